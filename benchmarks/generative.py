"""The generative differential run at scale: N cases drawn from the grammar of
tests/harness/generated.py, each planned and trained through the public API on 4 gloo
processes (tests/_generative_worker.py) and compared with one plain PyTorch process.

    python benchmarks/generative.py [--cases 500] [--per-launch 40] [--seed 0]

Writes benchmarks/results/generative.md: outcomes (equal / refused at plan time / wrong /
refused at run time / crashed) overall and per layout, how often each grammar feature was
drawn (each should appear in at least 10% of the cases), and every case that is not equal
or refused, with its one-line detail. The cases run in launches of ``--per-launch`` so that
a case that hangs its process group costs one launch, not the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from tests._launch import forked_results  # noqa: E402
from tests.harness import generated as g  # noqa: E402

OUTCOMES = ("equal", "refused", "wrong", "refused at run time", "crashed")


def run(cases: list[dict], per_launch: int) -> list[dict]:
    worker = str(ROOT / "tests" / "_generative_worker.py")
    results: list[dict] = []
    for start in range(0, len(cases), per_launch):
        part = cases[start:start + per_launch]
        folder = Path(tempfile.mkdtemp(prefix="generative-"))
        (folder / "cases.json").write_text(json.dumps(part))
        t0 = time.time()
        try:
            results += forked_results(worker, folder / "out.pt", nproc=4,
                                      timeout=max(600, 60 * len(part)))
        except Exception as exc:  # noqa: BLE001 - a launch that died: its cases crashed
            results += [{"case": c, "outcome": "crashed", "plan": "", "engine": "",
                         "detail": f"launch failed: {str(exc)[-300:]}"} for c in part]
        done = Counter(r["outcome"] for r in results)
        print(f"{len(results)}/{len(cases)} cases ({time.time() - t0:.0f} s for this launch): "
              + ", ".join(f"{done[o]} {o}" for o in OUTCOMES if done[o]), flush=True)
    return results


def report(results: list[dict], seconds: float, seed: int) -> str:
    n = len(results)
    counts = Counter(r["outcome"] for r in results)
    lines = [f"# Generative differential run ({n} cases, seed {seed})", "",
             "`python benchmarks/generative.py --cases "
             f"{n} --seed {seed}`: models drawn from tests/harness/generated.py, each trained "
             "through the public API in a user's loop on 4 gloo processes and compared with "
             f"one plain PyTorch process. {seconds / 60:.1f} minutes on this machine.", "",
             "| outcome | cases | share |", "|---|---:|---:|"]
    lines += [f"| {o} | {counts[o]} | {counts[o] / n:.1%} |" for o in OUTCOMES]
    by_layout: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_layout[f"{r['case']['kind']} {r['case']['layout']}"][r["outcome"]] += 1
    lines += ["", "## By model kind and layout", "",
              "| kind, layout | " + " | ".join(OUTCOMES) + " |",
              "|---|" + "---:|" * len(OUTCOMES)]
    lines += [f"| {k} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |"
              for k, c in sorted(by_layout.items())]
    drawn = Counter(f for r in results for f in g.features(r["case"]))
    lines += ["", "## How often each grammar feature was drawn", "",
              "| feature | cases | share |", "|---|---:|---:|"]
    lines += [f"| {f} | {c} | {c / n:.1%} |" for f, c in sorted(drawn.items())]
    refusals = Counter(r["detail"].split(":")[0] + ": " + r["detail"].split(":", 1)[-1][:90]
                       for r in results if r["outcome"] == "refused")
    lines += ["", "## Refusals at plan time (first 90 characters)", ""]
    lines += [f"- {c} x {text}" for text, c in refusals.most_common()]
    bad = [r for r in results if r["outcome"] not in ("equal", "refused")]
    lines += ["", f"## Cases neither equal nor refused ({len(bad)})", ""]
    lines += [f"- {r['outcome']}: `{json.dumps(r['case'], sort_keys=True)}` {r['plan']}: "
              f"{r['detail'][:300]}" for r in bad]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--per-launch", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generative.md"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cases = g.draw(args.cases, seed=args.seed)
    t0 = time.time()
    results = run(cases, args.per_launch)
    text = report(results, time.time() - t0, args.seed)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
