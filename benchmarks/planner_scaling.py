"""How long the intra-op planner takes: against layers, against mesh size, at GPT-3 scale.

trace -> cost -> **solve**: every case is traced once on the meta device (tracing time is
reported in its own column, it is not planning time), then planned as one SPMD stage with
``planner/singlestage.plan_single_stage`` (strategies, pricing, ILP, the cost model's
estimate of the chosen plan). Columns: ``build_s`` (groups, candidates and edges priced),
``ilp_s`` (the solver alone), ``plan_s`` (everything a user waits for after tracing).

Cases:
- layers: GPT-style (GPT-3 1.3B widths: hidden 2048, 16 heads, vocab 51,200, seq 2048) with
  1 to 96 layers on an 8x8 DGX A100 mesh, global batch 64;
- mesh: the same model with 24 layers on 8 to 1,024 A100s (1 to 128 nodes of 8), one sequence
  per device;
- targets: GPT-3 175B on 8x8 (batch 8, seq 2048) and Llama-2-7B on 8 devices (batch 8,
  seq 4096);
- backends: the same two stages solved by CBC, HiGHS, SCIP and CP-SAT (``--backends``).

Run: python benchmarks/planner_scaling.py [--quick] [--backends cbc,highs,scip,cp-sat]
Writes benchmarks/results/planner_scaling.{md,json,png}.

``--hybrid``: the whole ``meshplan.autoparallel`` (pipeline search, single-stage ILP,
simplest plan within the error band, engine choice) on the three targets of issue 27, each
traced then planned ``--repeat`` times: GPT-3 175B on 1,024 A100s (batch 1536, seq 2048),
Llama-3-8B on 64 H100s (batch 16, seq 8192: meta's autoparallel example_llama3.py), Llama 3
405B at 131,072 tokens on 16,384 H100s with cp in {1, 2, 4, 8, 16} (batch 128). Appends one
row per run to the history table in benchmarks/results/planner_scaling.md (date, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import meshplan
from meshplan.planner import ilp
from meshplan.planner.intra import StageOptions, build_problem, to_ilp
from meshplan.planner.singlestage import plan_single_stage
from meshplan.tracing import trace
from meshplan.specs import example_inputs, parse_model_spec

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# GPT-3 1.3B (Brown et al. 2020, Table 2.1): hidden 2048, 16 heads; vocab and seq as Megatron
GPT_SMALL = "transformers:gpt2?n_layer={}&n_embd=2048&n_head=16&vocab_size=51200&n_positions=2048"


def _trace(spec: str, batch: int, seq: int):
    model = parse_model_spec(spec).build("meta")
    start = time.perf_counter()
    graph = trace(model, example_inputs(model, batch, seq), model_name=spec)
    return graph, time.perf_counter() - start


def _mesh(devices: int):
    return meshplan.Mesh.preset("dgx-a100-80gb", nodes=max(1, devices // 8))


def _plan(case: str, graph, mesh, trace_s: float, *, recompute: str = "none",
          backend: str = "cbc") -> dict:
    names = tuple(n.name for n in graph.nodes)
    opts = StageOptions(dtype="bf16", recompute=recompute, backend=backend)
    t0 = time.perf_counter()
    problem = build_problem(graph, names, mesh.shape, mesh.hardware, opts,
                            devices_per_node=mesh.devices_per_node)
    t1 = time.perf_counter()
    ip = to_ilp(problem)
    result = ilp.solve(ip, backend=backend, time_limit_s=120, hint=ilp.greedy(ip))
    t2 = time.perf_counter()
    row = dict(case=case, model=graph.model_name, nodes=len(graph.nodes), layers=graph.num_layers,
               mesh="x".join(map(str, mesh.shape)), devices=mesh.num_devices, backend=backend,
               groups=len(problem.groups), candidates=sum(len(g.candidates) for g in problem.groups),
               edges=len(problem.edges), trace_s=round(trace_s, 3), build_s=round(t1 - t0, 3),
               ilp_s=round(t2 - t1, 3), status=result.status)
    if backend == "cbc":
        t3 = time.perf_counter()
        try:
            plan = plan_single_stage(graph, mesh, dtype="bf16", recompute=recompute,
                                     backend=backend)
            row.update(plan_s=round(time.perf_counter() - t3, 3),
                       step_s=round(plan.predicted.step_time_s, 4),
                       memory_gib=round(plan.predicted.peak_memory_gib, 2),
                       zero=plan.stages[0].zero)
        except meshplan.errors.MemoryLimitError as exc:
            row.update(plan_s=round(time.perf_counter() - t3, 3), status="does not fit",
                       memory_gib=round(exc.min_memory_gib, 2))
    return row


def run(quick: bool, backends: list[str]) -> list[dict]:
    rows = []
    layer_counts = (1, 2, 8, 24) if quick else (1, 2, 4, 8, 16, 32, 64, 96)
    for layers in layer_counts:
        graph, ts = _trace(GPT_SMALL.format(layers), 64, 2048)
        rows.append(_plan("layers", graph, _mesh(64), ts))
        _print(rows[-1])
    for devices in ((8, 64, 256) if quick else (8, 16, 32, 64, 128, 256, 512, 1024)):
        graph, ts = _trace(GPT_SMALL.format(24), devices, 2048)
        rows.append(_plan("mesh", graph, _mesh(devices), ts))
        _print(rows[-1])
    targets = [("gpt3-175b", 64, 8, 2048), ("llama2-7b", 8, 8, 4096)]
    for spec, devices, batch, seq in targets:
        graph, ts = _trace(spec, batch, seq)
        for backend in backends:
            rows.append(_plan("target", graph, _mesh(devices), ts, backend=backend))
            _print(rows[-1])
    return rows


_COLS = ("case", "model", "nodes", "mesh", "backend", "groups", "candidates", "edges", "trace_s",
         "build_s", "ilp_s", "plan_s", "status", "step_s", "memory_gib")


def _print(row: dict) -> None:
    print("  ".join(f"{row.get(c, '')}" for c in _COLS), flush=True)


def _markdown(rows: list[dict]) -> str:
    lines = ["# Intra-op planner scaling", "",
             "Generated by `python benchmarks/planner_scaling.py` on this 2-core machine "
             "(the machine is shared; times are wall-clock). `trace_s` is tracing on meta "
             "(not planning); `plan_s` is everything after tracing (strategies, pricing, ILP, "
             "the cost model's estimate); `ilp_s` the solver alone.", "",
             "| " + " | ".join(_COLS) + " |", "|" + "---|" * len(_COLS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in _COLS) + " |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    lay = [r for r in rows if r["case"] == "layers"]
    mesh = [r for r in rows if r["case"] == "mesh"]
    a.plot([r["layers"] for r in lay], [r.get("plan_s", 0) for r in lay], "o-", label="plan")
    a.plot([r["layers"] for r in lay], [r["ilp_s"] for r in lay], "s--", label="ILP only")
    a.set_xscale("log", base=2)
    a.set_xlabel("layers (GPT, hidden 2048, 8x8 A100)")
    a.set_ylabel("seconds")
    a.legend()
    b.plot([r["devices"] for r in mesh], [r.get("plan_s", 0) for r in mesh], "o-", label="plan")
    b.plot([r["devices"] for r in mesh], [r["ilp_s"] for r in mesh], "s--", label="ILP only")
    b.set_xscale("log", base=2)
    b.set_xlabel("devices (GPT 24 layers, 1 sequence per device)")
    b.legend()
    fig.suptitle("meshplan intra-op planning time (after tracing)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


LLAMA3_8B = ("transformers:llama?hidden_size=4096&intermediate_size=14336&num_hidden_layers=32"
             "&num_attention_heads=32&num_key_value_heads=8&vocab_size=128256"
             "&max_position_embeddings=131072")
LLAMA3_405B = ("transformers:llama?hidden_size=16384&intermediate_size=53248"
               "&num_hidden_layers=126&num_attention_heads=128&num_key_value_heads=8"
               "&vocab_size=128256&max_position_embeddings=131072")
HYBRID = (("gpt3-175b / 1024 A100", "gpt3-175b", "dgx-a100-80gb:nodes=128", 1536, 2048, (1,)),
          ("llama3-8b / 64 H100", LLAMA3_8B, "dgx-h100:nodes=8", 16, 8192, (1,)),
          ("llama3-405b 131K / 16384 H100, cp", LLAMA3_405B, "dgx-h100:nodes=2048", 128, 131072,
           (1, 2, 4, 8, 16)))
HISTORY = "## History: `meshplan.autoparallel` on the issue 27 targets (`--hybrid`)"
HISTORY_COLS = ("date", "commit", "case", "trace_s", "plan_s", "layout", "step_s", "mfu")


def hybrid(repeat: int) -> list[dict]:
    import subprocess

    from meshplan.planner.simplest import describe
    from meshplan.specs import parse_mesh_spec

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(OUT)).stdout.strip() or "?"
    rows = []
    for case, spec, mesh_spec, batch, seq, cps in HYBRID:
        mesh = parse_mesh_spec(mesh_spec)
        for _ in range(repeat):
            graph, trace_s = _trace(spec, batch, seq)
            model = parse_model_spec(spec).build("meta")
            start = time.perf_counter()
            plan = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16",
                                         context_parallel=cps)
            rows.append(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                             commit=commit, case=case, trace_s=round(trace_s, 1),
                             plan_s=round(time.perf_counter() - start, 1),
                             layout=describe(plan) + f" ({plan.engine})",
                             step_s=round(plan.predicted.step_time_s, 3),
                             mfu=f"{plan.predicted.mfu:.1%}"))
            print("  ".join(str(rows[-1][c]) for c in HISTORY_COLS), flush=True)
    return rows


def append_history(rows: list[dict]) -> None:
    path = os.path.join(OUT, "planner_scaling.md")
    text = open(path).read() if os.path.exists(path) else _markdown([])
    if HISTORY not in text:
        text += ("\n" + HISTORY + "\n\nWall-clock seconds on this shared 2-core machine; "
                 "`trace_s` is the export on meta, `plan_s` everything `autoparallel` does "
                 "after it.\n\n| " + " | ".join(HISTORY_COLS) + " |\n|" + "---|" * len(HISTORY_COLS)
                 + "\n")
    text = text.rstrip("\n") + "\n" + "".join(
        "| " + " | ".join(str(r[c]) for c in HISTORY_COLS) + " |\n" for r in rows)
    with open(path, "w") as f:
        f.write(text)


def _history_of(path: str) -> str:
    """The history section of an existing table, kept when the scaling rows are rewritten."""
    if not os.path.exists(path):
        return ""
    text = open(path).read()
    return text[text.index(HISTORY):] if HISTORY in text else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer layer counts and meshes")
    ap.add_argument("--backends", default="cbc", help="comma-separated: cbc,highs,scip,cp-sat")
    ap.add_argument("--hybrid", action="store_true",
                    help="time autoparallel on the issue 27 targets; append to the history")
    ap.add_argument("--repeat", type=int, default=2, help="runs per --hybrid target")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.hybrid:
        import torch

        torch.set_num_threads(1)
        append_history(hybrid(args.repeat))
        return 0
    print("  ".join(_COLS))
    rows = run(args.quick, args.backends.split(","))
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "planner_scaling.json"), "w") as f:
        json.dump(rows, f, indent=1)
    path = os.path.join(OUT, "planner_scaling.md")
    history = _history_of(path)
    with open(path, "w") as f:
        f.write(_markdown(rows) + ("\n" + history if history else ""))
    _plot(rows, os.path.join(OUT, "planner_scaling.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
