"""Which path PyTorch's CUDA elementwise loop takes for each eager kernel, and how fast it
streams there.

trace -> **cost** -> solve -> run. costmodel/eager.py counts the kernels eager PyTorch
launches; this module says how each one runs: a pure function of the OpGraph (the layout of
every value) and of the kernel's operands.

Each kernel streams at the bandwidth of its **path** (``device.memory_paths``: the measured
fraction of the contiguous rate). PyTorch's CUDA elementwise loop takes its vectorized
kernel only when every operand is contiguous and of the result's dtype (ATen
native/cuda/CUDALoops.cuh, ``gpu_kernel_impl``); otherwise it runs the unrolled kernel with
dtype casts or the strided one with an offset per dimension (``elementwise_kernel<128,
2>``), which reach 30-80% of the contiguous rate, measured on H100
and H200 (benchmarks/results/eager_kernels_gpu.md). Each kernel takes the slowest path that
applies, in the measured order: ``strided`` (an operand that is not dense, a slice of the
last dimension, or a permuted operand (a transpose) beside a broadcast or a differently laid
out one: the rotary embedding on the transposed q and k), ``upcast`` (a bf16 -> fp32 cast,
and the backward of a downcast), ``broadcast`` (an operand with fewer elements than the
result: RMSNorm's ``x * rsqrt`` and ``x * weight``, the backward of ``mean``),
``mixed_dtype`` (float operands of different widths: an fp32 norm output times a bf16
weight); a gradient summed over leading broadcast dimensions (a weight's gradient from a
broadcast product, GQA's ``expand`` backward) is a ``reduction``, slice_backward's zero
fill and copy a ``slice_backward``; everything else (same-dtype contiguous operands, fp32
-> bf16 casts, reductions over the last dimension, fused norms, the loss's fp32 kernels,
gradient sums) ``contiguous``.
"""

from __future__ import annotations

from meshplan.costmodel.compute import roofline_s
# the path names are the keys of a hardware profile's ``device.memory_paths``, defined with
# the profile format (costmodel/hardware.py), which checks them
from meshplan.costmodel.hardware import (BROADCAST, CONTIGUOUS, MIXED_DTYPE,  # noqa: F401
                                         PATHS, REDUCTION, SLICE_BACKWARD, STRIDED, UPCAST,
                                         HardwareProfile)
from meshplan.graph import OpGraph, OpKind
from meshplan.vocabulary import ComputeDtype

FLOAT = ("float", "bfloat")
_PERMUTES = ("aten.transpose", "aten.permute", "aten.t.", "aten.swapaxes", "aten.movedim")
SLICES = ("aten.slice", "aten.select", "aten.narrow")
_RESHAPES = ("aten.reshape", "aten.flatten", "aten.view", "aten._unsafe_view")


def is_float(dtype: str) -> bool:
    return dtype.startswith(FLOAT)


def is_complex(dtype: str) -> bool:
    return dtype.startswith("complex")


def data_inputs(node) -> tuple[str, ...]:
    """The inputs whose data ``node`` reads: ``x.type_as(y)`` reads ``y``'s dtype only."""
    return node.inputs[:1] if node.target.startswith("aten.type_as") else node.inputs


# factories that take their dtype and device, and their sizes as the caller reads them, from
# a tensor argument: ``x.new_empty(size)`` and friends, ``torch.empty_like(x)`` and friends
# (meshplan/opcount.py classifies them OpKind.CREATION; ``x`` is their one input)
SIZED_FACTORIES = ("aten.new_empty.", "aten.new_empty_strided.", "aten.new_zeros.",
                   "aten.new_ones.", "aten.new_full.", "aten.empty_like.", "aten.zeros_like.",
                   "aten.ones_like.", "aten.full_like.")


def factory_source(graph: OpGraph, name: str) -> str | None:
    """The tensor a factory operator ``name`` is made from (``x`` of ``x.new_empty(...)``,
    ``torch.zeros_like(x)``), or None where ``name`` is no such factory."""
    if name not in graph:
        return None
    node = graph.node(name)
    if node.kind != OpKind.CREATION or not node.inputs \
            or not node.target.startswith(SIZED_FACTORIES):
        return None
    return node.inputs[0]


def value_numel(graph: OpGraph, name: str) -> int:
    if name in graph:
        out = graph.node(name).out
        return out.numel if out is not None else 0
    if name in graph.param_map:
        return graph.param_map[name].numel
    return next((m.numel for n, m in graph.inputs if n == name), 0)


def value_dtype(graph: OpGraph, name: str) -> str:
    if name in graph:
        out = graph.node(name).out
        return out.dtype if out is not None else ""
    if name in graph.param_map:
        return graph.param_map[name].dtype
    # a value made outside a cut graph (planner/stagecost.py prices ranges of layers on the
    # graph around them): the block activation a traced fp32 graph carries
    return next((m.dtype for n, m in graph.inputs if n == name), "float32")


def layouts(graph: OpGraph, inputs: dict) -> dict[str, str]:
    """How eager PyTorch lays out each value: "contiguous"; "permuted" (dense with its
    dimensions in another order: a transpose of a contiguous value, and an elementwise
    result whose full-size operands are all permuted, since TensorIterator gives the result
    its operands' layout); "strided" (not dense: a slice that narrows the last dimension).
    A reshape of a permuted or strided value copies it (contiguous); other views and casts
    keep their input's layout; every other operator writes a contiguous result. ``inputs``:
    each operator's inputs as eager PyTorch passes them (``eager.effective_inputs``)."""
    lay: dict[str, str] = {}
    for node in graph.nodes:
        out = node.out
        if out is None:
            continue
        t = node.target
        src = lay.get(node.inputs[0], "contiguous") if node.inputs else "contiguous"
        if node.kind == OpKind.VIEW:
            if t.startswith(_PERMUTES):
                lay[node.name] = {"contiguous": "permuted", "permuted": "contiguous"}.get(
                    src, src)
            elif t.startswith(SLICES):
                shape = value_shape(graph, node.inputs[0])
                lay[node.name] = "strided" if shape and out.shape and \
                    shape[-1] != out.shape[-1] else src
            elif t.startswith(_RESHAPES) and src != "contiguous" \
                    and not t.startswith("aten.view"):
                lay[node.name] = "contiguous"
            elif t.startswith("aten.cat") or t.startswith("aten.index"):
                lay[node.name] = "contiguous"
            else:
                lay[node.name] = src
        elif node.kind == OpKind.ELEMENTWISE:
            full = [lay.get(i, "contiguous") for i in inputs[node.name]
                    if value_numel(graph, i) == out.numel]
            lay[node.name] = "permuted" if full and all(x == "permuted" for x in full) \
                else "contiguous"
        else:
            lay[node.name] = "contiguous"
    return lay


def materializes(graph: OpGraph, name: str) -> bool:
    """Whether the view ``name`` copies: a reshape of an ``expand`` that added elements
    whose new shape no strides of the expanded tensor can view (``reshape`` then calls
    ``clone``), decided by PyTorch itself on meta tensors: grouped-query attention's
    ``repeat_kv``, ``x[:, :, :, None].expand(...).reshape(...)``, writes every repeated key
    and value; with one key head (multi-query) the same reshape is a view."""
    if name not in graph:
        return False
    node = graph.node(name)
    if not node.target.startswith(_RESHAPES) or node.target.startswith("aten.view") \
            or not node.inputs or node.inputs[0] not in graph or node.out is None:
        return False
    src = graph.node(node.inputs[0])
    if not (src.target.startswith("aten.expand") and src.inputs and src.out is not None
            and value_numel(graph, src.inputs[0]) < value_numel(graph, src.name)):
        return False
    key = (value_shape(graph, src.inputs[0]), tuple(src.out.shape), tuple(node.out.shape))
    hit = _COPIES.get(key)
    if hit is None:
        import torch

        try:  # the expand's input contiguous, as a fresh unsqueeze or projection is
            torch.empty(key[0], device="meta").expand(key[1]).view(key[2])
            hit = False
        except RuntimeError:
            hit = True
        _COPIES[key] = hit
    return hit


_COPIES: dict = {}


def value_shape(graph: OpGraph, name: str) -> tuple[int, ...]:
    if name in graph:
        out = graph.node(name).out
        return tuple(out.shape) if out is not None else ()
    if name in graph.param_map:
        return tuple(graph.param_map[name].shape)
    return next((tuple(m.shape) for n, m in graph.inputs if n == name), ())


def elementwise_path(graph: OpGraph, size: dict, lay: dict, operands, result: str) -> str:
    """The path of an elementwise kernel that reads ``operands`` and writes a value shaped,
    typed and laid out like ``result`` (module docstring): strided, broadcast, mixed dtype
    or contiguous (the slowest that applies, in the measured order)."""
    n = value_numel(graph, result)
    ops = [i for i in operands if value_numel(graph, i) > 0]
    full = [lay.get(i, "contiguous") for i in ops if value_numel(graph, i) == n]
    small = [i for i in ops if value_numel(graph, i) < n]
    if any(lay.get(i) == "strided" for i in ops) or "permuted" in full and (
            small or any(x != "permuted" for x in full)):
        return STRIDED
    if small:
        return BROADCAST
    widths = {size[i] for i in ops if i in size and is_float(value_dtype(graph, i))}
    if len(widths) > 1:
        return MIXED_DTYPE
    return CONTIGUOUS


def sum_path(graph: OpGraph, small: str, big: str) -> str:
    """A gradient summed from ``big``'s shape down to ``small``'s: over leading dimensions
    (a weight's gradient, the measured sum over tokens) a ``reduction``; over the last
    dimension (to a ``[t, 1]`` value) a row reduction at the contiguous rate."""
    a, b = value_shape(graph, small), value_shape(graph, big)
    return REDUCTION if a and b and a[-1] == b[-1] else CONTIGUOUS


def stream_s(hw: HardwareProfile, nbytes: float, path: str) -> float:
    """Seconds ``nbytes`` of one kernel take on the roofline, without the launch, its
    streaming term at ``path``'s bandwidth (``device.memory_paths``). The bandwidth curve
    ``max_eff * w / (w + half_work)`` is a streaming term ``w / (bw x max_eff)`` plus a fixed
    ``half_work / (bw x max_eff)`` per kernel; the paths were measured on large kernels
    (192 MiB), where only the streaming term counts, so only it is slowed (a small kernel
    costs its launch whatever its path: benchmarks/results/eager_kernels_gpu.md)."""
    base = roofline_s(hw, 0.0, nbytes, ComputeDtype.BF16)
    ratio = hw.device.memory_path_ratio(path)
    if ratio == 1.0 or nbytes <= 0:
        return base
    dev = hw.device
    streaming = nbytes / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency.max_eff)
    return base + streaming * (1.0 / ratio - 1.0)
