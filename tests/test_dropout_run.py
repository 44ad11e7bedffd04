"""Dropout under meshplan.parallelize (tests/_dropout_worker.py, 4 gloo processes): T5 with
its default dropout 0.1 (attention weights through sdpa, hidden states through aten.dropout)
gives, from one seed, the same losses under dp4 and dp2 x tp2 as one eager process seeded
alike: every rank draws the mask at the global shape and keeps its shard (DECISIONS 48)."""

from pathlib import Path

import pytest
import torch

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_dropout_worker.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return forked_results(WORKER, tmp_path_factory.mktemp("dropout") / "out.pt", nproc=4,
                            timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["dp4", "dp2_tp2"])
def test_seeded_dropout_equals_one_process_under_any_single_stage_plan(results, plan):
    """Losses and, after the SGD steps, every weight (a gradient off by any factor moves
    them), against one eager process drawing the same masks."""
    r, ref = results[plan], results["ref"]
    assert r["engine"] == "graph"
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=1e-6)
    assert set(r["state"]) == set(ref["state"])
    for name, want in ref["state"].items():
        torch.testing.assert_close(r["state"][name], want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_dropout_is_on(results):
    # the masks change the reference's first loss (same weights, same batch): were dropout
    # off, the equality above would not test the masks at all
    with_masks, without = results["ref"]["losses"][0], results["ref_no_dropout"]["losses"][0]
    assert abs(with_masks - without) > 1e-3 * abs(without), (with_masks, without)


@pytest.mark.slow
def test_module_engine_refuses_dropout_in_one_line(results):
    # eager modules would draw DTensor's masks (per shard on CPU): not one process's
    r = results["dp2_tp2_modules"]
    assert r["refused"].startswith("NotSupportedError: engine='modules'")
    assert "\n" not in r["refused"]
