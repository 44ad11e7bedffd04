"""The stage DP (planner/inter, planner/stagedp) against brute force on hand-built cost tables."""

from __future__ import annotations

import hashlib
import itertools
import math

import pytest
from hypothesis import given, settings, strategies as st

from meshplan.errors import MemoryLimitError, PlanningError
from meshplan.planner.inter import (Problem, SearchSpace, StageCost, group_sizes, in_flight,
                                    pipeline_time_s, search, stage_meshes, stage_options)


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
                         boundary_bytes=1e9 * mbs / tp)


def problem(seed: int, units: int, devices: int, per_node: int, batch: int, limit: float,
            keys=None) -> Problem:
    return Problem(unit_layers=tuple((i, i + 1) for i in range(units)),
                   unit_keys=tuple(keys or (f"u{i}" for i in range(units))),
                   num_devices=devices, devices_per_node=per_node, global_batch=batch,
                   memory_limit_gib=limit, cost_fn=TableCost(seed, units),
                   p2p_s=lambda nbytes, crosses: nbytes / (25e9 if crosses else 300e9))


def brute_force(prob: Problem, space: SearchSpace) -> float:
    """Every schedule, group count, microbatch count, cut and per-stage option, priced with
    the same formulas the DP uses (pipeline_time_s, in_flight, p2p)."""
    best = math.inf
    k = prob.num_units
    for schedule in space.schedules:
        for size in group_sizes(prob.num_devices, prob.devices_per_node):
            groups = prob.num_devices // size
            if groups > k:
                continue
            for b in space.microbatches or range(1, prob.global_batch + 1):
                if prob.global_batch % b:
                    continue
                options = stage_options(size, prob, space, b)
                for cuts in itertools.combinations(range(1, k), groups - 1):
                    bounds = list(zip((0, *cuts), (*cuts, k)))
                    per_stage = []
                    for s, (j, e) in enumerate(bounds):
                        m = in_flight(schedule, s, groups, b)
                        ok = []
                        for opt in options:
                            mbs = prob.global_batch // (b * opt.mesh_shape[0])
                            c = prob.cost_fn((j, e), opt.mesh_shape, mbs, opt.recompute, opt.zero)
                            if c is None:
                                continue
                            if c.weights_gib + m * c.activation_gib + c.transient_gib \
                                    > prob.memory_limit_gib:
                                continue
                            t = c.time_s + (0 if e == k else 2 * prob.p2p_s(
                                c.boundary_bytes, size >= prob.devices_per_node))
                            ok.append((t, c.step_s))
                        per_stage.append(ok)
                    for pick in itertools.product(*per_stage):
                        times = [p[0] for p in pick]
                        value = pipeline_time_s(times, b, groups) + max(p[1] for p in pick)
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
        assert st_.memory_gib <= prob.memory_limit_gib / a.virtual_stages + 1e-9
        assert st_.devices == (st_.group * st_.devices[1], st_.devices[1])
    assert len(a.stages) == a.pipeline_degree * a.virtual_stages


def test_interleaved_is_priced_exactly():
    prob = problem(2, units=8, devices=4, per_node=4, batch=8, limit=40.0, keys=["b"] * 8)
    plan = search(prob, SearchSpace(schedules=("interleaved-1f1b",), virtual_stages=(2,),
                                    zero=(0,), recompute=("none",), pipeline_degrees=(2,)))
    assert plan.virtual_stages == 2 and len(plan.stages) == 4
    assert [s.group for s in plan.stages] == [0, 1, 0, 1]
    times = [s.time_s for s in plan.stages]
    assert plan.step_time_s == pytest.approx(pipeline_time_s(times, plan.microbatches, 2, 2)
                                             + plan.tail_s)


def test_schedule_formulas_closed_form():
    # Alpa: sum + (B - 1) max; Megatron interleaved: (B v + p - 1) t_chunk
    assert pipeline_time_s([1.0, 2.0, 3.0], 4, 3) == pytest.approx(6 + 3 * 3)
    assert pipeline_time_s([1.0] * 8, 4, 4, 2) == pytest.approx(4 * 2 + 4 - 1)
    assert in_flight("gpipe", 0, 4, 8) == 8
    assert [in_flight("1f1b", g, 4, 8) for g in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 0, 4, 2) == 2
    # Korthikanti et al. 2022: first stage holds p (1 + (p - 1) / (p v)) stage-microbatches
    p, v = 4, 2
    assert in_flight("interleaved-1f1b", 0, p, 64, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


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
