"""Context parallelism on the module engine (runtime/cp_modules.py: torch's context_parallel,
head-tail chunks, ring attention with K/V all-gather) through the public API, against one
process; the plan-time refusals; the graph engine's cp with each rank's own rows.

One launch of 4 gloo processes (tests/_cp_modules_worker.py) runs every case: a nanoGPT-style
tied GPT (``is_causal=True``, positions from ``torch.arange``, labels with -100) and a
transformers Llama (sdpa, rotary, grouped-query attention) under cp4, dp2 x cp2 (ZeRO-1/3
over dp x cp), cp2 x tp2 with sequence parallelism and cp2 x pp2 (microbatch size 1 and 2,
the Llama only); three AdamW steps with an LR schedule
and clipping that bites; eval outputs in natural order; full_state_dict. Tolerance: 10x the
fp32 reference's own error against fp64, floors 1e-5 (losses, norms) and 1e-4 (weights,
outputs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_cp_modules_worker.py"))
MODULE_CASES = ["gpt_cp4", "gpt_dp2_cp2_zero3", "llama_cp4", "llama_dp2_cp2_zero1",
                "llama_cp2_tp2_sp", "gpt_dp2_cp2_full_zero2", "llama_cp2_pp2_mb1",
                "llama_cp2_pp2_mb2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return forked_results(WORKER, tmp_path_factory.mktemp("cp") / "out.pt", nproc=4,
                          timeout=900)


def _check_equal(r: dict, name: str) -> None:
    """Losses, clipped norms, the final state and the eval outputs (this rank's rows, in
    natural sequence order) within tests/harness/equivalence.py's rule."""
    from tests.harness.equivalence import assert_equivalent, tolerances

    assert "error" not in r, r.get("traceback")
    assert all(n > 0.3 for n in r["ref"]["norms"])  # clipping bites (CLIP = 0.3)
    rank, size = r["eval_rows"]
    rows = r["ref"]["eval"].shape[0] // size
    assert_equivalent({"losses": r["losses"], "norms": r["norms"], "weights": r["final"],
                       "eval": r["eval"]}, tolerances(r["ref"], r["ref64"]), name,
                      eval_rows=slice(rank * rows, (rank + 1) * rows))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODULE_CASES)
def test_module_engine_cp_equals_one_process(results, name):
    r = results[name]
    _check_equal(r, name)
    assert r["engine"] == "modules"


@pytest.mark.slow
def test_graph_engine_cp_uses_each_ranks_rows(results):
    """An explicit mask runs on the graph engine's cp; before the fix its unlowered path
    scattered rank 0's batch to every rank (distribute_tensor's src_data_rank=0) and eval
    returned the load-balanced chunk order."""
    r = results["masked_dp2_cp2_graph"]
    assert r.get("engine") == "graph", r.get("traceback")
    _check_equal(r, "masked_dp2_cp2_graph")


@pytest.mark.slow
def test_graph_engine_cp_weighs_labels_over_the_global_batch(results):
    """Labels with -100, each row its own count, at dp2 x cp2 on the graph engine. Its cp
    stages run on DTensor, whose loss backward divides by the microbatch's labelled targets
    over both data-parallel ranks while the forward is each rank's own rows' mean: weighed
    as the forward, the gradients were off (loss 12.684 vs 12.254 at step 2, norm 10.40 vs
    8.75 at step 1) until the backward was weighed as a whole loss (runtime/loss_weights.py)."""
    r = results["masked_dp2_cp2_graph_labels"]
    assert r.get("engine") == "graph", r.get("traceback")
    _check_equal(r, "masked_dp2_cp2_graph_labels")


@pytest.mark.slow
def test_graph_engine_cp_pipeline_eval_returns_sequence_order(results):
    """The graph engine's forward-only pipeline gathered the last stage's cp output as DTensor
    lays it out, the load-balanced chunks (0, 3, 1, 2 at cp=2): eval outputs off by 38.9 past
    position 4, training equal. Now put back in sequence order, as one stage does."""
    r = results["masked_cp2_pp2_graph"]
    assert r.get("engine") == "graph", r.get("traceback")
    _check_equal(r, "masked_cp2_pp2_graph")


@pytest.mark.slow
def test_ring_attention_on_cpu_matches_fp64(results):
    """The CPU flash-attention adapter on torch's ring attention: outputs and q/k/v
    gradients of causal (head-tail chunks) and full (contiguous chunks) attention at cp=4."""
    for causal in (True, False):
        err, own = results["mechanism"][causal]
        assert err <= max(10 * own, 1e-5), (causal, err, own)


# -- plan time: one line each, never at run time ------------------------------------------------

def _plan(model, *, seq=16, **kw):
    import meshplan

    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return meshplan.manual_plan(model, meshplan.Mesh.local(4), (ids,), dtype="fp32", **kw)


def _llama(attn):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation=attn)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_cp_plans_choose_the_module_engine():
    from _cp_modules_worker import TiedGPT

    from meshplan.support import plan_problems

    with torch.device("meta"):
        gpt = TiedGPT()
    for model, kw in ((gpt, dict(cp=4)), (_llama("sdpa"), dict(cp=2, tp=2,
                                                               sequence_parallel=True))):
        plan = _plan(model, **kw)
        assert plan.engine == "modules", plan.engine_note
        assert not plan_problems(plan)


def test_refusals_are_one_line_at_plan_time():
    from _cp_modules_worker import TiedGPT

    from meshplan.errors import MeshplanError

    with pytest.raises(MeshplanError, match=r"attn_implementation='sdpa'") as info:
        _plan(_llama("eager"), cp=4)
    assert "\n" not in str(info.value)
    with torch.device("meta"):
        gpt = TiedGPT()
    # a tied head and embedding cannot be cut into module-engine stages, and the graph
    # engine's cp splits explicit masks only
    with pytest.raises(MeshplanError, match=r"shared by pipeline stages.*graph engine's cp "
                                            r"splits an explicit mask only.*is_causal=True") \
            as info:
        _plan(gpt, cp=2, pp=2, microbatch_size=1)
    assert "\n" not in str(info.value)
    with pytest.raises(MeshplanError, match=r"graph engine's cp splits an explicit mask only"):
        _plan(gpt, cp=4, engine="graph")


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration
    with torch.device("meta"):
        return T5ForConditionalGeneration(T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
            attn_implementation="sdpa"))


def test_module_engine_cp_check_sees_transformers_attention():
    """The module engine's cp check runs the forward on meta and records its SDPA calls.
    transformers' mask helpers branch on data (``padding_mask.all()``, packed-sequence
    checks), which raised on meta, and the check then passed every plan: T5, whose relative
    position bias goes to SDPA as a float attn_mask, got the module engine at dp2 x cp2 (its cp
    meets the mask only inside the step). Now those branches are answered as the cp region's
    all-ones mask answers them: Llama shows is_causal=True calls, T5 its masks, and T5's cp
    plans go to the graph engine, which splits an explicit mask."""
    from meshplan.runtime import module_plan as mp
    from meshplan.runtime.cp_modules import AttentionCalls

    llama = _llama("sdpa")
    plan = _plan(llama, cp=4)
    call, seen = mp._meta_call(plan, 1), AttentionCalls()
    with seen:
        mp._Forward(mp.meta_copy(llama))(*call[0], **call[1])
    assert seen.calls == [(False, True, False)] * 2 and plan.engine == "modules"
    import meshplan

    src, tgt = (torch.zeros(2, n, dtype=torch.long, device="meta") for n in (16, 8))
    plan = meshplan.manual_plan(_t5(), meshplan.Mesh.local(4),
                                {"input_ids": src, "decoder_input_ids": tgt},
                                example_targets=(tgt,), dtype="fp32", dp=2, cp=2)
    assert plan.engine == "graph" and "explicit attn_mask" in plan.engine_note, \
        (plan.engine, plan.engine_note)


def test_graph_engine_cp_with_pipeline_at_one_sequence_is_refused_when_planned():
    """cp x pp at one sequence per microbatch on the graph engine failed on stage 0 inside the
    schedule while stage 1 waited out the gloo timeout; then it was refused in parallelize,
    after the plan was made. Now manual_plan refuses it, in one line, for a model that only
    the graph engine's cp runs (an explicit mask) or when the graph engine is asked for."""
    from _cp_modules_worker import masked_gpt

    from meshplan.errors import MeshplanError

    for engine in ("auto", "graph"):
        with pytest.raises(MeshplanError, match=r"cp=2 with pipeline stages at microbatch size "
                                                r"1 on the graph engine.*microbatch_size >= 2") \
                as info:
            _plan(masked_gpt("meta"), cp=2, pp=2, microbatch_size=1, engine=engine)
        assert "\n" not in str(info.value)
    assert _plan(masked_gpt("meta"), cp=2, pp=2, microbatch_size=2, schedule="gpipe").engine \
        == "graph"


def test_a_loss_fn_with_module_engine_cp_is_planned_or_refused_when_it_cannot_split():
    """The module engine's cp calls the user's loss_fn on each rank's sequence chunk and
    weighs it by the chunk's labelled tokens (runtime/cp_modules.py ``chunk_loss``; before,
    every loss_fn with cp was refused). A loss that cannot be split so is refused when the
    plan is made, in one PlanningError line: one that shifts its targets inside (HF's
    causal-LM loss on labels = input_ids), a per-sequence mean declared as a token mean, a
    target with no value per position, no targets."""
    import torch.nn.functional as F

    from meshplan.errors import PlanningError

    def token_ce(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def shifted(out, ids):
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1))

    def per_sequence(out, y):
        per = F.cross_entropy(out.transpose(1, 2), y, reduction="none")
        mask = (y != -100).to(per.dtype)
        return ((per * mask).sum(1) / mask.sum(1)).mean()

    def last_position(out, y):  # a sequence's class from its last position
        return F.cross_entropy(out[:, -1], y)

    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert _plan(_llama("sdpa"), dp=2, cp=2, loss_fn=token_ce, example_targets=(ids,)).engine \
        == "modules"
    assert _plan(_llama("sdpa"), dp=2, cp=2, loss_fn=per_sequence, example_targets=(ids,),
                 loss_reduction="sequence").engine == "modules"
    refused = [(shifted, (ids,), "mean", "cp chunks combined as loss_reduction='mean' give"),
               (per_sequence, (ids,), "mean", "it is not a mean over labelled positions"),
               (last_position, (ids[:, 0],), "mean", "not one value per position"),
               (token_ce, (ids,), "median", "loss_reduction='median' is not one of")]
    for fn, targets, reduction, words in refused:
        with pytest.raises(PlanningError, match=words) as info:
            _plan(_llama("sdpa"), dp=2, cp=2, loss_fn=fn, example_targets=targets,
                  loss_reduction=reduction)
        assert "\n" not in str(info.value)
    assert _plan(_llama("sdpa"), dp=2, tp=2, loss_fn=shifted, example_targets=(ids,)).engine \
        == "modules"  # cp=1 runs any loss_fn
