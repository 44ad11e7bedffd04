"""CUDA kernel time by kernel class in one step of each benchmarks/gpu/sac_compile.py mode
(torchtitan's Llama 3.1 8B blocks, eager and compiled, with and without its op-level
selective AC), to see which costs torch.compile removes under selective AC. Runs on the GPU
machine from the repository root with meshplan importable (as run_on_device.sh lays it out):
``python3 benchmarks/gpu/sac_profile.py $OUT``; writes ``$OUT/sac_profile.json`` (kept as
benchmarks/results/sac_profile_h100.json)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import sac_compile  # noqa: E402

CLASSES = (("triton", ("triton",)),  # first: inductor names fused kernels after their ops
           ("attention", ("flash", "fmha", "cudnn", "attention")),
           ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")),
           ("reduction", ("reduce", "norm")))


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, words in CLASSES:
        if any(w in low for w in words):
            return cls
    return "elementwise"


def profile_mode(ac: str, compiled: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    net = sac_compile.build(ac, compiled, "cuda")
    x = torch.randn(sac_compile.BATCH, sac_compile.SEQ, sac_compile.DIMS["dim"],
                    device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(3):
            sac_compile.run_step(net, x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            sac_compile.run_step(net, x)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
    by: dict = {}
    for ev in prof.key_averages():
        ms = ev.self_device_time_total / 1e3
        if ms <= 0:
            continue
        b = by.setdefault(kernel_class(ev.key), {"ms": 0.0, "calls": 0, "top": []})
        b["ms"] += ms
        b["calls"] += ev.count
        b["top"].append([round(ms, 3), ev.count, ev.key[:90]])
    for b in by.values():
        b["ms"] = round(b["ms"], 3)
        b["top"] = sorted(b["top"], reverse=True)[:12]
    del net, x
    torch.cuda.empty_cache()
    return {"wall_ms": wall * 1e3, "kernel_ms": sum(b["ms"] for b in by.values()), "by": by}


def main(out: str) -> None:
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "modes": {}}
    for ac, compiled in sac_compile.MODES:
        key = f"{ac}_{'compiled' if compiled else 'eager'}"
        res["modes"][key] = profile_mode(ac, compiled)
        m = res["modes"][key]
        print(key, round(m["wall_ms"], 1), round(m["kernel_ms"], 1),
              {c: (b["ms"], b["calls"]) for c, b in m["by"].items()}, flush=True)
        with open(os.path.join(out, "sac_profile.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
