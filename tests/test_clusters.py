"""Layer units (planner/clusters) on hand-built graphs: segments, folding, cost balance."""

from __future__ import annotations

import pytest

from meshplan.errors import PlanningError
from meshplan.planner.clusters import balanced_bounds, layer_units, node_segments
from meshplan.graph import OpGraph, OpKind, OpNode, ParamInfo, TensorMeta

T = (TensorMeta((2, 4), "float32"),)


def _graph(num_layers: int, flops=None) -> OpGraph:
    nodes = [OpNode("emb", "aten.embedding.default", OpKind.EMBEDDING, ("inputs_0",), T,
                    flops=5, params=("wte",))]
    prev = "emb"
    for i in range(num_layers):
        f = (flops or [10] * num_layers)[i]
        nodes.append(OpNode(f"mm_{i}", "aten.mm.default", OpKind.MATMUL, (prev,), T, flops=f,
                            params=(f"h.{i}.w",), layer=i))
        nodes.append(OpNode(f"add_{i}", "aten.add.Tensor", OpKind.ELEMENTWISE, (f"mm_{i}", prev),
                            T, flops=1, layer=-1))  # a top-level residual between blocks
        prev = f"add_{i}"
    nodes.append(OpNode("head", "aten.mm.default", OpKind.MATMUL, (prev,), T, flops=7,
                        params=("wte",)))
    params = [ParamInfo("wte", (8, 4), "float32")] + \
        [ParamInfo(f"h.{i}.w", (4, 4), "float32") for i in range(num_layers)]
    return OpGraph(nodes=tuple(nodes), params=tuple(params),
                   inputs=(("inputs_0", TensorMeta((2, 4), "int64")),), output="head",
                   layer_fingerprints=tuple("same" for _ in range(num_layers)))


def test_segments_fold_between_block_ops_into_the_block_before():
    pre, blocks, post = node_segments(_graph(3))
    assert pre == ("emb",) and post == ("add_2", "head")  # after the last block: the head
    assert blocks == [["mm_0", "add_0"], ["mm_1", "add_1"], ["mm_2"]]


def test_units_fold_embedding_and_head_and_cover_every_node():
    g = _graph(4)
    units = layer_units(g)
    assert [u.layers for u in units] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert units[0].has_embedding and units[-1].has_head
    assert sorted(n for u in units for n in u.nodes) == sorted(n.name for n in g.nodes)
    # middle blocks are structurally equal, the edges are not
    assert units[1].key == units[2].key != units[0].key != units[3].key
    assert units[0].param_numel == 32 + 16 and units[1].param_numel == 16


def test_merging_balances_cost():
    g = _graph(6, flops=[40, 1, 1, 1, 1, 40])
    units = layer_units(g, max_units=3)
    assert [u.layers for u in units] == [(0, 1), (1, 5), (5, 6)]
    assert sum(u.flops for u in units) == g.forward_flops


def test_balanced_bounds_is_optimal_by_brute_force():
    import itertools
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    for parts in range(1, 9):
        got = balanced_bounds(costs, parts)
        best = min(max(sum(costs[a:b]) for a, b in zip((0, *c), (*c, 8)))
                   for c in itertools.combinations(range(1, 8), parts - 1))
        assert max(sum(costs[a:b]) for a, b in got) == best


def test_bad_unit_counts_are_refused():
    with pytest.raises(PlanningError):
        layer_units(_graph(2), max_units=0)
    with pytest.raises(PlanningError):
        balanced_bounds([1, 2], 3)
