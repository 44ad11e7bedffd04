"""Tracing into the OpGraph: structure, FLOPs against closed forms, families, repeated layers."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import meshplan
from meshplan.tracing import _TRACES
from meshplan.errors import TraceError
from meshplan.graph import OpKind
from meshplan.specs import example_inputs, parse_model_spec

B, S = 4, 32
GPT2 = "transformers:gpt2?n_layer=3&n_embd=128&n_head=4&vocab_size=512&n_positions=64"
LLAMA = ("transformers:llama?hidden_size=128&intermediate_size=320&num_hidden_layers=3"
         "&num_attention_heads=4&num_key_value_heads=4&vocab_size=512")
FAMILIES = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "bert": "transformers:bert?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
            "&num_attention_heads=4&vocab_size=256",
    "mistral": "transformers:mistral?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
               "&num_attention_heads=4&num_key_value_heads=2&vocab_size=256",
    "mixtral": "transformers:mixtral?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
               "&num_attention_heads=4&num_key_value_heads=4&vocab_size=256&num_local_experts=4"
               "&num_experts_per_tok=2",
    "t5": "transformers:t5?d_model=64&d_ff=128&num_layers=2&num_heads=4&vocab_size=256&d_kv=16",
}


def _trace(spec_text, batch=B, seq=S):
    spec = parse_model_spec(spec_text)
    model = spec.build()
    return model, meshplan.trace(model, example_inputs(model, batch, seq), model_name=spec.name)


@pytest.fixture(scope="module")
def gpt2():
    return _trace(GPT2)


def test_gpt2_forward_flops_match_megatron_formula(gpt2):
    # Narayanan et al. 2021 (arXiv 2104.04473), section 5.1: one GPT layer's forward pass is
    # 24*B*s*h^2 (QKV 6, projection 2, MLP 16) + 4*B*s^2*h (QK^T and attention x V) FLOPs,
    # and the logits layer 2*B*s*h*V. Biases, norms and softmax are not counted.
    model, g = gpt2
    L, h, V = 3, 128, 512
    expected = L * (24 * B * S * h * h + 4 * B * S * S * h) + 2 * B * S * h * V
    assert g.forward_flops == pytest.approx(expected, rel=0.02)
    assert g.train_flops == 3 * g.forward_flops


def test_llama_forward_flops_match_2_params_tokens_plus_attention():
    # Kaplan et al. 2020 (Scaling Laws, Table 1): forward FLOPs per token = 2 x (parameters
    # used in matmuls) + the attention term; for Llama the matmul parameters per layer are
    # q, k, v, o (4h^2) and gate, up, down (3*h*I), plus the LM head h*V; the attention term
    # is 4*s*h per token per layer (QK^T and attention x V, no causal discount in SDPA).
    model, g = _trace(LLAMA)
    L, h, I, V = 3, 128, 320, 512
    tokens = B * S
    matmul_params = L * (4 * h * h + 3 * h * I) + h * V
    expected = 2 * matmul_params * tokens + L * 4 * S * h * tokens
    assert g.forward_flops == pytest.approx(expected, rel=0.02)


def test_parameter_count_is_exact_and_ties_counted_once(gpt2):
    model, g = gpt2
    assert g.param_count == sum(p.numel() for p in model.parameters())  # dedups tied wte/lm_head
    tied = [p for p in g.params if p.tied_to]
    assert [p.name for p in tied] == ["lm_head.weight"] and tied[0].tied_to == "transformer.wte.weight"


def test_nodes_carry_shapes_modules_layers_and_sources(gpt2):
    _, g = gpt2
    matmuls = [n for n in g.nodes if n.kind == OpKind.MATMUL]
    assert len(matmuls) == 3 * 4 + 1  # qkv, proj, fc, proj per layer + lm head
    qkv = next(n for n in matmuls if n.module_path == "transformer.h.1.attn.c_attn")
    assert qkv.layer == 1 and set(qkv.params) == {"transformer.h.1.attn.c_attn.weight",
                                                  "transformer.h.1.attn.c_attn.bias"}
    assert qkv.out.shape == (B * S, 3 * 128) or qkv.out.shape == (B, S, 3 * 128)
    path, line = qkv.source.rsplit(":", 1)
    assert path.endswith(".py") and "/transformers/" in path and int(line) > 0
    assert g.node(g.output).kind == OpKind.LOSS and g.node(g.output).out.shape == ()
    attention = [n for n in g.nodes if n.kind == OpKind.ATTENTION]
    assert len(attention) == 3 and all(n.flops == 4 * B * S * S * 128 for n in attention)


def test_repeated_blocks_share_one_fingerprint():
    _, g = _trace("transformers:gpt2?n_layer=6&n_embd=64&n_head=4&vocab_size=256&n_positions=64")
    assert g.num_layers == 6 and g.layers_identical
    assert len(g.layer_nodes(0)) == len(g.layer_nodes(5)) > 10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_model_families_trace_and_plan(family):
    model, g = _trace(FAMILIES[family], batch=8, seq=16)
    assert g.num_layers >= 2 and g.forward_flops > 0 and g.param_count > 0
    plan = meshplan.autoparallel(model, meshplan.Mesh.preset("dgx-a100-80gb"), graph=g)
    assert plan.model.fingerprint == g.fingerprint and plan.predicted.step_time_s > 0


def test_fingerprint_changes_with_shapes_not_with_device():
    spec = parse_model_spec("transformers:gpt2?n_layer=1&n_embd=32&n_head=2&vocab_size=64&n_positions=32")
    a = meshplan.trace(spec.build("meta"), example_inputs(None, 2, 8))
    b = meshplan.trace(spec.build("meta"), example_inputs(None, 2, 16))
    assert a.fingerprint != b.fingerprint
    _TRACES.clear()  # a fresh export, not the cached one (meshplan.tracing, DECISIONS 64)
    c = meshplan.trace(spec.build("meta"), example_inputs(None, 2, 8))
    assert a.fingerprint == c.fingerprint


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, ids):
        x = self.emb(ids)
        if x.sum() > 0:  # data-dependent Python branch: not traceable
            x = x * 2
        return x


def test_untraceable_model_names_the_line_and_what_to_do():
    model = DataDependent()
    with pytest.raises(TraceError) as err:
        meshplan.trace(model, (torch.zeros(2, 4, dtype=torch.long),))
    msg = str(err.value)
    assert "DataDependent" in msg and "test_trace.py:" in msg and "if x.sum() > 0" in msg
    assert "Make that code traceable" in msg


def test_gpt3_175b_traces_on_meta_without_allocating_weights():
    """GPT-3 175B width (h=12288, 96 heads) at reduced depth in a fresh process: peak RSS
    stays far below the 4 GB bound (the full 96-layer trace is in benchmarks/trace_models.py)."""
    code = textwrap.dedent("""
        import resource, meshplan
        from meshplan.specs import parse_model_spec, example_inputs
        spec = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=12288&n_head=96&vocab_size=51200&n_positions=2048")
        m = spec.build("meta")
        g = meshplan.trace(m, example_inputs(m, 8, 2048))
        print(g.param_count, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    params, rss_kib = map(int, out.stdout.split()[-2:])
    assert params > 7.8e9  # 4 x 1.81B per layer + 0.65B embeddings: weights would be 31 GB in fp32
    assert rss_kib / 2**20 < 2.0


def test_one_tensor_as_input_and_target_traces_like_two():
    """ids passed as input and as target (a common call) must give the graph that the
    runtime's later calls, with distinct tensors, give: else the plan refuses to run."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    ids = torch.zeros(2, 4, dtype=torch.long, device="meta")

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out.reshape(-1, 16), y.reshape(-1))
    same = meshplan.trace(model, (ids,), loss_fn=loss_fn, example_targets=(ids,))
    _TRACES.clear()  # a fresh export, not the cached one (meshplan.tracing, DECISIONS 64)
    apart = meshplan.trace(model, (ids,), loss_fn=loss_fn, example_targets=(ids.clone(),))
    assert same.fingerprint == apart.fingerprint
