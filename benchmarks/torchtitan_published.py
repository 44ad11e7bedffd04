"""Cost model vs torchtitan's published FSDP runs: Llama-3.1-8B on 8 and 128 H100s, and
Llama 3 / Llama 2 on 64 A100s.

trace -> **cost**: each model, written as torchtitan writes it (benchmarks/torchtitan_llama.py:
rotary embedding on complex numbers, which torch.compile leaves unfused, and torchtitan's
loss on the fp32 logits), traced on the meta device at torchtitan's batch (local batch x
sequence per GPU), planned by hand with ``meshplan.manual_plan`` as torchtitan ran it: FSDP
(ZeRO-3, ``fully_shard`` per block) over every GPU, the run's activation checkpointing, bf16
parameters with fp32 reduction, AdamW; priced on the preset of that hardware for the stack
that ran it (``engine="torchtitan"``: FSDP2 with prefetch as the module engine runs it, SDPA
with ``is_causal=True``, and torchtitan's own op-level selective AC, which saves SDPA's
outputs and every other block matmul's: tests/test_torchtitan_sac.py) and for meshplan's
graph engine. torchtitan logs the caching allocator's peak reserved memory
(``max_reserved_gib``), an upper bound of the peak of live tensors that meshplan predicts.

Sources:
- H100 rows: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (end of 2024),
  Table 1 (8 GPUs, global batch 16: FSDP 5,762 tokens/s per GPU, 82.4 GiB) and Table 3 (128
  GPUs, global batch 256: 5,605, 67.0 GiB); local batch 2, sequence 8,192, selective AC, no
  torch.compile, no Float8; Table 1's FSDP + torch.compile row (6,667) is priced with
  ``meshplan.estimate(plan, compiled=True)``. Their H100s are Grand Teton parts (96 GB HBM2e, 2.4 TB/s, 500 W,
  400 Gb/s RDMA per GPU), not the 80 GB / 3.35 TB/s / 700 W SXM5 of ``dgx-h100``: the
  ``h100-96gb-hbm2e`` preset describes them (its peak, unpublished, is the midpoint of SXM
  and NVL, as torchtitan's doc bounds it).
- A100 rows: pytorch/torchtitan docs/performance.md (2024), FSDP2 on 64 A100 80GB: Llama 3
  8B (local batch 1, sequence 8,192, selective op AC) 2,973 tokens/s per GPU; Llama 3 70B
  (local batch 1, full AC) 331; Llama 2 13B (local batch 2, sequence 4,096) 2,162 without AC
  and 1,904 with selective op AC, the 8B and 13B runs with torchtitan's fused RMSNorm
  (``NORM_TYPES``, from their train configs). No memory is published for these. Priced on
  ``dgx-a100-80gb`` (the preset the Megatron-LM rows use), unchanged: the same team's
  software on a part whose preset was not tuned to these rows, so they check the engine
  terms apart from the H100 part's unmeasured efficiency.

Run: python benchmarks/torchtitan_published.py [--only h100|a100]
[--a100-attention-efficiency E]. The last prices the A100 rows with fused attention at E of
peak (the preset has no attention curve, so attention runs on its GEMM curve, 0.8);
FlashAttention-2 reaches 50-73% of A100 peak (Dao 2023, abstract). A run with either
option prints its table and leaves the results files as they are.
Writes benchmarks/results/torchtitan_published.{md,json}.
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


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchtitan_llama  # noqa: E402  (Llama 3 as torchtitan writes it)

LLAMA3_8B = torchtitan_llama.LLAMA3_8B
LLAMA3_70B = torchtitan_llama.LLAMA3_70B
LLAMA2_13B = torchtitan_llama.LLAMA2_13B
LLAMA3_405B = torchtitan_llama.LLAMA3_405B


def torchtitan_graph(spec: dict, batch: int, seq: int, name: str, norm: str = "rmsnorm"):
    """(model, graph): torchtitan's model code (benchmarks/torchtitan_llama.py) of flavor
    ``spec`` on the meta device, traced with its loss at ``batch`` sequences of ``seq``;
    ``norm``: the run's ``norm_type``."""
    model = torchtitan_llama.build(**spec, max_seq=seq, norm=norm)
    ids = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    return model, trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss,
                        model_name=name)


H100 = "benchmarks/llama3_h100_202412_torchtitan.md"
A100 = "docs/performance.md"
# (hardware, model, spec, GPUs, local batch, sequence, recompute, tokens/s per GPU, GiB, source)
ROWS = (
    ("h100", "Llama-3.1-8B", LLAMA3_8B, 8, 2, 8192, "selective", 5762, 82.4, H100 + " Table 1"),
    ("h100", "Llama-3.1-8B", LLAMA3_8B, 128, 2, 8192, "selective", 5605, 67.0, H100 + " Table 3"),
    ("a100", "Llama-3-8B", LLAMA3_8B, 64, 1, 8192, "selective", 2973, None, A100),
    ("a100", "Llama-3-70B", LLAMA3_70B, 64, 1, 8192, "full", 331, None, A100),
    ("a100", "Llama-2-13B", LLAMA2_13B, 64, 2, 4096, "none", 2162, None, A100),
    ("a100", "Llama-2-13B", LLAMA2_13B, 64, 2, 4096, "selective", 1904, None, A100),
)
# torchtitan's norm_type of a row's run where it is not "rmsnorm": the April 2024 A100 runs'
# train configs (pytorch/torchtitan 395a526 train_configs/llama_13b.toml and 1ea476e
# train_configs/llama3_8b.toml: norm_type = "fused_rmsnorm", a Triton kernel that keeps only
# its input; llama_70b.toml: "rmsnorm"). The H100 runs' configs (9dec370, the commit their
# benchmark names) use "rmsnorm".
NORM_TYPES = {("a100", "Llama-3-8B"): "fused_rmsnorm", ("a100", "Llama-2-13B"): "fused_rmsnorm"}
# the same runs with torch.compile on (torchtitan compiles each TransformerBlock), priced with
# meshplan.estimate(plan, compiled=True): (hardware, GPUs) -> tokens/s per GPU, GiB, source
COMPILED = {("h100", 8): (6667, 77.0, H100 + " Table 1, FSDP + torch.compile"),
            ("h100", 128): (6514, 62.0, H100 + " Table 3, FSDP + torch.compile")}
# The same document's TP / PP / CP rows (Tables 2, 4, 5, 6), exactly as published. Every one
# runs torch.compile and Float8 (torchao, on nn.Linear) with bf16 elsewhere; "local batch" is
# per data-parallel (FSDP) rank; tokens/s per GPU as torchtitan logs it (over all GPUs).
# (table, model, spec, GPUs, FSDP, TP, PP, CP, local batch, sequence, schedule, AC,
#  techniques, tokens/s per GPU, GiB)
PARALLEL_ROWS = (
    ("Table 2", "Llama-3.1-8B", LLAMA3_8B, 8, 8, 1, 1, 1, 1, 32768, "", "full",
     "FSDP + CP + torch.compile + Float8", 3890, 83.9),
    ("Table 2", "Llama-3.1-8B", LLAMA3_8B, 8, 4, 1, 1, 2, 1, 65536, "", "full",
     "FSDP + CP + torch.compile + Float8", 2540, 84.2),
    ("Table 2", "Llama-3.1-8B", LLAMA3_8B, 8, 2, 1, 1, 4, 1, 131072, "", "full",
     "FSDP + CP + torch.compile + Float8", 1071, 84.0),
    ("Table 2", "Llama-3.1-8B", LLAMA3_8B, 8, 1, 1, 1, 8, 1, 262144, "", "full",
     "FSDP + CP + torch.compile + Float8", 548, 84.5),
    ("Table 4", "Llama-3.1-70B", LLAMA3_70B, 256, 32, 8, 1, 1, 16, 8192, "", "full",
     "2D (FSDP + TP) + torch.compile + Float8", 829, 71.9),
    ("Table 4", "Llama-3.1-70B", LLAMA3_70B, 256, 32, 8, 1, 1, 16, 8192, "", "full",
     "2D + AsyncTP + torch.compile + Float8", 876, 67.6),
    ("Table 5", "Llama-3.1-405B", LLAMA3_405B, 512, 8, 8, 8, 1, 32, 8192, "1F1B", "full",
     "3D + torch.compile + Float8 + AsyncTP", 100, 82.5),
    ("Table 5", "Llama-3.1-405B", LLAMA3_405B, 512, 8, 8, 8, 1, 32, 8192, "Interleaved 1F1B",
     "full", "3D + torch.compile + Float8 + AsyncTP", 128, 72.7),
    ("Table 6", "Llama-3.1-405B", LLAMA3_405B, 512, 8, 8, 8, 1, 8, 32768, "1F1B", "full",
     "4D + torch.compile + Float8 + AsyncTP", 76, 75.3),
    ("Table 6", "Llama-3.1-405B", LLAMA3_405B, 512, 4, 8, 8, 2, 8, 65536, "1F1B", "full",
     "4D + torch.compile + Float8 + AsyncTP", 47, 75.9),
    ("Table 6", "Llama-3.1-405B", LLAMA3_405B, 512, 2, 8, 8, 4, 8, 131072, "1F1B", "full",
     "4D + torch.compile + Float8 + AsyncTP", 31, 77.1),
    ("Table 6", "Llama-3.1-405B", LLAMA3_405B, 512, 1, 8, 8, 8, 8, 262144, "1F1B", "full",
     "4D + torch.compile + Float8 + AsyncTP", 16, 84.9),
)
PRESETS = {"h100": "h100-96gb-hbm2e",  # torchtitan's Grand Teton H100s (costmodel/presets)
           "a100": "dgx-a100-80gb"}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _with_attention_efficiency(mesh, max_eff: float):
    """``mesh`` whose device runs fused attention at ``max_eff`` of peak, flat: the curve is
    read at one query row's work (``compute.attention_work``, ~1e6 FLOPs), so the GEMM
    curve's half-work (3e9 kernel FLOPs on the A100) would price it under 0.1% of ``max_eff``."""
    from dataclasses import replace

    from meshplan.costmodel.hardware import EfficiencyCurve

    dev = mesh.hardware.device
    curve = EfficiencyCurve(half_work=0.0, max_eff=max_eff)
    return replace(mesh, hardware=replace(mesh.hardware,
                                          device=replace(dev, attention_efficiency=curve)))


def h100_mesh(gpus: int):
    """The mesh of torchtitan's published H100 runs: its Grand Teton part, with PyTorch's SDPA
    on the kernel the runs' torch chose. They ran torch nightlies of late 2024 / early 2025,
    when SDPA tried its flash backend (FlashAttention-2) first: cuDNN attention was opt-in
    from 2.5.1 (pytorch/pytorch#138522) until 2.9 made it the default on Hopper
    (pytorch/pytorch#162073), which the preset's default curve follows. So these rows are
    priced on the preset's fa2 curve (``DeviceSpec.with_attention_kernel``)."""
    from dataclasses import replace

    mesh = meshplan.Mesh.preset(PRESETS["h100"], nodes=gpus // 8)
    hw = mesh.hardware
    return replace(mesh, hardware=replace(hw, device=hw.device.with_attention_kernel("fa2")))


PEAK_BAND = (835.0, 912.0, 989.0)  # NVL datasheet, the preset's midpoint, SXM datasheet


def _peak_band(plan, compiled: bool, tokens: int, published: float) -> dict:
    """Step-time error of ``plan`` re-priced with the device's peaks scaled to each of
    ``PEAK_BAND`` (bf16 TFLOP/s), as ``meshplan.estimate(hardware=...)`` prices it."""
    from dataclasses import replace

    from meshplan.costmodel.hardware import HardwareProfile

    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    out = {}
    for peak in PEAK_BAND:
        scale = peak / hw.device.peak_tflops["bfloat16"]
        dev = replace(hw.device, peak_tflops={k: v * scale
                                              for k, v in hw.device.peak_tflops.items()})
        est = meshplan.estimate(plan, hardware=replace(hw, device=dev), compiled=compiled)
        out[peak] = round(published / (tokens / est.step_time_s) - 1, 4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(PRESETS), help="only the rows of this hardware")
    ap.add_argument("--a100-attention-efficiency", type=float, default=None,
                    help="price the A100 rows' fused attention at this fraction of peak")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for hw, name, spec, gpus, local_batch, seq, recompute, published, published_gib, source \
            in ROWS:
        if args.only and hw != args.only:
            continue
        norm = NORM_TYPES.get((hw, name), "rmsnorm")
        model, graph = torchtitan_graph(spec, local_batch * gpus, seq, name, norm)
        mesh = h100_mesh(gpus) if hw == "h100" else \
            meshplan.Mesh.preset(PRESETS[hw], nodes=gpus // 8)
        if hw == "a100" and args.a100_attention_efficiency is not None:
            mesh = _with_attention_efficiency(mesh, args.a100_attention_efficiency)
        compiled_row = COMPILED.get((hw, gpus))
        for engine, compiled in (("torchtitan", False), ("graph", False)) + \
                ((("torchtitan", True),) if compiled_row else ()):
            start = time.perf_counter()
            plan = meshplan.manual_plan(model, mesh, graph=graph, dp=gpus, zero=3,
                                        microbatch_size=local_batch, recompute=recompute,
                                        dtype="bf16", engine=engine)
            est = meshplan.estimate(plan, compiled=True) if compiled else plan.predicted
            if compiled:
                published, published_gib, source = compiled_row
            tokens = local_batch * seq / est.step_time_s
            rows.append({"hardware": PRESETS[hw], "model": name, "gpus": gpus,
                         "local_batch": local_batch, "seq": seq, "recompute": recompute,
                         "norm_type": norm,
                         "engine": plan.engine, "compiled": compiled, "source": source,
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
            if hw == "h100" and engine == "torchtitan":
                rows[-1]["peak_band"] = _peak_band(plan, compiled, local_batch * seq,
                                                   published)
    lines = ["| preset | model | GPUs | local batch x seq | AC | engine | compiled | "
             "published tok/s/GPU | predicted | error | MFU | published GiB | peak GiB | "
             "breakdown (s) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['hardware']} | {r['model']} | {r['gpus']} | "
                     f"{r['local_batch']} x {r['seq']} | {r['recompute']} | {r['engine']} | "
                     f"{'yes' if r['compiled'] else 'no'} | "
                     f"{r['published_tokens_per_gpu']} | {r['predicted_tokens_per_gpu']} | "
                     f"{r['error'] * 100:+.1f}% | {r['predicted_mfu'] * 100:.1f}% | "
                     f"{r['published_gib'] if r['published_gib'] is not None else '-'} | "
                     f"{r['peak_memory_gib']} | {r['breakdown_s']} |")
    band = [r for r in rows if "peak_band" in r]
    if band:
        lines += ["", "The H100 part's bf16 peak is not published: torchtitan's footnote puts it "
                  "between the NVL's 835 and the SXM's 989 TFLOP/s (the preset takes the "
                  "midpoint, 912). The same rows priced at either end (every dtype's peak "
                  "scaled alike), error in step time (+: predicted slower):", "",
                  "| GPUs | compiled | at 835 | at 912 | at 989 |", "|---|---|---|---|---|"]
        lines += [f"| {r['gpus']} | {'yes' if r['compiled'] else 'no'} | "
                  + " | ".join(f"{r['peak_band'][k] * 100:+.1f}%" for k in PEAK_BAND) + " |"
                  for r in band]
    text = ("# Cost model vs torchtitan's published FSDP runs\n\n"
            "FSDP (ZeRO-3) over all GPUs, bf16 with fp32 reduction, AdamW, no Float8; eager "
            "(every kernel eager PyTorch launches priced one by one: costmodel/eager.py), "
            "except the rows marked compiled (torch.compile per block, priced with "
            "`meshplan.estimate(plan, compiled=True)`: costmodel/fusion.py). H100 rows: preset h100-96gb-hbm2e (96 GB HBM2e, "
            f"500 W), pytorch/torchtitan {H100}. A100 rows: preset dgx-a100-80gb, "
            f"pytorch/torchtitan {A100} (64 A100 80GB; no memory published; the Llama 3 8B and "
            "Llama 2 13B runs with torchtitan's fused RMSNorm, as their train configs set "
            "`norm_type`). Activations are priced at the dtypes eager PyTorch keeps them in "
            "(DECISIONS 108: the fp32 chain of the unfused RMSNorm, the fp32 loss). "
            "Engine `torchtitan`: the torchtitan profile (FSDP2 as the module engine runs it, "
            "selective AC by torchtitan's own op-level rule: SDPA and every other block matmul "
            "saved, memory.alternate_matmuls); `graph`: meshplan's graph engine beside it. "
            "Published GiB is what torchtitan logs, the caching allocator's peak *reserved* "
            "memory (`max_reserved_gib`); peak GiB is the predicted peak of live tensors, "
            "which the reserved peak bounds from above.\n\n" + "\n".join(lines)
            + "\n\nReproduce: `python benchmarks/torchtitan_published.py`.\n")
    print("\n" + text)
    if args.only or args.a100_attention_efficiency is not None:
        return 0  # a partial or what-if run does not replace the results
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "torchtitan_published.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "torchtitan_published.json"), "w") as f:
        json.dump({"sources": {"h100": "pytorch/torchtitan " + H100,
                               "a100": "pytorch/torchtitan " + A100},
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
