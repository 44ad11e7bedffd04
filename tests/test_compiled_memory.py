"""Activation memory of blocks as torchtitan runs them, eager and under torch.compile, against
what autograd and AOTAutograd's partitioner really keep on this CPU (saved-tensor hooks count
each saved storage once; weights and their autocast copies excluded: the model state prices
those): benchmarks/gpu/sac_compile.py's Llama blocks (torchtitan's model code) at a small
size, bf16 weights (FSDP2's compute) or fp32 weights under torch.autocast, no recompute or
torchtitan's op-level selective AC (costmodel/partition.py, DECISIONS 111)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import meshplan
from meshplan.costmodel.hardware import load_preset
from meshplan.costmodel.stage_layout import stage_activation_profile
from tests.harness.benchmarks import ROOT, gpu_benchmark_module

DIMS = {"blocks": 3, "dim": 256, "heads": 4, "kv_heads": 2, "hidden": 704}
SEQ = 128


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles blocks of its own sizes: a second size of the same code makes dynamo
    retrace with dynamic shapes, in later tests of this process too."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def sac():
    with gpu_benchmark_module("sac_compile") as module:
        module.SEQ = SEQ
        yield module


def _weight_copy(t, net) -> bool:
    """Autocast's bf16 copy of a weight (or its transpose): model state, not activation."""
    return t.dtype == torch.bfloat16 and any(
        t.shape == w.shape and torch.equal(t, w.to(torch.bfloat16))
        for p in net.parameters() if p.dim() == 2 for w in (p.detach(), p.T))


def _saved_by_block(sac, ac: str, compiled: bool, regime: str) -> list[int]:
    """Bytes each block saves for its backward (its own saved storages, first seen there)."""
    net = sac.build(ac, compiled, "cpu", regime, **DIMS)
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}
    dtype = torch.bfloat16 if regime == "bf16" else torch.float32
    x = torch.randn(sac.BATCH, SEQ, DIMS["dim"], dtype=dtype,
                    generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # compiles
        sac.run_step(net, x, regime)
    saved: dict[int, int] = {}
    casts: set[int] = set()

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in weights and key not in saved and key != x.untyped_storage().data_ptr():
            saved[key] = storage.nbytes()
            if regime == "autocast" and _weight_copy(t, net):
                casts.add(key)
        return t
    per_block = []
    h = x
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=regime == "autocast")
    with amp, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        table = net.freqs_cis[:SEQ]
        for block in net.layers:
            before = set(saved)
            h = block(h, table)
            per_block.append(sum(b for k, b in saved.items()
                                 if k not in before and k not in casts))
    return per_block


def _saved_by_layer(net, block, loss, autocast: bool = False) -> int:
    """Bytes ``block`` saves for its backward in one forward of ``loss()`` (weights excluded,
    and their autocast copies where ``autocast``), after two steps that compile."""
    for _ in range(2):
        loss().backward()
    keys = {p.untyped_storage().data_ptr() for p in net.parameters()}
    saved: dict[int, int] = {}
    casts: set[int] = set()

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in keys and key not in saved:
            saved[key] = storage.nbytes()
            if autocast and _weight_copy(t, net):
                casts.add(key)
        return t
    marks: list[set] = []
    block.register_forward_pre_hook(lambda *_: marks.append(set(saved)))
    block.register_forward_hook(lambda *_: marks.append(set(saved)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss()
    return sum(saved[k] for k in marks[-1] - marks[-2] if k not in casts)


def _module_profile(meta, example, *, dtype: str, seq: int, compiled: bool, loss_fn=None,
                    attention: str = "flash"):
    """The activation profile of ``meta`` (a meta-device model) on one dgx-h100 GPU in a
    module-engine plan at the batch of ``example``, under autocast."""
    graph = meshplan.trace(meta, (example,), loss_fn=loss_fn)
    mesh = meshplan.Mesh.from_dict({"shape": [1], "hardware": "dgx-h100"})
    plan = meshplan.manual_plan(meta, mesh, graph=graph, dp=1, dtype=dtype,
                                microbatch_size=example.shape[0], engine="modules")
    return stage_activation_profile(plan.stages[0], graph, load_preset("dgx-h100"),
                                    dtype=dtype, microbatches=1, seq_len=seq,
                                    precision="autocast", compiled=compiled,
                                    attention=attention)


def _profile(sac, regime: str, compiled: bool):
    dp = 2 if regime == "bf16" else 1  # FSDP2 holds bf16 weights where dp > 1
    with torch.device("meta"):
        net = sac.Blocks(**DIMS)
    x = torch.zeros(dp * sac.BATCH, SEQ, DIMS["dim"], device="meta")
    graph = meshplan.trace(net, (x,), loss_fn=sac.loss_fn)
    mesh = meshplan.Mesh.from_dict({"shape": [dp], "hardware": "dgx-h100"})
    plan = meshplan.manual_plan(net, mesh, graph=graph, dp=dp, zero=3 if dp > 1 else 0,
                                dtype="bf16", microbatch_size=sac.BATCH, engine="torchtitan")
    return stage_activation_profile(plan.stages[0], graph, load_preset("dgx-h100"),
                                    dtype="bf16", microbatches=1, seq_len=SEQ,
                                    precision="fsdp" if dp > 1 else "autocast",
                                    compiled=compiled)


@pytest.mark.parametrize("regime", ["bf16", "autocast"])
@pytest.mark.parametrize("ac", ["none", "selective"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_block_keeps_what_autograd_and_the_partitioner_save(sac, regime, ac, compiled):
    """A middle block's kept bytes, priced against what it saves. Under compile the
    partitioner keeps a normalisation's input and ``rsqrt`` (not its fp32 chain), the
    matmul inputs its backward reads (the bf16 copies under autocast), and not the SiLU
    (bf16 no recompute: 16.3 units of a block's hidden state against 23.05 eager); under
    torchtitan's selective AC it keeps only the saved matmul outputs its backward reads
    (not the last projection's, which eager SAC stores). Before DECISIONS 111 compiled
    blocks were priced as the eager tensors at the plan's dtype (1.14-1.3x)."""
    if ac == "selective" and not compiled:
        pytest.skip("eager SAC stores its saved outputs outside the saved-tensor hooks")
    measured = _saved_by_block(sac, ac, compiled, regime)[1]
    prof = _profile(sac, regime, compiled)
    if ac == "none":
        predicted = prof.kept[1]
    else:
        predicted = prof.kept_alternate[1] + prof.boundary[1]
    assert predicted == pytest.approx(measured, rel=0.01)


def test_a_float_input_is_held_in_the_dtype_fsdp2_casts_it_to(sac):
    """FSDP2 casts the root module's float inputs to its param dtype
    (``MixedPrecisionPolicy.cast_forward_inputs``): blocks fed bf16 hidden states keep a
    bf16 residual stream. Before, a float graph input was held in fp32 whatever the
    precision, and so the residual stream and every normalisation after it (all blocks'
    kept bytes 1.16x what autograd saves)."""
    measured = sum(_saved_by_block(sac, "none", False, "bf16"))
    prof = _profile(sac, "bf16", False)
    predicted = sum(v for layer, v in prof.kept.items() if layer >= 0)
    assert predicted == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_one_gpu_models_blocks_keep_what_they_save(compiled):
    """benchmarks/gpu/model.py's Llama (the one-GPU check's model: real-valued rotary tables
    made once outside the blocks, which no block's cut counts again) through the module
    engine's plan, fp32 weights under autocast, each block compiled as the module engine
    compiles it (``nn.Module.compile``): a middle block's kept bytes against what it saves."""
    gpu = os.path.join(ROOT, "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        import model as M
    finally:
        sys.path.remove(gpu)
    size = dict(vocab=512, dim=256, layers=3, heads=4, kv_heads=2, hidden=704, max_seq=160)
    batch, seq = 2, 160
    torch.manual_seed(0)
    net = M.Llama(**size)
    if compiled:
        for block in net.layers:
            block.compile()
    ids = torch.randint(0, size["vocab"], (batch, seq))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = net(ids)
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    measured = _saved_by_layer(net, net.layers[1], loss, autocast=True)
    with torch.device("meta"):
        meta = M.Llama(**size)
    prof = _module_profile(meta, torch.zeros(batch, seq, dtype=torch.long, device="meta"),
                           dtype="bf16", seq=seq, compiled=compiled)
    assert prof.kept[1] == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("attention,p", [("sdpa", 0.0), ("eager", 0.0), ("eager", 0.1)])
def test_a_compiled_gpt2_block_keeps_what_the_partitioner_saves(attention, p):
    """Another family: transformers' GPT-2 (LayerNorm, GELU, Conv1D's addmm), fp32, each block
    compiled, with SDPA or its eager attention (the s x s probabilities a matmul reads back),
    dropout off or on (not SDPA with dropout: on CPU it takes its math path, which no GPU
    runs). A dropout keeps its bool mask and has its output recomputed; one of
    probability 0, like GPT-2's cast of the probabilities to the dtype they have, is its
    input (before, each was a tensor of its own: the probabilities counted twice, 11% over;
    a dropout's output kept instead of its mask, 3% over)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=512, n_positions=96, n_embd=128, n_layer=3, n_head=4,
                     resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, use_cache=False)
    cfg._attn_implementation = attention
    batch, seq = 2, 96
    torch.manual_seed(0)
    net = GPT2LMHeadModel(cfg).train()
    for block in net.transformer.h:
        block.compile()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))

    def loss():
        logits = net(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    measured = _saved_by_layer(net, net.transformer.h[1], loss)
    with torch.device("meta"):
        meta = GPT2LMHeadModel(cfg).train()
    prof = _module_profile(meta, torch.zeros(batch, seq, dtype=torch.long, device="meta"),
                           dtype="fp32", seq=seq, compiled=True,
                           attention="materialized" if attention == "eager" else "flash")
    assert prof.kept[1] == pytest.approx(measured, rel=0.01)


class _CatBlock(torch.nn.Module):
    """``x + W silu(cat[x, 2x])``: ``cat`` is outside the partitioner's recomputable list."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = torch.nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.w(torch.nn.functional.silu(torch.cat([x, x * 2], dim=-1)))


class _CatNet(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CatBlock(dim) for _ in range(3))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


def test_an_operator_the_partitioner_may_not_recompute_is_kept():
    """torch's partitioner recomputes only the operators of its allowlist
    (``ban_recompute_not_in_allowlist``): the ``cat`` output is kept, not remade from the
    block's input (before: priced as remade, 25% under)."""
    dim, batch, seq = 64, 2, 32

    def loss_fn(out, *rest):
        return out.pow(2).mean()
    torch.manual_seed(0)
    net = _CatNet(dim)
    for block in net.layers:
        block.compile()
    x = torch.randn(batch, seq, dim)
    measured = _saved_by_layer(net, net.layers[1], lambda: loss_fn(net(x)))
    with torch.device("meta"):
        meta = _CatNet(dim)
    prof = _module_profile(meta, torch.zeros(batch, seq, dim, device="meta"), dtype="fp32",
                           seq=seq, compiled=True, loss_fn=loss_fn)
    assert prof.kept[1] == pytest.approx(measured, rel=0.01)
