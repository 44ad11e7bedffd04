"""Models drawn from a grammar of what users write, and a user's training loop to run them in.

The generative differential test (tests/test_generative.py, benchmarks/generative.py) draws
cases with hypothesis: a model (``build``), its data (``batch``), a user's loss
(``user_loss``) and a layout (``LAYOUTS``). A case is a JSON-able dict, so the test process
draws and the gloo workers (tests/_generative_worker.py) rebuild the same model from it.

Why a grammar of its own: tests/test_property_plans.py draws one hand-written class (biased
Linear layers in a ModuleList, a loop in ``forward``) with cross entropy and plain SGD, and
compares BatchNorm against a reference that cuts the same microbatches as the plan. That
misses what users write and what goes wrong there: ``nn.Sequential`` stacks with activation
*modules* between the layers (the stage cut of a pipeline), heads whose class count tp does not
divide (the loss then sees a shard), fused q/k/v projections split by size, positions from
``torch.arange``, BatchNorm whose statistics one process takes over the whole batch, and
losses other than plain cross entropy. Here the reference is always one plain process on the
whole global batch, with the same AdamW, schedule and clipping (that bites) as the run.

The grammar (each feature is a key of the case):
- ``kind``: ``mlp`` (an ``nn.Sequential``: Linear, activation module, optional norm and
  ``Dropout(0)``, ..., Linear head), ``blocks`` (residual blocks in a ``ModuleList`` or a
  number-keyed ``ModuleDict``), ``cnn`` (Conv2d + BatchNorm2d blocks, an ``fc`` head), ``seq``
  (a decoder: token embedding, positions from ``arange`` into a table or a sliced parameter,
  causal SDPA attention with fused or separate q/k/v, an MLP, tied or untied head);
- ``act`` (GELU, ReLU, Tanh, SiLU modules), ``norm`` (none, LayerNorm, RMSNorm, BatchNorm1d),
  ``classes`` (7 or 10: 7 is divided by no tp), ``dropout0`` (``nn.Dropout(p=0)``);
- ``loss``: ``ce``, ``smooth`` (label smoothing 0.1), ``aux`` (cross entropy plus a small
  per-element penalty on the outputs, a per-token mean like the rest).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS, LR, CLIP = 3, 1e-2, 0.05  # CLIP bites: every drawn model's first norm is above it
SEQ, VOCAB, IN_DIM, IMAGE = 16, 48, 12, 8

COMMON_LAYOUTS = ("auto", "dp4", "dp2xtp2", "dp2xpp2", "tp2xpp2")
SEQ_LAYOUTS = COMMON_LAYOUTS + ("cp4", "cp2xdp2", "cp2xtp2", "cp2xpp2")


def layouts(kind: str) -> tuple[str, ...]:
    return SEQ_LAYOUTS if kind == "seq" else COMMON_LAYOUTS


class RMSNorm(nn.Module):
    """Written as users write it (no torch.nn.RMSNorm): weight x x / rms(x)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _act(name: str) -> nn.Module:
    return {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}[name]()


def _norm(name: str, width: int, dims: int = 1) -> list[nn.Module]:
    if name == "none":
        return []
    if name == "batchnorm":
        return [nn.BatchNorm1d(width) if dims == 1 else nn.BatchNorm2d(width)]
    return [nn.LayerNorm(width) if name == "layernorm" else RMSNorm(width)]


def mlp(case: dict) -> nn.Module:
    w, layers = case["width"], []
    dim = IN_DIM
    for _ in range(case["depth"]):
        layers += [nn.Linear(dim, w), _act(case["act"]), *_norm(case["norm"], w)]
        layers += [nn.Dropout(0.0)] if case["dropout0"] else []
        dim = w
    return nn.Sequential(*layers, nn.Linear(dim, case["classes"]))


class Block(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        w = case["width"]
        self.norm = nn.Sequential(*_norm(case["norm"], w)) if case["norm"] != "batchnorm" \
            else nn.Identity()
        self.up, self.act, self.down = nn.Linear(w, 2 * w), _act(case["act"]), nn.Linear(2 * w, w)
        self.drop = nn.Dropout(0.0) if case["dropout0"] else nn.Identity()

    def forward(self, h):
        return h + self.drop(self.down(self.act(self.up(self.norm(h)))))


class Blocks(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        w = case["width"]
        self.inp = nn.Linear(IN_DIM, w)
        blocks = [Block(case) for _ in range(case["depth"] + 1)]
        self.blocks = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) \
            if case["container"] == "moduledict" else nn.ModuleList(blocks)
        self.bn = nn.BatchNorm1d(w) if case["norm"] == "batchnorm" else nn.Identity()
        self.head = nn.Linear(w, case["classes"])

    def forward(self, x):
        h = self.inp(x)
        for block in (self.blocks.values() if isinstance(self.blocks, nn.ModuleDict)
                      else self.blocks):
            h = block(h)
        return self.head(self.bn(h))


class ConvNet(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        c = case["width"] // 2
        layers, cin = [], 3
        for _ in range(case["depth"]):
            layers += [nn.Conv2d(cin, c, 3, padding=1), nn.BatchNorm2d(c), _act(case["act"])]
            cin = c
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, case["classes"])

    def forward(self, x):
        return self.fc(self.features(x).mean(dim=(2, 3)))


class Attention(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        w, self.heads, self.fused = case["width"], case["heads"], case["qkv"] == "fused"
        if self.fused:  # nanoGPT: one projection, split by size
            self.c_attn = nn.Linear(w, 3 * w)
        else:
            self.q, self.k, self.v = (nn.Linear(w, w) for _ in range(3))
        self.proj = nn.Linear(w, w)

    def forward(self, x):
        b, t, c = x.shape
        if self.fused:
            q, k, v = self.c_attn(x).split(c, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class DecoderBlock(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        w = case["width"]
        norm = "layernorm" if case["norm"] in ("none", "batchnorm") else case["norm"]
        self.ln1, self.ln2 = _norm(norm, w)[0], _norm(norm, w)[0]
        self.attn = Attention(case)
        self.mlp = nn.Sequential(nn.Linear(w, 2 * w), _act(case["act"]), nn.Linear(2 * w, w))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    def __init__(self, case: dict):
        super().__init__()
        w = case["width"]
        self.positions = case["positions"]
        self.wte = nn.Embedding(VOCAB, w)
        if self.positions == "table":
            self.wpe = nn.Embedding(SEQ, w)
        else:
            self.pos = nn.Parameter(torch.randn(SEQ, w) * 0.02)
        self.h = nn.ModuleList(DecoderBlock(case) for _ in range(case["depth"] + 1))
        self.ln_f = nn.LayerNorm(w)
        self.lm_head = nn.Linear(w, VOCAB, bias=False)
        if case["tied"]:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        t = idx.shape[1]
        pos = self.wpe(torch.arange(t, device=idx.device)) if self.positions == "table" \
            else self.pos[:t]
        x = self.wte(idx) + pos
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(case: dict) -> nn.Module:
    """The case's model, on the current default device."""
    return {"mlp": mlp, "blocks": Blocks, "cnn": ConvNet, "seq": Decoder}[case["kind"]](case)


def initial(case: dict) -> nn.Module:
    """The seeded model on the CPU, the same in every process."""
    torch.manual_seed(case["seed"])
    return build(case)


def batch(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch (inputs, targets) of step ``step``."""
    g = torch.Generator().manual_seed(case["seed"] * 1009 + step)
    b = case["batch"]
    if case["kind"] == "seq":
        ids = torch.randint(0, VOCAB, (b, SEQ + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    shape = (b, 3, IMAGE, IMAGE) if case["kind"] == "cnn" else (b, IN_DIM)
    return torch.randn(shape, generator=g), torch.randint(0, case["classes"], (b,), generator=g)


def user_loss(case: dict):
    """The user's ``loss_fn(outputs, targets)``: a per-token (per-row) mean."""
    kind = case["loss"]

    def loss_fn(out, y):
        flat = out.reshape(-1, out.shape[-1])
        value = F.cross_entropy(flat, y.reshape(-1),
                                label_smoothing=0.1 if kind == "smooth" else 0.0)
        if kind == "aux":
            value = value + 1e-3 * flat.float().pow(2).mean()
        return value
    return loss_fn


def features(case: dict) -> set[str]:
    """The grammar features a case exercises (benchmarks/generative.py counts them)."""
    out = {f"kind={case['kind']}", f"loss={case['loss']}", f"layout={case['layout']}",
           f"act={case['act']}"}
    if case["kind"] == "mlp":
        out.add("nn.Sequential stack")
    if case["kind"] == "blocks":
        out.add(f"{case['container']} blocks")
    if case["kind"] == "cnn" or case["norm"] == "batchnorm" and case["kind"] != "seq":
        out.add("batchnorm")
    if case["kind"] != "seq" and case["norm"] in ("layernorm", "rmsnorm"):
        out.add(case["norm"])
    if case["kind"] == "seq":
        out |= {f"qkv={case['qkv']}", f"positions={case['positions']}",
                "tied head" if case["tied"] else "untied head"}
    if case["kind"] != "seq" and case["classes"] % 2:
        out.add("classes tp does not divide")
    if case["dropout0"] and case["kind"] in ("mlp", "blocks"):
        out.add("dropout p=0")
    return out


def strategy():
    """The hypothesis strategy of models and losses (JSON-able dicts; ``draw`` adds the
    layout)."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries({
        "kind": st.sampled_from(["mlp", "blocks", "cnn", "seq"]),
        "depth": st.integers(1, 3),
        "width": st.sampled_from([16, 32]),
        "heads": st.sampled_from([2, 4]),
        "act": st.sampled_from(["gelu", "relu", "tanh", "silu"]),
        "norm": st.sampled_from(["none", "layernorm", "rmsnorm", "batchnorm"]),
        "container": st.sampled_from(["modulelist", "moduledict"]),
        "classes": st.sampled_from([7, 10]),
        "dropout0": st.booleans(),
        "qkv": st.sampled_from(["fused", "separate"]),
        "positions": st.sampled_from(["table", "param"]),
        "tied": st.booleans(),
        "loss": st.sampled_from(["ce", "smooth", "aux"]),
        "batch": st.sampled_from([8, 16]),
        "seed": st.integers(0, 2**16),
    })


def draw(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct cases, the same for the same ``seed``, stratified: the (kind, layout)
    pairs are dealt round-robin (every plan kind runs before any pair repeats), each with a
    model of that kind drawn by hypothesis."""
    import random

    from hypothesis import HealthCheck, Phase, given, settings

    pool: list[dict] = []

    @settings(max_examples=max(2 * n, 100), database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck),
              derandomize=True)
    @given(strategy())
    def collect(case):
        if case not in pool:
            pool.append(case)
    collect()
    rng = random.Random(seed)
    rng.shuffle(pool)
    by_kind: dict[str, list[dict]] = {}
    for case in pool:
        by_kind.setdefault(case["kind"], []).append(case)
    pairs = [(k, lay) for k in ("mlp", "blocks", "cnn", "seq") for lay in layouts(k)]
    out: list[dict] = []
    while len(out) < n:
        for kind, lay in pairs:
            if len(out) == n:
                break
            models = by_kind[kind]
            out.append({**models[len(out) % len(models)], "layout": lay})
        rng.shuffle(pairs)
    return out
