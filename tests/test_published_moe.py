"""CI holds the MoE accuracy (issue 39): Megatron-Bridge's published Qwen3-30B-A3B runs
(25.11 container, H100 FP8-CS, GB200 and B200 FP8-MX, EP 8), priced as they ran by
benchmarks/moe_published.py (``manual_plan`` + ``Stage.ep``, the ``megatron`` profile,
costmodel/moe.py for the experts), their error bounded. Nothing is fitted to these rows.

The bounds are the accuracy measured at this commit with a little room, not issue 39's
target (MAPE <= 25%, each within 40%), which these rows miss: the prediction is about 2x
too fast on the small-microbatch rows (H100 MBS 2, B200 MBS 1) and 16% on GB200's MBS 4.
The published rows themselves point at a large fixed cost per MoE layer per microbatch
(B200 MBS 1 vs GB200 MBS 4, same model and EP: 4x the tokens per microbatch cost 1.56x
the time, about 7 ms per layer and microbatch if all of it were fixed). The fixed costs
priced by documented mechanism (costmodel/moe.py: the token-count syncs to the host, one
cuBLAS GEMM launch per local expert in Transformer Engine's grouped GEMM) come to tens to
hundreds of microseconds per layer: they moved these rows by under 1%
(benchmarks/results/moe_published.md). Tightening these bounds is the next step;
loosening them needs a reason in the commit.

The larger rows (DeepSeek-V3, Qwen3-235B-A22B) take minutes to trace and stay in the
benchmark script.
"""

from __future__ import annotations

import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
CHEAP = ("h100-qwen3-30b-fp8", "gb200-qwen3-30b-fp8", "b200-qwen3-30b-fp8")
# measured at this commit: -52.8%, -16.1%, -53.6% (MAPE 40.85%, max 53.6%); before the
# fixed per-layer costs of costmodel/moe.py: -52.75%, -16.08%, -54.01% (MAPE 40.95%, max
# 54.0%), which these bounds refuse
MAPE_BOUND, MAX_BOUND = 0.409, 0.538


@pytest.fixture(scope="module")
def priced():
    sys.path.insert(0, BENCH)
    try:
        import moe_published as mp
    finally:
        sys.path.remove(BENCH)
    rows = {r[0]: r for r in mp.ROWS}
    out = {}
    graphs = {}
    for name in CHEAP:
        row = rows[name]
        key = (row[1], row[5], row[7])
        model, graph = graphs.get(key, (None, None))
        plan, est, model, graph, _ = mp.as_ran(row, graph=graph, model=model)
        graphs[key] = (model, graph)
        out[name] = (plan, est, row)
    return out


@pytest.mark.slow
def test_published_moe_rows_hold_their_accuracy(priced):
    errors = {}
    for name, (plan, est, row) in priced.items():
        assert all(st.ep == row[11] for st in plan.stages)
        tokens = est.tokens_per_s / row[3]
        errors[name] = row[14] / tokens - 1  # + where the prediction is slower
    mape = sum(map(abs, errors.values())) / len(errors)
    worst = max(map(abs, errors.values()))
    print({r: f"{e:+.2%}" for r, e in errors.items()}, f"MAPE {mape:.2%} max {worst:.2%}")
    assert mape <= MAPE_BOUND, errors
    assert worst <= MAX_BOUND, errors


@pytest.mark.slow
def test_published_blackwell_moe_rows_fit(priced):
    """Every row ran; the Blackwell rows fit as priced (the H100 row, PP 2 x VP 24 at MBS 2
    with no recompute, is priced at 84 GiB against 79.6: its recipe's recompute settings
    are not in the table)."""
    for name in ("gb200-qwen3-30b-fp8", "b200-qwen3-30b-fp8"):
        assert priced[name][1].fits, (name, priced[name][1].peak_memory_gib)
