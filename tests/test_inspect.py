"""Reading plans: summary tables, placements in words, explain's alternatives, diff."""

import dataclasses
import re

import pytest

import meshplan
from meshplan.diff import diff_plans, diff_text
from meshplan.errors import SpecError
from meshplan.costmodel.memory import state_bytes_per_param
from meshplan.explain import explain, explain_text
from meshplan.inspect import fmt_mem, split_param_name, summary_text
from meshplan.mesh import Mesh
from meshplan.costmodel.estimate import parameter_part, plan_runtime
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.plan import Plan
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec

GIB = 2.0 ** 30


@pytest.fixture(scope="module")
def plans():
    """Three manual plans of the demo GPT on 4 processes (dp=4; dp=2 x tp=2; dp=2 x pp=2)
    and one the intra-op ILP made for 2, all from one trace."""
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build("meta")
    graph = meshplan.trace(model, example_inputs(model, 8, 32), model_name=spec.name)
    mesh = Mesh.local(4)
    kw = dict(graph=graph, microbatch_size=1)
    dp = meshplan.manual_plan(model, mesh, dp=4, **kw)
    tp = meshplan.manual_plan(model, mesh, dp=2, tp=2, **kw)
    pp = meshplan.manual_plan(model, mesh, dp=2, pp=2, **kw)
    from meshplan.planner.singlestage import plan_single_stage  # the intra-op ILP's plans

    auto = plan_single_stage(graph, Mesh.local(2), dtype="fp32", time_limit_s=5)
    return {"dp": dp, "tp": tp, "pp": pp, "auto": auto, "graph": graph}


def test_summary_reads_top_stages_and_layers(plans):
    dp = plans["dp"]
    text = summary_text(dp)
    for needle in ("predicted step time", "tokens/s", "MFU", "pipeline bubble",
                   "peak memory / device", "of 4.0 GiB", "solver", "manual",
                   "stages (memory per device", "activ", "comm", "placements by layer",
                   "layers 0-1", "batch over axis 0 (dp)", "weights replicated"):
        assert needle in text, needle
    assert text.count("layers 0-1") == 1  # identical layers share one line
    assert dp.summary() == text
    pp = summary_text(plans["pp"])
    assert "layer 0 " in pp and "layer 1 " in pp and "2 / 1f1b" in pp


def test_words_name_the_parallel_style(plans, tmp_path):
    tp = plans["tp"]
    text = summary_text(tp)  # the in-memory plan keeps its graph
    assert "attention qkv: column-parallel over axis 1 (tp)" in text
    assert "mlp down: row-parallel over axis 1 (tp)" in text
    assert "token embedding: vocab-parallel over axis 1 (tp)" in text
    tp.to_json(tmp_path / "tp.json")
    loaded = Plan.from_json(tmp_path / "tp.json")  # no graph: the parameter table only
    text = summary_text(loaded)
    assert "attention qkv: weight split on dim 1 over axis 1 (tp)" in text
    assert "attention qkv: column-parallel" in summary_text(loaded, graph=tp.graph)


def test_split_param_name_and_memory_format():
    assert split_param_name("transformer.h.3.attn.c_attn.weight") == (3, "attn.c_attn")
    assert split_param_name("model.layers.12.self_attn.q_proj.weight") == (12, "self_attn.q_proj")
    assert split_param_name("lm_head.weight") == (-1, "lm_head")
    assert fmt_mem(40.0) == "40.00 GiB" and fmt_mem(0.5) == "512.00 MiB"


def test_diff_prices_each_difference(plans):
    dp, tp = plans["dp"], plans["tp"]
    assert diff_plans(dp, dp).identical
    assert "place everything the same way" in diff_text(diff_plans(dp, dp))
    d = diff_plans(dp, tp)
    assert not d.identical
    by_what = {(x.where, x.what): x for x in d.differences}
    assert (by_what[("stage 0", "mesh shape")].a, by_what[("stage 0", "mesh shape")].b) == \
        ("(4, 1)", "(2, 2)")
    step = by_what[("total", "step time")]
    assert step.time_s == pytest.approx(tp.predicted.step_time_s - dp.predicted.step_time_s)
    layers = by_what[("stage 0", "placements, layers 0-1")]
    assert "mlp up: column-parallel over axis 1 (tp)" in layers.b
    sa, sb = dp.stages[0].predicted, tp.stages[0].predicted
    assert layers.time_s == pytest.approx(sb.compute_s + sb.comm_s - sa.compute_s - sa.comm_s)
    assert layers.memory_gib == pytest.approx(sb.memory.total_gib - sa.memory.total_gib)
    more = dataclasses.replace(tp, training=dataclasses.replace(tp.training, microbatches=2))
    assert tp.training.microbatches != 2
    mb = {x.what: x for x in diff_plans(tp, more).differences}["microbatches"]
    assert (mb.a, mb.b, mb.where) == (str(tp.training.microbatches), "2", "training")
    staged = {x.what: x for x in diff_plans(dp, plans["pp"]).differences}
    assert staged["pipeline stages"].a.startswith("1:") and staged["pipeline stages"].b.startswith("2:")


def test_explain_node_prices_alternatives(plans):
    dp, graph = plans["dp"], plans["graph"]
    [e] = explain(dp, graph, node="addmm")
    assert e.source.startswith("meshplan.explain")  # a manual plan: local re-pricing
    chosen = e.alternatives[0]
    assert chosen.chosen and chosen.verdict == "chosen"
    assert chosen.output == tuple(dp.stages[0].ops["addmm"].output) == ("S(0)", "R")
    by_out = {(a.output, a.weight): a for a in e.alternatives}
    rep = by_out[(("R", "R"), ("R", "R"))]
    node = graph.node("addmm")
    # the weights' state as the estimate counts it (estimate.parameter_part: under fp32 the
    # module engine's FSDP2 keeps its shard beside the gathered copy), plus the output
    hw = HardwareProfile.from_dict(dp.plan.mesh.hardware) if hasattr(dp, "plan") else \
        HardwareProfile.from_dict(dp.mesh.hardware)
    state = 0.0
    for p in node.params:
        part = parameter_part(graph.param_map[p], ("R", "R"), [(("R", "R"), ("R", "R"))], -1,
                              dp.stages[0].mesh_shape, 0, None, zero=0, dtype=dp.training.dtype,
                              optimizer="adam", runtime=plan_runtime(dp, hw))
        state += part.weights_bytes + part.grads_bytes + part.optimizer_bytes
    assert state > state_bytes_per_param(dp.training.dtype, "adam").total * sum(
        graph.param_map[p].numel for p in node.params)  # FSDP2's fp32 shard beside the copy
    assert rep.memory_gib == pytest.approx((state + 4 * node.out.numel) / GIB)
    assert rep.comm_s == 0 and rep.compute_s > chosen.compute_s  # no split: all the work
    col = by_out[(("S(1)", "R"), ("S(1)", "R"))]  # column-parallel over the 4 processes
    assert col.memory_gib == pytest.approx(rep.memory_gib / 4)
    assert all(a.verdict for a in e.alternatives)
    text = explain_text([e], dp)
    assert "* batch over dp" in text and "column over dp" in text


def test_explain_uses_the_solvers_alternatives(plans):
    auto = plans["auto"]
    assert auto.solver.name.startswith("meshplan-intra-ilp")
    [e] = explain(auto, plans["graph"], node="addmm")
    assert e.source.startswith(auto.solver.name)
    assert sum(a.chosen for a in e.alternatives) == 1 and e.alternatives[0].chosen
    assert e.alternatives[0].time_s == pytest.approx(auto.solver.objective_s, rel=1e-6)
    assert "plan time" in explain_text([e], auto)


def test_explain_rules_out_indivisible_placements(plans):
    dp = plans["dp"]
    [e] = explain(dp, plans["graph"], node="embedding_1")  # position embedding: batch dim 1
    bad = [a for a in e.alternatives if a.verdict.startswith("invalid")]
    assert bad and all("not divisible" in a.verdict for a in bad)
    assert any("output dim 0 of size 1 is not divisible by 4" in a.verdict for a in bad)


def test_explain_bad_layer_and_node_list_valid_ones(plans):
    dp, graph = plans["dp"], plans["graph"]
    with pytest.raises(SpecError, match=r"valid layers are 0-1"):
        explain(dp, graph, layer=7)
    with pytest.raises(SpecError, match=r"not in this plan.*e\.g\. view, embedding"):
        explain(dp, graph, node="no_such_op")
    with pytest.raises(SpecError, match="exactly one"):
        explain(dp, graph)
    expls = explain(dp, graph, layer=1)
    assert {e.layer for e in expls} == {1} and any(e.node.startswith("addmm") for e in expls)


def test_published_plan_schema_is_the_shipped_one():
    from pathlib import Path

    import meshplan.plan as plan_module

    shipped = Path(plan_module.__file__).with_name("plan.schema.json")
    published = Path(__file__).resolve().parents[1] / "docs" / "plan.schema.json"
    assert published.read_bytes() == shipped.read_bytes(), (
        "docs/plan.schema.json differs from meshplan/plan.schema.json: "
        "cp meshplan/plan.schema.json docs/plan.schema.json")


@pytest.mark.parametrize("shape,dtype,sequence", [
    ((16, 32), "float32", False),  # features (issue 42: "a sequence of 32")
    ((16, 3, 8, 8), "float32", False),  # images
    ((16,), "int64", False),  # one id per row
    ((16, 32), "int64", True),  # token ids
    ((16, 32, 8), "float32", True)])  # embeddings: batch x seq x features
def test_inputs_without_a_sequence_are_not_called_one(shape, dtype, sequence):
    """The summary, ``show`` and the report say "global batch x seq" and tokens/s only for
    inputs with a sequence axis; features and images get "16 samples" and samples/s (issue
    42: the plan of an MLP on 32 float features spoke of a sequence of 32)."""
    import torch
    import torch.nn as nn
    from meshplan.report import render_report

    layers = {2: nn.Linear(shape[-1], 10), 1: nn.Embedding(64, 10),
              4: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(144, 10))}
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 10)) if dtype == "int64" and \
        len(shape) == 2 else layers[len(shape)] if len(shape) != 3 else nn.Linear(8, 10)
    x = torch.randint(0, 64, shape, device="meta") if dtype == "int64" else \
        torch.randn(shape, device="meta")
    plan = meshplan.manual_plan(model, Mesh.local(2), (x,), dp=2, microbatch_size=8,
                                loss_fn=lambda out: out.float().pow(2).mean())
    text = summary_text(plan)
    report = render_report(plan)
    rate = plan.predicted.tokens_per_s
    if sequence:
        assert re.search(rf"global batch x seq +│ 16 x {shape[1]} \(", text), text
        assert f"{rate:,.0f} tokens/s" in text and "samples" not in text
        assert f"global batch 16 x {shape[1]}," in report
    else:
        assert "x seq" not in text and re.search(r"global batch +│ 16 samples \(", text), text
        assert f"{rate / plan.training.seq_len:,.0f} samples/s" in text
        assert "tokens/s" not in text and "tokens/s" not in report
        assert "global batch 16 samples," in report
