"""meshplan/support.py: each rule, a plan file that breaks one, and automatic plans that
never break any (the search skips what the runtime cannot run)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import meshplan
from meshplan import support
from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.mesh import Mesh
from meshplan.plan import Plan
from meshplan.specs import parse_model_spec
from meshplan.support import Candidate, candidate_problems

GPT2 = "transformers:gpt2?n_layer=4&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=6&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
GPT2_WIDE = "transformers:gpt2?n_layer=8&n_embd=128&n_head=8&vocab_size=512&n_positions=128"


def traced(spec: str, batch: int = 8, seq: int = 16):
    model = parse_model_spec(spec).build(device="meta")
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, meshplan.trace(model, (ids,))


@pytest.fixture(scope="module")
def gpt2():
    return traced(GPT2)


# -- each rule -----------------------------------------------------------------------------------

def test_a_plain_pipeline_runs():
    assert candidate_problems(Candidate(pp=2, dp=2, schedule="1f1b", microbatches=2,
                                        global_batch=8, microbatch_size=2, zero=3,
                                        num_layers=4)) == ()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_every_zero_stage_runs_with_every_schedule(zero, schedule, v):
    assert candidate_problems(Candidate(pp=2, dp=2, schedule=schedule, virtual_stages=v,
                                        microbatches=2, global_batch=8, zero=zero,
                                        num_layers=4)) == ()


@pytest.mark.parametrize("change,words", [
    (dict(schedule="zero-bubble"), "schedule 'zero-bubble' is not one the runtime drives"),
    (dict(virtual_stages=2), "virtual_stages=2 needs schedule 'interleaved-1f1b'"),
    (dict(virtual_stages=0), "virtual_stages=0 must be at least 1"),
    (dict(schedule="interleaved-1f1b", virtual_stages=3, num_layers=4),
     "4 blocks do not split into pp x virtual_stages = 6"),
    (dict(microbatches=3), "global batch 8 is not divisible into 3 microbatches"),
    (dict(microbatches=1), "needs at least as many microbatches as pipeline rank groups: 1 < pp=2"),
    (dict(pp=4, schedule="interleaved-1f1b", virtual_stages=2, microbatches=9, global_batch=18,
          microbatch_size=1, num_layers=8), "9 is not a multiple of its 2 rounds"),
    (dict(dp=3), "global batch 8 does not split over dp=3 x 2 microbatches"),
    (dict(microbatch_size=1), "microbatch_size 1 x dp 2 x microbatches 2 != global batch 8"),
    (dict(zero=4), "zero=4; ZeRO stages are 0, 1, 2, 3"),
    (dict(dtype="fp16"), "dtype 'fp16' with pp > 1 needs loss scaling"),
    (dict(dtype="int8"), "dtype 'int8' is not one of"),
])
def test_each_rule_names_the_value_and_the_fix(change, words):
    base = Candidate(pp=2, dp=2, schedule="1f1b", microbatches=2, global_batch=8,
                     microbatch_size=2, num_layers=4)
    problems = candidate_problems(dataclasses.replace(base, **change))
    assert problems and words in problems[0], problems
    assert all("\n" not in p for p in problems)


def test_interleaved_rounds_rule_is_torchs():
    """Interleaved 1F1B with 8 microbatches on pp=4: two rounds of 4 (runs); 10 on pp=4: two
    rounds, 10 % 2 == 0 (runs); 9 on pp=4: two rounds, 9 % 2 != 0 (torch refuses)."""
    def ok(b):
        return not support.microbatch_rule(Candidate(pp=4, schedule="interleaved-1f1b",
                                                     virtual_stages=2, microbatches=b,
                                                     global_batch=b * 10))
    assert ok(8) and ok(10) and not ok(9)


def test_fp16_is_fine_on_one_stage():
    assert candidate_problems(Candidate(pp=1, dp=4, global_batch=8, dtype="fp16")) == ()


# -- plans ---------------------------------------------------------------------------------------

def test_manual_pipeline_plans_with_zero_run(gpt2):
    model, graph = gpt2
    for zero in (0, 1, 2, 3):
        plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=2, pp=2, zero=zero,
                                    microbatch_size=2, schedule="interleaved-1f1b",
                                    virtual_stages=2, dtype="fp32")
        assert support.plan_problems(plan) == ()
        assert support.pipeline_degree(plan) == 2 and support.data_parallel_degree(plan) == 2


def test_layout_rule_refuses_stages_on_the_wrong_devices(gpt2):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=2, pp=2,
                                microbatch_size=2, dtype="fp32")
    swapped = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], devices=(2, 3)),
        dataclasses.replace(plan.stages[1], devices=(0, 1))))
    assert "rank group i % pp" in support.plan_problems(swapped)[0]
    with pytest.raises(NotSupportedError, match="rank group i % pp"):
        support.check_plan(swapped)


def _breaks(plan: Plan, **training) -> Plan:
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, **training))


@pytest.mark.parametrize("training,words", [
    (dict(dtype="fp16"), "needs loss scaling"),
    (dict(microbatches=1, microbatch_size=4), "at least as many microbatches"),
    (dict(virtual_stages=3), "virtual_stages=3 needs schedule 'interleaved-1f1b'"),
])
def test_plan_file_that_breaks_a_rule_is_refused_when_loaded(gpt2, tmp_path, training, words):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=2, pp=2,
                                microbatch_size=2, dtype="fp32")
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan  # the unbroken plan loads
    _breaks(plan, **training).to_json(path)
    with pytest.raises(PlanFileError, match="cannot run") as err:
        Plan.from_json(path)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_interleaved_plan_whose_blocks_do_not_split_is_refused_when_loaded(tmp_path):
    model, graph = traced(LLAMA)  # 6 blocks: pp=2 x v=2 = 4 chunks do not divide them
    plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=2, pp=2,
                                microbatch_size=2, dtype="fp32")
    bad = _breaks(plan, schedule="interleaved-1f1b", virtual_stages=2)
    bad.to_json(tmp_path / "plan.json")
    with pytest.raises(PlanFileError, match="6 blocks do not split into pp x virtual_stages = 4"):
        Plan.from_json(tmp_path / "plan.json")


# -- what the planner emits ----------------------------------------------------------------------

MESHES = {"local:4": lambda: Mesh.local(4), "dgx-h100": lambda: Mesh.preset("dgx-h100"),
          "dgx-h100x2": lambda: Mesh.preset("dgx-h100", nodes=2)}
# (model, batch, mesh, dtype, memory limit GiB): local:4 plans pipeline with ZeRO at batch 8
# and interleave the wide GPT-2; on H100s bf16 pipelines and fp16 (which the pipeline
# runtime cannot run) must not
AUTO = [(GPT2, 8, "local:4", "bf16", None), (GPT2, 16, "local:4", "fp16", 0.004),
        (LLAMA, 16, "local:4", "bf16", None), (GPT2_WIDE, 16, "local:4", "bf16", None),
        (GPT2, 16, "dgx-h100", "fp16", None), (GPT2, 16, "dgx-h100", "bf16", None),
        (LLAMA, 16, "dgx-h100", "bf16", None), (LLAMA, 16, "dgx-h100x2", "fp16", None),
        (GPT2_WIDE, 16, "dgx-h100", "fp16", None), (GPT2_WIDE, 16, "dgx-h100x2", "bf16", None)]


@pytest.fixture(scope="module")
def graphs():
    cache = {}

    def get(spec, batch):
        if (spec, batch) not in cache:
            cache[spec, batch] = traced(spec, batch=batch)
        return cache[spec, batch]
    return get


NAMES = {GPT2: "gpt2", LLAMA: "llama6", GPT2_WIDE: "gpt2-wide"}


@pytest.mark.parametrize("spec,batch,mesh_name,dtype,limit", AUTO,
                         ids=[f"{NAMES[c[0]]}-b{c[1]}-{c[2]}-{c[3]}-{c[4]}" for c in AUTO])
def test_automatic_plans_always_run(graphs, spec, batch, mesh_name, dtype, limit):
    """A small sweep of automatic plans never yields a plan the rules refuse, and every
    plan survives a round trip through its file."""
    model, graph = graphs(spec, batch)
    plan = meshplan.autoparallel(model, MESHES[mesh_name](), graph=graph, dtype=dtype,
                                 memory_limit_gib=limit, time_limit_s=5)
    assert support.plan_problems(plan) == (), plan.summary()
    assert Plan.from_json_text(plan.to_json_text()) == plan


def test_the_small_sweep_covers_pipelines_with_zero_and_interleaving(graphs):
    """The cases above are worth having: the planner does pick pp with ZeRO on local:4 and
    the interleaved schedule for the wide model (if this fails, pick new cases). margin=0:
    the fastest plans as they are, not the simplest within the cost model's error."""
    model, graph = graphs(GPT2, 8)
    plan = meshplan.autoparallel(model, Mesh.local(4), graph=graph, dtype="bf16", time_limit_s=5,
                                 margin=0.0)
    assert plan.num_stages > 1 and max(st.zero for st in plan.stages) > 0
    model, graph = graphs(GPT2_WIDE, 16)
    plan = meshplan.autoparallel(model, Mesh.local(4), graph=graph, dtype="bf16", time_limit_s=5,
                                 margin=0.0)
    assert plan.training.schedule == "interleaved-1f1b" and plan.num_stages > 1


def test_interleaved_records_must_hold_equal_blocks(gpt2):
    """The runtime cuts an interleaved plan's blocks evenly (expand_interleaved); a plan whose
    rank-group records say otherwise would run otherwise than it was priced."""
    model, graph = gpt2
    plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=2, pp=2,
                                microbatch_size=2, schedule="interleaved-1f1b",
                                virtual_stages=2, dtype="fp32")
    assert support.interleaved_split_rule(plan) == ()
    uneven = dataclasses.replace(plan, stages=(
        dataclasses.replace(plan.stages[0], layers=(0, 1)),
        dataclasses.replace(plan.stages[1], layers=(1, 4))))
    assert "each of the 2 rank groups 2 of the 4 blocks" in support.interleaved_split_rule(uneven)[0]
    with pytest.raises(PlanFileError, match="cannot run: interleaved stage 0 holds blocks"):
        Plan.from_json_text(uneven.to_json_text())


def test_module_engine_runs_fp32_and_bf16_pipelines_and_refuses_fp16(gpt2, tmp_path):
    model, graph = gpt2
    plan = meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=4, microbatch_size=2,
                                dtype="fp32")
    for dtype in ("fp32", "bf16"):
        assert support.module_engine_dtype_rule(
            dataclasses.replace(_breaks(plan, dtype=dtype), engine="modules")) == ()
    fp16 = dataclasses.replace(_breaks(plan, dtype="fp16"), engine="modules")
    assert "engine 'modules' with dtype 'fp16'" in support.plan_problems(fp16)[0]
    fp16.to_json(tmp_path / "plan.json")
    with pytest.raises(PlanFileError, match="set engine 'graph'"):
        Plan.from_json(tmp_path / "plan.json")


def test_graph_only_list_is_documented():
    """docs/running.md lists every plan kind that only the graph engine runs, with the reason
    meshplan/support.py gives (the list the runtime's refusals fall under)."""
    import os

    from meshplan.support import GRAPH_ONLY

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "running.md")).read()
    doc = " ".join(doc.split())
    for title, why in GRAPH_ONLY:
        assert f"- {title}: {why}." in doc, title
