"""The torchrun worker behind ``meshplan run``: load a plan, build the model, train N steps.

trace -> cost -> solve -> plan -> **run**. Every rank builds the same initial weights from
``--seed`` (whatever the plan) and draws the same synthetic global batch per step, so the
losses of two plans are comparable. Rank 0 prints loss and time per step and writes the
metrics file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

from meshplan.errors import MeshplanError
from meshplan.plan import Plan, atomic_write
from meshplan.runtime.parallelize import make_optimizer, parallelize
from meshplan.specs import parse_model_spec, synthetic_batch


def _rss_gib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="meshplan-worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--metrics-out", default="")
    args = ap.parse_args(argv)

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        plan = Plan.from_json(args.plan)
        spec = parse_model_spec(args.model)
        torch.manual_seed(args.seed)
        model = spec.build(device="cpu")
        batch0 = synthetic_batch(model, plan.training.global_batch, plan.training.seq_len,
                                 seed=args.seed, step=0)
        rss_before = _rss_gib()
        pm = parallelize(model, plan, (batch0,))
        optimizer = make_optimizer(pm.unique_params(), plan, lr=args.lr)
        losses, times = [], []
        for step in range(args.steps):
            batch = synthetic_batch(model, plan.training.global_batch, plan.training.seq_len,
                                    seed=args.seed, step=step)
            dist.barrier()
            start = time.perf_counter()
            loss = pm.train_step(batch, optimizer)
            dist.barrier()
            elapsed = time.perf_counter() - start
            losses.append(loss)
            times.append(elapsed)
            if rank == 0:
                print(f"step {step}: loss {loss:.6f}  time {elapsed * 1e3:.1f} ms", flush=True)
        peak = torch.tensor([_rss_gib() - rss_before], dtype=torch.float64)
        gathered = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, peak)
        if rank == 0:
            measured = sorted(times[1:] or times)[len(times[1:] or times) // 2]
            metrics = {
                "model": args.model, "plan_fingerprint": plan.model.fingerprint,
                "world_size": dist.get_world_size(), "seed": args.seed, "losses": losses,
                "step_time_s": times, "measured_step_time_s": measured,
                "predicted_step_time_s": plan.predicted.step_time_s,
                "predicted_peak_memory_gib": plan.predicted.peak_memory_gib,
                "peak_memory_gib_per_rank": [float(g.item()) for g in gathered],
                "memory_measure": "peak RSS growth from model build to the end of training",
            }
            print(f"predicted step time {plan.predicted.step_time_s * 1e3:.1f} ms, measured "
                  f"{measured * 1e3:.1f} ms (median of steps after the first)", flush=True)
            if args.metrics_out:
                atomic_write(args.metrics_out, json.dumps(metrics, indent=1) + "\n")
    except MeshplanError as exc:
        print(f"meshplan run (rank {rank}): {exc}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        return 2
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
