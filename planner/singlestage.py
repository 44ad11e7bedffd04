"""Single-stage plans: every device in one SPMD mesh, placements chosen by the intra-op ILP.

trace -> cost -> **solve** -> assemble -> run. ``plan_single_stage`` is what
``meshplan.autoparallel`` calls when it plans without pipelining: it solves the whole graph as
one stage (``planner/intra.solve_stage``) and assembles the ``meshplan.plan/v1`` records.
``alternatives(plan, node)`` recomputes, for ``meshplan explain``, every candidate the solver
had for one operator (its group) and why each lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from meshplan.costmodel.estimate import with_stage_predictions
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.errors import PlanningError, gib
from meshplan.plan import Estimate, Plan, Stage
from meshplan.planner import ilp
from meshplan.planner.assemble import mesh_info, model_info, training_config
from meshplan.graph import OpGraph
from meshplan.costmodel.memory import GIB
from meshplan.planner.intra import (NS, StageOptions, build_problem, solve_stage, to_ilp)
from meshplan.placements import placement_str
from meshplan.vocabulary import ComputeDtype, Recompute


_UNPRICED = Estimate(step_time_s=0.0, peak_memory_gib=0.0, memory_capacity_gib=0.0, fits=False,
                     mfu=0.0, tokens_per_s=0.0)  # replaced by with_stage_predictions


def plan_single_stage(graph: OpGraph, mesh, *, dtype: str = ComputeDtype.BF16,
                      optimizer: str = "adam",
                      memory_limit_gib: float | None = None, time_limit_s: float = 30.0,
                      recompute: str = Recompute.NONE, backend: str = "cbc") -> Plan:
    """The fastest single-stage plan that fits ``memory_limit_gib`` per device."""
    start = time.perf_counter()
    options = StageOptions(memory_limit_gib=memory_limit_gib, dtype=dtype, optimizer=optimizer,
                           recompute=recompute, time_limit_s=time_limit_s, backend=backend)
    names = tuple(n.name for n in graph.nodes)
    sol = solve_stage(graph, names, mesh.shape, mesh.axis_names, mesh.hardware, options,
                      devices_per_node=mesh.devices_per_node)
    zero = sol.zero
    stage = Stage(index=0, devices=tuple(range(mesh.num_devices)), mesh_shape=tuple(mesh.shape),
                  axis_names=tuple(mesh.axis_names), layers=(0, graph.num_layers),
                  nodes=(names[0], names[-1]), recompute=recompute, zero=zero,
                  inputs=sol.inputs, params=sol.params, ops=sol.ops)
    training = training_config(graph, dtype=dtype, optimizer=optimizer)
    plan = Plan(model=model_info(graph), mesh=mesh_info(mesh), training=training,
                stages=(stage,), predicted=_UNPRICED, solver=sol.solver, graph=graph)
    # the cost model prices the chosen plan as it prices every other plan (manual_plan,
    # estimate); the solver priced it with the same parts, its objective in
    # solver.objective_s (tests/test_one_pricer.py: equal within 1%)
    plan = with_stage_predictions(plan, graph)
    return replace(plan, wall_time_s=time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class SolverAlternative:
    """One candidate of an operator's group, priced against the plan's other choices."""

    output: tuple[str, ...]  # the anchor's output placement
    inputs: tuple[tuple[str, ...], ...]
    zero3: bool
    time_s: float  # whole-plan objective if this candidate replaced the chosen one
    delta_s: float  # time_s - the plan's objective
    memory_gib: float  # whole-plan memory per device with this candidate
    chosen: bool
    reason: str


def alternatives(plan: Plan, node_name: str) -> tuple[SolverAlternative, ...]:
    """Every candidate the intra-op solver had for ``node_name``'s group, and why each lost.

    Needs ``plan.graph`` (plans made in this process, or pass it through ``replace``). Single-
    stage plans only; the numbers are recomputed with the plan's own mesh and options.
    """
    graph = plan.graph
    if graph is None:
        raise PlanningError("alternatives() needs the plan's graph: plan = replace(plan, "
                            "graph=meshplan.tracing.trace(model, inputs))")
    if plan.num_stages != 1 or node_name not in plan.stages[0].ops:
        raise PlanningError(f"{node_name!r} is not an operator of this single-stage plan")
    st = plan.stages[0]
    t = plan.training
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    limit = _recorded_limit(plan)
    options = StageOptions(memory_limit_gib=limit, dtype=t.dtype,
                           optimizer=t.optimizer, recompute=st.recompute)
    names = tuple(n.name for n in graph.nodes)
    problem = build_problem(graph, names, st.mesh_shape, hw, options,
                            devices_per_node=plan.mesh.devices_per_node)
    choice = [_matching(g, st) for g in problem.groups]
    ip = to_ilp(problem)
    base = ilp.evaluate(ip, tuple(choice))
    target = problem.rep[node_name]
    gi = next(i for i, g in enumerate(problem.groups) if target in g.members)
    group = problem.groups[gi]
    out = []
    for a, c in enumerate(group.candidates):
        trial = list(choice)
        trial[gi] = a
        total = _objective(ip, tuple(trial))
        mem = ilp.memory(ip, tuple(trial)) / GIB
        if a == choice[gi]:
            reason = "chosen"
        elif total is None:
            reason = "needs a redistribution DTensor cannot do from its neighbours' placements"
        elif mem > options.memory_limit_gib:
            reason = f"needs {gib(mem)} GiB per device, over the {gib(options.memory_limit_gib)} GiB limit"
        else:
            delta = (total - base) / NS if base is not None else 0.0
            reason = f"slower by {delta * 1e3:.3f} ms" if delta > 0 else \
                f"equal or faster alone ({delta * 1e3:.3f} ms) but not with the rest of the plan"
        out.append(SolverAlternative(
            output=placement_str(c.strategy.output),
            inputs=tuple(placement_str(p) for p in c.strategy.inputs), zero3=c.zero3,
            time_s=(total / NS) if total is not None else float("inf"),
            delta_s=((total - base) / NS) if total is not None and base is not None else float("inf"),
            memory_gib=mem, chosen=a == choice[gi], reason=reason))
    return tuple(sorted(out, key=lambda x: (not x.chosen, x.time_s)))


def _recorded_limit(plan: Plan) -> float:
    for note in plan.solver.notes:
        if note.startswith("memory limit "):
            return float(note.split()[2])
    return plan.predicted.memory_capacity_gib


def _objective(ip: ilp.IlpProblem, choice) -> int | None:
    return ilp.evaluate(replace(ip, memory_limit=None), choice)


def _matching(group, stage) -> int:
    """Index of the candidate whose placements the plan recorded for this group."""
    for a, c in enumerate(group.candidates):
        if group.is_source:
            if stage.inputs.get(group.anchor) == placement_str(c.member_outputs[0]):
                return a
            continue
        ok = all(stage.ops[m].output == placement_str(out) and
                 stage.ops[m].inputs == tuple(placement_str(p) for p in ins)
                 for m, ins, out in zip(group.members, c.member_inputs, c.member_outputs)
                 if m in stage.ops)
        ok = ok and all(stage.params.get(p) == placement_str(s)
                        for p, s in zip(group.owned_params, c.storage))
        ok = ok and (not group.owned_params or c.zero == stage.zero)  # the stage's ZeRO level
        if ok:
            return a
    return 0
