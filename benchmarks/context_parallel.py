"""Planning showcase for context parallelism (cp): long-context Llama 3 on H100s.

trace -> cost -> solve: two published-scale cases, traced on the meta device, planned and
priced on the DGX H100 preset (bf16), through the public API only:

1. Llama-3-8B (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocabulary
   128,256) at 131,072 tokens per sequence, 8 sequences per step, on 64 H100s (8 nodes):
   the same TP8 with dp8, cp4 x dp2 and cp8, each priced as meshplan's graph engine runs cp
   today and as the composable engine runs it (``meshplan.estimate(plan,
   engine="modules")``: PyTorch's context_parallel, causal attention halved on head-tail
   chunks, no mask, K/V all-gathered and their gradients reduce-scattered, the loss on each
   rank's chunk, FSDP/ZeRO over dp x cp), and what ``meshplan.autoparallel`` picks with and
   without cp in its search (the search prices the graph engine);
2. Llama 3 405B at 131,072 tokens on 16,384 H100s in the paper's layout: TP8 with
   sequence parallelism, CP16, PP16, DP8, 16M tokens per step (128 sequences), microbatch
   1, the distributed optimizer (ZeRO-1 over dp x cp), priced as Megatron-LM / NeMo run it
   (``engine="megatron"``) and as the composable engine would (``engine="torchtitan"``,
   the module engine's terms), for 1F1B and interleaved
   1F1B with 2 and 4 virtual stages (the paper does not give its interleaving depth),
   each with the least recompute that fits; predicted TFLOP/s per GPU against the
   published 380 (Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4:
   16,384 GPUs, 131,072 tokens, TP8 CP16 PP16 DP8, 380 TFLOP/s per GPU, 38% MFU).

TFLOP/s per GPU = the traced model's FLOPs (forward + 2x backward, attention counted whole)
/ (step x GPUs); ``causal TFLOP/s`` counts causal attention at half its FLOPs (the work the
kernels do), the paper does not say which it counts.

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
from meshplan.graph import OpKind
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


def attention_fraction(graph) -> float:
    """Share of the traced FLOPs in attention cores (halved under causal attention)."""
    att = sum(n.flops for n in graph.nodes if n.kind == OpKind.ATTENTION)
    return att / graph.forward_flops if graph.forward_flops else 0.0


def row(plan, est, graph, **extra) -> dict:
    st = plan.stages[0]
    t = plan.training
    axes = dict(zip(st.axis_names, st.mesh_shape))
    pp = plan.num_stages // (t.virtual_stages if t.schedule == "interleaved-1f1b" else 1)
    tflops = est.mfu * H100_BF16_TFLOPS
    return {**extra, "layout": " ".join(f"{k}{v}" for k, v in axes.items()) + f" pp{pp}"
            + (" sp" if t.sequence_parallel else ""),
            "schedule": t.schedule + (f" v{t.virtual_stages}" if t.virtual_stages > 1 else ""),
            "recompute": st.recompute, "zero": st.zero, "microbatches": t.microbatches,
            "fits": est.fits, "peak_memory_gib": round(est.peak_memory_gib, 1),
            "activations_gib": round(est.memory.activations_gib, 1),
            "step_time_s": round(est.step_time_s, 2), "mfu": round(est.mfu, 4),
            "tflops_per_gpu": round(tflops, 1),
            "causal_tflops_per_gpu": round(tflops * (1 - attention_fraction(graph) / 2), 1),
            "breakdown_s": {k: round(v, 2) for k, v in est.breakdown.items()},
            "chunks": chunk_words(SEQ, axes["cp"], limit=2) if "cp" in axes else ""}


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
            s = round(time.perf_counter() - start, 1)
            for engine in ("graph", "modules"):
                est = meshplan.estimate(plan, engine=engine)
                out.append(row(plan, est, graph, case=f"8B manual ({engine})", plan_s=s))
                print(out[-1], flush=True)
    if quick:
        return out
    for cps in ((1,), (1, 2, 4, 8, 16)):
        start = time.perf_counter()
        try:
            plan = meshplan.autoparallel(model, mesh, graph=graph, dtype="bf16",
                                         context_parallel=cps, schedules=("1f1b",))
            out.append(row(plan, plan.predicted, graph,
                           case=f"8B autoparallel cp in {list(cps)} ({plan.engine})",
                           plan_s=round(time.perf_counter() - start, 1)))
        except MeshplanError as exc:
            out.append({"case": f"8B autoparallel cp in {list(cps)}", "layout": "none fits",
                        "error": str(exc)[:300], "plan_s": round(time.perf_counter() - start, 1)})
        print(out[-1], flush=True)
    return out


def least_recompute(model, mesh, graph, engine, **kw):
    """The plan with the least recompute that fits as ``engine`` runs it (the last tried
    when none does)."""
    for recompute in ("none", "selective", "full"):
        plan = meshplan.manual_plan(model, mesh, graph=graph, recompute=recompute,
                                    dtype="bf16", engine=engine, **kw)
        if plan.predicted.fits:
            break
    return plan, plan.predicted


def case_405b() -> list[dict]:
    model = parse_model_spec(LLAMA3_405B).build(device="meta")
    graph = trace(model, (torch.zeros((128, SEQ), dtype=torch.long, device="meta"),),
                  model_name="llama3-405b")
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=16384 // 8)
    out = []
    # "torchtitan": the composable engine's terms (the module engine's runtime: FSDP2 over
    # dp x cp, PyTorch's context_parallel, SDPA flash attention, TP exposed), priced as a
    # stack because meshplan's runtimes do not run SP with cp yet
    for engine in ("megatron", "torchtitan"):
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)):
            start = time.perf_counter()
            plan, est = least_recompute(model, mesh, graph, engine,
                                        tp=8, cp=16, pp=16, dp=8, microbatch_size=1,
                                        schedule=schedule, virtual_stages=v, zero=1,
                                        sequence_parallel=True)
            r = row(plan, est, graph, case=f"405B Table 4 layout ({engine})",
                    plan_s=round(time.perf_counter() - start, 1),
                    published_tflops=PUBLISHED_405B_TFLOPS)
            r["error"] = round((r["tflops_per_gpu"] - PUBLISHED_405B_TFLOPS)
                               / PUBLISHED_405B_TFLOPS, 4)
            out.append(r)
            print(r, flush=True)
    return out


def main() -> int:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    rows = case_8b(quick) + ([] if quick else case_405b())
    lines = ["| case | layout | schedule | recompute | ZeRO | fits | peak GiB | activations GiB "
             "| step s | TFLOP/s per GPU | causal TFLOP/s | plan s | breakdown (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r and "fits" not in r:
            lines.append(f"| {r['case']} | {r['layout']} | | | | no | | | | | | {r['plan_s']} "
                         f"| {r['error']} |")
            continue
        pub = f" (published {r['published_tflops']}, {r['error'] * 100:+.1f}%)" \
            if "published_tflops" in r else ""
        lines.append(f"| {r['case']} | {r['layout']} | {r['schedule']} | {r['recompute']} | "
                     f"{r['zero']} | {'yes' if r['fits'] else 'no'} | {r['peak_memory_gib']} | "
                     f"{r['activations_gib']} | {r['step_time_s']} | {r['tflops_per_gpu']}{pub} "
                     f"| {r['causal_tflops_per_gpu']} | {r['plan_s']} | {r['breakdown_s']} |")
    chunks = sorted({r["chunks"] for r in rows if r.get("chunks")})
    text = ("# Context parallelism: Llama 3 at 131,072 tokens on H100s\n\n"
            "DGX H100 preset, bf16, sequence 131,072; 8B: 8 sequences per step on 64 GPUs; "
            "405B: 128 sequences (16M tokens) on 16,384 GPUs, the layout of arXiv 2407.21783 "
            "Table 4 (TP8 CP16 PP16 DP8, published 380 TFLOP/s per GPU), its interleaving depth "
            "unpublished. TFLOP/s per GPU = predicted MFU x 989 (attention FLOPs counted "
            "whole); causal TFLOP/s counts causal attention at half. (graph): meshplan's graph "
            "engine's cp as it runs today; (modules), (torchtitan): the composable engine's "
            "cp (PyTorch's context_parallel, FSDP over dp x cp); (megatron): Megatron-LM / NeMo "
            "(costmodel/estimate.py megatron_runtime).\n\n" + "\n".join(lines) + "\n\nEach cp rank's sequence "
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
