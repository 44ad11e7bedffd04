"""Split the exported training graph into pipeline stages at the plan's node boundaries.

trace -> cost -> solve -> plan -> **run**. A pure torch.fx pass: one ``fx.Graph`` (model +
loss, in graph order) and the plan's per-stage ``(first, last)`` node names in, one small
graph per stage out. Every value that crosses a stage boundary is made explicit: stage
``k`` takes, as positional inputs, exactly the values stage ``k - 1`` returns, and returns
every value produced at stage ``k`` or earlier that a later stage reads. A value read two or
more stages later (the token ids the loss reads at the last stage) passes through the stages
in between, because ``torch.distributed.pipelining`` sends only from stage ``k`` to stage
``k + 1``. The last stage returns the graph's output (the loss).

Values built from shapes, constants and buffers alone (``shape_only_nodes``: a causal mask,
position ids, Llama's rotary cos/sin) never cross a boundary: each stage that reads one
recomputes it from a copy of its operators, which costs a few cheap operators instead of one
point-to-point send per tensor per microbatch. The cost model already prices boundaries this
way: costmodel/estimate.py counts only values that depend on a graph input or a parameter
(``OpGraph.data_nodes``).

Parameters stay ``get_attr`` nodes; the runtime builds each stage's module from a
``{target: parameter}`` dict, so a parameter read by two stages (tied embeddings) appears in
both and its gradient is summed by the runtime. A ``get_attr`` of a submodule is the body of a
higher-order operator (Llama's rotary embedding runs under ``wrap_with_set_grad_enabled``):
it is listed apart, in ``subgraph_targets``, and the runtime hands the stage the module itself.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from meshplan.errors import NotSupportedError, PlanFileError

GRAPH_INPUTS = -1  # producer "stage" of the graph's own inputs: fed to stage 0 by the schedule
# Higher-order operators that only run their body (under a grad or autocast mode): pure when
# the body is. Others (e.g. run_with_rng_state) are never recomputed.
_BODY_ONLY_HOPS = frozenset({"wrap", "wrap_with_set_grad_enabled", "wrap_with_autocast"})
# Operators whose schema annotates no write but which update their running-statistics buffers
# in training (torch 2.13 keeps them un-decomposed in the exported training graph).
_UNANNOTATED_WRITES = frozenset({"aten::batch_norm", "aten::instance_norm"})
# Operators returning uninitialised memory: two copies need not hold the same values.
_UNINITIALISED = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                            "aten::empty_permuted", "aten::new_empty", "aten::new_empty_strided"})


@dataclass(frozen=True, slots=True)
class StageGraph:
    """One pipeline stage: ``graph`` maps ``inputs`` (positional) to ``outputs`` (a tuple)."""

    index: int
    graph: fx.Graph
    inputs: tuple[str, ...]  # names of received values: graph input names or node names
    outputs: tuple[str, ...]  # names of values sent on; the last stage: the graph output
    param_targets: tuple[str, ...]  # get_attr targets the stage reads (parameters, buffers)
    subgraph_targets: tuple[str, ...] = ()  # get_attr targets of higher-order operator bodies
    recomputed: tuple[str, ...] = ()  # shape-only operators of earlier stages copied here


def split_stages(graph: fx.Graph, boundaries: Sequence[tuple[str, str]]) -> list[StageGraph]:
    """Cut ``graph`` into ``len(boundaries)`` stages; ``boundaries[k]`` = (first, last) node names
    of stage ``k`` in graph order, the stages covering every operator in order."""
    stage_of = assign_stages(graph, boundaries)
    rebuilt = shape_only_nodes(graph)
    num_stages = len(boundaries)
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        for user in node.users:
            use = num_stages - 1 if user.op == "output" else stage_of.get(user)
            if use is not None:
                last_use[node] = max(last_use.get(node, GRAPH_INPUTS), use)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    carried: list[list[fx.Node]] = []  # carried[k]: values stage k sends to stage k + 1
    for k in range(num_stages - 1):
        carried.append([n for n in graph.nodes if n.op in ("placeholder", "call_function")
                        and n not in rebuilt  # each reader rebuilds these itself
                        and _producer(n, stage_of) <= k < last_use.get(n, GRAPH_INPUTS)])
    for values in carried:
        for n in values:
            _check_sendable(n)
    results = graph.output_node().all_input_nodes  # the loss

    stages = []
    for k in range(num_stages):
        received = placeholders if k == 0 else carried[k - 1]
        sent = carried[k] if k < num_stages - 1 else None
        stages.append(_stage_graph(graph, k, stage_of, received, sent, results, rebuilt))
    return stages


def shape_only_nodes(graph: fx.Graph, *, frozen_params: bool = False) -> set[fx.Node]:
    """Operators whose value depends on no graph input and no parameter: only on shapes,
    constants and buffers (a causal mask, position ids, rotary cos/sin).

    Every operator on the way is deterministic (no random op such as dropout or randperm, no
    uninitialised ``empty``), writes nothing (no mutable schema), and reads only buffers that
    no operator of the graph writes, so any stage can recompute the value and get the one the
    whole graph computes. A higher-order operator counts when it only runs a body made of such
    operators. Parameters count as inputs even when frozen: the plan places a parameter only
    in the stages that read it (``frozen_params=True`` counts parameters that need no
    gradient as buffers: the runtime's executor, which places buffers as frozen parameters,
    folds such values once per stage). ``graph.owning_module`` resolves ``get_attr``
    targets; without one, nothing that reads an attribute qualifies.
    """
    owner = graph.owning_module
    written_nodes = _written_nodes(graph, owner)
    written = {n.target for n in written_nodes if n.op == "get_attr"}
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and n not in written_nodes and \
                _recomputable_target(n.target) and all(
                a in out or _readable_attr(a, owner, written, frozen_params)
                for a in n.all_input_nodes):
            out.add(n)
    return out


def _recomputable_target(target) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name() in _BODY_ONLY_HOPS  # its body, a get_attr input, is checked apart
    if isinstance(target, torch._ops.OpOverload):
        return not (target._schema.is_mutable or target._schema.name in _UNINITIALISED
                    or target._schema.name in _UNANNOTATED_WRITES
                    or torch.Tag.nondeterministic_seeded in target.tags)
    return False  # a Python function: unknown


def _readable_attr(node: fx.Node, owner: nn.Module | None, written: set[str],
                   frozen_params: bool = False) -> bool:
    """A ``get_attr`` any stage may read: a buffer or constant no operator writes, or the body
    of a higher-order operator made only of recomputable operators."""
    if node.op != "get_attr" or owner is None or node.target in written:
        return False
    value = _attr(owner, node.target)
    if isinstance(value, fx.GraphModule):
        return _pure_body(value)
    return isinstance(value, torch.Tensor) and not (
        isinstance(value, nn.Parameter) and (value.requires_grad or not frozen_params))


def _pure_body(body: fx.GraphModule) -> bool:
    written = _written_targets(body.graph, body)
    return all(n.op in ("placeholder", "output")
               or (n.op == "get_attr" and _readable_attr(n, body, written))
               or (n.op == "call_function" and _recomputable_target(n.target))
               for n in body.graph.nodes)


def writes_in_place(target) -> bool:
    """Whether an operator may write its arguments (a mutable schema, or BatchNorm's
    un-annotated update of its running statistics)."""
    return isinstance(target, torch._ops.OpOverload) and (
        target._schema.is_mutable or target._schema.name in _UNANNOTATED_WRITES)


def written_attrs(graph: fx.Graph, owner: nn.Module | None) -> list[fx.Node]:
    """``get_attr`` nodes (buffers) some operator of ``graph`` may write, in graph order."""
    written = _written_nodes(graph, owner)
    return [n for n in graph.nodes if n.op == "get_attr" and n in written]


def _written_targets(graph: fx.Graph, owner: nn.Module | None) -> set[str]:
    """``get_attr`` targets some operator of ``graph`` may write."""
    return {n.target for n in _written_nodes(graph, owner) if n.op == "get_attr"}


def _written_nodes(graph: fx.Graph, owner: nn.Module | None) -> set[fx.Node]:
    """Nodes whose storage some operator of ``graph`` may write: those behind an argument of a
    mutable operator (or of a higher-order operator with an impure body), through views, and
    every view of them. A value written in place after it is made is not a constant."""
    written: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if isinstance(n.target, torch._ops.OpOverload):
            writes = n.target._schema.is_mutable or n.target._schema.name in _UNANNOTATED_WRITES
        elif isinstance(n.target, torch._ops.HigherOrderOperator):
            writes = not _pure_hop(n, owner)
        else:  # getitem, or the runtime's own pure functions (sdpa_math)
            writes = False
        if not writes:
            continue
        stack = _write_args(n)
        while stack:  # a write through a view writes its base
            a = stack.pop()
            if a in written:
                continue
            written.add(a)
            if a.op == "call_function" and _may_alias(a.target):
                stack.extend(a.all_input_nodes)
    for n in graph.nodes:  # and every view of a written value sees the write
        if n.op == "call_function" and _may_alias(n.target) and \
                any(a in written for a in n.all_input_nodes):
            written.add(n)
    return written


def _write_args(n: fx.Node) -> list[fx.Node]:
    """The inputs a writing operator may write: those its schema marks written (``a!``), or
    all of them where the schema does not say (running statistics, higher-order bodies)."""
    target = n.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        out = []
        for i, arg in enumerate(target._schema.arguments):
            value = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                out += [v for v in (value if isinstance(value, (list, tuple)) else [value])
                        if isinstance(v, fx.Node)]
        return out
    return list(n.all_input_nodes)


def _pure_hop(node: fx.Node, owner: nn.Module | None) -> bool:
    """A higher-order operator that only runs bodies made of recomputable operators."""
    if node.target.name() not in _BODY_ONLY_HOPS or owner is None:
        return False
    bodies = [_attr(owner, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
    return all(_pure_body(b) for b in bodies if isinstance(b, fx.GraphModule))


def _may_alias(target) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in target._schema.returns)
    return False


def _attr(owner: nn.Module, target: str):
    try:
        return functools.reduce(getattr, target.split("."), owner)
    except AttributeError:
        return None


def assign_stages(graph: fx.Graph, boundaries: Sequence[tuple[str, str]]) -> dict[fx.Node, int]:
    """Stage index of every operator node; checks that the boundaries tile the graph in order."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    position = {n.name: i for i, n in enumerate(ops)}
    for k, (first, last) in enumerate(boundaries):
        for name in (first, last):
            if name not in position:
                raise PlanFileError(f"stage {k} names node {name!r}, which is not in the traced "
                                    "graph; the plan was made for another model or torch version "
                                    "(re-plan with this model)")
    starts = [position[first] for first, _ in boundaries]
    ends = [position[last] for _, last in boundaries]
    expected_start = 0
    for k, (start, end) in enumerate(zip(starts, ends)):
        if start != expected_start or end < start:
            want = ops[expected_start].name if expected_start < len(ops) else "(end of graph)"
            raise PlanFileError(f"stage {k} spans nodes {boundaries[k][0]}..{boundaries[k][1]}, but "
                                f"stages must tile the graph in order: stage {k} should start at "
                                f"{want}; fix the plan's stage node ranges")
        expected_start = end + 1
    if expected_start != len(ops):
        raise PlanFileError(f"the last stage ends at {boundaries[-1][1]}, before the graph's last "
                            f"operator {ops[-1].name}; the stages must cover the whole graph")
    return {n: k for k, (start, end) in enumerate(zip(starts, ends)) for n in ops[start:end + 1]}


def _producer(node: fx.Node, stage_of: dict[fx.Node, int]) -> int:
    return GRAPH_INPUTS if node.op == "placeholder" else stage_of[node]


def _check_sendable(node: fx.Node) -> None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise NotSupportedError(f"node {node.name} ({node.target}) yields a "
                                f"{type(val).__name__}, not a tensor, and is read across a "
                                "pipeline stage boundary; move the boundary so that only "
                                "tensors cross it")


def _stage_graph(graph: fx.Graph, k: int, stage_of: dict[fx.Node, int],
                 received: list[fx.Node], sent: list[fx.Node] | None,
                 results: list[fx.Node], rebuilt: set[fx.Node]) -> StageGraph:
    sent = sent if sent is not None else results
    own = [n for n in graph.nodes if stage_of.get(n) == k]
    copies = _recomputed_here(graph, own, sent, k, stage_of, rebuilt)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in received:
        env[n] = new.placeholder(n.name)
        env[n].meta = dict(n.meta)
    targets: list[str] = []
    subgraphs: list[str] = []

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op != "get_attr":
                raise AssertionError(f"stage {k}: {n.name} is neither received nor computed here")
            env[n] = new.get_attr(n.target)
            env[n].meta = dict(n.meta)
            (subgraphs if _is_submodule(graph, n.target) else targets).append(n.target)
        return env[n]

    for n in copies + own:  # copies first: they come from earlier stages, so precede ``own``
        env[n] = new.node_copy(n, lookup)
    new.output(tuple(lookup(n) for n in sent))
    new.lint()
    return StageGraph(index=k, graph=new, inputs=tuple(n.name for n in received),
                      outputs=tuple(n.name for n in sent), param_targets=tuple(targets),
                      subgraph_targets=tuple(subgraphs),
                      recomputed=tuple(n.name for n in copies))


def _recomputed_here(graph: fx.Graph, own: list[fx.Node], sent: list[fx.Node], k: int,
                     stage_of: dict[fx.Node, int], rebuilt: set[fx.Node]) -> list[fx.Node]:
    """The shape-only operators of other stages that stage ``k`` reads, with their shape-only
    ancestors, in graph order (their other inputs are ``get_attr`` nodes)."""
    stack = [a for n in own for a in n.all_input_nodes]
    stack += sent
    found: set[fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in rebuilt and stage_of[a] != k and a not in found:
            found.add(a)
            stack.extend(a.all_input_nodes)
    return [n for n in graph.nodes if n in found] if found else []


def _is_submodule(graph: fx.Graph, target: str) -> bool:
    """Whether ``get_attr`` ``target`` of ``graph``'s module is a module (a higher-order
    operator's body) rather than a parameter or buffer."""
    owner = graph.owning_module
    if owner is None:
        return False
    try:
        return isinstance(owner.get_submodule(target), torch.nn.Module)
    except AttributeError:  # a parameter or buffer: get_submodule finds no module there
        return False
