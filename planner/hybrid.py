"""Hybrid planning: the plan ``meshplan.autoparallel`` returns.

trace -> cost -> **solve** (planner/inter's pipeline search + planner/singlestage's ILP) ->
assemble -> run. Two searches compete, both priced by the same cost model
(``costmodel.estimate``), and the faster plan that fits memory wins:

1. the pipeline search (planner/inter over planner/stagecost): stages, non-uniform stage
   boundaries, submesh shape (dp, tp), microbatches, schedule, recompute, ZeRO and sequence
   parallelism jointly, with Megatron-LM placements inside each stage; it includes the
   single-stage plans of that family;
2. the intra-operator ILP on one stage over every device (planner/singlestage), whose
   per-operator placements may beat Megatron's when the model fits without pipelining. It
   runs when the pipeline search's best plan has one stage or none fits (an ILP over a
   whole 1,024-device model is the expensive part of Alpa's 40-minute search; skipping it
   when pipelining already wins keeps planning in seconds).

Ties keep the pipeline search's plan, so the same inputs give the same plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

from meshplan import support
from meshplan.errors import MemoryLimitError, PlanningError, gib
from meshplan.graph import OpGraph
from meshplan.planner.inter import SearchSpace
from meshplan.planner.simplest import error_margin, simplest_within
from meshplan.planner.stagecost import RERANK_WITHIN, plan_hybrid
from meshplan.plan import Plan
from meshplan.schedules import SCHEDULES
from meshplan.vocabulary import RECOMPUTE, Engine, Recompute
from meshplan.planner.clusters import layer_units
from meshplan.planner.stagecost import MegatronStageCost
from meshplan.planner.singlestage import plan_single_stage
from meshplan.costmodel.estimate import with_stage_predictions
from meshplan.costmodel.memory import GIB, model_state_bytes

# Microbatch sizes (sequences per data-parallel rank) the search tries by default: the
# range Megatron-LM's published runs use (Narayanan et al. 2021, section 5: 1 to 8).
MICROBATCH_SIZES = (1, 2, 4, 8)
# Candidate interleaving depths (Narayanan et al. 2021, figure 13 sweeps 2 to 8 chunks).
VIRTUAL_STAGES = (2, 4)


def search_space(*, microbatches: Sequence[int] | None = None,
                 schedules: Sequence[str] | None = None, recompute: Sequence[str] | None = None,
                 max_stages: int | None = None, zero: Sequence[int] | None = None,
                 context_parallel: Sequence[int] = (1,), eps: float = 0.01) -> SearchSpace:
    """autoparallel's options as a SearchSpace; None keeps the whole dimension. ``eps``
    merges bound candidates within 1% (the exact search, eps=0, is what tests check).
    ``context_parallel`` lists the cp degrees tried (1: none), jointly with the rest."""
    return SearchSpace(
        schedules=tuple(schedules) if schedules else SCHEDULES,
        recompute=tuple(recompute) if recompute else RECOMPUTE,
        zero=tuple(zero) if zero is not None else (0, 1, 2, 3),
        microbatches=tuple(microbatches) if microbatches else None,
        microbatch_sizes=None if microbatches else MICROBATCH_SIZES,
        virtual_stages=VIRTUAL_STAGES, max_stages=max_stages,
        sequence_parallel=(False, True), mixed_meshes=False,
        context_parallel=tuple(context_parallel), eps=eps)


def plan_auto(graph: OpGraph, mesh, *, dtype: str, optimizer: str = "adam",
              memory_limit_gib: float | None = None, space: SearchSpace | None = None,
              time_limit_s: float = 30.0, single_stage_ilp: bool = True, cost=None,
              engine: str = Engine.GRAPH, margin: float | None = None,
              pipeline_engine: str | None = None) -> Plan:
    """The fastest plan of either search that fits ``memory_limit_gib`` per device, every
    candidate priced for ``engine`` (the runtime that will run it; the plan records it);
    then the simplest plan within ``margin`` of it (planner/simplest.py; None: the cost
    model's measured error on this kind of machine, 0: the fastest as is).
    ``pipeline_engine``: the engine that prices (and runs) multi-stage candidates where it is
    not ``engine``; the plan records the engine of its own kind."""
    start = time.perf_counter()
    space = space or search_space()
    if engine == Engine.GRAPH and space.expert_parallel is None:
        # expert parallelism runs on the module engine only (meshplan/axes.py EP_AXIS)
        space = replace(space, expert_parallel=(1,))
    limit = memory_limit_gib if memory_limit_gib is not None else mesh.hardware.device.memory_gib
    best: Plan | None = None
    failure: MemoryLimitError | None = None
    ilp_failure: MemoryLimitError | None = None
    if cost is None:  # one set of probes for every pipeline search below
        cost = MegatronStageCost(graph, layer_units(graph), mesh.hardware,
                                 num_devices=mesh.num_devices, dtype=dtype, optimizer=optimizer)

    def pipeline_search(restricted: SearchSpace, cap_s: float = math.inf) -> Plan:
        return plan_hybrid(graph, mesh, dtype=dtype, optimizer=optimizer, memory_limit_gib=limit,
                           space=restricted, cost=cost, engine=engine, cap_s=cap_s,
                           pipeline_engine=pipeline_engine)

    try:
        best = _runnable(pipeline_search(space))
    except MemoryLimitError as exc:
        failure = exc
    if single_stage_ilp and (best is None or best.num_stages == 1):
        recompute = best.stages[0].recompute if best is not None else Recompute.NONE
        try:
            ilp_plan = plan_single_stage(graph, mesh, dtype=dtype, optimizer=optimizer,
                                         memory_limit_gib=limit, time_limit_s=time_limit_s,
                                         recompute=recompute)
        except MemoryLimitError as exc:
            ilp_failure, ilp_plan = exc, None
        except PlanningError:
            ilp_plan = None
        ilp_plan = _runnable(ilp_plan)
        if ilp_plan is not None and ilp_plan.engine != engine:
            graph_s = ilp_plan.solver.objective_s
            ilp_plan = with_stage_predictions(replace(ilp_plan, engine=engine), graph)
            # the ILP chose placements at the graph engine's prices; the plan promises the
            # engine that runs it, and says so
            ilp_plan = replace(ilp_plan, solver=replace(
                ilp_plan.solver, objective_s=ilp_plan.predicted.step_time_s,
                notes=ilp_plan.solver.notes + (
                    f"placements chosen by the intra-op ILP at the graph engine's prices "
                    f"({graph_s:.4g} s); re-priced as the {engine} engine runs them",)))
        if ilp_plan is not None and ilp_plan.predicted.peak_memory_gib <= limit and (
                best is None or ilp_plan.predicted.step_time_s < best.predicted.step_time_s):
            best = ilp_plan
    if best is not None:
        margin = error_margin(mesh.hardware) if margin is None else margin
        if margin > 0:
            # the search prices ranges affinely (planner/stagecost.py): plans up to
            # RERANK_WITHIN over the margin are priced in full before they are compared
            cap = best.predicted.step_time_s * (1 + margin) * (1 + RERANK_WITHIN)
            best = simplest_within(best, space, lambda sp: _runnable(pipeline_search(sp, cap))
                                   or _no_plan(), num_devices=mesh.num_devices,
                                   devices_per_node=mesh.devices_per_node, margin=margin)
    if best is None:
        # the pipeline search spans microbatching, recompute and ZeRO, so its bound is the
        # one to report; the single-stage ILP's bound covers a smaller space
        raise _tightest(failure) or _tightest(ilp_failure if failure is None else None) or \
            _model_state_floor(graph, mesh, limit, dtype, optimizer)
    return replace(best, wall_time_s=time.perf_counter() - start)


def _no_plan() -> Plan:
    raise PlanningError("the pipeline search's plan cannot run")


def _runnable(plan: Plan | None) -> Plan | None:
    """The plan, or None when the runtime cannot run it (meshplan/support.py): the searches
    skip such candidates, so this only guards their assembly."""
    return None if plan is None or support.plan_problems(plan) else plan


def _tightest(*failures: MemoryLimitError | None) -> MemoryLimitError | None:
    """The failure that names the smallest finite per-device memory, if any does."""
    finite = [f for f in failures if f is not None and math.isfinite(f.min_memory_gib)]
    return min(finite, key=lambda f: f.min_memory_gib) if finite else None


def _model_state_floor(graph: OpGraph, mesh, limit: float, dtype: str,
                       optimizer: str) -> MemoryLimitError:
    """When no candidate could even be priced under the limit: the memory that the model
    state alone needs per device with everything sharded over every device (ZeRO-3)."""
    n = mesh.num_devices
    w, g, o = model_state_bytes(graph.param_count, dtype=dtype, optimizer=optimizer, zero=3, dp=n)
    floor = (w + g + o) / GIB  # model_state_bytes already divides by the n ZeRO-3 ranks
    return MemoryLimitError(
        f"no plan fits {gib(limit)} GiB per device on {n} devices: even sharded over all "
        f"{n} devices (ZeRO-3), the parameters, gradients and optimizer state need at least "
        f"{gib(floor)} GiB per device before any activation. Use more devices or a smaller "
        "model, or raise memory_limit_gib.", min_memory_gib=floor)
