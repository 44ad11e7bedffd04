"""Searches per ``autoparallel`` call and pricings per ``manual_plan`` call over the zoo
(issue 40: "the search can run up to three times per plan ... manual_plan prices twice").

Run: python benchmarks/search_counts.py [--mesh local:4] [--out FILE]
Each family of tests/_zoo_run_worker.py (tiny configs) is traced on meta, then planned on
MESH by ``autoparallel`` (microbatches=[1], as the zoo run plans it) and by ``manual_plan``
at dp2 x tp2, in this process. Counted by wrapping the functions the API calls:
``plan_auto`` (one whole search: the pipeline search, the intra-op ILP and the simplest-plan
pass), ``plan_hybrid`` (one pipeline search), ``plan_single_stage`` (one intra-op ILP) and
``with_stage_predictions`` (one full pricing of a plan). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import meshplan  # noqa: E402
import meshplan.api as api  # noqa: E402
import meshplan.costmodel.estimate as estimate  # noqa: E402
import meshplan.planner.hybrid as hybrid  # noqa: E402
import meshplan.planner.singlestage as singlestage  # noqa: E402
from meshplan.specs import parse_mesh_spec  # noqa: E402

import _zoo_run_worker as zoo  # noqa: E402

COUNTS: collections.Counter = collections.Counter()


def _counted(original, label: str):
    def wrapper(*args, **kwargs):
        COUNTS[label] += 1
        return original(*args, **kwargs)
    return wrapper


def install() -> None:
    """Count every call: each meshplan module's binding of the counted functions (imported
    at module level or inside functions, from the module that defines them) is replaced."""
    import meshplan.planner.stagecost  # noqa: F401 - loaded before the bindings are replaced

    counted = {hybrid.plan_auto: "searches", stagecost_plan_hybrid(): "pipeline searches",
               singlestage.plan_single_stage: "intra-op ILPs",
               estimate.with_stage_predictions: "pricings"}
    wrappers = {f: _counted(f, label) for f, label in counted.items()}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("meshplan"):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and value in wrappers:
                setattr(module, attr, wrappers[value])


def stagecost_plan_hybrid():
    import meshplan.planner.stagecost as stagecost
    return stagecost.plan_hybrid


def measure(family: str, mesh) -> list[tuple]:
    rows = []
    for kind in ("autoparallel", "manual dp2xtp2"):
        model = zoo.build(family, "meta")
        inputs, targets, loss_fn = zoo.call(family, model, "meta")
        common = dict(example_inputs=inputs, example_targets=targets, loss_fn=loss_fn)
        graph = meshplan.tracing.trace(model, inputs, loss_fn=loss_fn, example_targets=targets)
        COUNTS.clear()
        start = time.process_time()
        try:
            if kind == "autoparallel":
                plan = meshplan.autoparallel(model, mesh, **common, graph=graph,
                                             microbatches=[1], time_limit_s=10)
            else:
                plan = meshplan.manual_plan(model, mesh, **common, graph=graph, dp=2, tp=2,
                                            microbatch_size=zoo.BATCH // 2)
            outcome = f"{plan.engine}, {plan.num_stages} stage(s)"
        except meshplan.MeshplanError as exc:
            outcome = f"refused: {type(exc).__name__}"
        cpu = time.process_time() - start
        rows.append((family, kind, COUNTS["searches"], COUNTS["pipeline searches"],
                     COUNTS["intra-op ILPs"], COUNTS["pricings"], cpu, outcome))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="search_counts")
    ap.add_argument("--mesh", default="local:4")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    install()
    mesh = parse_mesh_spec(args.mesh)
    lines = [f"Searches and pricings per call, mesh {args.mesh} (benchmarks/search_counts.py)",
             "", "| family | call | searches | pipeline searches | intra-op ILPs | pricings | "
             "CPU s | plan |", "|---|---|---:|---:|---:|---:|---:|---|"]
    totals = collections.Counter()
    for family in zoo.FAMILIES:
        for row in measure(family, mesh):
            lines.append("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v)
                                           for v in row) + " |")
            print(lines[-1], flush=True)
            totals[row[1], "searches"] += row[2]
            totals[row[1], "pipeline"] += row[3]
            totals[row[1], "pricings"] += row[5]
            totals[row[1], "cpu"] += row[6]
            totals[row[1], "n"] += 1
    lines.append("")
    for kind in ("autoparallel", "manual dp2xtp2"):
        n = totals[kind, "n"]
        lines.append(f"- {kind}: {totals[kind, 'searches'] / n:.2f} searches, "
                     f"{totals[kind, 'pipeline'] / n:.2f} pipeline searches, "
                     f"{totals[kind, 'pricings'] / n:.2f} pricings per call; "
                     f"{totals[kind, 'cpu']:.1f} CPU s over {n} calls")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
