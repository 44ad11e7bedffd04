"""Closed-form checks of the cost model: each collective formula, each memory term, the
pipeline formula, schema validation, and a 175B model that cannot fit on 8 GPUs."""

import json
import math

import pytest

from meshplan.costmodel.comm import Collective, axis_link, collective_time_s
from meshplan.costmodel.hardware import (HardwareProfile, LinkSpec, load_preset, preset_names,
                                         validate_profile)
from meshplan.costmodel.memory import (inflight_microbatches, model_state_bytes,
                                       state_bytes_per_param, zero3_buffer_bytes)
from meshplan.costmodel.pipeline import pipeline_step_time
from meshplan.errors import MeshError

A, B = 1e-5, 100e9  # intra-node latency (s) and bandwidth (B/s) of the test profile
A2, B2 = 3e-5, 10e9


def _hw():
    d = load_preset("dgx-a100-80gb").to_dict()
    d["intra_node"] = {"name": "x", "bandwidth_gbps": B / 1e9, "latency_s": A, "collectives": {}}
    d["inter_node"] = {"name": "y", "bandwidth_gbps": B2 / 1e9, "latency_s": A2, "collectives": {}}
    return HardwareProfile.from_dict(d)


@pytest.mark.parametrize("kind,steps,factor", [
    (Collective.ALL_REDUCE, lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    (Collective.ALL_GATHER, lambda n: n - 1, lambda n: (n - 1) / n),
    (Collective.REDUCE_SCATTER, lambda n: n - 1, lambda n: (n - 1) / n),
    (Collective.ALL_TO_ALL, lambda n: n - 1, lambda n: (n - 1) / n),
    (Collective.BROADCAST, lambda n: n - 1, lambda n: 1.0),
    (Collective.SEND_RECV, lambda n: 1, lambda n: 1.0),
])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_flat_collectives_closed_form(kind, steps, factor, n):
    hw, nbytes = _hw(), 64e6
    assert collective_time_s(hw, kind, nbytes, n) == pytest.approx(steps(n) * A + factor(n) * nbytes / B)
    assert collective_time_s(hw, kind, nbytes, n, crosses_nodes=True) == \
        pytest.approx(steps(n) * A2 + factor(n) * nbytes / B2)
    assert collective_time_s(hw, kind, nbytes, 1) == 0.0


def test_hierarchical_all_reduce_is_rs_ar_ag():
    hw, nb = _hw(), 80e6
    local, nodes = 8, 4
    expect = ((local - 1) * A + (local - 1) / local * nb / B  # reduce-scatter in the node
              + 2 * (nodes - 1) * A2 + 2 * (nodes - 1) / nodes * (nb / local) / B2  # across nodes
              + (local - 1) * A + (local - 1) / local * nb / B)  # all-gather in the node
    got = collective_time_s(hw, "all_reduce", nb, 32, crosses_nodes=True, local_size=8)
    assert got == pytest.approx(expect)
    ag = collective_time_s(hw, "all_gather", nb, 32, crosses_nodes=True, local_size=8)
    assert ag == pytest.approx((nodes - 1) * A2 + (nodes - 1) / nodes * nb / local / B2
                               + (local - 1) * A + (local - 1) / local * nb / B)


def test_per_collective_override():
    link = LinkSpec("l", 10.0, 1e-5, collectives={"all_gather": {"bandwidth_gbps": 5.0}})
    assert link.for_collective("all_gather") == (5.0, 1e-5)
    assert link.for_collective("all_reduce") == (10.0, 1e-5)


def test_axis_link_row_major():
    # (pp-free) stage mesh (dp=4, tp=8) on 8-GPU nodes: tp inside a node, dp across nodes
    assert axis_link((4, 8), 1, 8) == (False, 8)
    assert axis_link((4, 8), 0, 8) == (True, 1)
    assert axis_link((2, 4), 0, 8) == (False, 2)
    assert axis_link((4, 2), 0, 4) == (True, 2)  # 2 members of each dp group per node


@pytest.mark.parametrize("dtype,opt,expect", [
    ("fp32", "adam", (4, 4, 8)), ("bf16", "adam", (2, 4, 12)),
    ("fp32", "sgd", (4, 4, 4)), ("fp16", "sgd", (2, 4, 8)),
])
def test_state_bytes_per_param(dtype, opt, expect):
    b = state_bytes_per_param(dtype, opt)
    assert (b.weights, b.grads, b.optimizer) == expect
    if (dtype, opt) == ("bf16", "adam"):
        assert b.total == 18  # Megatron-LM distributed optimizer table


@pytest.mark.parametrize("zero,expect", [
    (0, (2 * 1e9, 4 * 1e9, 12 * 1e9)), (1, (2e9, 4e9, 12e9 / 8)),
    (2, (2e9, 4e9 / 8, 12e9 / 8)), (3, (2e9 / 8, 4e9 / 8, 12e9 / 8)),
])
def test_zero_stages(zero, expect):
    got = model_state_bytes(1e9, dtype="bf16", optimizer="adam", zero=zero, dp=8)
    assert got == pytest.approx(expect)


def test_zero3_buffer():
    assert zero3_buffer_bytes(1e6, dtype="bf16") == 2 * 1e6 * 2


@pytest.mark.parametrize("schedule,stage,p,m,v,expect", [
    ("gpipe", 0, 4, 16, 1, 16), ("gpipe", 3, 4, 16, 1, 16),
    ("1f1b", 0, 4, 16, 1, 4), ("1f1b", 3, 4, 16, 1, 1), ("1f1b", 0, 4, 2, 1, 2),
    ("interleaved-1f1b", 0, 4, 16, 2, 4 * (1 + 3 / 8)),
    # Megatron-Core get_pp_rank_microbatches: 2 (p - r - 1) + (v - 1) p warmup chunks + 1,
    # each 1/v of the rank's activations: later ranks hold about p, not p - r
    ("interleaved-1f1b", 1, 4, 16, 2, (2 * 2 + 4 + 1) / 2),
    ("interleaved-1f1b", 3, 4, 16, 2, (0 + 4 + 1) / 2),
    ("interleaved-1f1b", 8, 9, 63, 7, (6 * 9 + 1) / 7),  # NeMo 405B, last rank
    ("interleaved-1f1b", 0, 4, 2, 2, 2),  # all in warmup: every microbatch's chunks
    ("1f1b", 0, 1, 8, 1, 1),
])
def test_inflight_microbatches(schedule, stage, p, m, v, expect):
    assert inflight_microbatches(schedule, stage, p, m, v) == pytest.approx(expect)


def test_pipeline_step_time_closed_form():
    t = pipeline_step_time([1.0] * 4, 8, "1f1b")
    assert t.step_s == pytest.approx(8 + 3)  # (m + p - 1) t
    assert t.bubble_s == pytest.approx(3)
    ti = pipeline_step_time([1.0] * 4, 8, "interleaved-1f1b", 3)
    assert ti.step_s == pytest.approx(8 + 3 / 3)  # bubble (p-1)/v
    uneven = pipeline_step_time([1.0, 2.0, 1.0], 4, "gpipe")
    assert uneven.step_s == pytest.approx(sum([1, 2, 1]) + 3 * 2)  # Alpa: sum + (m-1) max


def test_presets_validate_and_cite_sources():
    for name in preset_names():
        hw = load_preset(name)
        assert hw.sources, name


def test_schema_file_matches_docs():
    from pathlib import Path

    import meshplan.costmodel as cm
    root = Path(cm.__file__).resolve().parent.parent
    assert (root / "docs" / "hardware.schema.json").read_text() == \
        (Path(cm.__file__).parent / "hardware.schema.json").read_text()


def test_bad_profile_rejected():
    d = load_preset("dgx-h100").to_dict()
    del d["device"]["memory_gib"]
    assert validate_profile(d)
    with pytest.raises(MeshError, match="memory_gib"):
        HardwareProfile.from_dict(d)
    d = load_preset("dgx-h100").to_dict()
    d["device"]["matmul_efficiency"]["max_eff"] = 1.5
    with pytest.raises(MeshError, match="max_eff"):
        HardwareProfile.from_dict(json.loads(json.dumps(d)))


def test_busy_ranks_closed_form():
    """p equal stages of r ranks, m microbatches, v = 1: busy = r p m / (m + p - 1)."""
    from meshplan.costmodel.pipeline import busy_ranks
    for p, m, r in ((4, 4, 1), (2, 4, 2), (4, 8, 1), (1, 3, 4)):
        t = [0.01] * p
        step = pipeline_step_time(t, m).step_s
        assert busy_ranks(t, [r] * p, m, step) == pytest.approx(r * p * m / (m + p - 1))
    # unequal stages: 2 stages (1 s, 3 s), 2 microbatches -> span 2*3 + 1 = 7, work 2*(1+3)
    assert busy_ranks([1.0, 3.0], [1, 1], 2, pipeline_step_time([1.0, 3.0], 2).step_s) \
        == pytest.approx(8 / 7)


def test_pipeline_contention_uses_busy_ranks():
    """On a CPU host with fewer cores than processes, a 4-stage pipeline's compute is slowed
    by the ranks busy at once (< 4), a 4-way data-parallel plan's by all 4."""
    from meshplan.api import manual_plan
    from meshplan.costmodel.compute import contention_factor
    from meshplan.costmodel.estimate import plan_stage_costs, stage_cost
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.specs import example_inputs, parse_model_spec
    from meshplan.calibrate import _with_device

    hw = _with_device(load_preset("cpu-local"), host_cores=1)
    spec = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=64&n_head=4&vocab_size=512"
                            "&n_positions=32")
    meta = spec.build("meta")
    graph = trace(meta, example_inputs(meta, 8, 32), model_name=spec.name)
    mesh = Mesh.local(4, profile=hw)
    pp = manual_plan(meta, mesh, graph=graph, dtype="fp32", pp=4, microbatch_size=2)
    costs = plan_stage_costs(pp, graph, hw)
    t = pp.training
    kw = dict(dtype="fp32", optimizer=t.optimizer, microbatches=t.microbatches, num_stages=4,
              schedule=t.schedule, seq_len=t.seq_len, processes_on_host=4)
    full = stage_cost(pp.stages[1], graph, hw, **kw)
    ratio = costs[1].forward_s / full.forward_s
    # equal-ish stages, 4 microbatches: about 16/7 of 4 ranks busy, so ~ (16/7)/4 of the time
    assert 0.4 < ratio < 0.75
    assert costs[1].optimizer_s == pytest.approx(full.optimizer_s)  # every rank steps at once
    dp = manual_plan(meta, mesh, graph=graph, dtype="fp32", dp=4, microbatch_size=2)
    dcost = plan_stage_costs(dp, graph, hw)[0]
    from meshplan.costmodel.runtime_profiles import plan_runtime
    whole = stage_cost(dp.stages[0], graph, hw, dtype="fp32", optimizer=t.optimizer,
                       microbatches=dp.training.microbatches, seq_len=t.seq_len,
                       processes_on_host=4, runtime=plan_runtime(dp, hw))  # its engine's
    assert dcost.forward_s == pytest.approx(whole.forward_s, rel=1e-6)
    assert contention_factor(hw, 4) == pytest.approx(4.0)


def test_a_misspelt_memory_path_is_refused():
    """A path name the eager model does not price would silently run at the contiguous rate."""
    import pathlib

    from meshplan.costmodel.hardware import validate_profile

    root = pathlib.Path(__file__).resolve().parents[1]
    with open(root / "costmodel" / "presets" / "dgx-h100.json") as f:
        profile = json.load(f)
    assert validate_profile(profile) == []
    profile["device"]["memory_paths"]["stridded"] = 0.1
    problems = validate_profile(profile)
    assert len(problems) == 1 and "stridded" in problems[0] and "strided" in problems[0]


def test_a_profile_with_a_whole_float_count_is_refused():
    """devices_per_node 8.0 is an integer to draft 2020-12, not to meshplan's profiles."""
    d = load_preset("dgx-h100").to_dict()
    d["devices_per_node"] = 8.0
    assert validate_profile(d) == ["$.devices_per_node should be integer, got 8.0"]
    with pytest.raises(MeshError, match=r"devices_per_node should be integer, got 8\.0"):
        HardwareProfile.from_dict(d)
