"""NCCL's all-reduce algorithms (issue 14): the ring's 2 (n-1) latency steps against the
double binary tree's 2 log2(nodes) inter-node steps, chosen per buffer size and group as
NCCL's tuner does (NVIDIA/nccl src/graph/tuning.cc); gloo has only the ring."""

import math

import pytest

import meshplan
from meshplan.costmodel.comm import Collective, collective_time_s

A_INTER, BW_INTER = 2e-05, 50.0  # dgx-h100 preset: inter_node latency_s, bandwidth_gbps


@pytest.fixture(scope="module")
def hw():
    return meshplan.Mesh.preset("dgx-h100", nodes=1).hardware


def test_small_buffer_on_many_nodes_goes_by_tree(hw):
    """1 KiB over 1,024 GPUs, one per node: the ring pays 2 x 1,023 latencies (41 ms), the
    tree 2 x log2(1,024) = 20 (0.4 ms)."""
    n = 1024
    ring = collective_time_s(hw, Collective.ALL_REDUCE, 1024, n, crosses_nodes=True)
    tree = collective_time_s(hw, Collective.ALL_REDUCE, 1024, n, crosses_nodes=True, tree=True)
    assert ring == pytest.approx(2 * (n - 1) * A_INTER, rel=1e-3)
    bandwidth = 2 * (n - 1) / n * 1024 / (BW_INTER * 1e9) * n / (0.9 * (n - 1))
    assert tree == pytest.approx(2 * math.log2(n) * A_INTER + bandwidth, rel=1e-6)


def test_large_buffer_goes_by_ring(hw):
    """1 GiB over 16 GPUs on 16 nodes: both pay little latency, and the tree's bandwidth
    (0.45 of the bus bandwidth) loses to the ring's n / 2 (n-1)."""
    nbytes, n = 2 ** 30, 16
    ring = collective_time_s(hw, Collective.ALL_REDUCE, nbytes, n, crosses_nodes=True)
    assert collective_time_s(hw, Collective.ALL_REDUCE, nbytes, n, crosses_nodes=True,
                             tree=True) == ring


def test_tree_is_all_reduce_only_and_nccl_only(hw):
    """NCCL runs all-gather and reduce-scatter as rings; without ``tree`` (gloo) even a
    tiny all-reduce pays the ring's latency."""
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        assert collective_time_s(hw, kind, 1024, 512, crosses_nodes=True, tree=True) == \
            collective_time_s(hw, kind, 1024, 512, crosses_nodes=True)


def test_stage_gradient_sync_uses_the_tree_on_nccl_only():
    """A small model's flat gradient all-reduce over 64 nodes (dp=512): on NCCL it is one
    tree all-reduce of all the gradients (the algorithm picked for the buffer's size, not
    per tensor), far cheaper than the gloo-priced ring on the same hardware."""
    from meshplan.costmodel.estimate import default_runtime, stage_cost
    from meshplan.tracing import trace
    from meshplan.specs import example_inputs, parse_model_spec

    model = parse_model_spec("transformers:gpt2?n_layer=2&n_embd=64&n_head=8&vocab_size=256"
                             "&n_positions=64").build("meta")
    graph = trace(model, example_inputs(model, 512, 32))
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=64)
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=512, microbatch_size=1,
                                dtype="bf16", engine="graph")
    t, st = plan.training, plan.stages[0]
    hwp = mesh.hardware
    sync = {b: stage_cost(st, graph, hwp, dtype=t.dtype, optimizer=t.optimizer,
                          microbatches=t.microbatches, seq_len=t.seq_len,
                          runtime=default_runtime(hwp, engine="graph", backend=b)).grad_sync_s
            for b in ("nccl", "gloo")}
    assert sync["nccl"] < 0.2 * sync["gloo"]
    grads = sum(p.numel for p in graph.params if p.trainable and p.tied_to is None) * 4
    one = collective_time_s(hwp, Collective.ALL_REDUCE, grads, 512, crosses_nodes=True,
                            local_size=8, tree=True)
    latency = collective_time_s(hwp, Collective.ALL_REDUCE, 1e-30, 512, crosses_nodes=True,
                                local_size=8, tree=True)
    assert abs(sync["nccl"] - one) < latency / 2


def test_flat_sync_picks_the_algorithm_for_the_whole_buffer():
    """dp=32 over 4 nodes: each 50-67 MB weight alone, and the whole flat buffer, go by
    ring; the small tensors alone would go by tree. The graph engine syncs one flat buffer,
    so the sync is one ring all-reduce of all the gradients, not per-tensor times with the
    tree's latency taken off (which over-counted the ring's extra latency once per tensor)."""
    from meshplan.costmodel.estimate import default_runtime, stage_cost
    from meshplan.tracing import trace
    from meshplan.specs import example_inputs, parse_model_spec

    model = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=2048&n_head=16&vocab_size=256"
                             "&n_positions=64").build("meta")
    graph = trace(model, example_inputs(model, 32, 32))
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=4)
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=32, microbatch_size=1,
                                dtype="bf16", engine="graph")
    t, hwp = plan.training, mesh.hardware
    sync = stage_cost(plan.stages[0], graph, hwp, dtype=t.dtype, optimizer=t.optimizer,
                      microbatches=t.microbatches, seq_len=t.seq_len,
                      runtime=default_runtime(hwp, engine="graph")).grad_sync_s
    grads = sum(p.numel for p in graph.params if p.trainable and p.tied_to is None) * 4
    kw = dict(crosses_nodes=True, local_size=8)
    one = collective_time_s(hwp, Collective.ALL_REDUCE, grads, 32, tree=True, **kw)
    assert one == collective_time_s(hwp, Collective.ALL_REDUCE, grads, 32, **kw)  # ring
    tiny = collective_time_s(hwp, Collective.ALL_REDUCE, 1e-30, 32, tree=True, **kw)
    assert tiny < collective_time_s(hwp, Collective.ALL_REDUCE, 1e-30, 32, **kw)  # tree
    assert abs(sync - one) < tiny / 2
