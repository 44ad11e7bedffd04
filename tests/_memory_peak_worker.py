"""Worker for tests/test_costmodel_engine.py's step-peak test (forked gloo ranks): a small
Llama written in plain PyTorch (benchmarks/gpu/model.py, the one-GPU check's model code)
trained in bf16 through ``meshplan.parallelize`` in a user's loop (AdamW, ``zero_grad``),
each rank passing only its own rows, with the step's peak of live tensors measured by
runtime/memory_probe.py (what ``meshplan run`` reports) beside the plan's predicted peak.
One rank: autocast (fp32 weights); two ranks: FSDP2 (ZeRO-3, bf16 weights)."""

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks", "gpu"))
import model as M  # noqa: E402

import meshplan  # noqa: E402
from meshplan.runtime.memory_probe import StepMemoryProbe  # noqa: E402

ROWS, SEQ, VOCAB = 4, 512, 2048  # rows per rank
SIZE = dict(vocab=VOCAB, dim=256, layers=4, heads=8, kv_heads=4, hidden=704, max_seq=SEQ)


def build():
    with torch.device("meta"):
        return M.Llama(**SIZE)


def case(microbatch_size: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    ids = torch.zeros(ROWS * world, SEQ, dtype=torch.long, device="meta")
    mesh = meshplan.Mesh.from_dict({"shape": [world], "hardware": "dgx-h100"})
    plan = meshplan.manual_plan(build(), mesh, (ids,), dp=world, zero=3 if world > 1 else 0,
                                dtype="bf16", microbatch_size=microbatch_size,
                                engine="modules")
    torch.manual_seed(0)
    run = meshplan.parallelize(build(), plan, init_weights=M.init_weights)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    peak = 0
    for step in range(3):  # the last step measured: the second step under FSDP2 measured 5% above the third (CI, 2x2)
        rows = torch.randint(0, VOCAB, (ROWS * world, SEQ), generator=gen)
        mine = rows[rank * ROWS:(rank + 1) * ROWS]
        state = list(run.parameters()) + [v for s in opt.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor) and v.dim() > 0]
        with StepMemoryProbe(state) as probe:  # the last step: after AdamW made its state
            run.train_step((mine,))
            opt.step()
            opt.zero_grad()
        peak = probe.peak_bytes
    p = plan.predicted
    return {"predicted": p.peak_memory_gib * 2**30, "measured": peak,
            "grads": p.memory.grads_gib * 2**30, "microbatches": plan.training.microbatches}


def main():
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    out = {f"{dist.get_world_size()}x{mbs}": case(mbs) for mbs in (ROWS // 2, ROWS)}
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
