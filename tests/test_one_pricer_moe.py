"""One pricer for mixture-of-experts plans (issue 39): the pipeline search's objective for
the expert-parallel plan it returns equals ``meshplan.estimate`` of that plan (both price
the routed experts with costmodel/moe.py through ``estimate.stage_cost``), and expert
parallelism's terms move the price the way their mechanisms say."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import meshplan
from meshplan.costmodel import moe
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.specs import parse_mesh_spec, parse_model_spec, training_call

# the module traces a small Qwen3-MoE once (about 10 s alone, 50 s on the shared machine) and
# runs two pipeline searches: slow (still run in CI)
pytestmark = pytest.mark.slow

QWEN3_MOE = ("transformers:qwen3_moe?hidden_size=256&intermediate_size=512"
             "&moe_intermediate_size=128&num_hidden_layers=2&num_attention_heads=4"
             "&num_key_value_heads=2&head_dim=64&vocab_size=1024&num_experts=16"
             "&num_experts_per_tok=4")


@pytest.fixture(scope="module")
def traced():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parse_model_spec(QWEN3_MOE).build("meta")
        call = training_call(model, 32, 128)
        graph = meshplan.trace(model, call.inputs, example_targets=call.targets,
                               model_name=QWEN3_MOE)
    return model, graph


def test_moe_layers_are_read_from_the_graph(traced):
    _, graph = traced
    layers = moe.moe_layers(graph)
    assert sorted(layers) == [0, 1]
    m = layers[0]
    assert (m.experts, m.top_k, m.hidden) == (16, 4.0, 256)
    assert m.pairs == 32 * 128 * 4
    # gate_up (16, 256, 2 x 128) and down (16, 128, 256)
    assert m.numel == 16 * 256 * 256 + 16 * 128 * 256


@pytest.mark.parametrize("ep", [2, 8])
def test_search_objective_is_the_estimate_for_expert_parallel_plans(traced, ep):
    from meshplan.planner.hybrid import plan_auto, search_space

    model, graph = traced
    mesh = parse_mesh_spec("dgx-h100:nodes=2")
    space = dataclasses.replace(search_space(), expert_parallel=(ep,))
    plan = plan_auto(graph, mesh, dtype="bf16", space=space, single_stage_ilp=False,
                     engine="modules", margin=0)
    assert all(st.ep == ep for st in plan.stages)
    estimated = meshplan.estimate(plan, graph).step_time_s
    assert plan.predicted.step_time_s == pytest.approx(estimated, rel=1e-9)
    assert plan.solver.objective_s == pytest.approx(estimated, rel=0.01)


def test_expert_parallelism_moves_the_price_by_its_mechanisms(traced):
    model, graph = traced
    mesh = parse_mesh_spec("dgx-h100:nodes=2")
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=16, microbatch_size=2, zero=1,
                                dtype="bf16")
    hw = HardwareProfile.from_dict(plan.mesh.hardware)

    def at(ep):
        p = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, ep=ep)
                                                   for s in plan.stages))
        return p, meshplan.estimate(p, graph)

    _, e1 = at(1)
    p8, e8 = at(8)
    p16, e16 = at(16)
    # the experts' state divides over ep x efsdp: less memory per device at ep 8
    assert e8.memory.params_gib < e1.memory.params_gib
    # the all-to-all: inside a node at ep 8, across nodes (InfiniBand) at ep 16
    from meshplan.costmodel.runtime_profiles import plan_runtime
    rt = plan_runtime(p8, hw)
    t8 = moe.ep_cost_terms(p8.stages[0], graph, hw, dtype="bf16", optimizer="adam",
                           microbatches=p8.training.microbatches, runtime=rt)
    t16 = moe.ep_cost_terms(p16.stages[0], graph, hw, dtype="bf16", optimizer="adam",
                            microbatches=p16.training.microbatches, runtime=rt)
    assert 0 < t8.a2a_fwd_s < t16.a2a_fwd_s
    # tokens per local expert grow with ep (ep x the tokens of one rank / experts)
    assert t16.tokens_per_expert == pytest.approx(2 * t8.tokens_per_expert)
    # a stack that hides the all-to-all (DualPipe) exposes none of it
    hidden = moe.ep_cost_terms(p8.stages[0], graph, hw, dtype="bf16", optimizer="adam",
                               microbatches=p8.training.microbatches,
                               runtime=dataclasses.replace(rt, ep_a2a_overlap=1.0))
    assert hidden.a2a_exposed_s == 0 and t8.a2a_exposed_s == pytest.approx(
        t8.a2a_fwd_s + t8.a2a_bwd_s)


def test_all_to_all_across_nodes_is_bound_by_the_slower_link():
    hw = parse_mesh_spec("dgx-h800:nodes=8").hardware
    nbytes = 64e6
    # 64 ranks over 8 nodes: 56/64 of the bytes leave the node at 50 GB/s per GPU
    t = moe.all_to_all_s(hw, nbytes, 64)
    ib = nbytes * 56 / 64 / (hw.inter_node.bandwidth_gbps * 1e9)
    assert t == pytest.approx(ib + 56 * hw.inter_node.latency_s, rel=1e-6)
    # inside one node: NVLink's ring price, far below
    assert moe.all_to_all_s(hw, nbytes, 8) < t / 5
