"""``meshplan run``: launch the plan's workers with torchrun's launcher and wait for them.

trace -> cost -> solve -> plan -> **run**. One worker process per device of the plan (gloo
on CPU, NCCL when CUDA devices exist), started by torchrun's own elastic launcher
(``torch.distributed.launcher.api.elastic_launch``, what the ``torchrun`` command runs) with
``max_restarts=0``: when one worker dies the agent stops the others at once, and the
launcher's structured failure report gives the failed rank, which ``meshplan run`` prints in
one line before exiting non-zero. A worker that hangs instead of dying is caught by the
process-group timeout (``--timeout-s``), which makes its peers fail.

Many machines: every node runs ``meshplan run`` (or the printed torchrun command) with the
same ``--nnodes`` and ``--rdzv-endpoint``; torchrun's c10d rendezvous, hosted by node rank 0,
gathers them. Each node's processes get a contiguous block of global ranks (the plan's
mesh axis 0 crosses nodes); which node gets which block is the rendezvous's choice.
``torchrun_command`` gives the equivalent shell command, ``slurm_script`` an sbatch script.

Ctrl-C: the agent turns SIGINT into ``SignalException`` and sends SIGINT to the workers,
which die at once (meshplan/worker.py restores the default action); we print one line.
"""

from __future__ import annotations

import logging
import os
import shlex
import socket
import sys
import uuid
from dataclasses import dataclass

from meshplan.errors import SpecError
from meshplan.plan import Plan

TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # what `torchrun` runs
EXIT_RANK_FAILED = 1
EXIT_USER_ERROR = 2  # a worker's MeshplanError (meshplan/worker.py), as the CLI's own
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
DEFAULT_PORT = 29500  # torchrun's default rendezvous port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class Nodes:
    """Where the workers run: ``nnodes`` nodes of ``nproc_per_node`` processes."""

    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int = 0  # 0: the plan's devices / nnodes
    rdzv_endpoint: str = ""  # HOST:PORT; "" on one node: a free local port
    rdzv_id: str = "meshplan"

    def resolve(self, plan: Plan, *, need_endpoint: bool = True) -> "Nodes":
        """Check against the plan and fill in the defaults; SpecError names what is wrong.
        ``need_endpoint=False``: the endpoint is found later (SLURM's first node)."""
        devices = plan.num_devices
        if self.nnodes < 1:
            raise SpecError(f"--nnodes {self.nnodes}: need at least 1 node")
        if not 0 <= self.node_rank < self.nnodes:
            raise SpecError(f"--node-rank {self.node_rank} is out of range for --nnodes "
                            f"{self.nnodes}; use 0..{self.nnodes - 1}")
        nproc = self.nproc_per_node
        if nproc == 0:
            if devices % self.nnodes:
                divisors = [n for n in range(1, devices + 1) if devices % n == 0]
                raise SpecError(f"--nnodes {self.nnodes} does not divide the plan's {devices} "
                                f"devices; use --nnodes in {divisors} (or --nproc-per-node)")
            nproc = devices // self.nnodes
        if nproc < 1 or nproc * self.nnodes != devices:
            raise SpecError(f"--nnodes {self.nnodes} x --nproc-per-node {nproc} = "
                            f"{self.nnodes * nproc} processes, but the plan has {devices} "
                            "devices; make the product equal")
        endpoint = self.rdzv_endpoint
        if endpoint:
            parse_endpoint(endpoint)
        elif self.nnodes > 1 and need_endpoint:
            raise SpecError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, a "
                            "host:port on node rank 0 that every node can reach")
        return Nodes(self.nnodes, self.node_rank, nproc, endpoint, self.rdzv_id)

    def endpoint_or_local(self) -> str:
        return self.rdzv_endpoint or f"127.0.0.1:{free_port()}"


def parse_endpoint(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(f"--rdzv-endpoint {text!r} is not HOST:PORT with PORT in 1..65535; "
                        f"e.g. node0.cluster:{DEFAULT_PORT}")
    return host.strip("[]"), int(port)


def check_resolvable(endpoint: str) -> None:
    """The rendezvous host resolves (else torch's c10d store retries for a minute and more,
    printing C++ warnings, before it gives up)."""
    host, port = parse_endpoint(endpoint)
    try:
        socket.getaddrinfo(host, port)
    except (socket.gaierror, UnicodeError) as exc:
        why = getattr(exc, "strerror", None) or str(exc)
        raise SpecError(f"--rdzv-endpoint {endpoint}: host {host!r} does not resolve ({why}); "
                        "check the name, or give node rank 0's IP address") from None


def worker_args(plan_path: str, *, model: str, steps: int, seed: int, metrics_out: str = "",
                extra: tuple[str, ...] = ()) -> list[str]:
    args = ["-m", "meshplan.worker", "--plan", plan_path, "--model", model,
            "--steps", str(steps), "--seed", str(seed)]
    if metrics_out:
        args += ["--metrics-out", metrics_out]
    return args + list(extra)


def torchrun_command(plan_path: str, plan: Plan, *, model: str, steps: int, seed: int,
                     metrics_out: str = "", extra: tuple[str, ...] = (),
                     nodes: Nodes = Nodes()) -> list[str]:
    """The torchrun command line for one node that does what ``run_plan`` does in-process."""
    nodes = nodes.resolve(plan)
    # this interpreter's torchrun, by absolute path: a bare `torchrun` is "command not
    # found" (exit 127) wherever the virtual environment is not on PATH
    cmd = [*TORCHRUN, f"--nnodes={nodes.nnodes}", f"--nproc-per-node={nodes.nproc_per_node}",
           f"--node-rank={nodes.node_rank}", "--rdzv-backend=c10d",
           f"--rdzv-endpoint={nodes.endpoint_or_local()}", f"--rdzv-id={nodes.rdzv_id}",
           "--max-restarts=0"]
    if nodes.nnodes > 1:
        cmd.append(f"--rdzv-conf=is_host={int(nodes.node_rank == 0)}")
    return cmd + worker_args(os.path.abspath(plan_path), model=model, steps=steps, seed=seed,
                             metrics_out=metrics_out, extra=extra)


def slurm_script(plan_path: str, plan: Plan, *, model: str, steps: int, seed: int,
                 metrics_out: str = "", extra: tuple[str, ...] = (),
                 nodes: Nodes = Nodes()) -> str:
    """An sbatch script: one task per node, each running torchrun; the rendezvous is hosted on
    the first node of $SLURM_JOB_NODELIST (c10d finds it by host name)."""
    nodes = nodes.resolve(plan, need_endpoint=False)
    port = parse_endpoint(nodes.rdzv_endpoint)[1] if nodes.rdzv_endpoint else DEFAULT_PORT
    worker = worker_args(os.path.abspath(plan_path), model=model, steps=steps, seed=seed,
                         metrics_out=metrics_out and os.path.abspath(metrics_out), extra=extra)
    gpus = f"#SBATCH --gpus-per-node={nodes.nproc_per_node}\n" \
        if "cpu" not in str(plan.mesh.hardware.get("device", {}).get("name", "cpu")).lower() \
        else ""
    return f"""#!/bin/bash
# written by `meshplan run --slurm`: {plan.num_devices} devices, {nodes.nnodes} nodes
#SBATCH --job-name=meshplan
#SBATCH --nodes={nodes.nnodes}
#SBATCH --ntasks-per-node=1
{gpus}set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # reads all: no SIGPIPE under pipefail
export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-1}}
srun {shlex.join(TORCHRUN)} --nnodes={nodes.nnodes} --nproc-per-node={nodes.nproc_per_node} \\
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:{port}" --rdzv-id="$SLURM_JOB_ID" \\
    --max-restarts=0 \\
    {shlex.join(worker)}
"""


def run_plan(plan_path: str, *, model: str, steps: int = 5, seed: int = 0,
             metrics_out: str = "", extra: tuple[str, ...] = (), quiet_launcher: bool = True,
             nodes: Nodes = Nodes()) -> int:
    """Run ``steps`` training steps of the plan in ``plan_path`` on this node; returns the exit
    code (0, 1 when a rank failed, 130 when interrupted).

    ``extra`` passes more worker options (``--checkpoint-dir``, ``--timeout-s``, ...)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    plan = Plan.from_json(plan_path)
    nodes = nodes.resolve(plan)
    if nodes.rdzv_endpoint:
        check_resolvable(nodes.rdzv_endpoint)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # workers inherit the launcher's environment
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if quiet_launcher:  # the agent logs every start and stop; we print one line on failure
        _quiet("torch.distributed.elastic")
    many = nodes.nnodes > 1
    config = LaunchConfig(min_nodes=nodes.nnodes, max_nodes=nodes.nnodes,
                          nproc_per_node=nodes.nproc_per_node,
                          run_id=nodes.rdzv_id if many else f"meshplan-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint=nodes.endpoint_or_local(),
                          rdzv_configs={"is_host": nodes.node_rank == 0} if many else {},
                          max_restarts=0, monitor_interval=0.1)
    args = worker_args(plan_path, model=model, steps=steps, seed=seed,
                       metrics_out=metrics_out, extra=extra)
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as exc:
        user = user_error(exc)
        if user:  # a check a worker made (one line for all ranks, as the CLI's own checks)
            print(f"meshplan run: error: {user}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR
        print(f"meshplan run: error: {failure_line(exc)}", file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    except RendezvousError as exc:
        cause = exc.__cause__ or exc
        print(f"meshplan run: error: rendezvous at {config.rdzv_endpoint} failed "
              f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}); "
              "start node rank 0 first and check that every node can reach the endpoint",
              file=sys.stderr, flush=True)
        return EXIT_RANK_FAILED
    except (SignalException, KeyboardInterrupt):
        print("meshplan run: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def _quiet(prefix: str) -> None:
    """Silence ``prefix`` and its existing child loggers (torch's elastic loggers set their
    own level, so the parent's level alone does not reach them)."""
    for name in [prefix, *logging.root.manager.loggerDict]:
        if name.startswith(prefix):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def user_error(exc) -> str:
    """The message of the earliest worker that exited with EXIT_USER_ERROR after writing it
    to torchelastic's error file (meshplan/worker.py ``report_user_error``); "" if none."""
    told = [(f.timestamp, rank, f.message) for rank, f in exc.failures.items()
            if f.exitcode == EXIT_USER_ERROR and isinstance(f.message, str) and f.message
            and f.error_file_data.get("meshplan")]
    return min(told)[2] if told else ""


def failure_line(exc) -> str:
    """One line naming the first failed rank, its exit code or signal, and the others'."""
    rank, failure = exc.get_first_failure()
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else \
        f"exit code {failure.exitcode}"
    others = sorted(r for r in exc.failures if r != rank)
    tail = f"; ranks {others} also failed" if others else ""
    return (f"rank {rank} failed ({how}){tail}; every other rank was stopped. "
            f"See rank {rank}'s output above for its error.")
