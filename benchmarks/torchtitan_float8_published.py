"""Cost model vs torchtitan's published Float8 runs: Llama-3.1-8B FSDP on 8 and 128 H100s,
fp8 beside bf16.

trace -> **cost**: the rows of ``torchtitan_published.py`` (FSDP = ZeRO-3 over every GPU,
local batch 2, sequence 8,192, selective activation checkpointing, the ``h100-96gb-hbm2e``
preset of torchtitan's Grand Teton H100s) planned with ``meshplan.manual_plan(...,
engine="torchtitan")`` in bf16 and in ``dtype="fp8"`` (costmodel/fp8.py: the block linears'
GEMMs in fp8 with torchao's tensorwise scaling, the weights all-gathered in fp8, as
torchtitan's float8 converter with ``enable_fsdp_float8_all_gather`` runs them).

Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (8 GPUs,
global batch 16) and Table 3 (128 GPUs, global batch 256): "FSDP + torch.compile" 6,667 and
6,514 tokens/s per GPU (77.0, 62.0 GiB), "FSDP + torch.compile + Float8" 8,532 and 8,380
(76.8, 61.8 GiB). Both published rows are compiled ("torch.compile" in both rows' names),
so both are priced compiled: ``meshplan.estimate(plan, compiled=True)`` (costmodel/fusion.py:
each block's elementwise work fused; torchao's casts fused into the compiled blocks,
``RuntimeModel.fp8_casts = "fused"``), and the errors of both are printed with the speedup
(Float8 over compiled bf16, published, against fp8 over bf16, predicted). Nothing is fitted
to these rows.

Run: python benchmarks/torchtitan_float8_published.py
Writes benchmarks/results/torchtitan_float8_published.{md,json}.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import meshplan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtitan_published import LLAMA3_8B, h100_mesh, torchtitan_graph  # noqa: E402

SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
# (GPUs, table, compiled bf16 tok/s/GPU, GiB, compiled Float8 tok/s/GPU, GiB)
ROWS = ((8, "Table 1", 6667, 77.0, 8532, 76.8), (128, "Table 3", 6514, 62.0, 8380, 61.8))
LOCAL_BATCH, SEQ = 2, 8192
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main() -> int:
    torch.set_num_threads(1)
    rows = []
    for gpus, table, bf16_pub, bf16_gib, fp8_pub, fp8_gib in ROWS:
        # torchtitan's model code (benchmarks/torchtitan_llama.py), traced with its loss
        model, graph = torchtitan_graph(LLAMA3_8B, LOCAL_BATCH * gpus, SEQ, "Llama-3.1-8B")
        mesh = h100_mesh(gpus)  # h100-96gb-hbm2e, SDPA's flash backend as the runs had it
        pred = {}
        for dtype in ("bf16", "fp8"):
            plan = meshplan.manual_plan(model, mesh, graph=graph, dp=gpus, zero=3,
                                        microbatch_size=LOCAL_BATCH, recompute="selective",
                                        dtype=dtype, engine="torchtitan")
            est = meshplan.estimate(plan, compiled=True)  # both published rows compiled
            pred[dtype] = {"tokens_per_gpu": round(LOCAL_BATCH * SEQ / est.step_time_s),
                           "step_time_s": round(est.step_time_s, 3),
                           "peak_memory_gib": round(est.peak_memory_gib, 1),
                           "breakdown_s": {k: round(v, 3) for k, v in est.breakdown.items()}}
        row = {"gpus": gpus, "source": f"{SOURCE} {table}",
               "published": {"bf16_compiled": bf16_pub, "bf16_gib": bf16_gib,
                             "float8_compiled": fp8_pub, "float8_gib": fp8_gib},
               "predicted": pred,
               "published_speedup": round(fp8_pub / bf16_pub, 3),
               "predicted_speedup": round(pred["fp8"]["tokens_per_gpu"]
                                          / pred["bf16"]["tokens_per_gpu"], 3),
               "bf16_error": round((pred["bf16"]["tokens_per_gpu"] - bf16_pub) / bf16_pub, 4),
               "fp8_error": round((pred["fp8"]["tokens_per_gpu"] - fp8_pub) / fp8_pub, 4)}
        rows.append(row)
        print(row, flush=True)
    lines = ["| GPUs | published bf16 (compiled) | published Float8 (compiled) | predicted bf16 "
             "| bf16 error | predicted fp8 | fp8 error | speedup published / predicted | "
             "published GiB (Float8) | predicted GiB (fp8) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, q = r["published"], r["predicted"]
        lines.append(f"| {r['gpus']} | {p['bf16_compiled']} | {p['float8_compiled']} | "
                     f"{q['bf16']['tokens_per_gpu']} | {r['bf16_error'] * 100:+.1f}% | "
                     f"{q['fp8']['tokens_per_gpu']} | "
                     f"{r['fp8_error'] * 100:+.1f}% | {r['published_speedup']} / "
                     f"{r['predicted_speedup']} | {p['float8_gib']} | "
                     f"{q['fp8']['peak_memory_gib']} |")
    text = ("# Cost model vs torchtitan's published Float8 runs (Llama-3.1-8B, FSDP, H100)\n\n"
            f"{SOURCE}; tokens/s per GPU. Priced with `manual_plan(..., engine=\"torchtitan\")` "
            "on h100-96gb-hbm2e, compiled as both published rows ran "
            "(`meshplan.estimate(plan, compiled=True)`).\n\n" + "\n".join(lines)
            + "\n\nReproduce: `python benchmarks/torchtitan_float8_published.py`.\n")
    print("\n" + text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "torchtitan_float8_published.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "torchtitan_float8_published.json"), "w") as f:
        json.dump({"source": SOURCE, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
