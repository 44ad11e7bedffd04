"""Issue 41's "Done when", checked from a checkout as a user runs it: the ``meshplan`` command
line (``--json`` documents validated against docs/cli-json.schema.json), the exports read by
torchtitan 0.3.0's own ``ConfigManager`` / ``ParallelDims`` (tests/_torchtitan_check.py) and
by megatron-core 0.16.1's config classes (tests/test_stacks_megatron.py), read back with
``meshplan estimate --from``.

Steps (``--only NAME,...``; each appends its rows to benchmarks/results/issue41_check.json,
and the .md is rewritten from every step recorded so far):

- ``moe``: ``plan --for torchtitan|megatron`` on Qwen3-30B-A3B (8 H100, 16 x 8192; and
  DeepSeek-V3 with ``--deepseek``): the layout the search picks, its time, and the fastest
  fitting ep = 1 layout it priced (the compute bound only drops layouts slower than the
  best); exported and read back.
- ``exports``: Llama 3.1 8B on 8 H100 (``plan --for``), 70B on 64 and 405B on 1,024 (their
  published layouts, ``plan --engine TARGET --manual``), each exported for both stacks,
  checked by the stacks' own code and read back to the same layout.
- ``dry_run``: torchtitan's ``Trainer`` on the fake backend (the two slow tests of
  tests/test_stacks_torchtitan.py: dense dp4 x tp2 and MoE with ep).
- ``config_json``: the published config.json of Llama 3.1 8B, Qwen3-8B and Mixtral 8x7B
  (tests/test_config_models.py) planned with ``--model path/config.json``.
- ``fit``: ``meshplan fit`` for Llama 3.1 405B and DeepSeek-V3 at 8K on H100 80 GB.
- ``json``: one ``--json`` document per command (plan, estimate, fit, show, explain, diff,
  export) on a small model, each validated against the schema.

Run: python benchmarks/issue41_check.py [--only moe,exports,...] [--deepseek]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
SCHEMA = json.loads((ROOT / "docs" / "cli-json.schema.json").read_text())
MESHPLAN = str(Path(sys.executable).parent / "meshplan")
WORKER = ROOT / "tests" / "_torchtitan_check.py"
RESULTS = OUT / "issue41_check.json"
STEPS = ("moe", "exports", "dry_run", "config_json", "fit", "json")
# Llama 3.1 published layouts (benchmarks/stack_configs/, each file names its source)
PUBLISHED = (
    ("70B on 64 H100, 8K", "llama3.1-70b", 8, 128, {
        "torchtitan": "dp=8,tp=8,mb=8,recompute=full,sp=1,zero=3",
        "megatron": "dp=2,tp=4,cp=2,pp=4,schedule=interleaved-1f1b,vs=5,mb=1,sp=1,zero=1"}),
    ("405B on 1024 H100, 8K", "llama3.1-405b", 128, 2048, {
        "torchtitan": "dp=16,tp=8,pp=8,schedule=interleaved-1f1b,vs=2,mb=1,recompute=full,"
                      "sp=1,zero=2",
        "megatron": "dp=8,tp=8,cp=2,pp=8,schedule=interleaved-1f1b,vs=8,mb=1,sp=1,zero=1"}),
)
TINY = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=6"
        "&num_attention_heads=16&num_key_value_heads=16&vocab_size=2048"
        "&max_position_embeddings=131072&rope_theta=500000&rms_norm_eps=1e-05")


def cli(*args: str, json_doc: bool = True, timeout: int = 3600) -> tuple[dict | str, float]:
    """``meshplan ARGS [--json]``: (the one JSON document, validated; or stdout), wall s."""
    argv = [MESHPLAN, *args] + (["--json"] if json_doc else [])
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - start
    if not json_doc:
        if proc.returncode:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stderr[-2000:]}")
        return proc.stdout, wall
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"{' '.join(argv)}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    doc = json.loads(lines[0])
    jsonschema.validate(doc, SCHEMA)
    if not doc["ok"]:
        raise RuntimeError(f"{' '.join(args)}: {doc['error']}")
    return doc, wall


def record(step: str, rows: list[dict]) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[step] = {"rows": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULTS.write_text(json.dumps(data, indent=1))
    write_md(data)


def export_and_back(plan_file: str, target: str, mesh: str, tmp: Path) -> dict:
    """``export --to TARGET`` then ``estimate --from TARGET`` (import, priced): layouts."""
    stem = "job_" + re.sub(r"\W", "_", Path(plan_file).stem)  # torchtitan: a package name
    out = tmp / (stem + ("_pkg" if target == "torchtitan" else ".txt"))
    doc, _ = cli("export", plan_file, "--to", target, "-o", str(out))
    back, _ = cli("estimate", "--from", target, str(out), "--mesh", mesh)
    got = back["result"]["from"]
    return {"exported": doc["result"]["layout"], "export_path": str(out),
            "read_back": got.get("layout"), "same": got.get("layout") == doc["result"]["layout"]}


def torchtitan_accepts(packages: list[tuple[str, int]], tmp: Path) -> dict[str, dict]:
    """torchtitan 0.3.0's ConfigManager (registry and command line), ParallelDims and its
    mesh on the fake process group, per exported package (tests/_torchtitan_check.py)."""
    from meshplan.stacks import torchtitan as tt

    jobs = []
    for path, world in packages:
        pkg = Path(path)
        layout, arch = tt.from_torchtitan((pkg / "config_registry.py").read_text(),
                                          devices=world)
        name = re.sub(r"\W", "_", pkg.name)  # an importable module name
        target = tmp / "tt_jobs" / name
        target.mkdir(parents=True, exist_ok=True)
        for f in pkg.iterdir():
            (target / f.name).write_text(f.read_text())
        jobs.append({"package": name, "function": tt.function_name(arch), "world": world,
                     "command": tt.torchtitan_command(layout, arch, package=name)})
    path = tmp / "tt_jobs" / "jobs.json"
    path.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(WORKER), "mesh", str(path)], capture_output=True,
                          text=True, timeout=3600, cwd=path.parent,
                          env=dict(os.environ, OMP_NUM_THREADS="1", TT_DUMP=str(tmp / "dump")))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    out = {}
    for job, line in zip(jobs, lines):
        got = json.loads(line[len("RESULT "):])
        out[job["package"]] = {"accepted": not got.get("command_differs"),
                               "meshes": got["meshes"], "command_differs":
                                   got.get("command_differs")}
    for job in jobs[len(lines):]:
        out[job["package"]] = {"accepted": False, "error": proc.stderr[-1500:]}
    return out


def megatron_accepts(path: str) -> dict:
    """megatron-core 0.16.1's TransformerConfig / DistributedDataParallelConfig /
    OptimizerConfig built from the exported arguments (tests/test_stacks_megatron.py)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_stacks_megatron import megatron_configs

        cfgs = megatron_configs(Path(path).read_text())
        return {"accepted": True, "classes": sorted({type(c).__name__ for c in
                                                     (cfgs if isinstance(cfgs, tuple) else
                                                      (cfgs,))})}
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return {"accepted": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def step_moe(tmp: Path, deepseek: bool) -> list[dict]:
    import torch

    import meshplan
    from meshplan.specs import parse_model_spec
    from meshplan.stacks import layout_of
    from meshplan.stacks.search import search_layouts

    runs = [("qwen3-30b-a3b", 1, 16, 8192)]
    if deepseek:
        runs.append(("deepseek-v3", 128, 1024, 4096))
    rows = []
    for spec, nodes, batch, seq in runs:
        model = parse_model_spec(spec).build(device="meta")
        ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
        graph = meshplan.trace(model, (ids,), model_name=spec)
        mesh = meshplan.Mesh.preset("dgx-h100", nodes=nodes)
        for target in ("torchtitan", "megatron"):
            start, cpu = time.perf_counter(), time.process_time()
            plan, priced = search_layouts(model, mesh, target, graph=graph)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            plan = plan.with_spec(spec)
            f = tmp / f"{spec}_{target}.json"
            plan.to_json(f)
            ep1 = [p for p in priced if p.fits and p.layout.ep == 1]
            best1 = min(ep1, key=lambda p: p.step_time_s) if ep1 else None
            row = {"model": spec, "devices": mesh.num_devices, "batch": batch, "seq": seq,
                   "target": target, "layout": layout_of(plan).words(),
                   "step_s": plan.predicted.step_time_s,
                   "peak_gib": plan.predicted.peak_memory_gib,
                   "best_ep1": best1.layout.words() if best1 else None,
                   "best_ep1_step_s": best1.step_time_s if best1 else None,
                   "search_wall_s": wall, "search_cpu_s": cpu, "status": plan.solver.status}
            row.update(export_and_back(str(f), target, f"dgx-h100:nodes={nodes}", tmp))
            text = Path(row["export_path"]) / "config_registry.py" \
                if target == "torchtitan" else Path(row["export_path"])
            key = "expert_parallel_degree" if target == "torchtitan" else \
                "--expert-model-parallel-size"
            row["ep_line"] = next((ln.strip() for ln in text.read_text().splitlines()
                                   if key in ln), None)
            if target == "torchtitan":
                row["accepted_by"] = torchtitan_accepts([(row["export_path"],
                                                          mesh.num_devices)], tmp)
            else:
                row["accepted_by"] = megatron_accepts(row["export_path"])
            rows.append(row)
            print(row, flush=True)
    return rows


def step_exports(tmp: Path) -> list[dict]:
    rows, packages = [], []
    for target in ("torchtitan", "megatron"):
        f = tmp / f"8b_{target}.json"
        doc, wall = cli("plan", "--model", "llama3.1-8b", "--mesh", "dgx-h100:nodes=1",
                        "--batch", "16", "--seq", "8192", "--for", target, "-o", str(f))
        rows.append({"run": "8B on 8 H100, 8K", "target": target, "how": "plan --for",
                     "plan_wall_s": wall, "mesh": "dgx-h100:nodes=1", "plan": str(f),
                     "step_s": doc["result"]["summary"]["predicted"]["step_time_s"]})
    for name, spec, nodes, batch, manual in PUBLISHED:
        for target in ("torchtitan", "megatron"):
            f = tmp / f"{spec}_{target}.json"
            doc, wall = cli("plan", "--model", spec, "--mesh", f"dgx-h100:nodes={nodes}",
                            "--batch", str(batch), "--seq", "8192", "--engine", target,
                            "--manual", manual[target], "-o", str(f))
            rows.append({"run": name, "target": target, "how": f"--manual {manual[target]}",
                         "plan_wall_s": wall, "mesh": f"dgx-h100:nodes={nodes}",
                         "plan": str(f),
                         "step_s": doc["result"]["summary"]["predicted"]["step_time_s"]})
    for row in rows:
        row.update(export_and_back(row["plan"], row["target"], row["mesh"], tmp))
        if row["target"] == "megatron":
            row["accepted_by"] = megatron_accepts(row["export_path"])
        else:
            packages.append((row["export_path"], int(row["mesh"].split("=")[1]) * 8))
        print(row, flush=True)
    got = torchtitan_accepts(packages, tmp)
    for row in rows:
        if row["target"] == "torchtitan":
            row["accepted_by"] = got[re.sub(r"\W", "_", Path(row["export_path"]).name)]
    return rows


def step_dry_run(tmp: Path) -> list[dict]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_stacks_torchtitan.py", "-k",
                           "test_torchtitan_trainer_dry_run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return [{"command": "pytest tests/test_stacks_torchtitan.py -k "
                        "test_torchtitan_trainer_dry_run", "rc": proc.returncode,
             "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
             "wall_s": time.perf_counter() - start}]


def step_config_json(tmp: Path) -> list[dict]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_config_models import LLAMA31_8B, MIXTRAL_8X7B, QWEN3_8B

    rows = []
    for name, cfg, target, nodes, batch in (
            ("Llama-3.1-8B", LLAMA31_8B, "torchtitan", 1, 16),
            # torchtitan 0.3.0 has no qwen3 8B config function (plan --for torchtitan says so)
            ("Qwen3-8B", QWEN3_8B, "megatron", 1, 16),
            ("Mixtral-8x7B-v0.1", MIXTRAL_8X7B, "megatron", 8, 256)):
        folder = tmp / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        f = tmp / f"{name}.json"
        doc, wall = cli("plan", "--model", str(folder / "config.json"), "--mesh",
                        f"dgx-h100:nodes={nodes}", "--batch", str(batch), "--seq", "4096",
                        "--for", target, "--time-limit-s", "60", "-o", str(f))
        plan = doc["result"]["plan"]
        s = doc["result"]["summary"]
        rows.append({"config": f"{name}/config.json", "target": target,
                     "devices": nodes * 8, "parameters": s["model"]["parameters"],
                     "layout": s["layout"], "step_s": s["predicted"]["step_time_s"],
                     "config_sha256": plan["model"].get("spec_sha256", ""),
                     "spec": plan["model"].get("spec"), "wall_s": wall})
        print(rows[-1], flush=True)
    return rows


def step_fit(tmp: Path) -> list[dict]:
    rows = []
    for spec, batch in (("llama3.1-405b", 2048), ("deepseek-v3", 1024)):
        doc, wall = cli("fit", "--model", spec, "--gpu", "h100", "--batch", str(batch),
                        "--seq", "8192", "--mesh", "dgx-h100:nodes=128", timeout=7200)
        r = doc["result"]
        rows.append({"model": spec, "batch": batch, "seq": 8192, "wall_s": wall,
                     "smallest_nodes": r.get("smallest_nodes"),
                     "smallest": (r.get("smallest") or {}).get("layout"),
                     "smallest_peak_gib": (r.get("smallest") or {}).get("peak_memory_gib"),
                     "fastest": [(x["layout"], x["step_time_s"], x["peak_memory_gib"])
                                 for x in r.get("fastest", [])]})
        print(rows[-1], flush=True)
    return rows


def step_json(tmp: Path) -> list[dict]:
    a, b = tmp / "a.json", tmp / "b.json"
    base = ["--model", TINY, "--mesh", "dgx-h100:nodes=1", "--batch", "16", "--seq", "8192"]
    runs = [("plan", ["plan", *base, "--manual", "dp=8,zero=3", "--engine", "torchtitan",
                      "-o", str(a)]),
            ("plan", ["plan", *base, "--manual", "dp=4,tp=2,sp=1,zero=3", "--engine",
                      "torchtitan", "-o", str(b)]),
            ("estimate", ["estimate", str(a)]),
            ("fit", ["fit", "--model", TINY, "--gpu", "h100", "--batch", "16", "--seq",
                     "8192"]),
            ("show", ["show", str(a)]),
            ("explain", ["explain", str(a), "--layer", "0"]),
            ("diff", ["diff", str(a), str(b)]),
            ("export", ["export", str(a), "--to", "torchtitan", "-o", "-"])]
    rows = []
    for command, argv in runs:
        doc, wall = cli(*argv)
        rows.append({"command": "meshplan " + " ".join(x if len(x) < 60 else "TINY"
                                                       for x in argv) + " --json",
                     "document": doc["command"], "ok": doc["ok"], "schema_valid": True,
                     "keys": sorted(doc["result"]), "wall_s": wall})
        print(rows[-1], flush=True)
    return rows


def write_md(data: dict) -> None:
    lines = ["# Issue 41 \"Done when\", checked from the command line",
             "",
             "Written by `benchmarks/issue41_check.py` (`--only STEP` reruns one step). Times on "
             "the shared 2-core machine (wall, with other work beside it).", ""]
    if "moe" in data:
        lines += ["## plan --for with expert parallelism", "",
                  "| model | devices | stack | layout picked | step s | fastest ep=1 priced "
                  "| step s | search wall s (cpu s) | exported line | read back same | "
                  "accepted by the stack |", "|---|---:|---|---|---:|---|---:|---:|---|---|---|"]
        for r in data["moe"]["rows"]:
            acc = r["accepted_by"]
            ok = all(v["accepted"] for v in acc.values()) if r["target"] == "torchtitan" \
                else acc["accepted"]
            found = re.search(r"(expert_parallel_degree|--expert-model-parallel-size)[ =]+\d+",
                              r["ep_line"] or "")
            r = dict(r, ep_line=found.group(0) if found else r["ep_line"])
            lines.append(f"| {r['model']} | {r['devices']} | {r['target']} | {r['layout']} | "
                         f"{r['step_s']:.3f} | {r['best_ep1'] or 'none fits'} | "
                         f"{r['best_ep1_step_s'] or 0:.3f} | {r['search_wall_s']:.0f} "
                         f"({r['search_cpu_s']:.0f}) | `{r['ep_line']}` | {r['same']} | "
                         f"{ok} |")
        lines.append("")
    if "exports" in data:
        lines += ["## Exports accepted by the stacks' own code and read back", "",
                  "torchtitan: `ConfigManager().parse_args([\"--module\", P, \"--config\", F])` "
                  "and on the `--module ... --config ...` line, `ParallelDims` and its mesh on "
                  "the fake process group; Megatron-LM: megatron-core 0.16.1's config classes. "
                  "Read back: `meshplan estimate --from TARGET FILE --mesh M --json`.", "",
                  "| run | stack | plan | exported layout | read back same | accepted |",
                  "|---|---|---|---|---|---|"]
        for r in data["exports"]["rows"]:
            lines.append(f"| {r['run']} | {r['target']} | {r['how']} ({r['plan_wall_s']:.0f} s)"
                         f" | {r['exported']} | {r['same']} | {r['accepted_by'].get('accepted')}"
                         f" |")
        lines.append("")
    if "dry_run" in data:
        lines += ["## torchtitan Trainer dry run", ""]
        for r in data["dry_run"]["rows"]:
            lines.append(f"- `{r['command']}`: rc {r['rc']}, {r['summary']} "
                         f"({r['wall_s']:.0f} s)")
        lines.append("")
    if "config_json" in data:
        lines += ["## config.json planned without a query string", "",
                  "| config.json | stack | devices | parameters | layout | step s | "
                  "recorded sha256 | wall s |", "|---|---|---:|---:|---|---:|---|---:|"]
        for r in data["config_json"]["rows"]:
            lines.append(f"| {r['config']} | {r['target']} | {r['devices']} | "
                         f"{r['parameters']:,} | {r['layout']} | {r['step_s']:.3f} | "
                         f"{r['config_sha256'][:12]} | {r['wall_s']:.0f} |")
        lines.append("")
    if "fit" in data:
        lines += ["## meshplan fit at 8K on H100 80 GB", ""]
        for r in data["fit"]["rows"]:
            fast = "; ".join(f"{x[0]} ({x[1]:.2f} s, {x[2]:.1f} GiB)" for x in r["fastest"])
            lines.append(f"- {r['model']}, batch {r['batch']}: smallest {r['smallest_nodes']} "
                         f"nodes ({r['smallest']}, {r['smallest_peak_gib']} GiB); fastest on "
                         f"128 nodes: {fast} ({r['wall_s']:.0f} s wall)")
        lines.append("")
    if "json" in data:
        lines += ["## One --json document per command, schema-checked", "",
                  "| command | ok | valid against docs/cli-json.schema.json | result keys |",
                  "|---|---|---|---|"]
        for r in data["json"]["rows"]:
            lines.append(f"| `{r['command']}` | {r['ok']} | {r['schema_valid']} | "
                         f"{', '.join(r['keys'])} |")
        lines.append("")
    (OUT / "issue41_check.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(STEPS))
    ap.add_argument("--deepseek", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="issue41_") as d:
        tmp = Path(d)
        for step in args.only.split(","):
            start = time.perf_counter()
            fn = globals()[f"step_{step}"]
            rows = fn(tmp, args.deepseek) if step == "moe" else fn(tmp)
            record(step, rows)
            print(f"{step}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
