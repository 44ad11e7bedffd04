"""The OpGraph of an exported training step: aten operators in run order with shapes, dtypes,
FLOPs (meshplan/opcount.py), module paths and repeated-block index, and the blocks found in
the model (``find_block_paths``).

trace -> cost -> solve -> run. The graph half of ``meshplan.tracing`` (the export is
meshplan/export_program.py); split from meshplan/tracing.py so that meshplan/repeat_trace.py
imports no module above it (issue 40).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
import torch.nn as nn

from meshplan.graph import OpGraph, OpKind, OpNode, ParamInfo, TensorMeta
from meshplan.opcount import classify, forward_flops, warn_uncounted
from meshplan.export_program import WRAPPER_PREFIX, _is_library_frame


def graph_from_export(ep: torch.export.ExportedProgram, model: nn.Module, *,
                      model_name: str = "") -> OpGraph:
    sig = ep.graph_signature
    # parameters, buffers and lifted tensor constants (Falcon's index tensors) are read by
    # name like buffers; only the user's inputs are graph inputs
    placeholder_to_param = {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                            **sig.inputs_to_lifted_tensor_constants}
    user_inputs = set(sig.user_inputs)
    trainable = set(sig.inputs_to_parameters.values())
    block_paths = find_block_paths(model)
    blocks = {path: i for i, path in enumerate(block_paths)}
    block_path, _ = find_repeated_blocks(model)

    params: list[ParamInfo] = []
    seen_storage: dict[int, str] = {}
    for p_name, p in _named_tensors(model):
        tied = seen_storage.get(id(p))
        seen_storage.setdefault(id(p), p_name)
        params.append(ParamInfo(name=p_name, shape=tuple(p.shape), dtype=_dtype(p.dtype),
                                trainable=WRAPPER_PREFIX + p_name in trainable, tied_to=tied))

    inputs: list[tuple[str, TensorMeta]] = []
    nodes: list[OpNode] = []
    param_of: dict[str, str] = {}
    output_name = ""
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in placeholder_to_param:
                param_of[node.name] = placeholder_to_param[node.name].removeprefix(WRAPPER_PREFIX)
            elif node.name in user_inputs:
                inputs.append((node.name, _tensor_meta(node.meta.get("val"))[0]))
            continue
        if node.op == "output":
            outs = [a for a in node.args[0] if isinstance(a, torch.fx.Node)]
            output_name = outs[0].name if outs else ""
            continue
        if node.op != "call_function":
            continue
        nodes.append(_make_node(node, param_of, blocks))

    nodes = _in_run_order(_drop_dead_asserts(nodes), len(block_paths))
    warn_uncounted(nodes, model_name or type(model).__name__)
    fingerprints = _layer_fingerprints(nodes, len(block_paths))
    return OpGraph(nodes=tuple(nodes), params=tuple(params), inputs=tuple(inputs),
                   output=output_name, layer_fingerprints=fingerprints,
                   block_module=block_path, model_name=model_name)


def _named_tensors(model: nn.Module):
    yield from model.named_parameters(remove_duplicate=False)


def _make_node(node: torch.fx.Node, param_of: dict[str, str],
               blocks: Mapping[str, int]) -> OpNode:
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
        layer=_layer_index(module_path, blocks), source=_user_source(node),
        args_repr=_args_repr(node),
    )


def _in_run_order(nodes: list[OpNode], num_blocks: int) -> list[OpNode]:
    """Layer indices renumbered in the order the blocks first run (a decoder stack registered
    before its encoder still gets the later indices); blocks that never run go last."""
    order = list(dict.fromkeys(n.layer for n in nodes if n.layer >= 0))
    order += [i for i in range(num_blocks) if i not in set(order)]
    if order == list(range(num_blocks)):
        return nodes
    new = {old: i for i, old in enumerate(order)}
    return [dataclasses.replace(n, layer=new[n.layer]) if n.layer >= 0 else n for n in nodes]


def _drop_dead_asserts(nodes: list[OpNode]) -> list[OpNode]:
    return [n for n in nodes if not n.target.startswith("aten._assert")]


# -- repeated layers ------------------------------------------------------------------------

STACK_SHARE = 0.25  # a further stack counts when it holds >= 1/4 of the largest one's parameters


def find_block_paths(model: nn.Module) -> tuple[str, ...]:
    """Module paths of the repeated blocks, one per layer index, in registration order.

    A *stack* is an ``nn.ModuleList`` or numbered ``nn.ModuleDict`` of modules that hold
    parameters, or any other module (``nn.Sequential``) with two or more such children, all named by
    numbers and of one class. The stack with the most parameters holds the blocks; further
    stacks outside it and outside each other with at least ``STACK_SHARE`` of its
    parameters count too, so the encoder and the decoder of T5 or BART are both block runs
    (encoder blocks first: the order modules are registered in, the order they run in)."""
    stacks = []
    for order, (name, mod) in enumerate(model.named_modules()):
        children = [(k, c) for k, c in mod.named_children()
                    if next(c.parameters(), None) is not None]
        # a ModuleDict of named parts (nanoGPT's ``transformer = ModuleDict(wte=..., h=...)``)
        # holds the whole model, not blocks: only a numbered one (torchtitan's) is a stack
        container = isinstance(mod, nn.ModuleList) or isinstance(mod, nn.ModuleDict) and \
            all(k.isdigit() for k, _ in children)
        if not children or not container and (
                len(children) < 2 or len({type(c) for _, c in children}) != 1
                or not all(k.isdigit() for k, _ in children)):
            continue
        numel = sum(p.numel() for _, c in children for p in c.parameters())
        stacks.append((numel, order, name, [k for k, _ in children]))
    chosen: list[tuple[int, str, list[str]]] = []
    for numel, order, name, keys in sorted(stacks, key=lambda s: (-s[0], s[1])):
        if chosen and numel < STACK_SHARE * max(stacks)[0]:
            break
        if any(_nested(name, other) for _, other, _ in chosen):
            continue
        chosen.append((order, name, keys))
    return tuple(f"{name}.{k}" if name else k for _, name, keys in sorted(chosen) for k in keys)


def find_repeated_blocks(model: nn.Module) -> tuple[str, int]:
    """(container path, block count) of the main stack: the one holding the first block
    among those with the most blocks (``find_block_paths``); the runtime's recompute
    segments read blocks under this one prefix."""
    paths = find_block_paths(model)
    if not paths:
        return "", 0
    parents = [p.rpartition(".")[0] for p in paths]
    best = max(dict.fromkeys(parents), key=parents.count)
    return best, parents.count(best)


def _nested(a: str, b: str) -> bool:
    return a == b or not a or not b or a.startswith(b + ".") or b.startswith(a + ".")


def _layer_index(module_path: str, blocks: Mapping[str, int]) -> int:
    """The layer index of the innermost block that ``module_path`` lies in, -1 outside."""
    parts = module_path.split(".")
    for k in range(len(parts), 0, -1):
        layer = blocks.get(".".join(parts[:k]))
        if layer is not None:
            return layer
    return -1


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
    return "" if path == "model" else path.removeprefix(WRAPPER_PREFIX)


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
