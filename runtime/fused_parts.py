"""Fused projections under tensor parallelism on the module engine: one nn.Linear whose output
the user's code splits by size into parts (nanoGPT's ``q, k, v = self.c_attn(x).split(C,
dim=2)``).

trace -> cost -> solve -> plan -> **run**. A column-parallel shard of the natural weight
would give rank 0 all of q and half of k, so the local split would see the wrong parts. As
Megatron-LM stores its fused QKV, the weight's rows (and the bias) are permuted so that each
rank's Shard(0) holds its heads of every part: rank r's rows are [q_r; k_r; v_r]
(``row_order``). The permutation is applied when full tensors come in (load_full_state_dict,
a model with real weights) and undone when they go out (full_state_dict, full_grads), so
the user only ever sees the natural layout; DCP checkpoints hold the permuted global layout
of the same plan.

At run time the layer's local output is marked; a ``split``/``chunk`` of it into the parts
(``FusedSplit``, a TorchFunctionMode active while the layer's parent module runs) returns
each part as a DTensor sharded on that dim, so the user's code after it (views into heads,
transposes, ``.view(B, T, C)`` with the global C) reads global shapes while every rank
computes its own heads. ``scaled_dot_product_attention`` on head-sharded DTensors runs on
the local heads (``local_heads_sdpa``; inside context parallelism, through torch's ring
attention), and the row-parallel projection after it takes the sharded DTensor as its input.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

_SPLITS = {torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk}


def fused_layers(splits: dict, styles: dict, model: nn.Module, tp: int) -> dict[str, int]:
    """{module FQN: parts} of the column-parallel nn.Linear layers whose output the forward
    splits by size along its last dim into equal parts, each divisible by ``tp``.
    ``splits``: {module FQN: (split size or sizes, dim, output rank)} of the split calls
    seen on each layer's output (runtime/module_plan.py ``forward_probe``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    mods = dict(model.named_modules())
    out = {}
    for name, (size, dim, rank) in splits.items():
        mod = mods.get(name)
        if not isinstance(styles.get(name), ColwiseParallel) or not isinstance(mod, nn.Linear):
            continue
        width = mod.out_features
        sizes = list(size) if isinstance(size, (list, tuple)) else \
            [size] * (width // size if isinstance(size, int) and size > 0 else 0)
        if dim % rank == rank - 1 and len(sizes) > 1 and sum(sizes) == width \
                and len(set(sizes)) == 1 and sizes[0] % tp == 0:
            out[name] = len(sizes)
    return out


def row_order(rows: int, parts: int, tp: int) -> torch.Tensor:
    """The permuted layout's row i holds natural row ``row_order(...)[i]``: rank r's block
    is [part 0's r-th slice; part 1's r-th slice; ...]."""
    part = rows // parts
    piece = part // tp
    return torch.cat([torch.arange(p * part + r * piece, p * part + (r + 1) * piece)
                      for r in range(tp) for p in range(parts)])


def to_permuted(full: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    return full.index_select(0, row_order(full.shape[0], parts, tp).to(full.device))


def to_natural(permuted: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    order = row_order(permuted.shape[0], parts, tp).to(permuted.device)
    out = torch.empty_like(permuted)
    out[order] = permuted
    return out


class FusedSplit(TorchFunctionMode):
    """``split``/``chunk`` of a marked local output into its parts: each a DTensor sharded on
    the split dim over the tensor-parallel mesh (global shapes for the user's code)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mark = getattr(args[0], "_meshplan_fused", None) if args else None
        if func not in _SPLITS or mark is None:
            return func(*args, **kwargs)
        parts, mesh = mark
        local = args[0]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % local.dim()
        if dim != local.dim() - 1:
            return func(*args, **kwargs)
        pieces = local.chunk(parts, dim=dim)
        return tuple(DTensor.from_local(p, mesh, [Shard(dim)], run_check=False) for p in pieces)


def local_heads_sdpa(inner):
    """``F.scaled_dot_product_attention`` for head-sharded DTensors (Shard(1) of (batch,
    heads, seq, head_dim)): the attention of this rank's heads on local tensors (through
    ``inner``: torch's own, or context parallelism's ring attention), returned sharded the
    same way; other DTensors are gathered first; plain tensors go to ``inner``."""
    def sdpa(query, key, value, *args, **kwargs):
        if not isinstance(query, DTensor):
            return inner(query, key, value, *args, **kwargs)
        mesh = query.device_mesh
        qkv = (query, key, value)
        if all(isinstance(t, DTensor) and t.placements == (Shard(1),) for t in qkv):
            out = inner(*(t.to_local() for t in qkv), *args, **kwargs)
            return DTensor.from_local(out, mesh, [Shard(1)], run_check=False)
        whole = [t.redistribute(mesh, [Replicate()]).to_local() if isinstance(t, DTensor) else t
                 for t in qkv]
        return DTensor.from_local(inner(*whole, *args, **kwargs), mesh, [Replicate()],
                                  run_check=False)
    return sdpa


def install(layers: list[tuple[nn.Module, nn.Module, int]], tp_mesh) -> None:
    """Hooks on each (fused layer, its parent module, parts): the layer marks its local
    output; the parent runs under ``FusedSplit`` with ``local_heads_sdpa`` in place of
    F.scaled_dot_product_attention. Installed after parallelize_module's own hooks (the mark
    sees the local output)."""
    for layer, parent, parts in layers:
        def mark(_mod, _args, out, parts=parts):
            out._meshplan_fused = (parts, tp_mesh)
            return out
        layer.register_forward_hook(mark)
        stack: list = []

        def enter(_mod, _args, stack=stack):
            ctx = contextlib.ExitStack()
            ctx.enter_context(FusedSplit())
            inner = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = local_heads_sdpa(inner)
            ctx.callback(setattr, F, "scaled_dot_product_attention", inner)
            stack.append(ctx)

        def leave(_mod, _args, _out, stack=stack):
            stack.pop().close()
        parent.register_forward_pre_hook(enter)
        parent.register_forward_hook(leave)
