"""Grouped-query attention under tensor and sequence parallelism on the module engine (issue
14: Llama 3 405B, 128 query / 8 key-value heads at TP8 with sequence parallelism, was refused
and priced on the graph engine). Which plans the module engine takes and refuses, and on 4
gloo processes (one launch) a GQA Llama at dp2 x tp2 and pp2 x tp2, both with
sequence parallelism, against one process: losses, every gradient, the gradient norm."""

from __future__ import annotations

import sys

import pytest
import torch

import meshplan
from meshplan.specs import parse_model_spec
# the tiny-Llama pipeline cases' batch, steps, plans and data (run under pytest, which puts
# the repository on sys.path for this file's workers too)
from tests.test_module_engine_pp import BATCH, LR, SEQ, STEPS, batches, plan_for

# 8 query heads sharing 2 key/value heads (4 per group), head dim 8
GQA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=4&"
       "num_attention_heads=8&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
CASES = {  # name -> manual_plan options
    "dp2xtp2-sp": dict(dp=2, tp=2, sequence_parallel=True),
    "pp2xtp2-sp": dict(pp=2, tp=2, sequence_parallel=True),
}


def build(device: str = "cpu"):
    torch.manual_seed(0)
    return parse_model_spec(GQA).build(device=device)


# -- pure: which plans the module engine takes ------------------------------------------------

@pytest.fixture(scope="module")
def meta():
    return build("meta")


@pytest.fixture(scope="module")
def graph(meta):
    from meshplan.tracing import trace
    return trace(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))


def test_sequence_parallel_gqa_goes_to_the_module_engine(meta, graph):
    from meshplan.runtime.module_plan import GatherSequence, tp_styles

    for options in CASES.values():
        plan = plan_for(meta, graph, **options)
        assert plan.engine == "modules", (options, plan.engine_note)
    # one all-gather of the sequence per attention and per MLP, not one per projection
    styles, _ = tp_styles(plan_for(meta, graph, **CASES["dp2xtp2-sp"]), meta)
    assert {n for n, s in styles.items() if isinstance(s, GatherSequence)} == \
        {f"model.layers.{i}.{m}" for i in range(4) for m in ("self_attn", "mlp")}


def test_kv_heads_not_divisible_by_tp_is_one_line(meta, graph):
    """2 key/value heads over tp=4: a rank would hold half a head. The plan is refused when
    it is made, on every engine, in one line (support.heads_rule; the graph engine crashed on
    it at run time, DECISIONS 76)."""
    for options in (dict(tp=4), dict(tp=4, sequence_parallel=True),
                    dict(pp=2, tp=4, devices=8)):
        for engine in ("auto", "graph", "modules"):
            with pytest.raises(meshplan.errors.PlanningError,
                               match=r"num_key_value_heads=2 is not divisible by tp=4") as err:
                plan_for(meta, graph, engine=engine, **options)
            assert "\n" not in str(err.value)


# -- 4 gloo processes against one process ------------------------------------------------------

def reference() -> dict:
    from meshplan.tracing import next_token_loss

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": [], "grads": [], "norms": []}
    for ids in batches():
        loss = next_token_loss(model(ids, use_cache=False).logits, ids)
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["norms"].append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def worker(path: str) -> None:
    import torch.distributed as dist

    from meshplan.tracing import trace

    dist.init_process_group("gloo")
    graph = trace(build("meta"), (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),)) \
        if dist.get_rank() == 0 else None
    results = {}
    for name, options in CASES.items():
        holder = [plan_for(build("meta"), graph, **options) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        plan = holder[0]
        run = meshplan.parallelize(build(), plan)
        opt = torch.optim.AdamW(run.parameters(), lr=LR)
        got = {"engine": type(run.engine).__name__, "losses": [], "grads": [], "norms": []}
        per = BATCH // run.dp_size
        for ids in batches():
            got["losses"].append(run.train_step((ids[run.dp_rank * per:(run.dp_rank + 1) * per],)))
            got["grads"].append(run.engine.full_grads())
            got["norms"].append(float(run.clip_grad_norm_(1e9)))
            opt.step()
            opt.zero_grad()
        results[name] = got
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("gqa") / "out.pt", nproc=4,
                            timeout=600)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(launched, ref, name):
    got = launched[name]
    assert got["engine"] == ("PipelineModuleEngine" if name.startswith("pp") else "ModuleEngine")
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **close)
    for step in range(STEPS):
        assert set(got["grads"][step]) == set(ref["grads"][step])
        for fqn, grad in got["grads"][step].items():
            torch.testing.assert_close(grad, ref["grads"][step][fqn], **close,
                                       msg=lambda m: f"step {step} {fqn}: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"][step]), ref["norms"][step], **close)


if __name__ == "__main__":
    worker(sys.argv[1])
