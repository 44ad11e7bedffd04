"""``meshplan run``: launch the plan's workers with torchrun's launcher and wait for them.

trace -> cost -> solve -> plan -> **run**. One worker process per device of the plan (gloo
on CPU, NCCL when CUDA devices exist), started by torchrun's own elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what the ``torchrun`` command runs) with
``max_restarts=0``: when one worker dies the agent stops the others at once, and the
launcher's structured failure report gives the failed rank, which ``meshplan run`` prints in
one line before exiting non-zero. A worker that hangs instead of dying is caught by the
process-group timeout (``--timeout-s``), which makes its peers fail.

``torchrun_command`` gives the equivalent shell command for running a plan by hand.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import uuid

from meshplan.plan import Plan

EXIT_RANK_FAILED = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(plan_path: str, *, model: str, steps: int, seed: int, metrics_out: str = "",
                extra: tuple[str, ...] = ()) -> list[str]:
    args = ["-m", "meshplan.runtime.worker", "--plan", plan_path, "--model", model,
            "--steps", str(steps), "--seed", str(seed)]
    if metrics_out:
        args += ["--metrics-out", metrics_out]
    return args + list(extra)


def torchrun_command(plan_path: str, plan: Plan, *, model: str, steps: int, seed: int,
                     metrics_out: str = "", extra: tuple[str, ...] = ()) -> list[str]:
    """The torchrun command line that runs the plan (what ``run_plan`` does in-process)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={plan.num_devices}",
            "--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
            "--max_restarts=0"] + worker_args(plan_path, model=model, steps=steps, seed=seed,
                                               metrics_out=metrics_out, extra=extra)


def run_plan(plan_path: str, *, model: str, steps: int = 5, seed: int = 0,
             metrics_out: str = "", extra: tuple[str, ...] = (), quiet_launcher: bool = True) -> int:
    """Run ``steps`` training steps of the plan in ``plan_path``; returns the exit code.

    ``extra`` passes more worker options (``--checkpoint-dir``, ``--timeout-s``, ...)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    plan = Plan.from_json(plan_path)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers inherit the launcher's environment
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if quiet_launcher:  # the agent logs every start and stop; we print one line on failure
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=plan.num_devices,
                          run_id=f"meshplan-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
                          monitor_interval=0.1)
    args = worker_args(plan_path, model=model, steps=steps, seed=seed,
                       metrics_out=metrics_out, extra=extra)
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as exc:
        print(f"meshplan run: error: {failure_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    return 0


def failure_line(exc) -> str:
    """One line naming the first failed rank, its exit code or signal, and the others'."""
    rank, failure = exc.get_first_failure()
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else \
        f"exit code {failure.exitcode}"
    others = sorted(r for r in exc.failures if r != rank)
    tail = f"; ranks {others} also failed" if others else ""
    return (f"rank {rank} failed ({how}){tail}; every other rank was stopped. "
            f"See rank {rank}'s output above for its error.")
