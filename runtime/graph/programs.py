"""The exported training program made runnable on DTensor and its weights placed: what both
graph-engine classes (``ParallelModel``, runtime/graph/parallelize.py, and ``PipelineModel``,
runtime/graph/pipeline.py) and their shared side (runtime/graph/engine.py) build on.

Two rewrites make the exported graph runnable on DTensor: ``aten._assert_*`` metadata checks
are dropped (no sharding rule, no effect), and on CPU scaled-dot-product attention runs as its
math decomposition (``sdpa_math``) because DTensor has no rule for the CPU flash kernel's
backward. Split from runtime/graph/parallelize.py so that the pipeline runtime and the
placing rules import these without importing the single-stage engine (issue 40).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # private: no public local-shape helper in 2.13

from meshplan.placements import REPLICATE, shard
from meshplan.plan import Stage
from meshplan.runtime.engine import data_parallel_axes
from meshplan.runtime.graph import lowering
from meshplan.runtime.graph.custom_ops import replicate_unsharded_custom_ops


def sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """scaled_dot_product_attention as matmul + softmax + matmul (every op has a DTensor rule);
    attention dropout as PyTorch's math kernel applies it, to the softmax (global_dropout).
    DTensors split only by batch and heads run on their local shards (_local_attention)."""
    local = _local_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if local is not None:
        return local
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    weights = torch.softmax(scores, dim=-1)
    if dropout_p:
        weights = global_dropout(weights, dropout_p, True)
    return torch.matmul(weights, v)


def _local_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Attention of DTensors q, k, v laid out alike and split only along batch (dim 0) and
    heads (dim 1), evenly: every rank's rows and heads attend only among themselves, so each
    rank runs sdpa_math on its local shards and the result keeps q's placements. The mask
    is moved to the matching layout (split where it has the batch or heads, else whole).
    None where that does not hold (sequence or head-dim splits, Partial, dropout): DTensor's
    rules then run it; so do uneven splits, _StridedShard, q, k, v laid out differently, a
    mask on another mesh or one that needs a gradient, and a whole (non-DTensor) mask along a
    split dimension. DTensor decomposes a 4-d matmul into expand / view / bmm, whose
    flattened batch x heads dimension is a _StridedShard; pricing its redistributions took
    1-15 s per call on 2 CPU cores (runtime/graph/parallelize.py profile, DECISIONS 64)."""
    if dropout_p or not all(isinstance(t, DTensor) and t.ndim == 4 for t in (q, k, v)):
        return None
    mesh, placements = q.device_mesh, tuple(q.placements)
    if any(t.device_mesh != mesh or tuple(t.placements) != placements for t in (k, v)):
        return None
    split = {0: 1, 1: 1}  # dim -> ranks it is split over
    for axis, p in enumerate(placements):
        if p.is_replicate():
            continue
        if type(p) is not Shard or p.dim not in split:
            return None
        split[p.dim] *= mesh.size(axis)
    if any(t.shape[d] % n for t in (q, k, v) for d, n in split.items()):
        return None
    mask = attn_mask
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        return None  # a learned bias: its gradient sums over the ranks that split q
    if isinstance(mask, DTensor):
        if mask.device_mesh != mesh:
            return None
        lead = 4 - mask.ndim  # the mask broadcasts from the right

        def fit(p):
            d = p.dim - lead if type(p) is Shard else -1
            return Shard(d) if d >= 0 and mask.shape[d] > 1 else Replicate()
        mask = mask.redistribute(mesh, [fit(p) if type(p) is Shard else Replicate()
                                        for p in placements]).to_local()
    elif mask is not None and any(
            mask.ndim > 3 - d and mask.shape[d - 4 + mask.ndim] > 1
            for d, n in split.items() if n > 1):
        return None  # a whole (global) mask along a split dimension
    out = sdpa_math(q.to_local(), k.to_local(), v.to_local(), mask, 0.0, is_causal, scale,
                    enable_gqa)
    shape = (*q.shape[:-1], v.shape[-1])
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=_contiguous(shape))


def sdpa_math_dropout(*args, **kwargs):
    """sdpa_math with attention dropout: kept on DTensor (a local run would draw shard masks)."""
    return sdpa_math(*args, **kwargs)


def global_dropout(x, p: float, train: bool):
    """aten.dropout with one process's mask: every rank draws the mask at the tensor's GLOBAL
    shape from its default generator, as eager CPU dropout does
    (``empty_like(x).bernoulli_(1 - p).div_(1 - p)``), and keeps its shard of it. Ranks that
    run the same operators in the same order (one stage) stay in step with one process
    seeded alike, so the result does not depend on how the plan shards ``x``. DTensor's
    OffsetBasedRNGTracker gives the same guarantee only on CUDA-like devices
    (``is_rng_supported_mesh`` is False on CPU), and draws a different stream than eager."""
    if not train or p == 0:
        return x
    if not isinstance(x, DTensor):
        return x * torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
    if any(pl.is_partial() for pl in x.placements):
        x = x.redistribute(x.device_mesh, [Replicate() if pl.is_partial() else pl
                                           for pl in x.placements])
    noise = torch.empty(x.shape, dtype=x.dtype).bernoulli_(1 - p).div_(1 - p)
    shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
    local = noise[tuple(slice(o, o + n) for o, n in zip(offset, shape))].to(x.device_mesh.device_type)
    mask = DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())
    return x * mask


lowering.LOCAL_EQUIVALENT[sdpa_math] = torch.nn.functional.scaled_dot_product_attention
lowering.KEEP_ON_DTENSOR.update({global_dropout, sdpa_math_dropout})


def runnable_graph_module(ep: torch.export.ExportedProgram, *, device_type: str) -> torch.fx.GraphModule:
    """The exported program as a GraphModule that runs on ``device_type`` with DTensors
    (subgraphs of higher-order operators, such as Llama's rotary embedding, included)."""
    gm = ep.module()
    # ep.module() copies the top graph only; the subgraphs of higher-order operators are
    # the program's own, and the program may be cached (meshplan.tracing): rewrite copies
    for name, child in list(gm.named_children()):
        if isinstance(child, torch.fx.GraphModule):
            setattr(gm, name, copy.deepcopy(child))
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule):
            _make_runnable(sub, device_type)
            replicate_unsharded_custom_ops(sub.graph)  # MoE experts' grouped matmul
    return gm


def _make_runnable(gm: torch.fx.GraphModule, device_type: str) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function":  # traced on meta: make tensors on our device instead
            node.args, node.kwargs = torch.fx.node.map_aggregate(
                (node.args, node.kwargs),
                lambda a: torch.device(device_type) if isinstance(a, torch.device) else a)
        if node.op == "call_function" and str(node.target).startswith("aten._assert"):
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten.dropout.default and len(node.args) == 3 \
                and node.args[1] and node.args[2]:
            node.target = global_dropout  # p > 0 in training (p = 0 stays a lowered no-op)
        elif node.target is torch.ops.aten.scaled_dot_product_attention.default and \
                _sdpa_dropout(node):
            node.target = sdpa_math_dropout
        elif device_type == "cpu" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            node.target = sdpa_math
    gm.recompile()


def _sdpa_dropout(node: torch.fx.Node) -> bool:
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return bool(p)


def sharded_over(placements: Sequence[str], axes: Sequence[int]) -> tuple[str, ...]:
    """``placements`` with Replicate turned into S(0) on ``axes``: ZeRO's storage sharding."""
    return tuple(shard(0) if i in axes and p == REPLICATE else p for i, p in enumerate(placements))


def storage_placements(stage: Stage, fqn: str) -> tuple[str, ...]:
    planned = tuple(stage.params[fqn])
    return sharded_over(planned, data_parallel_axes(stage)) if stage.zero >= 3 else planned


def install_params(gm: nn.Module, params: dict) -> None:
    """Put the placed parameters and buffers (``params``: attribute name -> DTensor, tied
    names sharing one) into ``gm`` in place of those it was traced with, once: the SPMD
    executor reads them through ``gm``'s ``get_attr`` nodes, as the pipeline's stage
    GraphModules are built holding them. Names ``gm`` lacks are skipped."""
    for name, value in params.items():
        owner, _, leaf = name.rpartition(".")
        try:
            module = gm.get_submodule(owner)
        except AttributeError:
            continue
        if hasattr(module, leaf):
            setattr(module, leaf, value)  # a Parameter slot takes the nn.Parameter(DTensor)


def place_tensor(tensor: torch.Tensor, mesh: DeviceMesh, placements, device,
                 dtype: torch.dtype | None = None) -> DTensor:
    """``tensor`` as a DTensor with ``placements``. A tensor on the meta device (a model built
    under ``torch.device("meta")``) gets an uninitialised local shard and nothing else: the
    weights come later (meshplan.parallelize's load_full_state_dict or init_weights)."""
    dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    if tensor.is_meta:
        shape, _ = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        local = torch.empty(shape, dtype=dtype, device=device)
        return DTensor.from_local(local, mesh, placements, run_check=False,
                                  shape=tensor.shape, stride=_contiguous(tensor.shape))
    return distribute_tensor(tensor.detach().to(device, dtype), mesh, placements)


def _contiguous(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for s in reversed(tuple(shape)):
        out.append(stride)
        stride *= s
    return tuple(reversed(out))
