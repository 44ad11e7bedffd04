"""The generative differential test: models drawn from a grammar of what users write
(tests/harness/generated.py), each trained through the public API in a user's own loop under
a layout on 4 gloo processes (tests/_generative_worker.py, one launch for the whole sample),
against one plain PyTorch process on the whole batch.

The only allowed outcomes are ``equal`` and ``refused`` when the plan is made (one line).
CI runs a fixed-seed, stratified sample; ``benchmarks/generative.py`` runs a large one and
counts outcomes and how often each grammar feature was drawn."""

import json
from collections import Counter
from pathlib import Path

import pytest

from _launch import forked_results
from tests.harness import generated as g

WORKER = str(Path(__file__).with_name("_generative_worker.py"))
CI_CASES = 28  # every (kind, layout) pair once: 3 kinds x 5 + seq x 9 = 24, then 4 more

_SEQ = {"kind": "seq", "depth": 1, "width": 16, "heads": 2, "act": "gelu", "norm": "layernorm",
        "container": "modulelist", "classes": 10, "dropout0": False, "qkv": "separate",
        "positions": "param", "tied": False, "loss": "ce", "batch": 8, "seed": 5}
# What the generative runs found, each kept as a named case beside the drawn sample
REGRESSIONS = {
    # a learned position table sliced [:t] under cp: every rank added positions 0..t/cp
    # to its head-tail chunks (runtime/cp_modules.ChunkPositions knew buffers only)
    "cp-learned-position-table": {**_SEQ, "layout": "cp2xdp2"},
    "cp-learned-position-table-cp4": {**_SEQ, "layout": "cp4", "qkv": "fused", "tied": True},
    # an auxiliary loss term's mean over a sharded dim is P(avg) on DTensor; the graph engine
    # tried to make it the plan's P(sum) and refused at run time (runtime/graph/placing.py)
    "graph-tp-auxiliary-mean": {**_SEQ, "kind": "cnn", "loss": "aux", "batch": 16,
                                "layout": "dp2xtp2", "seed": 8035},
    # BatchNorm cut into microbatches by manual_plan's default (DECISIONS 18)
    "batchnorm-sequential-dp2xtp2": {**_SEQ, "kind": "mlp", "norm": "batchnorm", "classes": 7,
                                     "dropout0": True, "act": "silu", "loss": "aux",
                                     "layout": "dp2xtp2", "seed": 658},
}


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return g.draw(CI_CASES, seed=0) + list(REGRESSIONS.values())


def test_the_sample_covers_every_kind_and_layout(cases):
    pairs = {(c["kind"], c["layout"]) for c in cases[:CI_CASES]}
    assert pairs == {(k, lay) for k in ("mlp", "blocks", "cnn", "seq") for lay in g.layouts(k)}
    drawn = Counter(f for c in cases for f in g.features(c))
    for feature in ("nn.Sequential stack", "batchnorm", "qkv=fused", "positions=table",
                    "classes tp does not divide", "loss=aux", "loss=smooth"):
        assert drawn[feature] > 0, feature


def test_a_case_builds_and_trains_in_one_process():
    """The grammar's models run as plain PyTorch (what the reference does), each kind."""
    import torch

    for kind in ("mlp", "blocks", "cnn", "seq"):
        case = next(c for c in g.draw(40, seed=1) if c["kind"] == kind)
        model = g.initial(case)
        x, y = g.batch(case, 0)
        loss = g.user_loss(case)(model(x), y)
        loss.backward()
        assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_generated_models_train_as_one_process(cases, tmp_path):
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    results = forked_results(WORKER, tmp_path / "out.pt", nproc=4, timeout=1500)
    counts = Counter(r["outcome"] for r in results)
    print(f"\n{len(results)} cases: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    for r in results:
        c = r["case"]
        print(f"  {r['outcome']:<10} {c['kind']:<6} {c['layout']:<8} {r['plan']} {r['detail'][:200]}")
    bad = [r for r in results if r["outcome"] not in ("equal", "refused")]
    assert not bad, "\n".join(f"{r['outcome']}: {r['case']}: {r['detail']}" for r in bad)
    assert counts["equal"] >= len(results) // 2, counts
