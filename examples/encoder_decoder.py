"""Train a tiny T5 (transformers ``T5ForConditionalGeneration``, random weights, dropout 0)
with keyword inputs and label targets with a meshplan plan, in your own training loop.

    torchrun --nproc-per-node 4 examples/encoder_decoder.py [--steps N] [--check]
    python examples/encoder_decoder.py --check     # the same, as one process

The task is synthetic: the decoder learns to copy the source sentence reversed. Inputs are a
dict of keyword arguments (``input_ids``, ``decoder_input_ids``, one global batch to plan
with and this rank's rows to train on); the labels go only to ``loss_fn(logits, labels)``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import T5Config, T5ForConditionalGeneration

import meshplan
from common import (check_run, init_distributed, log, mean_over_ranks, parse_args,
                    plan_on_rank0, rows)

BATCH, SRC, TGT, LR, CLIP = 8, 16, 16, 3e-3, 1.0
CONFIG = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                  num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                  decoder_start_token_id=0, pad_token_id=0)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def global_batch(step: int, seed: int):
    """Source ids, the decoder's inputs (labels shifted right) and the labels."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    src = torch.randint(1, CONFIG.vocab_size, (BATCH, SRC), generator=g)
    labels = src.flip(1)[:, :TGT]
    decoder_in = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return {"input_ids": src, "decoder_input_ids": decoder_in}, labels


def schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train_plain(state, args, eval_rows):
    """The same steps in plain PyTorch, one process, whole global batch (--check)."""
    model = T5ForConditionalGeneration(CONFIG)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = schedule(opt)
    losses, norms = [], []
    for step in range(args.steps):
        inputs, labels = global_batch(step, args.seed)
        loss = loss_fn(model(**inputs, use_cache=False).logits, labels)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    inputs, labels = global_batch(args.steps, args.seed)
    with torch.no_grad():
        logits = model(**inputs, use_cache=False).logits
    losses.append(loss_fn(logits, labels).item())
    return {"losses": losses, "grad_norms": norms, "eval": logits[eval_rows],
            "state": model.state_dict()}


def main():
    args = parse_args(__doc__.splitlines()[0])
    init_distributed()
    with torch.device("meta"):
        model = T5ForConditionalGeneration(CONFIG)            # nothing allocated
    inputs, labels = global_batch(0, args.seed)
    meta_inputs = {k: v.to("meta") for k, v in inputs.items()}  # one GLOBAL batch
    plan = plan_on_rank0(model, plan_dir=args.plan_dir, example_inputs=meta_inputs,
                         example_targets=(labels.to("meta"),), loss_fn=loss_fn)
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)

    state0 = None
    if dist.get_rank() == 0:  # a seeded CPU model; rank 0 alone holds its full weights
        torch.manual_seed(args.seed)
        state0 = T5ForConditionalGeneration(CONFIG).state_dict()  # tied names included
    run.load_full_state_dict(state0, broadcast_from_rank0=True)

    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = schedule(opt)
    losses, norms = [], []
    for step in range(args.steps):
        inputs, labels = global_batch(step, args.seed)
        loss = run.train_step(rows(inputs, run), targets=(rows(labels, run),))
        norm = run.clip_grad_norm_(CLIP)               # the global norm, before clipping
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss), norms.append(float(norm))
        log(f"step {step}  loss {loss:.6f}  grad norm {norm:.4f}  lr {sched.get_last_lr()[0]:.2e}")

    run.eval()                                         # forward only, this rank's rows
    inputs, labels = global_batch(args.steps, args.seed)
    with torch.no_grad():
        out = run(rows(inputs, run))
    losses.append(mean_over_ranks(loss_fn(out, rows(labels, run)).item()))
    log(f"eval loss {losses[-1]:.6f}")
    state = run.full_state_dict()                      # full tensors on every rank

    if args.check and dist.get_rank() == 0:
        ref = train_plain(state0, args, rows(torch.arange(BATCH), run))
        log("one process:", ", ".join(f"{v:.6f}" for v in ref["losses"]))
        check_run({"losses": losses, "grad_norms": norms, "eval": out, "state": state}, ref)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
