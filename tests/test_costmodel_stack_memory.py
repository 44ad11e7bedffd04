"""What Megatron-LM and NeMo hold in memory (issue 26): fused kernels' activations and the
optimizer state of NeMo's recipes, each a closed-form small case on the tiny Llama traced on
the meta device (hidden 256, FFN 512, 4 heads, 2 KV heads of 64, 2 layers, 8 x 256 tokens)."""

import pytest

import meshplan
from meshplan.costmodel.estimate import (chunked_loss_stage, default_runtime,
                                         stage_activation_profile)
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GIB

H, FFN, KV_DIM, SEQ = 256, 512, 2 * 64, 256


def _profile(plan, graph, *, fused):
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    t = plan.training
    return stage_activation_profile(chunked_loss_stage(plan.stages[0], graph), graph, hw,
                                    dtype=t.dtype, microbatches=t.microbatches,
                                    seq_len=t.seq_len, fused=fused)


def test_fused_kernels_keep_what_transformer_engine_keeps(tiny_llama_h100):
    """A Llama block under Megatron-Core with Transformer Engine keeps, per token: the
    RMSNorm input and its output (LayerNormLinear's inp and ln_out) twice, the rotated q,
    k, v and the attention output, the fc1 output (gate and up: the fused SwiGLU's input)
    and the SwiGLU output (fc2's input) - 6 h + 2 kv + 3 ffn values, bf16. Eager autograd
    keeps more: the normalized value and rstd inside each RMSNorm, the SiLU output."""
    model, graph, mesh = tiny_llama_h100
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, dtype="bf16", zero=1,
                                engine="megatron")
    assert default_runtime(HardwareProfile.from_dict(plan.mesh.hardware),
                           engine="megatron").fused_activations
    fused, eager = _profile(plan, graph, fused=True), _profile(plan, graph, fused=False)
    per_layer = 2 * SEQ * (6 * H + 2 * KV_DIM + 3 * FFN)  # one sequence per microbatch
    rope = 2 * 2 * SEQ * 64  # cos and sin (s x head dim): every block reads them, kept once
    for layer in (0, 1):
        first = rope if layer == 0 else 0
        assert fused.kept[layer] == pytest.approx(per_layer + first)
        # eager: per RMSNorm the normalized value and two per-token scalars (the variance
        # plus eps, its rsqrt), and the SiLU output
        assert eager.kept[layer] == pytest.approx(
            per_layer + first + 2 * SEQ * (2 * H + 2 * 2 + FFN))
    assert fused.kept[-1] == eager.kept[-1]  # outside the blocks: not fused here


def _numel(graph, embedding_only=False):
    emb = {i for n in graph.nodes if n.kind == "embedding" for i in n.inputs}
    return sum(p.numel for p in graph.param_map.values()
               if p.trainable and p.tied_to is None and (p.name in emb or not embedding_only))


@pytest.mark.parametrize("dtype, master", [("bf16", 2), ("fp8", 4)])
def test_nemo_recipe_state_bf16_grads_and_master_remainders(tiny_llama_h100, dtype, master):
    """NeMo's recipes on Apex's DistributedFusedAdam (grad_sync_dtype bf16,
    store_param_remainders): bf16 weights (2 bytes), bf16 gradients (2) but the word
    embedding's in fp32 (4), and over dp x cp the moments and the 16-bit master remainder
    (4 + 4 + 2); under fp8 (fp8_params) NeMo stores whole fp32 masters (4 + 4 + 4).
    Megatron-LM keeps fp32 main gradients and an fp32 master: 4 and 4 + 4 + 4."""
    model, graph, mesh = tiny_llama_h100
    n, emb = _numel(graph), _numel(graph, embedding_only=True)
    mem = {}
    for engine in ("nemo", "megatron"):
        mem[engine] = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype=dtype,
                                           zero=1, engine=engine).predicted.memory
    nemo, megatron = mem["nemo"], mem["megatron"]
    assert nemo.params_gib == pytest.approx(2 * n / GIB)
    assert nemo.grads_gib == pytest.approx((2 * (n - emb) + 4 * emb) / GIB)
    assert nemo.optimizer_gib == pytest.approx((master + 8) * n / 8 / GIB)
    assert megatron.grads_gib == pytest.approx(4 * n / GIB)
    assert megatron.optimizer_gib == pytest.approx(12 * n / 8 / GIB)


def test_nemo_fp32_gradient_is_the_word_embeddings_even_when_tied():
    """NeMo keeps the word embedding's gradient in fp32 (``with_fp32_embedding_grads``): on
    GPT-2 the lookup reads ``lm_head.weight``, tied to ``transformer.wte.weight``, so the tie
    must be followed; the position embedding (wpe) stays bf16. bf16 -> fp32 adds 2 bytes per
    element of wte and nothing else."""
    from dataclasses import replace

    from meshplan.costmodel.params import parameter_walk
    from meshplan.costmodel.runtime_profiles import nemo_runtime
    from meshplan.specs import example_inputs, parse_model_spec

    spec = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=1024&n_positions=128"
    model = parse_model_spec(spec).build("meta")
    inputs = example_inputs(model, 16, 64)
    graph = meshplan.trace(model, inputs, model_name=spec)
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(4), example_inputs=inputs,
                                graph=graph, dp=4, microbatch_size=4)
    stage = plan.stages[0]
    readers: dict = {}
    for n in graph.nodes:
        op = stage.ops[n.name]
        for k, i in enumerate(n.inputs):
            if i in graph.param_map and k < len(op.inputs):
                readers.setdefault(i, []).append((op.output, op.inputs[k]))
    runtime = nemo_runtime(backend="gloo")
    grads = {flag: parameter_walk(stage, graph, readers, dtype="bf16", optimizer="adam",
                                  runtime=replace(runtime, fp32_embedding_grads=flag)).grads_bytes
             for flag in (True, False)}
    wte = graph.param_map["transformer.wte.weight"].numel
    assert grads[True] - grads[False] == pytest.approx(2 * wte)
