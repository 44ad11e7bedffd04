"""The stage DP (planner/inter, planner/stagedp) against brute force on hand-built cost tables."""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from meshplan.errors import MemoryLimitError, PlanningError
from meshplan.planner.inter import (Problem, SearchSpace, StageCost, group_sizes, in_flight,
                                    StageOption, pipeline_time_s, search, stage_meshes,
                                    stage_options)
from meshplan.planner.stagedp import p2p_hops


def _rand(*key) -> float:
    """A fixed pseudo-random number in [0, 1) per key: arbitrary, non-additive cost tables."""
    h = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(h[:8], "little") / 2 ** 64


class TableCost:
    """Hand-built stage costs: every (range, mesh, microbatch, recompute, zero) gets its own
    arbitrary number, shaped roughly like reality (more layers: more time and memory)."""

    def __init__(self, seed: int, layers: int):
        self.seed, self.layers = seed, layers

    def __call__(self, layers, mesh_shape, mbs, recompute, zero):
        first, last = layers
        n = last - first
        dp, tp = mesh_shape
        if _rand(self.seed, "bad", mesh_shape) < 0.1:
            return None
        work = n * mbs * (1 + _rand(self.seed, "t", layers, mesh_shape)) / tp
        work *= {"none": 1.0, "selective": 1.1, "full": 1.33}[recompute]
        weights = n * (2 + _rand(self.seed, "w", layers)) / tp / (1 + zero * (dp - 1) / 3)
        act = n * mbs * {"none": 1.0, "selective": 0.5, "full": 0.1}[recompute] / tp
        step = n * 0.3 * (1 + 0.2 * zero) * _rand(self.seed, "u", layers, mesh_shape, zero)
        return StageCost(time_s=work, step_s=step, weights_gib=weights, activation_gib=act,
                         transient_gib=0.05 * n * (recompute == "full"),
                         recv_s=1e9 * mbs / tp * (first > 0) / (25e9 if dp * tp >= 4 else 300e9))


def problem(seed: int, units: int, devices: int, per_node: int, batch: int, limit: float,
            keys=None) -> Problem:
    return Problem(unit_layers=tuple((i, i + 1) for i in range(units)),
                   unit_keys=tuple(keys or (f"u{i}" for i in range(units))),
                   num_devices=devices, devices_per_node=per_node, global_batch=batch,
                   memory_limit_gib=limit, cost_fn=TableCost(seed, units))


def brute_force(prob: Problem, space: SearchSpace) -> float:
    """Every schedule, stage count, virtual count, microbatch count, cut and per-stage option,
    priced with the cost model's formulas (pipeline_time_s, in_flight, p2p_hops)."""
    best = math.inf
    k = prob.num_units
    for schedule in space.schedules:
        virtuals = space.virtual_stages if schedule == "interleaved-1f1b" else (1,)
        for size, v in itertools.product(group_sizes(prob.num_devices, prob.devices_per_node),
                                         virtuals):
            stages = prob.num_devices // size
            if stages > k or (schedule == "interleaved-1f1b" and stages == 1):
                continue
            for b in space.microbatches or range(1, prob.global_batch + 1):
                if prob.global_batch % b or (schedule == "interleaved-1f1b" and b % stages):
                    continue
                options = stage_options(size, prob, space, b)
                for cuts in itertools.combinations(range(1, k), stages - 1):
                    per_stage = []
                    for s, (j, e) in enumerate(zip((0, *cuts), (*cuts, k))):
                        m = in_flight(schedule, s, stages, b, v)
                        ok = []
                        if v > 1 and (k % (stages * v) or e - j != k // stages):
                            # the runtime cuts the blocks into stages x v equal chunks
                            per_stage.append(ok)
                            continue
                        for opt in options:
                            mbs = prob.global_batch // (b * opt.mesh_shape[0])
                            c = prob.cost_fn((j, e), opt.mesh_shape, mbs, opt.recompute, opt.zero)
                            if c is None or c.weights_gib + m * c.activation_gib \
                                    + c.transient_gib > prob.memory_limit_gib:
                                continue
                            hops = v * p2p_hops(j == 0, e == k)
                            t = c.time_s + hops * c.recv_s
                            ok.append((t, c.step_s))
                        per_stage.append(ok)
                    for pick in itertools.product(*per_stage):
                        times = [p[0] for p in pick]
                        value = pipeline_time_s(times, b, schedule, v) + max(p[1] for p in pick)
                        best = min(best, value)
    return best


V1 = ("gpipe", "1f1b")


@pytest.mark.parametrize("seed", range(6))
def test_dp_equals_brute_force(seed):
    prob = problem(seed, units=5, devices=8, per_node=4, batch=4, limit=9.0)
    space = SearchSpace(schedules=V1, zero=(0, 1), recompute=("none", "full"))
    plan = search(prob, space)
    assert plan.step_time_s == pytest.approx(brute_force(prob, space), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), units=st.integers(1, 5), limit=st.floats(2.0, 30.0),
       batch=st.sampled_from([1, 2, 4, 6]))
def test_dp_equals_brute_force_random(seed, units, limit, batch):
    prob = problem(seed, units=units, devices=4, per_node=2, batch=batch, limit=limit)
    space = SearchSpace(schedules=V1, zero=(0, 3), recompute=("none", "selective", "full"))
    expected = brute_force(prob, space)
    if math.isinf(expected):
        with pytest.raises(MemoryLimitError):
            search(prob, space)
    else:
        assert search(prob, space).step_time_s == pytest.approx(expected, rel=1e-12)


def test_identical_units_share_classes_and_match_brute_force():
    keys = ["emb"] + ["block"] * 4 + ["head"]
    prob = problem(3, units=6, devices=4, per_node=4, batch=4, limit=12.0, keys=keys)
    space = SearchSpace(schedules=("1f1b",), zero=(0,), recompute=("none", "full"))
    assert search(prob, space).step_time_s == pytest.approx(brute_force(prob, space), rel=1e-12)


def test_plan_is_consistent_and_deterministic():
    prob = problem(1, units=6, devices=8, per_node=4, batch=8, limit=10.0)
    space = SearchSpace(schedules=("1f1b", "interleaved-1f1b"), zero=(0, 1), virtual_stages=(2,))
    a, b = search(prob, space), search(prob, space)
    assert a == b
    assert a.stages[0].units[0] == 0 and a.stages[-1].units[1] == 6
    for x, y in zip(a.stages, a.stages[1:]):
        assert x.units[1] == y.units[0]
    for st_ in a.stages:
        assert st_.memory_gib <= prob.memory_limit_gib + 1e-9
        assert st_.devices == (st_.index * st_.devices[1], st_.devices[1])
    assert len(a.stages) == a.pipeline_degree


@pytest.mark.parametrize("seed", range(3))
def test_interleaved_equals_brute_force(seed):
    prob = problem(seed, units=8, devices=4, per_node=4, batch=8, limit=40.0)
    space = SearchSpace(schedules=("interleaved-1f1b",), virtual_stages=(2, 3), zero=(0,),
                        recompute=("none", "full"))
    plan = search(prob, space)
    assert plan.schedule == "interleaved-1f1b" and plan.virtual_stages in (2, 3)
    assert plan.step_time_s == pytest.approx(brute_force(prob, space), rel=1e-12)


class AdditiveCost:
    """A cost that is the sum of per-unit costs: the additive fast path must agree with
    calling it per range."""

    def __init__(self, seed):
        self.seed = seed

    def unit_cost(self, i, option, mbs, *, leading, need_memory=True):
        mesh_shape, recompute, zero = option.mesh_shape, option.recompute, option.zero
        dp, tp = mesh_shape
        base = 1 + _rand(self.seed, i, mesh_shape)
        return StageCost(time_s=base * mbs / tp + (0.1 if leading else 0.0),
                         step_s=0.2 * base / (1 + zero), weights_gib=base / tp,
                         activation_gib=0.3 * mbs / tp * (recompute == "none"),
                         transient_gib=0.1 if leading else 0.0,
                         recv_s=(0.04 * mbs if i > 0 else 0.0) if leading else 0.0)

    def __call__(self, layers, mesh_shape, mbs, recompute, zero):
        opt = StageOption(mesh_shape, recompute, zero)
        parts = [self.unit_cost(i, opt, mbs, leading=i == layers[0]) for i in range(*layers)]
        return StageCost(*(sum(getattr(p, f) for p in parts) for f in
                           ("time_s", "step_s", "weights_gib", "activation_gib",
                            "transient_gib", "recv_s")))


def test_additive_fast_path_equals_per_range_calls():
    fn = AdditiveCost(7)
    base = problem(0, units=6, devices=8, per_node=4, batch=8, limit=6.0)
    space = SearchSpace(schedules=("1f1b", "gpipe"), zero=(0, 1), recompute=("none", "full"))
    fast = search(base.__class__(**{**base.__dict__, "cost_fn": fn}), space)
    slow = search(base.__class__(**{**base.__dict__, "cost_fn": fn.__call__}), space)
    assert fast.step_time_s == pytest.approx(slow.step_time_s, rel=1e-9)
    assert fast.step_time_s == pytest.approx(
        brute_force(base.__class__(**{**base.__dict__, "cost_fn": fn.__call__}), space), rel=1e-9)


def test_submesh_rule():
    assert group_sizes(16, 8) == [1, 2, 4, 8, 16]
    assert group_sizes(24, 8) == [1, 2, 4, 8, 24]
    assert stage_meshes(16, 8) == [(16, 1), (8, 2), (4, 4), (2, 8)]
    assert stage_meshes(4, 8, tensor_degrees=(1, 4)) == [(4, 1), (1, 4)]


def test_nothing_fits_reports_smallest_memory():
    prob = problem(0, units=3, devices=2, per_node=2, batch=2, limit=0.01)
    with pytest.raises(MemoryLimitError) as err:
        search(prob)
    assert err.value.min_memory_gib > 0.01


def test_bad_space_is_refused():
    with pytest.raises(PlanningError, match="schedule"):
        SearchSpace(schedules=("zero-bubble",))
    with pytest.raises(PlanningError, match="recompute"):
        SearchSpace(recompute=("some",))


# -- on a traced model: the search priced by the cost model ---------------------------------

@pytest.fixture(scope="module")
def tiny_gpt():
    import torch

    from meshplan.tracing import trace
    from meshplan.specs import parse_model_spec
    model = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=64&n_head=4&vocab_size=256"
                             "&n_positions=64").build(device="meta")
    ids = torch.zeros((16, 64), dtype=torch.long, device="meta")
    return trace(model, (ids,), model_name="tiny-gpt2")


def test_hybrid_plan_is_valid_and_priced_like_estimate(tiny_gpt):
    from meshplan.mesh import Mesh
    from meshplan.plan import Plan, check_consistency
    from meshplan.planner.hybrid import search_space
    from meshplan.planner.stagecost import plan_hybrid

    mesh = Mesh.preset("dgx-a100-80gb", nodes=2)
    space = search_space(schedules=("1f1b", "interleaved-1f1b"), eps=0.0)
    plan = plan_hybrid(tiny_gpt, mesh, dtype="bf16", space=space, memory_limit_gib=80)
    assert check_consistency(plan) == []
    ops = [n for st in plan.stages for n in st.ops]
    assert ops == [n.name for n in tiny_gpt.nodes]  # every operator once, in graph order
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 4
    # the search's affine stage prices agree with the full estimate of the assembled plan
    assert plan.solver.objective_s == pytest.approx(plan.predicted.step_time_s, rel=0.02)
    again = Plan.from_json_text(plan.to_json_text())
    assert again.to_json_text() == plan.to_json_text()


def test_hybrid_beats_or_matches_every_uniform_manual_plan(tiny_gpt):
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.planner.hybrid import search_space
    from meshplan.planner.stagecost import plan_hybrid

    mesh = Mesh.preset("dgx-h100", nodes=1)
    space = search_space(schedules=("1f1b",), recompute=("none",), zero=(0,), eps=0.0)
    auto = plan_hybrid(tiny_gpt, mesh, dtype="bf16", space=space)
    for dp, tp, pp in ((8, 1, 1), (4, 2, 1), (2, 4, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4)):
        for mbs in (1, 2):
            manual = build_manual_plan(tiny_gpt, mesh, dp=dp, tp=tp, pp=pp, microbatch_size=mbs,
                                       schedule="1f1b", dtype="bf16")
            assert auto.predicted.step_time_s <= manual.predicted.step_time_s * 1.01


def test_probes_on_the_cut_graph_equal_probes_on_the_whole_graph(tiny_gpt):
    from meshplan.costmodel.estimate import stage_cost
    from meshplan.mesh import Mesh
    from meshplan.planner.clusters import layer_units
    from meshplan.planner.stagecost import MegatronStageCost

    mesh = Mesh.preset("dgx-a100-80gb", nodes=1)
    units = layer_units(tiny_gpt)
    cost = MegatronStageCost(tiny_gpt, units, mesh.hardware, num_devices=8, dtype="bf16",
                             optimizer="adam")
    for opt in (StageOption((4, 2), "none", 0, True), StageOption((2, 4), "full", 3)):
        for first, last in ((0, 1), (1, 3), (3, 4)):
            st = cost.stage([n for u in units[first:last] for n in u.nodes], opt)
            kw = dict(dtype="bf16", optimizer="adam", microbatches=4, seq_len=64,
                      num_stages=2, schedule="gpipe")
            whole = stage_cost(st, tiny_gpt, mesh.hardware, **kw)
            cut_ = stage_cost(st, cost.neighbourhood(first, last), mesh.hardware, **kw)
            assert cut_ == whole


def test_pipeline_zero_limits_only_multi_stage_options():
    """``pipeline_zero`` (what the pipeline runtime runs) bounds the ZeRO stages of stages
    smaller than the mesh; a single stage over every device keeps ``zero``."""
    prob = problem(1, units=4, devices=4, per_node=4, batch=4, limit=30.0)
    space = SearchSpace(schedules=V1, zero=(0, 1, 2, 3), pipeline_zero=(0,))
    assert {o.zero for o in stage_options(4, prob, space, 1)} == {0, 1, 2, 3}
    assert {o.zero for o in stage_options(2, prob, space, 1)} == {0}
    plan = search(prob, space)
    if len(plan.stages) > 1:
        assert all(st.option.zero == 0 for st in plan.stages)
    assert plan.step_time_s == pytest.approx(brute_force(prob, space), rel=1e-12)
