"""Train a tiny Llama (transformers, random weights) on a nanoGPT-style token file with a
meshplan plan, in your own training loop.

    torchrun --nproc-per-node 4 examples/causal_lm_tokens.py [--steps N] [--data train.bin] [--check]
    python examples/causal_lm_tokens.py --check       # the same, as one process

The token file is a flat array of uint16 token ids (nanoGPT's ``train.bin``); without
``--data`` a small random one is written into a temporary folder. Every rank draws the same
row offsets for each global batch and reads only its data-parallel rows from the memmap.
With ``--check`` rank 0 also trains the same steps in plain PyTorch on the whole global
batch and asserts that the losses, gradient norms, eval outputs and final weights are equal.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import meshplan
from common import (check_run, init_distributed, log, mean_over_ranks, parse_args,
                    plan_on_rank0, rows)

BATCH, SEQ, LR, CLIP = 8, 32, 3e-3, 1.0
CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=SEQ, attention_dropout=0.0)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def token_file(path: str) -> np.memmap:
    if not path:  # rank 0 writes a small random file; the others read it after the barrier
        folder = [tempfile.mkdtemp(prefix="tokens-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        path = os.path.join(folder[0], "train.bin")
        if dist.get_rank() == 0:
            rng = np.random.default_rng(1234)
            rng.integers(0, CONFIG.vocab_size, 20_000, dtype=np.uint16).tofile(path)
        dist.barrier()
    return np.memmap(path, dtype=np.uint16, mode="r")


def global_batch(data: np.memmap, step: int, seed: int):
    """Row offsets of one global batch (the same on every rank), then x and the next tokens."""
    starts = np.random.default_rng(seed * 100_003 + step).integers(0, len(data) - SEQ - 1, BATCH)
    return starts, lambda idx: (
        torch.from_numpy(np.stack([data[s:s + SEQ] for s in starts[idx]]).astype(np.int64)),
        torch.from_numpy(np.stack([data[s + 1:s + 1 + SEQ] for s in starts[idx]]).astype(np.int64)))


def train_plain(state, data, args, eval_rows):
    """The same steps in plain PyTorch, one process, whole global batch (--check)."""
    model = LlamaForCausalLM(CONFIG)
    model.load_state_dict(state, strict=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    losses, norms = [], []
    for step in range(args.steps):
        starts, read = global_batch(data, step, args.seed)
        x, y = read(slice(None))
        loss = loss_fn(model(x, use_cache=False).logits, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        x, y = global_batch(data, args.steps, args.seed)[1](slice(None))
        logits = model(x, use_cache=False).logits
        losses.append(loss_fn(logits, y).item())
    return {"losses": losses, "grad_norms": norms, "eval": logits[eval_rows],
            "state": model.state_dict()}


def main():
    args = parse_args(__doc__.splitlines()[0], data=True)
    init_distributed()
    data = token_file(args.data)
    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIG)                      # nothing allocated
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")  # one GLOBAL batch
    plan = plan_on_rank0(model, plan_dir=args.plan_dir, example_inputs=(ids,),
                         example_targets=(ids,), loss_fn=loss_fn)
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)

    state0 = None
    if dist.get_rank() == 0:  # a seeded CPU model; rank 0 alone holds its full weights
        torch.manual_seed(args.seed)
        cpu = LlamaForCausalLM(CONFIG)
        state0 = {**cpu.state_dict(), **dict(cpu.named_buffers())}  # + rotary inv_freq
    run.load_full_state_dict(state0, broadcast_from_rank0=True)

    opt = torch.optim.AdamW(run.parameters(), lr=LR, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))  # warm-up
    my_rows = rows(np.arange(BATCH), run)  # this data-parallel rank's rows of every batch
    losses, norms = [], []
    for step in range(args.steps):
        _, read = global_batch(data, step, args.seed)
        x, y = read(my_rows)
        loss = run.train_step((x,), targets=(y,))
        norm = run.clip_grad_norm_(CLIP)               # the global norm, before clipping
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss), norms.append(float(norm))
        log(f"step {step}  loss {loss:.6f}  grad norm {norm:.4f}  lr {sched.get_last_lr()[0]:.2e}")

    run.eval()                                         # forward only, this rank's rows
    x, y = global_batch(data, args.steps, args.seed)[1](my_rows)
    with torch.no_grad():
        out = run(x)
    losses.append(mean_over_ranks(loss_fn(out, y).item()))
    log(f"eval loss {losses[-1]:.6f}")
    state = run.full_state_dict()                      # full tensors on every rank

    if args.check and dist.get_rank() == 0:
        ref = train_plain(state0, data, args, my_rows)
        log("one process:", ", ".join(f"{v:.6f}" for v in ref["losses"]))
        check_run({"losses": losses, "grad_norms": norms, "eval": out, "state": state}, ref)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
