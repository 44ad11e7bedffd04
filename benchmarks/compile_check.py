"""Eager vs compiled on one GPU: the cost model's step and its memory-bound share against
the H200 measurements (costmodel/fusion.py; issue 26, "torch.compile is not modelled").

Reads benchmarks/results/gpu_check.json (step times of meshplan.parallelize eager and
compile=True, benchmarks/gpu_check.py) and benchmarks/results/kernel_profile_h200.json (CUDA
kernel time by class of one step of plan_h200_mb4.json, eager and compile=True, torch.profiler
on the same H200: benchmarks/gpu/kernel_profile.py, run on the lent machine), traces benchmarks/gpu/model.py on the meta device and prices both plans eager and
compiled on ``dgx-h200``. Nothing is fitted. Writes benchmarks/results/compile_check.md.
Run: python benchmarks/compile_check.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
RESULTS = os.path.join(HERE, "results")
KERNEL_PROFILE = ("benchmarks/gpu/kernel_profile.py: one step after 3 warm-ups under "
                  "torch.profiler(CUDA), self device time summed by kernel name class "
                  "(nvjet/gemm: matmul; cudnn/flash: attention; multi_tensor_apply: optimizer; "
                  "triton_*: inductor's fused kernels; reduce/norm: reduction; other aten "
                  "kernels: elementwise)")


def main() -> int:
    import model as M
    import meshplan
    from meshplan.costmodel.compute import op_time
    from meshplan.costmodel.fusion import fusion_groups, fused_time
    from meshplan.costmodel.hardware import load_preset
    from meshplan.graph import OpKind
    from meshplan.tracing import trace

    torch.set_num_threads(1)
    steps = json.load(open(os.path.join(RESULTS, "gpu_check.json")))["steps"]
    prof = json.load(open(os.path.join(RESULTS, "kernel_profile_h200.json")))
    with torch.device("meta"):
        net = M.gpu_llama()
    graph = trace(net, (torch.zeros(4, 4096, dtype=torch.long, device="meta"),))
    lines = ["# Eager vs compiled: one bf16 step on one H200", "",
             "Measured: benchmarks/results/gpu_check.json (median of steps 3-10). Predicted: "
             "`meshplan.estimate(plan)` (eager) and `meshplan.estimate(plan, compiled=True)` "
             "on `dgx-h200` as the preset is today (a plan file carries the profile of the day "
             "it was made), benchmarks/gpu/model.py traced on the meta device.", "",
             "| plan | mode | measured ms | predicted ms | predicted / measured |",
             "|---|---|---:|---:|---:|"]
    for suffix, label in (("_mb4", "1 microbatch x 4"), ("", "4 microbatches x 1")):
        plan = meshplan.Plan.from_json(os.path.join(HERE, "gpu", f"plan_h200{suffix}.json"))
        for mode, compiled in (("eager", False), ("compiled", True)):
            measured = steps[f"meshplan_{mode}{suffix}"]["median_s"]
            pred = meshplan.estimate(plan, graph, compiled=compiled,
                                     hardware=load_preset("dgx-h200")).step_time_s
            lines.append(f"| {label} | {mode} | {measured * 1e3:.1f} | {pred * 1e3:.1f} | "
                         f"{pred / measured:.3f} |")
    hw = load_preset("dgx-h200")
    groups = fusion_groups(graph, [n.name for n in graph.nodes])
    fused = {n for g in groups for n in g.members}
    pred = {"matmul": 0.0, "attention": 0.0, "memory-bound in blocks": 0.0,
            "memory-bound outside blocks": 0.0}
    for n in graph.nodes:
        # the model's SDPA is called with is_causal=True: priced on half its FLOPs, as the
        # estimate does
        t = op_time(n, hw, "bf16", causal=n.kind == OpKind.ATTENTION).total_s
        if n.kind == OpKind.MATMUL:
            pred["matmul"] += t
        elif n.kind == OpKind.ATTENTION:
            pred["attention"] += t
        elif n.name in fused:
            pred["memory-bound in blocks"] += t
        else:
            pred["memory-bound outside blocks"] += t
    fused_s = sum(fused_time(g, hw, "bf16", 1).total_s for g in groups)
    eager, comp = ({k: v["ms"] if isinstance(v, dict) else v[0] for k, v in r["by"].items()}
                   for r in prof)
    for counts, r in zip((eager, comp), prof):
        counts.update({f"{k}_n": v[1] for k, v in r["by"].items()})
    lines += ["", "## Where the time goes (1 microbatch x 4, ms per step)", "",
              "Measured: CUDA kernel time by class, torch.profiler, one step of "
              "plan_h200_mb4.json on the same H200 (benchmarks/results/"
              "kernel_profile_h200.json; " + KERNEL_PROFILE + "). Predicted: "
              "`compute.op_time` per operator (forward + backward; the causal attention on "
              "half its FLOPs, on the preset's default curve, cuDNN's, the kernel torch 2.11 "
              "ran) and `fusion.fused_time` per fused group; the eager column is "
              "one kernel per traced operator, the pricing before issue 26's eager terms "
              "(next section).", "",
              "| class | predicted eager | measured eager | predicted compiled | "
              "measured compiled |", "|---|---:|---:|---:|---:|",
              f"| matmul | {pred['matmul'] * 1e3:.1f} | {eager['mm']:.1f} | "
              f"{pred['matmul'] * 1e3:.1f} | {comp['mm']:.1f} |",
              f"| attention | {pred['attention'] * 1e3:.1f} | {eager['attn']:.1f} | "
              f"{pred['attention'] * 1e3:.1f} | {comp['attn']:.1f} |",
              f"| block elementwise/norm/reduction ({len(groups)} fused groups) | "
              f"{pred['memory-bound in blocks'] * 1e3:.1f} | "
              f"{eager['elt'] + eager['red'] - comp['elt'] - comp['red']:.1f} (all aten "
              f"elementwise and reduction kernels less those left in the compiled step) | "
              f"{fused_s * 1e3:.1f} | {comp['triton']:.1f} (triton) |",
              f"| elementwise outside the blocks | "
              f"{pred['memory-bound outside blocks'] * 1e3:.1f} | - | "
              f"{pred['memory-bound outside blocks'] * 1e3:.1f} | "
              f"{comp['elt'] + comp['red']:.1f} |",
              f"| optimizer (AdamW, foreach) | see the step's breakdown | {eager['opt']:.1f} | | "
              f"{comp['opt']:.1f} |",
              f"| all kernels | | {prof[0]['kernel_ms']:.1f} (step {prof[0]['wall_ms']:.1f}) | | "
              f"{prof[1]['kernel_ms']:.1f} (step {prof[1]['wall_ms']:.1f}) |", "",
              ""] + _eager_section(graph, hw, eager, comp, pred["memory-bound in blocks"]) + \
        _sac_section() + ["Reproduce: `python benchmarks/compile_check.py`.", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(RESULTS, "compile_check.md"), "w") as f:
        f.write(text)
    return 0


def _eager_section(graph, hw, eager: dict, comp: dict, priced_s: float) -> list[str]:
    """The eager step's kernels as costmodel/eager.py counts them (what the estimate prices
    since issue 26's eager terms: one GPU, no FSDP, so autocast with fp32 weights) against
    the profile: the block kernels are the eager step's aten elementwise and reduction
    kernels less those the compiled step still runs (which are outside the blocks)."""
    from meshplan.costmodel.eager import eager_kernels, eager_time

    names = [n.name for n in graph.nodes]
    ek = eager_kernels(graph, names, dtype="bf16", precision="autocast")
    rows = {}
    for inside in (True, False):
        ops = [op for n, op in ek.items() if (graph.node(n).layer >= 0) == inside]
        rows[inside] = (sum(op.kernels for op in ops),
                        sum(eager_time(op, hw, 1).total_s for op in ops))
    blocks_ms = eager["elt"] + eager["red"] - comp["elt"] - comp["red"]
    return ["## Eager kernels one by one (costmodel/eager.py)", "",
            "The kernels eager PyTorch launches for the same step as the estimate now prices "
            "them: dtypes as they run (fp32 weights under autocast, RMSNorm's fp32 chain), "
            "autocast's casts of weights and matmul inputs, autograd's backward kernels from "
            "its derivative formulas, gradient sums where a value feeds several operators, "
            "the loss on fp32 logits. Each kernel on the preset's bandwidth curve plus its "
            "launch. Measured kernel counts from the same profile (kernel_profile_h200.json).",
            "",
            "| | predicted kernels | predicted ms | measured kernels | measured ms | "
            "one kernel per operator (before), ms |", "|---|---:|---:|---:|---:|---:|",
            f"| block elementwise, norms, casts, gradient sums | {rows[True][0]} | "
            f"{rows[True][1] * 1e3:.1f} | "
            f"{eager['elt_n'] + eager['red_n'] - comp['elt_n'] - comp['red_n']} | "
            f"{blocks_ms:.1f} | {priced_s * 1e3:.1f} |",
            f"| outside the blocks (embedding's gradient sum, final norm, fp32 loss) | "
            f"{rows[False][0]} | {rows[False][1] * 1e3:.1f} | "
            f"{comp['elt_n'] + comp['red_n']} (in the compiled step) | "
            f"{comp['elt'] + comp['red']:.1f} | |", "",
            "Each kernel streams at its path's measured fraction of the contiguous rate "
            "(`device.memory_paths`: strided, bf16 -> fp32 upcast, broadcast, mixed dtype, "
            "reduction, slice_backward; benchmarks/results/eager_kernels_gpu.md): the "
            "non-vectorized kernels PyTorch runs for them (the profile's largest eager kernel, "
            "`elementwise_kernel<128, 2>`, 197 calls, 19.1 ms). Left out: copies of "
            "non-contiguous gradients (a transposed gradient reshaped).", ""]


SAC_CLASSES = {"gemm": "matmul", "attention": "attention"}


def _sac_section() -> list[str]:
    """Llama 3.1 8B blocks as torchtitan runs them on one H100 (benchmarks/gpu/sac_compile.py,
    bf16 regime, no recompute): kernel time by class measured
    (benchmarks/results/sac_profile_h100.json, benchmarks/gpu/sac_profile.py) against the
    estimate's operators as ``meshplan explain`` prices them, eager and compiled, and the SM
    clock each step ran at under the 700 W cap (benchmarks/results/gpu_check_h100.json)."""
    from dataclasses import replace

    import sac_compile
    from meshplan.explain import as_planned
    from meshplan.graph import OpKind

    prof = json.load(open(os.path.join(RESULTS, "sac_profile_h100.json")))["modes"]
    _, graph, base = sac_compile.traced_plan("dgx-h100", "bf16")
    pred = {}
    for compiled in (False, True):
        plan = replace(base, training=replace(base.training, compiled=compiled))
        by = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
        for name, (compute_s, _, _) in as_planned(plan, graph, 0).items():
            node = graph.node(name)
            if node.layer >= 0:
                param_mm = node.kind == OpKind.MATMUL and any(
                    i in graph.param_map for i in node.inputs)
                cls = "matmul" if param_mm else \
                    "attention" if node.kind == OpKind.ATTENTION else "other"
                by[cls] += compute_s
        pred[compiled] = by

    def measured(mode: str) -> dict:
        by = prof[mode]["by"]
        out = {SAC_CLASSES.get(k, "other"): 0.0 for k in by}
        for k, b in by.items():
            out[SAC_CLASSES.get(k, "other")] += b["ms"]
        return out

    gpu = json.load(open(os.path.join(RESULTS, "gpu_check_h100.json")))
    clocks = gpu.get("sac_clock", {})
    eager, comp = measured("none_eager"), measured("none_compiled")
    lines = ["## Llama 3.1 8B blocks as torchtitan compiles them, one H100 (ms per step)", "",
             "Four blocks on 2 x 8192 tokens, bf16 parameters and states (FSDP2's compute), no "
             "recompute (benchmarks/gpu/sac_compile.py). Measured: CUDA kernel time by class, "
             "one profiled step (benchmarks/results/sac_profile_h100.json, "
             "benchmarks/gpu/sac_profile.py; nvjet/gemm: matmul; flash: attention; every other "
             "kernel, aten or triton: other). Predicted: each block operator as "
             "`meshplan.explain` prices it in a 2-GPU ZeRO-3 torchtitan plan (FSDP2's copy "
             "kernels are not operators), eager and compiled, on `dgx-h100` with the fa2 "
             "curve.", "",
             "| class | predicted eager | measured eager | predicted compiled | measured compiled |",
             "|---|---:|---:|---:|---:|"]
    for cls in ("matmul", "attention", "other"):
        lines.append(f"| {cls} | {pred[False][cls] * 1e3:.1f} | {eager.get(cls, 0.0):.1f} | "
                     f"{pred[True][cls] * 1e3:.1f} | {comp.get(cls, 0.0):.1f} |")
    lines.append(f"| all | {sum(pred[False].values()) * 1e3:.1f} | "
                 f"{prof['none_eager']['kernel_ms']:.1f} | {sum(pred[True].values()) * 1e3:.1f} | "
                 f"{prof['none_compiled']['kernel_ms']:.1f} |")
    if clocks:
        lines += ["", "SM clock (MHz, median of nvidia-smi every 100 ms over the timed steps; "
                  "power at the 700 W cap throughout): " + ", ".join(
                      f"{k} {v}" for k, v in clocks.items()) + "."]
    saved_other = eager["other"] - comp["other"]
    psaved_other = (pred[False]["other"] - pred[True]["other"]) * 1e3
    lines += ["", f"Compile removes {saved_other:.1f} ms of memory-bound kernels (predicted "
              f"{psaved_other:.1f}: fused groups, costmodel/fusion.py). The same matmul "
              f"kernels (same names and calls) take {comp['matmul'] / eager['matmul'] - 1:+.1%} "
              f"longer, and attention {comp['attention'] / eager['attention'] - 1:+.1%}, in "
              "the compiled step: with the memory-bound kernels fused away the tensor cores are "
              "busy a larger share of the step, and the power cap holds the SM clock lower. "
              "The estimate prices every GEMM on one curve, measured on back-to-back GEMMs (the "
              "lowest clock, above), whatever the step around it; it does not price the clock.",
              ""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
