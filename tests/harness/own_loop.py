"""The differential matrix: plans run in a user's own training loop through the public API,
against one plain-PyTorch process.

trace -> cost -> solve -> plan -> **run**. Each cell (model x layout) trains exactly as the
README's "In your own training loop" shows: the model is built on the meta device, rank 0
plans (``meshplan.autoparallel`` or ``meshplan.manual_plan``) and the other ranks read its
plan, ``meshplan.parallelize``, ``load_full_state_dict(state, broadcast_from_rank0=True)``,
a stock AdamW with an LR schedule, ``run.train_step`` on this rank's rows only
(``run.dp_rank`` of ``run.dp_size``), ``run.clip_grad_norm_`` with a max norm small enough
that it clips, then ``run.eval(); run(x)`` and ``run.full_state_dict()``. A plan that is
refused when it is made records its one-line error; any other error is a failing cell.

``tolerances(model)`` trains the same steps in one process with the equivalence harness
(tests/harness/equivalence.py: fp32, and fp64 for the tolerance: 10x the fp32 reference's
own error, floors 1e-5 on losses and norms, 1e-4 on weights and outputs). One launch runs
every layout of one model:

    torchrun --nproc_per_node 4 -m tests.harness.own_loop --model bert --out cells.pt
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.harness.equivalence import LAYOUTS as SHARED

BATCH, STEPS, LR, CLIP, SEED = 8, 3, 1e-2, 0.05, 0
# the shared layouts (tests/harness/equivalence.py) under this matrix's cell names
LAYOUTS = {"auto": "auto", **{k: SHARED[k] for k in ("dp4", "dp2xtp2", "dp2xpp2", "tp2xpp2")}}
EXTRA_LAYOUTS = {"tp4": SHARED["tp4"],  # beyond the matrix: tp over more ranks than KV heads
                 "dp2xpp2-zero1": SHARED["dp2xpp2+zero1"],  # autoparallel's tied-GPT pick
                 "dp4-accumulate": SHARED["dp4+mb1"],  # BatchNorm: refused
                 # context parallel (the other models' cp cells: tests/test_cp_modules.py)
                 "cp4": SHARED["cp4"], "dp2xcp2": SHARED["cp2xdp2"],
                 "cp2xtp2-sp": SHARED["cp2xtp2+sp"], "cp2xtp2": SHARED["cp2xtp2"],
                 "cp2xpp2-mb1": SHARED["cp2xpp2+mb1"], "cp2xpp2-mb2": SHARED["cp2xpp2+mb2"]}
CP_LAYOUTS = ("cp4", "dp2xcp2", "cp2xtp2-sp", "cp2xpp2-mb1", "cp2xpp2-mb2")


# -- models: (build(), global batch(step) -> (inputs, targets), loss_fn or None) --------------

class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # nanoGPT's attention
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln_2(x))


class TiedGPT(nn.Module):
    """nanoGPT's layout, small: learned positions, lm_head tied to the token embedding."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, block=16):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d),
            h=nn.ModuleList(_Block(d, heads) for _ in range(layers)), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class ConvNet(nn.Module):
    """ResNet-style: a stem, residual conv + BatchNorm2d blocks, a linear head."""

    def __init__(self, width=8, classes=10, layers=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.ModuleList(nn.Sequential(
            nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
            for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, images):
        h = self.stem(images)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h.mean(dim=(2, 3)))


class MLPClassifier(nn.Module):
    def __init__(self, d_in=16, d=32, classes=10, layers=2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(),
                                                  nn.Linear(2 * d, d)) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def sequential_mlp(d_in=16, d=32, classes=10):
    """The plainest classifier: an nn.Sequential of Linear and ReLU."""
    return nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(),
                         nn.Linear(d, d), nn.ReLU(), nn.Linear(d, classes))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa"))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa"))


def _neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, hidden_dropout=0.0,
        attention_dropout=0.0, attn_implementation="sdpa"))


def _bert():
    from transformers import BertConfig, BertForMaskedLM
    return BertForMaskedLM(BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, type_vocab_size=1,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))


def _t5():
    """A small T5 (relative position bias, encoder-decoder with cross-attention, head tied to
    the shared embedding); transformers' T5 declares SDPA support and passes its position
    bias (plus the padding mask) to SDPA as a float attn_mask."""
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
        pad_token_id=0, attn_implementation="sdpa"))


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 100_003 + 17 + step)


def _tokens(step):
    return (torch.randint(0, 64, (BATCH, 16), generator=_gen(step)),), ()


def _masked(step):
    """BERT's masking (15% of tokens predicted, label -100 elsewhere) and right padding
    (a random number of pad tokens per row, never labelled): each row has its own count."""
    g = _gen(step)
    ids = torch.randint(1, 64, (BATCH, 16), generator=g)
    labels = torch.where(torch.rand(BATCH, 16, generator=g) < 0.15, ids, -100)
    pad = torch.arange(16) >= (16 - torch.randint(0, 8, (BATCH, 1), generator=g))
    ids, labels = ids.masked_fill(pad, 0), labels.masked_fill(pad, -100)
    labels[:, 0] = torch.where(labels[:, 0] == -100, ids[:, 0], labels[:, 0])  # >= 1 each
    return (ids,), (labels,)


def _seq2seq(step):
    """T5's batch as keyword inputs: a right-padded source (16 tokens, attention_mask 0 on
    padding), 8 labels per row right-padded with -100 (each row its own count, >= 1) and the
    decoder's inputs (labels shifted right, decoder_start_token_id 0, padding 0)."""
    g = _gen(step)
    src = torch.randint(1, 64, (BATCH, 16), generator=g)
    pad = torch.arange(16) >= (16 - torch.randint(0, 8, (BATCH, 1), generator=g))
    labels = torch.randint(1, 64, (BATCH, 8), generator=g)
    labels = labels.masked_fill(torch.arange(8) >= torch.randint(1, 9, (BATCH, 1), generator=g),
                                -100)
    decoder_in = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long),
                            labels[:, :-1].clamp(min=0)], dim=1)
    return {"input_ids": src.masked_fill(pad, 0), "attention_mask": (~pad).long(),
            "decoder_input_ids": decoder_in}, (labels,)


def _images(step):
    g = _gen(step)
    return (torch.randn(BATCH, 3, 8, 8, generator=g),), (torch.randint(0, 10, (BATCH,),
                                                                      generator=g),)


def _features(step):
    """Features and class labels, some rows unlabelled (-100: semi-supervised data)."""
    g = _gen(step)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    return (x,), (y.masked_fill(torch.rand(BATCH, generator=g) < 0.3, -100),)


def token_loss(logits, labels):
    """Cross entropy per labelled token (ignore_index=-100: masks and padding)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def lm_loss(logits, ids):
    """Next-token cross entropy (the runtime's default without targets)."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


MODELS = {  # name: (build, batch(step), loss_fn given to meshplan or None, reference loss)
    "gpt": (TiedGPT, _tokens, None, None),
    "llama": (_llama, _tokens, None, None),
    "qwen2": (_qwen2, _tokens, None, None),
    "neox": (_neox, _tokens, None, None),
    "bert": (_bert, _masked, token_loss, token_loss),
    "t5": (_t5, _seq2seq, token_loss, token_loss),
    "cnn": (ConvNet, _images, None, token_loss),
    "mlp": (sequential_mlp, _features, token_loss, token_loss),
    "resmlp": (MLPClassifier, _features, token_loss, token_loss),
}


def _call(model, inputs):
    """The model on a batch's inputs: a tuple positionally, a dict as keywords."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _map(fn, inputs):
    return {k: fn(v) for k, v in inputs.items()} if isinstance(inputs, dict) else \
        tuple(fn(x) for x in inputs)


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))  # warmup


def initial_state(name: str) -> dict:
    torch.manual_seed(SEED)
    model = MODELS[name][0]()
    # the README's state: parameters and every buffer (non-persistent ones too: rotary
    # inv_freq, BERT's position_ids), as run.full_state_dict() gives it back
    return {k: v.clone() for k, v in [*model.state_dict().items(), *model.named_buffers()]}


# -- the reference: one plain process (tests/harness/equivalence.py) --------------------------

def tolerances(name: str):
    """The same steps in one process on the whole global batch, fp32 and fp64: the
    harness's reference and its rule (10x the fp32 reference's own error against fp64)."""
    from tests.harness.equivalence import expected

    build, batch, _, loss = MODELS[name]

    def start():
        model = build()
        model.load_state_dict(initial_state(name), strict=False)
        return model

    def forward(model, b):
        return _logits(_call(model, b[0]))

    def value(out, b):
        inputs, targets = b
        return loss(out, *targets) if loss is not None else lm_loss(out, inputs[0])
    return expected(start, [batch(step) for step in range(STEPS)], forward, value,
                    optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
                    schedule=_schedule, clip=CLIP, eval_batch=batch(STEPS))


def compare(cell: dict, tol) -> list[str]:
    """What differs between a cell and the reference beyond the tolerance (empty: equal):
    losses, gradient norms, eval outputs, and the final state (the same keys; floating
    entries within the rule, the others equal)."""
    from tests.harness.equivalence import check

    if "error" in cell:
        return [cell["error"]]
    if "refused" in cell:
        return []
    got = {"losses": cell["losses"], "norms": cell["norms"], "eval": cell["eval"],
           "weights": cell["final"]}
    return check(got, tol, fields=("losses", "norms", "eval", "weights"),
                 same_weight_keys=True)


# -- one cell on the launch's processes --------------------------------------------------------

def _rows(x: torch.Tensor, run) -> torch.Tensor:
    n = x.shape[0] // run.dp_size
    return x[run.dp_rank * n:(run.dp_rank + 1) * n]


def _plan(name: str, layout):
    """Rank 0 plans (as the README's scripts do); every rank gets its plan or its refusal."""
    import meshplan

    build, batch, loss_fn, _ = MODELS[name]
    answer = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            meta = build()
        inputs, targets = batch(0)
        common = dict(example_inputs=_map(lambda x: x.to("meta"), inputs),
                      example_targets=tuple(t.to("meta") for t in targets), loss_fn=loss_fn)
        mesh = meshplan.Mesh.local(dist.get_world_size())
        if name == "cnn" and layout != "auto":
            # BatchNorm normalises each microbatch it sees (DECISIONS 18): one process on the
            # whole batch is matched by one microbatch per step
            layout = {"microbatch_size": BATCH // layout.get("dp", 1), "schedule": "gpipe",
                      **layout}
        try:
            plan = meshplan.autoparallel(meta, mesh, **common, time_limit_s=10) \
                if layout == "auto" else meshplan.manual_plan(meta, mesh, **common, **layout)
            answer = [("plan", plan.to_json_text())]
        except meshplan.MeshplanError as exc:
            answer = [("refused", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def run_cell(name: str, layout) -> dict:
    import meshplan

    build, batch, loss_fn, _ = MODELS[name]
    kind, text = _plan(name, layout)
    if kind == "refused":
        return {"refused": text}
    plan = meshplan.Plan.from_json_text(text)
    with torch.device("meta"):
        model = build()
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)
    run.load_full_state_dict(initial_state(name) if dist.get_rank() == 0 else None,
                             broadcast_from_rank0=True)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = _schedule(opt)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, targets = batch(step)
        losses.append(run.train_step(_map(lambda x: _rows(x, run), inputs),
                                     targets=tuple(_rows(t, run) for t in targets)))
        norms.append(float(run.clip_grad_norm_(CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
    run.eval()
    inputs, _ = batch(STEPS)
    mine = _logits(run(_map(lambda x: _rows(x, run), inputs))).detach().double().cpu()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (run.dp_rank, mine))
    out = torch.cat([dict(shards)[r] for r in range(run.dp_size)])
    run.train()
    return {"losses": losses, "norms": norms, "eval": out, "final": run.full_state_dict(),
            "layout": f"{run.engine_name} engine, {plan.num_stages} stage(s), mesh "
                      f"{list(plan.stages[0].mesh_shape)} {list(plan.stages[0].axis_names)}, "
                      f"zero {plan.stages[0].zero}, {plan.training.microbatches} microbatches"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="meshplan-own-loop")
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    cells = {}
    for layout in args.layouts.split(","):
        start = time.perf_counter()
        try:
            cells[layout] = run_cell(args.model, {**LAYOUTS, **EXTRA_LAYOUTS}[layout])
        except Exception as exc:  # noqa: BLE001 - one failing cell must not hide the others
            cells[layout] = {"error": f"run time: {type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}",
                             "traceback": traceback.format_exc()}
        dist.barrier()
        cells[layout]["seconds"] = time.perf_counter() - start
    if dist.get_rank() == 0:
        torch.save(cells, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
