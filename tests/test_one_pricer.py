"""One pricer: the search's objective for the plan it returns equals ``meshplan.estimate`` of
that plan, for the engine that will run it (issue 27).

trace -> cost -> **solve** -> assemble. Models are generated (GPT-2 with dropout, which the
graph engine runs; Llama without, which the module engine runs), meshes span a DGX A100
node, two DGX H100 nodes and 4 local CPU processes (contention priced). The pipeline
search prices ranges of layers affinely (planner/stagecost.py) and the plan in full, so the
two agree up to the affine terms' error, which must stay under 1%.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest

import meshplan
from meshplan.specs import example_inputs, parse_mesh_spec, parse_model_spec

MODELS = {
    "gpt2": "transformers:gpt2?n_layer={L}&n_embd={H}&n_head=4&vocab_size=1024&n_positions=128",
    "llama": ("transformers:llama?hidden_size={H}&intermediate_size={F}&num_hidden_layers={L}"
              "&num_attention_heads=4&num_key_value_heads=2&vocab_size=1024"
              "&max_position_embeddings=128"),
}
MESHES = ("dgx-a100-80gb:nodes=1", "dgx-h100:nodes=2", "local:4")
CASES = [(f, layers, width, mesh) for f, (layers, width), mesh in itertools.product(
    MODELS, ((2, 128), (4, 64)), MESHES)]
TOLERANCE = 0.01


def _plan(family: str, layers: int, width: int, mesh_spec: str):
    spec = MODELS[family].format(L=layers, H=width, F=4 * width)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parse_model_spec(spec).build("meta")
        graph = meshplan.trace(model, example_inputs(model, 16, 64), model_name=spec)
        plan = meshplan.autoparallel(model, parse_mesh_spec(mesh_spec), graph=graph)
    return plan, graph


@pytest.mark.parametrize("family,layers,width,mesh", CASES)
def test_search_objective_is_the_estimate(family, layers, width, mesh):
    plan, graph = _plan(family, layers, width, mesh)
    # the pipeline search's plan, or the single-stage ILP's (priced at the graph engine's
    # prices, re-priced for the engine that runs it when that is another one)
    estimated = meshplan.estimate(plan, graph).step_time_s
    assert plan.predicted.step_time_s == pytest.approx(estimated, rel=1e-9)
    assert plan.solver.objective_s == pytest.approx(estimated, rel=TOLERANCE), (
        f"{plan.engine} engine, pp={plan.num_stages}, {plan.training.schedule}: the search "
        f"priced {plan.solver.objective_s:.6g} s, estimate says {estimated:.6g} s")


def test_module_engine_plans_are_searched_as_the_module_engine():
    """A Llama (no dropout) runs on the module engine: the search priced that engine, so
    the plan's objective is the module engine's estimate, not the graph engine's."""
    plan, graph = _plan("llama", 2, 128, "dgx-a100-80gb:nodes=1")
    assert plan.engine == "modules"
    assert plan.solver.objective_s == pytest.approx(meshplan.estimate(plan, graph).step_time_s,
                                                    rel=TOLERANCE)


ILP_CASES = [(f, layers, width, mesh) for f, (layers, width), mesh in itertools.product(
    MODELS, ((2, 256), (4, 64)), MESHES)]


@pytest.mark.parametrize("family,layers,width,mesh", ILP_CASES)
def test_ilp_objective_is_the_estimate(family, layers, width, mesh):
    """The single-stage ILP prices each candidate with the estimate's own parts (operators,
    input edges, parameters, the optimizer, flat-buffer and per-block latencies as fixed
    charges, one ZeRO level and dp axis for the stage), so its objective is the estimate
    of the plan it returns."""
    from meshplan.planner.singlestage import plan_single_stage

    spec = MODELS[family].format(L=layers, H=width, F=4 * width)
    mesh_obj = parse_mesh_spec(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parse_model_spec(spec).build("meta")
        graph = meshplan.trace(model, example_inputs(model, 16, 64), model_name=spec)
        dtype = "fp32" if mesh.startswith("local") else "bf16"
        plan = plan_single_stage(graph, mesh_obj, dtype=dtype)
    assert plan.solver.name.startswith("meshplan-intra-ilp") and plan.solver.status == "optimal"
    estimated = meshplan.estimate(plan, graph).step_time_s
    assert plan.solver.objective_s == pytest.approx(estimated, rel=TOLERANCE), (
        f"zero={plan.stages[0].zero}: the ILP priced {plan.solver.objective_s:.6g} s, "
        f"estimate says {estimated:.6g} s")


def test_a_tied_weight_read_under_its_other_name_syncs_its_gradient():
    """GPT-2's embedding reads ``lm_head.weight`` (tied to ``transformer.wte.weight``): the
    estimate counts the weight once and all-reduces its gradient over dp like every other
    trainable weight (it priced no sync for it when its readers were looked up under the
    kept name only)."""
    from meshplan.costmodel.comm import Collective
    from meshplan.costmodel.estimate import CollectivePrices, plan_stage_costs
    from meshplan.costmodel.hardware import HardwareProfile

    spec = MODELS["gpt2"].format(L=2, H=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = parse_model_spec(spec).build("meta")
        inputs = example_inputs(model, 16, 64)
        graph = meshplan.trace(model, inputs, model_name=spec)
        plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=inputs,
                                    graph=graph, dp=4, tp=1, pp=1, microbatch_size=4)
    plan = dataclasses.replace(plan, engine="graph")  # one flat all-reduce after the backward
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    tied = {p.name for p in graph.params if p.tied_to is not None}
    assert tied and any(i in tied for n in graph.nodes for i in n.inputs)  # read by its tied name
    # every trainable weight read by an operator split over dp, once (tied names as one)
    canonical = {p.name: p.tied_to or p.name for p in graph.params}
    split_read = {canonical[i] for n in graph.nodes for i in n.inputs
                  if i in canonical and plan.stages[0].ops[n.name].output[0] != "R"}
    assert "transformer.wte.weight" in split_read
    grads = sum(graph.param_map[p].numel * 4 for p in split_read if graph.param_map[p].trainable)
    flat = CollectivePrices(plan.stages[0], hw, backend="gloo")(Collective.ALL_REDUCE, grads, 0)
    assert plan_stage_costs(plan, graph, hw)[0].grad_sync_s == pytest.approx(flat, rel=1e-9)
