"""A user's own ``loss_fn`` through the public API (issue 42; tests/_user_loss_worker.py, one
launch of 4 gloo processes): each rank passes its own rows, AdamW with an LR warmup,
clip_grad_norm_ below every step's norm, eval outputs and full_state_dict, compared with one
plain PyTorch process (tests/harness/equivalence.py: 10x the fp32 reference's own error
against fp64; floors 1e-5 on losses and norms, 1e-4 on weights and outputs).

Failing before their fixes:
- the issue's nn.Sequential MLP at dp2 x tp2 on the module engine (``mlp10``): the colwise
  layers of a model with no block stack all gathered their outputs, so the rowwise layer
  after one got a whole input and the module engine refused the plan, while a user forcing
  it met the tensor-parallel shard of the last nn.Linear in ``loss_fn``. Now a colwise
  nn.Linear no rowwise layer follows gathers its output (runtime/module_plan.py
  ``_gather_unpaired``); ``mlp5``: a 5-class head tp=2 does not divide stays replicated.
- nanoGPT's learned positions (``wpe(torch.arange(t))``) in a later pipeline stage, whose
  copy of the forward had ``wpe`` as nn.Identity: the positions were added to the hidden
  states ("fails with blocks removed"; gpt cp2xpp2 refused, dp2xpp2 on the graph engine).
  Now the later stage's embedding adds zero (runtime/module_pipeline.py
  ``LaterStageEmbedding``, checked to be only added in the traced graph).
- nanoGPT's fused projection (``q, k, v = self.c_attn(x).split(C, dim=2)``) under tp
  (gpt dp2xtp2, cp2xtp2): the local split of a plain colwise shard failed ("not enough
  values to unpack"), so the module engine refused it. Now its rows are in Megatron's order
  (each rank's shard holds its heads of q, k and v) and the split returns head-sharded
  DTensors (runtime/fused_parts.py); full_state_dict gives the natural rows back.
- every layout with context parallelism and a ``loss_fn`` was refused when the plan was made;
  now the loss_fn runs on each rank's chunk, weighted by its labelled tokens (``mean``), as a
  sum (``sum``) or per sequence (``sequence``): runtime/cp_modules.py ``chunk_loss``.
"""

from pathlib import Path

import pytest
import torch

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_user_loss_worker.py"))
MODULES = "modules"
# (model, layout, engine): the engine each case must run on ("auto": the plan's choice)
CASES = [("mlp10", "dp2xtp2", MODULES), ("mlp5", "dp2xtp2", MODULES),
         *[(m, lay, "auto") for m in ("llama", "gpt")
           for lay in ("cp4", "dp2xcp2", "cp2xtp2", "cp2xpp2")],
         ("llama_sum", "dp2xcp2", "auto"), ("llama_seq", "dp2xcp2", "auto"),
         ("llama_sum", "cp2xpp2", "auto"), ("llama_seq", "cp2xpp2", "auto"),
         ("llama_sum", "dp2xtp2", MODULES), ("llama_seq", "dp4", "auto"),
         ("gpt", "dp2xpp2", MODULES), ("gpt", "dp2xtp2", MODULES)]


def _key(model, layout, engine):
    return f"{model}:{layout}:{engine}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("user-loss") / "out.pt"
    from _launch import forked_run
    forked_run(WORKER, [str(out), ",".join(_key(*c) for c in CASES)], 4, 1500,
               out.parent / "logs")
    return torch.load(out, weights_only=False)


_REF: dict = {}


def _reference(model):
    import _user_loss_worker as w
    if model not in _REF:
        _REF[model] = w.reference(model)
    return _REF[model]


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,engine", CASES,
                         ids=[f"{m}-{lay}" for m, lay, _ in CASES])
def test_user_loss_fn_equals_one_process(results, model, layout, engine):
    from tests.harness.equivalence import check
    import _user_loss_worker as w

    got = results[_key(model, layout, engine)]
    assert "refused" not in got and "error" not in got, \
        f"{model} {layout}: {got.get('refused') or got.get('error')}\n" \
        f"{got.get('traceback', '')[-3000:]}"
    if engine == MODULES or layout.startswith("cp") or "cp" in layout:
        assert got["engine"] == MODULES, got["layout"]
    ref = _reference(model)
    assert min(ref.ref["norms"]) > w.CLIP  # the clipping bites at every step
    bad = check({"losses": got["losses"], "norms": got["norms"], "eval": got["eval"],
                 "weights": got["final"]}, ref, fields=("losses", "norms", "eval", "weights"),
                same_weight_keys=True)
    assert not bad, f"{model} {layout} [{got['layout']}]: " + "; ".join(bad[:6])


def test_fused_rows_are_megatrons_order_and_come_back_natural():
    """Rank r's Shard(0) of the permuted weight holds its slice of every part; the inverse
    gives the user's layout back."""
    from meshplan.runtime.fused_parts import to_natural, to_permuted

    w = torch.arange(24.0).reshape(12, 2)  # parts q, k, v of 4 rows each
    p = to_permuted(w, parts=3, tp=2)
    q, k, v = w.split(4)
    assert torch.equal(p.chunk(2)[0], torch.cat([q[:2], k[:2], v[:2]]))
    assert torch.equal(p.chunk(2)[1], torch.cat([q[2:], k[2:], v[2:]]))
    assert torch.equal(to_natural(p, parts=3, tp=2), w)


def test_a_position_embedding_that_is_not_only_added_keeps_its_pipeline_refusal():
    """A later pipeline stage stands in for an embedding of arange positions with zero
    (runtime/module_pipeline.py ``LaterStageEmbedding``), right only where its output is
    added: one multiplied in keeps the module engine's refusal."""
    import meshplan
    import _user_loss_worker as w

    class Scaled(w.NanoGPT):
        def forward(self, idx):
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
            x = self.transformer.wte(idx) * self.transformer.wpe(pos)
            for block in self.transformer.h:
                x = block(x)
            return self.lm_head(self.transformer.ln_f(x))

    from meshplan.runtime.module_pipeline import pipeline_refusal

    (ids,), (labels,) = w.tokens(0)
    common = dict(example_inputs=(ids.to("meta"),), example_targets=(labels.to("meta"),),
                  loss_fn=w.token_ce, dp=2, pp=2)
    for cls, refused in ((w.NanoGPT, False), (Scaled, True)):
        with torch.device("meta"):
            model = cls()
        plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), engine="graph", **common)
        why = pipeline_refusal(plan, model)
        assert (why is not None and "not only to an add" in why) == refused, why
