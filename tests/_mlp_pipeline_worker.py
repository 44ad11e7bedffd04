"""torchrun worker for tests/test_mlp_pipeline.py (issue 42): a user's ``nn.Sequential`` MLP
classifier trained through the public API in the user's own loop.

The model is ``Linear(32, 64), GELU, Linear(64, 64), GELU, Linear(64, 10)``: float features
(16, 32), integer class targets, ``loss_fn=F.cross_entropy``, AdamW, ``clip_grad_norm_(0.5)``.
Rank 0 plans (``autoparallel`` or ``manual_plan``) with the user's loss, every rank runs
``meshplan.parallelize``, loads the full state from rank 0, passes only its own rows
(``run.dp_rank`` of ``run.dp_size``) and records, per step, the loss, the gradient norm and
every parameter's full gradient; then the eval outputs and the final full state dict. The
test compares them with one plain-PyTorch process (tests/harness/equivalence.py).

    python -m torch.distributed.run --nproc_per_node 4 tests/_mlp_pipeline_worker.py OUT CASE
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshplan

BATCH, FEATURES, CLASSES, STEPS, LR, CLIP = 16, 32, 10, 5, 1e-2, 0.5
# the cases: name -> manual_plan options (None: autoparallel's own choice)
CASES = {"auto": None,
         # the layout the autoparallel picked: 2 stages x dp2, one microbatch of 8
         "dp2xpp2-mb8": dict(dp=2, pp=2, microbatch_size=8, schedule="gpipe"),
         "dp2xpp2-mb4": dict(dp=2, pp=2, microbatch_size=4, schedule="1f1b")}


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, CLASSES))


def initial_state() -> dict:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in build().state_dict().items()}


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,),
                                                                    generator=g)


def _rows(x, run):
    n = x.shape[0] // run.dp_size
    return x[run.dp_rank * n:(run.dp_rank + 1) * n]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_case(options) -> dict:
    answer = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            meta = build()
        x, y = batch(0)
        common = dict(example_inputs=(x.to("meta"),), example_targets=(y.to("meta"),),
                      loss_fn=F.cross_entropy)
        plan = meshplan.autoparallel(meta, "local:4", **common) if options is None else \
            meshplan.manual_plan(meta, "local:4", **common, **options)
        answer = [plan.to_json_text()]
    dist.broadcast_object_list(answer, src=0)
    plan = meshplan.Plan.from_json_text(answer[0])
    with torch.device("meta"):
        model = build()
    run = meshplan.parallelize(model, plan, loss_fn=F.cross_entropy)
    run.load_full_state_dict(initial_state() if dist.get_rank() == 0 else None,
                             broadcast_from_rank0=True)
    opt = torch.optim.AdamW(run.parameters(), lr=LR)
    losses, norms, grads = [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        losses.append(run.train_step((_rows(x, run),), targets=(_rows(y, run),)))
        # every parameter's full gradient (a pipeline rank holds its stages' parameters)
        mine = {n: _full(p.grad) for n, p in run.named_parameters().items()
                if p.grad is not None}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        grads.append({k: v for part in parts for k, v in part.items()})
        norms.append(float(run.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
    run.eval()
    x, _ = batch(STEPS)
    with torch.no_grad():
        mine = run((_rows(x, run),)).detach().double()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (run.dp_rank, mine))
    out = torch.cat([dict(shards)[r] for r in range(run.dp_size)])
    return {"losses": losses, "norms": norms, "grads": grads, "eval": out,
            "weights": run.full_state_dict(),
            "layout": f"{run.engine_name} engine, {plan.num_stages} stage(s), mesh "
                      f"{list(plan.stages[0].mesh_shape)}, {plan.training.microbatches} "
                      f"microbatch(es) of {plan.training.microbatch_size}"}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    got = {name: run_case(CASES[name]) for name in names}
    if dist.get_rank() == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
