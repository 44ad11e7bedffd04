"""Train a small hand-written ConvNet with BatchNorm2d on random images and integer labels
with a meshplan plan, in your own training loop.

    torchrun --nproc-per-node 4 examples/image_classifier_bn.py [--steps N] [--check]
    python examples/image_classifier_bn.py --check     # the same, as one process

The labels are the loss targets (``loss_fn(logits, labels)``, cross entropy). BatchNorm's
statistics are those of the whole global batch (meshplan runs batch norm as SyncBatchNorm
would, and keeps a BatchNorm model's batch in one microbatch), so the running statistics,
and the eval loss that reads them, match one process; ``--check`` compares the losses and
the final weights and buffers (``run.full_state_dict()``) with plain PyTorch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshplan
from common import (check_losses, init_distributed, log, mean_over_ranks, parse_args,
                    plan_on_rank0, rows)

BATCH, CLASSES, SIZE, LR, CLIP = 16, 10, 16, 2e-3, 1.0


class ConvNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, 2 * width, 3, stride=2, padding=1,
                                             bias=False), nn.BatchNorm2d(2 * width), nn.ReLU())
        self.head = nn.Linear(2 * width, classes)

    def forward(self, images):
        h = self.block(self.stem(images))
        return self.head(h.mean(dim=(2, 3)))  # global average pooling


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def global_batch(step: int, seed: int):
    """One global batch of images and labels, the same on every rank (seeded per step)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return (torch.randn(BATCH, 3, SIZE, SIZE, generator=g),
            torch.randint(0, CLASSES, (BATCH,), generator=g))


def schedule(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)


def train_plain(state, args):
    """The same steps in plain PyTorch, one process, whole global batch (--check)."""
    model = ConvNet()
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = schedule(opt)
    losses = []
    for step in range(args.steps):
        images, labels = global_batch(step, args.seed)
        loss = loss_fn(model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    images, labels = global_batch(args.steps, args.seed)
    with torch.no_grad():
        return losses, loss_fn(model(images), labels).item(), model.state_dict()


def main():
    args = parse_args(__doc__.splitlines()[0])
    init_distributed()
    with torch.device("meta"):
        model = ConvNet()                                      # nothing allocated
    images = torch.empty(BATCH, 3, SIZE, SIZE, device="meta")  # one GLOBAL batch
    labels = torch.empty(BATCH, dtype=torch.long, device="meta")
    plan = plan_on_rank0(model, plan_dir=args.plan_dir, example_inputs=(images,),
                         example_targets=(labels,), loss_fn=loss_fn)
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)

    state = None
    if dist.get_rank() == 0:  # a seeded CPU model; rank 0 alone holds its full weights
        torch.manual_seed(args.seed)
        state = ConvNet().state_dict()  # BatchNorm running statistics included
    run.load_full_state_dict(state, broadcast_from_rank0=True)

    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = schedule(opt)
    losses = []
    for step in range(args.steps):
        images, labels = global_batch(step, args.seed)
        loss = run.train_step((rows(images, run),), targets=(rows(labels, run),))
        norm = run.clip_grad_norm_(CLIP)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss)
        log(f"step {step}  loss {loss:.6f}  grad norm {norm:.4f}  lr {sched.get_last_lr()[0]:.2e}")

    eval_loss = None
    if plan.num_stages == 1:  # forward-only calls run single-stage plans
        run.eval()  # BatchNorm now reads its running statistics
        images, labels = global_batch(args.steps, args.seed)
        with torch.no_grad():
            eval_loss = mean_over_ranks(loss_fn(run(rows(images, run)), rows(labels, run)).item())
        log(f"eval loss {eval_loss:.6f}")
    else:
        log(f"eval skipped: the plan has {plan.num_stages} pipeline stages")

    final = run.full_state_dict()  # on every rank (a collective)
    if args.check and dist.get_rank() == 0:
        ref_losses, ref_eval, ref_state = train_plain(state, args)
        log("one process:", ", ".join(f"{v:.6f}" for v in ref_losses), f"eval {ref_eval:.6f}")
        check_losses(losses + ([eval_loss] if eval_loss is not None else []),
                     ref_losses + ([ref_eval] if eval_loss is not None else []))
        assert set(final) == set(ref_state), sorted(set(final) ^ set(ref_state))
        for key, want in ref_state.items():  # weights, running statistics, batches tracked
            torch.testing.assert_close(final[key], want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, k=key: f"{k}: {m}")
        print("weights equal one process (BatchNorm buffers included)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
