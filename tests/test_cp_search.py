"""The pipeline search prices context-parallel options as they run (issues 25, 27).

Two defects kept ``autoparallel`` from picking cp for Llama 3 405B at 131K tokens on 16,384
H100s: the cost model's memo of the chunked-loss stage (``chunked_loss_stage``) returned the
first stage it saw for every stage that shares its operators, so every recompute and ZeRO
choice of a cp range was priced as the first one (recompute "none"); and the probe dropped
cp with sequence parallelism, which only the graph engine refuses. Pure planning on the meta
device, a few seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

LLAMA = ("transformers:llama?hidden_size=128&intermediate_size=256&num_hidden_layers=4&"
         "num_attention_heads=8&num_key_value_heads=4&vocab_size=512&"
         "max_position_embeddings=32768")


@pytest.fixture(scope="module")
def long_llama():
    """A 4-block Llama at 2 sequences of 32,768 tokens on one DGX H100 node."""
    import meshplan
    from meshplan.specs import parse_model_spec
    from meshplan.tracing import trace

    model = parse_model_spec(LLAMA).build("meta")
    graph = trace(model, (torch.zeros(2, 32768, dtype=torch.long, device="meta"),))
    return model, graph, meshplan.Mesh.preset("dgx-h100", nodes=1)


def test_probe_prices_each_recompute_and_zero_choice_of_a_cp_range(tiny_llama_h100):
    """One MegatronStageCost (shared operator dicts and cost-model memo) against a fresh one
    per option: the same prices, whatever was priced before."""
    from meshplan.planner.clusters import layer_units
    from meshplan.planner.inter import StageOption
    from meshplan.planner.stagecost import MegatronStageCost

    _, graph, mesh = tiny_llama_h100

    def fresh():
        return MegatronStageCost(graph, layer_units(graph), mesh.hardware, num_devices=8,
                                 dtype="bf16", optimizer="adam", engine="modules")

    shared = fresh()
    # (dp 2 and 4 share one operator dict: the rules do not read dp)
    options = [StageOption((dp, 2), rc, z, False, 2) for dp in (2, 4)
               for rc in ("none", "full") for z in (0, 3)]
    for option in options:
        assert shared.probe(0, 2, option, 1) == fresh().probe(0, 2, option, 1), option
        # the bounds' time-only probe (no activation walk) gives the same time
        assert fresh().probe(0, 2, option, 1, need_memory=False)[0] == \
            shared.probe(0, 2, option, 1)[0]
    none, full = (shared.probe(0, 2, o, 1) for o in options[:4:2])
    assert full[0] > none[0] and full[3] < none[3]  # recompute: more time, less kept


def test_cp_with_sequence_parallelism_is_searched_on_the_module_engine(long_llama):
    """NeMo's layout (TP with sequence parallelism inside, cp across) is in the search's
    space for the module engine, which runs it; the graph engine's probe still refuses it."""
    from meshplan.errors import MemoryLimitError
    from meshplan.planner.hybrid import search_space
    from meshplan.planner.stagecost import plan_hybrid

    _, graph, mesh = long_llama
    space = search_space(recompute=("full",), zero=(0,), max_stages=1, context_parallel=(4,))
    space = replace(space, tensor_degrees=(2,), sequence_parallel=(True,))
    plan = plan_hybrid(graph, mesh, dtype="bf16", space=space, engine="modules")
    assert plan.training.sequence_parallel and plan.stages[0].mesh_shape == (4, 2)
    with pytest.raises(MemoryLimitError):
        plan_hybrid(graph, mesh, dtype="bf16", space=space, engine="graph")


def test_autoparallel_finds_the_cp_layout_only_cp_fits(long_llama):
    """Under 0.05 GiB per device only cp layouts with full recompute fit (every cp=1 layout
    needs 0.055 GiB or more): the search finds one at least as fast as every manual plan of
    dp x cp x tp x pp (one sequence per microbatch, 1F1B; pp 4 would need 4 microbatches)
    that fits."""
    import meshplan
    from meshplan.errors import PlanningError
    from meshplan.support import cp_degree, plan_problems

    model, graph, mesh = long_llama
    limit = 0.05
    plan = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16", memory_limit_gib=limit,
                                 context_parallel=(1, 2, 4, 8), margin=0)
    assert "cp" in plan.stages[0].axis_names and plan.predicted.peak_memory_gib <= limit
    best = None
    for dp, cp, tp, pp in itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4), (1, 2)):
        for recompute, sp in itertools.product(("none", "full"), (False, True)):
            if dp * cp * tp * pp != 8 or (sp and tp == 1):
                continue
            try:
                manual = meshplan.manual_plan(
                    model, mesh, graph=graph, dp=dp, cp=cp, tp=tp, pp=pp, microbatch_size=1,
                    recompute=recompute, dtype="bf16", sequence_parallel=sp, schedule="1f1b")
            except PlanningError:
                continue  # a layout no runtime runs (e.g. fewer microbatches than stages)
            if plan_problems(manual) or manual.predicted.peak_memory_gib > limit:
                continue
            assert cp > 1, (dp, cp, tp, pp, recompute, sp)
            best = min(best or manual.predicted.step_time_s, manual.predicted.step_time_s)
    assert best is not None and plan.predicted.step_time_s <= best * 1.01
    constrained = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16",
                                        memory_limit_gib=limit, context_parallel=(8,),
                                        engine="modules", margin=0)
    assert cp_degree(constrained.stages[0]) == 8
