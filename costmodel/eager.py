"""Eager execution: the kernels PyTorch launches for each operator when nothing fuses them.

trace -> **cost** -> solve -> run. ``compute.op_time`` prices a memory-bound operator as one
kernel over its traced bytes (fp32, scaled to the compute dtype) forward and twice that
backward. Eager PyTorch under mixed precision launches more than that, and measured on one
H200 the difference is most of the non-GEMM time (benchmarks/results/compile_check.md: the
eager step's elementwise and reduction kernels took 121 ms where that rule priced 44 ms;
2,208 elementwise kernels where the trace has 392 elementwise operators). This module counts
the kernels one by one, a pure function of the OpGraph:

- **dtypes as they run** (``element_bytes``). The trace is fp32; eager bf16 runs keep the
  weights in bf16 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``, precision "fsdp") or
  in fp32 with ``torch.autocast`` casting the inputs of matmuls and attention to bf16
  (precision "autocast": meshplan's graph engine, its module engine without FSDP, plain
  PyTorch). Explicit casts in the user's code (``x.float()``, ``.to(x.dtype)``, ``type_as``)
  show in an fp32 trace as casts to float32: one that reads a narrower value is an upcast
  (RMSNorm's ``x.float()``); one that reads fp32 casts back to the dtype the chain came from
  (``.to(input_dtype)``), or, for a value that depends on no input or weight (a rotary
  position table), to the activations' dtype (``cos.to(x.dtype)``). Elementwise results take the widest float input (PyTorch's type
  promotion), reductions and views their input's, matmuls and attention the compute dtype.
  A float graph input keeps the dtype it was traced with, except under FSDP2, which casts
  the root module's float inputs to its ``param_dtype`` (``cast_forward_inputs``).
- **forward kernels**: one per non-view operator over the bytes it reads and writes at
  those dtypes; a cast that changes the dtype and a ``cat`` copy (views in the trace, free
  in ``op_time``); under autocast, a cast kernel for each fp32 input of a matmul or
  attention, weights included (once per microbatch: autocast caches a leaf's cast).
- **backward kernels** from PyTorch's derivative formulas (tools/autograd/derivatives.yaml,
  torch 2.13; each rule checked against the kernels autograd dispatches in
  tests/test_eager_kernels.py): ``mul`` one product per input needing a gradient, then a
  ``sum`` where that input was broadcast and a cast where its dtype is narrower than the
  product's; ``add``/``sub`` nothing for a same-shape input (``sub``: a ``neg``); ``pow`` and
  ``rsqrt`` three kernels (``pow``, ``mul`` by the scalar, ``mul`` by the gradient); ``mean``
  one ``div`` writing the input's size; ``sum``, ``cat`` and views none (expand, narrow);
  ``slice`` a zero fill of the input's size and a copy (``slice_backward``);
  ``repeat_interleave`` a ``sum``; activations, softmax and casts one kernel;
- **gradient accumulation**: autograd sums the gradients of a value read by k operators
  that carry gradients with k - 1 ``add`` kernels (``InputBuffer::add``), priced at the
  readers after the first (so that a stage, or a range of layers the pipeline search
  prices on a graph cut after it, pays the sums of what it reads); a weight's gradient is
  added into ``.grad`` on every microbatch after the first (``AccumulateGrad``).
- **the loss**: the engines upcast the logits before the cross entropy (meshplan's
  ``ModuleEngine._loss``, torchtitan's ``cross_entropy_loss``: ``pred.float()``), so the
  loss runs ``log_softmax`` and its backward on fp32 logits, and ``nll_loss_backward`` fills
  an fp32 gradient of the logits' size before ``_log_softmax_backward_data``.

Each kernel is priced on the roofline over its bytes plus the device's fixed cost per
launch (``kernel_latency_s + framework_overhead_s``), as ``op_time`` prices one, streaming
at the bandwidth of its path (``Kernel.path``: contiguous, strided, upcast, broadcast, mixed
dtype, reduction, slice_backward; costmodel/kernel_paths.py says which kernel takes which,
``device.memory_paths`` the measured fraction of the contiguous rate each reaches).
Stacks whose kernels are fused by hand (Megatron-Core with Transformer Engine) keep
``op_time``'s pricing: ``RuntimeModel.eager_kernels`` is off for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodel.compute import DTYPE_BYTES, OpTime
from meshplan.costmodel.fusion import runs_eager
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.kernel_paths import (BROADCAST, CONTIGUOUS, MIXED_DTYPE,
                                             SLICE_BACKWARD, SLICES, data_inputs, is_complex, materializes,
                                             STRIDED, UPCAST, elementwise_path, is_float,
                                             factory_source, layouts, stream_s, sum_path,
                                             value_dtype, value_numel)
from meshplan.graph import OpGraph, OpKind, OpNode
from meshplan.opcount import _GROUPED_MM

PRECISIONS = ("autocast", "fsdp")  # RuntimeModel.mixed_precision
MEMORY_BOUND = (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX, OpKind.REDUCTION,
                OpKind.OTHER)
_CASTS = ("aten.to.", "aten._to_copy", "aten.type_as")
_ACTIVATIONS = ("silu", "gelu", "tanh", "sigmoid", "relu", "exp", "softmax", "threshold",
                "elu", "softplus", "hardswish", "mish", "erf")
_POWS = ("aten.pow.Tensor_Scalar", "aten.rsqrt", "aten.reciprocal", "aten.sqrt")


@dataclass(frozen=True, slots=True)
class Kernel:
    """One launched kernel: bytes read and written for the whole traced batch, and the path
    PyTorch runs it on (``kernel_paths.PATHS``; it streams at ``device.memory_paths[path]``
    of the contiguous rate)."""

    read_bytes: float
    written_bytes: float
    path: str = CONTIGUOUS

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.written_bytes


@dataclass(frozen=True, slots=True)
class EagerOp:
    """The kernels one operator launches eagerly. ``forward``/``backward`` move activations
    (split like the operator's work); ``weight_forward``/``weight_backward`` move the
    parameter it reads (autocast's weight cast and its backward), split like the weight,
    once per microbatch; ``accumulate`` adds a weight's gradient into ``.grad``
    (microbatches after the first), ``accumulate_first`` makes the accumulator (the first
    microbatch), both averaged over the step's microbatches."""

    forward: tuple[Kernel, ...] = ()
    backward: tuple[Kernel, ...] = ()
    weight_forward: tuple[Kernel, ...] = ()
    weight_backward: tuple[Kernel, ...] = ()
    accumulate: tuple[Kernel, ...] = ()
    weight: str = ""  # the parameter the weight kernels move
    accumulate_first: tuple[Kernel, ...] = ()

    @property
    def kernels(self) -> int:
        return len(self.forward) + len(self.backward) + len(self.weight_forward) \
            + len(self.weight_backward)


def _is_cast(node: OpNode) -> bool:
    return node.target.startswith(_CASTS)


def _cast_to_weights(graph: OpGraph, node: OpNode) -> bool:
    """``x.to(w.dtype)`` before a kernel that reads the weight ``w`` as it is held and needs
    both operands in one dtype (transformers' grouped experts: ``_grouped_mm(input.to(
    weight.dtype), weight, offs)``, integrations/moe.py): every reader is a matmul reading a
    parameter of the cast's traced dtype, so the cast runs to the weights' dtype of the run
    (FSDP2's bf16 weights), not the traced fp32."""
    users = graph.users.get(node.name, ())
    out = node.out

    def weight(name: str) -> bool:  # a parameter of the cast's dtype, through views
        for _ in range(8):
            if name in graph.param_map:
                return graph.param_map[name].dtype == out.dtype
            if name not in graph or graph.node(name).kind != OpKind.VIEW \
                    or not graph.node(name).inputs:
                return False
            name = graph.node(name).inputs[0]
        return False
    return bool(users) and out is not None and all(
        (graph.node(u).kind == OpKind.MATMUL or _GROUPED_MM.search(graph.node(u).target))
        and any(weight(i) for i in graph.node(u).inputs if i != node.name) for u in users)


def _moves_device_only(graph: OpGraph, node: OpNode, src: str) -> bool:
    """``x.to(device)``: export writes the traced dtype into the call (GPT-2's
    ``position_embeds.to(inputs_embeds.device)``), the same as its input's, which a run in
    another dtype keeps too."""
    return "device" in node.parsed_args()[1] and node.out is not None \
        and node.out.dtype == value_dtype(graph, src)


def effective_inputs(graph: OpGraph) -> dict[str, tuple[str, ...]]:
    """Each operator's inputs as eager PyTorch passes them. In an fp32 trace ``x.float()``
    returns ``x`` itself, so the export records the cast's node wherever the code reads
    ``x`` afterwards: the residual add after a norm that upcasts reads the cast. Where the
    cast reads a value made outside its module (the module's input: ``x.float()`` at the
    top of a norm's forward), a reader outside that module read ``x``, and gets the cast's
    input here; a cast of a value the module made (``.to(x.dtype)`` on its result) is what
    the module returns."""
    out = {}
    for node in graph.nodes:
        resolved = []
        for i in node.inputs:
            for _ in range(8):
                src = graph.node(i) if i in graph else None
                if src is None or not _is_cast(src) or not src.inputs or not src.module_path \
                        or src.out is None or value_dtype(graph, src.inputs[0]) != src.out.dtype \
                        or _inside(node.module_path, src.module_path) \
                        or _inside(_module_of(graph, src.inputs[0]), src.module_path):
                    break
                i = src.inputs[0]
            resolved.append(i)
        out[node.name] = tuple(resolved[:len(data_inputs(node))])
    return out


def _module_of(graph: OpGraph, name: str) -> str:
    return graph.node(name).module_path if name in graph else ""


def _inside(path: str, module: str) -> bool:
    return path == module or path.startswith(module + ".")


def effective_users(graph: OpGraph, inputs: dict) -> dict[str, tuple[str, ...]]:
    users: dict[str, list[str]] = {}
    for node in graph.nodes:
        for i in dict.fromkeys(inputs[node.name]):
            users.setdefault(i, []).append(node.name)
    return {k: tuple(v) for k, v in users.items()}


def element_bytes(graph: OpGraph, *, dtype: str, precision: str,
                  inputs: dict | None = None) -> dict[str, int]:
    """Bytes per element of every value (nodes, parameters, graph inputs) as eager PyTorch
    holds it in a ``dtype`` run under ``precision`` (module docstring)."""
    inputs = effective_inputs(graph) if inputs is None else inputs
    compute = DTYPE_BYTES.get(dtype, 4)
    weights = 4 if precision == "autocast" else compute
    size: dict[str, int] = {}
    origin: dict[str, int] = {}  # the dtype a value had before an explicit upcast
    data = set(graph.data_nodes | _outside(graph))
    for node in graph.nodes:  # what depends on an activation made before a cut
        if node.name not in data and any(i in data for i in node.inputs):
            data.add(node.name)
    for p in graph.params:
        size[p.name] = origin[p.name] = weights if is_float(p.dtype) else \
            max(1, _meta_itemsize(p.dtype))
    for name, meta in graph.inputs:
        # a float input: FSDP2 casts the root module's floating-point inputs to its
        # param_dtype (MixedPrecisionPolicy.cast_forward_inputs, on by default); otherwise it
        # stays as the user passes it, the dtype it was traced with (fp32 data, or bf16
        # hidden states)
        size[name] = origin[name] = compute if precision == "fsdp" and is_float(meta.dtype) \
            else _meta_itemsize(meta.dtype)
    for name in _outside(graph):  # a block activation before a cut: the embedding's dtype
        size[name] = origin[name] = weights
    for node in graph.nodes:
        out = node.out
        if out is None:
            continue
        floats = [i for i in inputs[node.name] if i in size and is_float(value_dtype(graph, i))]
        like = node.inputs[1] if node.target.startswith("aten.type_as") and \
            len(node.inputs) > 1 else None
        if like in origin and is_float(out.dtype):  # x.type_as(y): y's dtype before any
            b = o = origin[like]                    # upcast of it, whatever x is
        elif not is_float(out.dtype):
            b = o = _meta_itemsize(out.dtype)
        elif node.kind in (OpKind.MATMUL, OpKind.ATTENTION):
            b = o = compute
        elif node.kind == OpKind.EMBEDDING:
            b = o = weights
        elif factory_source(graph, node.name) in size \
                and value_dtype(graph, node.inputs[0]) == out.dtype:
            # x.new_empty(...), zeros_like(x): x's dtype as it runs (no dtype= given)
            b, o = size[node.inputs[0]], origin[node.inputs[0]]
        elif node.kind == OpKind.CREATION or not floats:
            b = o = _meta_itemsize(out.dtype)
        elif _is_cast(node) and _cast_to_weights(graph, node):
            b = o = weights  # x.to(w.dtype) for a kernel autocast leaves alone
        elif _is_cast(node):
            src = size[floats[0]]
            if _moves_device_only(graph, node, floats[0]):
                b, o = src, origin[floats[0]]  # x.to(device): the dtype it already has
            elif out.dtype in ("bfloat16", "float16"):
                b = o = 2
            elif src < _meta_itemsize(out.dtype):
                b, o = _meta_itemsize(out.dtype), src  # x.float(): an upcast
            elif floats[0] not in data:  # a position table cast to the activations' dtype
                b = o = weights
            else:
                b = o = origin[floats[0]]  # .to(x.dtype) of an fp32 value: cast back
        else:
            b = max(size[i] for i in floats)
            o = min(origin[i] for i in floats if size[i] == b)
            if node.kind == OpKind.SOFTMAX and "float32" in node.args_repr:
                b = 4  # softmax(..., dtype=torch.float32)
        size[node.name], origin[node.name] = b, min(o, b)
    return size


_SIZES: dict = {}


def cached_element_bytes(graph: OpGraph, *, dtype: str, precision: str) -> dict[str, int]:
    """``element_bytes`` of the whole graph a cut one comes from (``OpGraph.whole``: its
    values made before the cut have the dtypes the whole graph gives them), one walk per
    graph, dtype and precision (the pipeline search prices thousands of ranges)."""
    graph = graph.whole or graph
    key = (id(graph), dtype, precision)
    hit = _SIZES.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(_SIZES) >= 32:
        _SIZES.clear()
    sizes = element_bytes(graph, dtype=dtype, precision=precision)
    _SIZES[key] = (graph, sizes)
    return sizes


def _meta_itemsize(dtype: str) -> int:
    for key, n in (("complex128", 16), ("complex64", 8), ("complex32", 4),
                   ("float64", 8), ("int64", 8), ("float32", 4), ("int32", 4),
                   ("bfloat16", 2), ("float16", 2), ("int16", 2), ("bool", 1), ("int8", 1),
                   ("uint8", 1), ("float8", 1)):
        if dtype.startswith(key):
            return n
    return 4


def _outside(graph: OpGraph) -> set[str]:
    """Activations block operators read that the graph does not hold: made before a cut.
    Buffers are read by their module path too (neither operators nor parameters); a
    traced value's name is an identifier (``add_3``), a buffer of a submodule is dotted
    (``layers.0.attn.bias``)."""
    inputs = {n for n, _ in graph.inputs}
    return {i for node in graph.nodes if node.layer >= 0 for i in node.inputs
            if i not in graph and i not in graph.param_map and i not in inputs
            and "." not in i}


def _carrying_grads(graph: OpGraph, outside: set[str]) -> frozenset[str]:
    """``OpGraph.grad_nodes``, with the activations made before a cut carrying gradients."""
    if not outside:
        return graph.grad_nodes
    out = set(outside)
    trainable = {p.name for p in graph.params if p.trainable}
    for n in graph.nodes:
        if n.kind != OpKind.CREATION and any(i in trainable or i in out for i in n.inputs) \
                and any(_differentiable(o.dtype) for o in n.outputs):
            out.add(n.name)
    return frozenset(out)


def eager_kernels(graph: OpGraph, names, *, dtype: str, precision: str,
                  microbatches: int = 1, compiled: bool = False) -> dict[str, EagerOp]:
    """The kernels each operator of ``names`` launches eagerly (module docstring).
    ``compiled``: the repeated blocks run under torch.compile (costmodel/fusion.py prices
    their fused kernels): their operators launch nothing here but autocast's weight casts
    (a cast of a parameter is a kernel of its own in the compiled graph) and the ``.grad``
    sums; the operators outside the blocks run eagerly."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}; "
                         "\"autocast\" for fp32 weights under torch.autocast, \"fsdp\" for "
                         "FSDP2's bf16 parameters")
    inputs = effective_inputs(graph)
    size = element_bytes(graph, dtype=dtype, precision=precision, inputs=inputs)
    compute = DTYPE_BYTES.get(dtype, 4)
    grads = _carrying_grads(graph, _outside(graph))
    trainable = {p.name for p in graph.params if p.trainable}
    users = effective_users(graph, inputs)
    lay = layouts(graph, inputs)

    def nbytes(name: str) -> float:
        return value_numel(graph, name) * size.get(name, 4)

    def needs_grad(name: str) -> bool:
        return name in grads or name in trainable

    out: dict[str, EagerOp] = {}
    for name in names:
        if name not in graph:
            continue
        node = graph.node(name)
        if node.out is None:
            continue
        # inductor fuses a block's operators, or calls its extern kernels, except those
        # it leaves to ATen (complex ones and the casts they read: fusion.runs_eager)
        in_compiled = compiled and node.layer >= 0 and not runs_eager(graph, name)
        fwd, bwd = ([], []) if in_compiled else \
            _operator_kernels(graph, node, inputs[name], size, lay, nbytes, needs_grad,
                              name in grads)
        wf, wb, acc, first, weight = [], [], [], [], ""
        if node.kind in (OpKind.MATMUL, OpKind.ATTENTION) and precision == "autocast" \
                and compute < 4:
            for i in dict.fromkeys(inputs[name]):
                if i in size and is_float(value_dtype(graph, i)) and size[i] > compute:
                    n = value_numel(graph, i)
                    cast_f, cast_b = Kernel(n * size[i], n * compute), \
                        Kernel(n * compute, n * size[i], UPCAST)  # the gradient's upcast
                    if i in graph.param_map:  # autocast's cached weight cast
                        wf.append(cast_f)
                        wb += [cast_b] if needs_grad(i) else []
                        weight = i
                    elif not in_compiled:  # inductor fuses an activation's cast
                        fwd.append(cast_f)
                        bwd += [cast_b] if needs_grad(i) else []
        if microbatches > 1 and node.kind in (OpKind.MATMUL, OpKind.EMBEDDING):
            for i in node.inputs:
                if i not in trainable:
                    continue
                n, s, later = graph.param_map[i].numel, size[i], (microbatches - 1) / microbatches
                if precision == "fsdp" and s < 4:
                    # FSDP2 accumulates an unsharded gradient it does not reduce in its
                    # reduce dtype (fp32: ``to_accumulated_grad_if_needed``): the first
                    # microbatch casts it up, each later one adds its bf16 gradient into it
                    first.append(Kernel(n * s / microbatches, n * 4 / microbatches, UPCAST))
                    acc.append(Kernel(n * (4 + s) * later, n * 4 * later, MIXED_DTYPE))
                else:  # AccumulateGrad adds into .grad after the first
                    acc.append(Kernel(2 * n * s * later, n * s * later))
                weight = weight or i
        # autograd sums the gradients of a value read by several operators: one add for
        # every reader after the first
        if name in grads and not in_compiled:
            for i in dict.fromkeys(inputs[name]):
                if i in grads and next(u for u in users[i] if u in grads) != name:
                    bwd.append(Kernel(2 * nbytes(i), nbytes(i)))
        if fwd or bwd or wf or wb or acc:
            out[name] = EagerOp(tuple(fwd), tuple(bwd), tuple(wf), tuple(wb), tuple(acc),
                                weight, tuple(first))
    return out


def _differentiable(dtype: str) -> bool:
    return is_float(dtype) or is_complex(dtype)


def _operator_kernels(graph: OpGraph, node: OpNode, inputs: tuple[str, ...], size: dict,
                      lay: dict, nbytes, needs_grad,
                      back: bool) -> tuple[list[Kernel], list[Kernel]]:
    """(forward, backward) kernels of one operator's own work and their paths (module
    docstring)."""
    t = node.target
    o = nbytes(node.name)
    ins = [i for i in inputs if i in size]
    floats = [i for i in ins if _differentiable(value_dtype(graph, i))]
    grad_ins = [i for i in floats if needs_grad(i)] if back else []
    if node.kind in (OpKind.MATMUL, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.CREATION):
        return [], []  # priced by op_time (FLOPs / their own kernels)
    if node.kind == OpKind.LOSS:
        return _loss_kernels(graph, ins, size, nbytes, back)
    if _is_cast(node) and node.kind != OpKind.VIEW:  # type_as: a cast, or nothing
        if not floats and ins:  # (h > 0).type_as(h): a bool or integer value cast
            return [Kernel(nbytes(ins[0]), o, CONTIGUOUS)], []
        if not floats or size[floats[0]] == size[node.name]:
            return [], []
    if node.kind == OpKind.VIEW or _is_cast(node):
        if _is_cast(node) and floats and size[floats[0]] != size[node.name]:
            up = size[node.name] > size[floats[0]]
            strided = lay.get(floats[0]) == "strided"
            fwd_path = STRIDED if strided else UPCAST if up else CONTIGUOUS
            bwd_path = STRIDED if strided else CONTIGUOUS if up else UPCAST
            return [Kernel(nbytes(floats[0]), o, fwd_path)], \
                [Kernel(o, nbytes(floats[0]), bwd_path)] if grad_ins else []
        if t.startswith("aten.cat"):
            return [Kernel(sum(nbytes(i) for i in ins), o,
                           elementwise_path(graph, size, lay, ins, node.name))], []
        if materializes(graph, node.name):  # repeat_kv's copy: the expanded value written
            src = graph.node(node.inputs[0]).inputs[0]
            return [Kernel(nbytes(src), o, BROADCAST)], []
        if t.startswith(SLICES) and grad_ins:
            return [], [Kernel(0.0, nbytes(grad_ins[0]), SLICE_BACKWARD),
                        Kernel(o, o, SLICE_BACKWARD)]
        if t.startswith("aten.expand") and grad_ins and value_numel(graph, grad_ins[0]) < \
                value_numel(graph, node.name):
            return [], [Kernel(o, nbytes(grad_ins[0]), sum_path(graph, grad_ins[0],
                                                                 node.name))]
        return [], []
    if node.kind not in MEMORY_BOUND:
        return [], []
    # the forward's path; the gradient lies like the output (the backward's stand-in for it)
    path = elementwise_path(graph, size, lay, ins, node.name) if node.kind == OpKind.ELEMENTWISE \
        else CONTIGUOUS
    fwd = [Kernel(sum(nbytes(i) for i in ins), o, path)]
    if "dropout" in t:  # bernoulli_ mask, div_ by keep probability, mul
        fwd = [Kernel(0.0, o), Kernel(o, o), Kernel(2 * o, o)]
    if not grad_ins:
        return fwd, []
    n_out = value_numel(graph, node.name)
    bwd: list[Kernel] = []

    def reduce_or_cast(i: str, produced: float) -> list[Kernel]:
        """A gradient computed at the output's size and dtype, brought to the input's."""
        if value_numel(graph, i) < n_out:  # sum over the broadcast dims
            return [Kernel(produced, nbytes(i), sum_path(graph, i, node.name))]
        if size[i] < size[node.name]:
            return [Kernel(produced, nbytes(i))]  # cast to the input's (narrower) dtype
        return []

    if t.startswith(("aten.add.", "aten.sub.", "aten.rsub.")):
        for k, i in enumerate(floats):
            if i not in grad_ins:
                continue
            if t.startswith("aten.sub.") and k == 1 or t.startswith("aten.rsub.") and k == 0:
                bwd.append(Kernel(o, o, path))  # neg
            bwd += reduce_or_cast(i, o)
    elif t.startswith(("aten.mul.Tensor", "aten.div.Tensor")) and len(floats) == 2:
        for k, i in enumerate(floats):
            if i not in grad_ins:
                continue
            other = floats[1 - k]
            if is_complex(value_dtype(graph, other)):
                # grad * other.conj(): mul reads no conjugate view, so autograd clones it
                bwd.append(Kernel(nbytes(other), nbytes(other), CONTIGUOUS))
            prod = elementwise_path(graph, size, lay, (node.name, other), node.name)
            bwd.append(Kernel(o + nbytes(other), o, prod))  # grad * other (or / other)
            if t.startswith("aten.div.") and k == 1:  # -grad * self / other**2
                bwd += [Kernel(o, o, path), Kernel(2 * o, o, path), Kernel(2 * o, o, path)]
            bwd += reduce_or_cast(i, o)
    elif t.startswith(_POWS):
        i = grad_ins[0]
        x = nbytes(i)
        bwd += [Kernel(x, x), Kernel(x, x), Kernel(o + x, x)]
    elif t.startswith("aten.mean"):  # div of the expanded gradient
        bwd.append(Kernel(o, nbytes(grad_ins[0]),
                          BROADCAST if o < nbytes(grad_ins[0]) else CONTIGUOUS))
    elif t.startswith(("aten.sum", "aten.clone", "aten.contiguous", "aten.alias")):
        pass  # expand / pass-through: no kernel
    elif t.startswith("aten.repeat_interleave"):  # sum over the repeats
        bwd.append(Kernel(o, nbytes(grad_ins[0]), sum_path(graph, grad_ins[0], node.name)))
    elif any(a in t for a in _ACTIVATIONS) or "dropout" in t or t.startswith(
            ("aten.mul.Scalar", "aten.div.Scalar", "aten.neg", "aten.where",
             "aten.masked_fill")):
        for i in grad_ins:
            saved = o if any(a in t for a in _ACTIVATIONS) or "dropout" in t else 0.0
            bwd.append(Kernel(o + saved, nbytes(i), path))
    elif node.kind == OpKind.NORM:  # fused layer/rms norm: grad input, then weight grads
        x = nbytes(floats[0])
        bwd += [Kernel(o + x, x), Kernel(o + x, sum(nbytes(i) for i in floats[1:]))]
    else:  # a memory-bound operator without a rule: op_time's, twice the forward's bytes
        moved = sum(nbytes(i) for i in ins) + o
        bwd.append(Kernel(moved, moved))
    return fwd, bwd


def _loss_kernels(graph: OpGraph, inputs: list[str], size: dict, nbytes,
                  back: bool) -> tuple[list[Kernel], list[Kernel]]:
    """Cross entropy on logits the engine upcast to fp32 (module docstring)."""
    logits = next((i for i in inputs if i in size and is_float(value_dtype(graph, i))),
                  None)
    if logits is None:
        return [], []
    x, n = nbytes(logits), value_numel(graph, logits)
    f32 = 4.0 * n
    cast = size[logits] < 4
    fwd = ([Kernel(x, f32, UPCAST)] if cast else []) + [Kernel(f32, f32), Kernel(f32 / 1e3, 4.0)]
    if not back:
        return fwd, []
    bwd = [Kernel(0.0, f32), Kernel(2 * f32, f32)] + ([Kernel(f32, x)] if cast else [])
    return fwd, bwd


def kernel_stream_s(kernel: Kernel, hw: HardwareProfile, shard: float) -> float:
    """Seconds ``kernel``'s bytes (split ``shard`` ways) stream at its path's bandwidth,
    without the launch (``kernel_paths.stream_s``)."""
    return stream_s(hw, kernel.bytes / shard, kernel.path)


def kernels_time_s(kernels, hw: HardwareProfile, shard: float) -> float:
    """Each kernel's bytes (split ``shard`` ways) at its path's bandwidth plus one launch."""
    fixed = hw.device.kernel_latency_s + hw.device.framework_overhead_s
    return sum(kernel_stream_s(k, hw, shard) + fixed for k in kernels)


def eager_time(op: EagerOp, hw: HardwareProfile, shard: float, weight_shard: float = 1.0, *,
               contention: float = 1.0) -> OpTime:
    """Forward and backward seconds of ``op``'s kernels: activations split ``shard`` ways
    (devices x microbatches), the weight's ``weight_shard`` ways (its own split, whole
    every microbatch)."""
    forward = kernels_time_s(op.forward, hw, shard) + kernels_time_s(op.weight_forward, hw,
                                                                     weight_shard)
    backward = kernels_time_s(op.backward, hw, shard) \
        + kernels_time_s(op.weight_backward, hw, weight_shard) \
        + sum(kernel_stream_s(k, hw, weight_shard)
              for k in op.accumulate + op.accumulate_first) \
        + len(op.accumulate) * (hw.device.kernel_latency_s + hw.device.framework_overhead_s)
    return OpTime(forward * contention, backward * contention)


def fsdp_copy_out_bytes(weight_numel: float, *, dtype: str, passes: int) -> float:
    """Bytes FSDP2's all-gather copy-out moves on the compute stream per microbatch:
    ``foreach_all_gather_copy_out`` (torch.distributed.fsdp._fully_shard._fsdp_collectives)
    reads the gathered flat buffer and writes every unsharded parameter, in the parameter
    dtype, once per all-gather (``passes``: 2 when the weights are resharded after the
    forward and gathered again for the backward, ZeRO-3; 1 otherwise). The all-gather's
    copy-in (cast of the fp32 shard and its copy into the all-gather buffer) runs on
    FSDP2's side stream (``all_gather_copy_in_stream``), beside the compute, and is not
    counted; the gradients' copy-in is (``fsdp_reduce_copy_in_bytes``)."""
    return passes * 2 * weight_numel * DTYPE_BYTES.get(dtype, 4)


def fsdp_reduce_copy_in_bytes(weight_numel: float, *, dtype: str, reduce_bytes: float) -> float:
    """Bytes FSDP2 moves on the compute stream per gradient reduction of one unit:
    ``foreach_reduce`` (same file) runs ``foreach_reduce_scatter_copy_in``, one
    ``chunk_cat`` that reads every unsharded gradient in the parameter dtype and writes it
    into the reduce-scatter buffer in the reduce dtype (fp32 under torchtitan's
    ``MixedPrecisionPolicy(reduce_dtype=float32)``), on the current stream, before the
    reduce-scatter stream waits on it ("Only after the copy-in finishes can we free the
    gradients"; torch 2.13)."""
    return weight_numel * (DTYPE_BYTES.get(dtype, 4) + reduce_bytes)
