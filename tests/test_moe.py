"""Mixture-of-experts models (issue 39, first layer): traced on meta with the routed experts'
FLOPs at top-k, and the published MoE presets at their published sizes.

The analytic count follows torch.utils.flop_counter's convention, as meshplan/opcount.py
does: 2 FLOPs per multiply-add, each matmul weight met once per token (the routed experts'
weights by top_k / experts of the tokens: Fedus et al. 2021, Switch Transformers, sec. 2),
attention as 2 x batch x heads x seq^2 x (qk head + v head) per block (the full square:
the counter does not discount a causal mask).
"""

import sys
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.specs import MODEL_PRESETS, parse_model_spec, training_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import moe_grouped  # noqa: E402

B, S = 2, 32

MIXTRAL = ("transformers:mixtral?hidden_size=64&intermediate_size=96&num_hidden_layers=2"
           "&num_attention_heads=4&num_key_value_heads=2&vocab_size=256&num_local_experts=8"
           "&num_experts_per_tok=2")
# head_dim 32 with hidden 64 / 4 heads = 16: Qwen3-MoE's real shapes have head_dim 128 with
# hidden / heads = 64 (Qwen/Qwen3-30B-A3B config.json)
QWEN3_MOE = ("transformers:qwen3_moe?hidden_size=64&intermediate_size=128"
             "&moe_intermediate_size=32&num_hidden_layers=2&num_attention_heads=4"
             "&num_key_value_heads=2&head_dim=32&vocab_size=256&num_experts=8"
             "&num_experts_per_tok=2")
# multi-latent attention, one shared expert, a dense first block, sigmoid top-k routing with
# a score-correction bias and no auxiliary loss (transformers' DeepseekV3TopkRouter)
DEEPSEEK_V3 = ("transformers:deepseek_v3?hidden_size=64&intermediate_size=128"
               "&moe_intermediate_size=32&num_hidden_layers=3&first_k_dense_replace=1"
               "&num_attention_heads=4&num_key_value_heads=4&n_routed_experts=8"
               "&n_shared_experts=1&num_experts_per_tok=2&n_group=2&topk_group=1&q_lora_rank=32"
               "&kv_lora_rank=16&qk_nope_head_dim=16&qk_rope_head_dim=8&v_head_dim=16"
               "&vocab_size=256")
GPT_OSS = ("transformers:gpt_oss?hidden_size=64&intermediate_size=64&num_hidden_layers=2"
           "&num_attention_heads=4&num_key_value_heads=2&head_dim=16&num_local_experts=8"
           "&num_experts_per_tok=2&vocab_size=256&sliding_window=8")


def experts_of(model) -> tuple[int, int]:
    """(routed experts, top_k) of a transformers MoE config or the example's MoEDecoder."""
    c = getattr(model, "config", None)
    if c is None:
        return model.num_experts, model.top_k
    return (getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
            or c.n_routed_experts), c.num_experts_per_tok


def attention_dims(model) -> tuple[int, int, int, int]:
    """(blocks, heads, qk head size, v head size)."""
    c = getattr(model, "config", None)
    if c is None:
        block = model.layers[0]
        return len(model.layers), block.heads, block.proj.in_features // block.heads, \
            block.proj.in_features // block.heads
    if c.model_type == "deepseek_v3":
        return (c.num_hidden_layers, c.num_attention_heads,
                c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_attention_heads, d, d


def analytic_forward(model, batch: int, seq: int) -> tuple[float, float]:
    """(whole forward, routed experts' part) in FLOPs: every weight matrix but the input
    embeddings met by every token, the routed experts' (experts, ., .) weights by top_k of
    every experts tokens, plus attention."""
    experts, k = experts_of(model)
    tokens = batch * seq
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dense = routed = 0.0
    for name, p in model.named_parameters():
        if p.dim() < 2 or id(p) in lookups:
            continue  # norms and biases (no matmul work), embedding lookups
        if ".experts." in name:
            routed += p.numel() * k / experts if p.dim() == 3 else 0  # 2-D: expert biases
        else:
            dense += p.numel()
    blocks, heads, dqk, dv = attention_dims(model)
    attention = blocks * 2 * batch * heads * seq * seq * (dqk + dv)
    return 2 * tokens * (dense + routed) + attention, 2 * tokens * routed


def _transformers(text):
    def build():
        return parse_model_spec(text).build()
    return build


def _example(factory):
    def build():
        with torch.device("meta"):
            return factory()
    return build


MODELS = {
    "mixtral": _transformers(MIXTRAL), "qwen3_moe": _transformers(QWEN3_MOE),
    "deepseek_v3": _transformers(DEEPSEEK_V3), "gpt_oss": _transformers(GPT_OSS),
    "grouped_mm": _example(moe_grouped.tiny_moe),
    "grouped_mm_deepseek_style": _example(moe_grouped.tiny_deepseek_style),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_routed_experts_are_counted_at_top_k(name):
    """Traced on meta, the grouped GEMMs' FLOPs are top_k / experts of running every
    expert on every token, and the whole forward is within 10% of the analytic count."""
    model = MODELS[name]()
    assert all(p.is_meta for p in model.parameters())
    call = training_call(model, B, S)
    g = meshplan.trace(model, call.inputs, example_targets=call.targets, model_name=name)
    whole, routed = analytic_forward(model, B, S)
    grouped = [n for n in g.nodes if "grouped_mm" in n.target]
    experts, k = experts_of(model)
    got = sum(n.flops for n in grouped)
    print(f"{name}: routed experts {got / routed:.4f} of analytic, forward "
          f"{g.forward_flops / whole:.4f} of analytic")
    assert grouped and all(n.flops > 0 for n in grouped)
    assert abs(got / routed - 1) <= 0.10, (got, routed)
    assert abs(g.forward_flops / whole - 1) <= 0.10, (g.forward_flops, whole)
    # every expert on every token would be experts / top_k times as much
    assert got < routed * experts / k / 2


def test_grouped_mm_model_equals_its_expert_loop_on_cpu():
    """The example's dispatcher (sort by expert, grouped GEMM, unsort) computes what running
    each expert on its own tokens computes: outputs and gradients, softmax and sigmoid
    routing, with a shared expert. Tolerance: the grouped GEMM runs in bf16 (8 mantissa
    bits, relative error 2^-8 per rounding) while the loop runs in fp32."""
    torch.manual_seed(0)
    kw = dict(layers=2, dense_layers=1, shared_hidden=32, score="sigmoid")
    grouped = moe_grouped.MoEDecoder(**kw)
    loop = moe_grouped.MoEDecoder(**kw, use_grouped_mm=False)
    loop.load_state_dict(grouped.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    y, ref = grouped(ids), loop(ids)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-3)
    y.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(grouped.named_parameters(), loop.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=1e-3, msg=name)


def test_qwen3_moe_builds_at_its_real_head_dim():
    """head_dim is no field of transformers' Qwen3MoeConfig, yet its modeling code reads it
    (getattr with hidden / heads as fallback) and Qwen's config.json sets it: the spec takes
    it and the attention is built that wide."""
    model = parse_model_spec(QWEN3_MOE).build()
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == 32 and attn.q_proj.out_features == 4 * 32
    assert parse_model_spec("qwen3-30b-a3b").build().model.layers[0].self_attn \
        .q_proj.out_features == 32 * 128


# (preset, published total, published active, active counts the input embedding): the
# authors' numbers, sources beside MODEL_PRESETS in meshplan/specs.py; OpenAI's gpt-oss card
# (Table 1) counts active parameters without the embedding table, the others with it
PUBLISHED = [("mixtral-8x7b", 46.7e9, 12.9e9, True), ("qwen3-30b-a3b", 30.5e9, 3.3e9, True),
             ("qwen3-235b-a22b", 235e9, 22e9, True), ("deepseek-v3", 671e9, 37e9, True),
             ("gpt-oss-120b", 117e9, 5.1e9, False)]


def parameter_counts(model) -> tuple[int, float, int]:
    """(total, active per token, input embedding) parameters."""
    experts, k = experts_of(model)
    total = embedding = 0
    active = 0.0
    for name, p in model.named_parameters():
        total += p.numel()
        active += p.numel() * (k / experts if ".experts." in name else 1)
        if "embed_tokens" in name:
            embedding += p.numel()
    return total, active, embedding


@pytest.mark.parametrize("preset,total,active,with_embedding", PUBLISHED,
                         ids=[p[0] for p in PUBLISHED])
def test_moe_presets_have_their_published_sizes(preset, total, active, with_embedding):
    """Built on meta from the preset's config.json values: total and active parameters
    within 2% of the published figures (given to 2-3 significant digits)."""
    assert preset in MODEL_PRESETS
    got_total, got_active, embedding = parameter_counts(parse_model_spec(preset).build())
    if not with_embedding:
        got_active -= embedding
    print(f"{preset}: {got_total / 1e9:.2f}B total, {got_active / 1e9:.2f}B active")
    assert abs(got_total / total - 1) <= 0.02, got_total
    assert abs(got_active / active - 1) <= 0.02, got_active


# qk head 8 + 8 = v head 16: CPU SDPA runs its flash kernel (q, k, v, output and logsumexp
# kept), as GPUs run DeepSeek-V3's 192 / 128 heads; unequal heads take CPU's math path
DEEPSEEK_ACT = DEEPSEEK_V3.replace("qk_nope_head_dim=16", "qk_nope_head_dim=8")


def test_deepseek_activations_per_rank_match_what_eager_autograd_saves():
    """A DeepSeek-V3-style model (multi-latent attention, a dense first block, two MoE
    blocks with a shared expert) in bf16: what eager autograd saves for one rank's
    microbatch (2 x 64 tokens), block by block, with saved-tensor hooks counting each saved
    storage once (parameters excluded), against the kept bytes a dp=8 plan prices per rank.

    Measured before the fix (module engine, KiB per block: dense, MoE, MoE): priced 784 /
    940 / 923 against 580 / 664 / 662 saved at the head sizes of DEEPSEEK_V3; 800 / 956 /
    939 against 398 / 482 / 480 here. Three mechanisms: (1) the attention's keys, which
    transformers builds with ``kv_nope.new_empty(...)`` and fills by ``copy_``, were
    priced at the global batch (the plan places a factory replicated; each rank's module
    allocates its local batch: ``stage_layout.factory_split``), dp times their size -
    12 GiB per DeepSeek-V3 layer at dp 64; (2) ``copy_`` kept its inputs (CopyBackwards
    keeps none); (3) the experts' ``input.to(weight.dtype)`` before the grouped GEMM was
    priced as an fp32 upcast in a run whose weights FSDP2 holds in bf16
    (``eager._cast_to_weights``). The Megatron profile (every float in bf16) prices the
    same per rank at dp=8 as at dp=1."""
    from meshplan.costmodel.runtime_profiles import plan_runtime
    from meshplan.costmodel.stage_layout import stage_activation_profile
    from meshplan.tracing import next_token_loss

    batch, seq, dp = 2, 64, 8
    spec = parse_model_spec(DEEPSEEK_ACT)
    torch.manual_seed(0)
    model = spec.build("cpu").to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    block = [-1]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: block.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: block.__setitem__(0, -1))
    saved: dict[int, tuple[int, int]] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in saved:
            saved[ptr] = (block[0], t.untyped_storage().nbytes())
        return t
    ids = torch.randint(0, 256, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        next_token_loss(model(ids).logits.float(), ids)
    measured = {i: sum(b for k, b in saved.values() if k == i) for i in range(3)}

    meta = spec.build("meta")

    def priced(engine, ranks):
        graph = meshplan.trace(meta, (torch.zeros(batch * ranks, seq, dtype=torch.long,
                                                  device="meta"),))
        mesh = meshplan.Mesh.from_dict({"shape": [ranks], "hardware": "dgx-a100-80gb"})
        plan = meshplan.manual_plan(meta, mesh, graph=graph, dp=ranks, microbatch_size=batch,
                                    dtype="bf16", engine=engine)
        hw = HardwareProfile.from_dict(plan.mesh.hardware)
        rt = plan_runtime(plan, hw)
        return stage_activation_profile(
            plan.stages[0], graph, hw, dtype="bf16", microbatches=1, seq_len=seq,
            fused=rt.fused_activations, local_factories=rt.local_factories,
            precision="fsdp" if rt.eager_activations else "").kept
    kept = priced("modules", dp)
    print({i: (round(kept[i] / 1024, 1), round(measured[i] / 1024, 1)) for i in range(3)})
    for i in range(3):  # dense block exact; MoE blocks within the routing's few index tensors
        assert abs(kept[i] / measured[i] - 1) <= (0.01 if i == 0 else 0.07), (i, kept, measured)
    assert abs(sum(kept[i] for i in range(3)) / sum(measured.values()) - 1) <= 0.03
    one, eight = priced("megatron", 1), priced("megatron", dp)
    for i in range(3):
        assert eight[i] == pytest.approx(one[i], rel=1e-3), (i, one, eight)


def test_grouped_gemm_per_expert_launches_bound_few_tokens_per_expert():
    """Transformer Engine's grouped GEMM is one cuBLAS GEMM per local expert
    (``multi_stream_cublas_gemm``), so 16 experts of 8 rows cost at least 16 kernel
    latencies forward and 32 backward (80 us, 160 us on an H100 preset); one grouped kernel
    (``torch._grouped_mm``) costs one (two) on top of its work. With many rows per expert
    the work dominates either way."""
    from meshplan.costmodel.moe import grouped_gemm_time_s
    from meshplan.mesh import load_preset

    hw = load_preset("dgx-h100")
    lat = hw.device.kernel_latency_s
    few = dict(flops=2 * 16 * 8 * 2048 * 1536, groups=16, rows=8, k=2048, n=1536)
    f, b = grouped_gemm_time_s(hw, "bf16", per_expert=True, **few)
    f1, b1 = grouped_gemm_time_s(hw, "bf16", **few)
    assert f >= 16 * lat and b >= 32 * lat
    assert f > 1.5 * f1  # 43 us: one kernel reading the 16 experts' weights
    many = dict(flops=2 * 16 * 8192 * 2048 * 1536, groups=16, rows=8192, k=2048, n=1536)
    f, b = grouped_gemm_time_s(hw, "bf16", per_expert=True, **many)
    f1, b1 = grouped_gemm_time_s(hw, "bf16", **many)
    assert abs(f / f1 - 1) < 0.05 and abs(b / b1 - 1) < 0.05
