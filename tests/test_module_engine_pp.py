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
CASES = {  # name -> (layout of tests/harness/equivalence.py, built on meta)
    "dp2xpp2-gpipe": ("dp2xpp2+gpipe", False),
    "dp2xpp2-1f1b": ("dp2xpp2+1f1b", False),
    "pp2xtp2": ("tp2xpp2", False),
    "dp2xpp2-zero3-meta": ("dp2xpp2+zero3", True),
    "dp2xpp2-recompute-full": ("dp2xpp2+full", False),
    "dp2xpp2-interleaved": ("dp2xpp2+interleaved", False),
    # bf16: fully_shard's MixedPrecisionPolicy per stage; without dp, autocast
    "dp2xpp2-bf16": ("dp2xpp2+bf16", False),
    "pp2xtp2-bf16": ("tp2xpp2+bf16", False),
}
# tests/test_module_engine_gqa.py's model and layouts, run in this file's launch (same
# batches, steps and optimizer): 8 query heads sharing 2 key/value heads, head dim 8
GQA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=4&"
       "num_attention_heads=8&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
GQA_CASES = {"dp2xtp2-sp": "dp2xtp2+sp", "pp2xtp2-sp": "tp2xpp2+sp"}
# every run of the launch: name -> (model spec, layout, built on meta)
RUNS = {**{name: (LLAMA, lay, meta) for name, (lay, meta) in CASES.items()},
        **{f"gqa-{name}": (GQA, lay, False) for name, lay in GQA_CASES.items()}}


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
    from tests.harness.equivalence import LAYOUTS

    for lay, _ in CASES.values():
        plan = plan_for(meta, graph, **LAYOUTS[lay])
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
                                loss_fn=nn.functional.mse_loss, dp=2, pp=2, microbatch_size=4,
                                batch_norm="microbatch")
    assert plan.engine == "graph" and "running statistics" in plan.engine_note
    bf16 = plan_for(meta, graph, dp=2, pp=2, dtype="bf16")
    assert bf16.engine == "modules", bf16.engine_note
    with pytest.raises(meshplan.MeshplanError, match="needs loss scaling"):
        plan_for(meta, graph, dp=2, pp=2, dtype="fp16")  # no engine runs fp16 pipelines


# -- 4 gloo processes against one process ------------------------------------------------------

def forward(model, ids):
    return model(ids, use_cache=False).logits


def next_token(logits, ids):
    from meshplan.tracing import next_token_loss
    return next_token_loss(logits.float(), ids)


@pytest.fixture(scope="module")
def expected():
    """One process (tests/harness/equivalence.py), per (model, bf16): fp32 with its fp64
    twin for the tolerance, or under bf16 autocast (fp32 master weights)."""
    from tests.harness.equivalence import expected as reference, train_reference

    cache = {}

    def get(spec: str, bf16: bool = False):
        if (spec, bf16) not in cache:
            kw = dict(optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
            cache[spec, bf16] = \
                train_reference(lambda: build(spec=spec), batches(), forward, next_token,
                                autocast=torch.bfloat16, **kw) if bf16 else \
                reference(lambda: build(spec=spec), batches(), forward, next_token, **kw)
        return cache[spec, bf16]
    return get


def worker(path: str) -> None:
    import torch.distributed as dist

    from meshplan.tracing import trace
    from tests.harness.equivalence import LAYOUTS

    dist.init_process_group("gloo")
    graphs, results = {}, {}
    for name, (spec, lay, on_meta) in RUNS.items():
        if dist.get_rank() == 0 and spec not in graphs:  # one trace per model
            graphs[spec] = trace(build("meta", spec),
                                 (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),))
        holder = [plan_for(build("meta", spec), graphs.get(spec), **LAYOUTS[lay])
                  if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        plan = holder[0]
        assert plan.engine == "modules", plan.engine_note
        model = build("meta" if on_meta else "cpu", spec)
        run = meshplan.parallelize(model, plan)
        if on_meta:  # only this stage's local shards got memory
            real = build(spec=spec)
            run.load_full_state_dict({**real.state_dict(), **dict(real.named_buffers())},
                                     strict=False)
        opt = torch.optim.AdamW(run.parameters(), lr=LR)
        got = {"engine": type(run.engine).__name__, "losses": [], "grads": [], "norms": [],
               "linear_dtypes": set()}
        # the dtype the stage's matmuls compute in (bf16 plans: bf16, not fp32 left on)
        for module in getattr(run.engine, "modules", [model]):
            for sub in module.modules():
                if isinstance(sub, torch.nn.Linear):
                    sub.register_forward_hook(
                        lambda m, a, out, seen=got["linear_dtypes"]: seen.add(str(out.dtype)))
        per = BATCH // run.dp_size
        for ids in batches():
            got["losses"].append(run.train_step((ids[run.dp_rank * per:(run.dp_rank + 1) * per],)))
            got["grads"].append(run.engine.full_grads())
            got["norms"].append(float(run.clip_grad_norm_(1e9)))
            opt.step()
            opt.zero_grad()
        got["weights"] = run.full_state_dict()
        got["linear_dtypes"] = sorted(got["linear_dtypes"])
        results[name] = got
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("modpipe") / "out.pt", nproc=4,
                            timeout=900)  # 10 runs; the 2 shared cores are often loaded


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_one_process(launched, expected, name):
    """Losses, every step's gradients and gradient norm, the final weights, within the
    harness's rule (tests/harness/equivalence.py). As tests/test_module_engine.py: Adam's
    first step amplifies 1e-10 gradient differences on near-zero gradients, under the 1e-4
    floor on weights. bf16 plans against a bf16-autocast process."""
    from tests.harness.equivalence import assert_equivalent

    got, spec = launched[name], RUNS[name][0]
    pipelined = "pp2" in RUNS[name][1]
    assert got["engine"] == ("PipelineModuleEngine" if pipelined else "ModuleEngine")
    if name.endswith("bf16"):  # bf16 matmuls (fp32 master weights and reductions)
        assert got["linear_dtypes"] == ["torch.bfloat16"], got["linear_dtypes"]
        torch.testing.assert_close(torch.tensor(got["losses"]),
                                   torch.tensor(expected(spec, bf16=True)["losses"]),
                                   rtol=BF16_RTOL, atol=0)
        # the first step's gradients (same weights) against fp32, within bf16's rounding;
        # after AdamW's first, sign-like update near-zero gradients move weights by a full lr
        for fqn, grad in got["grads"][0].items():
            want = expected(spec).ref["grads"][0][fqn]
            err = (grad.float() - want).norm() / want.norm().clamp_min(1e-12)
            assert err < 3e-2, f"{fqn}: relative error {err:.3g}"
        return
    assert got["linear_dtypes"] == ["torch.float32"], got["linear_dtypes"]
    assert_equivalent(got, expected(spec), name)


if __name__ == "__main__":
    worker(sys.argv[1])
