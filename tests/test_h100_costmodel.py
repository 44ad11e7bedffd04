"""Closed-form checks of what issue 14's H100 set changed in the cost model: fused attention
priced at its own efficiency (half the FLOPs when the engine runs it causal), the module
engine holding no causal mask, and the H100 presets with a source for every number."""

from __future__ import annotations

import pytest
import torch

import meshplan
from meshplan.costmodel.compute import op_time
from meshplan.costmodel.hardware import HardwareProfile, load_preset
from meshplan.graph import OpKind, OpNode, TensorMeta
from meshplan.specs import parse_model_spec

SDPA = OpNode(name="sdpa", target="aten._scaled_dot_product_flash_attention.default",
              kind=OpKind.ATTENTION, inputs=("q", "k", "v"),
              outputs=(TensorMeta((8, 32, 8192, 128), "float32"),), flops=4 * 10 ** 14)


def test_attention_runs_at_the_presets_attention_efficiency():
    hw = load_preset("dgx-h100")
    dev = hw.device
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    row = SDPA.flops / (8 * 32 * 8192)  # one query row of one head (compute.attention_work)
    eff = dev.attention_efficiency(row)
    assert eff < dev.matmul_efficiency(SDPA.flops)  # about 0.5 vs 0.71 of peak
    t = op_time(SDPA, hw, "bf16")
    assert t.forward_s == pytest.approx(SDPA.flops / (989e12 * eff) + fixed)
    # backward: 2.5x the forward's FLOPs (compute.py docstring), the curve read at 2.5x
    assert t.backward_s == pytest.approx(2.5 * SDPA.flops / (989e12 * dev.attention_efficiency(
        2.5 * row)) + 2 * fixed)
    # causal (is_causal=True): flash attention skips half of the counted FLOPs
    causal = op_time(SDPA, hw, "bf16", causal=True)
    assert causal.forward_s == pytest.approx(SDPA.flops / 2 / (989e12 * dev.attention_efficiency(
        row / 2)) + fixed)
    # a profile without the field prices attention as a GEMM, as before
    a100 = load_preset("dgx-a100-80gb")
    assert a100.device.attention_efficiency is None
    assert op_time(SDPA, a100, "bf16").forward_s == pytest.approx(
        SDPA.flops / (312e12 * a100.device.matmul_efficiency(SDPA.flops))
        + a100.device.kernel_latency_s + a100.device.framework_overhead_s)


def test_h100_presets_source_every_number_and_round_trip():
    tt = load_preset("h100-96gb-hbm2e")
    sxm = load_preset("dgx-h100")
    assert tt.device.memory_bandwidth_gbps == 2400.0 and sxm.device.memory_bandwidth_gbps == 3350.0
    assert 835.0 <= tt.device.peak_tflops["bfloat16"] <= 989.0  # between NVL and SXM
    for hw in (tt, sxm):
        for key in ("device.peak_tflops", "device.memory_bandwidth_gbps", "device.memory_gib",
                    "device.attention_efficiency", "inter_node", "intra_node"):
            assert hw.sources.get(key), (hw.name, key)
        assert HardwareProfile.from_dict(hw.to_dict()) == hw
    # profiles without the optional field write none (a plan's embedded profile stays valid)
    assert "attention_efficiency" not in load_preset("dgx-a100-80gb").to_dict()["device"]
    assert meshplan.Mesh.preset("h100-96gb-hbm2e", nodes=2).num_devices == 16


LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
BATCH, SEQ = 8, 32


@pytest.fixture(scope="module")
def llama():
    from meshplan.tracing import trace
    model = parse_model_spec(LLAMA).build(device="meta")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return model, ids, trace(model, (ids,))


def test_the_module_engine_holds_no_causal_mask(llama):
    from meshplan.costmodel.memory import causal_masks

    model, ids, graph = llama
    (mask,) = causal_masks(graph)
    assert graph.node(mask).out.shape == (BATCH, 1, SEQ, SEQ)
    plans = {e: meshplan.manual_plan(model, meshplan.Mesh.local(2), (ids,), graph=graph, dp=2,
                                     microbatch_size=2, recompute="full", engine=e)
             for e in ("graph", "modules")}
    # full recompute keeps the mask once per in-flight microbatch on the graph engine, made
    # replicated at dp x microbatch rows (DECISIONS 34): 2 x 2 rows x 32 x 32 booleans; and
    # the layer being recomputed holds the key and value that transformers repeats for an
    # SDPA given a mask (repeat_kv's copies: 2 rows x 4 heads x 32 x 16 fp32 each, twice
    # the 2 key heads' tensor), which the module engine, calling SDPA with enable_gqa, never
    # makes (DECISIONS 108)
    diff = (plans["graph"].predicted.memory.activations_gib
            - plans["modules"].predicted.memory.activations_gib) * 2 ** 30
    copies = 2 * (2 * 4 * SEQ * 16 * 4 - 2 * 2 * SEQ * 16 * 4)
    assert diff == pytest.approx(2 * 2 * SEQ * SEQ + copies)


def test_engines_that_build_no_mask_do_not_price_its_operators():
    """The module engine and the stacks it stands in for run the model eagerly, where
    transformers builds no causal mask: the operators the export made it with (position
    indices, comparisons and ``and``s at batch x seq x seq) cost them nothing, so a
    data-parallel rank's step does not grow with the global batch (before: those operators,
    replicated, were priced at the global batch, 63 ms per step for Llama 3.1 8B on 128
    GPUs). The graph engine replays the export and builds them."""
    from meshplan.costmodel.kernel_paths import materializes
    from meshplan.costmodel.memory import causal_masks, mask_builders
    from meshplan.tracing import trace

    seq = 1024  # masks of batch x seq x seq booleans: bandwidth, not launches
    model = parse_model_spec(LLAMA.replace("max_position_embeddings=64",
                                           f"max_position_embeddings={seq}")).build(device="meta")
    built = {}
    for dp in (2, 8):  # FSDP2 on both (one device would run autocast's fp32 weights)
        ids = torch.zeros(2 * dp, seq, dtype=torch.long, device="meta")
        graph = trace(model, (ids,))
        builders = mask_builders(graph)
        assert causal_masks(graph) <= builders
        assert {graph.node(n).target.split(".")[1] for n in builders} >= {"le", "__and__"}
        # transformers repeats keys and values only when it passes SDPA a mask; with none
        # it calls SDPA with enable_gqa=True, so the copies go with the mask
        repeats = {n.name for n in graph.nodes if materializes(graph, n.name)}
        assert len(repeats) == 4 and repeats <= builders  # 2 blocks x (keys, values)
        assert not (builders - repeats) & graph.data_nodes
        mesh = meshplan.Mesh.from_dict({"shape": [dp], "hardware": "dgx-h100",
                                        "name": f"h100x{dp}"})
        for engine in ("torchtitan", "megatron", "graph"):
            plan = meshplan.manual_plan(model, mesh, (ids,), graph=graph, dp=dp, zero=3,
                                        microbatch_size=2, dtype="bf16", engine=engine)
            built[engine, dp] = plan.predicted.breakdown["forward"]
    assert built["torchtitan", 8] == pytest.approx(built["torchtitan", 2], rel=1e-3)
    assert built["megatron", 8] == pytest.approx(built["megatron", 2], rel=1e-3)
    assert built["graph", 8] > built["graph", 2] * 1.02  # replicated, at 4x the rows


def test_both_engines_run_attention_causal(llama):
    """The module engine's eager model builds no mask; the graph engine's replay finds the
    folded causal mask and drops it (DECISIONS 67): both price the attention at half its
    FLOPs, and pricing them as masked costs exactly that half again."""
    from dataclasses import replace

    from meshplan.costmodel.estimate import default_runtime, estimate_plan

    from meshplan.costmodel.hardware import EfficiencyCurve

    model, ids, graph = llama
    mesh = meshplan.Mesh.preset("dgx-h100")
    # a flat, slow attention curve: at this size (32 keys a row) the preset's curve is in its
    # per-tile-overhead regime, where a causal kernel costs what a full one does, and the
    # kernel is memory-bound; this one keeps it compute-bound at a fixed fraction of peak
    dev = mesh.hardware.device
    flat = replace(dev, attention_efficiency=EfficiencyCurve(max_eff=1e-4, half_work=1.0))
    mesh = replace(mesh, hardware=replace(mesh.hardware, device=flat))
    hw = mesh.hardware
    attn = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    assert len(attn) == 2
    saved = sum(op_time(n, hw, "bf16", 8).forward_s - op_time(n, hw, "bf16", 8, causal=True).forward_s
                for n in attn)
    assert saved > 0
    for engine in ("graph", "modules"):
        plan = meshplan.manual_plan(model, mesh, (ids,), graph=graph, dp=8, microbatch_size=1,
                                    dtype="bf16", engine=engine)
        masked = replace(default_runtime(hw, engine=engine), causal_attention=False)
        fwd = estimate_plan(plan, graph, runtime=masked).breakdown["forward"]
        assert fwd - plan.predicted.breakdown["forward"] == pytest.approx(saved, rel=1e-6), engine


def _torchtitan_published():
    import importlib.util
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "torchtitan_published_bench", os.path.join(root, "benchmarks",
                                                       "torchtitan_published.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def test_torchtitan_benchmark_meshes_price_attention_as_stated():
    """torchtitan's 2024 H100 rows run SDPA's flash backend (the preset's fa2 curve, DECISIONS
    102); ``--a100-attention-efficiency E`` prices A100 attention at E of peak. The curve is
    read at one query row's work, so E with the GEMM curve's half-work (3e9 kernel FLOPs)
    priced the A100's attention at 0.04% of peak instead."""
    tp = _torchtitan_published()
    h100 = tp.h100_mesh(8).hardware
    assert h100.device.attention_efficiency == \
        load_preset("h100-96gb-hbm2e").device.attention_kernels["fa2"]
    a100 = tp._with_attention_efficiency(meshplan.Mesh.preset("dgx-a100-80gb", nodes=8), 0.6)
    hw = a100.hardware
    s = 4096
    node = OpNode(name="a", target="aten._scaled_dot_product_flash_attention.default",
                  kind=OpKind.ATTENTION, inputs=(),
                  outputs=(TensorMeta((1, 40, s, 128), "float32"),), flops=4 * 40 * s * s * 128)
    t = op_time(node, hw, "bf16", causal=True)
    eff = node.flops / 2 * 3.5 / t.total_s / hw.device.peak_flops("bfloat16")
    assert eff == pytest.approx(0.6, rel=0.01)


@pytest.mark.parametrize("key", ["attention_efficiency", "fa2"])
def test_an_attention_curve_in_kernel_flops_is_refused(key):
    """A profile (or a plan saved before DECISIONS 102) whose attention curve's half_work is
    in kernel FLOPs (the published curves' 8e9) would price attention at under 0.1% of peak,
    since the curve is read at one query row's FLOPs: loading it is one clear error."""
    d = load_preset("dgx-h100").to_dict()
    if key == "fa2":
        d["device"]["attention_kernels"]["fa2"]["half_work"] = 8e9
    else:
        d["device"][key]["half_work"] = 8e9
    with pytest.raises(meshplan.MeshplanError, match=r"half_work is 8e\+09; attention curves "
                                                     r"are read at one query row's FLOPs"):
        HardwareProfile.from_dict(d)
    # every shipped preset loads
    from meshplan.costmodel.hardware import preset_names
    for name in preset_names():
        load_preset(name)


@pytest.mark.parametrize("window,built", [(16, True), (64, False)])
def test_a_sliding_window_mask_is_built_when_the_keys_reach_the_window(window, built):
    """transformers keeps a sliding-window mask when the keys are at least the window long
    (``masking_utils._ignore_causal_mask_sdpa``), and the eager engines then build it and
    repeat the keys and values: it is no skipped causal mask (the second review of
    DECISIONS 106: Mistral's and Gemma 3's windows were skipped). Shorter, the band is the
    causal pattern and nothing is built."""
    from meshplan.costmodel.memory import causal_masks, mask_builders
    from meshplan.tracing import trace

    spec = ("transformers:mistral?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
            "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&"
            f"max_position_embeddings=64&sliding_window={window}")
    model = parse_model_spec(spec).build(device="meta")
    graph = trace(model, (torch.zeros(2, 32, dtype=torch.long, device="meta"),))
    assert (not causal_masks(graph)) == built
    assert (not mask_builders(graph)) == built
