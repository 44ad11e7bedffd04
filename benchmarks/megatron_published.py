"""Cost model vs published Megatron-LM runs (Narayanan et al. 2021, Table 1), all ten rows.

trace -> **cost**: each configuration is traced on the meta device, planned by hand with
``meshplan.manual_plan`` exactly as Megatron-LM's ``examples/sc21/run_table_1.sh`` ran it
(its TP, PP, DP, microbatch size, interleaving depth v, global batch, sequence 2048,
vocabulary 51,200, fp16 mixed precision, full activation recomputation; 1F1B, interleaved
1F1B where v > 1), priced on the DGX A100 80GB preset with the kernels Megatron ran then
(``MEGATRON_2021``: attention through memory, fused bias-GeLU, dropout 0.1). The measured step time is the
paper's FLOPs over the GPUs' published throughput, FLOPs per its eq. 3 (recompute
included): 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)). Every row ran on 80 GB A100s, so
every predicted peak must fit.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv 2104.04473), Table 1; microbatch, v and batch from
Megatron-LM examples/sc21/run_table_1.sh (copied in /work/shared/REFERENCES.md).

Run: python benchmarks/megatron_published.py [--rows 1.7b,18.4b,...]
Writes benchmarks/results/megatron_published.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import meshplan
from meshplan.tracing import trace
from meshplan.specs import example_inputs, parse_model_spec

SEQ, VOCAB = 2048, 51200  # Table 1 caption: sequence length 2048, vocabulary 51,200
# key: (layers, hidden, heads, TP, PP, GPUs, microbatch, v, global batch, TFLOP/s per GPU)
# Narayanan et al. 2021 Table 1 with run_table_1.sh's microbatch, interleaving and batch
ROWS = {
    "1.7b": (24, 2304, 24, 1, 1, 32, 16, 1, 512, 137),
    "3.6b": (30, 3072, 32, 2, 1, 64, 16, 1, 512, 138),
    "7.5b": (36, 4096, 32, 4, 1, 128, 16, 1, 512, 142),
    "18.4b": (40, 6144, 48, 8, 1, 256, 8, 1, 1024, 135),
    "39.1b": (48, 8192, 64, 8, 2, 512, 4, 1, 1536, 138),
    "76.1b": (60, 10240, 80, 8, 4, 1024, 2, 3, 1792, 140),
    "145.6b": (80, 12288, 96, 8, 8, 1536, 2, 2, 2304, 148),
    "310.1b": (96, 16384, 128, 8, 16, 1920, 1, 2, 2160, 155),
    "529.6b": (105, 20480, 128, 8, 35, 2520, 1, 3, 2520, 163),
    "1008b": (128, 25600, 160, 8, 64, 3072, 1, 1, 3072, 163),
}
# MT-NLG 530B (Smith et al. 2022, arXiv 2201.11990, section 2.4): 105 layers, hidden 20480,
# 128 heads, TP8 x PP35 on 280 / 350 / 420 DGX A100 80GB nodes (DP 8 / 10 / 12), global
# batch 1920 of 2048 tokens, measured 60.1 / 50.2 / 44.4 s per iteration (126 / 121 / 113
# TFLOP/s per GPU by eq. 3). DeepSpeed's pipeline engine (1F1B, gradients reduced after the
# flush) with its ZeRO stage 1 over DP and Megatron's TP; microbatch 1, full recompute: the
# paper does not list those two here, so they are Megatron's settings of the 530B row above.
# key: (layers, hidden, heads, TP, PP, GPUs, microbatch, v, global batch, measured s)
MTNLG = {
    "mt-nlg@2240": (105, 20480, 128, 8, 35, 2240, 1, 1, 1920, 60.1),
    "mt-nlg@2800": (105, 20480, 128, 8, 35, 2800, 1, 1, 1920, 50.2),
    "mt-nlg@3360": (105, 20480, 128, 8, 35, 3360, 1, 1, 1920, 44.4),
}
MEMORY_GIB = 80.0  # A100 SXM4 80GB
# The kernels Megatron-LM ran then (commit 6985e58 of examples/sc21/README.md, default
# arguments): attention and hidden dropout 0.1 (--attention-dropout, --hidden-dropout);
# the bias-GeLU fusion (--bias-gelu-fusion, megatron/model/fused_bias_gelu.py: one
# tanh-approximation kernel, here the one aten.gelu(approximate="tanh") of
# gelu_pytorch_tanh rather than gelu_new's eight elementwise operators); no fused
# attention (FlashAttention came in 2022): Q K^T, the fused scale-mask-softmax kernel,
# dropout and P V through memory, priced by RuntimeModel(attention="materialized").
MEGATRON_2021 = ("&attn_pdrop=0.1&resid_pdrop=0.1&embd_pdrop=0.1"
                 "&activation_function=gelu_pytorch_tanh")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with recomputation (Narayanan et al. 2021, section 5.1, eq. 3)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt_graph(layers: int, hidden: int, heads: int, batch: int, *, vocab: int = VOCAB,
              seq: int = SEQ, name: str = "megatron", config: str = ""):
    """Megatron-LM's GPT as transformers' GPT-2 (same blocks: pre-LN attention and a 4h GeLU
    MLP) built on the meta device and traced at one global batch: (model, graph, seconds).
    ``config``: more ``&key=value`` settings of the spec (``MEGATRON_2021``'s kernels)."""
    spec = parse_model_spec(f"transformers:gpt2?n_layer={layers}&n_embd={hidden}&n_head={heads}"
                            f"&vocab_size={vocab}&n_positions={seq}{config}")
    model = spec.build(device="meta")
    start = time.perf_counter()
    graph = trace(model, example_inputs(model, batch, seq), model_name=name)
    return model, graph, time.perf_counter() - start


def megatron_plan(model, graph, *, gpus: int, tp: int, pp: int, mb: int, v: int = 1,
                  recompute: str = "full", sequence_parallel: bool = False,
                  dtype: str = "fp16", zero: int = 0, preset: str = "dgx-a100-80gb",
                  gpus_per_node: int = 8, engine: str = "megatron-2021"):
    """One Megatron-LM configuration written by hand as ``meshplan.manual_plan`` builds it, on
    ``gpus / gpus_per_node`` nodes of ``preset``: dp = gpus / (tp pp), 1F1B, interleaved 1F1B
    with ``v`` virtual stages where v > 1. Priced as ``engine`` runs it (a stack of
    ``meshplan.costmodel.estimate.STACKS``: Megatron ran fp16 pipelines with loss scaling,
    which meshplan's pipeline runtime does not, so the plan is priced, and its
    ``engine_note`` says meshplan's runtimes cannot run it)."""
    mesh = meshplan.Mesh.preset(preset, nodes=gpus // gpus_per_node)
    return meshplan.manual_plan(model, mesh, graph=graph, dp=gpus // (tp * pp), tp=tp, pp=pp,
                                microbatch_size=mb,
                                schedule="interleaved-1f1b" if v > 1 else "1f1b",
                                virtual_stages=v, recompute=recompute,
                                sequence_parallel=sequence_parallel, dtype=dtype, zero=zero,
                                engine=engine)


def _priced(est) -> dict:
    """The prediction's memory, fit, bubble and breakdown, as both tables record them."""
    return {"peak_memory_gib": round(est.peak_memory_gib, 1),
            "fits_80gib": est.peak_memory_gib <= MEMORY_GIB,
            "memory_gib": {k: round(getattr(est.memory, k), 1) for k in
                           ("params_gib", "grads_gib", "optimizer_gib", "activations_gib",
                            "buffers_gib")},
            "bubble_fraction": round(est.bubble_fraction, 3),
            "breakdown_s": {k: round(v, 3) for k, v in est.breakdown.items()}}


def predict(key: str) -> dict:
    layers, hidden, heads, tp, pp, gpus, mb, v, batch, published = ROWS[key]
    dp = gpus // (tp * pp)
    model, graph, traced = gpt_graph(layers, hidden, heads, batch, name=f"megatron-{key}",
                                     config=MEGATRON_2021)
    start = time.perf_counter()
    plan = megatron_plan(model, graph, gpus=gpus, tp=tp, pp=pp, mb=mb, v=v)
    est = plan.predicted
    measured_s = paper_flops(batch, SEQ, layers, hidden, VOCAB) / (gpus * published * 1e12)
    tflops = paper_flops(batch, SEQ, layers, hidden, VOCAB) / (est.step_time_s * gpus) / 1e12
    return {"model": f"{key.upper()}", "tp": tp, "pp": pp, "dp": dp, "gpus": gpus,
            "microbatch_size": mb, "v": v, "batch": batch, "published_tflops": published,
            "predicted_tflops": round(tflops, 1), "measured_step_s": round(measured_s, 3),
            "predicted_step_s": round(est.step_time_s, 3),
            "error": round((est.step_time_s - measured_s) / measured_s, 4),
            **_priced(est),
            "trace_s": round(traced, 1), "estimate_s": round(time.perf_counter() - start, 1)}


def predict_mtnlg(key: str) -> dict:
    """One MT-NLG run (``MTNLG``) priced as the Table 1 rows are, with DeepSpeed's ZeRO-1."""
    layers, hidden, heads, tp, pp, gpus, mb, v, batch, measured_s = MTNLG[key]
    model, graph, traced = gpt_graph(layers, hidden, heads, batch, name=key,
                                     config=MEGATRON_2021)
    plan = megatron_plan(model, graph, gpus=gpus, tp=tp, pp=pp, mb=mb, v=v, zero=1)
    est = plan.predicted
    flops = paper_flops(batch, SEQ, layers, hidden, VOCAB)
    return {"model": key, "tp": tp, "pp": pp, "dp": gpus // (tp * pp), "gpus": gpus,
            "microbatch_size": mb, "v": v, "batch": batch,
            "published_tflops": round(flops / (gpus * measured_s) / 1e12, 1),
            "predicted_tflops": round(flops / (est.step_time_s * gpus) / 1e12, 1),
            "measured_step_s": measured_s, "predicted_step_s": round(est.step_time_s, 3),
            "error": round((est.step_time_s - measured_s) / measured_s, 4),
            **_priced(est),
            "trace_s": round(traced, 1)}


def table(results: list[dict]) -> str:
    lines = ["| model | TP | PP | DP | mb | v | batch | measured s | predicted s | error | "
             "TFLOP/s published / predicted | peak GiB | bubble |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['tp']} | {r['pp']} | {r['dp']} | "
                     f"{r['microbatch_size']} | {r['v']} | {r['batch']} | "
                     f"{r['measured_step_s']} | {r['predicted_step_s']} | "
                     f"{r['error'] * 100:+.1f}% | {r['published_tflops']} / "
                     f"{r['predicted_tflops']} | {r['peak_memory_gib']} | "
                     f"{r['bubble_fraction'] * 100:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"subset of {', '.join(ROWS)}")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for key in args.rows.split(","):
        r = predict(key.strip())
        results.append(r)
        print(f"{r['model']}: step {r['predicted_step_s']} s predicted, {r['measured_step_s']} s "
              f"measured ({r['error'] * 100:+.1f}%), peak {r['peak_memory_gib']} GiB "
              f"{r['memory_gib']}, breakdown {r['breakdown_s']}", flush=True)
    mtnlg = [predict_mtnlg(k) for k in MTNLG] if args.rows == ",".join(ROWS) else []
    for r in mtnlg:
        print(r, flush=True)
    return write_results(results, mtnlg)


def write_results(results: list[dict], mtnlg: list[dict] = ()) -> int:
    """The table, MAPE and fit count of ``results``, printed and written to results/."""
    mape = sum(abs(r["error"]) for r in results) / len(results)
    fit = sum(r["fits_80gib"] for r in results)
    text = (f"# Cost model vs Megatron-LM (Narayanan et al. 2021, Table 1)\n\n"
            f"DGX A100 80GB preset; the configurations of Megatron-LM's "
            f"examples/sc21/run_table_1.sh: fp16, full recompute, sequence {SEQ}, vocabulary "
            f"{VOCAB}, 1F1B (interleaved where v > 1). Measured step time = FLOPs (eq. 3, "
            f"recompute included) / (GPUs x published TFLOP/s). Priced with the kernels Megatron "
            f"ran in 2021: attention through memory (no fused attention), the fused bias-GeLU, "
            f"dropout 0.1 (docs/DECISIONS.md 55).\n\n{table(results)}\n\n"
            f"Step-time MAPE {mape * 100:.1f}% over {len(results)} rows; {fit} of "
            f"{len(results)} fit in {MEMORY_GIB:.0f} GiB.\n"
            "Source: arXiv 2104.04473, Table 1. Reproduce: "
            "`python benchmarks/megatron_published.py`.\n")
    if mtnlg:
        text += ("\n## MT-NLG 530B (Smith et al. 2022, arXiv 2201.11990, section 2.4)\n\n"
                 "The same model shape as Table 1's 529.6B row, TP8 x PP35, global batch 1920, "
                 "measured seconds per iteration as published (TFLOP/s by eq. 3); DeepSpeed's "
                 "pipeline engine: 1F1B, ZeRO-1 over DP, gradients reduced after the flush, "
                 "priced with the same 2021 kernels; microbatch 1 and full recompute as "
                 "Megatron's 530B row (the section does not list them).\n\n"
                 + table(list(mtnlg)) + f"\n\n{sum(r['fits_80gib'] for r in mtnlg)} of "
                 f"{len(mtnlg)} fit in {MEMORY_GIB:.0f} GiB.\n")
    print("\n" + text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "megatron_published.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "megatron_published.json"), "w") as f:
        json.dump({"source": "Narayanan et al. 2021, arXiv 2104.04473, Table 1; "
                   "Megatron-LM examples/sc21/run_table_1.sh", "mape": round(mape, 4),
                   "rows": results,
                   "mtnlg_source": "Smith et al. 2022, arXiv 2201.11990, section 2.4",
                   "mtnlg_rows": list(mtnlg)}, f, indent=1)
    return 0 if fit == len(results) and all(r["fits_80gib"] for r in mtnlg) else 1


if __name__ == "__main__":
    sys.exit(main())
