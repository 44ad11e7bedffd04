"""The model of the one-GPU step check (benchmarks/gpu_check.py): a Llama-style decoder written
in plain PyTorch (RMSNorm, rotary positions, grouped-query attention through
``F.scaled_dot_product_attention(..., is_causal=True)``, SwiGLU MLP, untied head), so that the
plan made on the CPU machine (torch 2.13, transformers of this checkout) and the GPU machine
(its own torch and transformers) trace the same graph and the plan's fingerprint matches.

``build()`` takes its size from keyword arguments; ``gpu_llama`` is the size the check runs
(about 1.3B parameters: fits one 80 GB GPU in bf16 with fp32 AdamW state, and a step is long
enough (hundreds of ms) to time).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary(x, cos, sin):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden):
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = Attention(dim, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def rope_inv_freq(dim: int, heads: int, theta: float) -> torch.Tensor:
    """Rotary inverse frequencies of one head of ``dim // heads``."""
    hd = dim // heads
    return 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))


def rope_tables(inv_freq: torch.Tensor, seq: int, like: torch.Tensor):
    """(cos, sin) of positions 0..seq-1, in ``like``'s dtype and on its device."""
    pos = torch.arange(seq, device=like.device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq.to(pos.device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


class Llama(nn.Module):
    def __init__(self, vocab=32000, dim=2048, layers=16, heads=16, kv_heads=8, hidden=5632,
                 max_seq=4096, theta=500000.0):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(dim, heads, theta), persistent=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        cos, sin = rope_tables(self.inv_freq, ids.shape[1], x)
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def init_weights(model: nn.Module) -> None:
    """GPT-2-style normal(0, 0.02) on every Linear / Embedding; ones on norms."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, RMSNorm):
            nn.init.ones_(m.weight)


def gpu_llama() -> Llama:
    return Llama()


def tiny_llama() -> Llama:
    return Llama(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=128, max_seq=64)


def param_count(model: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in model.parameters())
