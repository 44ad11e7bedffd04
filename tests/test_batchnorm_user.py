"""Regression (issue 42): a BatchNorm CNN trained through the public API in a user's own loop
on 4 gloo processes, each rank passing its own rows of a global batch of 16
(tests/_batchnorm_user_worker.py), trains what one plain-PyTorch process trains on the whole
batch: the loss of every step, the weights after the steps, the running statistics and
``num_batches_tracked`` of ``full_state_dict()``, and the eval outputs — under dp4 with one
microbatch per rank, dp4 at the planner's microbatch size (graph and module engines), dp2 and
the plan autoparallel picks.

Before the fix (issue 42): the graph engine normalised each rank's rows alone (step 0's loss
2.3652 vs 2.3623 in the issue's script), counted ``num_batches_tracked`` once per rank and
microbatch, and ``manual_plan(dp=2)``'s microbatches cut the batch BatchNorm normalises."""

from pathlib import Path

import pytest
import torch

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_batchnorm_user_worker.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return forked_results(WORKER, tmp_path_factory.mktemp("bn_user") / "out.pt", nproc=4,
                          timeout=900)


@pytest.fixture(scope="module")
def expected():
    import _batchnorm_user_worker as w
    return w.reference()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp4-mb1", "dp4", "dp4-modules", "dp2-tp2", "dp2-pp2", "auto"])
def test_batchnorm_user_loop_equals_one_process(results, expected, case):
    r = results[case]
    assert "crashed" not in r, r.get("crashed")
    assert "refused" not in r, r.get("refused")
    assert r["microbatches"] == 1, (case, r["layout"])  # BatchNorm's batch is not cut
    torch.testing.assert_close(torch.tensor(r["losses"], dtype=torch.float64),
                               torch.tensor(expected["losses"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5, msg=lambda m: f"{case} losses: {m}")
    assert set(r["state"]) == set(expected["state"])
    for key, want in expected["state"].items():
        got = r["state"][key]
        if key.endswith("num_batches_tracked"):  # once per step, not per rank or microbatch
            assert int(got) == int(want), (case, key, int(got), int(want))
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=key: f"{case} {k}: {m}")
    torch.testing.assert_close(r["eval"], expected["eval"], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{case} eval outputs: {m}")
