"""Planning showcase for context parallelism (cp): long-context Llama 3 on H100s.

trace -> cost -> solve: two published-scale cases, traced on the meta device, planned and
priced on the DGX H100 preset (bf16):

1. Llama-3-8B (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocabulary
   128,256) at 131,072 tokens per sequence, 8 sequences per step, on 64 H100s (8 nodes):
   peak memory per device with and without cp for the same TP8 (dp8 vs cp8 and cp4 x dp2),
   and what ``meshplan.autoparallel`` picks with and without cp in its search;
2. Llama 3 405B at 131,072 tokens on 16,384 H100s as the paper ran its long-context stage:
   TP8, CP16, PP16, DP8, 16M tokens per step (128 sequences), microbatch 1, 1F1B, ZeRO-2,
   the least recompute that fits; predicted TFLOP/s per GPU against the published 380
   (Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4: 16,384 GPUs,
   131,072 tokens, TP8 CP16 PP16 DP8, 380 TFLOP/s per GPU, 38% MFU).

meshplan cannot combine sequence parallelism with cp (both would split the sequence), so
the 405B plan runs TP8 without it; the paper's run used both.

Run: python benchmarks/context_parallel.py [--quick]. Writes
benchmarks/results/context_parallel.{md,json}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import meshplan
from meshplan.context import chunk_words
from meshplan.errors import MeshplanError
from meshplan.tracing import trace
from meshplan.specs import parse_model_spec

SEQ = 131072
LLAMA3_8B = ("transformers:llama?hidden_size=4096&intermediate_size=14336&num_hidden_layers=32"
             "&num_attention_heads=32&num_key_value_heads=8&vocab_size=128256"
             f"&max_position_embeddings={SEQ}")
LLAMA3_405B = ("transformers:llama?hidden_size=16384&intermediate_size=53248"
               "&num_hidden_layers=126&num_attention_heads=128&num_key_value_heads=8"
               f"&vocab_size=128256&max_position_embeddings={SEQ}")
H100_BF16_TFLOPS = 989.0  # H100 SXM dense bf16 datasheet
PUBLISHED_405B_TFLOPS = 380  # arXiv 2407.21783, Table 4 (131,072 tokens, 16,384 GPUs)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def row(plan, **extra) -> dict:
    e, st = plan.predicted, plan.stages[0]
    axes = dict(zip(st.axis_names, st.mesh_shape))
    return {**extra, "layout": " ".join(f"{k}{v}" for k, v in axes.items())
            + f" pp{plan.num_stages if plan.training.virtual_stages == 1 else plan.num_stages}",
            "recompute": st.recompute, "zero": st.zero,
            "microbatches": plan.training.microbatches,
            "fits": e.fits, "peak_memory_gib": round(e.peak_memory_gib, 1),
            "activations_gib": round(e.memory.activations_gib, 1),
            "step_time_s": round(e.step_time_s, 2), "mfu": round(e.mfu, 4),
            "tflops_per_gpu": round(e.mfu * H100_BF16_TFLOPS, 1),
            "breakdown_s": {k: round(v, 2) for k, v in e.breakdown.items()},
            "chunks": chunk_words(SEQ, axes["cp"], limit=2) if "cp" in axes else ""}


def least_recompute(model, mesh, graph, **kw):
    for recompute in ("none", "full"):  # selective is refused with cp (DECISIONS 37)
        plan = meshplan.manual_plan(model, mesh, graph=graph, recompute=recompute, dtype="bf16",
                                    **kw)
        if plan.predicted.fits:
            break
    return plan


def case_8b(quick: bool) -> list[dict]:
    model = parse_model_spec(LLAMA3_8B).build(device="meta")
    graph = trace(model, (torch.zeros((8, SEQ), dtype=torch.long, device="meta"),),
                  model_name="llama3-8b")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=8)
    out = []
    for kw in (dict(tp=8, dp=8), dict(tp=8, cp=4, dp=2), dict(tp=8, cp=8)):
        for recompute in ("none", "full"):
            start = time.perf_counter()
            plan = meshplan.manual_plan(model, mesh, graph=graph, recompute=recompute,
                                        dtype="bf16", zero=1 if kw.get("dp", 1) > 1 else 0,
                                        microbatch_size=1, **kw)
            out.append(row(plan, case="8B manual", plan_s=round(time.perf_counter() - start, 1)))
            print(out[-1], flush=True)
    if quick:
        return out
    for cps in ((1,), (1, 2, 4, 8, 16)):
        start = time.perf_counter()
        try:
            plan = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16",
                                         context_parallel=cps, schedules=("1f1b",))
            out.append(row(plan, case=f"8B autoparallel cp in {list(cps)}",
                           plan_s=round(time.perf_counter() - start, 1)))
        except MeshplanError as exc:
            out.append({"case": f"8B autoparallel cp in {list(cps)}", "layout": "none fits",
                        "error": str(exc)[:300], "plan_s": round(time.perf_counter() - start, 1)})
        print(out[-1], flush=True)
    return out


def case_405b() -> list[dict]:
    model = parse_model_spec(LLAMA3_405B).build(device="meta")
    graph = trace(model, (torch.zeros((128, SEQ), dtype=torch.long, device="meta"),),
                  model_name="llama3-405b")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=16384 // 8)
    start = time.perf_counter()
    plan = least_recompute(model, mesh, graph, tp=8, cp=16, pp=16, dp=8, microbatch_size=1,
                           schedule="1f1b", zero=2)
    r = row(plan, case="405B manual, Table 4 layout", plan_s=round(time.perf_counter() - start, 1),
            published_tflops=PUBLISHED_405B_TFLOPS)
    r["error"] = round((r["tflops_per_gpu"] - PUBLISHED_405B_TFLOPS) / PUBLISHED_405B_TFLOPS, 4)
    print(r, flush=True)
    return [r]


def main() -> int:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    rows = case_8b(quick) + ([] if quick else case_405b())
    lines = ["| case | layout | recompute | ZeRO | fits | peak GiB | activations GiB | step s | "
             "TFLOP/s per GPU | breakdown (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r and "fits" not in r:
            lines.append(f"| {r['case']} | {r['layout']} | | | no | | | | | {r['error']} |")
            continue
        pub = f" (published {r['published_tflops']}, {r['error'] * 100:+.1f}%)" \
            if "published_tflops" in r else ""
        lines.append(f"| {r['case']} | {r['layout']} | {r['recompute']} | {r['zero']} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['peak_memory_gib']} | "
                     f"{r['activations_gib']} | {r['step_time_s']} | {r['tflops_per_gpu']}{pub} | "
                     f"{r['breakdown_s']} |")
    chunks = sorted({r["chunks"] for r in rows if r.get("chunks")})
    text = ("# Context parallelism: Llama 3 at 131,072 tokens on H100s\n\n"
            "DGX H100 preset, bf16, sequence 131,072; 8B: 8 sequences per step on 64 GPUs; "
            "405B: 128 sequences (16M tokens) on 16,384 GPUs, the layout of arXiv 2407.21783 "
            "Table 4 (TP8 CP16 PP16 DP8, published 380 TFLOP/s per GPU). TFLOP/s per GPU = "
            "predicted MFU x 989.\n\n" + "\n".join(lines) + "\n\nEach cp rank's sequence "
            "chunks (load-balanced for the causal mask):\n\n" + "\n".join(f"- {c}" for c in chunks)
            + "\n\nReproduce: `python benchmarks/context_parallel.py`.\n")
    print("\n" + text)
    if not quick:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "context_parallel.md"), "w") as f:
            f.write(text)
        with open(os.path.join(OUT, "context_parallel.json"), "w") as f:
            json.dump({"source": "arXiv 2407.21783, Table 4", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
