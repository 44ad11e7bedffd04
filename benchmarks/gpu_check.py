"""One short GPU check (under 8 minutes on one H100/H200): the kernel curves the GPU presets
price with, and one training step of meshplan's module engine against its prediction.

trace -> **cost** -> run. The cost model prices a GEMM at ``max_eff * work / (work +
half_work)`` of the device peak and fused attention on a curve of the same form
(costmodel/hardware.py); this script measures both on the GPU it runs on, plus HBM copy
bandwidth, fp8 GEMMs (``torch._scaled_mm``, tensorwise and rowwise scales), four Llama 3.1 8B
blocks under torchtitan's op-level selective AC eager and compiled (benchmarks/gpu/sac_compile.py,
section ``sac_compile``, last: ``--sections sac_compile`` runs it alone) and one bf16 step
of a ~0.9B-parameter Llama-style model (benchmarks/gpu/model.py) run by
``meshplan.parallelize`` on one GPU, eager and with ``compile=True``, next to the same step in
plain PyTorch (no meshplan). Every section is timed with CUDA events after warm-up, repeated,
and reported with its spread; a section that fails records its error and the rest go on.

Two modes:
  python benchmarks/gpu_check.py make-plan      # on the CPU machine: writes
        benchmarks/gpu/plan_h100.json and plan_h200.json (manual_plan, one device, bf16)
        and their predictions
  python benchmarks/gpu_check.py measure --out DIR [--budget-s 420]   # on the GPU
  python benchmarks/gpu_check.py compare DIR    # on the CPU machine: predicted vs measured,
        writes benchmarks/results/gpu_check.md and .json
  python benchmarks/gpu_check.py fit            # on the CPU machine: fits the GPU presets'
        GEMM and attention curves to the recorded kernel points (benchmarks/gpu/kernel_fit.py)

The GEMM and fused-attention curves of the H100 and H200 presets are fitted to the kernel
points recorded here (``fit``); nothing is fitted to the one-GPU step, whose prediction is
compared with its measurement, nor to any published training run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
BATCH, SEQ = 4, 4096  # one GLOBAL batch of the step check (16,384 tokens)


# -- timing ----------------------------------------------------------------------------------

def _time_cuda(fn, *, min_time_s=0.05, warmup=3, repeats=5):
    """Median and spread (min, max) of seconds per call over ``repeats`` timed batches of
    calls, each batch long enough (``min_time_s``) to swamp launch overhead."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(min_time_s / one)))
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(samples), min(samples), max(samples)


# -- sections --------------------------------------------------------------------------------

def gemm_curve(dtype=torch.bfloat16):
    rows = []
    shapes = [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192, 16384)]
    # transformer-shaped (tokens x in -> out): 16K tokens through Llama-8B / 70B projections
    shapes += [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096),
               (16384, 8192, 1024), (16384, 8192, 28672), (4096, 4096, 128256)]
    for m, k, n in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        med, lo, hi = _time_cuda(lambda: torch.mm(a, b))
        flops = 2 * m * k * n
        rows.append({"m": m, "k": k, "n": n, "dtype": str(dtype).split(".")[-1], "flops": flops,
                     "time_s": med, "tflops": flops / med / 1e12,
                     "tflops_min": flops / hi / 1e12, "tflops_max": flops / lo / 1e12})
        del a, b
    return rows


def fp8_gemm_curve():
    """fp8 e4m3 GEMMs through ``torch._scaled_mm`` (the op torchao's float8 training calls),
    with the bf16 cast and amax of the inputs that dynamic tensorwise scaling adds."""
    rows = []
    f8 = torch.float8_e4m3fn
    for m, k, n in [(n, n, n) for n in (1024, 2048, 4096, 8192, 16384)] + \
            [(16384, 4096, 14336), (16384, 8192, 28672)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        a8, b8 = a.to(f8), b.to(f8)
        one = torch.ones((), device="cuda")
        flops = 2 * m * k * n
        for scaling in ("tensorwise", "rowwise"):
            if scaling == "tensorwise":
                sa, sb = one, one
            else:
                sa = torch.ones(m, 1, device="cuda")
                sb = torch.ones(1, n, device="cuda")
            try:
                mm = lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                              out_dtype=torch.bfloat16)
                med, lo, hi = _time_cuda(mm)

                def cast_and_mm():
                    s1 = a.abs().amax().float().clamp(min=1e-12) / 448.0
                    s2 = b.abs().amax().float().clamp(min=1e-12) / 448.0
                    x8 = (a / s1).to(f8)
                    w8 = (b / s2).to(f8)
                    return torch._scaled_mm(x8, w8.t(), scale_a=s1, scale_b=s2,
                                            out_dtype=torch.bfloat16)
                cmed = _time_cuda(cast_and_mm)[0] if scaling == "tensorwise" else None
                rows.append({"m": m, "k": k, "n": n, "scaling": scaling, "flops": flops,
                             "time_s": med, "tflops": flops / med / 1e12,
                             "tflops_min": flops / hi / 1e12, "tflops_max": flops / lo / 1e12,
                             "with_cast_amax_time_s": cmed,
                             "with_cast_amax_tflops": flops / cmed / 1e12 if cmed else None})
            except Exception as exc:  # an op this build lacks is recorded, not fatal
                rows.append({"m": m, "k": k, "n": n, "scaling": scaling, "error": repr(exc)[:300]})
        del a, b, a8, b8
    return rows


def attention_curve():
    """SDPA per backend (flash, cuDNN, efficient), bf16, head dim 128, 32 query heads;
    forward and forward+backward, causal and not. FLOPs: forward 4*B*H*S^2*D (halved when
    causal, as kernels quote it), backward 2.5x forward (FlashAttention-2 paper, sec. 4.1)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    rows = []
    H, D = 32, 128
    for seq in (1024, 2048, 4096, 8192, 16384):
        B = max(1, 16384 // seq)
        q = torch.randn(B, H, seq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn_like(q, requires_grad=True)
        v = torch.randn_like(q, requires_grad=True)
        g = torch.randn_like(q)
        for name, be in backends.items():
            for causal in (True, False):
                fwd_flops = 4 * B * H * seq * seq * D * (0.5 if causal else 1.0)
                try:
                    with sdpa_kernel(be):
                        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        fmed, flo, fhi = _time_cuda(fwd)

                        def fwd_bwd():
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            o.backward(g)
                        bmed, blo, bhi = _time_cuda(fwd_bwd)
                    total = fwd_flops * 3.5
                    rows.append({"backend": name, "seq": seq, "batch": B, "heads": H,
                                 "head_dim": D, "causal": causal, "fwd_flops": fwd_flops,
                                 "fwd_time_s": fmed, "fwd_tflops": fwd_flops / fmed / 1e12,
                                 "fwd_tflops_range": [fwd_flops / fhi / 1e12, fwd_flops / flo / 1e12],
                                 "fwd_bwd_time_s": bmed, "fwd_bwd_tflops": total / bmed / 1e12,
                                 "bwd_tflops": fwd_flops * 2.5 / max(bmed - fmed, 1e-9) / 1e12})
                except Exception as exc:
                    rows.append({"backend": name, "seq": seq, "causal": causal,
                                 "error": repr(exc)[:300]})
        del q, k, v, g
        q = k = v = g = None
        torch.cuda.empty_cache()
    return rows


def bandwidth():
    n = 1 << 30  # 1 Gi elements of bf16: 2 GiB read + 2 GiB written per copy
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    med, lo, hi = _time_cuda(lambda: y.copy_(x))
    moved = 2 * x.numel() * x.element_size()
    return {"bytes_moved": moved, "time_s": med, "gbps": moved / med / 1e9,
            "gbps_range": [moved / hi / 1e9, moved / lo / 1e9]}


def _batches(steps, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (BATCH, SEQ), generator=g) for _ in range(steps)]


def plain_model(compile_: bool):
    """(model, optimizer) of the reference step: model.py's Llama on the GPU with fp32
    weights, each block ``torch.compile``d where ``compile_``, fused AdamW."""
    import model as M
    torch.manual_seed(0)
    net = M.gpu_llama().cuda()
    M.init_weights(net)
    if compile_:
        for i, blk in enumerate(net.layers):
            net.layers[i] = torch.compile(blk)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)


def plain_step(compile_: bool, steps=6):
    """The reference: the same model, bf16 autocast with fp32 weights and AdamW, no meshplan."""
    net, opt = plain_model(compile_)
    data = [b.cuda() for b in _batches(steps, 32000)]
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for ids in data:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = net(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del net, opt
    torch.cuda.empty_cache()
    return {"compile": compile_, "step_times_s": times, "losses": losses, "peak_gib": peak}


def meshplan_step(plan_path: str, compile_: bool, steps=6):
    import model as M
    import torch.distributed as dist
    import meshplan
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
    plan = meshplan.Plan.from_json(plan_path)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = M.gpu_llama()
    run = meshplan.parallelize(net, plan, init_weights=M.init_weights, compile=compile_)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-4)
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    for ids in _batches(steps, 32000):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = run.train_step((ids.cuda(),))
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del run, net, opt
    torch.cuda.empty_cache()
    return {"compile": compile_, "engine": plan.engine, "step_times_s": times,
            "losses": losses, "peak_gib": peak}


# -- modes -----------------------------------------------------------------------------------

def make_plan():
    import model as M
    import meshplan
    for preset in ("dgx-h100", "dgx-h200"):
        mesh = meshplan.Mesh.from_dict({"shape": [1], "hardware": preset,
                                        "name": f"{preset}:1gpu"})
        with torch.device("meta"):
            net = M.gpu_llama()
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
        for mb, suffix in ((1, ""), (BATCH, "_mb4")):  # 4 microbatches of 1, or 1 of 4
            plan = meshplan.manual_plan(net, mesh, (ids,), dp=1, dtype="bf16",
                                        microbatch_size=mb)
            path = os.path.join(HERE, "gpu", f"plan_{preset.split('-')[1]}{suffix}.json")
            plan.to_json(path)
            p = plan.predicted
            print(f"{preset} mb={mb}: engine {plan.engine}, predicted "
                  f"{p.step_time_s * 1e3:.1f} ms/step, {p.peak_memory_gib:.1f} GiB, "
                  f"MFU {p.mfu:.3f} -> {path}")


def measure(out: str, budget_s: float, only: tuple[str, ...] = ()):
    t_start = time.time()
    res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0),
           "sections": {}}
    path = os.path.join(out, "gpu_check_raw.json")

    def save():
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    name = torch.cuda.get_device_name(0)
    plan = os.path.join(HERE, "gpu", "plan_h200.json" if "H200" in name else "plan_h100.json")
    plan4 = plan.replace(".json", "_mb4.json")
    sections = [("bandwidth", bandwidth), ("gemm_bf16", gemm_curve),
                ("attention", attention_curve), ("fp8_gemm", fp8_gemm_curve),
                ("plain_eager", lambda: plain_step(False)),
                ("meshplan_eager", lambda: meshplan_step(plan, False)),
                ("plain_compiled", lambda: plain_step(True)),
                ("meshplan_compiled", lambda: meshplan_step(plan, True)),
                ("meshplan_eager_mb4", lambda: meshplan_step(plan4, False)),
                ("meshplan_compiled_mb4", lambda: meshplan_step(plan4, True)),
                ("sac_compile", lambda: __import__("sac_compile").measure())]
    for key, fn in sections:
        if only and key not in only:
            continue
        left = budget_s - (time.time() - t_start)
        if left < 20:
            res["sections"][key] = {"skipped": f"budget: {left:.0f} s left"}
            save()
            continue
        t0 = time.time()
        try:
            res["sections"][key] = {"result": fn()}
        except Exception as exc:
            res["sections"][key] = {"error": repr(exc)[:500],
                                    "traceback": traceback.format_exc()[-3000:]}
        res["sections"][key]["wall_s"] = time.time() - t0
        print(f"[{time.time() - t_start:6.1f} s] {key}: {res['sections'][key].get('error', 'ok')}",
              flush=True)
        save()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    sub.add_parser("make-plan")
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--budget-s", type=float, default=420.0)
    m.add_argument("--sections", default="", help="comma-separated subset (default: all)")
    c = sub.add_parser("compare")
    c.add_argument("dir", nargs="+")
    sub.add_parser("fit", help="fit the GPU presets' GEMM and attention curves to the "
                   "recorded kernel points (benchmarks/results/gpu_check*.json)")
    args = ap.parse_args(argv)
    if args.mode == "make-plan":
        make_plan()
    elif args.mode == "fit":
        from kernel_fit import write_presets
        for preset, fits in write_presets().items():
            print(preset, "  ".join(f"{k}: max_eff {m} half_work {h:.3g} rms {100 * r:.1f}%"
                                    for k, (m, h, r) in fits.items()))
    elif args.mode == "measure":
        measure(args.out, args.budget_s, tuple(filter(None, args.sections.split(","))))
    else:
        from gpu_compare import compare
        compare(*args.dir)


if __name__ == "__main__":
    main()
