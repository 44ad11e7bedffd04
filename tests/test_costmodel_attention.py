"""Materialized attention (issue 14): the attention core as it ran before fused kernels
(Megatron-LM 2021), priced kernel by kernel, closed form on a small memory-bound case."""

from dataclasses import replace

import pytest

from meshplan.costmodel.compute import (materialized_attention_saved_bytes,
                                        materialized_attention_time, op_time)
from meshplan.costmodel.runtime_profiles import RuntimeModel
from meshplan.costmodel.hardware import EfficiencyCurve, load_preset
from meshplan.errors import PlanningError
from meshplan.graph import OpKind, OpNode, TensorMeta

B, HEADS, S, D = 2, 4, 1024, 64
BW = 2039e9  # A100 80GB HBM2e, the preset's bandwidth
FIXED = 5e-6  # the preset's kernel latency


def _hw():
    hw = load_preset("dgx-a100-80gb")
    flat = EfficiencyCurve(max_eff=1.0, half_work=0.0)  # every kernel at peak: closed form
    return replace(hw, device=replace(hw.device, matmul_efficiency=flat,
                                      memory_efficiency=flat, framework_overhead_s=0.0))


def _sdpa(dropout_p: float) -> OpNode:
    out = TensorMeta((B, HEADS, S, D), "float32")
    args = f"(['%', '%', '%', '%', {dropout_p}], {{}})" if dropout_p else "(['%', '%', '%', '%'], {})"
    return OpNode(name="sdpa", target="aten.scaled_dot_product_attention.default",
                  kind=OpKind.ATTENTION, inputs=("q", "k", "v", "mask"), outputs=(out,),
                  flops=4 * B * HEADS * S * S * D, bytes_read=4 * 3 * B * HEADS * S * D,
                  bytes_written=4 * B * HEADS * S * D, layer=0, args_repr=args)


E = B * HEADS * S * S  # scores
SCORES = 2 * E  # fp16
X = 2 * B * HEADS * S * D  # one of q, k, v, o in fp16


def test_memory_bound_kernels_in_closed_form():
    """Every kernel here is memory-bound (head dim 64 < A100's 153 FLOP/byte ridge):
    forward Q K^T (2X + S), softmax (2S), dropout (2S + E mask bytes), P V (S + 2X); backward
    dP, dV (S + 2X each), dropout (2S + E), softmax (3S), dQ, dK (S + 2X each)."""
    t = materialized_attention_time(_sdpa(0.1), _hw(), "fp16")
    assert t.forward_s == pytest.approx((4 * X + 6 * SCORES + E) / BW + 4 * FIXED, rel=1e-9)
    assert t.backward_s == pytest.approx((8 * X + 9 * SCORES + E) / BW + 6 * FIXED, rel=1e-9)
    # without dropout, its kernel is gone in both directions
    t0 = materialized_attention_time(_sdpa(0.0), _hw(), "fp16")
    assert t0.forward_s == pytest.approx((4 * X + 4 * SCORES) / BW + 3 * FIXED, rel=1e-9)
    assert t0.backward_s == pytest.approx((8 * X + 7 * SCORES) / BW + 5 * FIXED, rel=1e-9)
    # split over 4 devices: a quarter of the bytes, the same kernels
    t4 = materialized_attention_time(_sdpa(0.1), _hw(), "fp16", 4)
    assert t4.forward_s == pytest.approx((4 * X + 6 * SCORES + E) / 4 / BW + 4 * FIXED, rel=1e-9)


def test_slower_than_fused_and_keeps_the_probabilities():
    node = _sdpa(0.1)
    assert materialized_attention_time(node, _hw(), "fp16").forward_s \
        > 3 * op_time(node, _hw(), "fp16").forward_s
    # softmax output (2 bytes), dropout mask (1) and dropped probabilities (2) per score
    assert materialized_attention_saved_bytes(node, "fp16") == 5 * E
    assert materialized_attention_saved_bytes(_sdpa(0.0), "fp16", 2) == 2 * E / 2


def test_unknown_attention_kernel_is_one_clear_error():
    with pytest.raises(PlanningError, match="attention='paged' is not one of flash, materialized"):
        RuntimeModel(attention="paged")
