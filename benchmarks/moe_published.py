"""Cost model vs published mixture-of-experts training runs (issue 39).

trace -> **cost**: each row's model preset (meshplan/specs.py, the authors' config.json
sizes) traced on the meta device at the run's global batch and sequence, planned by hand
exactly as it ran (``meshplan.manual_plan`` with its dp, tp, pp, microbatch and schedule,
then ``Stage.ep`` set to its expert-parallel degree) and priced with ``meshplan.estimate``
as the stack runs it (``engine="megatron"``: Megatron-Core, the stack Megatron-Bridge runs).
Expert parallelism is priced by costmodel/moe.py: nothing here is fitted to these rows.

Sources (tokens/s per GPU as published):

- NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, "25.11 NeMo Container",
  pre-training tables for DGX-GB200, DGX-B200 and DGX-H100 (columns GBS, MBS, sequence,
  FSDP, TP, PP, CP, VP, EP, GA, tokens/s/GPU). Its note: "In MoE training benchmarks, we
  force-balance the token distribution among experts and all benchmarks are token-dropless"
  (so ``moe_imbalance`` stays 1.0). Here: the BF16 DeepSeek-V3 and Qwen3-235B-A22B rows
  of the GB200 table and the Qwen3-30B-A3B rows of the H100 (FP8-CS: Transformer Engine's
  current scaling, priced by costmodel/fp8.py as ``dtype="fp8"``), GB200 and B200 tables
  (FP8-MX: MXFP8 is issue 43's recipe, not priced yet; these rows are priced as fp8
  current scaling on the same fp8 peak, and say so). Left out: the GPT-OSS-120B rows - the
  pinned transformers' gpt_oss has no SDPA path (``_supports_sdpa = False``: its attention
  sinks run as eager matmul + softmax), so the traced model materializes every attention
  score while Megatron-Core runs a fused kernel; meshplan prices what it traces, and at
  seq 4,096 x MBS 4 that is 750 GiB per GPU, not the run. The H100 Qwen3_235B_a22B row,
  whose cells are shifted (13 values under 15 headers: its GBS is missing); the GB300
  table (no GB300 preset); DeepSeek-V3 FP8-MX on GB200/B200 (MXFP8).
- DeepSeek-V3 technical report (arXiv 2412.19437): 2,048 H800, PP16 (DualPipe) x EP64 over
  8 nodes x ZeRO-1 DP, 180K H800 GPU-hours per trillion tokens (sec. 1, Table 1) =
  1e12 / (180e3 x 3600) = 1,543 tokens/s per GPU; sequence 4,096, batch 15,360 sequences
  (sec. 4.2 hyper-parameters, the batch after its ramp); fp8 mixed precision (sec. 3.3).
  Priced in bf16 (fp8 block-scaled GEMMs are issue 43's) with DualPipe's all-to-all overlap
  (``RuntimeModel.ep_a2a_overlap`` = 1: "both all-to-all and PP communication can be fully
  hidden", sec. 3.2.1); DualPipe's bubble is priced as 1F1B's, the multi-token-prediction
  module is not in the preset.

Layers that do not divide evenly over the pipeline (61 in DeepSeek-V3, 94 in
Qwen3-235B-A22B) go to the stages as evenly as they can (``stage_layers``), the first stages
one more; where the stages' layers do not divide by the virtual stages, the run is priced as
1F1B (Megatron-Bridge's recipes give such models a custom ``pipeline_model_parallel_layout``;
its interleaving would lower the bubble by (vp - 1) / vp of pp - 1 of the microbatches).

Run: python benchmarks/moe_published.py [--only NAME,...] [--pick]
Writes benchmarks/results/moe_published.{md,json}; ``--pick`` adds meshplan's own plan
(``autoparallel``) for the same model, batch and GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

MB = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md, 25.11 NeMo Container"
DSV3 = "DeepSeek-V3 technical report, arXiv 2412.19437, sec. 1 / 3.2 / 4.2"

# (name, model preset, system preset, GPUs, dtype, GBS, MBS, seq, TP, PP, VP, EP, recompute,
#  a2a overlap, published tokens/s/GPU, source)
ROWS = (
    ("gb200-deepseek-v3", "deepseek-v3", "gb200-nvl72", 256, "bf16", 4096, 1, 4096, 1, 4, 4, 64,
     "none", 0.0, 3139, MB + ", DGX-GB200"),
    ("gb200-qwen3-235b", "qwen3-235b-a22b", "gb200-nvl72", 256, "bf16", 8192, 1, 4096, 1, 8, 3,
     32, "none", 0.0, 4916, MB + ", DGX-GB200"),
    ("h100-qwen3-30b-fp8", "qwen3-30b-a3b", "dgx-h100", 16, "fp8", 512, 2, 4096, 1, 2, 24, 8,
     "none", 0.0, 5275, MB + ", DGX-H100 (FP8-CS)"),
    ("gb200-qwen3-30b-fp8", "qwen3-30b-a3b", "gb200-nvl72", 8, "fp8", 512, 4, 4096, 1, 1, 1, 8,
     "none", 0.0, 23766, MB + ", DGX-GB200 (FP8-MX)"),
    ("b200-qwen3-30b-fp8", "qwen3-30b-a3b", "dgx-b200", 8, "fp8", 512, 1, 4096, 1, 1, 1, 8,
     "none", 0.0, 9299, MB + ", DGX-B200 (FP8-MX)"),
    ("h800-deepseek-v3-report", "deepseek-v3", "dgx-h800", 2048, "bf16", 15360, 1, 4096, 1, 16,
     1, 64, "none", 1.0, 1543, DSV3),
)
NAMES = tuple(r[0] for r in ROWS)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def stage_layers(layers: int, pp: int) -> tuple[int, ...]:
    """``layers`` over ``pp`` stages as evenly as they go, the first stages one more."""
    base, extra = divmod(layers, pp)
    return tuple(base + (i < extra) for i in range(pp))


def as_ran(row, graph=None, model=None):
    """(plan, estimate, model, graph) of a row priced as it ran."""
    import meshplan
    from meshplan.costmodel.runtime_profiles import plan_runtime
    from meshplan.costmodel.hardware import HardwareProfile
    from meshplan.specs import parse_model_spec, training_call

    (name, preset, system, gpus, dtype, gbs, mbs, seq, tp, pp, vp, ep, rc, overlap,
     _published, _source) = row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model is None:
            model = parse_model_spec(preset).build("meta")
        if graph is None:
            call = training_call(model, gbs, seq)
            graph = meshplan.trace(model, call.inputs, example_targets=call.targets,
                                   model_name=preset)
    mesh = run_mesh(system, gpus)
    layers = model.config.num_hidden_layers
    split = stage_layers(layers, pp)
    interleave = vp > 1 and all(n % vp == 0 for n in split)
    plan = meshplan.manual_plan(
        model, mesh, graph=graph, dp=gpus // (tp * pp), tp=tp, pp=pp, microbatch_size=mbs,
        sequence_parallel=tp > 1, zero=1, recompute=rc, dtype=dtype, engine="megatron",
        schedule="interleaved-1f1b" if interleave else "1f1b",
        virtual_stages=vp if interleave else 1,
        stage_layers=split if pp > 1 and layers % pp else ())
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, ep=ep)
                                                  for s in plan.stages))
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    runtime = dataclasses.replace(plan_runtime(plan, hw), ep_a2a_overlap=overlap)
    from meshplan.costmodel.estimate import estimate_plan
    est = estimate_plan(plan, graph, runtime=runtime)
    return plan, est, model, graph, interleave


def run_mesh(system: str, gpus: int):
    """The run's ``gpus`` devices on ``system``: one NVLink domain where they fit in one,
    else whole domains of the largest size that divides them (256 GB200s: 4 NVL72 racks
    of 64 GPUs each, since 256 is no multiple of 72)."""
    return _mesh(system, gpus)


def _mesh(system: str, gpus: int):
    import meshplan
    from meshplan.mesh import load_preset

    hw = load_preset(system)
    per_node = hw.devices_per_node
    if gpus <= per_node:
        return meshplan.Mesh((gpus,), hw, ("gpu",), name=f"{system}:gpus={gpus}")
    local = max(d for d in range(1, per_node + 1) if gpus % d == 0)
    hw = dataclasses.replace(hw, devices_per_node=local)
    return meshplan.Mesh((gpus // local, local), hw, ("node", "gpu"),
                         name=f"{system}:gpus={gpus}")


def predict(row, pick: bool = False) -> dict:
    import meshplan

    start = time.perf_counter()
    plan, est, model, graph, interleave = as_ran(row)
    gpus, published = row[3], row[14]
    tokens = est.tokens_per_s / gpus
    out = {"name": row[0], "model": row[1], "system": row[2], "gpus": gpus, "dtype": row[4],
           "global_batch": row[5], "mbs": row[6], "seq": row[7], "tp": row[8], "pp": row[9],
           "vp": row[10], "ep": row[11], "schedule": plan.training.schedule,
           "interleaved_as_published": interleave or row[10] == 1,
           "a2a_overlap": row[13], "source": row[15],
           "published_tokens_per_gpu": published,
           "predicted_tokens_per_gpu": round(tokens, 1),
           # + where the prediction is slower (step time: published / predicted throughput)
           "error": round(published / tokens - 1, 4),
           "peak_memory_gib": round(est.peak_memory_gib, 1), "fits": est.fits,
           "mfu": round(est.mfu, 4),
           "breakdown_s": {k: round(v, 3) for k, v in est.breakdown.items()},
           "seconds": round(time.perf_counter() - start, 1)}
    if pick:
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = run_mesh(row[2], gpus)
            auto = meshplan.autoparallel(model, mesh, graph=graph, dtype=row[4])
        a = meshplan.estimate(auto, graph)
        out["pick"] = {"layout": [dict(dp_cp_tp=list(s.mesh_shape), ep=s.ep, zero=s.zero,
                                       recompute=s.recompute) for s in auto.stages],
                       "pp": auto.num_stages, "engine": auto.engine,
                       "schedule": auto.training.schedule,
                       "microbatches": auto.training.microbatches,
                       "tokens_per_gpu": round(a.tokens_per_s / gpus, 1),
                       "mfu": round(a.mfu, 4), "peak_memory_gib": round(a.peak_memory_gib, 1),
                       "planning_s": round(time.perf_counter() - t, 1)}
    return out


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"rows": len(rows), "mape": round(sum(errors) / len(errors), 4) if errors else None,
            "max_error": round(max(errors), 4) if errors else None,
            "all_fit": all(r["fits"] for r in rows)}


def write(rows: list[dict]) -> None:
    s = summary(rows)
    with open(os.path.join(RESULTS, "moe_published.json"), "w") as f:
        json.dump({"rows": rows, "summary": s}, f, indent=1)
    lines = ["# Published mixture-of-experts runs, priced as they ran",
             "", "`python benchmarks/moe_published.py` (sources and method: its docstring). "
             "Error: published / predicted throughput - 1 (+: predicted slower).", "",
             "| run | GPUs | GBS x seq | TP/PP/VP/EP | schedule priced | published tok/s/GPU "
             "| predicted | error | peak GiB (fits) | MFU | meshplan's pick |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("pick")
        pick = (f"pp{p['pp']} {p['layout'][0]} {p['tokens_per_gpu']} tok/s/GPU, "
                f"{p['peak_memory_gib']} GiB, {p['planning_s']} s") if p else "not run"
        lines.append(
            f"| {r['name']} ({r['system']}) | {r['gpus']} | {r['global_batch']} x {r['seq']} | "
            f"{r['tp']}/{r['pp']}/{r['vp']}/{r['ep']} | {r['schedule']} | "
            f"{r['published_tokens_per_gpu']} | {r['predicted_tokens_per_gpu']} | "
            f"{r['error']:+.1%} | {r['peak_memory_gib']} ({'yes' if r['fits'] else 'NO'}) | "
            f"{r['mfu']:.1%} | {pick} |")
    lines += ["", f"MAPE {s['mape']:.1%}, max {s['max_error']:.1%} over {s['rows']} rows; "
              f"every run fits: {s['all_fit']}.", "", "Findings (issue 39's targets: MAPE <= 25%, "
              "each within 40%, every run fits; not met):", "",
              "- Qwen3-30B-A3B at microbatch 1-2 (H100, B200) is priced about 2x too fast, "
              "GB200 at microbatch 4 16%: the published rows show a large fixed cost per MoE "
              "layer per microbatch (B200 MBS 1 vs GB200 MBS 4, same model and EP 8: 4x the "
              "tokens per microbatch cost 1.56x the time, about 7 ms per layer and "
              "microbatch if all of it were fixed). costmodel/moe.py prices the fixed costs "
              "a documented mechanism gives: the forward's device-to-host syncs of the token "
              "counts (Transformer Engine's `m_splits`, the all-to-all's split sizes; "
              "Megatron-LM #1598), two kernel latencies each, and Transformer Engine's "
              "grouped GEMM as one cuBLAS launch per local expert; together tens to hundreds "
              "of microseconds per layer, under 1% of these rows. The rest (host-side "
              "Python of Megatron-Core and Transformer Engine per call, which no source "
              "states) is not priced, and nothing is fitted to these rows.",
              "- DeepSeek-V3's activations were priced at 950-1,650 GiB per GPU: "
              "transformers builds multi-latent attention's keys with "
              "`kv_nope.new_empty(...)` (filled by `copy_`), which the plan places "
              "replicated, so they were priced at the global batch (12 GiB per layer at dp "
              "64). Engines that run the user's modules per rank now split such a factory "
              "as its source (costmodel/stage_layout.py `factory_split`; tests/test_moe.py "
              "measures a tiny DeepSeek against eager autograd's saved tensors). What is "
              "left above 80 GB (H800) and 186 GB (GB200) is the activations of the "
              "microbatches 1F1B keeps in flight with no recompute, about 1.9 GiB per layer "
              "and 4,096-token microbatch; DeepSeek's report recomputes RMSNorm and the MLA "
              "up-projections and caches activations in FP8 (sec. 3.2.3, 3.3.3), and "
              "Megatron-Bridge's recipe settings beyond the table's columns are not "
              "known: neither is priced.",
              "- GPT-OSS-120B rows are left out (the docstring says why).", ""]
    with open(os.path.join(RESULTS, "moe_published.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated row names: " + ", ".join(NAMES))
    ap.add_argument("--pick", action="store_true", help="also run autoparallel per row")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other rows already in results/moe_published.json")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    bad = only - set(NAMES)
    if bad:
        print(f"--only {','.join(sorted(bad))}: not a row; choose from {', '.join(NAMES)}",
              file=sys.stderr)
        return 2
    rows = {}
    path = os.path.join(RESULTS, "moe_published.json")
    if args.merge and os.path.exists(path):
        with open(path) as f:
            rows = {r["name"]: r for r in json.load(f)["rows"]}
    for row in ROWS:
        if only and row[0] not in only:
            continue
        rows[row[0]] = predict(row, pick=args.pick)
        print(json.dumps(rows[row[0]]), flush=True)
    write([rows[n] for n in NAMES if n in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
