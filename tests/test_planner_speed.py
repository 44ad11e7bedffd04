"""The pipeline search's shortcuts change no answer: the floor under the shapes' bounds
(planner/inter.search_best, MegatronStageCost.time_floor_s) and the cost model's memos
(whole plans priced with one cache, parameter walks and operator times kept per
placement)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshplan.mesh import Mesh
from meshplan.planner import inter
from meshplan.planner.clusters import layer_units
from meshplan.planner.hybrid import search_space
from meshplan.planner.inter import Problem, StageOption, search_best
from meshplan.planner.stagecost import MegatronStageCost


@pytest.fixture(scope="module")
def gpt16():
    from meshplan.specs import parse_model_spec
    from meshplan.tracing import trace

    model = parse_model_spec("transformers:gpt2?n_layer=16&n_embd=64&n_head=4&vocab_size=256"
                             "&n_positions=64").build(device="meta")
    ids = torch.zeros((64, 64), dtype=torch.long, device="meta")
    return trace(model, (ids,), model_name="gpt2-16")


def _problem(graph, mesh, engine="graph"):
    cost = MegatronStageCost(graph, layer_units(graph), mesh.hardware,
                             num_devices=mesh.num_devices, dtype="bf16", optimizer="adam",
                             engine=engine)
    return cost, Problem(unit_layers=tuple(u.layers for u in cost.units),
                         unit_keys=tuple(u.key for u in cost.units),
                         num_devices=mesh.num_devices, devices_per_node=mesh.devices_per_node,
                         global_batch=64, memory_limit_gib=mesh.hardware.device.memory_gib,
                         cost_fn=cost, weights_floor_gib=cost.weights_floor_gib, dtype="bf16")


@pytest.mark.parametrize("engine", ["graph", "modules"])
def test_floor_is_under_every_one_stage_time(gpt16, engine):
    """One stage over every unit, priced in full with the fastest options: never under the
    floor, on every mesh and microbatch count."""
    mesh = Mesh.preset("dgx-a100-80gb", nodes=2)
    cost, problem = _problem(gpt16, mesh, engine)
    n = len(cost.units)
    checked = 0
    for tp in (1, 2, 4, 8):
        dp = mesh.num_devices // tp
        for mbs in (1, 2):
            b = 64 // (dp * mbs) if 64 % (dp * mbs) == 0 else 0
            if not b:
                continue
            for sp in (False, True) if tp > 1 else (False,):
                time = cost.range_cost(0, n, StageOption((dp, tp), "none", 0, sp), mbs,
                                       need_memory=False)
                if time is None:
                    continue
                assert cost.time_floor_s(mesh.num_devices, b) <= time.time_s
                checked += 1
    assert checked >= 6


@pytest.mark.parametrize("engine", ["graph", "modules"])
def test_search_with_floors_equals_search_without(gpt16, engine, monkeypatch):
    mesh = Mesh.preset("dgx-a100-80gb", nodes=2)
    space = search_space(schedules=("gpipe", "1f1b", "interleaved-1f1b"))
    calls = []
    original = inter.search_best

    def spy(*a, **kw):
        calls.append(kw.get("floors", True))
        return original(*a, **kw)

    monkeypatch.setattr(inter, "search_best", spy)
    cost, problem = _problem(gpt16, mesh, engine)
    fast = inter.search_best(problem, space, keep=4, within=0.01)
    probes_fast = len(cost._probes)
    assert calls == [True]  # no bound fell under its floor: no second search
    cost, problem = _problem(gpt16, mesh, engine)
    full = inter.search_best(problem, space, keep=4, within=0.01, floors=False)
    assert [dataclasses.astuple(p) for p in fast] == [dataclasses.astuple(p) for p in full]
    assert probes_fast <= len(cost._probes)


def test_a_floor_over_a_bound_falls_back_to_the_search_without_floors(gpt16, monkeypatch):
    mesh = Mesh.preset("dgx-a100-80gb", nodes=1)
    space = search_space(schedules=("1f1b",))
    cost, problem = _problem(gpt16, mesh)
    exact = search_best(problem, space, keep=2, floors=False)
    cost, problem = _problem(gpt16, mesh)
    # a "floor" over the first bound priced: not a floor, the search runs without them
    monkeypatch.setattr(cost, "time_floor_s", lambda size, b: 1e9)
    assert search_best(problem, space, keep=2) == exact


def test_shared_memo_prices_plans_as_fresh_estimates(gpt16):
    """Plans priced through one MegatronStageCost memo (the search's assembly and its
    schedule variants) equal each plan priced alone."""
    from meshplan.costmodel.estimate import with_stage_predictions
    from meshplan.planner.manual import build_manual_plan

    mesh = Mesh.preset("dgx-a100-80gb", nodes=1)
    cost, _ = _problem(gpt16, mesh)
    for dp, tp, pp, zero, rc, schedule in ((2, 2, 2, 1, "none", "1f1b"),
                                           (2, 2, 2, 1, "none", "gpipe"),
                                           (4, 2, 1, 3, "full", "1f1b"),
                                           (2, 1, 4, 2, "selective", "interleaved-1f1b")):
        plan = build_manual_plan(gpt16, mesh, dp=dp, tp=tp, pp=pp, zero=zero, recompute=rc,
                                 schedule=schedule, virtual_stages=2 if pp == 4 else 1,
                                 dtype="bf16")
        shared = cost.predicted(plan, gpt16)
        alone = with_stage_predictions(plan, gpt16)
        assert shared.predicted == alone.predicted
        assert [s.predicted for s in shared.stages] == [s.predicted for s in alone.stages]
        assert cost.predicted(plan, gpt16).predicted == alone.predicted  # from the memo
