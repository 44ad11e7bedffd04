"""The CPU machine's side of benchmarks/gpu_check.py: measured GPU points against the preset's
curves and the one-GPU step against the plan's prediction; writes
benchmarks/results/gpu_check.{md,json}. The preset is read, not changed: its GEMM and
attention curves are fitted to these kernel points by ``gpu_check.py fit``
(benchmarks/gpu/kernel_fit.py); the one-GPU step is never fitted."""

from __future__ import annotations

import json
import os
import statistics

from meshplan.costmodel.hardware import load_preset
from meshplan.plan import Plan

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(os.path.dirname(HERE), "results")


def _steps(sec):
    t = sec["result"]["step_times_s"][2:]  # two warm-up steps (allocator, compile) dropped
    return statistics.median(t), min(t), max(t)


def compare(*dirs: str) -> None:
    raws = [json.load(open(os.path.join(d, "gpu_check_raw.json"))) for d in dirs]
    sections = {}
    for raw in raws:  # later runs add or replace sections (a rerun of the step sections)
        sections.update({k: v for k, v in raw["sections"].items() if "result" in v})
    device = raws[-1]["device"]
    from kernel_fit import measured_preset
    preset = measured_preset(device)
    dev = load_preset(preset).device
    peak = dev.peak_tflops["bfloat16"]
    short = preset.split("-")[1]
    plan = Plan.from_json(os.path.join(HERE, f"plan_{short}.json"))
    plan4 = Plan.from_json(os.path.join(HERE, f"plan_{short}_mb4.json"))
    lines = [f"# GPU check: {device} (torch {raws[-1]['torch']}), against preset `{preset}`", "",
             "Measured by `benchmarks/gpu/run_on_device.sh` (benchmarks/gpu_check.py measure) on "
             "a lent GPU machine of this workplace; CUDA events, median of 5 timed batches of "
             "calls after 3 warm-ups, [min, max] of the 5 in brackets. The preset's GEMM and "
             "attention curves are fitted to these kernel points (`python benchmarks/gpu_check.py "
             "fit`, benchmarks/gpu/kernel_fit.py); the one-GPU step below is not.", ""]
    bw = sections["bandwidth"]["result"]
    lines += [f"HBM copy: {bw['gbps']:.0f} GB/s counting read + write "
              f"([{bw['gbps_range'][0]:.0f}, {bw['gbps_range'][1]:.0f}]); preset "
              f"{dev.memory_bandwidth_gbps:.0f} x max efficiency {dev.memory_efficiency.max_eff} "
              f"= {dev.memory_bandwidth_gbps * dev.memory_efficiency.max_eff:.0f} GB/s.", ""]
    from kernel_fit import gemm_time
    c = dev.matmul_efficiency

    def gemm_price(flops):
        return gemm_time(c.max_eff, c.half_work, peak, dev.kernel_latency_s, flops)

    lines += ["## bf16 GEMM (torch.mm)", "",
              "'preset %': the GEMM as the preset prices it (its curve and kernel launch).", "",
              "| m | k | n | GFLOP | measured TFLOP/s [min, max] | % of peak | preset % |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sections["gemm_bf16"]["result"]:
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['flops'] / 1e9:.1f} | "
                     f"{r['tflops']:.0f} [{r['tflops_min']:.0f}, {r['tflops_max']:.0f}] | "
                     f"{100 * r['tflops'] / peak:.1f} | "
                     f"{100 * r['flops'] / gemm_price(r['flops']) / (peak * 1e12):.1f} |")
    from kernel_fit import ATTENTION_CURVES, attention_time
    curves = {backend: dev.attention_kernels.get(curve) for curve, backend in
              ATTENTION_CURVES.items()}
    lines += ["", "## Attention (F.scaled_dot_product_attention, bf16, 32 heads x 128, B x S = 16K "
              "tokens)", "",
              "TFLOP/s on the FLOPs the kernel does (causal: half of 4BHS²D forward; backward "
              "2.5x forward). 'preset %': forward + backward as the preset prices it, on its "
              "curve for the backend (fa2 for flash, cudnn), read at one query row's work "
              "(compute.attention_work).", "",
              "| backend | seq | causal | fwd TFLOP/s | fwd % peak | fwd+bwd TFLOP/s | "
              "fwd+bwd % peak | preset % |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in sections["attention"]["result"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['seq']} | {r['causal']} | error: "
                         f"{r['error'][:60]} | | | | |")
            continue
        c = curves.get(r["backend"])
        if c is None:
            pre = ""
        else:
            t = attention_time(c.max_eff, c.half_work, peak, dev.kernel_latency_s,
                               r["fwd_flops"], r["batch"] * r["heads"] * r["seq"])
            pre = f"{100 * 3.5 * r['fwd_flops'] / t / (peak * 1e12):.1f}"
        lines.append(f"| {r['backend']} | {r['seq']} | {r['causal']} | {r['fwd_tflops']:.0f} | "
                     f"{100 * r['fwd_tflops'] / peak:.1f} | {r['fwd_bwd_tflops']:.0f} | "
                     f"{100 * r['fwd_bwd_tflops'] / peak:.1f} | {pre} |")
    fp8_peak = 2 * peak  # Hopper dense fp8 = 2x bf16 (H100/H200 datasheets: 1,979 TFLOP/s)
    lines += ["", "## fp8 e4m3 GEMM (torch._scaled_mm, bf16 out)", "",
              f"% of the dense fp8 peak {fp8_peak:.0f} TFLOP/s (datasheet: 2x bf16). 'with cast "
              "+ amax': the bf16 inputs' amax, scale and cast to fp8 done unfused in eager "
              "PyTorch before each product (dynamic tensorwise scaling without a fused cast "
              "kernel).", "",
              "| m | k | n | scaling | TFLOP/s [min, max] | % fp8 peak | with cast + amax TFLOP/s |",
              "|---:|---:|---:|---|---:|---:|---:|"]
    for r in sections["fp8_gemm"]["result"]:
        if "error" in r:
            lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['scaling']} | error | | |")
            continue
        cast = f"{r['with_cast_amax_tflops']:.0f}" if r.get("with_cast_amax_tflops") else ""
        lines.append(f"| {r['m']} | {r['k']} | {r['n']} | {r['scaling']} | {r['tflops']:.0f} "
                     f"[{r['tflops_min']:.0f}, {r['tflops_max']:.0f}] | "
                     f"{100 * r['tflops'] / fp8_peak:.1f} | {cast} |")
    p, p4 = plan.predicted, plan4.predicted
    # compiled runs are priced by the fusion pass (costmodel/fusion.py): re-trace the model
    # (its fingerprint must match the plans') and estimate with compiled=True
    import sys

    import torch

    import meshplan
    sys.path.insert(0, HERE)
    import model as M
    with torch.device("meta"):
        net = M.gpu_llama()
    graph = meshplan.trace(net, (torch.zeros(4, 4096, dtype=torch.long, device="meta"),))
    pc, p4c = (meshplan.estimate(x, graph, compiled=True) for x in (plan, plan4))
    lines += ["", "## One bf16 training step on one GPU", "",
              "benchmarks/gpu/model.py `gpu_llama` (0.886B parameters, 16 layers, hidden 2048, "
              "GQA 16/8 heads, SDPA `is_causal=True`), global batch 4 x 4096 tokens, AdamW. "
              f"Plans (manual_plan dp=1, bf16, engine `{plan.engine}`): "
              f"benchmarks/gpu/plan_{short}.json, 4 microbatches of 1 sequence, predicted "
              f"{p.step_time_s * 1e3:.1f} ms and {p.peak_memory_gib:.1f} GiB; "
              f"plan_{short}_mb4.json, one microbatch of 4 (as the plain PyTorch step), predicted "
              f"{p4.step_time_s * 1e3:.1f} ms and {p4.peak_memory_gib:.1f} GiB, on `{preset}`. "
              "Step times: median of steps 3-10 [min, max]; peak: torch.cuda.max_memory_allocated. "
              "Compiled rows are priced with `meshplan.estimate(plan, compiled=True)` (the fusion pass), eager rows are the plan's own prediction.", "",
              "| run | measured ms [min, max] | each run's median ms | predicted / measured | "
              "peak GiB | predicted GiB / measured |", "|---|---:|---:|---:|---:|---:|"]
    rows = {}
    for key, label, est in (
            ("plain_eager", "plain PyTorch, eager (autocast bf16, fused AdamW), 1 x 4", None),
            ("meshplan_eager_mb4", "meshplan.parallelize, eager, 1 microbatch x 4", p4),
            ("meshplan_eager", "meshplan.parallelize, eager, 4 microbatches x 1", p),
            ("plain_compiled", "plain PyTorch, torch.compile per block, 1 x 4", None),
            ("meshplan_compiled_mb4", "meshplan.parallelize(compile=True), 1 microbatch x 4", p4c),
            ("meshplan_compiled", "meshplan.parallelize(compile=True), 4 microbatches x 1", pc)):
        if key not in sections:
            continue
        med, lo, hi = _steps(sections[key])
        peak_gib = sections[key]["result"]["peak_gib"]
        rows[key] = {"median_s": med, "min_s": lo, "max_s": hi, "peak_gib": peak_gib,
                     "predicted_s": est.step_time_s if est else None,
                     "predicted_gib": est.peak_memory_gib if est else None}
        pred = (f"{est.step_time_s / med:.3f}", f"{est.peak_memory_gib / peak_gib:.3f}") \
            if est else ("", "")
        # the same section measured by several runs (a repeat on a fresh machine): their spread
        each = [_steps(r["sections"][key])[0] for r in raws
                if "result" in r["sections"].get(key, {})]
        rows[key]["each_run_median_s"] = each
        lines.append(f"| {label} | {med * 1e3:.1f} [{lo * 1e3:.1f}, {hi * 1e3:.1f}] | "
                     f"{', '.join(f'{e * 1e3:.1f}' for e in each)} | {pred[0]} | "
                     f"{peak_gib:.1f} | {pred[1]} |")
    phases_path = os.path.join(RESULTS, f"memory_phases_{short}.json")
    if os.path.exists(phases_path):
        phases = json.load(open(phases_path))["runs"]
        fresh = {k: max(max(r["forward_peak_gib"], r["backward_peak_gib"])
                        for r in rows[-1:]) for k, rows in phases.items()
                 if isinstance(rows, list) and rows}
        shared = {k: rows[k]["peak_gib"] for k in ("meshplan_eager_mb4", "meshplan_compiled_mb4")
                  if k in rows}
        if "meshplan_eager" in fresh and len(shared) == 2:
            lines += ["", "The sections run in one process in gpu_check.py's order: plain "
                      "eager, meshplan 4 x 1 eager, plain compiled, meshplan 4 x 1 compiled, "
                      "then the two 1 x 4 runs. Those two peak at "
                      f"{shared['meshplan_eager_mb4']:.1f} / "
                      f"{shared['meshplan_compiled_mb4']:.1f} GiB, against "
                      f"{fresh['meshplan_eager']:.1f} / {fresh['meshplan_compiled']:.1f} GiB "
                      "for the same step in a process that runs only meshplan's step "
                      "(memory_phases, below), for a reason not found yet: on CPU the same "
                      "sequence of runs frees every weight of the earlier ones (weak references "
                      "to them die after `del`, compiled or not)."]
        lines += _memory_phase_lines(json.load(open(phases_path)), plan4, preset, graph)
    sac_clock: dict = {}
    if "sac_compile" in sections:
        logs = [os.path.join(d, "smi_clock.csv") for d in dirs
                if "result" in json.load(open(os.path.join(d, "gpu_check_raw.json")))
                ["sections"].get("sac_compile", {})]
        lines += _sac_compile_lines(sections["sac_compile"]["result"], preset,
                                    logs[-1] if logs else None, sac_clock)
    os.makedirs(RESULTS, exist_ok=True)
    # the H200's record keeps its first name; other GPUs get their own files
    name = "gpu_check" if preset == "dgx-h200" else f"gpu_check_{short}"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"device": device, "torch": raws[-1]["torch"], "preset": preset,
                   "steps": rows, "sac_clock": sac_clock, "sections": sections}, f,
                  indent=1)
    print("\n".join(lines))


def _sac_compile_lines(res: dict, preset: str, clock_log: str | None = None,
                       clock_out: dict | None = None) -> list[str]:
    """Four Llama 3.1 8B blocks, torchtitan's op-level selective AC or none, eager or
    compiled, in each regime measured: measured forward + backward against the torchtitan
    profile's price; the SM clock and power the log beside the run read in each mode."""
    import sac_compile
    regimes = res.get("regimes") or {"bf16": res["modes"]}
    clocks = _clock_samples(clock_log) if clock_log else []
    lines = ["", "## torch.compile under torchtitan's selective AC (benchmarks/gpu/sac_compile.py)",
             "", f"{res['blocks']} Llama 3.1 8B blocks on hidden states of {res['batch']} x "
             f"{res['seq']} tokens, SDPA's flash backend; forward + backward, median of the "
             "timed steps after 2 warm-ups [min, max]. Regime bf16: bf16 parameters and states "
             "(FSDP2's mixed-precision compute), predicted by a 2-GPU ZeRO-3 plan (FSDP2 holds "
             "the blocks; its copy kernels, about 2%, counted, its collectives not); autocast: "
             "fp32 parameters under torch.autocast, predicted by the one-GPU plan. Predicted: "
             "`manual_plan(..., engine=\"torchtitan\")` forward + backward + recompute on the "
             "preset's fa2 curve.", "",
             "| regime | AC | mode | measured ms [min, max] | predicted ms | predicted / measured "
             "| peak GiB | SM MHz | W |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    savings = []
    for regime, modes in regimes.items():
        pred = sac_compile.predict(preset, regime)
        for key, r in modes.items():
            ac, mode = key.split("_")
            mhz, watts = _clock_in(clocks, r.get("window"))
            if clock_out is not None and mhz:
                clock_out[f"{regime} {ac} {mode}"] = int(mhz)
            lines.append(f"| {regime} | {ac} | {mode} | {r['median_s'] * 1e3:.1f} "
                         f"[{r['min_s'] * 1e3:.1f}, {r['max_s'] * 1e3:.1f}] | "
                         f"{pred[key] * 1e3:.1f} | {pred[key] / r['median_s']:.3f} | "
                         f"{r['peak_gib']:.1f} | {mhz} | {watts} |")
        for ac in ("selective", "none"):
            if f"{ac}_eager" in modes and f"{ac}_compiled" in modes:
                saved = modes[f"{ac}_eager"]["median_s"] - modes[f"{ac}_compiled"]["median_s"]
                psaved = pred[f"{ac}_eager"] - pred[f"{ac}_compiled"]
                savings.append(f"- {regime}, {ac} AC: compile saves {saved * 1e3:.1f} ms "
                               f"measured, {psaved * 1e3:.1f} ms predicted "
                               f"({psaved / saved:.2f}x).")
    lines += [""] + savings
    if "gemm_loop" in res:
        g = res["gemm_loop"]
        mhz, watts = _clock_in(clocks, g["window"])
        if clock_out is not None and mhz:
            clock_out["back-to-back GEMMs"] = int(mhz)
        lines.append(f"\nBack-to-back {res['batch'] * res['seq']} x {res['dims']['dim']} x "
                     f"{res['dims']['hidden']} bf16 GEMMs on random data: {g['tflops']:.0f} "
                     f"TFLOP/s, SM {mhz} MHz, {watts} W.")
    return lines


def _memory_phase_lines(res: dict, plan: Plan, preset: str, graph) -> list[str]:
    """The one-GPU step's memory by phase in steady state (steps 2-4, after AdamW made its
    state; benchmarks/gpu/memory_phases.py), against the predicted peak of the same plan
    (``graph``: model.py's, traced once by ``compare``)."""
    import meshplan
    lines = ["", "## Where the one-GPU step's memory peaks (benchmarks/gpu/memory_phases.py)", "",
             "The same 1 x 4 step, GiB allocated (torch.cuda.max_memory_allocated and "
             "memory_allocated, reset at each phase), the last of 4 steps (steady state: AdamW "
             "has made its state; the first step, without it, peaks 6.6 GiB lower), each "
             "engine in a fresh process; the plain step drops its logits before the "
             "backward. "
             f"Predicted: `meshplan.estimate(plan_{preset.split('-')[1]}_mb4.json, "
             "compiled=...)`, its parts: weights and their autocast copies, optimizer state, "
             "gradients, activations.", "",
             "| run | forward peak | at backward start | backward peak | optimizer peak | "
             "predicted peak (activations, gradients) | predicted / measured peak |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for key, rows in res["runs"].items():
        if not isinstance(rows, list) or not rows:
            continue
        r = rows[-1]
        measured = max(r["forward_peak_gib"], r["backward_peak_gib"], r["optimizer_peak_gib"])
        pred = ratio = ""
        if key.startswith("meshplan"):
            est = meshplan.estimate(plan, graph, compiled=key.endswith("compiled"),
                                    hardware=load_preset(preset))
            pred = (f"{est.peak_memory_gib:.1f} ({est.memory.activations_gib:.1f}, "
                    f"{est.memory.grads_gib:.1f})")
            ratio = f"{est.peak_memory_gib / measured:.3f}"
        lines.append(f"| {key.replace('_', ' ')} | {r['forward_peak_gib']:.1f} | "
                     f"{r['at_backward_gib']:.1f} | {r['backward_peak_gib']:.1f} | "
                     f"{r['optimizer_peak_gib']:.1f} | {pred} | {ratio} |")
    return lines


def _clock_samples(path: str) -> list[tuple[float, float, float]]:
    """(epoch s, SM MHz, W) rows of the nvidia-smi log run_on_device.sh keeps beside the
    measurement (``--query-gpu=timestamp,clocks.sm,power.draw``)."""
    import datetime
    rows = []
    if not os.path.exists(path):
        return rows
    # nvidia-smi writes the machine's local time: the "local ... utc ..." line that
    # run_on_device.sh writes beside it gives the offset
    offset = 0.0
    smi = os.path.join(os.path.dirname(path), "nvidia_smi.txt")
    fmt = "%Y/%m/%d %H:%M:%S"
    for line in open(smi) if os.path.exists(smi) else ():
        words = line.split()
        if len(words) == 6 and words[0] == "local" and words[3] == "utc":
            local = datetime.datetime.strptime(" ".join(words[1:3]), fmt)
            offset = (datetime.datetime.strptime(" ".join(words[4:6]), fmt) - local) \
                .total_seconds()
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            t = t.replace(tzinfo=datetime.timezone.utc).timestamp() + offset
            rows.append((t, float(parts[1].split()[0]), float(parts[2].split()[0])))
        except (ValueError, IndexError):
            continue
    return rows


def _clock_in(rows, window) -> tuple[str, str]:
    """Median SM clock and power of the samples inside ``window``, "" without any."""
    if not rows or not window:
        return "", ""
    inside = [r for r in rows if window[0] <= r[0] <= window[1]]
    if not inside:
        return "", ""
    return (f"{statistics.median(r[1] for r in inside):.0f}",
            f"{statistics.median(r[2] for r in inside):.0f}")
