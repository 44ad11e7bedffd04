"""Module-engine pipelines (runtime/module_pipeline.py): which multi-stage plans the module
engine takes, and on 4 gloo processes (one torchrun launch) the losses, every gradient, the
global gradient norm and the final weights of plain one-process PyTorch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

import meshplan
from meshplan.specs import parse_model_spec

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=4&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
BATCH, SEQ, STEPS, LR = 8, 16, 2, 1e-2
BF16_RTOL = 5e-3  # the loss of one process under bf16 autocast; bf16's epsilon is 7.8e-3
CASES = {  # name -> (manual_plan options, built on meta)
    "dp2xpp2-gpipe": (dict(dp=2, pp=2, schedule="gpipe"), False),
    "dp2xpp2-1f1b": (dict(dp=2, pp=2, schedule="1f1b"), False),
    "pp2xtp2": (dict(tp=2, pp=2), False),
    "dp2xpp2-zero3-meta": (dict(dp=2, pp=2, zero=3), True),
    "dp2xpp2-recompute-full": (dict(dp=2, pp=2, recompute="full"), False),
    "dp2xpp2-interleaved": (dict(dp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2),
                            False),
    # bf16: fully_shard's MixedPrecisionPolicy per stage; without dp, autocast
    "dp2xpp2-bf16": (dict(dp=2, pp=2, dtype="bf16"), False),
    "pp2xtp2-bf16": (dict(tp=2, pp=2, dtype="bf16"), False),
}


def build(device: str = "cpu", spec: str = LLAMA) -> nn.Module:
    torch.manual_seed(0)
    return parse_model_spec(spec).build(device=device)


def plan_for(model: nn.Module, graph=None, devices: int = 4, **options) -> meshplan.Plan:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return meshplan.manual_plan(model, meshplan.Mesh.local(devices), example_inputs=(ids,),
                                graph=graph, microbatch_size=1, **options)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


# -- pure: which pipeline plans the module engine takes -------------------------------------

@pytest.fixture(scope="module")
def meta():
    return build("meta")


@pytest.fixture(scope="module")
def graph(meta):
    from meshplan.tracing import trace
    return trace(meta, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))


def test_llama_pipelines_go_to_the_module_engine(meta, graph):
    for options, _ in CASES.values():
        plan = plan_for(meta, graph, **options)
        assert plan.engine == "modules", (options, plan.engine_note)


def test_stage_cuts_keep_names_and_the_outer_layers_where_they_run(meta, graph):
    from meshplan.runtime.module_pipeline import cut_stage, stage_cuts

    plan = plan_for(meta, graph, dp=2, pp=2)
    container, cuts = stage_cuts(plan, meta)
    assert container == "model.layers" and [c.blocks for c in cuts] == [("0", "1"), ("2", "3")]
    first, last = (set(dict(cut_stage(meta, container, c).named_parameters())) for c in cuts)
    assert first == set(plan.stages[0].params) and last == set(plan.stages[1].params)


def test_tied_embedding_and_head_across_stages_are_refused(graph):
    tied = build("meta", LLAMA + "&tie_word_embeddings=True")
    plan = plan_for(tied, dp=2, pp=2)
    assert plan.engine == "graph" and "tied" in plan.engine_note


class NoSkip(nn.Module):
    """A forward that reads its first block directly: it cannot run with blocks removed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 64)

    def forward(self, ids):
        h = self.blocks[0](self.embed(ids)) * 0.5
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_a_forward_that_needs_every_block_is_refused():
    with torch.device("meta"):
        model = NoSkip()
    plan = plan_for(model, dp=2, pp=2)
    assert plan.engine == "graph" and "blocks removed" in plan.engine_note
    with pytest.raises(meshplan.errors.NotSupportedError, match="blocks removed"):
        plan_for(model, dp=2, pp=2, engine="modules")


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
                                    for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_running_statistics_refused_fp16_pipelines_refused_bf16_taken(meta, graph):
    with torch.device("meta"):
        model = WithBatchNorm()
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4),
                                example_inputs=(torch.zeros(16, 8, device="meta"),),
                                example_targets=(torch.zeros(16, 4, device="meta"),),
                                loss_fn=nn.functional.mse_loss, dp=2, pp=2, microbatch_size=4)
    assert plan.engine == "graph" and "running statistics" in plan.engine_note
    bf16 = plan_for(meta, graph, dp=2, pp=2, dtype="bf16")
    assert bf16.engine == "modules", bf16.engine_note
    with pytest.raises(meshplan.MeshplanError, match="needs loss scaling"):
        plan_for(meta, graph, dp=2, pp=2, dtype="fp16")  # no engine runs fp16 pipelines


# -- 4 gloo processes against one process ------------------------------------------------------

def reference(bf16: bool = False) -> dict:
    """One process: fp32, or bf16 autocast (fp32 master weights)."""
    from contextlib import nullcontext

    from meshplan.tracing import next_token_loss

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"losses": [], "grads": [], "norms": []}
    for ids in batches():
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext():
            logits = model(ids, use_cache=False).logits
        loss = next_token_loss(logits.float(), ids)
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["norms"].append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
        opt.zero_grad()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def worker(path: str) -> None:
    import torch.distributed as dist

    from meshplan.tracing import trace

    dist.init_process_group("gloo")
    graph = trace(build("meta"), (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),)) \
        if dist.get_rank() == 0 else None
    results = {}
    for name, (options, on_meta) in CASES.items():
        holder = [plan_for(build("meta"), graph, **options) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        plan = holder[0]
        assert plan.engine == "modules", plan.engine_note
        model = build("meta" if on_meta else "cpu")
        run = meshplan.parallelize(model, plan)
        assert type(run.engine).__name__ == "PipelineModuleEngine"
        if on_meta:  # only this stage's local shards got memory
            real = build()
            run.load_full_state_dict({**real.state_dict(), **dict(real.named_buffers())},
                                     strict=False)
        opt = torch.optim.AdamW(run.parameters(), lr=LR)
        got = {"losses": [], "grads": [], "norms": [], "linear_dtypes": set()}
        # the dtype the stage's matmuls compute in (bf16 plans: bf16, not fp32 left on)
        for module in run.engine.modules:
            for sub in module.modules():
                if isinstance(sub, torch.nn.Linear):
                    sub.register_forward_hook(
                        lambda m, a, out, seen=got["linear_dtypes"]: seen.add(str(out.dtype)))
        per = BATCH // run.dp_size
        for ids in batches():
            got["losses"].append(run.train_step((ids[run.dp_rank * per:(run.dp_rank + 1) * per],)))
            got["grads"].append(run.engine.full_grads())
            got["norms"].append(run.clip_grad_norm_(1e9))
            opt.step()
            opt.zero_grad()
        got["weights"] = run.full_state_dict()
        got["linear_dtypes"] = sorted(got["linear_dtypes"])
        results[name] = got
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("modpipe") / "out.pt", nproc=4,
                            timeout=900)  # 8 cases; the 2 shared cores are often loaded


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def ref_bf16():
    return reference(bf16=True)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(launched, ref, ref_bf16, name):
    got = launched[name]
    if name.endswith("bf16"):  # bf16 matmuls (fp32 master weights and reductions)
        assert got["linear_dtypes"] == ["torch.bfloat16"], got["linear_dtypes"]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_bf16["losses"]),
                                   rtol=BF16_RTOL, atol=0)
        # the first step's gradients (same weights) against fp32, within bf16's rounding;
        # after AdamW's first, sign-like update near-zero gradients move weights by a full lr
        for fqn, grad in got["grads"][0].items():
            want = ref["grads"][0][fqn]
            err = (grad.float() - want).norm() / want.norm().clamp_min(1e-12)
            assert err < 3e-2, f"{fqn}: relative error {err:.3g}"
        return
    assert got["linear_dtypes"] == ["torch.float32"], got["linear_dtypes"]
    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **close)
    for step in range(STEPS):
        assert set(got["grads"][step]) == set(ref["grads"][step])
        for fqn, grad in got["grads"][step].items():
            torch.testing.assert_close(grad, ref["grads"][step][fqn], **close,
                                       msg=lambda m: f"step {step} {fqn}: {m}")
        torch.testing.assert_close(torch.tensor(got["norms"][step]), ref["norms"][step], **close)
    # as tests/test_module_engine.py: Adam's first step amplifies 1e-10 gradient differences
    # on near-zero gradients; the weights agree to 1% of the learning rate
    for fqn, weight in ref["weights"].items():
        torch.testing.assert_close(got["weights"][fqn], weight, rtol=1e-5, atol=1e-2 * LR,
                                   msg=lambda m: f"{fqn}: {m}")


if __name__ == "__main__":
    worker(sys.argv[1])
