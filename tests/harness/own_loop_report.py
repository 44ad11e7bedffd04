"""Run the own-loop matrix for some models and print it (a developer's tool):

    python -m tests.harness.own_loop_report mlp bert [--layouts dp4,dp2xtp2]
"""
import argparse
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _launch import forked_run  # noqa: E402
from tests.harness.own_loop import LAYOUTS, compare, tolerances  # noqa: E402

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="own-loop-"))
    for name in args.models:
        t0 = time.time()
        out = tmp / f"{name}.pt"
        forked_run("tests.harness.own_loop", ["--model", name, "--layouts", args.layouts,
                                              "--out", str(out)], 4, 1200, tmp / name,
                   module=True)
        cells, tol = torch.load(out), tolerances(name)
        for layout, cell in cells.items():
            bad = compare(cell, tol)
            verdict = "refused: " + cell["refused"] if "refused" in cell else \
                "equal" if not bad else "FAILING: " + "; ".join(bad[:3])
            print(f"{name:6s} {layout:8s} {verdict}  [{cell.get('layout', '')}] "
                  f"{cell.get('seconds', 0):.1f} s", flush=True)
            if "traceback" in cell:
                print(cell["traceback"][-1500:])
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
