"""Expert parallelism on the module engine: each MoE layer's routed experts split over ``ep``
data-parallel ranks, tokens sent to their expert's rank and back by all-to-all.

trace -> cost -> solve -> plan -> **run** (meshplan/axes.py ``EP_AXIS.runtime_step``). The
layout is torchtitan 0.3's (ideas, not code: its ``ExpertParallel`` style and
``parallelize_llama``): the stage's dp axis is viewed as (efsdp, ep), ep inner, so that rank
``r`` of an ep group holds experts ``[r * E/ep, (r + 1) * E/ep)`` as DTensor ``Shard(0)``
shards on the ``ep`` sub-mesh, and the same experts are replicated over the ``efsdp`` ranks.
torch 2.13 ships no expert-parallel style (torch.distributed.tensor.parallel has none), so
``ExpertParallel`` is a ``ParallelStyle`` applied with ``parallelize_module``:

1. partition: each expert weight becomes ``Shard(0)`` over ``ep`` (its local rows sliced out,
   no collective; a meta weight stays meta);
2. dispatch (drop-less: every routed copy of every token is sent): copies sorted by expert,
   their counts per expert exchanged first (one all-to-all of E integers), then the rows by
   ``torch.distributed.all_to_all_single`` with uneven splits (gloo implements it), regrouped
   local expert by local expert;
3. the experts' own forward on their local shard (the module's weights swapped for their
   local tensors for the call), then the rows back by the reverse all-to-all, in their
   original order; the module combines them as it does unsplit.

Gradients. A rank's expert shard receives the gradient of every rank of its ep group that
routed tokens to it (the all-to-all's backward is the reverse all-to-all), each rank's loss
being its own rows' mean; the other parameters' gradients are averaged over dp by FSDP. The
expert shards are left out of FSDP (``ignored_params``) and, once per step, summed over the
ranks that hold the same experts (efsdp, and cp under context parallelism, whose ranks see
other tokens of the same rows) and divided by dp (x cp) (``ExpertGrads.reduce``): the
gradient one process computes on the global batch.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from meshplan.axes import EP, GROUPED, ROUTED, find_experts

EFSDP = "efsdp"


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


def exchange(rows: torch.Tensor, counts: torch.Tensor, local_fn, group, ep: int) -> torch.Tensor:
    """Outputs of ``rows`` (sorted by global expert, ``counts[e]`` rows for expert e) computed
    by the ranks holding their experts: ``local_fn(local_rows, local_counts)`` runs this
    rank's E/ep experts on the rows every rank sent it, grouped local expert by local expert."""
    experts = counts.numel()
    per = experts // ep
    send = counts.to(torch.long).reshape(ep, per)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.reshape(-1), send.reshape(-1).contiguous(), group=group)
    in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    got = _AllToAll.apply(rows, out_splits, in_splits, group)
    # received (source rank, local expert)-major; the experts want (local expert, source):
    # a stable sort of each row's segment key (one key per segment, E of them) regroups them
    keys = torch.tensor([e * ep + s for s in range(ep) for e in range(per)],
                        dtype=torch.long, device=rows.device)
    perm = torch.argsort(torch.repeat_interleave(keys, recv.reshape(-1).to(rows.device)),
                         stable=True)
    local = got[perm]
    out = local_fn(local, recv.sum(0))
    if out.shape[0] == 0 and torch.is_grad_enabled() and local.requires_grad:
        out = out + local.sum() * 0  # keep the backward all-to-all in every rank's graph
    # the inverse permutation; no torch.arange here or below: under context parallelism
    # runtime/cp_modules.py ChunkPositions turns an arange of the local sequence length into
    # this rank's positions
    back = torch.argsort(perm)
    return _AllToAll.apply(out[back], in_splits, out_splits, group)


@contextmanager
def _local_weights(module: nn.Module, dtype: torch.dtype | None):
    """The module's DTensor expert weights replaced by their local shards (differentiable
    views, cast to the activations' dtype) for one call, and its ``num_experts`` (which
    transformers' experts read to group rows) the local count."""
    saved = dict(module._parameters)
    count = getattr(module, "num_experts", None)
    try:
        for name, p in saved.items():
            if isinstance(p, DTensor):
                local = p.to_local()
                module._parameters[name] = local.to(dtype) if dtype is not None else local
                if count is not None:
                    module.num_experts = local.shape[0]
        yield
    finally:
        module._parameters.update(saved)
        if count is not None:
            module.num_experts = count


class ExpertParallel(ParallelStyle):
    """Routed experts split over a 1-D ``ep`` mesh (see the module docstring)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        ep, me = device_mesh.size(), device_mesh.get_local_rank()
        for name, p in list(module.named_parameters(recurse=False)):
            part = p.detach().chunk(ep, dim=0)[me].clone()
            module.register_parameter(name, nn.Parameter(
                DTensor.from_local(part, device_mesh, [Shard(0)], run_check=False),
                requires_grad=p.requires_grad))
        original = module.forward
        group = device_mesh.get_group()
        experts = next(module.parameters(recurse=False)).shape[0]

        def local_fn(x, local_counts):
            with _local_weights(module, x.dtype if x.is_floating_point() else None):
                if self.kind == GROUPED:
                    return original(x, local_counts)
                ids = torch.repeat_interleave(local_counts)  # expert e repeated counts[e] times
                return original(x, ids.unsqueeze(1), x.new_ones(x.shape[0], 1))

        if self.kind == GROUPED:
            def forward(x, counts):
                return exchange(x, counts, local_fn, group, ep)
        else:
            def forward(hidden_states, top_k_index, top_k_weights):
                k = top_k_index.shape[-1]
                flat = top_k_index.reshape(-1)
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=experts)
                token = order // k
                out = exchange(hidden_states[token], counts, local_fn, group, ep)
                out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
                return torch.zeros_like(hidden_states).index_add(
                    0, token, out.to(hidden_states.dtype))
        module.forward = forward
        return module


def ep_mesh(stage, device_type: str, pp: int = 1) -> DeviceMesh:
    """Every rank of the run (``pp`` rank groups of the stage's mesh, row-major as
    ``init_device_mesh`` lays them) with the dp axis viewed as (efsdp, ep), ep inner
    (torchtitan's ``dp_shard_in_ep``): ep groups are runs of consecutive dp ranks."""
    shape, names = list(stage.mesh_shape), list(stage.axis_names)
    dp = names.index("dp")
    shape[dp:dp + 1] = [shape[dp] // stage.ep, stage.ep]
    names[dp:dp + 1] = [EFSDP, EP]
    if pp > 1:
        shape, names = [pp, *shape], ["pp", *names]
    ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=tuple(names))


def replica_group(mesh: DeviceMesh):
    """The ranks holding the same experts on their own data: efsdp, and cp where the stage
    has it (tensor-parallel ranks compute the same tokens; ep with tp is refused,
    meshplan/axes.py); None when that is this rank alone."""
    dims = [d for d in (EFSDP, "cp") if d in mesh.mesh_dim_names and mesh[d].size() > 1]
    if not dims:
        return None
    sub = mesh[dims[0]] if len(dims) == 1 else mesh[tuple(dims)]._flatten("_".join(dims))
    return sub.get_group()


class ExpertGrads:
    """The expert shards' gradients made one process's (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter], efsdp_group, dp_size: int):
        self.params, self.group, self.dp_size = params, efsdp_group, dp_size
        self._before: list = []

    def stash(self) -> None:
        """Before a step: set aside the gradients already accumulated (the user may
        accumulate over several steps), so that only this step's are reduced."""
        self._before = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def reduce(self) -> None:
        for p, before in zip(self.params, self._before or [None] * len(self.params)):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            local = g.to_local() if isinstance(g, DTensor) else g
            if self.group is not None:
                dist.all_reduce(local, group=self.group)
            local.div_(self.dp_size)
            p.grad = g if before is None else before + g
        self._before = []


def apply_expert_parallel(model: nn.Module, stage, mesh: DeviceMesh | None = None,
                          device_type: str = "cpu") -> ExpertGrads:
    """Split ``model``'s routed experts (a pipeline stage's part: its own) over the stage's
    ``ep`` ranks, in place; returns the gradient reducer the engine calls once per step,
    whose ``params`` FSDP must ignore. ``mesh``: ``ep_mesh``'s (built here when None)."""
    mesh = mesh if mesh is not None else ep_mesh(stage, device_type)
    found = find_experts(model)
    parallelize_module(model, mesh[EP], {name: ExpertParallel(kind)
                                         for name, (kind, _) in found.items()})
    params = [p for name in found for p in model.get_submodule(name).parameters(recurse=False)]
    degrees = dict(zip(stage.axis_names, stage.mesh_shape))
    # FSDP averages the other gradients over dp x cp; the experts' sum over their replicas
    # is divided by the same
    return ExpertGrads(params, replica_group(mesh), degrees.get("dp", 1) * degrees.get("cp", 1))


__all__ = ["ExpertParallel", "ExpertGrads", "apply_expert_parallel", "exchange", "ep_mesh",
           "ROUTED", "GROUPED"]
