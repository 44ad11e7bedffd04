"""Global gradient-norm clipping for a running plan, over every rank and pipeline stage: the
one clipping every engine uses (runtime/engine.py).

trace -> cost -> solve -> plan -> **run**. ``torch.nn.utils.clip_grad_norm_`` sees the
gradients of one process; under a plan the gradients are DTensors (on a stage's mesh or a
submesh of it, some replicated over mesh axes, some sharded) or plain tensors replicated
over the stage, and a weight tied across pipeline stages holds the same (summed) gradient on
two rank groups. The global norm counts every element of the model's gradient once:

    ||g||_p^p = sum over pipeline rank groups s of ||g_s||_p^p

where ``g_s`` is what the optimizer steps on rank group ``s`` (``Engine.optimizer_params``,
ZeRO-1/2 masters included), less the tied gradients a lower group holds
(``Engine.tied_elsewhere``). Within a group, gradients on one DTensor layout are normed
together by torch's ``get_total_norm`` (a DTensor norm reduces over its mesh, each shard
once), plain tensors locally, and the layouts' norms combined; every rank of the group then
holds ``||g_s||``. One all-reduce over the world, to which the first rank of each group
adds ``||g_s||_p^p`` (the maximum for p = inf), gives the global norm; torch's
``clip_grads_with_norm_`` scales the gradients with it. Call after the engine's gradient
sync (``Optimizer.register_step_pre_hook`` is the place: meshplan/worker.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from meshplan.runtime.engine import collective_device


def _gradients(engine) -> list[torch.Tensor]:
    """The parameters whose gradients the optimizer will step (synced; a partial sum
    reduced to a replicated gradient first)."""
    params = []
    for p in engine.optimizer_params().values():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and any(isinstance(q, Partial) for q in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate() if isinstance(q, Partial) else q
                                                     for q in p.grad.placements])
        params.append(p)
    return params


def _group_norm(grads: list[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """The norm of this rank group's gradients (the same on each of its ranks)."""
    layouts: dict = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        layouts.setdefault(key, []).append(g)
    norms = []
    for same in layouts.values():
        norm = torch.nn.utils.get_total_norm(same, norm_type, foreach=False)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        norms.append(norm.to(device, torch.float64))
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


@torch.no_grad()
def total_norm(engine, norm_type: float = 2.0) -> float:
    """The norm of the whole model's gradient, the same on every rank (a collective)."""
    norm_type = float(norm_type)
    device = collective_device()
    skip = engine.tied_elsewhere()
    grads = [p.grad for p in _gradients(engine) if id(p) not in skip]
    local = _group_norm(grads, norm_type, device)
    plan = engine.plan
    first_of_group = dist.get_rank() % len(plan.stages[0].devices) == 0
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return float(local.item())
    power = local ** norm_type if first_of_group else torch.zeros_like(local)
    dist.all_reduce(power)
    return float(power.item() ** (1.0 / norm_type))


@torch.no_grad()
def clip_grad_norm_(engine, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient of ``engine`` in place so that the global norm is at most
    ``max_norm`` (torch.nn.utils' rule and epsilon); returns the global norm before."""
    norm = total_norm(engine, norm_type)
    params = _gradients(engine)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm), foreach=False)
    return norm
