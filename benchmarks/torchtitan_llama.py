"""Llama 3 written the way torchtitan writes it, for pricing torchtitan's published runs.

The transformers Llama the other benchmarks trace computes the same function, but a plan is
priced on the operators that run, and torchtitan's model code runs different ones. This is
its late-2024 version, which the published H100 runs used (pytorch/torchtitan
``torchtitan/models/llama/model.py`` and ``models/norms.py``); torchtitan 0.2.2 keeps the
complex rotary embedding (``models/llama3/model/model.py`` ``apply_rotary_emb``) but has
since moved to ``nn.RMSNorm`` and SDPA's ``enable_gqa`` in place of ``repeat_kv``:

- **rotary embedding on complex numbers**: the query and key are upcast to fp32, viewed as
  complex pairs and multiplied by a complex64 table ``freqs_cis``, then viewed back as real
  and cast to the activations' dtype (``apply_rotary_emb``); transformers rotates halves in
  the activations' dtype (``rotate_half``). Under torch.compile the complex multiply is
  not fused (costmodel/fusion.py: inductor has no code generation for complex values).
- **keys and values repeated for grouped-query attention** by ``expand`` + ``reshape``
  before ``F.scaled_dot_product_attention(..., is_causal=True)``;
- **RMSNorm** on an fp32 copy of its input, cast back with ``type_as`` and scaled by the
  weight in the activations' dtype (``norm_type = "rmsnorm"``), or torchtitan's Triton
  ``fused_rmsnorm`` (``norm="fused_rmsnorm"``: the 2024 A100 runs' configs); SwiGLU
  ``w2(silu(w1(x)) * w3(x))``;
- **the loss**: cross entropy of the fp32 logits, flattened, against labels passed beside
  the tokens (no slicing of the logits): ``torchtitan/components/loss.py``.

Written from that description for meshplan's benchmarks (no torchtitan code; torchtitan
itself needs triton to import, which the CPU machines here do not have). Module names follow
torchtitan's (``tok_embeddings``, ``layers``, ``attention.wq``, ``feed_forward.w1``, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """torchtitan's ``rmsnorm`` (the fp32 chain above), or with ``fused=True`` its
    ``fused_rmsnorm``: one Triton kernel each way that keeps only its input and the rows'
    inverse RMS, here ``F.rms_norm`` (one ``aten.rms_norm`` operator in the trace)."""

    def __init__(self, dim: int, eps: float = 1e-5, fused: bool = False):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.fused:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotate(xq, xk, freqs_cis):
    """Rotary embedding on complex pairs, in fp32: (batch, seq, heads, head_dim) in and out."""
    cq = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    ck = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    table = freqs_cis.view(1, cq.shape[1], 1, cq.shape[-1])
    out_q = torch.view_as_real(cq * table).flatten(3)
    out_k = torch.view_as_real(ck * table).flatten(3)
    return out_q.type_as(xq), out_k.type_as(xk)


def repeat_heads(x, times: int):
    if times == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, times, d).reshape(b, s, kv * times, d)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = rotate(q, k, freqs_cis)
        times = self.heads // self.kv_heads
        k, v = repeat_heads(k, times), repeat_heads(v, times)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, eps, fused_norm=False):
        super().__init__()
        self.attention = Attention(dim, heads, kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps, fused_norm)
        self.ffn_norm = RMSNorm(dim, eps, fused_norm)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


def freqs_table(head_dim: int, seq: int, theta: float) -> torch.Tensor:
    """complex64 (seq, head_dim / 2): e^(i t / theta^(2j / head_dim))."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(seq).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)


class Transformer(nn.Module):
    def __init__(self, dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336,
                 vocab=128256, max_seq=8192, theta=500000.0, eps=1e-5, fused_norm=False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads, kv_heads, hidden, eps,
                                                              fused_norm)
                                     for i in range(layers)})
        self.norm = RMSNorm(dim, eps, fused_norm)
        self.output = nn.Linear(dim, vocab, bias=False)
        table = freqs_table(dim // heads, max_seq, theta)
        self.register_buffer("freqs_cis", table.to(self.output.weight.device), persistent=True)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for block in self.layers.values():
            h = block(h, freqs_cis)
        return self.output(self.norm(h))


def loss(pred, labels):
    """torchtitan's ``cross_entropy_loss``: the fp32 logits flattened against the labels."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


NORMS = ("rmsnorm", "fused_rmsnorm")  # torchtitan's ``[model] norm_type`` values priced here


def build(*, dim, layers, heads, kv_heads, hidden, vocab, max_seq, device="meta",
          norm="rmsnorm"):
    """``norm``: the run's ``norm_type`` (its train config): "rmsnorm" or "fused_rmsnorm"."""
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r} is not one of {', '.join(NORMS)} (torchtitan's "
                         "norm_type of the run)")
    with torch.device(device):
        return Transformer(dim, layers, heads, kv_heads, hidden, vocab, max_seq,
                           fused_norm=norm == "fused_rmsnorm")


# torchtitan's flavors (meshplan/stacks/torchtitan_flavors.py reads the same numbers)
LLAMA3_8B = dict(dim=4096, layers=32, heads=32, kv_heads=8, hidden=14336, vocab=128256)
LLAMA3_70B = dict(dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672, vocab=128256)
LLAMA3_405B = dict(dim=16384, layers=126, heads=128, kv_heads=8, hidden=53248, vocab=128256)
LLAMA2_13B = dict(dim=5120, layers=40, heads=40, kv_heads=40, hidden=13824, vocab=32000)
