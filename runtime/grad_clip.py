"""Global gradient-norm clipping for a running plan, over every rank and pipeline stage.

trace -> cost -> solve -> plan -> **run**. ``torch.nn.utils.clip_grad_norm_`` sees the
gradients of one process; under a plan the gradients are DTensors on each stage's submesh,
some replicated over mesh axes, some sharded, and a tied parameter read by two pipeline
stages holds the same (summed) gradient on both rank groups. The global norm counts every
element of the model's gradient exactly once:

    ||g||_p^p = sum over ranks r, over parameters x on r, counted(r, x): ||local(x.grad)||_p^p

where a local shard is counted on the rank whose coordinate is 0 along every mesh axis on
which the gradient is replicated, and a tied gradient only on its lowest rank group. One
all-reduce over the world sums (or, for p = inf, takes the max of) the partial norms; the
scaling multiplies the local shards in place, with torch.nn.utils' rule. Works for
``runtime.parallelize.ParallelModel`` (gradients of ZeRO-1/2 masters included: they are what
the optimizer steps) and ``runtime.pipeline.PipelineModel``, after their gradient sync
(``Optimizer.register_step_pre_hook`` is the place: meshplan/worker.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate


def _counted_here(grad: DTensor) -> bool:
    """Whether this rank's shard of ``grad`` is the one copy counted (coordinate 0 along
    every replicated mesh axis)."""
    coord = grad.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coord, grad.placements) if isinstance(p, Replicate))


def _tie_duplicates(model) -> set[int]:
    """ids of tied parameters whose gradient another (lower) rank group already counts, and
    of their ZeRO-1/2 masters (what ``optimizer_params`` returns in their place)."""
    skip = set()
    rank = dist.get_rank()
    masters = getattr(model, "masters", None) or {}
    for group, params, *_ in getattr(model, "tie_groups", ()):  # (group, params[, via])
        if rank != min(dist.get_process_group_ranks(group)):
            skip.update(id(p) for p in params)
            skip.update(id(masters[id(p)]) for p in params if id(p) in masters)
    return skip


def _gradients(model) -> list[torch.Tensor]:
    """The gradients the optimizer will step (synced, in their parameters' placements)."""
    grads = []
    for p in model.optimizer_params().values():
        if p.grad is None:
            continue
        if isinstance(p.grad, DTensor) and any(isinstance(q, Partial) for q in p.grad.placements):
            p.grad = p.grad.redistribute(placements=[Replicate() if isinstance(q, Partial) else q
                                                     for q in p.grad.placements])
        grads.append(p)
    return grads


@torch.no_grad()
def total_norm(model, norm_type: float = 2.0) -> float:
    """The norm of the whole model's gradient, the same on every rank (a collective)."""
    norm_type = float(norm_type)
    skip = _tie_duplicates(model)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for p in _gradients(model):
        grad = p.grad
        if id(p) in skip or (isinstance(grad, DTensor) and not _counted_here(grad)):
            continue
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).to(torch.float64)
        if local.numel() == 0:
            continue
        if math.isinf(norm_type):
            acc = torch.maximum(acc, local.abs().max())
        else:
            acc += torch.linalg.vector_norm(local, norm_type) ** norm_type
    dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    return float(acc.item() if math.isinf(norm_type) else acc.item() ** (1.0 / norm_type))


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, norm_type: float = 2.0) -> float:
    """Scale every gradient of ``model`` in place so that the global norm is at most
    ``max_norm``; returns the global norm before clipping (as torch.nn.utils does)."""
    norm = total_norm(model, norm_type)
    coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grads_with_norm_'s rule and epsilon
    if coef < 1.0:  # every rank decides alike: the norm is the same everywhere
        for p in _gradients(model):
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(coef)
    return norm
