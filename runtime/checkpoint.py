"""Sharded checkpoints of a running plan with torch.distributed.checkpoint (DCP).

trace -> cost -> solve -> plan -> **run**. A checkpoint holds what a resumed run needs to
continue with exactly the losses of an uninterrupted one: every parameter (DTensor shards,
each rank writes its own) and buffer (BatchNorm's running statistics), the optimizer state per parameter (moments and step counts, in
the placements of what the optimizer steps: the parameter, or its ZeRO-1/2 master shard)
and the step counter. Data needs no state: the batch of step ``s`` is a function of
(seed, s) (meshplan/specs.py ``synthetic_batch``).

Layout: ``DIR/step_000004/`` is the DCP checkpoint written after 4 steps; a checkpoint
becomes visible only when complete (written to a temporary name, renamed by rank 0 after a
barrier), so a run killed while saving leaves the previous one intact.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshplan.errors import PlanFileError

_STEP_DIR = re.compile(r"^step_(\d{6})$")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:06d}")


def latest_step(directory: str) -> int | None:
    """The step of the newest complete checkpoint in ``directory`` (None when there is none)."""
    if not directory or not os.path.isdir(directory):
        return None
    steps = [int(m.group(1)) for name in os.listdir(directory) if (m := _STEP_DIR.match(name))]
    return max(steps) if steps else None


def _optimizer_state(pm, optimizer) -> dict:
    """Optimizer state by parameter name (DCP needs stable keys, not param ids)."""
    out = {}
    for fqn, p in pm.optimizer_params().items():
        out[fqn] = optimizer.state[p]
    return out


def _materialise_optimizer_state(pm, optimizer) -> None:
    """Create every state tensor (Adam's moments, SGD's momentum) so DCP can load into it:
    one step with zero gradients, which leaves the parameters unchanged (Adam's update is
    m / (sqrt(v) + eps) = 0; SGD's momentum update is 0)."""
    params = list(pm.optimizer_params().values())
    if all(optimizer.state.get(p) for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state_dict(pm, optimizer, step: int) -> dict:
    """Parameters (or their ZeRO-1/2 master shards), buffers (running statistics), optimizer
    state and the step; DCP loads into these tensors in place."""
    return {"model": {**pm.named_buffers(), **pm.optimizer_params()},
            "optim": _optimizer_state(pm, optimizer), "step": torch.tensor(step, dtype=torch.int64)}


def save(directory: str, pm, optimizer, step: int) -> str:
    """Write the checkpoint after ``step`` steps; returns its path."""
    final = checkpoint_path(directory, step)
    tmp = final + ".partial"
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(state_dict(pm, optimizer, step), checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(directory: str, pm, optimizer, step: int | None = None) -> int:
    """Load the newest (or the given) checkpoint into ``pm`` and ``optimizer`` in place;
    returns the number of steps it had completed. Master shards (ZeRO-1/2) are loaded and
    the parameters gathered from them."""
    step = latest_step(directory) if step is None else step
    if step is None:
        raise PlanFileError(f"no checkpoint in {directory}; run with --checkpoint-every K "
                            "first, or drop --resume")
    _materialise_optimizer_state(pm, optimizer)
    state = state_dict(pm, optimizer, 0)
    dcp.load(state, checkpoint_id=checkpoint_path(directory, step))
    if hasattr(pm, "gather_masters"):  # ZeRO-1/2: parameters from their loaded master shards
        pm.gather_masters()
    return int(state["step"].item())
