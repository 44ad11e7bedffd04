"""Calibration against the runtime and the step memory probe (fast, one process, no files
in the user's cache)."""

import gc

import numpy as np
import torch

from meshplan.costmodel import calibrate as cal
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
