"""Full state dicts of a running plan: one path for every engine (runtime/engine.py).

trace -> cost -> solve -> plan -> **run**. Reading: every placed tensor an engine names
(``Engine.state_tensors``: DTensor shards of any layout, plain tensors) becomes a full CPU
tensor with DTensor's own ``full_tensor`` (a collective over the tensor's mesh), and the
pipeline stages' entries are gathered onto every rank. Writing: each rank cuts its own
shard out of the full tensor with ``distribute_tensor(..., src_data_rank=None)`` (no
communication) and copies it into the placed tensor in place; with ``broadcast_from_rank0``
rank 0 sends the names, shapes and dtypes in one message and then each tensor.

These are the calls ``torch.distributed.checkpoint.state_dict``'s full state dicts make
inside (``full_tensor`` to read; ``distribute_tensor`` or a slice of a broadcast tensor to
write); they are made here on the engine's tensors rather than through
``get_model_state_dict``/``set_model_state_dict``, which need one ``nn.Module`` holding every
parameter under the model's names: the graph engine's tensors live in a traced program's
dict (a tied weight under one of its names, ZeRO-1/2 masters beside), and a pipeline rank
holds only its stages' modules. ``names`` map the model's names to the engine's where a tied
weight has several (``aliases``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshplan.runtime.engine import DataError, collective_device
from meshplan.runtime.fused_parts import to_natural, to_permuted


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of a parameter or buffer -> all the names of that tensor (ties)."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _full(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return t.full_tensor().detach().cpu()
    return t.detach().to("cpu", copy=True)


def gather_stages(plan, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every pipeline stage's entries on every rank (each rank holds its own stages; the
    first rank of each stage's submesh sends them). Every rank of a one-stage plan has all."""
    if plan.num_stages == 1:
        return mine
    stage_size = len(plan.stages[0].devices)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine if dist.get_rank() % stage_size == 0 else {})
    out = dict(mine)
    for part in everyone:
        out.update(part)
    return out


def natural_rows(engine, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors of fused projections (runtime/fused_parts.py) back in the model's own
    row order."""
    fused = getattr(engine, "fused_rows", {})
    if not fused:
        return tensors
    return {k: to_natural(v, *fused[k]) if k in fused else v for k, v in tensors.items()}


@torch.no_grad()
def full_state_dict(engine, keys=None, names: Mapping[str, list[str]] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Full CPU tensors of every pipeline stage on every rank: under ``keys`` (each read from
    the first of its ``names`` this engine holds), or every name ``state_tensors`` gives."""
    engine.sync_weights()
    tensors = engine.state_tensors()
    mine: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name in sorted(tensors):  # full_tensor is a collective: one order on every rank
        t = tensors[name]
        if id(t) not in done:
            done[id(t)] = _full(t)
        mine[name] = done[id(t)]
    mine = gather_stages(engine.plan, natural_rows(engine, mine))
    if keys is None:
        return mine
    names = names or {}
    out = {}
    for key in keys:
        source = next((a for a in names.get(key, [key]) if a in mine), None)
        if source is not None:
            out[key] = mine[source]
    return out


@torch.no_grad()
def set_full(name: str, full: torch.Tensor, tensors: Mapping[str, torch.Tensor],
             names: Mapping[str, list[str]] | None = None) -> bool:
    """Write this rank's part of the full tensor ``full`` into the placed tensor of ``name``
    (or of another of its ``names``); False where another pipeline stage holds it."""
    target = next((tensors[a] for a in (names or {}).get(name, [name]) if a in tensors), None)
    if target is None:
        return False
    if tuple(full.shape) != tuple(target.shape):
        raise DataError(f"{name}: state has shape {list(full.shape)}, the model "
                        f"{list(target.shape)}; load the state of this model")
    if not isinstance(target, DTensor):
        target.copy_(full.to(target.device, target.dtype))
        return True
    part = distribute_tensor(full.to(target.device_mesh.device_type, target.dtype),
                             target.device_mesh, target.placements,
                             src_data_rank=None).to_local()
    target.to_local().copy_(part)
    return True


@torch.no_grad()
def load_full_state_dict(engine, state: Mapping[str, torch.Tensor] | None, *,
                         broadcast_from_rank0: bool = False,
                         names: Mapping[str, list[str]] | None = None,
                         check: Callable[[list[str]], None] | None = None) -> list[str]:
    """Set the engine's tensors from full tensors (every rank passes ``state``, or rank 0
    only with ``broadcast_from_rank0``); ``check(keys)`` runs on every rank before any tensor
    moves. Returns the keys loaded."""
    if broadcast_from_rank0:
        info = [[(k, tuple(v.shape), v.dtype) for k, v in sorted(state.items())]
                if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(info, src=0)
        entries = info[0]
    else:
        if state is None:
            raise DataError("load_full_state_dict(None): pass the state on every rank, or "
                            "broadcast_from_rank0=True with the state on rank 0")
        entries = [(k, None, None) for k in sorted(state)]
    keys = [k for k, _, _ in entries]
    if check is not None:
        check(keys)
    tensors = engine.state_tensors()
    _agree_on_shapes(entries, state, tensors, names)
    for key, shape, dtype in entries:
        full = state[key] if state is not None and key in state else None
        if broadcast_from_rank0:  # every rank takes part, whichever stage holds the tensor
            wire = full.to(collective_device()) if dist.get_rank() == 0 else \
                torch.empty(shape, dtype=dtype, device=collective_device())
            dist.broadcast(wire, src=0)
            full = wire
        fused = getattr(engine, "fused_rows", {}).get(key)
        if fused is not None and full is not None:
            full = to_permuted(full, *fused)
        set_full(key, full, tensors, names)
    engine.after_load({a for k in keys for a in (names or {}).get(k, [k])})
    return keys


def _agree_on_shapes(entries, state, tensors, names) -> None:
    """Refuse a state whose shapes differ from the model's on every rank at once, before any
    tensor moves: only the ranks of the stage holding a tensor can see its shape, and a
    refusal there alone would leave the other ranks waiting in the next broadcast."""
    wrong = []
    for key, shape, _ in entries:
        if shape is None:
            shape = tuple(state[key].shape)
        target = next((tensors[a] for a in (names or {}).get(key, [key]) if a in tensors), None)
        if target is not None and tuple(target.shape) != tuple(shape):
            wrong.append(f"{key}: state has shape {list(shape)}, the model "
                         f"{list(target.shape)}")
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, wrong)
    wrong = sorted({w for part in everyone for w in part})
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise DataError(f"{wrong[0]}{more}; load the state of this model")
