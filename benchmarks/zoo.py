"""The zoo table (issue 13): family x trace / plan at 16 H100 / run auto / tp / pp.

Run: python benchmarks/zoo.py
Each family of tests/_zoo_run_worker.py (tiny configs) is traced on the meta device and
planned by autoparallel on two DGX-H100 nodes (a fake mesh: the planner only reads its
hardware description), here in one process; then the worker runs every family on 4 gloo
processes (auto, dp2 x tp2, dp2 x pp2, 2 steps each) and each run is compared with one
process (losses rtol 1e-5, gradients rtol 1e-5 / atol 1e-5, as tests/test_zoo_run.py).
Writes benchmarks/results/zoo.md.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import torch  # noqa: E402

import meshplan  # noqa: E402
from meshplan.specs import parse_mesh_spec  # noqa: E402

import _zoo_run_worker as zoo  # noqa: E402
from _launch import torchrun_results  # noqa: E402

H100_BATCH = 256  # global batch planned on 16 H100s: 16 rows per device at dp=16


def plan_h100(family: str) -> tuple[str, str]:
    model = zoo.build(family, "meta")
    inputs, targets, loss_fn = zoo.call(family, model, "meta", batch=H100_BATCH)
    t = time.perf_counter()
    try:
        graph = meshplan.trace(model, inputs, example_targets=targets, loss_fn=loss_fn)
    except meshplan.MeshplanError as exc:
        return f"FAILED: {exc}"[:80], "-"
    traced = f"ok ({graph.num_layers} blocks, {time.perf_counter() - t:.1f} s)"
    try:
        plan = meshplan.autoparallel(model, parse_mesh_spec("dgx-h100:nodes=2"), inputs,
                                     example_targets=targets, loss_fn=loss_fn, graph=graph,
                                     time_limit_s=10)
    except meshplan.MeshplanError as exc:
        return traced, f"refused: {type(exc).__name__}: {exc}"[:100]
    st = plan.stages[0]
    return traced, (f"{plan.num_stages} stage(s), mesh {list(st.mesh_shape)}, "
                    f"mb {plan.training.microbatches}, "
                    f"{plan.predicted.step_time_s * 1e3:.2f} ms/step")


def verdict(r: dict) -> str:
    if "refused" in r:
        return "refused: " + r["refused"][:70]
    try:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]),
                                   rtol=1e-5, atol=1e-6)
        for got, ref in zip(r["grads"], r["ref_grads"]):
            assert set(got) == set(ref)
            for name, g in ref.items():
                torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-5)
    except AssertionError as exc:
        return "DIFFERS: " + str(exc).splitlines()[0][:60]
    return f"= 1 process ({r['layout'].split(',')[0]}, {r['seconds']:.0f} s)"


def main() -> None:
    warnings.filterwarnings("ignore")
    planned = {f: plan_h100(f) for f in zoo.FAMILIES}
    for f, row in planned.items():
        print(f, *row, sep=" | ", flush=True)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = torchrun_results(os.path.join(HERE, "..", "tests", "_zoo_run_worker.py"),
                                os.path.join(tmp, "out.pt"), nproc=4, timeout=1800)
    launch_s = time.perf_counter() - t
    header = ("family", "trace", "plan at 16 H100 (batch 256)", "run auto", "run tp=2",
              "run pp=2")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for f in zoo.FAMILIES:
        cells = [f, *planned[f], *(verdict(runs[(f, p)]) for p in zoo.PLANS)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(HERE, "results", "zoo.md"), "w") as fh:
        fh.write("# The model zoo: trace, plan at 16 H100, run on 4 CPU processes\n\n"
                 "Command: `python benchmarks/zoo.py` (2-core CPU machine shared with other "
                 "jobs). Tiny configs (2 layers, hidden 32, seq 16, batch 8 for the runs); "
                 "runs are 2 steps through `meshplan.parallelize` on 4 gloo processes, "
                 "compared with one process (losses rtol 1e-5, every gradient rtol/atol "
                 f"1e-5). The one torchrun launch took {launch_s:.0f} s.\n\n"
                 + table + "\n")


if __name__ == "__main__":
    main()
