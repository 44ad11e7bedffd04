"""Split the exported training graph into pipeline stages at the plan's node boundaries.

trace -> cost -> solve -> plan -> **run**. A pure torch.fx pass: one ``fx.Graph`` (model +
loss, in graph order) and the plan's per-stage ``(first, last)`` node names in, one small
graph per stage out. Every value that crosses a stage boundary is made explicit: stage
``k`` takes, as positional inputs, exactly the values stage ``k - 1`` returns, and returns
every value produced at stage ``k`` or earlier that a later stage reads. A value read two or
more stages later (position ids and the attention mask made in stage 0, the token ids the
loss reads at the last stage) passes through the stages in between, because
``torch.distributed.pipelining`` sends only from stage ``k`` to stage ``k + 1``. The last
stage returns the graph's output (the loss).

Parameters stay ``get_attr`` nodes; the runtime builds each stage's module from a
``{target: parameter}`` dict, so a parameter read by two stages (tied embeddings) appears in
both and its gradient is summed by the runtime. A ``get_attr`` of a submodule is the body of a
higher-order operator (Llama's rotary embedding runs under ``wrap_with_set_grad_enabled``):
it is listed apart, in ``subgraph_targets``, and the runtime hands the stage the module itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshplan.errors import NotSupportedError, PlanFileError

GRAPH_INPUTS = -1  # producer "stage" of the graph's own inputs: fed to stage 0 by the schedule


@dataclass(frozen=True, slots=True)
class StageGraph:
    """One pipeline stage: ``graph`` maps ``inputs`` (positional) to ``outputs`` (a tuple)."""

    index: int
    graph: fx.Graph
    inputs: tuple[str, ...]  # names of received values: graph input names or node names
    outputs: tuple[str, ...]  # names of values sent on; the last stage: the graph output
    param_targets: tuple[str, ...]  # get_attr targets the stage reads (parameters, buffers)
    subgraph_targets: tuple[str, ...] = ()  # get_attr targets of higher-order operator bodies


def split_stages(graph: fx.Graph, boundaries: Sequence[tuple[str, str]]) -> list[StageGraph]:
    """Cut ``graph`` into ``len(boundaries)`` stages; ``boundaries[k]`` = (first, last) node names
    of stage ``k`` in graph order, the stages covering every operator in order."""
    stage_of = assign_stages(graph, boundaries)
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
                        and _producer(n, stage_of) <= k < last_use.get(n, GRAPH_INPUTS)])
    for values in carried:
        for n in values:
            _check_sendable(n)
    results = graph.output_node().all_input_nodes  # the loss

    stages = []
    for k in range(num_stages):
        received = placeholders if k == 0 else carried[k - 1]
        sent = carried[k] if k < num_stages - 1 else None
        stages.append(_stage_graph(graph, k, stage_of, received, sent, results))
    return stages


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
                 results: list[fx.Node]) -> StageGraph:
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

    for n in graph.nodes:
        if stage_of.get(n) == k:
            env[n] = new.node_copy(n, lookup)
    sent = sent if sent is not None else results
    new.output(tuple(lookup(n) for n in sent))
    new.lint()
    return StageGraph(index=k, graph=new, inputs=tuple(n.name for n in received),
                      outputs=tuple(n.name for n in sent), param_targets=tuple(targets),
                      subgraph_targets=tuple(subgraphs))


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
