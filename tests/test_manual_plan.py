"""manual_plan: Megatron-style placements read from the graph, estimates that never raise
for memory, and a 175B model that does not fit 8 GPUs unsharded."""

import pytest
import torch

import meshplan
from meshplan.errors import MeshError, PlanningError
from meshplan.tracing import trace
from meshplan.specs import example_inputs, parse_model_spec

GPT2 = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"


@pytest.fixture(scope="module")
def gpt2():
    model = parse_model_spec(GPT2).build("meta")
    return model, trace(model, example_inputs(model, 8, 32))


def test_megatron_tp_placements(gpt2):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), graph=graph, dp=2, tp=2)
    st = plan.stages[0]
    assert st.mesh_shape == (2, 2) and st.axis_names == ("dp", "tp")
    p = st.params
    assert p["transformer.h.0.attn.c_attn.weight"] == ("R", "S(1)")  # Conv1D column
    assert p["transformer.h.0.attn.c_proj.weight"] == ("R", "S(0)")  # Conv1D row
    assert p["transformer.h.0.mlp.c_fc.weight"] == ("R", "S(1)")
    assert p["transformer.h.0.mlp.c_proj.weight"] == ("R", "S(0)")
    assert p["transformer.h.0.ln_1.weight"] == ("R", "R")
    assert p["lm_head.weight"] == ("R", "S(0)") == p["transformer.wte.weight"]  # vocab-parallel
    outs = {n: st.ops[n].output for n in st.ops}
    row = [n for n in st.ops if graph.node(n).params and
           "attn.c_proj.weight" in " ".join(graph.node(n).params)][0]
    assert outs[row] == ("S(0)", "P")
    assert set(st.ops) == {n.name for n in graph.nodes}
    est = meshplan.estimate(plan)
    assert est.step_time_s > 0 and est.fits


def test_llama_linear_weights_use_out_in_layout():
    spec = parse_model_spec("transformers:llama?hidden_size=64&intermediate_size=128&"
                            "num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=4&"
                            "vocab_size=256")
    model = spec.build("meta")
    graph = trace(model, example_inputs(model, 4, 16))
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), graph=graph, tp=2)
    p = plan.stages[0].params
    assert p["model.layers.0.self_attn.q_proj.weight"] == ("R", "S(0)")  # column, (out, in)
    assert p["model.layers.0.self_attn.o_proj.weight"] == ("R", "S(1)")  # row
    assert p["model.layers.0.mlp.down_proj.weight"] == ("R", "S(1)")


def test_sequence_parallel_reduce_scatters(gpt2):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), graph=graph, tp=2,
                                sequence_parallel=True)
    st = plan.stages[0]
    norm = [n for n in st.ops if graph.node(n).target.startswith("aten.layer_norm")][1]
    assert st.ops[norm].output == ("S(0)", "S(1)")


def test_pipeline_stages_and_zero3(gpt2):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), graph=graph, dp=2, pp=2,
                                zero=3, microbatch_size=2)
    assert [s.layers for s in plan.stages] == [(0, 1), (1, 2)]
    assert plan.stages[1].devices == (2, 3) and plan.training.microbatches == 2
    assert plan.stages[0].params["transformer.h.0.mlp.c_fc.weight"][0].startswith("S(")
    assert plan.predicted.bubble_fraction > 0


def test_memory_falls_with_sharding_and_recompute(gpt2):
    model, graph = gpt2
    mesh = meshplan.Mesh.local(4)
    base = meshplan.manual_plan(model, mesh, graph=graph, dp=4).predicted
    z = meshplan.manual_plan(model, mesh, graph=graph, dp=4, zero=2, engine="graph").predicted
    assert z.memory.optimizer_gib == pytest.approx(base.memory.optimizer_gib / 4)
    # the graph engine accumulates ZeRO-2 gradients full-size (DECISIONS 19); the module
    # engine's fully_shard reduce-scatters them every microbatch (DECISIONS 44)
    assert z.memory.grads_gib == pytest.approx(base.memory.grads_gib)
    zm = meshplan.manual_plan(model, mesh, graph=graph, dp=4, zero=2, engine="modules").predicted
    assert zm.memory.grads_gib == pytest.approx(base.memory.grads_gib / 4)
    z3 = meshplan.manual_plan(model, mesh, graph=graph, dp=4, zero=3).predicted
    # ZeRO-3 shards the weights; in fp32 the module engine's ZeRO-0 holds them twice (the
    # FSDP2 shard beside the gathered copy, DECISIONS 73), the graph engine's once
    plain = meshplan.manual_plan(model, mesh, graph=graph, dp=4, engine="graph").predicted
    assert base.memory.params_gib == pytest.approx(2 * plain.memory.params_gib)
    assert z3.memory.params_gib == pytest.approx(plain.memory.params_gib / 4)
    assert z3.memory.grads_gib == pytest.approx(base.memory.grads_gib / 4)
    full = meshplan.manual_plan(model, mesh, graph=graph, dp=4, recompute="full").predicted
    assert full.memory.activations_gib < base.memory.activations_gib
    assert full.breakdown["recompute"] > 0


def test_bad_degrees_say_the_fix(gpt2):
    model, graph = gpt2
    with pytest.raises(MeshError, match="product is the mesh size"):
        meshplan.manual_plan(model, meshplan.Mesh.local(4), graph=graph, dp=3)
    with pytest.raises(PlanningError, match="choose tp in"):
        meshplan.manual_plan(model, meshplan.Mesh.local(3), graph=graph, tp=3)


def test_175b_unsharded_on_8_gpus_does_not_fit():
    spec = parse_model_spec("gpt3-175b")
    model = spec.build("meta")
    graph = trace(model, (torch.zeros(8, 2048, dtype=torch.long, device="meta"),))
    plan = meshplan.manual_plan(model, meshplan.Mesh.preset("dgx-a100-80gb"), graph=graph, dp=8,
                                dtype="bf16")
    est = plan.predicted
    assert not est.fits
    assert est.memory.params_gib + est.memory.optimizer_gib > 80 * 20
    assert "capacity 80.0 GiB" in est.overflow


def test_zero_1_and_2_pay_for_gathering_the_updated_weights(gpt2):
    """ZeRO-1/2 replace the gradient all-reduce by a reduce-scatter plus an all-gather of the
    updated weights (Rajbhandari et al. 2020): on the same ring that is the same volume, so
    their communication is never below plain data parallelism's."""
    model, graph = gpt2
    mesh = meshplan.Mesh.preset("dgx-a100-80gb")
    comm = {z: meshplan.manual_plan(model, mesh, graph=graph, dp=8, zero=z, dtype="fp32")
            .predicted.breakdown["comm"] for z in (0, 1, 2)}
    assert comm[1] > comm[0] and comm[2] >= 0.99 * comm[0]
