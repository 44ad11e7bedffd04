"""Where a one-GPU step's memory peaks, forward or backward, eager or compiled: the step of
benchmarks/gpu_check.py (model.py's 0.9B Llama, 4 x 4096 tokens, bf16 autocast, AdamW) as
plain PyTorch and through ``meshplan.parallelize`` (plan_h100_mb4.json), each
``torch.Tensor.backward`` wrapped to read the allocator at the backward's start: the
forward's peak, what is allocated when the backward starts (the kept activations and the
loss), the backward's peak, and the optimizer's. Runs on the GPU machine from the repository
root with meshplan importable (as run_on_device.sh lays it out):
``PYTHONPATH=/tmp/mp_pkg:/tmp/mp_deps python3 benchmarks/gpu/memory_phases.py $OUT [RUN ...]``
after run_on_device.sh in the same call (runs: plain_eager, plain_compiled, meshplan_eager,
meshplan_compiled; default all; each engine in a process of its own); writes ``$OUT/memory_phases.json`` (kept as
benchmarks/results/memory_phases_h100.json)."""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
GIB = 2 ** 30


class Phases:
    """Wraps ``torch.Tensor.backward``: at its start, the forward's peak and the allocated
    bytes; at its end, the backward's peak; ``optimizer()`` after the optimizer step."""

    def __init__(self):
        self.rows: list[dict] = []
        self._orig = torch.Tensor.backward

    def __enter__(self):
        orig = self._orig
        rows = self.rows

        def backward(t, *args, **kwargs):
            torch.cuda.synchronize()
            row = {"forward_peak_gib": torch.cuda.max_memory_allocated() / GIB,
                   "at_backward_gib": torch.cuda.memory_allocated() / GIB}
            torch.cuda.reset_peak_memory_stats()
            out = orig(t, *args, **kwargs)
            torch.cuda.synchronize()
            row["backward_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
            rows.append(row)
            return out
        torch.Tensor.backward = backward
        return self

    def optimizer(self):
        torch.cuda.synchronize()
        if self.rows:
            self.rows[-1]["optimizer_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()

    def __exit__(self, *exc):
        torch.Tensor.backward = self._orig


def plain(compile_: bool, steps: int = 4) -> list[dict]:
    import gpu_check as G
    net, opt = G.plain_model(compile_)
    with Phases() as ph:
        for ids in [b.cuda() for b in G._batches(steps, 32000)]:
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = net(ids)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                     ids[:, 1:].flatten())
            del logits
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ph.optimizer()
    del net, opt
    torch.cuda.empty_cache()
    return ph.rows


def parallelized(compile_: bool, steps: int = 4) -> list[dict]:
    import gpu_check as G
    import model as M
    import torch.distributed as dist

    import meshplan
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
    name = torch.cuda.get_device_name(0)  # the plan made for this GPU (gpu_check.py make-plan)
    plan = meshplan.Plan.from_json(os.path.join(
        HERE, "plan_h200_mb4.json" if "H200" in name else "plan_h100_mb4.json"))
    torch.manual_seed(0)
    with torch.device("meta"):
        net = M.gpu_llama()
    run = meshplan.parallelize(net, plan, init_weights=M.init_weights, compile=compile_)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-4)
    with Phases() as ph:
        for ids in G._batches(steps, 32000):
            torch.cuda.reset_peak_memory_stats()
            run.train_step((ids.cuda(),))
            opt.step()
            opt.zero_grad()
            ph.optimizer()
    del run, net, opt
    torch.cuda.empty_cache()
    return ph.rows


def _one(out: str, keys: tuple[str, ...]) -> None:
    """The runs ``keys`` in this process, into ``$OUT/memory_phases_<first key>.json``."""
    res = {}
    for name, fn in (("plain", plain), ("meshplan", parallelized)):
        for compile_ in (False, True):
            key = f"{name}_{'compiled' if compile_ else 'eager'}"
            if key not in keys:
                continue
            try:
                res[key] = fn(compile_)
            except Exception as exc:  # one failure must not lose the other rows
                res[key] = {"error": repr(exc)[:400]}
            last = res[key][-1] if isinstance(res[key], list) and res[key] else res[key]
            print(key, last, flush=True)
    with open(os.path.join(out, f"memory_phases_{keys[0]}.json"), "w") as f:
        json.dump(res, f, indent=1)


def main(out: str, only: tuple[str, ...] = ()) -> None:
    """Each engine's eager and compiled runs in a process of their own (a run after another
    engine's compiled one reads more: benchmarks/results/gpu_check_h100.md), merged into
    ``$OUT/memory_phases.json``."""
    import subprocess
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "runs": {}}
    for group in (("plain_eager", "plain_compiled"), ("meshplan_eager", "meshplan_compiled")):
        keys = tuple(k for k in group if not only or k in only)
        if not keys:
            continue
        subprocess.run([sys.executable, os.path.abspath(__file__), out, "--one", *keys],
                       check=False)
        part = os.path.join(out, f"memory_phases_{keys[0]}.json")
        if os.path.exists(part):
            res["runs"].update(json.load(open(part)))
            os.remove(part)
        with open(os.path.join(out, "memory_phases.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--one":
        _one(sys.argv[1], tuple(sys.argv[3:]))
    else:
        main(sys.argv[1], tuple(sys.argv[2:]))
