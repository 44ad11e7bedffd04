"""The validation set by group (issue 26): published H100 runs (NeMo, torchtitan, Llama 3)
and the A100 sets beside them, each group's error, bias, memory and fit in one table.

trace -> **cost**: the rows are the other benchmarks' tables, imported, never copied:
``nemo_published.ROWS`` / ``FP8_STEP_S``, ``torchtitan_published.ROWS`` / ``COMPILED`` /
``PARALLEL_ROWS``, ``llama3_published.ROWS``, ``megatron_published.ROWS`` and
``ranking.SWEEPS`` (Korthikanti et al. Table 5). Their predictions are what those scripts
wrote to benchmarks/results/*.json with the public API (``manual_plan``, ``estimate``); this
script checks that every published row of each table has its prediction there (a missing or
stale one is an error naming the script to run) and summarises. ``--price-parallel`` also
prices torchtitan's TP / CP / PP rows (``PARALLEL_ROWS``: Float8 and torch.compile on every
one) here, with ``manual_plan(..., dtype="fp8", engine="torchtitan")`` and
``estimate(plan, compiled=True)``; the 405B pipelines at torchtitan's own defaults of the
doc's commit for what the doc leaves out (``TORCHTITAN_STAGES_PER_RANK``).

Error is the step time's, (predicted - published) / published, + where the prediction is
slower (throughputs converted: published / predicted - 1). MAPE: mean |error|; bias: mean
error; memory: predicted peak against a published figure where the source gives one; fit:
rows predicted to fit the device (every row here ran, so every one should).

Run (the group scripts first): python benchmarks/nemo_published.py; python
benchmarks/nemo_published.py --dtype fp8; python benchmarks/torchtitan_published.py; python
benchmarks/llama3_published.py; python benchmarks/megatron_published.py; python
benchmarks/ranking.py; then python benchmarks/h100_validation.py [--price-parallel].
Writes benchmarks/results/h100_validation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama3_published  # noqa: E402
import megatron_published  # noqa: E402
import nemo_published  # noqa: E402
import ranking  # noqa: E402
import torchtitan_published  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Stale(Exception):
    """A published row without its prediction in the results file."""


def _load(name: str) -> dict:
    path = os.path.join(OUT, name)
    if not os.path.exists(path):
        raise Stale(f"{path} is missing: run benchmarks/{name.split('.')[0]}.py first")
    with open(path) as f:
        return json.load(f)


def _row(error: float, fits: bool, peak: float, published_gib=None, label: str = "") -> dict:
    return {"error": error, "fits": fits, "peak_gib": peak, "published_gib": published_gib,
            "label": label}


def _find(rows, script: str, **key):
    hit = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
    if len(hit) != 1:
        raise Stale(f"{script}: no single result for {key} ({len(hit)} found): run "
                    f"benchmarks/{script}.py again")
    return hit[0]


def nemo(dtype: str) -> list[dict]:
    name = "nemo_published" + ("_fp8" if dtype == "fp8" else "")
    rows = _load(name + ".json")["rows"]
    out = []
    for model, layers, gpus, tp, pp, cp, vp, batch, step_s in nemo_published.ROWS:
        published = step_s if dtype == "bf16" else nemo_published.FP8_STEP_S[(model, gpus)]
        r = _find(rows, "nemo_published", layers=layers, gpus=gpus, global_batch=batch)
        if r["published_step_s"] != published:
            raise Stale(f"{name}.json has {r['published_step_s']} s for {model}@{gpus}, the "
                        f"table {published}: run benchmarks/nemo_published.py again")
        out.append(_row(r["predicted_step_s"] / published - 1, r["fits"], r["peak_memory_gib"],
                        label=f"{model} {layers}L @{gpus}"))
    return out


def torchtitan(hardware: str, compiled: bool) -> list[dict]:
    rows = _load("torchtitan_published.json")["rows"]
    out = []
    for hw, model, _, gpus, local, seq, rec, published, gib, _src in torchtitan_published.ROWS:
        if hw != hardware:
            continue
        if compiled:
            if (hw, gpus) not in torchtitan_published.COMPILED:
                continue
            published, gib = torchtitan_published.COMPILED[(hw, gpus)][:2]
        r = _find(rows, "torchtitan_published", model=model, gpus=gpus, recompute=rec,
                  compiled=compiled, engine="torchtitan")
        out.append(_row(published / r["predicted_tokens_per_gpu"] - 1, r["fits"],
                        r["peak_memory_gib"], gib, f"{model} {rec} AC @{gpus}"))
    return out


def llama3() -> list[dict]:
    rows = _load("llama3_published.json")["rows"]
    out = []
    for gpus, tp, pp, dp, published in llama3_published.ROWS + (llama3_published.LONG_ROW,):
        r = _find(rows, "llama3_published", gpus=gpus, tp=tp, pp=pp, dp=dp)
        out.append(_row(published / r["predicted_tflops"] - 1, r["fits"], r["peak_memory_gib"],
                        label=f"405B @{gpus}, seq {r['seq']}, cp {r['cp']} ({r['engine']}, "
                              f"v={r['virtual_stages']}, {r['recompute']} recompute)"))
    return out


def megatron() -> list[dict]:
    rows = _load("megatron_published.json")["rows"]
    out = []
    for key, row in megatron_published.ROWS.items():
        r = _find(rows, "megatron_published", model=key.upper(), gpus=row[5])
        out.append(_row(r["error"], r["fits_80gib"], r["peak_memory_gib"],
                        label=f"{key} @{row[5]}"))
    return out


def mtnlg() -> list[dict]:
    """MT-NLG 530B on 2240 / 2800 / 3360 A100s (Smith et al. 2022), priced by
    megatron_published.py with Megatron's 2021 runtime: DeepSpeed's pipeline engine ran it."""
    rows = _load("megatron_published.json").get("mtnlg_rows", [])
    out = []
    for key, row in megatron_published.MTNLG.items():
        r = _find(rows, "megatron_published", model=key, gpus=row[5])
        out.append(_row(r["error"], r["fits_80gib"], r["peak_memory_gib"],
                        label=f"530B @{row[5]} (dp {r['dp']})"))
    return out


def korthikanti_table5() -> list[dict]:
    """Korthikanti et al. Table 5: 22B, 175B, 530B and 1T, full recompute and SP + selective
    (ranking.py prices them; time order is its subject, memory and fit are read here)."""
    sweeps = {s["sweep"]: s for s in _load("ranking.json")["sweeps"]}
    out = []
    for sweep in ranking.SWEEPS:
        if not sweep.name.startswith("korthikanti-t5"):
            continue
        got = sweeps.get(sweep.name)
        if got is None:
            raise Stale(f"ranking.json has no {sweep.name}: run benchmarks/ranking.py")
        for c in sweep.configs:
            r = _find(got["rows"], "ranking", label=c.label)
            out.append(_row(r["predicted_s"] / c.measured - 1, r["fits"], r["peak_gib"],
                            label=f"{sweep.name} {c.label}"))
    return out


# torchtitan's pipelined rows (Tables 5 and 6) at the knobs the doc leaves out, read from
# torchtitan at the commit it names (9dec370, 2024-12-26), each at that commit's default:
# - "local batch" is per data-parallel (FSDP) rank: train.py gives the data loader
#   training.batch_size per dp rank ("global batch size {batch_size * dp_degree}"; Table 5:
#   32 x FSDP 8 = its global 256), and a pipeline step runs that whole batch;
# - microbatches: experimental.pipeline_parallel_microbatches defaults to None, and then
#   build_pipeline_schedule (parallelisms/pipelining_utils.py) takes the pipeline degree: 8
#   microbatches, of 32 / 8 = 4 sequences in Table 5 and 8 / 8 = 1 in Table 6 (32K tokens
#   each). torchtitan 0.2.2 defaults to microbatches of 1 sequence instead (32 in Table 5),
#   which the job files of benchmarks/ranking.py get;
# - split: pipeline_parallel_split_points defaults to [], and then generate_split_points cuts
#   the layers into pp x (1 stage per rank for single-stage schedules such as 1F1B, 2 for
#   multi-stage ones such as Interleaved1F1B) stages (``torchtitan_split``): 126 layers into
#   15 + 6 x 16 + 15 (1F1B) and 7 + 14 x 8 + 7 (Interleaved 1F1B, 2 stages per rank);
# - FSDP under PP: apply_fsdp (parallelisms/parallelize_llama.py) passes
#   reshard_after_forward=False to every block and the root when PP is on ("to avoid
#   per-microbatch all-gathers"), so parameters stay gathered from forward to backward:
#   ZeRO-2 in meshplan's words (DESIGN.md), over dp x cp; the TP / CP rows reshard (ZeRO-3).
TORCHTITAN_STAGES_PER_RANK = {"1F1B": 1, "Interleaved 1F1B": 2}  # generate_split_points
TORCHTITAN_SCHEDULES = {"1F1B": "1f1b", "Interleaved 1F1B": "interleaved-1f1b"}


def torchtitan_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """Blocks per pipeline stage as torchtitan 9dec370 cuts a model given no split points
    (parallelisms/pipelining_utils.generate_split_points): num_layers // stages in the
    first stage, one more in each middle stage while the remainder lasts, and what is left
    in the last."""
    base, extra = divmod(num_layers, stages)
    if base == 0:
        raise ValueError(f"{stages} stages of {num_layers} layers: torchtitan refuses more "
                         "stages than layers; choose fewer stages")
    if stages == 1:
        return (num_layers,)
    middle = [base + (j < extra) for j in range(stages - 2)]
    return (base, *middle, num_layers - base - sum(middle))


def runs(counts: list[int]) -> str:
    """[15, 16, 16, 15] -> "15/2x16/15"."""
    out = []
    for c in counts:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return "/".join(f"{n}x{c}" if n > 1 else str(c) for c, n in out)


def price_parallel() -> list[dict]:
    """torchtitan's TP / CP / PP rows priced here: fp8 (torchao Float8 on the linears),
    compiled, FSDP over dp x cp (ZeRO-3; ZeRO-2 with PP, as torchtitan runs it), TP with
    sequence parallelism, full AC; the pipelined rows with torchtitan's default microbatch
    count and split (see ``TORCHTITAN_STAGES_PER_RANK``). AsyncTP is not told apart: the
    torchtitan profile leaves TP collectives exposed, so both Table 4 rows get one
    prediction."""
    import meshplan

    out, plans, graphs = [], {}, {}
    for (table, model, spec, gpus, fsdp, tp, pp, cp, local, seq, schedule, ac, what,
         published, gib) in torchtitan_published.PARALLEL_ROWS:
        key = (model, gpus, fsdp, tp, pp, cp, local, seq, schedule, ac)
        if key not in plans:
            gkey = (model, local * fsdp, seq)
            if gkey not in graphs:  # torchtitan's model code, traced with its loss
                graphs[gkey] = torchtitan_published.torchtitan_graph(spec, local * fsdp, seq,
                                                                     model)
            built, graph = graphs[gkey]
            mesh = torchtitan_published.h100_mesh(gpus)  # SDPA's flash backend, as they ran
            kw = {}
            if pp > 1:
                v = TORCHTITAN_STAGES_PER_RANK[schedule]
                kw = dict(pp=pp, schedule=TORCHTITAN_SCHEDULES[schedule], virtual_stages=v,
                          stage_layers=torchtitan_split(graph.num_layers, pp * v))
            plan = meshplan.manual_plan(built, mesh, graph=graph, dp=fsdp, tp=tp, cp=cp,
                                        zero=2 if pp > 1 else 3,
                                        microbatch_size=local // pp if pp > 1 else local,
                                        recompute=ac, dtype="fp8", sequence_parallel=tp > 1,
                                        engine="torchtitan", **kw)
            plans[key] = plan, meshplan.estimate(plan, compiled=True)
        plan, est = plans[key]
        tokens = local * fsdp * seq / est.step_time_s / gpus
        layout = f"FSDP {fsdp} TP {tp} CP {cp}, seq {seq}"
        if pp > 1:
            t = plan.training
            layout = (f"FSDP {fsdp} as ZeRO-2, TP {tp} PP {pp} CP {cp}, seq {seq}, {schedule}, "
                      f"{t.microbatches} microbatches of {t.microbatch_size}, stages of "
                      f"{runs([b - a for a, b in (st.layers for st in plan.stages)])} blocks")
        out.append(_row(published / tokens - 1, est.fits, round(est.peak_memory_gib, 1), gib,
                        f"{table} {model} {what} ({layout}): predicted {tokens:.0f} / "
                        f"published {published} tokens/s per GPU"))
        print(out[-1], {k: round(x, 2) for k, x in est.breakdown.items()},
              {k: round(getattr(est.memory, f"{k}_gib"), 1) for k in
               ("params", "grads", "optimizer", "activations", "buffers")}, flush=True)
    return out


def summary(rows: list[dict]) -> dict:
    priced = [r for r in rows if "error" in r]
    errs = [r["error"] for r in priced]
    mem = [(r["peak_gib"], r["published_gib"]) for r in priced if r["published_gib"]]
    return {"rows": len(priced), "mape": sum(map(abs, errs)) / len(errs),
            "max": max(map(abs, errs)), "bias": sum(errs) / len(errs),
            "fit": sum(r["fits"] for r in priced),
            "memory": [f"{p} / {q}" for p, q in mem]}


GROUPS = (  # (name, device, rows)
    ("NeMo Llama 3.1 bf16 (dgxc-benchmarking 24.09)", "H100", lambda: nemo("bf16")),
    ("NeMo Llama 3.1 fp8, beside (same runs, FP8 tables)", "H100", lambda: nemo("fp8")),
    ("torchtitan FSDP eager (Llama 3.1 8B)", "H100 96 GB", lambda: torchtitan("h100", False)),
    ("torchtitan FSDP compiled (Llama 3.1 8B)", "H100 96 GB", lambda: torchtitan("h100", True)),
    ("Llama 3 405B, Meta's stack (Table 4)", "H100", llama3),
    ("Megatron-LM Table 1 (Narayanan et al. 2021)", "A100", megatron),
    ("A100 memory: Korthikanti et al. Table 5", "A100", korthikanti_table5),
    ("A100: MT-NLG 530B (Smith et al. 2022; DeepSpeed's pipeline engine, priced as "
     "Megatron-LM 2021)", "A100", mtnlg),
    ("torchtitan FSDP eager (A100)", "A100", lambda: torchtitan("a100", False)),
)


POOLED = "all dense bf16 H100 rows, pooled (the four groups above without fp8)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--price-parallel", action="store_true",
                    help="also price torchtitan's TP / CP / PP rows (Float8, compiled) here")
    args = ap.parse_args(argv)
    groups = [(name, device, rows()) for name, device, rows in GROUPS]
    if args.price_parallel:
        groups.append(("torchtitan TP / CP / PP, fp8 + compiled, beside", "H100 96 GB",
                       price_parallel()))
    lines = ["| group | device | rows | MAPE | max error | bias | fit | memory: predicted / "
             "published GiB |", "|---|---|---|---|---|---|---|---|"]
    detail = []
    # the "dense bf16 H100 rows": every H100 group but the fp8 ones, pooled
    pooled = [r for name, device, rows in groups if device.startswith("H100")
              and "fp8" not in name for r in rows]
    for name, device, rows in groups + [(POOLED, "H100", pooled)]:
        s = summary(rows)
        lines.append(f"| {name} | {device} | {s['rows']} | {s['mape'] * 100:.1f}% | "
                     f"{s['max'] * 100:.1f}% | {s['bias'] * 100:+.1f}% | {s['fit']} of "
                     f"{s['rows']} | {', '.join(s['memory']) or '-'} |")
        if name == POOLED:
            continue
        detail.append(f"\n### {name}\n\n| row | error | peak GiB | published GiB | fits |\n"
                      "|---|---|---|---|---|")
        for r in rows:
            if "error" not in r:
                detail.append(f"| {r['label']} | not priced: {r['skipped']} | - | "
                              f"{r['published_gib']} | - |")
                continue
            detail.append(f"| {r['label']} | {r['error'] * 100:+.1f}% | {r['peak_gib']} | "
                          f"{r['published_gib'] or '-'} | {'yes' if r['fits'] else 'NO'} |")
    text = ("# Validation by group: published H100 runs and the A100 sets\n\n"
            "Error: predicted vs published step time (+: predicted slower); the rows and "
            "their sources are the group scripts' tables (module docstring). Every row ran, "
            "so every one should fit. Published GiB of the torchtitan rows is what "
            "torchtitan logs, the caching allocator's peak reserved memory "
            "(`max_reserved_gib`), which bounds from above the peak of live tensors that "
            "meshplan predicts.\n\n" + "\n".join(lines) + "\n" + "\n".join(detail)
            + "\n\nReproduce: the group scripts, then `python benchmarks/h100_validation.py"
            + (" --price-parallel" if args.price_parallel else "") + "`.\n")
    print(text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "h100_validation.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Stale as exc:
        sys.exit(f"h100_validation: {exc}")
