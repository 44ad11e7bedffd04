"""Published torchtitan and Megatron-LM / NeMo configurations, imported and priced beside
what ``meshplan plan --for`` picks for the same model, batch and devices; both exported.

trace -> **stacks**: for each run (Llama 3.1 8B on 8 H100s, 70B on 64, 405B on 1,024 at 8K
tokens, 405B at 131K on 16,384) and each stack, the published configuration in
``benchmarks/stack_configs/`` (each file names its source) is read with
``meshplan.import_plan`` and priced as that stack runs it; ``search_layouts`` (what
``meshplan plan --for`` runs) searches the layouts that stack accepts at the same global batch
and sequence; the chosen plan is exported with ``meshplan.export_plan`` to
``benchmarks/results/stack_exports/``. All on the ``dgx-h100`` preset. Then the mixtures of
experts (``MOE``): each exported with expert parallelism and read back.

Run: python benchmarks/stack_exports.py [--only NAME] [--target torchtitan|megatron]
[--time-limit-s 300] (each search keeps the best found after that long and says so)
Writes benchmarks/results/stack_exports.{md,json} (a partial run prints only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import meshplan
from meshplan.specs import parse_model_spec
from meshplan.stacks import layout_of
from meshplan.stacks.commands import export_plan, import_plan
from meshplan.stacks.search import search_layouts

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "stack_configs")
OUT = os.path.join(HERE, "results")
SUFFIX = {"torchtitan": ".toml", "megatron": ".txt"}  # the published configs
EXPORTED = {"torchtitan": "_config_registry.py", "megatron": ".txt"}  # torchtitan 0.3: Python
# (name, model preset, H100s, config file stem)
RUNS = (
    ("8B on 8 H100, 8K", "llama3.1-8b", 8, "llama3.1_8b_8gpu"),
    ("70B on 64 H100, 8K", "llama3.1-70b", 64, "llama3.1_70b_64gpu"),
    ("405B on 1024 H100, 8K", "llama3.1-405b", 1024, "llama3.1_405b_1024gpu"),
    ("405B on 16384 H100, 131K", "llama3.1-405b", 16384, "llama3.1_405b_131k_16384gpu"),
)


def _row(name: str, target: str, spec: str, gpus: int, stem: str,
         time_limit_s: float | None) -> dict | None:
    path = os.path.join(CONFIGS, target, stem + SUFFIX[target])
    if not os.path.exists(path):
        return None
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=gpus // 8)
    start = time.perf_counter()
    theirs = import_plan(path, target, mesh, model_spec=spec)
    imported_s = time.perf_counter() - start
    start = time.perf_counter()
    model = parse_model_spec(spec).build(device="meta")
    dtype, note = theirs.training.dtype, ""
    if target == "torchtitan" and dtype == "fp8":
        # torchtitan 0.3.0 runs rowwise fp8 only (stacks/torchtitan.py FP8_PROBLEM): the
        # published tensorwise-fp8 run is priced as it ran, meshplan's pick searched in bf16
        dtype, note = "bf16", "searched in bf16: torchtitan 0.3.0 has no tensorwise fp8"
    ours, priced = search_layouts(model, mesh, target, graph=theirs.graph, dtype=dtype,
                                  compiled=theirs.training.compiled,
                                  time_limit_s=time_limit_s)
    search_s = time.perf_counter() - start
    ours = ours.with_spec(spec)
    out_dir = os.path.join(OUT, "stack_exports")
    os.makedirs(out_dir, exist_ok=True)
    exported = os.path.join(out_dir, f"{stem}.meshplan{EXPORTED[target]}")
    with open(exported, "w") as f:
        f.write(export_plan(ours, target, graph=theirs.graph))
    a, b = theirs.predicted, ours.predicted
    return {"run": name, "target": target, "config": os.path.relpath(path, os.path.dirname(HERE)),
            "published_layout": layout_of(theirs, compiled=theirs.training.compiled).words(),
            "published_step_s": round(a.step_time_s, 3), "published_mfu": round(a.mfu, 4),
            "published_peak_gib": round(a.peak_memory_gib, 1), "published_fits": a.fits,
            "meshplan_layout": layout_of(ours, compiled=ours.training.compiled).words(),
            "meshplan_step_s": round(b.step_time_s, 3), "meshplan_mfu": round(b.mfu, 4),
            "meshplan_peak_gib": round(b.peak_memory_gib, 1), "meshplan_fits": b.fits,
            "speedup": round(a.step_time_s / b.step_time_s, 3), "note": note,
            "search_status": ours.solver.status, "search_s": round(search_s, 1),
            "import_s": round(imported_s, 1),
            "exported": os.path.relpath(exported, os.path.dirname(HERE))}


# Mixtures of experts (issue 39): no published configuration to import here, so each MoE
# preset is written in a layout of the published runs' shape with expert parallelism, for
# every stack that runs it, and read back. torchtitan 0.3.0 builds DeepSeek-V3 671B with
# RMSNorm eps 1e-5 (its flavor table) and ships no Mixtral: that row is the refusal line.
MOE = (
    ("Mixtral 8x7B on 64 H100", "mixtral-8x7b", {}, dict(
        dp=8, tp=2, pp=4, ep=8, global_batch=256, seq_len=4096, sequence_parallel=True,
        recompute="selective")),
    ("Qwen3-30B-A3B on 16 H100", "qwen3-30b-a3b", {}, dict(
        dp=16, ep=8, global_batch=64, seq_len=4096, microbatch_size=4, recompute="full")),
    ("DeepSeek-V3 671B on 1024 H100", "deepseek-v3", {"norm_eps": 1e-5}, dict(
        dp=64, pp=16, ep=64, global_batch=1024, seq_len=4096, recompute="selective",
        schedule="interleaved-1f1b", virtual_stages=2)),
)
ZERO = {"megatron": 1, "torchtitan": 3}  # each stack's own sharding of optimizer state


def _moe_rows() -> list[dict]:
    """Each MoE layout exported (to_megatron / to_torchtitan), written to stack_exports/ and
    read back (from_megatron / from_torchtitan): the layout, ep included, must come back."""
    from dataclasses import replace

    from meshplan.stacks import StackLayout, arch_of_spec
    from meshplan.stacks import megatron as mg
    from meshplan.stacks import torchtitan as tt

    rows = []
    out_dir = os.path.join(OUT, "stack_exports")
    for name, preset, arch_kw, kw in MOE:
        arch = replace(arch_of_spec(preset), **arch_kw)
        for target, mod in (("megatron", mg), ("torchtitan", tt)):
            layout = StackLayout(zero=ZERO[target], **kw)
            if target == "megatron" and layout.tp > 1:
                layout = replace(layout, sequence_parallel=True)
            why = (tt.flavor_problem(arch) if target == "torchtitan" else None) or \
                next(iter(mod.problems(layout, arch)), None)
            row = {"run": name, "target": target, "model": arch.spec(),
                   "layout": layout.words()}
            if why:
                rows.append(dict(row, refused=why))
                continue
            text = mg.to_megatron(layout, arch) if target == "megatron" else \
                tt.to_torchtitan(layout, arch, package="meshplan_job")
            stem = preset.replace(".", "_") + f"_{layout.devices}gpu"
            path = os.path.join(out_dir, f"moe_{stem}.meshplan{EXPORTED[target]}")
            with open(path, "w") as f:
                f.write(text)
            back, _ = (mg.from_megatron(text) if target == "megatron" else
                       tt.from_torchtitan(text, devices=layout.devices))
            rows.append(dict(row, exported=os.path.relpath(path, os.path.dirname(HERE)),
                             read_back=back == layout))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="runs whose name contains this")
    ap.add_argument("--target", choices=("torchtitan", "megatron"), default=None)
    ap.add_argument("--time-limit-s", type=float, default=300.0, help="each search keeps the "
                    "best found after this long (its status says how many it left unpriced)")
    ap.add_argument("--rows-from", default="", help="a log of an earlier run of this script "
                    "(its JSON lines): runs found there are taken from it, not recomputed")
    args = ap.parse_args()
    done = {}
    if args.rows_from:
        with open(args.rows_from) as f:
            for line in f:
                if line.startswith('{"run"'):
                    row = json.loads(line)
                    done[(row["run"], row["target"])] = row
    torch.set_num_threads(1)
    rows = []
    for name, spec, gpus, stem in RUNS:
        if args.only and args.only not in name:
            continue
        for target in ("torchtitan", "megatron"):
            if args.target and target != args.target:
                continue
            row = done.get((name, target)) or _row(name, target, spec, gpus, stem,
                                                   args.time_limit_s)
            if row is None:
                print(f"{name} / {target}: no published configuration in {CONFIGS}")
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| run | stack | published configuration | step s | MFU | GiB | meshplan plan --for | "
             "step s | MFU | GiB | published / meshplan time | search s | note |",
             "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fit = "" if r["published_fits"] else " (does not fit)"
        lines.append(f"| {r['run']} | {r['target']} | {r['published_layout']} | "
                     f"{r['published_step_s']} | {r['published_mfu'] * 100:.1f}% | "
                     f"{r['published_peak_gib']}{fit} | {r['meshplan_layout']} | "
                     f"{r['meshplan_step_s']} | {r['meshplan_mfu'] * 100:.1f}% | "
                     f"{r['meshplan_peak_gib']} | {r['speedup']:.3f} | {r['search_s']} |"
                     + (f" {r['note']} |" if r.get("note") else " |"))
    text = ("# Published stack configurations vs meshplan plan --for\n\n"
            "Each published configuration (benchmarks/stack_configs/, sources in each file) "
            "imported with `meshplan.import_plan` and priced as that stack runs it; beside it "
            "the layout `meshplan plan --for` picks at the same model, global batch, sequence "
            "and devices, exported to benchmarks/results/stack_exports/. dgx-h100 preset "
            "(80 GB). Search seconds on this 2-core machine.\n\n" + "\n".join(lines) +
            "\n\nReproduce: `python benchmarks/stack_exports.py`.\n")
    moe = [] if args.only or args.target else _moe_rows()
    if moe:
        text = text.replace("\n\nReproduce:", "\n\n## Mixtures of experts: exported and read "
                            "back\n\nEach MoE preset in a layout with expert parallelism "
                            "(ep ranks borrowed from dp x cp x tp), written for each stack and "
                            "read back; tests/test_stacks_megatron.py and tests/"
                            "test_stacks_torchtitan.py check the same layouts with megatron-"
                            "core 0.16.1's config classes and torchtitan 0.3.0's ConfigManager."
                            "\n\n| model | stack | layout | export | read back |\n|---|---|---|"
                            "---|---|\n" + "\n".join(
                                f"| {r['run']} | {r['target']} | {r['layout']} | "
                                + (f"`{r['exported']}` | {'same layout' if r['read_back'] else 'DIFFERS'} |"
                                   if "exported" in r else f"refused: {r['refused']} | |")
                                for r in moe) + "\n\nReproduce:")
    print("\n" + text)
    if args.only or args.target:
        return 0
    with open(os.path.join(OUT, "stack_exports.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "stack_exports.json"), "w") as f:
        json.dump({"rows": rows, "moe": moe}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
