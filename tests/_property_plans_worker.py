"""torchrun worker for tests/test_property_plans.py: many generated models in one launch.

Reads the examples (drawn by hypothesis in the test process) from ``examples.json`` next to
the output file. For each: rank 0 plans with ``meshplan.autoparallel`` on
``Mesh.local(world)`` (or writes the example's manual layout with ``manual_plan``; a
layout it refuses with a clear error is recorded as skipped) and sends the plan (as JSON text) to the others; every rank runs
``meshplan.parallelize`` + ``load_full_state_dict`` + two SGD steps on its data-parallel
rows, gathers every gradient as a full tensor, the final ``full_state_dict`` (buffers
included) and the eval outputs of every rank (pipeline plans included). Rank 0 compares all
of it with the same steps in plain PyTorch, accumulating over the plan's microbatches
(rtol 1e-5), and saves one record per example.
"""

import datetime
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import meshplan

STEPS, LR = 2, 0.1
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Module):
    """A dense stack of biased Linear layers; optionally an embedding whose weight the head
    shares (tied), optionally BatchNorm1d after every layer."""

    def __init__(self, ex: dict):
        super().__init__()
        w = ex["width"]
        self.tied = ex["tied"]
        if self.tied:
            self.embed = nn.Embedding(ex["classes"], w)
        else:
            self.inp = nn.Linear(ex["in_dim"], w)
        self.layers = nn.ModuleList(nn.Linear(w, w) for _ in range(ex["depth"]))
        self.norms = nn.ModuleList(nn.BatchNorm1d(w) for _ in range(ex["depth"])) \
            if ex["bn"] else None
        self.act = nn.GELU() if ex["act"] == "gelu" else nn.Tanh()
        self.head = nn.Linear(w, ex["classes"])
        if self.tied:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) if self.tied else self.inp(x)
        for i, layer in enumerate(self.layers):
            # BatchNorm after the activation: before it, the Linear's bias would have a
            # gradient that is zero in exact arithmetic (pure rounding noise to compare)
            h = self.act(layer(h))
            if self.norms is not None:
                h = self.norms[i](h)
        return self.head(h)


def loss_fn(logits, labels):
    return F.cross_entropy(logits, labels)


def data(ex: dict, step: int):
    g = torch.Generator().manual_seed(ex["seed"] * 1000 + step)
    b = ex["batch"]
    x = torch.randint(0, ex["classes"], (b,), generator=g) if ex["tied"] else \
        torch.randn(b, ex["in_dim"], generator=g, dtype=torch.float32)
    return x, torch.randint(0, ex["classes"], (b,), generator=g)


def microbatch_rows(batch: int, dp: int, microbatches: int) -> list[torch.Tensor]:
    """The global rows of each microbatch: the j-th chunk of every data-parallel rank's
    shard (runtime/run.py's data layout)."""
    per = batch // dp
    r = per // microbatches
    return [torch.cat([torch.arange(k * per + j * r, k * per + (j + 1) * r) for k in range(dp)])
            for j in range(microbatches)]


def reference(ex: dict, state: dict, dp: int, microbatches: int, dtype=torch.float32):
    """One process accumulating gradients over the plan's microbatches (the same as the whole
    batch at once, except that BatchNorm normalises each microbatch: DECISIONS 18)."""
    model = Net(ex).to(dtype)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = data(ex, step)
        x = x.to(dtype) if x.is_floating_point() else x
        loss = 0.0
        for idx in microbatch_rows(ex["batch"], dp, microbatches):
            part = loss_fn(model(x[idx]), y[idx]) / microbatches
            part.backward()
            loss += part.item()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    model.eval()
    x = data(ex, STEPS)[0]
    with torch.no_grad():
        out = model(x.to(dtype) if x.is_floating_point() else x)
    return losses, grads, model.state_dict(), out


def rows(t, run):
    n = t.shape[0] // run.dp_size
    return t[run.dp_rank * n:(run.dp_rank + 1) * n]


def gathered(mine: dict) -> dict:
    """Every rank's dict merged (pipeline stages hold different parameters)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        out.update(part)
    return out


def manual_layout(name: str, world: int, batch: int) -> dict:
    """manual_plan options of a named layout on ``world`` devices, two microbatches where the
    batch allows, and at least 4 rows in a microbatch: BatchNorm over one row per channel
    raises, and over 2 rows its gradients are rounding noise (its outputs are +-1 whatever
    the input; the fp32 one-process reference is off from fp64 by ~1e-5 of its largest
    element there too)."""
    half = max(world // 2, 1)
    options = {"dp": dict(dp=world), "tp": dict(tp=world),
               "dp_tp": dict(dp=half, tp=world // half),
               "pp": dict(dp=half, pp=world // half),
               "zero1": dict(dp=world, zero=1), "zero2": dict(dp=world, zero=2),
               "zero3": dict(dp=world, zero=3)}[name]
    dp = options.get("dp", 1)
    return {**options, "microbatch_size": max(batch // (2 * dp), -(-4 // dp))}


class Skipped(Exception):
    """manual_plan refused the layout for this model (a clear MeshplanError): not a bug."""


def plan_for(ex: dict, model: nn.Module) -> meshplan.Plan:
    x, y = data(ex, 0)
    text = [None]
    if dist.get_rank() == 0:
        mesh = meshplan.Mesh.local(dist.get_world_size())
        # its one-process reference accumulates over the plan's microbatches, each normalised
        # alone: the per-microbatch statistics a user opts into (tests/test_batchnorm_user.py
        # checks the default, the whole batch)
        common = dict(example_inputs=(x.to("meta"),), example_targets=(y.to("meta"),),
                      loss_fn=loss_fn, batch_norm="microbatch" if ex["bn"] else "batch")
        try:
            if ex["plan"] == "auto":
                # BatchNorm normalises each microbatch; over fewer than 4 rows its gradients
                # are rounding noise (manual_layout), so its search keeps 4 rows or more
                micro = tuple(m for m in range(1, ex["batch"] + 1)
                              if ex["batch"] % m == 0 and ex["batch"] // m >= 4) \
                    if ex["bn"] else None
                plan = meshplan.autoparallel(model, mesh, microbatches=micro, **common)
            else:
                try:
                    plan = meshplan.manual_plan(model, mesh, **common,
                                                **manual_layout(ex["plan"], mesh.num_devices,
                                                               ex["batch"]))
                except meshplan.MeshplanError as exc:
                    raise Skipped(f"{type(exc).__name__}: {exc}") from None
            text[0] = plan.to_json_text()
        except Skipped as exc:
            text[0] = f"SKIP {exc}"
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they hang
            text[0] = f"ERROR {type(exc).__name__}: {exc}"
    dist.broadcast_object_list(text, src=0)
    if text[0].startswith("SKIP "):
        raise Skipped(text[0][5:])
    if text[0].startswith("ERROR "):
        raise RuntimeError(text[0][6:])
    return meshplan.Plan.from_json_text(text[0])


def layout(plan: meshplan.Plan) -> str:
    st = plan.stages[0]
    split = sorted({f"{k}:{'/'.join(v)}" for k, v in st.params.items()
                    if any(p != "R" for p in v)})
    return (f"stages={plan.num_stages} mesh={list(st.mesh_shape)} zero={st.zero} "
            f"microbatches={plan.training.microbatches} schedule={plan.training.schedule} "
            f"sharded={split or 'none'}")


def run_example(ex: dict) -> dict:
    torch.manual_seed(ex["seed"])
    state = Net(ex).state_dict()  # every rank builds the same seeded weights
    with torch.device("meta"):
        model = Net(ex)
    plan = plan_for(ex, model)
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)
    run.load_full_state_dict(state)
    opt = torch.optim.SGD(run.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        x, y = data(ex, step)
        losses.append(run.train_step((rows(x, run),), targets=(rows(y, run),)))
        # DTensors, or plain tensors where the module engine had nothing to shard (1 rank)
        mine = {n: getattr(p.grad, "full_tensor", p.grad.detach)()
                for n, p in run.named_parameters().items() if p.grad is not None}
        grads.append(gathered(mine))
        opt.step()
        opt.zero_grad()
    final = run.full_state_dict()
    run.eval()  # pipelines too: every rank returns its shard's outputs
    out = run(rows(data(ex, STEPS)[0], run))
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, (run.dp_rank, run.dp_size, out))
    return {"plan": plan, "losses": losses, "grads": grads, "final": final, "outs": outs,
            "dp": run.dp_size}


def compare(ex: dict, got: dict) -> list[str]:
    """What differs from one process, one line each (empty: equal)."""
    torch.manual_seed(ex["seed"])
    state = Net(ex).state_dict()
    dp, mb = got["dp"], got["plan"].training.microbatches
    ref_losses, ref_grads, ref_final, ref_out = reference(ex, state, dp, mb)
    # the same in float64: how far the fp32 one-process reference itself is from exact
    exact = reference(ex, {k: v.double() if v.is_floating_point() else v
                           for k, v in state.items()}, dp, mb, dtype=torch.float64)
    exact_of = {"losses": torch.tensor(exact[0])}
    exact_of.update({f"step {i} grad {n}": g for i, gs in enumerate(exact[1]) for n, g in gs.items()})
    exact_of.update({f"final {n}": t for n, t in exact[2].items()})
    problems = []

    def check(what, a, b, scaled=True):
        """|a - b| <= ATOL + RTOL |b| (+ RTOL x the tensor's largest element for gradients and
        weights: a sum's rounding scales with its largest terms) + twice the fp32 reference's
        own error against fp64 (BatchNorm over a few rows amplifies rounding, and then the
        one-process reference is no closer to exact than the plan's run)."""
        a, b = a.double(), b.double()
        allowed = ATOL + RTOL * b.abs()
        if scaled and b.numel():
            allowed = allowed + RTOL * float(b.abs().max())
        if what in exact_of:
            allowed = allowed + 2 * (b - exact_of[what].double()).abs()
        diff = (a - b).abs()
        if a.shape != b.shape or bool((diff > allowed).any()):
            if a.shape != b.shape:
                problems.append(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
                return
            i = int((diff - allowed).flatten().argmax())
            problems.append(f"{what}: {int((diff > allowed).sum())} of {b.numel()} elements "
                            f"differ, worst {float(a.flatten()[i]):.7g} vs {float(b.flatten()[i]):.7g}"
                            f" (allowed {float(allowed.flatten()[i]):.2g})")

    check("losses", torch.tensor(got["losses"]), torch.tensor(ref_losses), scaled=False)
    by_id: dict[int, list[str]] = {}
    for name, p in Net(ex).named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    aliases = {name: names for names in by_id.values() for name in names}  # tied: both
    for step, (mine, ref) in enumerate(zip(got["grads"], ref_grads)):
        for name, g in ref.items():
            key = next((k for a in aliases[name] for k in (a, f"model.{a}") if k in mine),
                       None)
            if key is None:
                problems.append(f"step {step} grad {name}: missing (have {sorted(mine)[:4]})")
                continue
            check(f"step {step} grad {name}", mine[key], g)
    for name, t in ref_final.items():
        if name not in got["final"]:
            problems.append(f"final {name}: missing")
        elif t.is_floating_point():
            check(f"final {name}", got["final"][name], t)
        elif not torch.equal(got["final"][name], t):
            problems.append(f"final {name}: {got['final'][name].tolist()} != {t.tolist()}")
    if got["outs"] is not None:
        for rank, (dp_rank, dp_size, out) in enumerate(got["outs"]):
            n = ref_out.shape[0] // dp_size
            check(f"eval output of rank {rank}", out, ref_out[dp_rank * n:(dp_rank + 1) * n])
    return problems


def main():
    out_path = Path(sys.argv[1])
    examples = json.loads(out_path.with_name("examples.json").read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = []
    for ex in examples:
        record = {"example": ex, "layout": "", "problems": [], "skipped": ""}
        try:
            got = run_example(ex)
            record["layout"] = layout(got["plan"])
            if dist.get_rank() == 0:
                record["problems"] = compare(ex, got)
        except Skipped as exc:
            record["skipped"] = str(exc)[:300]
        except Exception as exc:  # noqa: BLE001 - a failing example is a finding, go on
            last = traceback.format_exception_only(exc)[-1].strip()
            record["problems"] = [f"raised {last[:500]}"]
            print(f"rank {dist.get_rank()}: {ex}: {''.join(traceback.format_exception(exc))}",
                  file=sys.stderr, flush=True)
        if dist.get_rank() == 0:
            print(json.dumps(record), flush=True)
        results.append(record)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
