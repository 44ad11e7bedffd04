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
             "on `dgx-h200`, benchmarks/gpu/model.py traced on the meta device.", "",
             "| plan | mode | measured ms | predicted ms | predicted / measured |",
             "|---|---|---:|---:|---:|"]
    for suffix, label in (("_mb4", "1 microbatch x 4"), ("", "4 microbatches x 1")):
        plan = meshplan.Plan.from_json(os.path.join(HERE, "gpu", f"plan_h200{suffix}.json"))
        for mode, compiled in (("eager", False), ("compiled", True)):
            measured = steps[f"meshplan_{mode}{suffix}"]["median_s"]
            pred = meshplan.estimate(plan, graph, compiled=compiled).step_time_s
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
    lines += ["", "## Where the time goes (1 microbatch x 4, ms per step)", "",
              "Measured: CUDA kernel time by class, torch.profiler, one step of "
              "plan_h200_mb4.json on the same H200 (benchmarks/results/"
              "kernel_profile_h200.json; " + KERNEL_PROFILE + "). Predicted: "
              "`compute.op_time` per operator (forward + backward; the causal attention on "
              "half its FLOPs, on the preset's FlashAttention-2 curve, while torch 2.11 ran "
              "cuDNN's kernel) and `fusion.fused_time` per fused group.", "",
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
              ""] + _real_dtypes(M, hw, pred["memory-bound in blocks"]) + [
              "Reproduce: `python benchmarks/compile_check.py`.", ""]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(RESULTS, "compile_check.md"), "w") as f:
        f.write(text)
    return 0


def _real_dtypes(M, hw, priced_s: float) -> list[str]:
    """The eager block operators priced on the dtypes they run in: the model traced with
    bf16 weights (as the module engine holds them), so RMSNorm's ``x.float()`` chain is
    fp32, and its dtype casts (views in the fp32 trace, free) priced as copy kernels (read
    the source, write the result; backward likewise)."""
    from meshplan.costmodel.compute import op_time, roofline_s
    from meshplan.costmodel.fusion import FUSIBLE
    from meshplan.tracing import trace

    with torch.device("meta"):
        net = M.gpu_llama().to(torch.bfloat16)
    g = trace(net, (torch.zeros(4, 4096, dtype=torch.long, device="meta"),))
    fixed = hw.device.kernel_latency_s + hw.device.framework_overhead_s
    ops = casts = 0.0
    n = 0
    for node in g.nodes:
        if node.layer < 0:
            continue
        if node.kind in FUSIBLE:
            ops += op_time(node, hw, "fp32").total_s  # "fp32": the traced bytes as they are
        elif node.target in ("aten.to.dtype", "aten._to_copy.default") and node.inputs[0] in g:
            src = g.node(node.inputs[0]).out
            if src is not None and node.out is not None and src.dtype != node.out.dtype:
                b = src.bytes + node.out.bytes
                casts += 2 * (roofline_s(hw, 0, b, "fp32") + fixed)
                n += 1
    return ["## What eager misses", "",
            "The same block operators priced on the dtypes they run in (the model traced "
            "with bf16 weights: RMSNorm's `x.float()` chain in fp32) and with their "
            f"{n} dtype casts as copy kernels (free views in the fp32 trace the plan "
            f"prices): {ops * 1e3:.1f} + {casts * 1e3:.1f} = {(ops + casts) * 1e3:.1f} ms "
            f"against the {priced_s * 1e3:.1f} ms the plan's trace gives (above) and the "
            "measured eager "
            "kernels. What remains unpriced is autograd's own kernels (the measured eager "
            "step runs 2,208 elementwise kernels where the trace has 392 elementwise "
            "operators): gradients summed where a tensor feeds several operators, "
            "reductions for broadcast weights' gradients, copies for `cat` and "
            "non-contiguous inputs (views, free, in the trace), mixed-dtype kernels on "
            "PyTorch's non-vectorized path.", ""]


if __name__ == "__main__":
    sys.exit(main())
