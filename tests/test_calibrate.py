"""Calibration against the runtime and the step memory probe (fast, one process, no files
in the user's cache)."""

import gc

import numpy as np
import torch

from meshplan import calibrate as cal
from meshplan.costmodel.compute import contention_factor
from meshplan.costmodel.hardware import load_preset
from meshplan.runtime.memory_probe import StepMemoryProbe


def test_probe_counts_saved_activations_and_grads():
    w = torch.randn(256, 256, requires_grad=True)  # 256 KiB
    with StepMemoryProbe([w]) as probe:
        x = torch.randn(64, 256)  # 64 KiB, saved by the matmul for w's gradient
        y = (x @ w).relu()  # relu keeps its output; the matmul's output is freed
        z = y.sum()
        del x
        assert probe.current_bytes == 4 * (256 * 256 + 64 * 256 + 64 * 256 + 1)
        z.backward()
        del y, z
        gc.collect()
        assert probe.current_bytes == 2 * 4 * 256 * 256  # w and w.grad remain
    assert probe.start_bytes == 4 * 256 * 256
    assert probe.peak_bytes >= 4 * (256 * 256 * 2 + 64 * 256)


def test_probe_counts_views_once():
    with StepMemoryProbe() as probe:
        a = torch.zeros(1000)
        b = a.view(10, 100)[2:]  # noqa: F841 - a view keeps a's storage, no new bytes
    assert probe.peak_bytes == 4000


def test_nonneg_lstsq_recovers_coefficients_and_clamps():
    rng = np.random.default_rng(0)
    design = rng.uniform(1, 10, size=(6, 2))
    y = design @ np.array([2.0, 0.5])
    assert np.allclose(cal._nonneg_lstsq(design, y), (2.0, 0.5))
    k, f = cal._nonneg_lstsq(design, design[:, 0] * 3.0 - design[:, 1] * 0.1)
    assert k > 0 and f == 0.0


def test_effective_cores_set_the_contention():
    hw = load_preset("cpu-local")
    two = cal._with_device(hw, host_cores=2)
    assert contention_factor(two, 4) == 2.0 and contention_factor(two, 1) == 1.0
    fitted = cal._with_device(two, effective_cores=1.6)
    assert contention_factor(fitted, 4) == 4 / 1.6
    assert contention_factor(hw, 4) == 1.0  # host_cores 0: dedicated devices
    slow = cal._scaled(two, 2.0, 1e-3)
    assert slow.device.peak_flops("float32") == two.device.peak_flops("float32") / 2
    assert slow.device.framework_overhead_s == 1e-3
    lat = cal._with_latency(two, 3e-3)
    assert lat.intra_node.for_collective("all_reduce")[1] == 3e-3


def test_fit_runtime_recovers_a_known_profile():
    """Steps predicted by a known profile (compute 2x slower, 100 us per operator, 1.5
    effective cores, 1 ms collective latency) are fitted back to it."""
    from meshplan.api import manual_plan
    from meshplan.costmodel.estimate import estimate_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.specs import example_inputs, parse_model_spec

    base = cal._with_device(load_preset("cpu-local"), host_cores=2)
    truth = cal._with_latency(cal._scaled(base, 2.0, 1e-4, 1.5), 1e-3)
    rows = []
    (_, four, _), = cal.runtime_graphs(4)[:1]
    for text, batch, seq in cal.RUNTIME_GRAPHS[:1]:
        assert four == 4 * batch  # each of 4 processes takes the 1-process batch
        for world, b in ((1, 1), (1, batch), (4, four)):
            spec = parse_model_spec(text)
            meta = spec.build("meta")
            graph = trace(meta, example_inputs(meta, b, seq), model_name=spec.name)
            plan = manual_plan(meta, Mesh.local(world, profile=truth), graph=graph,
                               dtype="fp32", dp=world, microbatch_size=b // world,
                               engine="graph")
            est = estimate_plan(plan, graph, hw=truth)
            rows.append((text, b, seq, world, est.step_time_s,
                         est.breakdown["forward"] + est.breakdown["backward"]))
    fitted, info = cal.fit_runtime(base, rows)
    assert abs(info["compute_scale"] - 2.0) < 0.05
    assert abs(info["framework_overhead_s"] - 1e-4) < 5e-6
    assert abs(info["effective_cores"] - 1.5) < 0.05
    assert abs(info["collective_latency_s"] - 1e-3) < 5e-5
    assert info["runtime_residual_nproc"] < 0.01
    # the calibration's runs are the graph engine's, and are priced as it
    assert cal._runtime_plan(meta, graph, 4, batch, profile=truth).engine == "graph"


def test_a_calibrated_profile_keeps_the_source_of_what_it_did_not_measure():
    """A CUDA calibration starts from dgx-h100 and measures the GEMM and memory curves,
    latency and links; the constants it keeps (the overlap slowdown, attention kernels,
    eager paths) keep the preset's source instead of being labelled measured."""
    from meshplan.costmodel.hardware import MEASURED, calibrated_sources, load_preset

    sources = load_preset("dgx-h100").sources
    got = calibrated_sources(sources, "dgx-h100", "measured here", MEASURED)
    assert got["*"] == "measured here"
    assert "2507.03114" in got["device.overlap_slowdown"]
    assert "device.matmul_efficiency" not in got and "intra_node" not in got
    assert all(k == "*" or k in sources for k in got)
