"""The GPU machine's scripts that have a CPU side: benchmarks/gpu/sac_compile.py (torch.compile
under torchtitan's op-level selective AC) runs its rule on CPU at a tiny size with the same
gradients as no recompute, and its prediction prices the recompute and the fusion."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.harness.benchmarks import ROOT, benchmark_module

TINY = {"blocks": 2, "dim": 64, "heads": 4, "kv_heads": 2, "hidden": 128}


@pytest.fixture(scope="module")
def sac():
    gpu = os.path.join(ROOT, "benchmarks", "gpu")
    sys.path.insert(0, gpu)  # sac_compile imports model.py beside it
    try:
        with benchmark_module("gpu/sac_compile") as module:
            yield module
    finally:
        sys.path.remove(gpu)
        sys.modules.pop("model", None)


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
