"""Where a graph-engine pipeline step spends its time, against the hand-written pipeline.

trace -> cost -> solve -> plan -> **run**. The dp2 x pp2 row of benchmarks/runtime_overhead.py
(same model, plan and hand-written code, imported from it), stepped in alternating pairs
on 4 local gloo processes, with wall-clock timers around the phases of a step: the
schedule (``PipelineScheduleSingle.step``), each stage's forward and backward of a
microbatch (``forward_one_chunk``, ``backward_one_chunk``), meshplan's gradient sync
(``PipelineModel._finish_grads``), the parameter leaves' post-accumulate hooks
(``leaf_hooks``: moving each local gradient into its DTensor parameter's ``.grad``,
runtime/graph/lowering.py ``ParamLeaves``) and the optimizer steps. The step-level ratio is noisy
on a shared 2-core machine (+-4% run to run); the phases say which part differs.
``--hand-sends-ids`` adds a third step: the hand-written pipeline whose stage 0 also sends
the token ids to the last stage, as meshplan's does for the loss in its graph, so the cost
of that send shows as "hand+ids" against "hand". ``--loss-first`` adds meshplan's step as it
was before 2026-11-25 ("loss-first"): the loss summed over all ranks before the optimizer
step instead of after it (``PipelineModel.train_step``), on the same engine and optimizer.

    python benchmarks/pipeline_phases.py [--pairs 30] [--hand-sends-ids] [--loss-first]

Prints one line per rank: milliseconds per step of each phase (sums over the step).
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 3


def _timed(acc, cls, meth: str, key: str) -> None:
    orig = getattr(cls, meth)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
    setattr(cls, meth, wrapper)


def _timed_hooks(acc) -> None:
    """Time every post-accumulate hook the lowered program's parameter leaves register."""
    from meshplan.runtime.graph import lowering

    make = lowering._grad_to_param

    def timed_make(ref, spec):
        hook = make(ref, spec)

        def timed(leaf):
            start = time.perf_counter()
            try:
                return hook(leaf)
            finally:
                acc["leaf_hooks"] += time.perf_counter() - start
        return timed
    lowering._grad_to_param = timed_make


def _loss_first(step):
    """meshplan's pipeline step with the loss summed over every rank before the optimizer
    step (``forward_backward`` then the optimizer), the order before 2026-11-25."""
    pm, opt, batches = step.engine, step.optimizer, step.batches

    def run(i):
        pm.forward_backward(batches[i])
        pm.optimizer_step(opt)
    return run


def worker(pairs: int, hand_sends_ids: bool, loss_first: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules, stage

    import runtime_overhead as ro
    from meshplan.runtime.graph import optim, pipeline

    acc: dict = collections.defaultdict(float)
    for cls, meth, key in ((stage._PipelineStageBase, "forward_one_chunk", "forward"),
                           (stage._PipelineStageBase, "backward_one_chunk", "backward"),
                           (schedules.PipelineScheduleSingle, "step", "schedule"),
                           (pipeline.PipelineModel, "_finish_grads", "grad_sync"),
                           (optim.LocalShardAdam, "step", "optimizer"),
                           (torch.optim.Adam, "step", "optimizer")):
        _timed(acc, cls, meth, key)
    _timed_hooks(acc)
    args = argparse.Namespace(hidden=256, heads=4, layers=2, vocab=1024, batch=8, seq=128,
                              steps=pairs + WARMUP, warmup=WARMUP)
    dist.init_process_group("gloo")
    steps = {"meshplan": ro.meshplan_step(args, "pipeline", lowered=True)[0],
             "hand": ro.handwritten_pipeline_step(args)[0]}
    if loss_first:
        steps["loss-first"] = _loss_first(steps["meshplan"])
    if hand_sends_ids:
        steps["hand+ids"] = ro.handwritten_pipeline_step(args, send_ids=True)[0]
    total = {name: collections.defaultdict(float) for name in steps}

    def phased(name, step):  # the phases of each step after the warmup, summed
        calls = [0]

        def run(i):
            acc.clear()
            step(i)
            calls[0] += 1
            if calls[0] > WARMUP:
                for key, value in acc.items():
                    total[name][key] += value
        return run
    times = ro.alternating_times({name: phased(name, step) for name, step in steps.items()},
                                 pairs, WARMUP)
    for name, ts in times.items():
        total[name]["step"] = sum(ts)
    line = " | ".join(f"{name}: " + " ".join(f"{k}={v / pairs * 1e3:.1f}"
                                             for k, v in sorted(t.items()))
                      for name, t in total.items())
    for rank in range(dist.get_world_size()):
        dist.barrier()
        if rank == dist.get_rank():
            print(f"rank {rank} (ms per step) {line}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--hand-sends-ids", action="store_true",
                    help="also time the hand-written pipeline sending the token ids on")
    ap.add_argument("--loss-first", action="store_true",
                    help="also time meshplan's step with the loss summed before the optimizer")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args.pairs, args.hand_sends_ids, args.loss_first)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--nnodes=1",
           "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--max_restarts=0",
           __file__, "--pairs", str(args.pairs)] + \
        (["--hand-sends-ids"] if args.hand_sends_ids else []) + \
        (["--loss-first"] if args.loss_first else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "LOGLEVEL": "WARNING"}
    return subprocess.run(cmd, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
