"""The module engine (runtime/modules.py): which plans it takes, and on 4 gloo processes the
losses, gradients, gradient norm and final weights of plain one-process PyTorch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan
from meshplan.specs import parse_model_spec

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=4&vocab_size=256")
GPT2 = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
BATCH, SEQ, STEPS, LR, VOCAB = 8, 16, 2, 1e-2, 64
CASES = {  # name -> (model, layout of tests/harness/equivalence.py, built on meta)
    "llama-dp4-zero0": ("llama", "dp4+zero0", False),
    "llama-dp4-zero3-meta": ("llama", "dp4+zero3", True),
    "llama-dp2xtp2": ("llama", "dp2xtp2", False),
    "llama-tp4-recompute-full": ("llama", "tp4+full", False),
    "moduledict-dp2xtp2": ("toy", "dp2xtp2", False),
    # 4 microbatches, gradient sync deferred to the last one
    "llama-dp2xtp2-zero1-selective": ("llama", "dp2xtp2+zero1+selective", False),
    "llama-dp4-zero2": ("llama", "dp4+zero2", False),  # reduce-scatter per microbatch
    "moduledict-dp2xtp2-sp": ("toy", "dp2xtp2+sp", False),
    "llama-dp2xtp2-zero3-bf16": ("llama", "dp2xtp2+zero3+bf16", False),
}


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class BiasedModuleDict(nn.Module):
    """torchtitan-style: blocks in an nn.ModuleDict keyed "0", "1"; every Linear biased."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.layers.values():
            h = block(h)
        return self.head(self.norm(h))


def build(kind: str, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    if kind == "toy":
        with torch.device(device):
            return BiasedModuleDict()
    return parse_model_spec(LLAMA if kind == "llama" else GPT2).build(device=device)


def plan_for(model: nn.Module, graph=None, **options) -> meshplan.Plan:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=(ids,),
                                graph=graph, **{"pp": 1, **options})


def batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    vocab = VOCAB if kind == "toy" else 256
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=g),
             torch.randint(0, vocab, (BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def loss_of(kind: str, out, ids, targets):
    """The engine's defaults: cross-entropy on targets (toy), next-token loss (Llama)."""
    from meshplan.tracing import next_token_loss
    if kind == "toy":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    return next_token_loss(out, ids)


# -- pure: which plans the module engine takes ------------------------------------------------

@pytest.fixture(scope="module")
def metas():
    return {kind: build(kind, "meta") for kind in ("llama", "gpt2", "toy")}


def test_llama_and_moduledict_tensor_parallel_are_expressible(metas):
    from meshplan.runtime.module_engine import module_engine_refusal
    from meshplan.runtime.modules import tp_styles
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    for kind in ("llama", "toy"):
        plan = plan_for(metas[kind], dp=2, tp=2)
        assert module_engine_refusal(plan, metas[kind]) is None
    styles, why = tp_styles(plan, metas["toy"])
    assert why is None
    assert isinstance(styles["layers.0.up"], ColwiseParallel)
    assert isinstance(styles["layers.1.down"], RowwiseParallel)
    assert isinstance(styles["embed"], RowwiseParallel)  # vocab-parallel embedding
    assert isinstance(styles["head"], ColwiseParallel)  # the head gathers its logits


def test_sequence_parallel_runs_a_plain_residual_stream_and_hf_llama(metas):
    """The residual stream stays a sequence-sharded DTensor between the layers, so HF Llama,
    which sizes its positions and rotary table from the sequence it reads, sees the global
    one (it was refused while the stream was local rows; tests/test_module_engine_gqa.py runs
    it against one process)."""
    from meshplan.runtime.module_engine import module_engine_refusal
    from meshplan.runtime.modules import tp_styles
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = plan_for(metas["toy"], dp=2, tp=2, sequence_parallel=True)
    assert module_engine_refusal(plan, metas["toy"]) is None
    styles, _ = tp_styles(plan, metas["toy"])
    assert {n for n, st in styles.items() if isinstance(st, SequenceParallel)} == \
        {"layers.0.norm", "layers.1.norm", "norm"}
    assert all(not st.use_local_output for st in styles.values()
               if isinstance(st, SequenceParallel))
    assert module_engine_refusal(plan_for(metas["llama"], tp=4, sequence_parallel=True),
                                 metas["llama"]) is None


def test_gpt2_conv1d_fused_qkv_is_refused(metas):
    from meshplan.runtime.module_engine import module_engine_refusal

    why = module_engine_refusal(plan_for(metas["gpt2"], dp=2, tp=2), metas["gpt2"])
    assert why is not None and "c_attn" in why and "Conv1D" in why
    assert module_engine_refusal(plan_for(metas["gpt2"], dp=4, zero=3), metas["gpt2"]) is None


def test_shards_the_forward_cannot_run_are_refused():
    """2 key/value heads over tp=4: each rank would hold half a head. manual_plan refuses it
    when the plan is made, on every engine (support.heads_rule: the graph engine crashed at
    run time on it, "Cannot unflatten unevenly sharded tensor"); a plan built without the
    model (build_manual_plan) is refused by the module engine in the same line."""
    from meshplan.errors import PlanningError
    from meshplan.planner.manual import build_manual_plan
    from meshplan.runtime.module_engine import module_engine_refusal
    from meshplan.runtime.modules import tp_styles
    from meshplan.tracing import trace

    model = parse_model_spec(LLAMA.replace("num_key_value_heads=4", "num_key_value_heads=2")
                             ).build(device="meta")
    for engine in ("auto", "graph"):
        with pytest.raises(PlanningError, match=r"^num_key_value_heads=2 is not divisible by "
                           r"tp=4: .*; choose tp in \{1, 2\}$"):
            plan_for(model, tp=4, engine=engine)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    plan = build_manual_plan(trace(model, (ids,)), meshplan.Mesh.local(4), tp=4)
    styles, why = tp_styles(plan, model)
    assert styles == {} and why.startswith("num_key_value_heads=2 is not divisible by tp=4")
    assert module_engine_refusal(plan, model) == why


def test_fp16_plans_are_refused_and_pipelines_taken(metas):
    """Pipelines run on torch.distributed.pipelining (tests/test_module_engine_pp.py)."""
    from meshplan.runtime.module_engine import module_engine_refusal

    assert module_engine_refusal(plan_for(metas["llama"], dp=2, pp=2), metas["llama"]) is None
    assert module_engine_refusal(plan_for(metas["llama"], dp=2, pp=2, dtype="bf16"),
                                 metas["llama"]) is None
    assert "fp16" in module_engine_refusal(plan_for(metas["llama"], dp=4, dtype="fp16"),
                                           metas["llama"])


def test_a_plan_for_another_model_is_rejected(metas):
    from meshplan.errors import PlanFileError
    from meshplan.runtime.modules import check_model

    plan = plan_for(metas["toy"], dp=4)
    check_model(plan, metas["toy"])
    with pytest.raises(PlanFileError, match="places no parameter"):
        check_model(plan, metas["llama"])
    with torch.device("meta"):
        wider = BiasedModuleDict(dim=48)
    with pytest.raises(PlanFileError, match="trainable parameters"):
        check_model(plan, wider)


# -- 4 gloo processes against one process ------------------------------------------------------

def forward(kind: str):
    return lambda model, batch: (model(batch[0], use_cache=False).logits if kind == "llama"
                                 else model(batch[0]))


@pytest.fixture(scope="module")
def expected():
    """The one-process reference of each model (tests/harness/equivalence.py)."""
    from tests.harness.equivalence import expected as reference

    cache = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = reference(
                lambda: build(kind), batches(kind), forward(kind),
                lambda out, batch: loss_of(kind, out, *batch),
                optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                eval_batch=batches(kind)[0])
        return cache[kind]
    return get


def worker(path: str) -> None:
    import torch.distributed as dist

    from meshplan.runtime.modules import ModuleEngine

    from meshplan.tracing import trace

    dist.init_process_group("gloo")
    results, graphs = {}, {}
    from tests.harness.equivalence import LAYOUTS

    for name, (kind, lay, on_meta) in CASES.items():
        options = LAYOUTS[lay]
        if dist.get_rank() == 0 and kind not in graphs:  # one trace per model
            graphs[kind] = trace(build(kind, "meta"), (torch.zeros(BATCH, SEQ, dtype=torch.long,
                                                                   device="meta"),))
        holder = [plan_for(build(kind, "meta"), graphs.get(kind), **options)
                  if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder)
        model = build(kind, "meta" if on_meta else "cpu")
        engine = ModuleEngine(model, holder[0])
        if on_meta:  # only local shards got memory; the full weights (and inv_freq) come in
            real = build(kind)
            engine.load_full_state_dict({**real.state_dict(), **dict(real.named_buffers())})
        opt = torch.optim.AdamW(engine.parameters(), lr=LR)
        got = {"losses": [], "grads": [], "norms": []}
        per = BATCH // engine.dp_size
        for ids, targets in batches(kind):
            rows = slice(engine.dp_rank * per, (engine.dp_rank + 1) * per)
            got["losses"].append(engine.train_step((ids[rows],), {},
                                                   (targets[rows],) if kind == "toy" else ()))
            got["grads"].append(engine.full_grads())
            got["norms"].append(engine.clip_grad_norm_(1e9))
            opt.step()
            opt.zero_grad()
        got["weights"] = engine.full_state_dict()
        ids = batches(kind)[0][0]
        got["eval"] = engine.eval().forward((ids[:BATCH // engine.dp_size],))
        got["dp_size"] = engine.dp_size
        results[name] = got
    if dist.get_rank() == 0:
        torch.save(results, path)
    dist.barrier()  # gloo torn down under a peer still saving aborts it ("terminate called")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    from tests._launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("modengine") / "out.pt", nproc=4,
                            timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_process(launched, expected, name):
    """Losses, every step's gradients and gradient norm, the final weights and the eval
    forward on rank 0's rows, within the harness's rule (10x the fp32 reference's error
    against fp64; Adam's first step turns 1e-10 gradient differences on near-zero gradients
    into ~1e-5 weight ones, under the 1e-4 floor on weights and outputs)."""
    from tests.harness.equivalence import assert_equivalent

    exp, got = expected(CASES[name][0]), launched[name]
    if "bf16" in name:  # bf16 matmuls (fp32 master weights and reductions): ~3 digits
        torch.testing.assert_close(torch.tensor(got["losses"]),
                                   torch.tensor(exp.ref["losses"]), rtol=5e-3, atol=0)
        return
    assert_equivalent(got, exp, name, eval_rows=slice(0, BATCH // got["dp_size"]))


if __name__ == "__main__":
    worker(sys.argv[1])


def test_batchnorm_beyond_data_parallel_is_refused():
    """BatchNorm under data parallelism runs on the module engine, synchronised over the dp
    ranks (runtime/sync_batchnorm.py; trained in tests/test_batchnorm_user.py); split over
    tensor-parallel ranks it goes to the graph engine; on one rank the module engine runs
    it."""
    from meshplan.runtime.module_engine import module_engine_refusal

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    x, y = torch.zeros(8, 4, device="meta"), torch.zeros(8, dtype=torch.long, device="meta")
    kw = dict(example_targets=(y,), loss_fn=nn.functional.cross_entropy)
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), (x,), dp=2, **kw)
    assert module_engine_refusal(plan, model) is None and plan.engine == "modules"
    tp = meshplan.manual_plan(model, meshplan.Mesh.local(2), (x,), tp=2, **kw)
    why = module_engine_refusal(tp, model)
    assert why is not None and "1 is a BatchNorm and the plan splits the tp axis" in why
    assert tp.engine == "graph"
    one = meshplan.manual_plan(model, meshplan.Mesh.local(1), (x,), **kw)
    assert module_engine_refusal(one, model) is None and one.engine == "modules"
