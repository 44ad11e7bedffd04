"""Worker for tests/test_user_loss.py: a user's own ``loss_fn`` through the public API.

Each case is a model and a layout, trained as a user's script trains it: the model built on
meta, ``meshplan.manual_plan`` with the user's ``loss_fn`` (rank 0 plans, the others read
its plan), ``meshplan.parallelize`` on the engine the case names, the seeded state loaded
with ``broadcast_from_rank0``, a stock AdamW with an LR warmup, each rank passing only its
own rows, ``clip_grad_norm_`` at a max norm below every step's norm, then eval outputs and
``full_state_dict``. The test compares them with one plain PyTorch process (``reference``).

    python -m torch.distributed.run --nproc_per_node 4 tests/_user_loss_worker.py OUT CASES

CASES: ``model:layout[:engine]`` joined by commas (layouts: tests/harness/equivalence.py).
"""

from __future__ import annotations

import pathlib
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests.harness

BATCH, SEQ, STEPS, LR, CLIP, SEED = 8, 16, 3, 1e-2, 0.05, 0


def mlp(classes: int):
    """The issue's classifier: an nn.Sequential with activation modules between layers."""
    def build():
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, classes))
    return build


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 100_003 + 31 + step)


def features(classes: int):
    def batch(step):
        g = _gen(step)
        return (torch.randn(BATCH, 32, generator=g),), \
            (torch.randint(0, classes, (BATCH,), generator=g),)
    return batch


def tokens(step):
    """Token ids and their next-token labels, some positions unlabelled (-100): each row and
    each cp chunk has its own count of labelled tokens."""
    g = _gen(step)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((BATCH, 1), -100)], dim=1)
    labels = labels.masked_fill(torch.rand(BATCH, SEQ, generator=g) < 0.25, -100)
    return (ids,), (labels,)


def token_ce(logits, labels):
    """The most common loss there is: a per-token mean over labels != -100."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def token_ce_sum(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="sum")


def token_ce_per_sequence(logits, labels):
    """Each sequence's labelled-token mean, averaged over the sequences."""
    per = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    mask = (labels != -100).to(per.dtype)
    return ((per * mask).sum(1) / mask.sum(1)).mean()


def shifted_ce(logits, ids):
    """Next-token loss that shifts inside: position t's target is at t + 1, across any
    split of the sequence (cannot be computed chunk by chunk)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa"))


class _Block(nn.Module):
    """nanoGPT's block: a fused q/k/v projection split by size, causal SDPA."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder, untied: learned positions from ``torch.arange(t)``."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, block=SEQ):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList(_Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# name: (build, batch(step), loss_fn, loss_reduction)
MODELS = {
    "mlp10": (mlp(10), features(10), F.cross_entropy, "mean"),
    "mlp5": (mlp(5), features(5), F.cross_entropy, "mean"),  # 5 classes: tp=2 does not divide
    "llama": (llama, tokens, token_ce, "mean"),
    "gpt": (NanoGPT, tokens, token_ce, "mean"),
    "llama_sum": (llama, tokens, token_ce_sum, "sum"),
    "llama_seq": (llama, tokens, token_ce_per_sequence, "sequence"),
}


def initial_state(name: str) -> dict:
    torch.manual_seed(SEED)
    model = MODELS[name][0]()
    return {k: v.clone() for k, v in [*model.state_dict().items(), *model.named_buffers()]}


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))  # warmup


def reference(name: str):
    """One plain process on the whole global batch (fp32 and fp64: the harness's rule)."""
    from tests.harness.equivalence import expected

    build, batch, loss_fn, _ = MODELS[name]

    def start():
        model = build()
        model.load_state_dict(initial_state(name), strict=False)
        return model
    return expected(start, [batch(s) for s in range(STEPS)],
                    lambda model, b: _logits(model(*b[0])),
                    lambda out, b: loss_fn(out, *b[1]),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                    schedule=_schedule, clip=CLIP, eval_batch=batch(STEPS))


def _rows(x: torch.Tensor, run) -> torch.Tensor:
    n = x.shape[0] // run.dp_size
    return x[run.dp_rank * n:(run.dp_rank + 1) * n]


def run_case(name: str, layout: str, engine: str) -> dict:
    import meshplan
    from tests.harness.equivalence import parse_layout

    build, batch, loss_fn, reduction = MODELS[name]
    answer = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            meta = build()
        inputs, targets = batch(0)
        try:
            plan = meshplan.manual_plan(
                meta, meshplan.Mesh.local(dist.get_world_size()),
                example_inputs=tuple(x.to("meta") for x in inputs),
                example_targets=tuple(t.to("meta") for t in targets), loss_fn=loss_fn,
                loss_reduction=reduction, engine=engine, **parse_layout(layout))
            answer = [("plan", plan.to_json_text())]
        except meshplan.MeshplanError as exc:
            answer = [("refused", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(answer, src=0)
    kind, text = answer[0]
    if kind == "refused":
        return {"refused": text}
    plan = meshplan.Plan.from_json_text(text)
    with torch.device("meta"):
        model = build()
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn, loss_reduction=reduction)
    run.load_full_state_dict(initial_state(name) if dist.get_rank() == 0 else None,
                             broadcast_from_rank0=True)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = _schedule(opt)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        losses.append(run.train_step(tuple(_rows(x, run) for x in inputs),
                                     targets=tuple(_rows(t, run) for t in targets)))
        norms.append(float(run.clip_grad_norm_(CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
    run.eval()
    inputs, _ = batch(STEPS)
    mine = _logits(run(tuple(_rows(x, run) for x in inputs)))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (run.dp_rank, None if mine is None else
                                    mine.detach().double().cpu()))
    have = {r: t for r, t in shards if t is not None}
    out = torch.cat([have[r] for r in range(run.dp_size)]) if len(have) >= run.dp_size \
        else None
    run.train()
    return {"losses": losses, "norms": norms, "eval": out, "final": run.full_state_dict(),
            "engine": run.engine_name,
            "layout": f"{run.engine_name} engine, {plan.num_stages} stage(s), mesh "
                      f"{list(plan.stages[0].mesh_shape)} {list(plan.stages[0].axis_names)}"}


def main(out: str, cases: str) -> int:
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for case in cases.split(","):
        name, layout, *engine = case.split(":")
        try:
            results[case] = run_case(name, layout, engine[0] if engine else "auto")
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
            results[case] = {"error": f"{type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}",
                             "traceback": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
