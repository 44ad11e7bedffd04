"""The GPU presets' GEMM and fused-attention curves, fitted to the kernels measured on this
workplace's lent GPUs (benchmarks/gpu_check.py measure -> compare ->
benchmarks/results/gpu_check_h100.json, gpu_check.json).

trace -> **cost** -> solve. The cost model prices a GEMM of ``w`` FLOPs at
``w / (peak * max_eff * w / (w + half_work)) + kernel_latency_s`` and a fused attention
forward of ``w`` FLOPs (causal: half) the same way on the attention curve, read at the
FLOPs of one query row of one head (``compute.attention_work``), its backward at ``2.5 w`` with
twice the fixed cost (``compute.op_time``). This module finds, for each curve,
the (max_eff, half_work) whose prices are closest to the measured kernel times: least squares
on log(predicted / measured time) over a grid (``fit``), each point priced the way the model
prices it, so the fit and the estimate cannot disagree.

Points used:
- GEMM: every measured ``torch.mm`` bf16 shape of at least ``MIN_GEMM_FLOPS``. The smaller
  cubes (256^3 - 1024^3) are timed back to back from Python and measure the host's launch
  rate, not the kernel (1024^3: 55-176 TFLOP/s between repeats on the H100).
- attention: every forward + backward point of the backend (causal and not, seq 1K-16K,
  B x S = 16K tokens, 32 heads x 128), against forward + backward priced as above.

These are kernel-level measurements on one GPU; no training run, and none of the validation
rows of benchmarks/h100_validation.py, is used. ``python benchmarks/gpu_check.py fit``
writes the curves and their sources into the presets of ``FITS``.
"""

from __future__ import annotations

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PRESETS = os.path.join(ROOT, "costmodel", "presets")

MIN_GEMM_FLOPS = 1e10
ATTENTION_BACKWARD = 2.5  # compute.BACKWARD_FLOPS_FACTOR[ATTENTION]
# preset -> the record its curves come from (the H100 96GB HBM2e part at 500 W has the same
# GH100 chip as the measured H100 80GB: its curves are the same fractions of its own peak)
FITS = {"dgx-h100": "gpu_check_h100.json", "h100-96gb-hbm2e": "gpu_check_h100.json",
        "dgx-h200": "gpu_check.json"}
# preset curve -> attention backend measured (SDPA's flash backend is FlashAttention-2)
ATTENTION_CURVES = {"fa2": "flash", "cudnn": "cudnn"}


def _curve(max_eff: float, half_work: float, work: float) -> float:
    return max_eff * work / (work + half_work)


def gemm_time(max_eff, half_work, peak_tflops, latency_s, flops) -> float:
    """A GEMM as ``compute.op_time`` prices its forward: roofline on the curve + fixed cost."""
    return flops / (peak_tflops * 1e12 * _curve(max_eff, half_work, flops)) + latency_s


def attention_time(max_eff, half_work, peak_tflops, latency_s, fwd_flops, rows=1) -> float:
    """Forward + backward of one fused attention of ``rows`` query rows (batch x heads x
    queries) as ``compute.op_time`` prices them: the curve read at one row's work
    (``compute.attention_work``)."""
    p = peak_tflops * 1e12
    w = fwd_flops / rows
    fwd = fwd_flops / (p * _curve(max_eff, half_work, w)) + latency_s
    b = ATTENTION_BACKWARD * fwd_flops
    return fwd + b / (p * _curve(max_eff, half_work, ATTENTION_BACKWARD * w)) + 2 * latency_s


def fit(price, points) -> tuple[float, float, float]:
    """(max_eff, half_work, rms log error) minimizing sum(log(price(m, h, w) / t)^2) over
    ``points`` [(*args, measured seconds)]; ``price(max_eff, half_work, *args)``. A coarse grid
    (max_eff 0.01, half_work 10 a decade over 1e3-1e13), then a fine one (0.001, 30 a decade)
    around its best."""
    def err(m, h):
        return sum(math.log(price(m, h, *rest) / t) ** 2 for *rest, t in points)

    _, m0, k0 = min((err(e / 100, 10 ** (3 + k / 10)), e / 100, 3 * k)
                    for e in range(10, 100) for k in range(0, 101))
    best, m, h = min((err(e / 1000, 10 ** (3 + k / 30)), e / 1000, 10 ** (3 + k / 30))
                     for e in range(max(100, round(m0 * 1000) - 10), round(m0 * 1000) + 11)
                     for k in range(max(0, k0 - 3), min(300, k0 + 3) + 1))
    return m, float(f"{h:.3g}"), math.sqrt(best / len(points))


def gemm_points(record) -> list[tuple[float, float]]:
    return [(r["flops"], r["time_s"]) for r in record["sections"]["gemm_bf16"]["result"]
            if r["flops"] >= MIN_GEMM_FLOPS]


def attention_points(record, backend: str) -> list[tuple[float, float, int]]:
    """(forward FLOPs, measured forward + backward seconds, query rows) per point."""
    return [(r["fwd_flops"], r["fwd_bwd_time_s"], r["batch"] * r["heads"] * r["seq"])
            for r in record["sections"]["attention"]["result"]
            if r.get("backend") == backend and "error" not in r]


def fits_from(record, peak_tflops: float, latency_s: float) -> dict:
    """{"matmul": (max_eff, half_work, rms), "fa2": ..., "cudnn": ...} for one record."""
    out = {"matmul": fit(lambda m, h, w: gemm_time(m, h, peak_tflops, latency_s, w),
                         gemm_points(record))}
    for curve, backend in ATTENTION_CURVES.items():
        out[curve] = fit(lambda m, h, w, rows: attention_time(m, h, peak_tflops, latency_s,
                                                              w, rows),
                         [(w, rows, t) for w, t, rows in attention_points(record, backend)])
    return out


def load_record(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def measured_preset(device: str) -> str:
    """The preset of the GPU a record was measured on (``record["device"]``)."""
    return "dgx-h200" if "H200" in device else "dgx-h100"


def record_fits(record: dict) -> dict:
    """``fits_from`` at the peak and launch cost of the GPU ``record`` was measured on: its
    points are fractions of that GPU's peak, carried to every preset fitted from them."""
    with open(os.path.join(PRESETS, f"{measured_preset(record['device'])}.json")) as f:
        dev = json.load(f)["device"]
    return fits_from(record, dev["peak_tflops"]["bfloat16"], dev["kernel_latency_s"])


def _measured(record_name: str, record: dict, preset: str) -> str:
    part = ("" if preset != "h100-96gb-hbm2e" else
            " Measured on the H100 80GB HBM3 (700 W): the same GH100 chip and kernels, its "
            "fractions carried to this part's own peak (the 500 W cap is in the peak's range).")
    return (f"Fitted by benchmarks/gpu/kernel_fit.py (python benchmarks/gpu_check.py fit) to "
            f"kernel times measured on this workplace's lent {record['device']} (torch "
            f"{record['torch']}, CUDA events, median of 5; benchmarks/results/{record_name}); "
            "least squares on log time, each point against the curve's price as "
            "compute.op_time makes it (kernel_latency_s included). A kernel-level measurement, "
            f"not fitted to any training run or validation row.{part}")


def _result(fitted) -> str:
    m, h, rms = fitted
    return f"max_eff {m}, half_work {h:.3g}, rms {100 * rms:.1f}% over the points"


def write_presets(names=tuple(FITS)) -> dict:
    """Fit each preset's curves to its record and write them, with their sources, into
    costmodel/presets/<name>.json. Returns {preset: fits}."""
    done, fitted = {}, {}
    for preset in names:
        path = os.path.join(PRESETS, f"{preset}.json")
        with open(path) as f:
            data = json.load(f)
        dev = data["device"]
        record = load_record(FITS[preset])
        if FITS[preset] not in fitted:  # two presets share the H100's record: fit it once
            fitted[FITS[preset]] = record_fits(record)
        fits = fitted[FITS[preset]]
        src = data["sources"]
        m, h, _ = fits["matmul"]
        dev["matmul_efficiency"] = {"half_work": h, "max_eff": m}
        src["device.matmul_efficiency"] = (
            "bf16 torch.mm, every measured shape of >= 1e10 FLOPs (2048^3 to 16384^3 and the "
            "Llama 8B / 70B projections at 16K tokens): " + _result(fits["matmul"]) + ". "
            + _measured(FITS[preset], record, preset))
        src.pop("device.matmul_efficiency.measured", None)
        for curve in ATTENTION_CURVES:
            m, h, _ = fits[curve]
            dev["attention_kernels"][curve] = {"half_work": h, "max_eff": m}
        if "fa3" in dev["attention_kernels"]:  # published max_eff, no point measured: its
            # half_work is read per query row like the others', so it takes the fitted fa2's
            dev["attention_kernels"]["fa3"]["half_work"] = fits["fa2"][1]
        m, h, _ = fits["cudnn"]
        dev["attention_efficiency"] = {"half_work": h, "max_eff": m}
        fa3 = src.get("device.attention_kernels", "")
        start = fa3.find("fa3:")
        end = fa3.find("cudnn:", start) if start >= 0 else -1
        fa3 = "" if start < 0 else fa3[start:end if end >= 0 else len(fa3)].strip()
        src["device.attention_kernels"] = (
            "fused attention by kernel, bf16/fp16, fraction of dense peak for forward and "
            "backward alike (compute.op_time: causal on half the FLOPs, backward 2.5x the "
            "forward's). fa2, PyTorch SDPA's flash backend (FlashAttention-2): "
            + _result(fits["fa2"]) + "; cudnn, SDPA's cuDNN backend (the kernel Transformer "
            "Engine's FusedAttention runs on Hopper): " + _result(fits["cudnn"]) + ". Points: "
            "forward + backward of each backend, causal and not, seq 1K-16K at B x S = 16K "
            "tokens, 32 heads x 128; the curve is read at the FLOPs of one query row of one head "
            "(compute.attention_work), so it follows the sequence length, which the measurement "
            "varied. Published beside it: "
            "FlashAttention-2 reaches up to 335 TFLOP/s forward + backward on H100 SXM5, 34% "
            "of 989 (Dao 2023, arXiv 2307.08691, sec. 4.1). " + _measured(FITS[preset], record,
                                                                           preset)
            + (" The fa3 curve's half_work is the fitted fa2 curve's (read per query row "
               "like it; no fa3 point was measured)." if fa3 else "")
            + " " + (fa3 or "fa3: not measured."))
        src["device.attention_efficiency"] = (
            "the kernel PyTorch's SDPA runs by default on Hopper in bf16: cuDNN's since torch "
            "2.9 with a bundled cuDNN newer than 9.15 (pytorch/pytorch#162073, "
            "sdp_utils.cpp check_prefer_cudnn_attention; the torch 2.11 wheels cross it), "
            "seen in this workplace's profile of the one-GPU step (torch 2.11, "
            "benchmarks/results/kernel_profile_h200.json: cudnn_generated_fort_native_sdpa_"
            "sm90_flash_fprop / _bprop kernels). The cudnn curve of device.attention_kernels, "
            "same source. torch 2.5.1 to 2.8 ran the flash backend (FlashAttention-2) first "
            "(pytorch/pytorch#138522 made cuDNN opt-in): runs of those versions are priced on "
            "the fa2 curve (benchmarks/torchtitan_published.py)")
        with open(path, "w") as f:
            f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        done[preset] = fits
    return done
