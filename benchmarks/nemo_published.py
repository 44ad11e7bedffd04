"""Cost model vs NVIDIA's published NeMo runs on DGX H100: Llama 3.1 8B, 70B and 405B, bf16.

trace -> **cost**: each row traced on the meta device at its global batch (sequence 8,192),
planned by hand with ``meshplan.manual_plan`` exactly as the recipe ran it (TP, PP, CP,
virtual pipeline stages, microbatch 1, the global batch) and priced as Megatron-LM / NeMo
run it (``engine="nemo"``: Megatron-Core with Transformer Engine as the ``megatron`` profile
prices it - sequence parallelism where TP > 1, overlapped gradient reduce-scatter and
parameter all-gather, TP communication overlap, cuDNN fused causal attention, context
parallelism on head-tail chunks with the loss on each chunk, fused norms / SwiGLU / RoPE
keeping only what they materialize - trained with the recipes' optimizer, Apex's
distributed fused Adam with ``grad_sync_dtype: bf16``: bf16 gradients, fp32 Adam state with
16-bit master remainders, sharded over dp x cp), on the ``dgx-h100`` preset, whose
constants come from datasheets and kernel measurements, never from these rows.

Source: NVIDIA/dgxc-benchmarking, llama3.1/README_8b.md, README_70b.md, README_405b.md
("Llama 3.1 ... 24.09 BF16" tables: NeMo 24.09 container, DGX H100; training step time in
seconds per step, the last step of the run). Configurations as the tables head them:
8B TP1 PP1 CP2 MBS1 GA32, global batch 16 sequences per GPU; 70B TP4 PP4 CP2 VP5 MBS1
GA64, 2 per GPU; 405B TP8 PP9 CP2 VP7 MBS1 GA63, 252 per 576 GPUs (the proxy rows under 576
GPUs, with fewer layers, as published). The recipes' own settings (the repository's
llama3.1/llama3.1_{8b,70b,405b}.yaml and configure.sh at its first tag, v24.11.1, which
runs the nemo:24.09 container): no activation recompute (``activations_checkpoint_*:
null``), sequence parallelism with TP (``sequence_parallel: true`` on 70B/405B),
``optim.name: distributed_fused_adam`` with ``grad_sync_dtype: bf16``, fused RoPE, SwiGLU
and cross entropy; 8B and 70B use the Llama 3 tokenizer (128,256 entries), the 405B recipe
trains on mock data with Megatron's ``GPT2BPETokenizer`` (50,257, padded to a multiple of
``make_vocab_size_divisible_by`` 128 x TP 8: 51,200) and ``num_query_groups: 16``; the
proxy rows set ``num_layers``/PP as configure.sh does. No memory is published; every row
ran on 80 GB H100s, so every row must fit.

``--dtype fp8`` prices the same rows with ``dtype="fp8"`` (costmodel/fp8.py: the block
linears' GEMMs in fp8 with Transformer Engine's current scaling, as NeMo's FP8 runs) against
the READMEs' "24.09 FP8" tables (same configurations, same container), beside the bf16
prediction. Nothing is fitted to them.

Run: python benchmarks/nemo_published.py [--only 8b,70b,405b] [--dtype fp8]
Writes benchmarks/results/nemo_published.{md,json} (bf16) or nemo_published_fp8.{md,json}.
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
from meshplan.tracing import trace

SEQ = 8192
SOURCE = "NVIDIA/dgxc-benchmarking llama3.1/README_{}.md, 24.09 BF16 table"
MODELS = {  # hidden, FFN, heads, KV heads, vocabulary: the recipes' llama3.1_*.yaml
    "8b": (4096, 14336, 32, 8, 128256),  # Llama 3 tokenizer
    "70b": (8192, 28672, 64, 8, 128256),
    "405b": (16384, 53248, 128, 16, 51200),  # num_query_groups: 16; GPT-2 BPE, padded
}
ENGINE = "nemo"  # costmodel/runtime_profiles.py nemo_runtime: the recipes' optimizer
# (model, layers, GPUs, TP, PP, CP, VP, global batch, published step s)
ROWS = (
    ("8b", 32, 8, 1, 1, 2, 1, 128, 12.91),
    ("8b", 32, 16, 1, 1, 2, 1, 256, 13.00),
    ("8b", 32, 32, 1, 1, 2, 1, 512, 13.05),
    ("8b", 32, 64, 1, 1, 2, 1, 1024, 13.08),
    ("8b", 32, 128, 1, 1, 2, 1, 2048, 13.10),
    ("70b", 80, 64, 4, 4, 2, 5, 128, 14.72),
    ("70b", 80, 128, 4, 4, 2, 5, 256, 14.73),
    ("70b", 80, 256, 4, 4, 2, 5, 512, 14.8),
    ("70b", 80, 512, 4, 4, 2, 5, 1024, 14.89),
    ("70b", 80, 1024, 4, 4, 2, 5, 2048, 14.92),
    ("70b", 80, 2048, 4, 4, 2, 5, 4096, 14.98),
    ("405b", 7, 32, 8, 1, 2, 1, 126, 8.85),
    ("405b", 21, 96, 8, 3, 2, 7, 126, 8.75),
    ("405b", 42, 192, 8, 3, 2, 7, 252, 16.93),
    ("405b", 126, 576, 8, 9, 2, 7, 252, 17.20),
    ("405b", 126, 1152, 8, 9, 2, 7, 504, 17.52),
    ("405b", 126, 2304, 8, 9, 2, 7, 1008, 17.62),
)
# the same rows' "24.09 FP8" tables: step seconds by (model, GPUs)
FP8_STEP_S = {
    ("8b", 8): 9.67, ("8b", 16): 9.73, ("8b", 32): 9.75, ("8b", 64): 9.80, ("8b", 128): 9.82,
    ("70b", 64): 11.01, ("70b", 128): 10.93, ("70b", 256): 11.16, ("70b", 512): 11.18,
    ("70b", 1024): 11.28, ("70b", 2048): 11.39,
    ("405b", 32): 5.80, ("405b", 96): 5.71, ("405b", 192): 11.00, ("405b", 576): 11.24,
    ("405b", 1152): 11.31, ("405b", 2304): 12.35,
}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def spec(model: str, layers: int) -> str:
    hidden, ffn, heads, kv, vocab = MODELS[model]
    return (f"transformers:llama?hidden_size={hidden}&intermediate_size={ffn}"
            f"&num_hidden_layers={layers}&num_attention_heads={heads}"
            f"&num_key_value_heads={kv}&vocab_size={vocab}&max_position_embeddings={SEQ}")


def predict(row, dtype: str = "bf16") -> dict:
    model_name, layers, gpus, tp, pp, cp, vp, batch, published = row
    bf16_published = published
    if dtype == "fp8":
        published = FP8_STEP_S[(model_name, gpus)]
    model = parse_model_spec(spec(model_name, layers)).build(device="meta")
    start = time.perf_counter()
    graph = trace(model, (torch.zeros((batch, SEQ), dtype=torch.long, device="meta"),),
                  model_name=f"llama3.1-{model_name}")
    traced = time.perf_counter() - start
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=max(1, gpus // 8))
    dp = gpus // (tp * pp * cp)
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=dp, tp=tp, pp=pp, cp=cp,
                                microbatch_size=1, sequence_parallel=tp > 1, zero=1,
                                schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                                virtual_stages=vp, recompute="none", dtype=dtype,
                                engine=ENGINE)
    est = plan.predicted
    extra = {}
    if dtype != "bf16":  # the bf16 row beside it
        bf16 = meshplan.manual_plan(model, mesh, graph=graph, dp=dp, tp=tp, pp=pp, cp=cp,
                                    microbatch_size=1, sequence_parallel=tp > 1, zero=1,
                                    schedule="interleaved-1f1b" if vp > 1 else "1f1b",
                                    virtual_stages=vp, recompute="none", dtype="bf16",
                                    engine=ENGINE).predicted
        extra = {"bf16_published_step_s": bf16_published,
                 "bf16_predicted_step_s": round(bf16.step_time_s, 3),
                 "published_speedup": round(bf16_published / published, 3),
                 "predicted_speedup": round(bf16.step_time_s / est.step_time_s, 3)}
    return {"model": f"Llama 3.1 {model_name.upper()}", "layers": layers, "gpus": gpus,
            "tp": tp, "pp": pp, "cp": cp, "vp": vp, "dp": dp, "global_batch": batch,
            "source": SOURCE.format(model_name).replace("BF16", dtype.upper()),
            "dtype": dtype, "published_step_s": published, **extra,
            "predicted_step_s": round(est.step_time_s, 3),
            "error": round((est.step_time_s - published) / published, 4),
            "peak_memory_gib": round(est.peak_memory_gib, 1), "fits": est.fits,
            "memory_gib": {k: round(getattr(est.memory, f"{k}_gib"), 1) for k in
                           ("params", "grads", "optimizer", "activations", "buffers")},
            "breakdown_s": {k: round(v, 3) for k, v in est.breakdown.items()},
            "trace_s": round(traced, 1),
            "estimate_s": round(time.perf_counter() - start - traced, 1)}


def summary(rows: list[dict]) -> dict:
    errs = [r["error"] for r in rows]
    return {"rows": len(rows), "mape": sum(abs(e) for e in errs) / len(errs),
            "max": max(abs(e) for e in errs), "bias": sum(errs) / len(errs),
            "fit": sum(r["fits"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated models (8b,70b,405b)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    only = set(filter(None, args.only.split(",")))
    rows = []
    for row in ROWS:
        if only and row[0] not in only:
            continue
        rows.append(predict(row, args.dtype))
        print(rows[-1], flush=True)
    lines = ["| model | GPUs | TP | PP | CP | VP | DP | GBS | published s | predicted s | error | "
             "peak GiB | fits | breakdown (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"
             "---|---|---|"]
    fp8 = args.dtype == "fp8"
    if fp8:
        lines[0] = lines[0].replace("breakdown (s) |", "bf16 published / predicted s | "
                                    "speedup published / predicted | breakdown (s) |")
        lines[1] += "---|---|"
    for r in rows:
        beside = (f"{r['bf16_published_step_s']} / {r['bf16_predicted_step_s']} | "
                  f"{r['published_speedup']} / {r['predicted_speedup']} | ") if fp8 else ""
        lines.append(f"| {r['model']} ({r['layers']} layers) | {r['gpus']} | {r['tp']} | "
                     f"{r['pp']} | {r['cp']} | {r['vp']} | {r['dp']} | {r['global_batch']} | "
                     f"{r['published_step_s']} | {r['predicted_step_s']} | "
                     f"{r['error'] * 100:+.1f}% | {r['peak_memory_gib']} | "
                     f"{'yes' if r['fits'] else 'NO'} | {beside}{r['breakdown_s']} |")
    groups = {}
    for r in rows:
        groups.setdefault(r["model"], []).append(r)
    stats = {k: summary(v) for k, v in groups.items()}
    stats["all"] = summary(rows)
    stat_lines = ["| group | rows | MAPE | max error | bias | fit 80 GB |", "|---|---|---|---|---|---|"]
    for k, s in stats.items():
        stat_lines.append(f"| {k} | {s['rows']} | {s['mape'] * 100:.1f}% | {s['max'] * 100:.1f}% "
                          f"| {s['bias'] * 100:+.1f}% | {s['fit']} of {s['rows']} |")
    text = (f"# Cost model vs NeMo's published Llama 3.1 runs on DGX H100 ({args.dtype})\n\n"
            "NVIDIA/dgxc-benchmarking llama3.1 READMEs (NeMo 24.09"
            f"{', FP8 tables' if fp8 else ''}), priced with "
            f"`manual_plan(..., dtype=\"{args.dtype}\", engine=\"{ENGINE}\")` on the dgx-h100 "
            "preset; error = "
            "(predicted - published) / published step time (+: predicted slower). No memory "
            "is published: every row ran in 80 GB.\n\n" + "\n".join(stat_lines) + "\n\n"
            + "\n".join(lines) + "\n\nReproduce: `python benchmarks/nemo_published.py"
            + (" --dtype fp8" if fp8 else "") + "`.\n")
    print("\n" + text)
    if only:
        return 0
    os.makedirs(OUT, exist_ok=True)
    name = "nemo_published" + ("_fp8" if fp8 else "")
    with open(os.path.join(OUT, f"{name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump({"source": "NVIDIA/dgxc-benchmarking llama3.1 READMEs "
                             f"(24.09 {args.dtype.upper()})",
                   "summary": stats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
