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
    return {1: w.reference(), w.PER_MICROBATCH: w.reference(w.PER_MICROBATCH)}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp4-mb1", "dp4", "dp4-graph", "dp2-tp2", "auto",
                                  "dp4-per-microbatch", "dp4-per-microbatch-graph"])
def test_batchnorm_user_loop_equals_one_process(results, expected, case):
    """dp4-per-microbatch*: the user asked for per-microbatch statistics (batch_norm=
    'microbatch'); the reference accumulates gradients over the same global microbatches and
    counts num_batches_tracked once per microbatch, as one process doing so does."""
    import _batchnorm_user_worker as w

    r = results[case]
    assert "crashed" not in r, r.get("crashed")
    assert "refused" not in r, r.get("refused")
    per = "per-microbatch" in case
    # BatchNorm's batch is cut only when the user asks
    assert r["microbatches"] == (w.PER_MICROBATCH if per else 1), (case, r["layout"])
    expected = expected[r["microbatches"]]
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


def _cnn_call():
    import _batchnorm_user_worker as w

    with torch.device("meta"):
        model = w.CNN()
    return model, (torch.empty(w.BATCH, 3, w.SIZE, w.SIZE, device="meta"),), dict(
        example_targets=(torch.empty(w.BATCH, dtype=torch.long, device="meta"),),
        loss_fn=w.loss_fn, dtype="fp32")


def test_planner_keeps_a_batchnorm_batch_whole():
    """manual_plan's default microbatch size and autoparallel's search give a BatchNorm model
    one microbatch; microbatches the user asks for without batch_norm='microbatch' are
    refused in one line; with it they are kept and recorded in the plan file."""
    import meshplan
    from meshplan.errors import PlanningError

    model, inputs, kw = _cnn_call()
    for dp in (4, 2):
        plan = meshplan.manual_plan(model, "local:4", inputs, dp=dp, tp=4 // dp, **kw)
        assert plan.training.microbatches == 1 and plan.training.batch_norm == "batch"
    with pytest.raises(PlanningError, match="BatchNorm and the plan cuts each step's batch into "
                                            "4 microbatches.*microbatch_size=4.*batch_norm="):
        meshplan.manual_plan(model, "local:4", inputs, dp=4, microbatch_size=1, **kw)
    with pytest.raises(PlanningError, match="pp=2 with schedule '1f1b' and a BatchNorm model"):
        meshplan.manual_plan(model, "local:4", inputs, dp=2, pp=2, **kw)
    with pytest.raises(PlanningError, match=r"microbatches=\(2,\) with a BatchNorm model"):
        meshplan.autoparallel(model, "local:4", inputs, microbatches=(2,), **kw)
    with pytest.raises(PlanningError, match="batch_norm='sync' is not one of batch, microbatch"):
        meshplan.manual_plan(model, "local:4", inputs, dp=4, batch_norm="sync", **kw)
    plan = meshplan.manual_plan(model, "local:4", inputs, dp=4, microbatch_size=1,
                                batch_norm="microbatch", **kw)
    assert plan.training.microbatches == 4
    assert meshplan.Plan.from_dict(plan.to_dict()).training.batch_norm == "microbatch"
    assert meshplan.autoparallel(model, "local:4", inputs, **kw).training.microbatches == 1


def test_module_engine_refuses_batchnorm_split_beyond_dp():
    """The module engine synchronises BatchNorm over dp only: a tp-split plan goes to the
    graph engine (auto) or is refused in one line (engine='modules')."""
    import meshplan
    from meshplan.errors import MeshplanError

    model, inputs, kw = _cnn_call()
    assert meshplan.manual_plan(model, "local:4", inputs, dp=4, **kw).engine == "modules"
    assert meshplan.manual_plan(model, "local:4", inputs, dp=2, tp=2, **kw).engine == "graph"
    with pytest.raises(MeshplanError, match="bn1 is a BatchNorm and the plan splits the tp axis"):
        meshplan.manual_plan(model, "local:4", inputs, dp=2, tp=2, engine="modules", **kw)
