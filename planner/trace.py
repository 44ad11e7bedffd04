"""Tracing: nn.Module + example inputs -> OpGraph.

trace -> cost -> solve -> run. We trace with ``torch.export`` (non-strict), which is
torch.fx underneath and yields an aten-level ``fx.Graph`` with shapes in ``node.meta``.
``torch.fx.symbolic_trace`` is tried first only to name the offending module and line
when export fails: its module-level graph has no shapes and no aten operators, which the
sharding rules need, so it cannot replace export (see docs/DECISIONS.md).

The training step is traced as one graph: model forward plus the loss, so the loss is an
operator the planner can shard like any other. Everything runs on the meta device: no
weight is allocated.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import traceback
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan.errors
from meshplan.errors import TraceError
from meshplan.planner.graph import (CallSignature, OpGraph, OpKind, OpNode, ParamInfo, TensorMeta,
                                    dtype_bytes)

LossFn = Callable[..., torch.Tensor]


def next_token_loss(output: torch.Tensor, ids: torch.Tensor, *rest) -> torch.Tensor:
    """Language-model loss on synthetic data: predict token t+1 from tokens <= t."""
    vocab = output.shape[-1]
    return F.cross_entropy(output[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))


def target_loss(output: torch.Tensor, target: torch.Tensor, *rest) -> torch.Tensor:
    """The default loss when targets are given without a loss_fn: cross entropy of the last
    output dim against the targets (class labels, or one label per token)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


Inputs = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def flatten_call(inputs: Inputs, targets: torch.Tensor | Sequence[torch.Tensor] = ()
                 ) -> tuple[tuple[torch.Tensor, ...], CallSignature]:
    """The model's inputs (a tensor, a tuple of positional arguments or a dict of keyword
    arguments) and the loss targets as one flat tuple, with the signature that undoes it."""
    targets = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets or ())
    if isinstance(inputs, torch.Tensor):
        args, kwargs = (inputs,), {}
    elif isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, Sequence):
        args, kwargs = tuple(inputs), {}
    else:
        raise TraceError(f"inputs of type {type(inputs).__name__} are not supported; pass a "
                         "tensor, a tuple of tensors (positional arguments) or a dict of "
                         "tensors (keyword arguments)")
    flat = (*args, *kwargs.values(), *targets)
    for i, x in enumerate(flat):
        if not isinstance(x, torch.Tensor):
            raise TraceError(f"input {i} is a {type(x).__name__}; every model input and "
                             "target must be a tensor (bind other arguments in the model or "
                             "a wrapper module)")
    return flat, CallSignature(len(args), tuple(kwargs), len(targets))


def unflatten_call(flat: Sequence, sig: CallSignature) -> tuple[tuple, dict, tuple]:
    """(args, kwargs, targets) from the flat inputs, as ``flatten_call`` made them."""
    if len(flat) != sig.size:
        raise TraceError(f"got {len(flat)} flat inputs for a call with {sig.size}")
    k = sig.num_args + len(sig.kwarg_names)
    return (tuple(flat[:sig.num_args]), dict(zip(sig.kwarg_names, flat[sig.num_args:k])),
            tuple(flat[k:]))


def model_output(out):
    """What a loss reads from a model's output: ``.logits`` of a transformers output, the
    first element of a tuple, or the tensor itself."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


class TrainingModule(nn.Module):
    """model + loss as one module: forward(*flat inputs) -> scalar loss.

    The flat inputs are the model's positional arguments, its keyword arguments and the
    loss targets (``CallSignature``). The loss is ``loss_fn(outputs, *targets)``; without a
    loss_fn it is ``target_loss`` when targets are given and ``next_token_loss`` on the
    first input otherwise (the language-model default). HF transformers models are called
    with ``use_cache=False`` and their ``.logits`` taken; an encoder-decoder model called
    with token ids alone gets the same ids as decoder input (synthetic sequence-to-sequence).
    With ``loss=False`` forward returns the model's outputs instead (eval).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None,
                 signature: CallSignature | None = None, *, loss: bool = True):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.signature = signature
        self.with_loss = loss
        params = inspect.signature(model.forward).parameters
        self._kwargs = {"use_cache": False} if "use_cache" in params else {}
        config = getattr(model, "config", None)
        self._seq2seq = bool(getattr(config, "is_encoder_decoder", False))

    def forward(self, *inputs):
        sig = self.signature or CallSignature(len(inputs))
        args, kwargs, targets = unflatten_call(inputs, sig)
        if self._seq2seq and len(args) == 1 and not kwargs:
            out = self.model(input_ids=args[0], decoder_input_ids=args[0], **self._kwargs)
        else:
            out = self.model(*args, **kwargs, **self._kwargs)
        out = model_output(out)
        if not self.with_loss:
            return out
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if targets:
            return target_loss(out, *targets)
        first = args[0] if args else next(iter(kwargs.values()))
        return next_token_loss(out, first)


_WRAPPER_PREFIX = "model."


def export_training_graph(model: nn.Module, example_inputs: Inputs,
                          loss_fn: LossFn | None = None, *, example_targets=(),
                          signature: CallSignature | None = None,
                          loss: bool = True) -> torch.export.ExportedProgram:
    """Export model + loss with torch.export (non-strict). Raises TraceError naming the op.

    ``example_inputs`` is a tensor, a tuple (positional arguments) or a dict (keyword
    arguments); ``example_targets`` go only to the loss. ``signature`` says that
    ``example_inputs`` is already flat (as ``flatten_call`` made it)."""
    if signature is None:
        flat, signature = flatten_call(example_inputs, example_targets)
    else:
        flat = tuple(example_inputs)
    # one tensor passed twice (ids as input and as target) would be one placeholder used
    # twice in the export, a graph unlike the one every later call (distinct tensors) makes
    seen: set[int] = set()
    flat = tuple(x.clone() if id(x) in seen or seen.add(id(x)) else x for x in flat)
    wrapped = TrainingModule(model, loss_fn, signature, loss=loss)
    try:
        return torch.export.export(wrapped, flat, strict=False)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one clear TraceError
        raise TraceError(_explain_trace_failure(exc, model)) from exc


def trace(model: nn.Module, example_inputs: Inputs, *, loss_fn: LossFn | None = None,
          example_targets=(), model_name: str = "") -> OpGraph:
    """Trace ``model`` (+ loss) on ``example_inputs`` (and ``example_targets``) into an
    OpGraph; the convention of the inputs is ``export_training_graph``'s."""
    flat, signature = flatten_call(example_inputs, example_targets)
    ep = export_training_graph(model, flat, loss_fn, signature=signature)
    graph = graph_from_export(ep, model, model_name=model_name or type(model).__name__)
    return dataclasses.replace(graph, signature=signature)


# -- building the OpGraph ------------------------------------------------------------------

def graph_from_export(ep: torch.export.ExportedProgram, model: nn.Module, *,
                      model_name: str = "") -> OpGraph:
    sig = ep.graph_signature
    placeholder_to_param = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    trainable = set(sig.inputs_to_parameters.values())
    block_path, block_len = find_repeated_blocks(model)

    params: list[ParamInfo] = []
    seen_storage: dict[int, str] = {}
    for p_name, p in _named_tensors(model):
        tied = seen_storage.get(id(p))
        seen_storage.setdefault(id(p), p_name)
        params.append(ParamInfo(name=p_name, shape=tuple(p.shape), dtype=_dtype(p.dtype),
                                trainable=_WRAPPER_PREFIX + p_name in trainable, tied_to=tied))

    inputs: list[tuple[str, TensorMeta]] = []
    nodes: list[OpNode] = []
    param_of: dict[str, str] = {}
    output_name = ""
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in placeholder_to_param:
                param_of[node.name] = placeholder_to_param[node.name].removeprefix(_WRAPPER_PREFIX)
            else:
                inputs.append((node.name, _tensor_meta(node.meta.get("val"))[0]))
            continue
        if node.op == "output":
            outs = [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
            output_name = outs[0].name if outs else ""
            continue
        if node.op != "call_function":
            continue
        nodes.append(_make_node(node, param_of, block_path))

    nodes = _drop_dead_asserts(nodes)
    fingerprints = _layer_fingerprints(nodes, block_len)
    return OpGraph(nodes=tuple(nodes), params=tuple(params), inputs=tuple(inputs),
                   output=output_name, layer_fingerprints=fingerprints,
                   block_module=block_path, model_name=model_name)


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)


def _make_node(node: torch.fx.Node, param_of: dict[str, str], block_path: str) -> OpNode:
    target = _target_name(node.target)
    arg_nodes = [a for a in node.all_input_nodes]
    inputs = tuple(param_of.get(a.name, a.name) for a in arg_nodes)
    params = tuple(param_of[a.name] for a in arg_nodes if a.name in param_of)
    outputs = _tensor_meta(node.meta.get("val"))
    in_bytes = sum(m.bytes for a in arg_nodes for m in _tensor_meta(a.meta.get("val")))
    kind = classify(target)
    module_path = _module_path(node)
    return OpNode(
        name=node.name, target=target, kind=kind, inputs=inputs, outputs=outputs,
        flops=forward_flops(node, target), bytes_read=0 if kind == OpKind.VIEW else in_bytes,
        bytes_written=0 if kind == OpKind.VIEW else sum(m.bytes for m in outputs),
        params=params, module_path=module_path,
        layer=_layer_index(module_path, block_path), source=_user_source(node),
        args_repr=_args_repr(node),
    )


def _drop_dead_asserts(nodes: list[OpNode]) -> list[OpNode]:
    return [n for n in nodes if not n.target.startswith("aten._assert")]


# -- operator classes and FLOPs -------------------------------------------------------------

_KIND_PATTERNS: tuple[tuple[OpKind, re.Pattern], ...] = tuple(
    (kind, re.compile(pattern)) for kind, pattern in (
        (OpKind.ATTENTION, r"aten\.(_?scaled_dot_product|_flash_attention|_efficient_attention)"),
        (OpKind.MATMUL, r"aten\.(mm|addmm|bmm|baddbmm|linear|matmul|einsum|_scaled_mm)\."),
        (OpKind.EMBEDDING, r"aten\.embedding\."),
        (OpKind.NORM, r"aten\.(layer_norm|rms_norm|native_layer_norm|group_norm|_fused_rms_norm)"),
        (OpKind.SOFTMAX, r"aten\.(_?softmax|_?log_softmax)\."),
        (OpKind.LOSS, r"aten\.(cross_entropy_loss|nll_loss)"),
        (OpKind.REDUCTION, r"aten\.(sum|mean|amax|amin|max|min|var|std|norm|cumsum|argmax|all|any)\."),
        (OpKind.VIEW, r"aten\.(view|_unsafe_view|reshape|transpose|t|permute|split|split_with_sizes|"
                      r"chunk|cat|stack|slice|select|expand|unsqueeze|squeeze|flatten|unflatten|"
                      r"contiguous|clone|alias|detach|to|_to_copy|index|narrow|unbind|movedim)\."),
        (OpKind.CREATION, r"aten\.(arange|zeros|ones|full|empty|new_ones|new_zeros|new_full|"
                          r"new_empty|scalar_tensor|tensor|ones_like|zeros_like|full_like|tril|triu)"),
        (OpKind.VIEW, r"^(<built-in function getitem>|getitem)$"),
    )
)


def classify(target: str) -> OpKind:
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(target):
            return kind
    if target.startswith("aten."):
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


def forward_flops(node: torch.fx.Node, target: str) -> int:
    """Forward FLOPs of one node.

    torch.utils.flop_counter's registry has formulas for mm/addmm/bmm/baddbmm and the fused
    attention kernels; the composite ops an exported training graph keeps (linear, matmul,
    einsum, scaled_dot_product_attention) are counted here with the same convention
    (2 FLOPs per multiply-add, only matmul-class work counted).
    """
    from torch.utils.flop_counter import flop_registry

    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args]
    out = node.meta.get("val")
    packet = getattr(node.target, "overloadpacket", None)
    if packet in flop_registry:
        try:
            return int(flop_registry[packet](*vals, out_val=out, **_kwarg_vals(node)))
        except Exception:  # noqa: BLE001 - fall through to our own formulas
            pass
    if not isinstance(out, torch.Tensor):
        return 0
    if target in ("aten.linear.default", "aten.matmul.default"):
        k = vals[0].shape[-1]
        return 2 * out.numel() * k
    if target.startswith("aten.einsum"):
        operands = vals[1]
        total = 1
        for d in set("".join(vals[0].split("->")[0].split(","))) - set(" "):
            for spec, t in zip(vals[0].split("->")[0].split(","), operands):
                if d in spec.strip():
                    total *= t.shape[spec.strip().index(d)]
                    break
        return 2 * total
    if target.startswith("aten.scaled_dot_product_attention"):
        q, k = vals[0], vals[1]
        batch = q.numel() // (q.shape[-2] * q.shape[-1])
        # QK^T and softmax(QK^T) V: two matmuls of (Sq x D) by (D x Sk)
        return 4 * batch * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return 0


def _kwarg_vals(node: torch.fx.Node) -> dict:
    return {k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v)
            for k, v in node.kwargs.items()}


# -- repeated layers ------------------------------------------------------------------------

def find_repeated_blocks(model: nn.Module) -> tuple[str, int]:
    """The ModuleList whose children hold the most parameters: the transformer blocks."""
    best, best_len, best_params = "", 0, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            n = sum(p.numel() for p in mod.parameters())
            if n > best_params:
                best, best_len, best_params = name, len(mod), n
    return best, best_len


def _layer_index(module_path: str, block_path: str) -> int:
    if not block_path or not module_path.startswith(block_path + "."):
        return -1
    head = module_path[len(block_path) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def _layer_fingerprints(nodes: list[OpNode], num_layers: int) -> tuple[str, ...]:
    """A structural fingerprint per layer: ops, shapes and in-layer wiring, names stripped."""
    import hashlib

    per_layer: dict[int, list[OpNode]] = {i: [] for i in range(num_layers)}
    for n in nodes:
        if n.layer >= 0:
            per_layer.setdefault(n.layer, []).append(n)
    out = []
    for i in sorted(per_layer):
        members = per_layer[i]
        local = {n.name: j for j, n in enumerate(members)}
        h = hashlib.sha256()
        for n in members:
            wiring = [local.get(x, "ext") for x in n.inputs]
            h.update(repr((n.target, wiring, [(o.shape, o.dtype) for o in n.outputs],
                           n.args_repr, len(n.params))).encode())
        out.append(h.hexdigest()[:16])
    return tuple(out)


# -- small helpers --------------------------------------------------------------------------

def _target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" \
            else f"{target.namespace}.{target._opname}.{target._overloadname}"
    return str(target)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_meta(val) -> tuple[TensorMeta, ...]:
    if isinstance(val, torch.Tensor):
        return (TensorMeta(tuple(int(s) for s in val.shape), _dtype(val.dtype)),)
    if isinstance(val, (tuple, list)):
        return tuple(m for v in val for m in _tensor_meta(v))
    return ()


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.removeprefix("L['self'].").replace("L__self__", "")
    # strip the TrainingModule wrapper's "model" only: Llama's own inner module is also
    # called "model" ("model.model.layers.0" -> "model.layers.0", matching block_module)
    return "" if path == "model" else path.removeprefix(_WRAPPER_PREFIX)


def _user_source(node: torch.fx.Node) -> str:
    trace_text = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace_text)
    for path, line in reversed(frames):
        if not _is_library_frame(path):
            return f"{path}:{line}"
    return f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""


def _args_repr(node: torch.fx.Node) -> str:
    def keep(a):
        if isinstance(a, torch.fx.Node):
            return "%"
        if isinstance(a, (list, tuple)):
            return [keep(x) for x in a]
        if isinstance(a, (int, float, bool, str)) or a is None:
            return a
        if isinstance(a, torch.device):
            return "device"  # the same model traced on meta or on a real device is the same plan
        return str(a)
    return repr((keep(list(node.args)), {k: keep(v) for k, v in sorted(node.kwargs.items())}))


_OWN_DIRS = (os.path.dirname(os.path.abspath(__file__)),
             os.path.dirname(os.path.abspath(meshplan.errors.__file__)))


def _is_library_frame(path: str) -> bool:
    """torch's own frames and meshplan's are never the 'user line' an error should name."""
    return "/torch/" in path or path.startswith(_OWN_DIRS) or path.startswith("<")


def _explain_trace_failure(exc: Exception, model: nn.Module) -> str:
    """Name the operator or module and the user's source line that stopped tracing."""
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if not _is_library_frame(f.filename)]
    where = f"{user[-1].filename}:{user[-1].lineno} ({user[-1].line.strip()})" if user else \
        "an unknown line"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    op = re.search(r"(aten\.\w+(\.\w+)?|torch\.\w+(\.\w+)*)", str(exc))
    op_text = f" in operator {op.group(1)}" if op else ""
    return (f"cannot trace {type(model).__name__}{op_text} at {where}: {first[:300]}. "
            "Make that code traceable by torch.export (no data-dependent Python control flow, "
            "no .item()/.tolist() on tensors, no calls into non-PyTorch libraries), or wrap it "
            "so forward takes and returns tensors.")
