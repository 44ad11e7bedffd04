"""Cost model vs torchtitan's published Llama-3.1-8B FSDP runs on 8 and 128 H100s.

trace -> **cost**: Llama-3.1-8B (32 layers, hidden 4096, FFN 14336, 32 heads, 8 KV heads,
vocabulary 128,256) traced on the meta device at torchtitan's batch (local batch 2 x 8,192
tokens per GPU, 8 GPUs), planned by hand with ``meshplan.manual_plan`` as torchtitan ran it:
FSDP (ZeRO-3, ``fully_shard`` per block) over 8 GPUs, selective activation checkpointing,
bf16 parameters with fp32 reduction, AdamW; priced on the preset of torchtitan's hardware
(``h100-96gb-hbm2e``) for the engine that runs such a plan (the module engine: FSDP2 with
prefetch, SDPA with ``is_causal=True``) and for the graph engine.

Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (end of 2024), Table 1
(8 GPUs, global batch 16: FSDP 5,762 tokens/s per GPU, 82.4 GiB) and Table 3 (128 GPUs,
global batch 256: 5,605, 67.0 GiB); local batch 2, sequence 8,192, selective AC, no
torch.compile, no Float8. Their H100s are Grand Teton parts (96 GB HBM2e, 2.4 TB/s, 500 W,
400 Gb/s RDMA per GPU), not the 80 GB / 3.35 TB/s / 700 W SXM5 of ``dgx-h100``: the
``h100-96gb-hbm2e`` preset describes them (its peak, unpublished, is the midpoint of SXM
and NVL, as torchtitan's doc bounds it).

Run: python benchmarks/torchtitan_published.py.
Writes benchmarks/results/torchtitan_published.{md,json}.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import meshplan
from meshplan.tracing import trace
from meshplan.specs import parse_model_spec

SEQ, LOCAL_BATCH = 8192, 2
SPEC = ("transformers:llama?hidden_size=4096&intermediate_size=14336&num_hidden_layers=32"
        "&num_attention_heads=32&num_key_value_heads=8&vocab_size=128256"
        f"&max_position_embeddings={SEQ}")
# (GPUs, tokens/s per GPU, GiB): llama3_h100_202412_torchtitan.md Tables 1 and 3, "FSDP" rows
ROWS = ((8, 5762, 82.4), (128, 5605, 67.0))
PRESET = "h100-96gb-hbm2e"  # torchtitan's Grand Teton H100s (costmodel/presets)
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main() -> int:
    torch.set_num_threads(1)
    model = parse_model_spec(SPEC).build(device="meta")
    rows = []
    for gpus, published, published_gib in ROWS:
        ids = torch.zeros((LOCAL_BATCH * gpus, SEQ), dtype=torch.long, device="meta")
        graph = trace(model, (ids,), model_name="llama3.1-8b")
        mesh = meshplan.Mesh.preset(PRESET, nodes=gpus // 8)
        for engine in ("auto", "graph"):
            start = time.perf_counter()
            plan = meshplan.manual_plan(model, mesh, graph=graph, dp=gpus, zero=3,
                                        microbatch_size=LOCAL_BATCH, recompute="selective",
                                        dtype="bf16", engine=engine)
            est = plan.predicted
            tokens = LOCAL_BATCH * SEQ / est.step_time_s
            rows.append({"gpus": gpus, "engine": plan.engine,
                         "published_tokens_per_gpu": published, "published_gib": published_gib,
                         "predicted_tokens_per_gpu": round(tokens),
                         "error": round((tokens - published) / published, 4),
                         "predicted_mfu": round(est.mfu, 4),
                         "step_time_s": round(est.step_time_s, 3),
                         "peak_memory_gib": round(est.peak_memory_gib, 1), "fits": est.fits,
                         "breakdown_s": {k: round(v, 3) for k, v in est.breakdown.items()},
                         "memory_gib": {k: round(getattr(est.memory, f"{k}_gib"), 1) for k in
                                        ("params", "grads", "optimizer", "activations",
                                         "buffers")},
                         "estimate_s": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
    lines = ["| GPUs | engine | published tok/s/GPU | predicted | error | MFU | published GiB | "
             "peak GiB | breakdown (s) | memory (GiB) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gpus']} | {r['engine']} | {r['published_tokens_per_gpu']} | "
                     f"{r['predicted_tokens_per_gpu']} | {r['error'] * 100:+.1f}% | "
                     f"{r['predicted_mfu'] * 100:.1f}% | {r['published_gib']} | {r['peak_memory_gib']} | "
                     f"{r['breakdown_s']} | {r['memory_gib']} |")
    text = ("# Cost model vs torchtitan Llama-3.1-8B FSDP on 8 and 128 H100s\n\n"
            f"Preset {PRESET} (H100 96 GB HBM2e, 500 W), bf16, FSDP (ZeRO-3) over all GPUs, local batch {LOCAL_BATCH} x {SEQ}, "
            "selective recompute, AdamW. Published: pytorch/torchtitan "
            "benchmarks/llama3_h100_202412_torchtitan.md Tables 1 and 3 (eager; H100 96 GB, 500 W).\n\n" + "\n".join(lines)
            + "\n\nReproduce: `python benchmarks/torchtitan_published.py`.\n")
    print("\n" + text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "torchtitan_published.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "torchtitan_published.json"), "w") as f:
        json.dump({"source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md",
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
