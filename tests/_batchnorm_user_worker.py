"""A BatchNorm CNN trained through the public API in a user's own loop (issue 42), one case
per plan: each rank passes only its rows (``run.dp_rank`` of ``run.dp_size``) of a global
batch of 16, AdamW with a schedule, clipping; after the steps the eval outputs and
``run.full_state_dict()`` (weights, running_mean/var, num_batches_tracked) are saved.
tests/test_batchnorm_user.py compares them with one plain-PyTorch process on the whole batch.

    torchrun --nproc-per-node 4 tests/_batchnorm_user_worker.py out.pt [case ...]
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH, CLASSES, SIZE, STEPS, LR, CLIP, SEED = 16, 10, 8, 5, 1e-2, 1.0, 0

# case -> (planner, options); microbatch_size is rows per data-parallel rank
CASES = {
    "dp4-mb1": ("manual", dict(dp=4, microbatch_size=4)),  # one microbatch per rank
    "dp4": ("manual", dict(dp=4)),                          # the planner's microbatch size
    "dp4-graph": ("manual", dict(dp=4, engine="graph")),
    "dp2-tp2": ("manual", dict(dp=2, tp=2)),
    "auto": ("auto", {}),
    # the user's opt-in: 4 microbatches per rank, each global microbatch normalised alone
    "dp4-per-microbatch": ("manual", dict(dp=4, microbatch_size=1, batch_norm="microbatch")),
    "dp4-per-microbatch-graph": ("manual", dict(dp=4, microbatch_size=1, engine="graph",
                                                batch_norm="microbatch")),
}
PER_MICROBATCH = 4  # microbatches of the per-microbatch cases (rows per rank)


class CNN(nn.Module):
    """Two conv + BatchNorm2d blocks and an ``fc`` head, as a user writes it. The convolutions
    have no bias, as in ResNets: BatchNorm subtracts it again, so its gradient is zero up to
    rounding, which AdamW's normalised update would turn into steps of random sign."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.mean(dim=(2, 3)))


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def initial_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return CNN().state_dict()


def batch(step: int):
    """The global batch of ``step`` (STEPS: the eval batch); images not centred, so the
    statistics of 4 rows differ from those of 16."""
    g = torch.Generator().manual_seed(SEED * 100_003 + step)
    return (torch.randn(BATCH, 3, SIZE, SIZE, generator=g) * 2 + 0.5,
            torch.randint(0, CLASSES, (BATCH,), generator=g))


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def reference(microbatches: int = 1) -> dict:
    """Plain PyTorch, one process, the whole batch of 16 every step; with ``microbatches``
    > 1, gradient accumulation over the global microbatches the plan runs (microbatch i:
    row i of each rank's 16 / 4 rows, each normalised alone)."""
    model = CNN()
    model.load_state_dict(initial_state())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = schedule(opt)
    losses = []
    for step in range(STEPS):
        images, labels = batch(step)
        loss = 0.0
        for i in range(microbatches):
            rows = torch.arange(BATCH).view(-1, microbatches)[:, i]  # row i of each rank's
            part = loss_fn(model(images[rows]), labels[rows]) / microbatches
            part.backward()
            loss = loss + part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step(), sched.step(), opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        out = model(batch(STEPS)[0])
    return {"losses": losses, "state": {k: v.detach().clone()
                                        for k, v in model.state_dict().items()},
            "eval": out}


def run_case(case: str) -> dict:
    import torch.distributed as dist

    import meshplan

    planner, options = CASES[case]
    with torch.device("meta"):
        model = CNN()
    images = torch.empty(BATCH, 3, SIZE, SIZE, device="meta")
    labels = torch.empty(BATCH, dtype=torch.long, device="meta")
    kw = dict(example_targets=(labels,), loss_fn=loss_fn, dtype="fp32")
    try:
        plan = (meshplan.autoparallel(model, "local:4", (images,), **kw) if planner == "auto"
                else meshplan.manual_plan(model, "local:4", (images,), **kw, **options))
    except meshplan.MeshplanError as exc:
        return {"refused": str(exc)}
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)
    run.load_full_state_dict(initial_state() if dist.get_rank() == 0 else None,
                             broadcast_from_rank0=True)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    sched = schedule(opt)

    def mine(t):
        n = t.shape[0] // run.dp_size
        return t[run.dp_rank * n:(run.dp_rank + 1) * n]

    losses = []
    for step in range(STEPS):
        images, labels = batch(step)
        losses.append(run.train_step((mine(images),), targets=(mine(labels),)))
        run.clip_grad_norm_(CLIP)
        opt.step(), sched.step(), opt.zero_grad()
    run.eval()
    with torch.no_grad():
        out = run(mine(batch(STEPS)[0])) if plan.num_stages == 1 else None
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (run.dp_rank, out))
    rows = dict(sorted(((r, o) for r, o in gathered if o is not None), key=lambda x: x[0]))
    return {"losses": losses, "state": run.full_state_dict(), "engine": plan.engine,
            "microbatches": plan.training.microbatches, "layout": plan.summary().splitlines()[0],
            "eval": torch.cat(list(rows.values())) if rows else None}


def main(out: str, cases: list[str]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for case in cases or list(CASES):
        try:
            results[case] = run_case(case)
        except Exception:  # noqa: BLE001 - the test reports the traceback as the failure
            results[case] = {"crashed": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
