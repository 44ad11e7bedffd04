"""Run a test file as its own torchrun worker (gloo, local processes) and load what it saved."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from meshplan.runtime.launch import free_port


def torchrun_results(script: str, out, nproc: int = 2, timeout: int = 300):
    """``torchrun --nproc_per_node nproc script out``; the workers save to ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--nnodes=1", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_backend=c10d",
           "--max_restarts=0", script, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)
