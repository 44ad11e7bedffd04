"""A mixture-of-experts decoder in torchtitan's style: routed experts run as one grouped GEMM
(``torch._grouped_mm``) behind a token dispatcher, written for meshplan from scratch.

The MoE block, as torchtitan's MoE layer does its work (ideas, not code: torchtitan
``torchtitan/models/moe``):

1. the router scores every token against every expert (softmax, or sigmoid with an
   expert bias that only steers the choice: DeepSeek-V3's auxiliary-loss-free balancing,
   arXiv 2412.19437 section 2.1.2) and keeps the top ``top_k``;
2. the dispatcher sorts the ``tokens x top_k`` copies by expert, counts the copies each
   expert received and lays them out expert after expert;
3. the experts run as three grouped GEMMs over those groups (SwiGLU: w1, w3, then w2): each
   copy meets only its own expert's weights, so the work is ``top_k / experts`` of running
   every expert on every token;
4. the outputs, weighted by their scores, are summed back onto their tokens (unsort).

Optionally a shared expert every token passes through, and dense first blocks (DeepSeek-V3's
three). ``torch._grouped_mm`` takes bf16 only (its meta kernel checks it, torch 2.13), so
the experts cast to bf16 around it as torchtitan's grouped path does;
``use_grouped_mm=False`` runs the experts one by one in the model's dtype instead (eager
only: the group sizes become Python ints).

Plan it: ``meshplan plan --model examples/moe_grouped.py:tiny_moe --mesh local:4 --batch 8
--seq 32``; ``meshplan.trace`` counts each grouped GEMM's FLOPs at the rows it received
(``meshplan/opcount.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Router(nn.Module):
    """Top-k routing: (tokens, dim) -> (scores, experts), each (tokens, top_k)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, score: str = "softmax"):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score={score!r}: use 'softmax' or 'sigmoid'")
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.score = top_k, score
        # steers which experts are chosen, never the weights (no gradient): the balancing
        # bias of auxiliary-loss-free routing, updated between steps by whoever trains
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        if self.score == "softmax":
            probs = logits.float().softmax(dim=-1)
            scores, experts = probs.topk(self.top_k, dim=-1)
        else:
            probs = logits.float().sigmoid()
            _, experts = (probs + self.expert_bias).topk(self.top_k, dim=-1)
            scores = probs.gather(-1, experts)
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores.to(x.dtype), experts


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards stored as (experts, out, in) weights."""

    def __init__(self, dim: int, hidden: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)
        self.use_grouped_mm = use_grouped_mm

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: (rows, dim), sorted by expert; ``counts``: (experts,) rows per expert."""
        if not self.use_grouped_mm:
            outs = []
            for e, rows in enumerate(torch.split(x, counts.tolist())):
                h = F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)
                outs.append(h @ self.w2[e].T)
            return torch.cat(outs)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)

        def gmm(a, w):  # (rows, in) x (experts, out, in) -> (rows, out), group by group
            return torch._grouped_mm(a.bfloat16(), w.bfloat16().transpose(-2, -1), offs=offs)

        h = F.silu(gmm(x, self.w1)) * gmm(x, self.w3)
        return gmm(h, self.w2).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Router, token dispatcher, grouped experts and an optional shared expert."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *,
                 shared_hidden: int = 0, score: str = "softmax", use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(dim, num_experts, top_k, score)
        self.experts = GroupedExperts(dim, hidden, num_experts, use_grouped_mm)
        self.shared = FeedForward(dim, shared_hidden) if shared_hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores, experts = self.router(x)
        # dispatch: the tokens x top_k copies sorted by expert (stable: token order kept
        # within an expert), and how many each expert received
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device) \
            .scatter_add(0, flat, torch.ones_like(flat))
        token = order // self.top_k
        out = self.experts(x[token], counts)
        # combine: each copy's output, weighted by its score, summed onto its token
        out = out * scores.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros_like(x).index_add(0, token, out)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: nn.Module):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = ffn

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.ffn(self.ffn_norm(x))


class MoEDecoder(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab): ``dense_layers`` dense blocks,
    then ``layers - dense_layers`` MoE blocks."""

    def __init__(self, vocab_size: int = 256, dim: int = 64, layers: int = 3, heads: int = 4,
                 num_experts: int = 8, top_k: int = 2, expert_hidden: int = 64,
                 dense_hidden: int = 128, dense_layers: int = 0, shared_hidden: int = 0,
                 score: str = "softmax", max_seq: int = 256, use_grouped_mm: bool = True):
        super().__init__()
        self.vocab_size, self.num_experts, self.top_k = vocab_size, num_experts, top_k
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(
            Block(dim, heads, FeedForward(dim, dense_hidden) if i < dense_layers else
                  MoE(dim, expert_hidden, num_experts, top_k, shared_hidden=shared_hidden,
                      score=score, use_grouped_mm=use_grouped_mm))
            for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))


def tiny_moe() -> nn.Module:
    """Mixtral-style: 3 MoE blocks, 8 experts, top-2, softmax routing."""
    return MoEDecoder()


def tiny_deepseek_style() -> nn.Module:
    """DeepSeek-V3-style: a dense first block, then MoE blocks with a shared expert and
    sigmoid top-k routing steered by an expert bias (no auxiliary loss)."""
    return MoEDecoder(layers=4, dense_layers=1, shared_hidden=64, score="sigmoid")
