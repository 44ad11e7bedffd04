"""The GPU presets' GEMM and attention curves are fitted to the kernels measured on a lent GPU
(benchmarks/gpu/kernel_fit.py, DECISIONS 102): the fit prices as the estimate does, finds a
known curve again, and the presets hold exactly what it finds in the recorded measurements."""

from __future__ import annotations

import math

import pytest

from meshplan.costmodel.compute import op_time
from meshplan.costmodel.hardware import load_preset
from meshplan.graph import OpKind, OpNode, TensorMeta
from tests.harness.benchmarks import benchmark_module



@pytest.fixture(scope="module")
def kf():
    with benchmark_module("gpu/kernel_fit") as module:
        yield module


@pytest.fixture(scope="module")
def fitted(kf):
    return {name: kf.record_fits(kf.load_record(name)) for name in set(kf.FITS.values())}


def _node(kind, flops):
    return OpNode(name="x", target="aten.mm.default", kind=kind, inputs=(),
                  outputs=(TensorMeta((16, 16), "float32"),), flops=int(flops),
                  bytes_read=16, bytes_written=16)


def _attention(flops):
    return OpNode(name="a", target="aten._scaled_dot_product_flash_attention.default",
                  kind=OpKind.ATTENTION, inputs=(),
                  outputs=(TensorMeta((2, 32, 4096, 128), "float32"),), flops=int(flops),
                  bytes_read=16, bytes_written=16)


@pytest.mark.parametrize("flops", [2e10, 5.5e11, 7.7e12])
def test_the_fit_prices_each_kernel_as_the_estimate_does(kf, flops):
    hw = load_preset("dgx-h100")
    dev = hw.device
    peak, lat = dev.peak_tflops["bfloat16"], dev.kernel_latency_s
    t = op_time(_node(OpKind.MATMUL, flops), hw, "bf16")
    m, h = dev.matmul_efficiency.max_eff, dev.matmul_efficiency.half_work
    assert kf.gemm_time(m, h, peak, lat, flops) == pytest.approx(t.forward_s, rel=1e-9)
    # attention, causal: the estimate halves the operator's FLOPs, as the kernel does, and
    # reads the curve at one query row's work (2 x 32 heads x 4096 queries here)
    a = op_time(_attention(2 * flops), hw, "bf16", causal=True)
    c = dev.attention_efficiency
    assert kf.attention_time(c.max_eff, c.half_work, peak, lat, flops, 2 * 32 * 4096) == \
        pytest.approx(a.forward_s + a.backward_s, rel=1e-9)


def test_the_fit_finds_a_known_curve_again(kf):
    points = [(w, kf.gemm_time(0.65, 3e9, 989, 5e-6, w)) for w in (1e10, 1e11, 1e12, 1e13)]
    m, h, rms = kf.fit(lambda m, h, w: kf.gemm_time(m, h, 989, 5e-6, w), points)
    assert m == pytest.approx(0.65, abs=0.0015)
    assert math.log10(h) == pytest.approx(math.log10(3e9), abs=0.02)
    assert rms < 5e-3  # the grid: 30 steps a decade


def test_presets_hold_the_curves_fitted_to_the_recorded_kernels(kf, fitted):
    """An edit of a preset's curve without a refit (or a new measurement without one) fails."""
    for preset, record in kf.FITS.items():
        dev = load_preset(preset).device
        fits = fitted[record]
        assert (dev.matmul_efficiency.max_eff, dev.matmul_efficiency.half_work) == \
            fits["matmul"][:2], preset
        for curve in kf.ATTENTION_CURVES:
            c = dev.attention_kernels[curve]
            assert (c.max_eff, c.half_work) == fits[curve][:2], (preset, curve)
        # fa3: published max_eff, no point measured; its half_work (per query row) is fa2's
        assert dev.attention_kernels["fa3"].half_work == fits["fa2"][1], preset
        # SDPA's default on Hopper since torch 2.9 (what meshplan's own engines run)
        assert dev.attention_efficiency == dev.attention_kernels["cudnn"]


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-h200"])
def test_the_presets_price_the_measured_kernels(kf, preset):
    """Each measured GEMM and attention point against the preset's own curves: the published
    constants they replace (0.75 / 8e9 GEMMs, 0.35 and 0.51 attention) missed the attention
    points by up to 2x (seq 1K) and every large GEMM by 3-30%."""
    hw = load_preset(preset)
    dev = hw.device
    record = kf.load_record(kf.FITS[preset])
    peak, lat = dev.peak_tflops["bfloat16"], dev.kernel_latency_s

    def rms(errors):
        return math.sqrt(sum(e * e for e in errors) / len(errors))

    c = dev.matmul_efficiency
    gemm = [math.log(kf.gemm_time(c.max_eff, c.half_work, peak, lat, w) / t)
            for w, t in kf.gemm_points(record)]
    assert rms(gemm) < 0.10
    for curve, backend in kf.ATTENTION_CURVES.items():
        c = dev.attention_kernels[curve]
        att = [math.log(kf.attention_time(c.max_eff, c.half_work, peak, lat, w, rows) / t)
               for w, t, rows in kf.attention_points(record, backend)]
        assert rms(att) < 0.04, (curve, rms(att))
        assert max(abs(e) for e in att) < 0.08, curve


def test_attention_efficiency_follows_the_keys_each_query_row_sees():
    """A fused attention's price is read at one query row's work (compute.attention_work):
    batch, heads and the devices splitting them change its time in proportion to its FLOPs;
    a longer sequence (more keys per row) runs at a higher fraction of peak."""
    hw = load_preset("dgx-h100")

    def att(b, h, s):
        n = OpNode(name="a", target="aten._scaled_dot_product_flash_attention.default",
                   kind=OpKind.ATTENTION, inputs=(),
                   outputs=(TensorMeta((b, h, s, 128), "float32"),),
                   flops=4 * b * h * s * s * 128, bytes_read=16, bytes_written=16)
        return n

    lat = hw.device.kernel_latency_s
    one = op_time(att(1, 8, 8192), hw, "bf16", causal=True).forward_s - lat
    eight = op_time(att(8, 8, 8192), hw, "bf16", causal=True).forward_s - lat
    assert eight == pytest.approx(8 * one, rel=1e-9)
    # 64 heads split over 8 devices: each runs 8 heads, at the same efficiency
    split = op_time(att(1, 64, 8192), hw, "bf16", 8, causal=True).forward_s - lat
    assert split == pytest.approx(one, rel=1e-9)
    # twice the keys per row: 4x the FLOPs in under 4x the time
    longer = op_time(att(1, 8, 16384), hw, "bf16", causal=True).forward_s - lat
    assert 3.0 * one < longer < 3.95 * one


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-h200", "h100-96gb-hbm2e"])
def test_every_attention_curve_is_read_per_query_row(preset):
    """Every fused-attention curve of a preset (the default and each named kernel, fa3's
    too) is read at one query row's work (compute.attention_work, ~1e6 FLOPs at seq 8K), so
    its half_work must be on that scale: a half_work left in kernel FLOPs (8e9, the
    published curves') priced FlashAttention-3 at 0.03% of peak, 1,700x cuDNN's time."""
    from dataclasses import replace

    hw = load_preset(preset)
    s = 8192
    node = OpNode(name="a", target="aten._scaled_dot_product_flash_attention.default",
                  kind=OpKind.ATTENTION, inputs=(),
                  outputs=(TensorMeta((1, 32, s, 128), "float32"),),
                  flops=4 * 32 * s * s * 128, bytes_read=16, bytes_written=16)
    peak = hw.device.peak_tflops["bfloat16"] * 1e12
    curves = {"": hw.device.attention_efficiency, **hw.device.attention_kernels}
    for kernel, curve in curves.items():
        dev = hw.device.with_attention_kernel(kernel)
        t = op_time(node, replace(hw, device=dev), "bf16", causal=True)
        eff = node.flops / 2 * 3.5 / t.total_s / peak
        assert 0.5 * curve.max_eff < eff <= curve.max_eff, (preset, kernel or "default", eff)


def test_unbatched_attention_is_read_per_query_row_too():
    """SDPA accepts (queries, dim) tensors (torch 2.13: F.scaled_dot_product_attention of
    64 x 16 gives 64 x 16): one head of one sequence, priced as the same (1, 1, S, D) one.
    Before, an output of fewer than 3 dims read the curve at the kernel's FLOPs."""
    hw = load_preset("dgx-h100")

    def att(shape):
        s, d = shape[-2], shape[-1]
        return OpNode(name="a", target="aten.scaled_dot_product_attention.default",
                      kind=OpKind.ATTENTION, inputs=(),
                      outputs=(TensorMeta(shape, "float32"),), flops=4 * s * s * d)

    assert op_time(att((4096, 128)), hw, "bf16") == op_time(att((1, 1, 4096, 128)), hw, "bf16")


def test_ring_context_parallelism_reads_the_curve_per_kv_chunk(monkeypatch):
    """Ring context parallelism (torch's context_parallel on the module engine and
    torchtitan, Transformer Engine's p2p CP under Megatron-LM) runs one attention kernel per
    K/V chunk of S / cp keys; the graph engine all-gathers K and V and runs one kernel over
    all of them. The estimate reads the attention curve at a row's work / cp on the ring
    engines (operators.ring_kv_chunks) and at the whole row's on the graph engine."""
    import meshplan
    from meshplan.costmodel import operators
    from meshplan.costmodel.estimate import default_runtime
    from meshplan.costmodel.stage_layout import split_factor
    from meshplan.specs import example_inputs, parse_model_spec
    from meshplan.tracing import trace

    # head dim 128 at 2K tokens: attention is compute-bound and on the curve's slope
    model = parse_model_spec("transformers:llama?hidden_size=256&intermediate_size=512"
                             "&num_hidden_layers=2&num_attention_heads=2&num_key_value_heads=1"
                             "&vocab_size=1024&max_position_embeddings=2048").build("meta")
    graph = trace(model, example_inputs(model, 8, 2048))
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    attn = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    for engine, chunks in (("modules", 2), ("torchtitan", 2), ("megatron", 2), ("graph", 1)):
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype="bf16",
                                    zero=1, engine=engine)
        stage = plan.stages[0]
        cp_ax = stage.axis_names.index("cp")
        ring = default_runtime(load_preset("dgx-h100"), engine=engine).cp_composable
        assert {operators.ring_kv_chunks(n, stage.ops[n.name], stage.mesh_shape, cp_ax, ring)
                for n in attn} == {chunks}, engine
    # the module engine's estimate moves by exactly the attention kernels' difference
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype="bf16", zero=1,
                                engine="modules")
    stage = plan.stages[0]
    m = plan.training.microbatches
    ring = meshplan.estimate(plan).breakdown["forward"]
    monkeypatch.setattr(operators, "ring_kv_chunks", lambda *a: 1)
    whole = meshplan.estimate(plan).breakdown["forward"]
    hw = load_preset("dgx-h100")
    delta = 0.0
    for n in attn:
        shard = split_factor(stage.ops[n.name].output, stage.mesh_shape) * m
        delta += (op_time(n, hw, "bf16", shard, causal=True, kv_chunks=2).forward_s
                  - op_time(n, hw, "bf16", shard, causal=True).forward_s) * m
    assert delta > 0
    assert ring - whole == pytest.approx(delta, rel=1e-6)
    # explain's pricer (the chosen placement and its alternatives) reads it the same way
    monkeypatch.undo()
    from meshplan.costmodel.estimate import operator_pricer
    from meshplan.costmodel.operators import operator_time

    pricer = operator_pricer(plan, graph, 0)
    for n in attn:
        op = stage.ops[n.name]
        t = operator_time(n, op, graph, pricer.hw, "bf16", stage.mesh_shape, m,
                          pricer.contention, kernels=pricer.kernels, causal=True, kv_chunks=2)
        assert pricer.compute_s(n, op) == pytest.approx(t.total_s, rel=1e-9)
