"""Runtime overhead: a meshplan-executed plan against the same parallelism written by hand.

trace -> cost -> solve -> plan -> **run**. On 4 local CPU processes (gloo) the same Llama
model trains with (a) 1-D tensor parallelism and (b) ZeRO-3, once executed by meshplan
(the plan's placements realised by the fx/DTensor executor, runtime/spmd.py) and once
written by hand with torch.distributed's own APIs (``parallelize_module`` with
ColwiseParallel / RowwiseParallel; ``fully_shard`` per block and at the root). The table
gives the median step time of each and their ratio (meshplan / hand-written).

    python benchmarks/runtime_overhead.py [--hidden 256 --layers 2 --batch 8 --seq 128]

The script relaunches itself under torchrun; results go to
benchmarks/results/runtime_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORLD = 4
RESULTS = Path(__file__).resolve().parent / "results"


def model_spec(args) -> str:
    return (f"transformers:llama?hidden_size={args.hidden}&intermediate_size={4 * args.hidden}"
            f"&num_hidden_layers={args.layers}&num_attention_heads={args.heads}"
            f"&num_key_value_heads={args.heads}&vocab_size={args.vocab}"
            f"&max_position_embeddings={max(args.seq, 128)}")


def timed_steps(step, steps: int, warmup: int) -> float:
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


MANUAL = {"tp": "dp=1,tp=4,mb=8", "zero3": "dp=4,zero=3,mb=2"}  # as `meshplan plan --manual`


def meshplan_step_time(args, variant: str) -> tuple[float, list[float]]:
    import torch

    from meshplan.cli import _manual
    from meshplan.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.planner.trace import trace
    from meshplan.runtime.parallelize import make_optimizer, parallelize
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    spec = parse_model_spec(model_spec(args))
    meta = spec.build(device="meta")
    graph = trace(meta, example_inputs(meta, args.batch, args.seq))
    plan = build_manual_plan(graph, Mesh.local(WORLD), **_manual(MANUAL[variant]))
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.steps + args.warmup)]
    pm = parallelize(model, plan, (batches[0],), lowered=args.executor == "lowered")
    opt = make_optimizer(pm.optimizer_params(), pm.plan)
    losses = []
    t = timed_steps(lambda i: losses.append(pm.train_step(batches[i], opt)), args.steps,
                    args.warmup)
    return t, losses


def handwritten_step_time(args, variant: str) -> tuple[float, list[float]]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from meshplan.planner.trace import TrainingModule
    from meshplan.specs import parse_model_spec, synthetic_batch

    torch.manual_seed(0)
    model = parse_model_spec(model_spec(args)).build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.steps + args.warmup)]
    mesh = init_device_mesh("cpu", (WORLD,))
    rank = dist.get_rank()
    if variant == "tp":  # Megatron: column-parallel q/k/v/gate/up, row-parallel o/down
        style = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                 "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                 "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                 "mlp.down_proj": RowwiseParallel()}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, style)
        local = lambda b: b  # noqa: E731 - every rank sees the whole batch
    else:  # zero3: fully_shard each block, then the root
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        per = args.batch // WORLD
        local = lambda b: b[rank * per:(rank + 1) * per]  # noqa: E731
    step_fn = TrainingModule(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    losses = []

    def step(i):
        loss = step_fn(local(batches[i]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return timed_steps(step, args.steps, args.warmup), losses


def worker(args) -> None:
    import logging

    import torch.distributed as dist

    for name in ("torch.distributed.tensor._redistribute", "torch._logging._internal"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    rows = []
    for variant in ("tp", "zero3"):
        args.executor = "lowered"
        ours, our_losses = meshplan_step_time(args, variant)
        theirs, their_losses = handwritten_step_time(args, variant)
        args.executor = "dtensor"
        reference, _ = meshplan_step_time(args, variant)
        rows.append({"config": variant, "plan": MANUAL[variant], "meshplan_ms": ours * 1e3,
                     "handwritten_ms": theirs * 1e3, "ratio": ours / theirs,
                     "dtensor_executor_ms": reference * 1e3,
                     "dtensor_ratio": reference / theirs,
                     "meshplan_first_loss": our_losses[0],
                     "handwritten_first_loss": their_losses[0]})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    RESULTS.mkdir(exist_ok=True)
    raw = RESULTS / "runtime_overhead.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
           "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
           "--max_restarts=0", __file__, *sys.argv[1:], "--out", str(raw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "LOGLEVEL": "WARNING"}
    subprocess.run(cmd, env=env, check=True)
    rows = json.loads(raw.read_text())
    setup = (f"Llama hidden={args.hidden} layers={args.layers} heads={args.heads} "
             f"vocab={args.vocab}, batch {args.batch} x seq {args.seq}, fp32, Adam, "
             f"{WORLD} CPU processes (gloo), median of {args.steps} steps after {args.warmup}")
    lines = ["# Runtime overhead: meshplan vs hand-written torch.distributed", "", setup, "",
             "meshplan runs the plan `meshplan plan --manual ...` writes, with the lowered "
             "program (runtime/lowering.py); the last columns run the same plan with every "
             "operator on DTensor (the reference executor, `parallelize(..., lowered=False)`).",
             "",
             "| config | plan | meshplan ms | hand-written ms | ratio | DTensor executor ms "
             "| its ratio | first loss (meshplan / hand) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | `{r['plan']}` | {r['meshplan_ms']:.1f} | "
                     f"{r['handwritten_ms']:.1f} | {r['ratio']:.2f} | "
                     f"{r['dtensor_executor_ms']:.1f} | {r['dtensor_ratio']:.2f} | "
                     f"{r['meshplan_first_loss']:.5f} / {r['handwritten_first_loss']:.5f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "runtime_overhead.md").write_text(text)
    raw.write_text(json.dumps({"setup": setup, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
