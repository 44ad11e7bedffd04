"""gloo worker of the generative differential test: many drawn cases in one launch.

Reads the cases (tests/harness/generated.py, drawn in the test process) from
``cases.json`` beside the output file. For each case, rank 0 plans it through the public
API (``meshplan.autoparallel`` or ``meshplan.manual_plan`` with the user's ``loss_fn`` and
one global batch) and sends the plan to the others; every rank then trains it as a user
does: ``meshplan.parallelize``, ``load_full_state_dict``, its own rows of each global batch,
AdamW with a warm-up schedule, ``clip_grad_norm_`` that bites, then ``full_state_dict`` and
eval outputs of its rows. Rank 0 compares losses, gradient norms, final weights and every
rank's eval rows with one plain PyTorch process on the whole batch (tests/harness/
equivalence.py's rule) and records one outcome per case:

- ``equal``; ``refused`` (a one-line ``MeshplanError`` when the plan is made);
- ``wrong`` (numbers differ), ``refused at run time`` (a ``MeshplanError`` after the plan
  was made) or ``crashed`` (any other exception): the outcomes that must not happen.
"""

import datetime
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import meshplan
from tests.harness import generated as g
from tests.harness.equivalence import check, expected, parse_layout

BAD = ("wrong", "refused at run time", "crashed")


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))


def rows(t: torch.Tensor, run) -> torch.Tensor:
    n = t.shape[0] // run.dp_size
    return t[run.dp_rank * n:(run.dp_rank + 1) * n]


def make_plan(case: dict) -> tuple[str, str]:
    """Rank 0 plans; every rank gets ("plan", json) or ("refused" / "crashed", message)."""
    answer = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            model = g.build(case)
        x, y = g.batch(case, 0)
        common = dict(example_inputs=(x.to("meta"),), example_targets=(y.to("meta"),),
                      loss_fn=g.user_loss(case))
        mesh = meshplan.Mesh.local(dist.get_world_size())
        try:
            plan = meshplan.autoparallel(model, mesh, **common) if case["layout"] == "auto" \
                else meshplan.manual_plan(model, mesh, **common, **parse_layout(case["layout"]))
            answer[0] = ("plan", plan.to_json_text())
        except meshplan.MeshplanError as exc:
            answer[0] = ("refused", f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a finding; every rank must hear of it
            answer[0] = ("crashed", "when planning: " + _last_line(exc))
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(exc)[-1].strip()[:600]


def train(case: dict, plan: meshplan.Plan) -> dict:
    """The user's loop on this rank; what it records."""
    loss_fn = g.user_loss(case)
    with torch.device("meta"):
        model = g.build(case)
    run = meshplan.parallelize(model, plan, loss_fn=loss_fn)
    run.load_full_state_dict(g.initial(case).state_dict())
    opt = torch.optim.AdamW(run.parameters(), lr=g.LR)
    sched = schedule(opt)
    losses, norms = [], []
    for step in range(g.STEPS):
        x, y = g.batch(case, step)
        losses.append(float(run.train_step((rows(x, run),), targets=(rows(y, run),))))
        norms.append(float(run.clip_grad_norm_(g.CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
    weights = run.full_state_dict()
    run.eval()
    with torch.no_grad():
        out = run((rows(g.batch(case, g.STEPS)[0], run),))
    return {"losses": losses, "norms": norms, "weights": weights,
            "eval": (run.dp_rank, run.dp_size, out.detach()), "engine": run.engine_name}


def compare(case: dict, got: dict, evals: list) -> list[str]:
    """What differs from one plain process (empty: equal)."""
    loss_fn = g.user_loss(case)
    exp = expected(lambda: g.initial(case), [g.batch(case, s) for s in range(g.STEPS)],
                   lambda model, b: model(b[0]), lambda out, b: loss_fn(out, b[1]),
                   optimizer=lambda params: torch.optim.AdamW(params, lr=g.LR),
                   schedule=schedule, clip=g.CLIP, eval_batch=g.batch(case, g.STEPS))
    bad = check(got, exp, fields=("losses", "norms", "weights"))
    ref, tol = exp.ref["eval"], exp.tol["eval"]
    for rank, (dp_rank, dp_size, out) in enumerate(evals):
        n = ref.shape[0] // dp_size
        want = ref[dp_rank * n:(dp_rank + 1) * n]
        if out.shape != want.shape:
            bad.append(f"eval rows of rank {rank}: shape {list(out.shape)} != {list(want.shape)}")
            continue
        err = float((out.double() - want.double()).abs().max())
        if err > tol:
            bad.append(f"eval rows of rank {rank} differ by {err:.3g} (allowed {tol:.2g})")
    return bad


def run_case(case: dict) -> dict:
    record = {"case": case, "outcome": "", "detail": "", "plan": "", "engine": ""}
    kind, text = make_plan(case)
    if kind != "plan":
        record.update(outcome=kind, detail=text)
        return record
    plan = meshplan.Plan.from_json_text(text)
    record["plan"] = (f"engine={plan.engine} stages={plan.num_stages} "
                      f"mesh={list(plan.stages[0].mesh_shape)} "
                      f"microbatches={plan.training.microbatches}")
    try:
        got, status = train(case, plan), ("ok", "")
    except meshplan.MeshplanError as exc:
        got, status = None, ("refused at run time", f"{type(exc).__name__}: {exc}"[:600])
    except Exception as exc:  # noqa: BLE001 - a finding
        got, status = None, ("crashed", _last_line(exc))
        print(f"rank {dist.get_rank()} {case}:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
    statuses = [None] * dist.get_world_size()
    dist.all_gather_object(statuses, status)
    evals = [None] * dist.get_world_size()
    dist.all_gather_object(evals, got["eval"] if got else None)
    failed = [s for s in statuses if s[0] != "ok"]
    if failed:
        record.update(outcome=failed[0][0], detail=failed[0][1])
    elif dist.get_rank() == 0:
        record["engine"] = got["engine"]
        problems = compare(case, got, evals)
        record.update(outcome="wrong" if problems else "equal", detail=" | ".join(problems[:4]))
    return record


def main():
    out_path = Path(sys.argv[1])
    cases = json.loads(out_path.with_name("cases.json").read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    results = []
    for case in cases:
        record = run_case(case)
        if dist.get_rank() == 0:
            print(json.dumps({k: record[k] for k in ("outcome", "plan", "detail")}
                             | {"layout": case["layout"], "kind": case["kind"]}), flush=True)
        results.append(record)
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
