"""How long `meshplan sweep` takes: GPT-3 13B on 64 A100s (dgx-a100-80gb:nodes=8).

trace -> cost -> **sweep**. Times each part of ``meshplan.sweep.run_sweep`` on this machine:
the trace (once), the pricing of every uniform configuration (one ``manual_plan`` per
placement key, then ``meshplan.estimate`` per configuration, in forked workers), and the
automatic plan. The target is under 60 s on a 2-core machine. The batch is GPT-3 13B's
published one: 2M tokens = 1024 sequences of 2048 (Brown et al. 2020, Table 2.1).

Run: python benchmarks/sweep_speed.py [--batch 1024] [--workers 0] [--sample N]
(``--sample N`` prices N configurations drawn at random and extrapolates; the full sweep is
the default). Writes benchmarks/results/sweep_speed.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import meshplan
from meshplan.planner.manual import attention_heads
from meshplan.specs import example_inputs, parse_model_spec, parse_mesh_spec
from meshplan.sweep import configurations, run_sweep

MODEL, MESH, SEQ = "gpt3-13b", "dgx-a100-80gb:nodes=8", 2048
TARGET_S = 60.0  # the bar: the whole sweep in under a minute on 2 cores
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=0, help="0: one per available core")
    ap.add_argument("--sample", type=int, default=0, help="price a random sample and extrapolate")
    ap.add_argument("--no-auto", action="store_true")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    spec = parse_model_spec(MODEL)
    model = spec.build("meta")
    mesh = parse_mesh_spec(MESH)
    graph = meshplan.trace(model, example_inputs(model, args.batch, SEQ), model_name=spec.name)
    t_trace = time.perf_counter() - t0
    space = configurations(devices=mesh.num_devices, devices_per_node=mesh.devices_per_node,
                           batch=args.batch, layers=graph.num_layers,
                           heads=attention_heads(graph))
    configs = space
    if args.sample:
        configs = random.Random(0).sample(space, min(args.sample, len(space)))
    t1 = time.perf_counter()
    frame = run_sweep(model, mesh, graph=graph, configs=configs, auto=False,
                      workers=args.workers, progress=True)
    t_price = time.perf_counter() - t1
    print(f"priced {len(configs)} configurations in {t_price:.1f} s", flush=True)
    t_auto, auto_note = 0.0, ""
    if not args.no_auto:
        t2 = time.perf_counter()
        try:
            auto = meshplan.autoparallel(model, mesh, graph=graph, time_limit_s=30)
            auto_note = f"automatic plan: {auto.predicted.step_time_s:.3f} s per step"
        except Exception as exc:  # noqa: BLE001 - a planner failure must not lose the timing
            auto_note = f"automatic plan failed: {type(exc).__name__}: {exc}"
        t_auto = time.perf_counter() - t2
    full_price = t_price * len(space) / len(configs)
    total = t_trace + full_price + t_auto
    workers = args.workers or len(os.sched_getaffinity(0))
    rows = [("trace (once)", t_trace), (f"price {len(configs)} of {len(space)} configurations "
                                        f"({workers} workers)", t_price)]
    if args.sample:
        rows.append((f"price all {len(space)} (extrapolated)", full_price))
    if not args.no_auto:
        rows.append(("automatic plan", t_auto))
    rows.append(("total" + (" (extrapolated)" if args.sample else ""), total))
    fits = int(frame["fits"].sum())
    lines = [f"# sweep speed: {MODEL} on {MESH}, batch {args.batch} x {SEQ}", "",
             f"machine: {platform.machine()}, {len(os.sched_getaffinity(0))} cores available; "
             f"target under {TARGET_S:.0f} s", "", "| part | seconds |", "|---|---|"]
    lines += [f"| {name} | {sec:.1f} |" for name, sec in rows]
    lines += ["", f"{len(space)} configurations in the space, {len(configs)} priced, {fits} fit; "
              f"per configuration {t_price / len(configs) * 1e3:.1f} ms of wall time.",
              auto_note,
              f"Verdict: {'meets' if total < TARGET_S else 'MISSES'} the {TARGET_S:.0f} s target."]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "sweep_speed.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "sweep_speed.json"), "w") as f:
        json.dump({"model": MODEL, "mesh": MESH, "batch": args.batch, "seq": SEQ,
                   "workers": workers, "space": len(space), "priced": len(configs),
                   "fits": fits, "seconds": dict(rows), "target_s": TARGET_S,
                   "automatic_plan": auto_note},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
