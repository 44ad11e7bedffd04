"""Run a test's worker on local gloo processes and load what it saved.

Two launchers with one calling convention (the workers read RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT as torchrun sets them and save to ``out``):

- ``torchrun_results``: ``python -m torch.distributed.run`` as users launch, for the tests
  whose subject is the launch itself (several nodes, the CLI, the examples).
- ``forked_results``: the same workers forked from one server process that imported torch,
  transformers and meshplan once for the whole session (multiprocessing's forkserver).
  Each torchrun launch pays those imports again in every process (about 15-20 s of a
  2-core machine per 4-process launch); the workers' code, process groups and
  collectives are the same.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import runpy
import subprocess
import sys
import time

import torch

from meshplan.runtime.launch import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the repository
_PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.pipelining",
            "torch.distributed.fsdp", "transformers", "meshplan", "meshplan.runtime.graph.parallelize",
            "meshplan.runtime.modules", "meshplan.runtime.graph.pipeline",
            "meshplan.runtime.module_pipeline", "meshplan.api",
            # the model code most workers build (the first HF model a process builds imports
            # modeling_utils and generation: about 0.8 s of a quiet core, per rank)
            "transformers.modeling_utils", "transformers.models.gpt2.modeling_gpt2",
            "transformers.models.llama.modeling_llama"]


def torchrun_results(script: str, out, nproc: int = 2, timeout: int = 300):
    """``torchrun --nproc_per_node nproc script out``; the workers save to ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--nnodes=1", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_backend=c10d",
           "--max_restarts=0", script, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out)


_CONTEXT = None


def _context():
    """The session's forkserver, its imports done once (started on first use)."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _CONTEXT = ctx
    return _CONTEXT


def _worker(rank: int, nproc: int, port: int, target: str, is_module: bool, argv: list,
            cwd: str, env: dict, log: str) -> None:
    """One rank, in a process forked from the server: set the environment torchrun sets,
    send stdout/stderr to ``log``, and run ``target`` as ``__main__``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    os.chdir(cwd)
    code = 0
    profile = None
    if env.get("MESHPLAN_PROFILE_DIR"):  # a developer's profile of every rank (DEVELOPING.md)
        import cProfile
        profile = cProfile.Profile()
        profile.enable()
    try:
        if is_module:
            sys.argv = [target, *argv]
            sys.path[:0] = [cwd]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *argv]
            sys.path[:0] = [str(pathlib.Path(target).parent)]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the parent reads the log
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        if profile is not None:
            profile.disable()
            os.makedirs(env["MESHPLAN_PROFILE_DIR"], exist_ok=True)
            name = target if is_module else pathlib.Path(target).stem
            profile.dump_stats(os.path.join(env["MESHPLAN_PROFILE_DIR"],
                                            f"{name}-{nproc}procs-rank{rank}.prof"))
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # as a torchrun worker ends: no interpreter teardown of the process group


def forked_run(target: str, argv: list, nproc: int, timeout: int, logdir, *,
               module: bool = False, cwd=None, env: dict | None = None) -> str:
    """Run ``target`` (a script path, or a module name with ``module=True``) on ``nproc``
    forked gloo ranks; returns rank 0's output, raises AssertionError with every failing
    rank's output tail if a rank fails or the launch passes ``timeout`` seconds."""
    ctx = _context()
    logdir = pathlib.Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING",
           "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
    port = free_port()
    logs = [str(logdir / f"rank{r}.log") for r in range(nproc)]
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, str(target), module, list(argv),
                                               str(cwd or ROOT), env, logs[r]), daemon=True)
             for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if now > deadline:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = now  # a rank failed: give the others a moment to report theirs
            if failed_at is not None and now - failed_at > 20:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()

    def tail(r: int, n: int = 4000) -> str:
        text = pathlib.Path(logs[r]).read_text(errors="replace") if os.path.exists(logs[r]) else ""
        return text[-n:]
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        timed_out = time.monotonic() > deadline
        report = [f"launch of {target} on {nproc} forked ranks "
                  f"{'ran past %d s' % timeout if timed_out else 'failed'}: exit codes {codes}"]
        for r, c in enumerate(codes):
            if c != 0:
                report.append(f"--- rank {r} (exit {c}) ---\n{tail(r)}")
        raise AssertionError("\n".join(report))
    return tail(0, 10**7)


def forked_results(script: str, out, nproc: int = 2, timeout: int = 300):
    """``forked_run(script, [out])`` on ``nproc`` ranks; loads what the workers saved."""
    out = pathlib.Path(out)
    forked_run(script, [str(out)], nproc, timeout, out.parent / f"{out.stem}-logs")
    return torch.load(out)
