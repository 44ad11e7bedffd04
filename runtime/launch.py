"""``meshplan run``: launch the plan's workers with torchrun and wait for them.

trace -> cost -> solve -> plan -> **run**. One worker process per device of the plan
(gloo on CPU, NCCL when CUDA devices exist). torchrun stops every worker when one fails and
exits non-zero, naming the failed rank.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from meshplan.plan import Plan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(plan_path: str, plan: Plan, *, model: str, steps: int, seed: int,
                     metrics_out: str = "", extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={plan.num_devices}",
           "--nnodes=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
           "--max_restarts=0", "-m", "meshplan.runtime.worker", "--plan", plan_path,
           "--model", model, "--steps", str(steps), "--seed", str(seed)]
    if metrics_out:
        cmd += ["--metrics-out", metrics_out]
    return cmd + list(extra)


def run_plan(plan_path: str, *, model: str, steps: int = 5, seed: int = 0,
             metrics_out: str = "", quiet_launcher: bool = True, timeout_s: float | None = None) -> int:
    """Run ``steps`` training steps of the plan in ``plan_path``; returns the exit code."""
    plan = Plan.from_json(plan_path)
    cmd = torchrun_command(plan_path, plan, model=model, steps=steps, seed=seed,
                           metrics_out=metrics_out)
    env = None
    if quiet_launcher:
        import os
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "TORCHELASTIC_ERROR_FILE": os.environ.get("TORCHELASTIC_ERROR_FILE", ""),
               "LOGLEVEL": "WARNING", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, env=env, timeout=timeout_s)
    return proc.returncode
