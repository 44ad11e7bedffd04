"""What the three examples share: start the process group, plan once, cut a rank's rows.

The training loop itself is written out in each example, as a user would write it.

Planning: rank 0 plans and writes plan.json, the other ranks wait at a barrier and read it
with ``Plan.from_json``. Every rank planning on its own would also work on one machine, but
the solver stops at a time limit (its answer can depend on how busy the machine is) and the
cost model reads this machine's calibration cache, so ranks on different nodes, or racing
each other for the same cores, could pick different plans; one planner also spends one core
instead of world-size cores. On several nodes, pass ``--plan-dir`` on a shared filesystem.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import meshplan


def parse_args(description: str, *, steps: int = 4, data: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    if data:
        p.add_argument("--data", default="", help="a flat uint16 token file (nanoGPT's "
                       "train.bin); default: a small random one in a temporary folder")
    p.add_argument("--steps", type=int, default=steps, help="training steps")
    p.add_argument("--check", action="store_true",
                   help="also train the same steps in plain PyTorch on rank 0 over the global "
                        "batch and assert that the losses are equal (rtol 1e-5)")
    p.add_argument("--plan-dir", default="",
                   help="where rank 0 writes plan.json (a shared filesystem on several nodes); "
                        "default: a fresh temporary folder")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed() -> None:
    """gloo under torchrun; ``python examples/X.py`` runs as a one-process group."""
    if "RANK" not in os.environ:  # not launched by torchrun: a world of one
        from meshplan.runtime.launch import free_port
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo")


def plan_on_rank0(model, *, plan_dir: str = "", **autoparallel_kwargs) -> meshplan.Plan:
    """Rank 0 runs ``meshplan.autoparallel`` on ``Mesh.local(world)`` and writes plan.json;
    every rank then reads that file (so all run the very same plan)."""
    rank = dist.get_rank()
    path = [None]
    if rank == 0:
        folder = plan_dir or tempfile.mkdtemp(prefix="meshplan-example-")
        os.makedirs(folder, exist_ok=True)
        plan = meshplan.autoparallel(model, meshplan.Mesh.local(dist.get_world_size()),
                                     **autoparallel_kwargs)
        path[0] = os.path.join(folder, "plan.json")
        plan.to_json(path[0])
        print(plan.summary(), flush=True)
    dist.broadcast_object_list(path, src=0)  # also the barrier: the file is written
    return meshplan.Plan.from_json(path[0])


def rows(x, run):
    """This data-parallel rank's rows of a global batch (a tensor, tuple or dict):
    rows [dp_rank * B / dp_size, (dp_rank + 1) * B / dp_size)."""
    if isinstance(x, dict):
        return {k: rows(v, run) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return tuple(rows(v, run) for v in x)
    n = x.shape[0] // run.dp_size
    return x[run.dp_rank * n:(run.dp_rank + 1) * n]


def mean_over_ranks(value: float) -> float:
    """The mean of a per-rank number (each data-parallel rank appears as often as the
    others, so this is the mean over data-parallel ranks)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def check_losses(losses, reference) -> None:
    """Rank 0: the plan's losses equal plain PyTorch's (rtol 1e-5)."""
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(reference, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    print("losses equal one process", flush=True)


def check_run(mine: dict, reference: dict) -> None:
    """Rank 0: the plan's run equals plain PyTorch's in one process, in what a loss under
    Adam cannot show: every step's loss and gradient norm (before clipping), the eval
    output, and every weight and buffer after the last step.

    Each is a dict with ``losses``, ``grad_norms``, ``eval`` (a tensor or None) and
    ``state`` (name -> tensor). Losses alone would pass a gradient twice too large: Adam
    divides it out of the update, and clipping hides it again."""
    close = torch.testing.assert_close
    close(torch.tensor(mine["losses"], dtype=torch.float64),
          torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-5, atol=1e-6,
          msg=lambda m: f"losses differ from one process: {m}")
    print("losses equal one process", flush=True)
    close(torch.tensor(mine["grad_norms"], dtype=torch.float64),
          torch.tensor(reference["grad_norms"], dtype=torch.float64), rtol=1e-4, atol=1e-6,
          msg=lambda m: f"gradient norms differ from one process: {m}")
    if mine["eval"] is not None:
        close(mine["eval"].double(), reference["eval"].double(), rtol=1e-4, atol=1e-5,
              msg=lambda m: f"eval outputs differ from one process: {m}")
    missing = sorted(set(reference["state"]) - set(mine["state"]))
    assert not missing, f"full_state_dict lacks {missing}"
    for name, ref in reference["state"].items():
        close(mine["state"][name].double(), ref.double(), rtol=1e-4, atol=1e-5,
              msg=lambda m, name=name: f"{name} differs from one process: {m}")
    print("gradient norms, eval outputs and weights equal one process", flush=True)


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)
