"""Layer clusters: the units the pipeline planner cuts the model into.

trace -> cost -> solve (**clusters** -> planner/inter) -> run. A transformer's operator graph
is the embedding, a run of repeated blocks (``node.layer`` >= 0, identified by
``graph.layer_fingerprints``) and the head (final norm, output projection, loss). Pipeline
stages are contiguous block ranges; by the plan convention the first stage also holds the
embedding and the last stage the head, so the embedding is folded into the first unit and
the head into the last.

When a model has more blocks than the planner should consider as cut points
(``max_units``), neighbouring blocks are merged into units of balanced cost: the linear
partition that minimises the largest unit's forward FLOPs (the same balancing idea as
Alpa's operator clustering, Zheng et al. OSDI'22, section 5.2, applied to whole blocks).

Every unit carries a structural ``key``: two block ranges with equal keys cost the same on
equal submeshes, so stage costs are computed once per key, not once per range.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import PlanningError
from meshplan.graph import OpGraph


@dataclass(frozen=True, slots=True)
class LayerUnit:
    """A run of consecutive blocks ``layers = [first, last)`` and every operator they own."""

    index: int
    layers: tuple[int, int]
    nodes: tuple[str, ...]  # every operator of the unit, graph order
    flops: int  # forward FLOPs of the unit's operators
    param_numel: int  # trainable parameters read first by this unit
    key: str  # structural identity: equal keys cost the same
    has_embedding: bool = False
    has_head: bool = False

    def __post_init__(self):
        if self.layers[0] > self.layers[1]:
            raise ValueError(f"unit {self.index}: layers {self.layers} is not a range")


def node_segments(graph: OpGraph) -> tuple[tuple[str, ...], list[list[str]], tuple[str, ...]]:
    """Split the graph's operators into (embedding, per-block lists, head).

    Operators outside any block that sit between blocks (a residual add some models keep at
    the top level) belong to the block before them; those before the first block are the
    embedding; those after the last block are the head.
    """
    num = graph.num_layers
    blocks: list[list[str]] = [[] for _ in range(num)]
    first_block = next((i for i, n in enumerate(graph.nodes) if n.layer >= 0), None)
    last_block = max((i for i, n in enumerate(graph.nodes) if n.layer >= 0), default=None)
    if first_block is None:
        return tuple(n.name for n in graph.nodes), blocks, ()
    pre = tuple(n.name for n in graph.nodes[:first_block] if n.layer < 0)
    post = tuple(n.name for n in graph.nodes[last_block + 1:] if n.layer < 0)
    current = 0
    for n in graph.nodes[first_block:last_block + 1]:
        if n.layer >= 0:
            current = max(current, n.layer)
            blocks[n.layer].append(n.name)
        else:
            blocks[current].append(n.name)
    # operators of a block created before the first block (hoisted creation ops) stay in pre
    return pre, blocks, post


def layer_units(graph: OpGraph, *, max_units: int | None = None) -> tuple[LayerUnit, ...]:
    """The partitioning units of ``graph``: one per block (embedding folded into the first,
    head into the last), merged into at most ``max_units`` cost-balanced units."""
    if max_units is not None and max_units < 1:
        raise PlanningError(f"max_units={max_units} must be at least 1")
    pre, blocks, post = node_segments(graph)
    num = graph.num_layers
    if num == 0:  # no repeated blocks: the whole model is one unit
        return (_unit(graph, 0, (0, 0), pre, "whole", True, True),)
    per_block = [_flops(graph, b) for b in blocks]
    per_block[0] += _flops(graph, pre)
    per_block[-1] += _flops(graph, post)
    bounds = balanced_bounds(per_block, min(max_units or num, num))
    units = []
    for u, (first, last) in enumerate(bounds):
        names: list[str] = []
        if first == 0:
            names += pre
        for b in range(first, last):
            names += blocks[b]
        if last == num:
            names += post
        key = "|".join(graph.layer_fingerprints[first:last])
        units.append(_unit(graph, u, (first, last), tuple(names), key, first == 0, last == num))
    return tuple(units)


def balanced_bounds(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Cut ``costs`` into ``parts`` contiguous non-empty ranges minimising the largest sum
    (exact linear-partition DP, O(parts x n^2)); ties keep earlier cuts."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise PlanningError(f"cannot cut {n} blocks into {parts} units; choose 1..{n}")
    if parts == n:
        return [(i, i + 1) for i in range(n)]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for k in range(p, n - (parts - p) + 1):
            for i in range(p - 1, k):
                value = max(best[p - 1][i], prefix[k] - prefix[i])
                if value < best[p][k]:
                    best[p][k], cut[p][k] = value, i
    bounds, k = [], n
    for p in range(parts, 0, -1):
        i = cut[p][k]
        bounds.append((i, k))
        k = i
    return bounds[::-1]


def _flops(graph: OpGraph, names) -> int:
    return sum(graph.node(n).flops for n in names)


def _unit(graph: OpGraph, index: int, layers: tuple[int, int], names: tuple[str, ...],
          key: str, has_embedding: bool, has_head: bool) -> LayerUnit:
    seen: set[str] = set()
    numel = 0
    pmap = graph.param_map
    for name in names:
        for p in graph.node(name).params:
            info = pmap.get(p)
            if info is None or p in seen or not info.trainable or info.tied_to is not None:
                continue
            seen.add(p)
            numel += info.numel
    edge = ("E" if has_embedding else "") + ("H" if has_head else "")
    return LayerUnit(index=index, layers=layers, nodes=names, flops=_flops(graph, names),
                     param_numel=numel, key=f"{key}#{edge}", has_embedding=has_embedding,
                     has_head=has_head)
