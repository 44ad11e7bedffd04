"""The runtime tests' equivalence harness (tests/harness/equivalence.py) can fail: layout
names parse to one meaning, and the tolerance rule reports a run that differs from the
single-process reference by more than 10x the reference's own fp32 error (or the floors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.harness.equivalence import (LAYOUTS, WEIGHT_FLOOR, check, devices, expected, layout,
                                       parse_layout, train_reference)


def test_layout_names_parse_to_manual_plan_options():
    assert layout("cp2xtp2+sp") == dict(cp=2, tp=2, sequence_parallel=True)
    assert parse_layout("dp2xpp2+interleaved+mb1") == dict(
        dp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatch_size=1)
    assert layout("dp2xtp2+zero3+bf16") == dict(dp=2, tp=2, zero=3, dtype="bf16")
    assert devices("dp2xtp2+sp") == 4 and devices("pp2") == 2
    assert all(devices(name) == 4 for name in LAYOUTS)
    for bad in ("dp2xdp2", "ep2", "dp2+zero9", "dp0", "dp2 x tp2"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)
    with pytest.raises(ValueError, match="not in tests/harness/equivalence.py LAYOUTS"):
        layout("dp2")  # a layout outside the shared list
    layout("dp4")["dp"] = 3  # a fresh dict: the list itself stays
    assert LAYOUTS["dp4"] == dict(dp=4)


def _setup():
    torch.manual_seed(0)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    return build, data, (lambda model, batch: model(batch[0])), \
        (lambda out, batch: nn.functional.cross_entropy(out, batch[1]))


def test_the_reference_equals_itself_and_a_perturbed_run_fails():
    build, data, forward, loss = _setup()
    opts = dict(optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                eval_batch=data[0])
    exp = expected(build, data, forward, loss, **opts)
    assert all(t > 0 for t in (exp.tol["losses"], exp.tol["norms"], exp.tol["eval"]))
    same = train_reference(build, data, forward, loss, **opts)
    assert check(same, exp) == []
    # each quantity, moved past its tolerance, is reported
    for field, move in (("losses", lambda r: [r[0] + 2 * exp.tol["losses"], *r[1:]]),
                        ("norms", lambda r: [x * 1.01 for x in r]),
                        ("eval", lambda r: r + 3 * exp.tol["eval"])):
        bad = check({**same, field: move(same[field])}, exp)
        assert len(bad) == 1 and bad[0].startswith(
            "eval outputs" if field == "eval" else field), bad
    grads = [dict(g) for g in same["grads"]]
    grads[1]["0.weight"] = grads[1]["0.weight"] + 1e-5  # 10x the 1e-6 gradient floor
    assert check({**same, "grads": grads}, exp)[0].startswith("step 1 grad 0.weight")
    weights = {**same["weights"], "2.bias": same["weights"]["2.bias"] + 2 * WEIGHT_FLOOR}
    assert check({**same, "weights": weights}, exp)[0].startswith("weight 2.bias")
    # a missing gradient, a NaN loss, a failed run, a quantity not recorded
    assert "names differ" in check({**same, "grads": {0: {}}}, exp)[0]
    assert check({**same, "losses": [float("nan"), *same["losses"][1:]]}, exp)
    assert check({"error": "boom"}, exp) == ["run failed: boom"]
    assert check({k: v for k, v in same.items() if k != "norms"}, exp) == \
        ["norms: not recorded by the run"]


def test_the_tolerance_is_ten_times_the_fp32_error_against_fp64():
    """A larger model's fp32 error passes the floor: the tolerance follows it."""
    torch.manual_seed(0)
    data = [(torch.randn(64, 256) * 30,) for _ in range(2)]

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 1))
    exp = expected(build, data, lambda m, b: m(b[0]).square().mean(),
                   optimizer=lambda p: torch.optim.SGD(p, lr=1e-6))
    r64 = train_reference(build, data, lambda m, b: m(b[0]).square().mean(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=1e-6), dtype=torch.float64)
    err = max(abs(a - b) for a, b in zip(exp.ref["losses"], r64["losses"]))
    assert exp.tol["losses"] == pytest.approx(max(10 * err, 1e-5))
