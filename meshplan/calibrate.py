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
4. on CPU, the runtime itself (``parallelize`` + ``train_step``, as ``meshplan run`` executes
   a plan) on small GPT-2 graphs (``RUNTIME_GRAPHS``: other sizes than the accuracy
   benchmark's, so that benchmarks/costmodel_accuracy.py is not the training set), with 1
   process and with N processes (data parallel, each process with the 1-process batch).
   ``fit_runtime`` fits, by least squares on
   relative error: the compute scale k and the per-operator framework overhead f (the fx
   Interpreter, DTensor dispatch and autograd of the runtime) from the 1-process steps;
   the effective cores (contention N / cores) from the N-process forward + backward; and
   the latency of one collective as the runtime meets it from the N-process steps (on
   oversubscribed cores a collective ends only when every rank has been scheduled, which
   costs milliseconds, far above the bare collective timed in 3). These runs are the graph
   engine's, and are priced as the graph engine (the engine that ran them).
Sample counts and relative residuals go under ``fitted``. The local profile records
``host_cores`` so that estimates slow compute when processes outnumber cores. The whole
calibration takes about 1.5-2.5 minutes on 2 shared cores with 4 processes.
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
from meshplan.costmodel.hardware import (MEASURED, MEASURED_ON_CPU, HardwareProfile,
                                        calibrated_sources, load_preset)
from meshplan.vocabulary import ComputeDtype, Engine

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


def _run_group(world: int, target, args: tuple, timeout_s: float) -> list[tuple]:
    """Spawn ``world`` processes of ``target(rank, world, port, *args, queue)``; rank 0 puts
    its rows on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=timeout_s)
    for p in procs:
        p.join(timeout=60)
    return rows


def measure_collectives(max_procs: int, backend: str, progress=None) -> list[tuple]:
    rows = []
    for world in range(2, max_procs + 1):
        rows += _run_group(world, _collective_worker, (backend,), timeout_s=300)
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


# -- the runtime itself: per-operator overhead, compute scale, contention -----------------------

# Calibration graphs: small GPT-2s at batch x seq, deliberately other sizes than
# benchmarks/costmodel_accuracy.py (4 layers, width 256, vocab 8192, batch 8 x 128) so that the
# accuracy benchmark is not its own training set. Tiny token counts (overhead-bound) and a
# wide layer (compute-bound) separate the per-operator cost from the compute rate.
RUNTIME_GRAPHS = (
    ("transformers:gpt2?n_layer=1&n_embd=128&n_head=4&vocab_size=2048&n_positions=64", 4, 16),
    ("transformers:gpt2?n_layer=2&n_embd=128&n_head=4&vocab_size=2048&n_positions=64", 4, 32),
    ("transformers:gpt2?n_layer=1&n_embd=384&n_head=6&vocab_size=4096&n_positions=64", 4, 64),
)
def runtime_graphs(procs: int) -> list[tuple[str, int, int]]:
    """``RUNTIME_GRAPHS`` as ``procs`` processes run them: each process takes the 1-process
    batch (weak scaling), so the contention is measured on the same per-process work, not
    on a few tokens per rank (which made the fit swing between calibrations)."""
    return [(text, batch * procs, seq) for text, batch, seq in RUNTIME_GRAPHS]


RUNTIME_STEPS = 6  # the first step (optimizer state allocation, warm-up) is not timed


def _runtime_plan(meta, graph, world: int, batch: int, *,
                  profile: HardwareProfile | None = None):
    """The data-parallel plan a calibration run executes, for the engine that runs it (the
    graph engine: ``parallelize_graph``, runtime/graph/parallelize.py), so that it is priced
    as that engine (left to ``engine="auto"``, these small data-parallel plans would be priced as
    the module engine, whose collectives overlap the backward)."""
    from meshplan.api import manual_plan
    from meshplan.mesh import Mesh

    return manual_plan(meta, Mesh.local(world, profile=profile or load_preset("cpu-local")),
                       graph=graph, dtype=ComputeDtype.FP32, dp=world,
                       microbatch_size=batch // world,
                       engine=Engine.GRAPH)


def _runtime_worker(rank: int, world: int, port: int, graphs, queue) -> None:
    """Time ``meshplan run``'s path (parallelize + train_step) of each graph as dp=world."""
    import torch.distributed as dist

    from meshplan.tracing import trace
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    results = []
    for text, batch, seq in graphs:
        spec = parse_model_spec(text)
        meta = spec.build("meta")
        graph = trace(meta, example_inputs(meta, batch, seq), model_name=spec.name)
        plan = _runtime_plan(meta, graph, world, batch)
        torch.manual_seed(0)
        model = spec.build("cpu")
        pm = parallelize_graph(model, plan, (synthetic_batch(model, batch, seq, seed=0, step=0),))
        opt = make_optimizer(pm.optimizer_params(), plan)
        times, compute = [], []
        for step in range(RUNTIME_STEPS):
            x = synthetic_batch(model, batch, seq, seed=0, step=step)
            dist.barrier()
            start = time.perf_counter()
            pm.train_step(x, opt)
            dist.barrier()
            times.append(time.perf_counter() - start)
            dist.barrier()  # forward + backward alone: the compute the contention slows
            start = time.perf_counter()
            pm.loss(x).backward()
            compute.append(time.perf_counter() - start)
            for p in pm.unique_params():
                p.grad = None
        results.append((text, batch, seq, world, statistics.median(times[1:]),
                        statistics.median(compute[1:])))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def measure_runtime(worlds=(1,), graphs=RUNTIME_GRAPHS, progress=None) -> list[tuple]:
    """(model, batch, seq, processes, median step s, median forward + backward s) of the
    graph engine on each graph."""
    rows = []
    for world in worlds:
        rows += _run_group(world, _runtime_worker, (graphs,), timeout_s=600)
        if progress:
            progress()
    return rows


def _with_device(profile: HardwareProfile, **changes) -> HardwareProfile:
    d = profile.to_dict()
    d["device"].update(changes)
    return HardwareProfile.from_dict(d, origin="calibration")


def _scaled(profile: HardwareProfile, k: float, overhead: float, cores: float = 0.0) -> HardwareProfile:
    """The profile with every roofline time and the kernel latency k x slower."""
    dev = profile.device
    return _with_device(profile, peak_tflops={n: v / k for n, v in dev.peak_tflops.items()},
                        memory_bandwidth_gbps=dev.memory_bandwidth_gbps / k,
                        kernel_latency_s=dev.kernel_latency_s * k,
                        framework_overhead_s=overhead, effective_cores=cores)


def _nonneg_lstsq(design: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Two non-negative coefficients minimising the relative error of ``design @ c ~ y``."""
    a = design / y[:, None]
    best, best_err = (0.0, 0.0), np.inf
    sol, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    candidates = [tuple(sol)] if min(sol) >= 0 else []
    for j in (0, 1):  # one coefficient at zero: 1-D least squares on the other
        col = a[:, j]
        c = float(col @ np.ones_like(y) / (col @ col)) if col @ col > 0 else 0.0
        candidates.append((c, 0.0) if j == 0 else (0.0, c))
    for c in candidates:
        err = float(np.sum((a @ np.array(c) - 1) ** 2))
        if err < best_err and min(c) >= 0:
            best, best_err = (float(c[0]), float(c[1])), err
    return best


def _with_latency(profile: HardwareProfile, latency: float) -> HardwareProfile:
    """The profile with every collective's fixed latency set to ``latency``."""
    d = profile.to_dict()
    for level in ("intra_node", "inter_node"):
        d[level]["latency_s"] = latency
        for kind in d[level].get("collectives", {}).values():
            kind["latency_s"] = latency
    return HardwareProfile.from_dict(d, origin="calibration")


def fit_runtime(profile: HardwareProfile, rows: list[tuple]) -> tuple[HardwareProfile, dict]:
    """Fit the runtime's costs to measured steps (rows of ``measure_runtime``).

    The cost model is linear in the compute scale k and the per-operator overhead f for a
    fixed graph (step = k T0 + f A, where T0 is the estimate without framework overhead and
    A its derivative in f), so the 1-process fit is a 2-parameter linear least squares; the
    contention s (cores = N / s) is the 1-parameter fit of the N-process forward + backward,
    and the collective latency the 1-parameter fit of the rest of the N-process step. Each
    row is priced as the graph engine, the engine that ran it (``_runtime_plan``)."""
    from meshplan.costmodel.estimate import estimate_plan
    from meshplan.tracing import trace
    from meshplan.specs import example_inputs, parse_model_spec

    cases = []
    for text, batch, seq, world, measured, compute in rows:
        spec = parse_model_spec(text)
        meta = spec.build("meta")
        graph = trace(meta, example_inputs(meta, batch, seq), model_name=spec.name)
        cases.append((_runtime_plan(meta, graph, world, batch, profile=profile), graph, world,
                      measured, compute))

    def predict(hw, case, part=None):
        est = estimate_plan(case[0], case[1], hw=hw)
        return est.step_time_s if part is None else sum(est.breakdown[k] for k in part)

    ones = [c for c in cases if c[2] == 1]
    base0, base1 = _scaled(profile, 1.0, 0.0), _scaled(profile, 1.0, 1e-3)
    t0 = np.array([predict(base0, c) for c in ones])
    dfd = (np.array([predict(base1, c) for c in ones]) - t0) / 1e-3
    y = np.array([c[3] for c in ones])
    k, f = _nonneg_lstsq(np.stack([t0, dfd], axis=1), y)
    k = max(k, 1e-3)
    one_resid = [abs(predict(_scaled(profile, k, f), c) - c[3]) / c[3] for c in ones]
    fitted = _scaled(profile, k, f)
    many = [c for c in cases if c[2] > 1]
    cores, latency, many_resid = float(profile.device.host_cores or 1), None, []
    if many:
        # (a) contention s = N / cores from the forward + backward time of N processes,
        #     against the model's forward + backward without contention;
        # (b) then the latency of one collective as the runtime sees it (every rank must be
        #     scheduled for it to finish, on shared cores), from the whole step
        n = many[0][2]
        free = _scaled(profile, k, f, float(n))
        fb = np.array([predict(free, c, ("forward", "backward")) for c in many])
        meas_fb = np.array([c[4] for c in many])
        r = fb / meas_fb  # least squares of the relative error of s x fb ~ measured
        s = float(r.sum() / (r @ r))
        cores = float(n / max(s, 1.0))
        flat = _with_latency(_scaled(profile, k, f, cores), 0.0)
        e_a = np.array([predict(flat, c) for c in many])
        dl = (np.array([predict(_with_latency(flat, 1e-3), c) for c in many]) - e_a) / 1e-3
        y = np.array([c[3] for c in many])
        latency = float(max(0.0, ((y - e_a) / y) @ (dl / y) / ((dl / y) @ (dl / y))))
        fitted = _with_latency(_scaled(profile, k, f, cores), latency)
        many_resid = [abs(predict(fitted, c) - c[3]) / c[3] for c in many]
    info = {"runtime_samples": [list(r) for r in rows], "compute_scale": k,
            "framework_overhead_s": f, "effective_cores": cores,
            "collective_latency_s": latency,
            "runtime_residual_1proc": float(np.median(one_resid)),
            "runtime_residual_nproc": float(np.median(many_resid)) if many_resid else None}
    return fitted, info


def calibrate(procs: int = 4, *, device: str | None = None, progress=None,
              runtime: bool = True) -> HardwareProfile:
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
    preset = "cpu-local" if device == "cpu" else "dgx-h100"
    base = load_preset(preset).to_dict()
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
                sources=calibrated_sources(
                    base.get("sources", {}), preset, where + f"; {time.strftime('%Y-%m-%d')}",
                    MEASURED_ON_CPU if device == "cpu" else MEASURED),
                fitted={"matmul_samples": len(compute["matmul"]), "matmul_residual": r_mm,
                        "elementwise_samples": len(compute["elementwise"]),
                        "elementwise_residual": r_el, "collective_samples": len(rows),
                        "collective_residuals": link_resid, "procs": procs,
                        "torch": torch.__version__})
    if device == "cuda":
        base["devices_per_node"] = torch.cuda.device_count()
    profile = HardwareProfile.from_dict(base, origin="calibration")
    if device == "cpu" and runtime:
        worlds = (1, procs) if procs > 1 else (1,)
        rows = measure_runtime(worlds=(1,), progress=progress)
        if procs > 1:
            rows += measure_runtime(worlds=(procs,), progress=progress,
                                    graphs=runtime_graphs(procs))
        profile, info = fit_runtime(profile, rows)
        d = profile.to_dict()
        d["fitted"].update(info, runtime_worlds=list(worlds))
        d["sources"]["device.framework_overhead_s"] = (
            where + ": 1-process runs of the runtime (parallelize + train_step) on "
            "RUNTIME_GRAPHS, least squares with the compute scale")
        d["sources"]["device.effective_cores"] = (
            where + f": {procs}-process data-parallel runs of the runtime, 1-D least squares")
        profile = HardwareProfile.from_dict(d, origin="calibration")
    return profile


def progress_steps(procs: int, runtime: bool = True) -> int:
    return len(MATMUL_SIZES) + len(ELEMENTWISE_NUMEL) + max(0, procs - 1) + \
        (1 + (procs > 1)) * runtime
