"""meshplan.parallelize in a user's own loop (tests/_public_run_worker.py, 4 gloo processes):
losses, clipped gradient norms, final weights and eval outputs equal one plain-PyTorch
process, for a Llama (dp x tp, dp x pp, ZeRO-1) and a hand-written ModuleDict model with
biased Linear layers, keyword inputs and class-label targets; bad input gets one clear error."""

from pathlib import Path

import pytest
import torch

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_public_run_worker.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return forked_results(WORKER, tmp_path_factory.mktemp("public") / "out.pt", nproc=4,
                            timeout=900)


CASES = ["llama_dp2_tp2", "llama_dp2_tp2_graph", "llama_dp2_pp2", "llama_zero1", "mlp_dp4",
         "mlp_dp2_tp2", "mlp_dp2_tp2_graph", "mlp_auto"]


@pytest.fixture(scope="module")
def expected():
    """One plain process per model (tests/harness/equivalence.py): the same AdamW steps with
    the same clipping on the whole batch, fp32 and fp64."""
    import _public_run_worker as w
    from tests.harness.equivalence import expected as reference

    cache = {}

    def get(kind, batch):
        if (kind, batch) not in cache:
            cache[kind, batch] = reference(
                lambda: w.initial(kind), [w.data(kind, batch)] * w.STEPS, w.forward(kind),
                w.loss(kind), optimizer=lambda params: torch.optim.AdamW(params, lr=w.LR),
                clip=w.CLIP, eval_batch=w.data(kind, batch))
        return cache[kind, batch]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_equal_to_one_process(results, expected, name):
    """Losses, clipped gradient norms and the final full state (the same keys), within the
    harness's rule: two AdamW steps at lr 1e-2 turn 1e-7 gradient differences into ~1e-5
    weight ones, under the 1e-4 floor on weights."""
    from tests.harness.equivalence import assert_equivalent

    r = results[name]
    assert_equivalent({"losses": r["losses"], "norms": r["norms"], "weights": r["final"]},
                      expected(r["kind"], r["batch"]), f"{name} {r['layout']}",
                      fields=("losses", "norms", "weights"), same_weight_keys=True)


@pytest.mark.slow
def test_plans_run_on_the_engine_they_name(results):
    # expressible plans run on PyTorch's composables, pipelines included
    assert results["llama_dp2_tp2"]["engine"] == "modules"
    assert results["llama_dp2_tp2_graph"]["engine"] == "graph"
    assert results["llama_dp2_pp2"]["engine"] == "modules"


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_eval_outputs_are_the_rank_rows_of_one_process(results, expected, name):
    """After training, ``run(x)`` in eval mode returns this rank's rows of what the trained
    one-process model outputs, every engine and pipelines included (values, not shapes)."""
    r = results[name]
    ref = expected(r["kind"], r["batch"]).ref["eval"]
    n = r["batch"] // r["dp_size"]
    want = ref[r["dp_rank"] * n:(r["dp_rank"] + 1) * n]
    assert r["eval"] is not None and r["eval"].shape == want.shape, (r["eval"], want.shape)
    torch.testing.assert_close(r["eval"].double(), want.double(), rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{name} {r['layout']}: {m}")


@pytest.mark.slow
def test_bad_input_is_one_clear_error(results):
    bad = results["bad"]
    assert "never given values" in bad["uninitialized"]
    assert "missing" in bad["missing_key"]
    assert "shape [8, 8]" in bad["shape"] and "[4, 8]" in bad["shape"]
    assert "dtype" in bad["dtype"]
    assert "1 target(s)" in bad["targets"] and "0 target(s)" in bad["targets"]
    assert "differs between ranks" in bad["differs"]
    for line in bad.values():
        assert line is not None and "\n" not in line and line.startswith("DataError")


@pytest.mark.slow
def test_module_engine_loads_follow_the_same_rules(results):
    """One state path for every engine: a mismatched state broadcast from rank 0 is refused
    on every rank (not on rank 0 alone while the others wait), and a meta weight left out of
    a strict=False load is refused at the step instead of training on uninitialised memory."""
    bad = results["bad_modules"]
    assert bad["engine"] == "modules"
    assert bad["broadcast_missing"] is not None and "missing" in bad["broadcast_missing"]
    assert bad["partial"] is not None and "lm_head.weight" in bad["partial"]
    # a wrong shape on the stage that holds the tensor: refused on every rank, not a hang
    assert bad["broadcast_shape_pp"] is not None and "lm_head.weight" in bad["broadcast_shape_pp"]
    for key in ("broadcast_missing", "partial", "broadcast_shape_pp"):
        assert "\n" not in bad[key] and bad[key].startswith("DataError"), bad[key]
