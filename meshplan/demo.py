"""``meshplan demo``: the whole path on this machine in about a minute.

Plan a scaled-down GPT-2 for 4 local CPU processes and for 1, print the plan, train a few
steps with each under torchrun (``meshplan run``), train the same steps in plain PyTorch in
this process, and compare: every step's loss and gradient norm of both runs must equal plain
PyTorch's (the reference is never meshplan's own runtime), and each run's predicted step
time is shown beside the measured one.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from meshplan.api import autoparallel
from meshplan.mesh import Mesh
from meshplan.runtime.launch import run_plan
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec

DEMO_BATCH, DEMO_SEQ = 8, 32
NO_CLIP = 1e9  # `meshplan run --clip` records the global gradient norm; this never binds


def plain_pytorch(steps: int, seed: int = 0, lr: float = 1e-3) -> dict:
    """The demo's steps in plain PyTorch, one process, whole batch: the seeded weights and
    synthetic batches ``meshplan run`` draws (specs.LoadedModel.synthetic), Adam (the plan's
    optimizer) at the worker's learning rate."""
    from meshplan.tracing import next_token_loss, target_loss

    torch.manual_seed(seed)
    loaded = parse_model_spec(DEMO_MODEL).load(DEMO_BATCH, DEMO_SEQ, device="cpu")
    model = loaded.model
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        call = loaded.synthetic(seed=seed, step=step)
        out = model(*call.inputs)
        loss = target_loss(out.logits, *call.targets) if call.targets else \
            next_token_loss(out.logits, *call.inputs)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), NO_CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norm": norms}


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))


def run_demo(*, procs: int = 4, steps: int = 5, workdir: str = "") -> int:
    workdir = workdir or tempfile.mkdtemp(prefix="meshplan-demo-")
    os.makedirs(workdir, exist_ok=True)
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build(device="meta")
    inputs = example_inputs(model, DEMO_BATCH, DEMO_SEQ)

    results = {}
    for n in (procs, 1):
        plan = autoparallel(model, Mesh.local(n), inputs, model_name=spec.name)
        path = os.path.join(workdir, f"plan-{n}.json")
        plan.to_json(path)
        if n == procs:
            print(plan.summary())
        print(f"== training {steps} steps on {n} process{'es' if n > 1 else ''} ({path})", flush=True)
        metrics = os.path.join(workdir, f"metrics-{n}.json")
        code = run_plan(path, model=DEMO_MODEL, steps=steps, seed=0, metrics_out=metrics,
                        extra=("--clip", str(NO_CLIP)))
        if code != 0:
            print(f"meshplan demo: the {n}-process run failed (exit {code})")
            return code
        with open(metrics) as f:
            results[n] = json.load(f)

    print("== the same steps in plain PyTorch, this process, whole batch", flush=True)
    plain = plain_pytorch(steps)
    multi, single = results[procs], results[1]
    print(f"\nstep  loss ({procs} procs)  loss (1 proc)  plain PyTorch  grad norm ({procs} procs / "
          "plain)")
    for i, (a, b, c) in enumerate(zip(multi["losses"], single["losses"], plain["losses"])):
        print(f"{i:>4}  {a:>15.6f}  {b:>13.6f}  {c:>13.6f}  {multi['grad_norm'][i]:.6f} / "
              f"{plain['grad_norm'][i]:.6f}")
    worst = max(_worst(r["losses"], plain["losses"]) for r in (multi, single))
    worst_norm = max(_worst(r["grad_norm"], plain["grad_norm"]) for r in (multi, single))
    equal = worst < 1e-5 and worst_norm < 1e-4
    print(f"largest relative difference from plain PyTorch: losses {worst:.2e}, gradient norms "
          f"{worst_norm:.2e} ({'equal within 1e-5 / 1e-4' if equal else 'DIFFERENT'})")
    for n in (procs, 1):
        r = results[n]
        print(f"step time on {n} process{'es' if n > 1 else ''}: predicted "
              f"{r['predicted_step_time_s'] * 1e3:.1f} ms, measured "
              f"{r['measured_step_time_s'] * 1e3:.1f} ms")
    faster = lambda key: procs if multi[key] < single[key] else 1  # noqa: E731
    print(f"fastest: predicted {faster('predicted_step_time_s')} process(es), measured "
          f"{faster('measured_step_time_s')}")
    hw = Mesh.local(procs).hardware
    if not hw.fitted:  # the preset: order-of-magnitude defaults, not this machine
        print(f"(predicted with the uncalibrated '{hw.name}' profile; `meshplan calibrate` "
              "measures this machine in about a minute, and later plans use it)")
    else:
        print(f"(predicted with this machine's calibration, profile '{hw.name}')")
    print(f"plans and metrics in {workdir}")
    return 0 if equal else 1
