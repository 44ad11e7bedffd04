"""Eager elementwise kernels on one GPU: the two hardware constants costmodel/eager.py prices
every kernel with (the preset's fixed cost per kernel, ``kernel_latency_s``, and its bandwidth
curve, ``memory_efficiency``), and the bandwidth of the kernel paths an eager bf16 step
really takes (benchmarks/results/compile_check.md: 1,888 block kernels predicted 97 ms,
measured 121 ms on an H200; the profile's largest eager kernel is PyTorch's non-vectorized
``elementwise_kernel<128, 2>``, the path of mixed-dtype and strided operands).

Run on the GPU machine from the repository root (under a minute):
    OUT=/tmp/out python benchmarks/gpu/eager_kernels.py
Writes $OUT/eager_kernels.json. Bytes are counted as costmodel/eager.py counts them (every
operand read once, the result written once). A measurement of the hardware and of PyTorch's
kernels, not of any training row: nothing here is fitted to a validation row.
"""

import json
import os
import statistics

import torch


def per_call_s(fn, calls=200, repeats=5):
    """Median seconds per call of ``calls`` back-to-back launches (CUDA events)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(out)


def chain():
    """Time per kernel of c = a * b (bf16, contiguous) against the bytes it moves: the
    intercept is the fixed cost per kernel, the slope the bandwidth."""
    rows = []
    for mib in (0.25, 1, 4, 16, 64, 256):
        n = int(mib * 2 ** 20 / 2)
        a, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), \
            torch.randn(n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty_like(a)
        t = per_call_s(lambda: torch.mul(a, b, out=c))
        rows.append({"bytes": 3 * n * 2, "time_s": t, "gbps": 3 * n * 2 / t / 1e9})
    return rows


def paths(tokens=16384, dim=2048, heads=16, head_dim=128, batch=4):
    """The kernel paths of an eager Llama block at the H200 step's size."""
    bf, f32 = torch.bfloat16, torch.float32
    x = torch.randn(tokens, dim, device="cuda", dtype=bf)
    y = torch.randn(tokens, dim, device="cuda", dtype=bf)
    x32 = torch.randn(tokens, dim, device="cuda", dtype=f32)
    seq = tokens // batch
    q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=bf).transpose(1, 2)
    cos = torch.randn(seq, head_dim, device="cuda", dtype=bf)
    w = torch.randn(dim, device="cuda", dtype=f32)
    e, e2 = tokens * dim, tokens * dim * 2
    cases = {  # name: (function, bytes as eager.py counts them)
        "bf16 mul, contiguous": (lambda: x * y, 3 * e2),
        "fp32 + bf16 add (mixed dtype)": (lambda: x32 + y, e * 4 + e2 + e * 4),
        "fp32 mul, contiguous": (lambda: x32 * x32, 3 * e * 4),
        "fp32 x row broadcast (x * rsqrt[t, 1])": (lambda: x32 * x32[:, :1], 2 * e * 4),
        "fp32 x weight broadcast (x * w[d])": (lambda: x32 * w, 2 * e * 4),
        "fp32 -> bf16 cast": (lambda: x32.to(bf), e * 4 + e2),
        "bf16 -> fp32 cast": (lambda: x.float(), e2 + e * 4),
        "transposed q * cos[s, d] (strided rotary)": (lambda: q * cos, 2 * e2),
        "sum over tokens (a weight's gradient)": (lambda: x32.sum(0), e * 4),
        "slice_backward (zero fill + copy of a half)": (
            lambda: torch.ops.aten.slice_backward(x[:, : dim // 2], [tokens, dim], 1, 0,
                                                  dim // 2, 1), e2 + e2),
    }
    rows = []
    for name, (fn, nbytes) in cases.items():
        t = per_call_s(fn, calls=50)
        rows.append({"kernel": name, "bytes": nbytes, "time_s": t, "gbps": nbytes / t / 1e9})
    return rows


def main():
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "chain": chain(), "paths": paths()}
    for r in res["chain"]:
        print(f"{r['bytes'] / 2 ** 20:8.2f} MiB  {r['time_s'] * 1e6:8.1f} us  {r['gbps']:7.0f} GB/s")
    for r in res["paths"]:
        print(f"{r['kernel']:45s} {r['time_s'] * 1e6:8.1f} us  {r['gbps']:7.0f} GB/s")
    with open(os.path.join(os.environ.get("OUT", "."), "eager_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
