"""The GPU machine's scripts that have a CPU side: benchmarks/gpu/sac_compile.py (torch.compile
under torchtitan's op-level selective AC) runs its rule on CPU at a tiny size with the same
gradients as no recompute, and its prediction prices the recompute and the fusion."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.harness.benchmarks import ROOT, gpu_benchmark_module

TINY = {"blocks": 2, "dim": 64, "heads": 4, "kv_heads": 2, "hidden": 128}


@pytest.fixture(scope="module")
def sac():
    with gpu_benchmark_module("sac_compile") as module:
        yield module


def test_torchtitans_rule_recomputes_without_changing_the_gradients(sac):
    grads = {}
    for ac in ("selective", "none"):
        net = sac.build(ac, False, "cpu", **TINY)
        x = torch.randn(2, 32, TINY["dim"], dtype=torch.bfloat16,
                        generator=torch.Generator().manual_seed(1))
        loss = sac.run_step(net, x)
        assert loss == loss and loss > 0
        grads[ac] = [p.grad.clone() for p in net.parameters()]
    for a, b in zip(grads["selective"], grads["none"]):
        assert torch.equal(a, b)


def test_the_prediction_prices_recompute_and_fusion(sac, monkeypatch):
    monkeypatch.setattr(sac, "SEQ", 256)
    t = sac.predict("dgx-h100", **TINY)
    assert t["selective_eager"] > t["none_eager"] > t["none_compiled"] > 0
    assert t["selective_eager"] > t["selective_compiled"]


@pytest.mark.parametrize("ac", ["selective", "none"])
def test_the_compiled_blocks_are_not_traced_with_dynamic_shapes(sac, ac, monkeypatch):
    """gpu_check.py's earlier sections compile model.py's Block at another size in the same
    process; a second size makes dynamo retrace with symbolic shapes (automatic dynamic), so
    the section would time a dynamic-shape graph where torchtitan runs a static one."""
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(any(isinstance(s, torch.SymInt) for t in example_inputs
                          for s in (t.shape if isinstance(t, torch.Tensor) else (t,))))
        return gm.forward

    torch._dynamo.reset()  # what other tests of this process compiled is not the premise
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m: compile_(m, backend=recorder))
    import model  # benchmarks/gpu/model.py, on the path beside sac_compile

    other = torch.compile(model.Block(32, 2, 1, 64))  # the earlier section's block size
    other(torch.randn(1, 16, 32), torch.ones(16, 16), torch.zeros(16, 16))
    assert graphs == [False]
    net = sac.build(ac, True, "cpu", **TINY)
    x = torch.randn(2, 32, TINY["dim"], dtype=torch.bfloat16)
    sac.run_step(net, x)
    assert len(graphs) > 1 and not any(graphs)


def test_a_step_leaves_its_own_gradients(sac):
    """Timed steps run back to back: each must compute its gradients, not add to the last
    step's (torchtitan zeroes them every step; the prediction has no accumulation)."""
    net = sac.build("none", False, "cpu", **TINY)
    x = torch.randn(2, 32, TINY["dim"], dtype=torch.bfloat16)
    sac.run_step(net, x)
    once = [p.grad.clone() for p in net.parameters()]
    sac.run_step(net, x)
    assert all(torch.equal(a, p.grad) for a, p in zip(once, net.parameters()))


def test_the_autocast_regime_keeps_fp32_weights_and_recomputes_exactly(sac):
    """torchtitan on one GPU (no FSDP2) trains fp32 weights under torch.autocast: the
    section's second regime, with torchtitan's rule changing no gradient there either."""
    grads = {}
    for ac in ("selective", "none"):
        net = sac.build(ac, False, "cpu", "autocast", **TINY)
        assert all(p.dtype == torch.float32 for p in net.parameters())
        x = torch.randn(2, 32, TINY["dim"], generator=torch.Generator().manual_seed(1))
        sac.run_step(net, x, "autocast")
        grads[ac] = [p.grad.clone() for p in net.parameters()]
        assert all(g.dtype == torch.float32 for g in grads[ac])
    for a, b in zip(grads["selective"], grads["none"]):
        assert torch.equal(a, b)


def test_the_regimes_are_priced_as_they_hold_their_weights(sac, monkeypatch):
    """bf16 parameters (FSDP2's compute) launch no autocast casts; fp32 weights under autocast
    cast each weight and matmul input, which compile fuses only for the activations."""
    monkeypatch.setattr(sac, "SEQ", 256)
    bf16, amp = sac.predict("dgx-h100", "bf16", **TINY), sac.predict("dgx-h100", "autocast", **TINY)
    assert amp["none_eager"] > bf16["none_eager"]
    assert amp["none_eager"] - amp["none_compiled"] > bf16["none_eager"] - bf16["none_compiled"]


def test_the_clock_log_is_read_inside_each_window():
    """gpu_compare reads nvidia-smi's log (run_on_device.sh) over a mode's timed window."""
    import datetime
    import tempfile
    gpu = os.path.join(ROOT, "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        import gpu_compare
    finally:
        sys.path.remove(gpu)
    t0 = datetime.datetime(2026, 11, 27, 1, 46, 0, tzinfo=datetime.timezone.utc)
    rows = [(t0 + datetime.timedelta(seconds=0.1 * i), 1500 + (200 if i >= 10 else 0), 690)
            for i in range(20)]
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        for t, mhz, w in rows:
            f.write(f"{t.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz} MHz, {w}.00 W\n")
        f.write("[N/A], [N/A], [N/A]\n")  # a sample nvidia-smi could not read
    samples = gpu_compare._clock_samples(f.name)
    os.unlink(f.name)
    assert len(samples) == 20
    start = t0.timestamp()
    assert gpu_compare._clock_in(samples, [start + 1.05, start + 1.95]) == ("1700", "690")
    assert gpu_compare._clock_in(samples, [start - 9, start - 8]) == ("", "")
