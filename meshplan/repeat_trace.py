"""Tracing a model of many identical blocks from an export of three of them.

trace -> OpGraph: ``meshplan.tracing.trace`` exports the whole training step with
torch.export, which costs about 60 ms per GPT-3 block on this machine (5.5 s of the 96-block
model's 5.9 s trace; profile in benchmarks/results/planner_profiles_issue27.md). The blocks
of a transformer are one module class with equal shapes and settings, and their operators
are one subgraph repeated with other parameter names. So a copy of the model that keeps its
first ``KEPT`` blocks (on the same, shared, submodules: nothing is allocated) is exported,
and the OpGraph of the whole model is written from it: the prologue and blocks 0 and 1 as
exported, block 2 as the template of blocks 2 .. L-1 (its inputs from block 1 read the
block before, those from block 0 read block 0, parameters renamed to the block's own) and
the epilogue reading the last block. Operator names are the ones torch.fx gives in graph
order (``torch.fx.graph._Namespace``, a private API: one counter per base name), so every
name, input, shape, FLOP count, parameter and module path equals the full export's
(tests/test_tracing_repeat.py compares them on GPT-2 and Llama).

Every assumption is checked, and any doubt returns None (the caller exports the whole
model): one stack of one block class whose settings agree apart from the layer index
(HF's ``layer_idx``), a uniform HF ``layer_types``, operators in prologue / block 0 / 1 /
2 / epilogue order, blocks 1 and 2 equal operator by operator, no reads of block 1's
parameters from block 2, the epilogue reading only the last block, and torch.fx's naming
rule reproducing the small export's names. A forward that branches on the layer index with
a period longer than two, with no attribute or config entry saying so, is the one case the
checks cannot see; ``trace(..., repeat=False)`` exports the whole model.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import torch.nn as nn

from meshplan import export_graph, export_program
from meshplan.graph import OpGraph, OpNode, ParamInfo
from meshplan.opcount import warn_uncounted

KEPT = 3  # blocks exported: block 0 (read by later blocks, as T5's position bias), 1, 2
MIN_BLOCKS = 8  # fewer blocks: the whole export costs at most ~2.7x the three-block one
# attributes that number a block and that forwards read only to index caches (HF's
# ``layer_idx``, torchtitan's ``layer_id`` and its init scale, Megatron's ``layer_number``)
INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "weight_init_std"})
_SUFFIX = re.compile(r"(.*)_(\d+)$")  # torch.fx's name suffix (graph._Namespace)


def repeated_graph(model: nn.Module, flat: tuple, loss_fn, signature, *,
                   model_name: str = "", min_blocks: int = MIN_BLOCKS) -> OpGraph | None:
    """The OpGraph ``export_graph.graph_from_export`` would build from the whole model's export,
    written from an export of its first ``KEPT`` blocks; None when a check fails."""
    paths = export_graph.find_block_paths(model)
    container = paths[0].rpartition(".")[0] if paths else ""
    if len(paths) < max(min_blocks, KEPT + 1) or \
            any(p.rpartition(".")[0] != container for p in paths):
        return None  # too few blocks for a gain, or several stacks (T5's)
    parent = model.get_submodule(container) if container else model
    if list(parent._modules) != [p.rpartition(".")[2] for p in paths] or \
            not _blocks_alike(model, paths):
        return None
    small = _with_blocks(model, container, KEPT)
    try:
        ep = export_program.export_training_graph(small, flat, loss_fn, signature=signature)
    except Exception:  # noqa: BLE001 - a model that needs all its blocks (or any other
        return None    # failure): the whole export runs, and names what fails if it does
    return _replicated(ep, model, paths, container, model_name)


def _blocks_alike(model: nn.Module, paths) -> bool:
    """Every block one class, with equal attributes (the layer index aside) and parameter
    shapes in every submodule, and a uniform HF ``layer_types``."""
    config = getattr(model, "config", None)
    if len(set(getattr(config, "layer_types", None) or ())) > 1:
        return False
    first = None
    for path in paths:
        sig = []
        for name, m in model.get_submodule(path).named_modules(remove_duplicate=False):
            attrs = []
            for k, v in vars(m).items():
                if k in ("_parameters", "_buffers", "_modules") or k in INDEX_ATTRS or \
                        k in export_program._UNTRACED_ATTRS or isinstance(v, nn.Module):
                    continue
                if hasattr(v, "to_json_string") and hasattr(v, "_attn_implementation"):
                    v = id(v)  # one HF config shared by the blocks
                frozen = export_program._frozen(v, {})
                if frozen is export_program._UNKNOWN:
                    return False
                attrs.append((k, frozen))
            tensors = tuple((k, tuple(t.shape), t.dtype, t.requires_grad)
                            for table in (m._parameters, m._buffers)
                            for k, t in table.items() if t is not None)
            sig.append((name, type(m), tuple(attrs), tensors, m._forward_hooks.keys(),
                        m._forward_pre_hooks.keys()))
        sig = repr(sig)
        if first is None:
            first = sig
        elif sig != first:
            return False
    return True


def _with_blocks(model: nn.Module, container: str, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose block container holds its first ``keep`` blocks
    (the same module objects; the modules on the path to it are copied, nothing else)."""
    root = copy.copy(model)
    root._modules = dict(root._modules)
    node = root
    parts = container.split(".") if container else []
    for part in parts:
        child = copy.copy(node._modules[part])
        child._modules = dict(child._modules)
        node._modules[part] = child
        node = child
    node._modules = dict(list(node._modules.items())[:keep])
    return root


def _replicated(ep, model: nn.Module, paths, container: str, model_name: str):
    sig = ep.graph_signature
    param_of = {ph: name.removeprefix(export_program.WRAPPER_PREFIX) for ph, name in
                {**sig.inputs_to_parameters, **sig.inputs_to_buffers,
                 **sig.inputs_to_lifted_tensor_constants}.items()}
    blocks = {path: i for i, path in enumerate(paths[:KEPT])}
    fx_nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    nodes = [export_graph._make_node(n, param_of, blocks) for n in fx_nodes]
    outs = [a for a in next(n for n in ep.graph.nodes if n.op == "output").args[0]
            if hasattr(a, "name")]
    # regions: prologue (-1), blocks 0, 1, 2, epilogue (-1), in this order
    layers = [n.layer for n in nodes]
    starts = [layers.index(b) if b in layers else -1 for b in range(KEPT)]
    if -1 in starts:
        return None
    ends = [len(layers) - layers[::-1].index(b) for b in range(KEPT)]
    cuts = [0, starts[0], ends[0], ends[1], ends[2], len(nodes)]
    if any(a != b for a, b in zip(ends[:-1], starts[1:])):
        return None
    region = [nodes[cuts[i]:cuts[i + 1]] for i in range(5)]
    pro, b0, b1, b2, epi = region
    if any(n.layer != -1 for n in pro + epi) or not all(
            all(n.layer == i for n in r) for i, r in enumerate((b0, b1, b2))):
        return None
    bases = [_base(n.name) for n in nodes]
    if _names(bases) != [n.name for n in nodes]:
        return None  # torch.fx named this export otherwise than the rule assumed
    where = {n.name: (r, i) for r, nodes_r in enumerate(region) for i, n in enumerate(nodes_r)}
    pre = [p + "." for p in paths]
    if not _template_ok(b1, b2, where, pre) or any(
            where.get(x, (4,))[0] in (1, 2) or x.startswith(tuple(pre[:KEPT]))
            for n in epi for x in n.inputs):
        return None

    # the whole model: names from the rule over the full sequence of base names
    L = len(paths)
    b2_bases = bases[cuts[3]:cuts[4]]
    full_bases = bases[:cuts[3]] + b2_bases * (L - 2) + bases[cuts[4]:]
    names = _names(full_bases)
    out: list[OpNode] = list(pro + b0 + b1)
    name_of: dict[tuple[int, int], str] = {}  # (layer, position) -> name, for blocks >= 1
    for i, n in enumerate(b1):
        name_of[(1, i)] = n.name
    k = len(out)
    for layer in range(2, L):
        for i, t in enumerate(b2):
            name_of[(layer, i)] = names[k]
            k += 1
    k = len(out)
    for layer in range(2, L):
        for i, t in enumerate(b2):
            def move(x: str, layer=layer) -> str:
                r, j = where.get(x, (None, None))
                if r == 3:
                    return name_of[(layer, j)]
                if r == 2:
                    return name_of[(layer - 1, j)]
                return _rename_param(x, pre[2], pre[layer])
            out.append(dataclasses.replace(
                t, name=names[k], inputs=tuple(move(x) for x in t.inputs),
                params=tuple(_rename_param(p, pre[2], pre[layer]) for p in t.params),
                module_path=_rename_path(t.module_path, paths[2], paths[layer]), layer=layer))
            k += 1
    epi_names = {}
    for t in epi:
        epi_names[t.name] = names[k]

        def move(x: str) -> str:
            r, j = where.get(x, (None, None))
            if r == 3:
                return name_of[(L - 1, j)]
            return epi_names.get(x, x)
        out.append(dataclasses.replace(t, name=names[k], inputs=tuple(move(x) for x in t.inputs)))
        k += 1
    output = outs[0].name if outs else ""
    output = epi_names.get(output, output)

    small_trainable = {v.removeprefix(export_program.WRAPPER_PREFIX)
                       for v in sig.inputs_to_parameters.values()}
    params: list[ParamInfo] = []
    seen: dict[int, str] = {}
    for p_name, p in model.named_parameters(remove_duplicate=False):
        tied = seen.get(id(p))
        seen.setdefault(id(p), p_name)
        as_small = p_name
        for layer in range(KEPT, L):
            if p_name.startswith(pre[layer]):
                as_small = pre[2] + p_name[len(pre[layer]):]
                break
        params.append(ParamInfo(name=p_name, shape=tuple(p.shape),
                                dtype=export_graph._dtype(p.dtype),
                                trainable=as_small in small_trainable, tied_to=tied))
    inputs = [(n.name, export_graph._tensor_meta(n.meta.get("val"))[0]) for n in ep.graph.nodes
              if n.op == "placeholder" and n.name in set(sig.user_inputs)]
    kept = export_graph._drop_dead_asserts(out)
    full = export_graph._in_run_order(kept, L)
    if full is not kept:
        return None  # blocks that run out of registration order
    warn_uncounted(full, model_name or type(model).__name__)
    return OpGraph(nodes=tuple(full), params=tuple(params), inputs=tuple(inputs), output=output,
                   layer_fingerprints=export_graph._layer_fingerprints(full, L),
                   block_module=container, model_name=model_name)


def _template_ok(b1: list[OpNode], b2: list[OpNode], where: dict, pre: list[str]) -> bool:
    """Blocks 1 and 2 are one subgraph: the same operators, shapes, arguments and module
    paths relative to the block, and inputs that correspond (block 2's from block 1 where
    block 1's are from block 0; from block 0 or the prologue alike)."""
    if len(b1) != len(b2):
        return False
    for x, y in zip(b1, b2):
        if (x.target, x.kind, x.outputs, x.flops, x.bytes_read, x.bytes_written, x.source,
                x.args_repr, _base(x.name), len(x.inputs), len(x.params)) != \
                (y.target, y.kind, y.outputs, y.flops, y.bytes_read, y.bytes_written, y.source,
                 y.args_repr, _base(y.name), len(y.inputs), len(y.params)):
            return False
        if _rename_path(x.module_path, pre[1][:-1], pre[2][:-1]) != y.module_path:
            return False
        for a, b in zip(x.inputs, y.inputs):
            ra, rb = where.get(a, (None, None)), where.get(b, (None, None))
            if rb[0] == 3:  # within block 2: within block 1 at the same place
                ok = ra == (2, rb[1])
            elif rb[0] == 2:  # from the block before: block 0 for block 1
                ok = ra == (1, rb[1])
            elif rb[0] == 1:  # from block 0 itself
                ok = ra == rb
            elif rb[0] is None:  # a parameter, buffer or graph input
                if b.startswith(pre[1]):
                    return False  # block 2 reads block 1's parameter
                ok = _rename_param(a, pre[1], pre[2]) == b
            else:  # the prologue
                ok = a == b
            if not ok:
                return False
    return True


def _rename_param(name: str, old: str, new: str) -> str:
    return new + name[len(old):] if name.startswith(old) else name


def _rename_path(path: str, old: str, new: str) -> str:
    if path == old:
        return new
    return new + path[len(old):] if path.startswith(old + ".") else path


def _base(name: str) -> str:
    m = _SUFFIX.match(name)
    return m.group(1) if m else name


def _names(bases: list[str]) -> list[str]:
    """The names torch.fx gives operators created in this order with these base names."""
    from torch.fx.graph import _Namespace

    ns = _Namespace()
    return [ns.create_name(b, None) for b in bases]
