"""``meshplan demo``: the whole path on this machine in about a minute.

Plan a scaled-down GPT-2 for 4 local CPU processes, print the plan, train a few steps with
it under torchrun, train the same steps in one process, and compare: losses must agree and
the predicted step time is shown beside the measured one.
"""

from __future__ import annotations

import json
import os
import tempfile

from meshplan.api import autoparallel
from meshplan.mesh import Mesh
from meshplan.runtime.launch import run_plan
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec

DEMO_BATCH, DEMO_SEQ = 8, 32


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
        code = run_plan(path, model=DEMO_MODEL, steps=steps, seed=0, metrics_out=metrics)
        if code != 0:
            print(f"meshplan demo: the {n}-process run failed (exit {code})")
            return code
        with open(metrics) as f:
            results[n] = json.load(f)

    multi, single = results[procs], results[1]
    worst = max(abs(a - b) / abs(b) for a, b in zip(multi["losses"], single["losses"]))
    print("\nstep  loss (%d procs)  loss (1 proc)" % procs)
    for i, (a, b) in enumerate(zip(multi["losses"], single["losses"])):
        print(f"{i:>4}  {a:>15.6f}  {b:>13.6f}")
    print(f"largest relative loss difference: {worst:.2e} "
          f"({'equal within 1e-5' if worst < 1e-5 else 'DIFFERENT'})")
    print(f"step time on {procs} processes: predicted {multi['predicted_step_time_s'] * 1e3:.1f} ms, "
          f"measured {multi['measured_step_time_s'] * 1e3:.1f} ms")
    hw = Mesh.local(procs).hardware
    if not hw.fitted:  # the preset: order-of-magnitude defaults, not this machine
        print(f"(predicted with the uncalibrated '{hw.name}' profile; `meshplan calibrate` "
              "measures this machine in about a minute, and later plans use it)")
    else:
        print(f"(predicted with this machine's calibration, profile '{hw.name}')")
    print(f"plans and metrics in {workdir}")
    return 0 if worst < 1e-5 else 1
