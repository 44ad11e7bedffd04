"""Plan quality: autoparallel's plan against the best Megatron-style plan of an exhaustive grid,
both priced by the same cost model; and the planning time of GPT-3 175B on 1,024 GPUs.

trace -> cost -> **solve** (planner/hybrid) vs a grid of ``meshplan.manual_plan`` plans.
The grid is every (dp, tp, pp) with dp x tp x pp = GPUs (tp inside a node and dividing the
heads), microbatch size 1/2/4/8, schedule GPipe / 1F1B / interleaved 1F1B (v = 2, 4 where
the blocks divide into pp x v chunks and the microbatches into pp), recompute none /
selective / full, sequence parallelism on/off (tp > 1) and ZeRO 0-3 (dp > 1): thousands of
plans per cell. Pricing each with ``manual_plan`` + ``estimate`` (0.2-0.5 s) would take
hours, so the grid is ranked with the pipeline search's own stage probes (the cost model's
``stage_cost`` on Megatron placements, planner/stagecost), and its three best plans that fit
are built with ``manual_plan`` and priced in full by ``estimate``; the best of those is the
baseline. The auto plan is ``autoparallel``'s (planner/hybrid.plan_auto), priced in full.

Ratio = auto throughput / best grid throughput. The auto search contains the grid's plans
(uniform stages are one of its cuts), so the ratio is >= 1 up to the affine probes' error;
it is higher where the search uses what the grid cannot: non-uniform stage boundaries
(the embedding and head make the first and last stage heavier), per-stage recompute and
ZeRO, interleaving depths the grid's divisibility rule forbids.

Run:  python benchmarks/plan_quality.py [--models gpt3-1.3b,...] [--hardware dgx-h100]
                                        [--gpus 8,64,1024] [--timing-only]
Writes benchmarks/results/plan_quality.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from meshplan.costmodel.pipeline import pipeline_step_time
from meshplan.errors import MemoryLimitError
from meshplan.planner.manual import attention_heads, build_manual_plan, layer_bounds
from meshplan.mesh import Mesh
from meshplan.planner.clusters import layer_units
from meshplan.planner.hybrid import MICROBATCH_SIZES, plan_auto, search_space
from meshplan.planner.inter import StageOption, in_flight
from meshplan.planner.stagecost import MegatronStageCost
from meshplan.planner.stagedp import p2p_hops
from meshplan.tracing import trace
from meshplan.specs import parse_model_spec

# (preset or spec, global batch, sequence). Batches: GPT-3 paper Table 2.1 (0.5M / 1M /
# 3.2M tokens of 2048), Llama 2 (4M tokens of 4096: 1024 sequences), BERT (256 x 512).
MODELS = {
    "gpt3-1.3b": ("gpt3-1.3b", 512, 2048),
    "gpt3-13b": ("gpt3-13b", 1024, 2048),
    "gpt3-175b": ("gpt3-175b", 1536, 2048),
    "llama2-7b": ("llama2-7b", 1024, 4096),
    "llama2-70b": ("llama2-70b", 1024, 4096),
    "bert-large": ("bert-large", 256, 512),
    # mixture of experts: a small Mixtral (8 experts, top-2; Jiang et al. 2024's layout at a
    # quarter of the width). T5 (encoder-decoder) also traces, but the tracer's repeated
    # blocks are then the decoder's only: the whole encoder would sit in the first stage.
    "mixtral-small": ("transformers:mixtral?hidden_size=2048&intermediate_size=5632"
                      "&num_hidden_layers=16&num_attention_heads=16&num_key_value_heads=8"
                      "&num_local_experts=8&num_experts_per_tok=2&vocab_size=32000", 512, 2048),
}
HARDWARE = ("dgx-a100-80gb", "dgx-h100")
GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
VIRTUAL = (2, 4)
OUT = os.path.join(os.path.dirname(__file__), "results")


def traced(name: str):
    spec, batch, seq = MODELS[name]
    model = parse_model_spec(spec).build(device="meta")
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    start = time.perf_counter()
    graph = trace(model, (ids,), model_name=name)
    return graph, time.perf_counter() - start


def mesh_for(hardware: str, gpus: int) -> Mesh:
    return Mesh.preset(hardware, nodes=max(1, gpus // 8))


def grid(graph, mesh, cost: MegatronStageCost):
    """Every Megatron-style plan, ranked by the probes: (step s, fits, config) sorted."""
    n, layers = mesh.num_devices, graph.num_layers
    batch = graph.inputs[0][1].shape[0]
    heads = attention_heads(graph)
    capacity = mesh.hardware.device.memory_gib
    out = []
    for tp in (1, 2, 4, 8):
        if n % tp or (heads and heads % tp) or tp > mesh.devices_per_node:
            continue
        for pp in range(1, min(layers, n // tp) + 1):
            if (n // tp) % pp:
                continue
            dp = n // (tp * pp)
            bounds = layer_bounds(layers, pp)
            for mbs in MICROBATCH_SIZES:
                if batch % (dp * mbs):
                    continue
                b = batch // (dp * mbs)
                scheds = [("gpipe", 1), ("1f1b", 1)] + [
                    ("interleaved-1f1b", v) for v in VIRTUAL
                    if pp > 1 and layers % (pp * v) == 0 and b % pp == 0]
                for rc in ("none", "selective", "full"):
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                            if cost.weights_floor_gib(pp, dp, tp, zero) > capacity:
                                continue  # cannot fit whatever the rest: not worth pricing
                            opt = StageOption((dp, tp), rc, zero, sp)
                            for schedule, v in scheds:
                                step, fits = _price(cost, opt, mbs, b, bounds, schedule, v,
                                                    capacity)
                                out.append((step, not fits, dict(
                                    dp=dp, tp=tp, pp=pp, microbatch_size=mbs, schedule=schedule,
                                    virtual_stages=v, recompute=rc, sequence_parallel=sp,
                                    zero=zero)))
    out.sort(key=lambda r: (r[1], r[0]))
    return out


def _price(cost, opt, mbs, b, bounds, schedule, v, capacity):
    times, tails, fits = [], [], True
    k = len(bounds)
    for s, (first, last) in enumerate(bounds):
        parts = [cost.unit_cost(i, opt, mbs, leading=i == first) for i in range(first, last)]
        if any(p is None for p in parts):
            return float("inf"), False
        t = sum(p.time_s for p in parts)
        t += v * p2p_hops(s == 0, s == k - 1) * parts[0].recv_s
        w = sum(p.weights_gib for p in parts)
        a = sum(p.activation_gib for p in parts)
        r = sum(p.transient_gib for p in parts)
        fits &= w + in_flight(schedule, s, k, b, v) * a + r <= capacity
        times.append(t)
        tails.append(sum(p.step_s for p in parts))
    return pipeline_step_time(times, b, schedule, v).step_s + max(tails), fits


def cell(name, graph, hardware, gpus):
    mesh = mesh_for(hardware, gpus)
    units = layer_units(graph)
    cost = MegatronStageCost(graph, units, mesh.hardware, num_devices=gpus, dtype="bf16",
                             optimizer="adam")
    start = time.perf_counter()
    try:
        # margin=0: the search's fastest plan (the default keeps the simplest within the
        # cost model's error, planner/simplest.py, which may be up to that much slower)
        auto = plan_auto(graph, mesh, dtype="bf16", space=search_space(), cost=cost, margin=0.0)
    except MemoryLimitError as exc:
        # nothing in the auto space fits: the grid (a subset of it) cannot fit either
        ranked = [r for r in grid(graph, mesh, cost) if not r[1]]
        return dict(model=name, hardware=hardware, gpus=gpus, nofit=True,
                    plan_s=round(time.perf_counter() - start, 2), grid_fits=len(ranked),
                    why=f"nothing fits: {exc}"[:200])
    auto_s = time.perf_counter() - start
    ranked = [r for r in grid(graph, mesh, cost) if not r[1]][:3]
    best = None
    for _, _, cfg in ranked:
        plan = build_manual_plan(graph, mesh, dtype="bf16", **cfg)
        if plan.predicted.fits and (best is None or plan.predicted.step_time_s
                                    < best[0].predicted.step_time_s):
            best = (plan, cfg)
    row = dict(model=name, hardware=hardware, gpus=gpus, plan_s=round(auto_s, 2),
               auto_step_s=auto.predicted.step_time_s, auto_mfu=auto.predicted.mfu,
               auto=describe(auto), auto_probe_step_s=auto.solver.objective_s)
    if best is None:
        row.update(grid_step_s=None, ratio=None, grid="nothing fits")
    else:
        plan, cfg = best
        row.update(grid_step_s=plan.predicted.step_time_s, grid_mfu=plan.predicted.mfu,
                   grid=", ".join(f"{k}={v}" for k, v in cfg.items()),
                   ratio=plan.predicted.step_time_s / auto.predicted.step_time_s,
                   why=why(auto, cfg))
    return row


def why(auto, cfg) -> str:
    """What the auto plan does that the best grid plan does not."""
    st, t = auto.stages, auto.training
    out = []
    sizes = [s.layers[1] - s.layers[0] for s in st]
    if len(set(sizes)) > 1:
        out.append(f"non-uniform blocks {'/'.join(map(str, sizes))}")
    if len({(s.recompute, s.zero) for s in st}) > 1:
        out.append("per-stage recompute/ZeRO")
    if auto.solver.name != "meshplan-inter":
        out.append(f"intra-op ILP placements ({auto.solver.name}) on mesh "
                   f"{tuple(st[0].mesh_shape)}")
    elif (*st[0].mesh_shape, len(st)) != (cfg["dp"], cfg["tp"], cfg["pp"]):
        out.append("dp,tp,pp={},{},{}".format(*st[0].mesh_shape, len(st)))
    if (t.schedule, t.virtual_stages) != (cfg["schedule"], cfg["virtual_stages"]):
        out.append(f"{t.schedule} v={t.virtual_stages}")
    if t.microbatch_size != cfg["microbatch_size"]:
        out.append(f"mb={t.microbatch_size}")
    if st[0].recompute != cfg["recompute"] or st[0].zero != cfg["zero"]:
        out.append(f"recompute={st[0].recompute} zero={st[0].zero}")
    return "; ".join(out) or "same plan"


def describe(plan) -> str:
    t = plan.training
    st = plan.stages
    layers = "/".join(str(s.layers[1] - s.layers[0]) for s in st)
    per_stage = sorted({(s.recompute, s.zero) for s in st})
    return (f"pp={len(st)} mesh={tuple(st[0].mesh_shape)} mb={t.microbatch_size}x{t.microbatches} "
            f"{t.schedule}{'/v' + str(t.virtual_stages) if t.virtual_stages > 1 else ''} "
            f"sp={int(t.sequence_parallel)} blocks={layers} rc/zero={per_stage}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--hardware", default=",".join(HARDWARE))
    ap.add_argument("--gpus", default=",".join(map(str, GPUS)))
    ap.add_argument("--timing-only", action="store_true",
                    help="only the planning time of GPT-3 175B on 1,024 GPUs")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the table from benchmarks/results/plan_quality.json")
    args = ap.parse_args(argv)
    rows, timing = [], None
    if args.render_only:
        write([], None)
        return 0
    if args.timing_only:
        graph, _ = traced("gpt3-175b")
        mesh = mesh_for("dgx-a100-80gb", 1024)
        start = time.perf_counter()
        plan = plan_auto(graph, mesh, dtype="bf16", space=search_space())
        timing = dict(seconds=time.perf_counter() - start, plan=describe(plan),
                      step_s=plan.predicted.step_time_s, mfu=plan.predicted.mfu)
        print(f"GPT-3 175B on 1024 x A100: planned in {timing['seconds']:.1f} s -> "
              f"{timing['plan']}, step {timing['step_s']:.2f} s, MFU {timing['mfu']:.1%}")
    else:
        for name in args.models.split(","):
            try:
                graph, trace_s = traced(name)
            except Exception as exc:  # report the family that cannot be traced, then go on
                print(f"{name}: tracing failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(dict(model=name, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                continue
            print(f"{name}: traced in {trace_s:.1f} s ({len(graph.nodes)} operators)", flush=True)
            for hardware in args.hardware.split(","):
                for gpus in map(int, args.gpus.split(",")):
                    row = cell(name, graph, hardware, gpus)
                    rows.append(row)
                    print(_line(row), flush=True)
                    write(rows, timing, quiet=True)  # keep what is done if interrupted
    write(rows, timing)
    return 0


def _line(r) -> str:
    if r.get("nofit"):
        return (f"| {r['model']} | {r['hardware']} | {r['gpus']} | - | - | - | {r['plan_s']:.1f} "
                f"| nothing fits | grid plans that fit: {r['grid_fits']} | {r['why']} |")
    if r.get("error"):
        return f"| {r['model']} | - | - | - | - | - | - | tracing failed: {r['error']} | - | - |"
    ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
    grid = f"{r['grid_step_s']:.3f}" if r.get("grid_step_s") else "-"
    return (f"| {r['model']} | {r['hardware']} | {r['gpus']} | {r['auto_step_s']:.3f} | {grid} "
            f"| {ratio} | {r['plan_s']:.1f} | {r['auto']} | {r['grid']} | {r.get('why', '')} |")


def _merged(path: str, rows: list) -> list:
    """Rows of earlier runs (other models or meshes) kept, this run's replacing equal cells."""
    def key(r):
        return (r.get("model"), r.get("hardware"), r.get("gpus"))
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("rows", [])
    new = {key(r) for r in rows}
    merged = [r for r in old if key(r) not in new] + list(rows)
    order = {m: i for i, m in enumerate(MODELS)}
    return sorted(merged, key=lambda r: (order.get(r.get("model"), 99), r.get("hardware") or "",
                                         r.get("gpus") or 0))


def write(rows, timing, quiet: bool = False) -> None:
    os.makedirs(OUT, exist_ok=True)
    name = "plan_quality_timing" if timing else "plan_quality"
    rows = _merged(os.path.join(OUT, name + ".json"), rows) if not timing else rows
    lines = [f"# {'Planning time' if timing else 'Plan quality'} (benchmarks/plan_quality.py)", ""]
    if timing:
        lines.append(f"GPT-3 175B on 1024 A100 (128 nodes x 8): {timing['seconds']:.1f} s on "
                     f"this machine -> {timing['plan']}, step {timing['step_s']:.2f} s, "
                     f"MFU {timing['mfu']:.1%}")
    else:
        ratios = [r["ratio"] for r in rows if r.get("ratio")]
        if ratios:
            lines += [f"{len(ratios)} cells: ratio min {min(ratios):.3f}, max {max(ratios):.3f}; "
                      f"{sum(r > 1.005 for r in ratios)} cells above 1.005.", ""]
        lines += ["Ratio = best Megatron-grid step time / auto step time (= throughput ratio), "
                  "both priced in full by costmodel.estimate.", "",
                  "| model | hardware | GPUs | auto step s | grid best step s | ratio | plan s "
                  "| auto plan | best grid plan | where auto differs |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_line(r) for r in rows]
    with open(os.path.join(OUT, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(dict(rows=rows, timing=timing), f, indent=1, default=str)
    if not quiet:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
