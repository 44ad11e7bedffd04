"""torchrun worker for tests/test_dropout_run.py: T5 with its default dropout (0.1, in the
attention weights and the hidden states) run 2 steps through meshplan.parallelize under two
plans (dp4, dp2 x tp2, graph engine) from one seed, next to one eager process seeded alike;
also the module engine's dp2 x tp2 (eager modules: DTensor's own dropout)."""

import sys
import warnings

import torch
import torch.distributed as dist

import meshplan
from meshplan.tracing import TrainingModule, flatten_call
from meshplan.specs import parse_model_spec, training_call

T5 = ("transformers:t5?d_model=32&d_ff=64&num_layers=2&num_heads=4&vocab_size=128&d_kv=8"
      "&dropout_rate=0.1")
BATCH, SEQ, STEPS, LR, SEED = 8, 8, 2, 0.1, 1234
# engine "auto": a model with dropout is given the graph engine (runtime/module_plan.py)
PLANS = {"dp4": dict(dp=4), "dp2_tp2": dict(dp=2, tp=2),
         "dp2_tp2_modules": dict(dp=2, tp=2, engine="modules")}


def batch(model, step, device="cpu"):
    c = training_call(model, BATCH, SEQ, device=device, seed=step)
    return c.inputs, c.targets


def reference(state, *, dropout=True):
    """One eager process; ``dropout=False`` runs the same steps with the dropouts off (eval
    mode: T5 has no other train-only layer), to show that the masks change the losses."""
    model = parse_model_spec(T5).build("cpu")
    model.load_state_dict(state)
    model.train(dropout)
    torch.manual_seed(SEED)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(model, step)
        flat, sig = flatten_call(inputs, targets)
        loss = TrainingModule(model, None, sig)(*flat)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
    return {"losses": losses, "state": model.state_dict()}


def run(state, options):
    model = parse_model_spec(T5).build("meta")
    inputs, targets = batch(model, 0, "meta")
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(dist.get_world_size()), inputs,
                                microbatch_size=BATCH // options["dp"],
                                example_targets=targets, **options)
    r = meshplan.parallelize(model, plan)
    r.load_full_state_dict(state)
    opt = torch.optim.SGD(r.parameters(), lr=LR)
    torch.manual_seed(SEED)
    per = BATCH // r.dp_size
    lo, hi = r.dp_rank * per, (r.dp_rank + 1) * per
    losses = []
    for step in range(STEPS):
        ins, tgs = batch(model, step)
        losses.append(r.train_step({k: v[lo:hi] for k, v in ins.items()},
                                   targets=tuple(t[lo:hi] for t in tgs)))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "engine": r.engine_name, "state": r.full_state_dict()}


def main():
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    state = parse_model_spec(T5).build("cpu").state_dict()
    out = {"ref": reference(state), "ref_no_dropout": reference(state, dropout=False)}
    for name, options in PLANS.items():
        try:
            out[name] = run(state, options)
        except meshplan.MeshplanError as exc:
            out[name] = {"refused": f"{type(exc).__name__}: {exc}"}
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
