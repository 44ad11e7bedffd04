"""Grouped-query attention under tensor and sequence parallelism on the module engine (issue
14: Llama 3 405B, 128 query / 8 key-value heads at TP8 with sequence parallelism, was refused
and priced on the graph engine): which plans the module engine takes and refuses. The GQA
Llama's runs at dp2 x tp2 and pp2 x tp2, both with sequence parallelism, against one process
(losses, every gradient, the gradient norm, the final weights) are in
tests/test_module_engine_pp.py's launch (``gqa-*``), which trains the same batches."""

from __future__ import annotations


import pytest
import torch

import meshplan
from meshplan.specs import parse_model_spec
from tests.harness.equivalence import LAYOUTS
# the tiny-Llama pipeline cases' batch and plans; the GQA model (8 query heads sharing 2
# key/value heads, head dim 8) and its layouts, run there
from tests.test_module_engine_pp import BATCH, GQA, GQA_CASES, SEQ, plan_for

CASES = {name: LAYOUTS[lay] for name, lay in GQA_CASES.items()}  # name -> manual_plan options


def build(device: str = "cpu"):
    torch.manual_seed(0)
    return parse_model_spec(GQA).build(device=device)


# -- pure: which plans the module engine takes ------------------------------------------------

@pytest.fixture(scope="module")
def meta():
    return build("meta")


@pytest.fixture(scope="module")
def graph(meta):
    from meshplan.tracing import trace
    return trace(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))


def test_sequence_parallel_gqa_goes_to_the_module_engine(meta, graph):
    from meshplan.runtime.module_plan import GatherSequence, tp_styles

    for options in CASES.values():
        plan = plan_for(meta, graph, **options)
        assert plan.engine == "modules", (options, plan.engine_note)
    # one all-gather of the sequence per attention and per MLP, not one per projection
    styles, _ = tp_styles(plan_for(meta, graph, **CASES["dp2xtp2-sp"]), meta)
    assert {n for n, s in styles.items() if isinstance(s, GatherSequence)} == \
        {f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn", "mlp")}


def test_kv_heads_not_divisible_by_tp_is_one_line(meta, graph):
    """2 key/value heads over tp=4: a rank would hold half a head. The plan is refused when
    it is made, on every engine, in one line (support.heads_rule; the graph engine crashed on
    it at run time, DECISIONS 76)."""
    for options in (dict(tp=4), dict(tp=4, sequence_parallel=True),
                    dict(pp=2, tp=4, devices=8)):
        for engine in ("auto", "graph", "modules"):
            with pytest.raises(meshplan.errors.PlanningError,
                               match=r"num_key_value_heads=2 is not divisible by tp=4") as err:
                plan_for(meta, graph, engine=engine, **options)
            assert "\n" not in str(err.value)
