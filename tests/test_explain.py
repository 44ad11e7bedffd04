"""explain prices with the estimate's parts (issue 27, one pricer): at the plan's own
placements, its per-operator compute adds up to the estimate's forward + backward +
recompute of every stage, and its pricer's activation collectives to the estimate's
communication, for single-stage and pipelined plans on both engines."""

import warnings

import pytest

import meshplan
from meshplan.costmodel.estimate import operator_pricer, plan_stage_costs
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.explain import as_planned, explain
from meshplan.mesh import Mesh
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec


@pytest.fixture(scope="module")
def plans():
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build("meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = meshplan.trace(model, example_inputs(model, 8, 32), model_name=spec.name)
        mesh = Mesh.local(4)
        kw = dict(graph=graph, microbatch_size=1)
        out = {
            "dp2 tp2": meshplan.manual_plan(model, mesh, dp=2, tp=2, **kw),
            "tp4 full recompute": meshplan.manual_plan(model, mesh, dp=1, tp=4,
                                                       recompute="full", **kw),
            "dp2 pp2 1f1b": meshplan.manual_plan(model, mesh, dp=2, pp=2, **kw),
            "tp2 pp2 gpipe selective": meshplan.manual_plan(
                model, mesh, dp=1, tp=2, pp=2, schedule="gpipe", recompute="selective", **kw),
        }
        from meshplan.planner.singlestage import plan_single_stage

        out["intra-op ILP"] = plan_single_stage(graph, Mesh.local(2), dtype="fp32", time_limit_s=5)
    return out, graph


@pytest.mark.parametrize("name", ["dp2 tp2", "tp4 full recompute", "dp2 pp2 1f1b",
                                  "tp2 pp2 gpipe selective", "intra-op ILP"])
def test_explain_prices_the_estimates_operators(plans, name):
    all_plans, graph = plans
    plan = all_plans[name]
    costs = plan_stage_costs(plan, graph, HardwareProfile.from_dict(plan.mesh.hardware))
    m = plan.training.microbatches
    for i, c in enumerate(costs):
        priced = as_planned(plan, graph, i)
        compute = sum(v[0] for v in priced.values())
        assert compute == pytest.approx(m * (c.forward_s + c.backward_s + c.recompute_s),
                                        rel=1e-9), (plan.engine, i)
        pricer = operator_pricer(plan, graph, i)
        activations = sum(pricer.input_comm_s(graph.node(n), op)
                          for n, op in pricer.stage.ops.items())
        if plan.num_stages == 1 and plan.stages[0].zero < 3:  # no send/recv, no ZeRO-3 gathers
            assert activations == pytest.approx(c.comm_s, rel=1e-9, abs=1e-15), plan.engine


def test_explains_chosen_row_is_the_priced_operator(plans):
    all_plans, graph = plans
    plan = all_plans["dp2 tp2"]
    [e] = explain(plan, graph, node="addmm")
    chosen = next(a for a in e.alternatives if a.chosen)
    compute, comm, _ = as_planned(plan, graph, 0)["addmm"]
    assert (chosen.compute_s, chosen.comm_s) == pytest.approx((compute, comm), rel=1e-12)


@pytest.mark.parametrize("cp", [1, 2])
def test_explain_prices_parameters_as_the_estimate_does(cp, monkeypatch):
    """Under a runtime that shards ZeRO over dp x cp (Megatron-LM), explain's per-operator
    state adds up to the estimate's weights + gradients + optimizer state, with or without
    cp (it divided the optimizer state by dp alone). Activations are left out of explain's
    memory column here by pricing them at 0 bytes per element."""
    import meshplan.explain as explain_module
    from meshplan.costmodel.compute import DTYPE_BYTES

    monkeypatch.setattr(explain_module, "DTYPE_BYTES", {**DTYPE_BYTES, "bf16": 0})
    model = parse_model_spec(
        "transformers:llama?hidden_size=256&intermediate_size=512&num_hidden_layers=2&"
        "num_attention_heads=4&num_key_value_heads=2&vocab_size=1024&"
        "max_position_embeddings=256").build("meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = meshplan.trace(model, example_inputs(model, 8, 256))
    plan = meshplan.manual_plan(model, Mesh.preset("dgx-h100", nodes=1), graph=graph,
                                dp=8 // cp, cp=cp, dtype="bf16", zero=1, engine="megatron")
    state = sum(gib for _, _, gib in as_planned(plan, graph, 0).values())
    m = plan.predicted.memory
    assert state == pytest.approx(m.params_gib + m.grads_gib + m.optimizer_gib, rel=1e-6)
