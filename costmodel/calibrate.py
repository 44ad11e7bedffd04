"""``meshplan calibrate``: measure this machine and fit a hardware profile (least squares).

trace -> **cost** -> solve -> run. Measures, with one thread per process as the runtime
runs (OMP_NUM_THREADS=1):
1. matmuls of many sizes (fp32 on CPU, bf16 on CUDA) and elementwise ops over many buffer
   sizes; each family is fitted to ``t = a + w / P`` (w = FLOPs or bytes), which is the
   roofline with the profile's efficiency curve ``eff(w) = max_eff * w / (w + half_work)``:
   P = peak x max_eff and half_work = (a - latency) x P;
2. the fixed cost of a tiny operator (kernel latency) and the extra cost of running it as
   a DTensor (the runtime's dispatch: ``framework_overhead_s``);
3. collectives with torch.distributed (gloo on CPU, NCCL on GPU) over 2..N local processes
   and several buffer sizes, fitted per collective to ``t = steps(n) alpha + factor(n) B / beta``
   (costmodel/comm.py's ring model) by least squares over all group sizes.
Sample counts and relative residuals go under ``fitted``. The local profile records
``host_cores`` so that estimates slow compute when processes outnumber cores.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from meshplan.costmodel.comm import Collective, bytes_factor, latency_steps
from meshplan.costmodel.hardware import HardwareProfile, load_preset

MATMUL_SIZES = (32, 64, 96, 128, 192, 256, 384, 512, 768)
ELEMENTWISE_NUMEL = (1 << 10, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 22)
COLLECTIVE_BYTES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
GLOO_COLLECTIVES = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.BROADCAST)


def _time(fn: Callable[[], object], *, repeat: int = 5, sync=lambda: None) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def fit_linear(work: list[float], times: list[float]) -> tuple[float, float, float]:
    """Least squares ``t = a + w * b``; returns (a, b, median relative residual)."""
    x = np.asarray(work, dtype=float)
    y = np.asarray(times, dtype=float)
    design = np.stack([np.ones_like(x), x], axis=1)
    weights = 1.0 / y  # relative error: small kernels count as much as large ones
    (a, b), *_ = np.linalg.lstsq(design * weights[:, None], y * weights, rcond=None)
    a, b = max(float(a), 0.0), max(float(b), 1e-30)
    resid = float(np.median(np.abs((a + b * x) - y) / y))
    return a, b, resid


def measure_compute(device: str, progress=None) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {"matmul": [], "elementwise": []}
    tiny = torch.ones(1, device=device)
    latency = _time(lambda: tiny.add(1.0), repeat=50, sync=sync)
    for n in MATMUL_SIZES:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out["matmul"].append((2.0 * n ** 3, _time(lambda: a @ b, sync=sync)))
        if progress:
            progress()
    for numel in ELEMENTWISE_NUMEL:
        x = torch.randn(numel, device=device, dtype=dtype)
        y = torch.randn(numel, device=device, dtype=dtype)
        nbytes = 3.0 * numel * x.element_size()  # read two, write one
        out["elementwise"].append((nbytes, _time(lambda: x * y, sync=sync)))
        if progress:
            progress()
    out["latency_s"] = latency
    return out


def measure_dispatch_overhead(device: str) -> float:
    """Extra time of a small op run as a DTensor on a one-process mesh (the runtime's path)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        return 0.0
    with tempfile.NamedTemporaryFile(delete=False) as f:
        store_path = f.name
    try:
        dist.init_process_group("gloo" if device == "cpu" else "nccl",
                                init_method=f"file://{store_path}", rank=0, world_size=1)
        mesh = init_device_mesh(device, (1,))
        x = torch.randn(64, 64, device=device)
        dx = distribute_tensor(x, mesh, [Replicate()])
        plain = _time(lambda: x * x, repeat=200)
        dt = _time(lambda: dx * dx, repeat=200)
        return max(0.0, dt - plain)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.unlink(store_path)


def _collective_worker(rank: int, world: int, port: int, backend: str, queue) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kinds = list(GLOO_COLLECTIVES) if backend == "gloo" else list(Collective)
    results = []
    for kind in kinds:
        for nbytes in COLLECTIVE_BYTES:
            numel = max(world, nbytes // 4 // world * world)
            x = torch.ones(numel, device=device)
            parts = [torch.empty(numel // world, device=device) for _ in range(world)]
            full = [torch.empty(numel, device=device) for _ in range(world)]

            def run(kind=kind, x=x, parts=parts, full=full):
                if kind == Collective.ALL_REDUCE:
                    dist.all_reduce(x)
                elif kind == Collective.ALL_GATHER:
                    dist.all_gather(full, x)
                elif kind == Collective.BROADCAST:
                    dist.broadcast(x, 0)
                elif kind == Collective.REDUCE_SCATTER:
                    dist.reduce_scatter(parts[0], list(x.chunk(world)))
                elif kind == Collective.ALL_TO_ALL:
                    dist.all_to_all(parts, list(x.chunk(world)))
                elif kind == Collective.SEND_RECV:
                    if rank == 0:
                        dist.send(x, 1)
                    elif rank == 1:
                        dist.recv(x, 0)
                sync()
                dist.barrier()

            t = _time(run, repeat=5)
            barrier = _time(lambda: dist.barrier(), repeat=5)
            buf = numel * 4 * (world if kind == Collective.ALL_GATHER else 1)
            results.append((str(kind), world, buf, max(t - barrier, 1e-7)))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_collectives(max_procs: int, backend: str, progress=None) -> list[tuple]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    for world in range(2, max_procs + 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        procs = [ctx.Process(target=_collective_worker, args=(r, world, port, backend, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows += queue.get(timeout=300)
        for p in procs:
            p.join(timeout=60)
        if progress:
            progress()
    return rows


def fit_collectives(rows: list[tuple]) -> tuple[dict, dict]:
    """Per collective (alpha, beta) by least squares over (group size, bytes) samples."""
    fitted, residuals = {}, {}
    for kind in sorted({r[0] for r in rows}):
        k = Collective(kind)
        sample = [r for r in rows if r[0] == kind]
        design = np.array([[latency_steps(k, n), bytes_factor(k, n) * b] for _, n, b, _ in sample])
        y = np.array([t for *_, t in sample])
        w = 1.0 / y
        (alpha, inv_beta), *_ = np.linalg.lstsq(design * w[:, None], y * w, rcond=None)
        alpha, inv_beta = max(float(alpha), 1e-7), max(float(inv_beta), 1e-13)
        pred = design @ np.array([alpha, inv_beta])
        fitted[kind] = {"latency_s": alpha, "bandwidth_gbps": 1.0 / inv_beta / 1e9}
        residuals[kind] = float(np.median(np.abs(pred - y) / y))
    return fitted, residuals


def calibrate(procs: int = 4, *, device: str | None = None, progress=None) -> HardwareProfile:
    """Measure this machine and return a fitted HardwareProfile (see the module docstring)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)
    compute = measure_compute(device, progress)
    overhead = measure_dispatch_overhead(device) if device == "cpu" else 0.0
    backend = "nccl" if device == "cuda" else "gloo"
    rows = measure_collectives(max(2, procs), backend, progress) if procs >= 2 else []
    a_mm, b_mm, r_mm = fit_linear(*zip(*compute["matmul"]))
    a_el, b_el, r_el = fit_linear(*zip(*compute["elementwise"]))
    latency = compute["latency_s"]
    flop_rate, byte_rate = 1.0 / b_mm, 1.0 / b_el
    base = load_preset("cpu-local" if device == "cpu" else "dgx-h100").to_dict()
    dev = base["device"]
    dtype_name = "float32" if device == "cpu" else "bfloat16"
    if device == "cpu":
        dev["peak_tflops"] = {"float32": flop_rate / 1e12, "bfloat16": flop_rate / 4e12,
                              "float16": flop_rate / 8e12}
        dev["matmul_efficiency"] = {"max_eff": 1.0, "half_work": max(0.0, (a_mm - latency) * flop_rate)}
        dev["memory_bandwidth_gbps"] = byte_rate / 1e9
        dev["memory_efficiency"] = {"max_eff": 1.0, "half_work": max(0.0, (a_el - latency) * byte_rate)}
        dev["host_cores"] = os.cpu_count() or 1
        dev["memory_gib"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30 / max(1, procs)
        dev["name"] = "cpu"
    else:
        props = torch.cuda.get_device_properties(0)
        dev["name"] = props.name
        dev["memory_gib"] = props.total_memory / 2 ** 30
        peak = dev["peak_tflops"]["bfloat16"] * 1e12
        dev["matmul_efficiency"] = {"max_eff": min(1.0, flop_rate / peak),
                                    "half_work": max(0.0, (a_mm - latency) * flop_rate)}
        bw = dev["memory_bandwidth_gbps"] * 1e9
        dev["memory_efficiency"] = {"max_eff": min(1.0, byte_rate / bw),
                                    "half_work": max(0.0, (a_el - latency) * byte_rate)}
    dev["kernel_latency_s"] = latency
    dev["framework_overhead_s"] = overhead
    fitted_links, link_resid = fit_collectives(rows) if rows else ({}, {})
    where = f"measured by `meshplan calibrate` on {platform.node()} ({platform.processor() or platform.machine()})"
    for level in ("intra_node", "inter_node"):
        link = base[level]
        if "all_reduce" in fitted_links:
            link["bandwidth_gbps"] = fitted_links["all_reduce"]["bandwidth_gbps"]
            link["latency_s"] = fitted_links["all_reduce"]["latency_s"]
        link["collectives"] = fitted_links
    base.update(name=f"calibrated-{device}", device=dev,
                description=f"{dtype_name} compute and {backend} collectives {where}",
                sources={"*": where + f"; {time.strftime('%Y-%m-%d')}"},
                fitted={"matmul_samples": len(compute["matmul"]), "matmul_residual": r_mm,
                        "elementwise_samples": len(compute["elementwise"]),
                        "elementwise_residual": r_el, "collective_samples": len(rows),
                        "collective_residuals": link_resid, "procs": procs,
                        "torch": torch.__version__})
    if device == "cuda":
        base["devices_per_node"] = torch.cuda.device_count()
    return HardwareProfile.from_dict(base, origin="calibration")


def progress_steps(procs: int) -> int:
    return len(MATMUL_SIZES) + len(ELEMENTWISE_NUMEL) + max(0, procs - 1)
