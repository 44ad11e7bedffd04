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


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_equal_to_one_process(results, name):
    r = results[name]
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                               rtol=1e-5, atol=1e-6, msg=f"{name} {r['layout']}")
    torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(r["ref_norms"]),
                               rtol=1e-5, atol=1e-6)
    assert set(r["final"]) == set(r["ref_final"])
    for key, ref in r["ref_final"].items():
        # two AdamW steps at lr 1e-2 turn 1e-7 gradient differences into ~1e-5 weight ones
        torch.testing.assert_close(r["final"][key], ref, rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.slow
def test_plans_run_on_the_engine_they_name(results):
    # expressible plans run on PyTorch's composables, pipelines included
    assert results["llama_dp2_tp2"]["engine"] == "modules"
    assert results["llama_dp2_tp2_graph"]["engine"] == "graph"
    assert results["llama_dp2_pp2"]["engine"] == "modules"


@pytest.mark.slow
def test_eval_forward_is_the_rank_shard(results):
    for name in ("mlp_dp4", "mlp_dp2_tp2_graph"):  # one per engine
        out = results[name]["eval"]
        assert out is not None and out.shape == (8 // (4 if name == "mlp_dp4" else 2), 10)


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
