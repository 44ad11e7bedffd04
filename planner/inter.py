"""Inter-operator (pipeline) planning: stages x submeshes x microbatches x schedule x recompute
x ZeRO, chosen jointly by dynamic programming over contiguous ranges of layer units.

trace -> cost -> solve (planner/intra per stage, **planner/inter** across stages) -> run.

The program (Alpa's inter-operator pass, Zheng et al. OSDI'22 section 5, extended). The model
is ``K`` units (planner/clusters). The mesh's ``N`` devices form ``p`` equal device groups
(contiguous ranges, realisable as DeviceMesh slices: a power-of-two slice of one node or
whole nodes, Alpa's submesh rule). A pipeline cuts the units into ``p`` contiguous stages,
stage ``s`` on group ``s`` (as planner/manual.py writes Megatron plans; the interleaved
schedule keeps ``p`` stage records and ``v`` enters the schedule's formulas). Every stage
picks an option ``o`` = (logical mesh (dp, tp) of its group, recompute, ZeRO stage); the
stage-cost function gives, per microbatch of ``G / B`` sequences, its time ``t`` (forward +
backward + recompute + exposed communication), its once-per-step tail ``u`` (gradient sync,
optimizer) and its memory: weights ``w``, activations ``a`` kept per in-flight microbatch and
a working peak ``r``. With ``m_s`` microbatches in flight on stage ``s``
(costmodel.memory.inflight_microbatches) the step time (costmodel.pipeline) and memory rule are

    T = B max_s t_s + (sum_s t_s - max_s t_s) / v + max_s u_s
      = (1/v) (sum_s t_s + (B v - 1) max_s t_s) + max_s u_s
    w_s + m_s a_s + r_s <= M   for every stage s

which for ``v = 1`` is Alpa's latency ``sum_s t_s + (B - 1) max_s t_s`` plus the tail. For
fixed bounds ``t_s <= t_max`` and ``u_s <= u_max`` the cheapest cut is a shortest path over
unit boundaries,

    F[s][k] = min_{j < k} F[s-1][j] + c_s(j, k),   c_s(j, k) = min_o { t | t <= t_max,
              u <= u_max, memory of o on units [j, k) at position s fits },

and ``T <= F[p][K] / v + (B - 1/v) t_max + u_max``. Enumerating ``(u_max, t_max)`` over the
values the cost tables take (ascending, stopping once ``u_max + S0 / v + (B - 1/v) t_max``
reaches the best plan so far, ``S0`` the unbounded minimum) makes the search exact; tests
compare it with brute force. ``(schedule, p, v, B)`` combinations are visited in a fixed
order and skipped when their lower bound ``S0 / v + (B - 1/v) S0 / p`` cannot beat the best
plan, which is what keeps a 1,024-device search in seconds.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from meshplan.axes import EP, EP_AXIS, AxisContext
from meshplan.costmodel.memory import inflight_microbatches
from meshplan.costmodel.pipeline import pipeline_step_time
from meshplan import support
from meshplan.errors import MemoryLimitError, PlanningError, gib
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for
from meshplan.vocabulary import RECOMPUTE, ComputeDtype
from meshplan.planner.stagedp import (RangeClasses, bottleneck, bound_candidates, build_tables,
                                      cut)

INF = float("inf")


@dataclass(frozen=True, slots=True)
class StageCost:
    """What one stage costs on one device of its submesh, per microbatch unless said."""

    time_s: float  # forward + backward (+ recompute) of one microbatch, intra-stage comm included
    step_s: float = 0.0  # once per step: gradient sync, ZeRO gathers, optimizer
    weights_gib: float = 0.0  # parameters + gradients + optimizer state
    activation_gib: float = 0.0  # held per in-flight microbatch
    transient_gib: float = 0.0  # working peak of one microbatch's backward
    recv_s: float = 0.0  # one receive of the stage's input activations (0 for the first stage)
    placements: object = field(default=None, compare=False)  # the intra planner's solution


class StageCostFn(Protocol):
    """Cost of running layers ``[first, last)`` (stage 0 holds the embedding, the last stage
    the head) on a stage mesh; None when the option is impossible (e.g. tp does not divide
    the heads). A cost function may instead (or also) offer the additive form
    ``unit_cost(i, option: StageOption, microbatch_size, *, leading, need_memory=True)``:
    unit ``i`` as the first unit of a stage (``leading``) or its marginal cost after unit
    ``i - 1`` (planner/stagedp). The search's pruning assumes a stage's time does not drop
    when recompute or the ZeRO stage goes up (``relaxed_space``)."""

    def __call__(self, layers: tuple[int, int], mesh_shape: tuple[int, ...],
                 microbatch_size: int, recompute: str, zero: int) -> StageCost | None: ...


@dataclass(frozen=True, slots=True)
class SearchSpace:
    schedules: tuple[str, ...] = SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = (0, 1, 2, 3)
    pipeline_zero: tuple[int, ...] | None = None  # ZeRO stages when pp > 1; None: as zero
    microbatches: tuple[int, ...] | None = None  # None: every count that divides the batch
    pipeline_degrees: tuple[int, ...] | None = None  # None: every degree the mesh allows
    tensor_degrees: tuple[int, ...] | None = None  # None: every divisor within a node
    virtual_stages: tuple[int, ...] = (2, 3, 4)
    max_stages: int | None = None
    microbatch_sizes: tuple[int, ...] | None = None  # sequences per dp rank; None: any
    sequence_parallel: tuple[bool, ...] = (False,)  # tried per pipeline (tp > 1 only)
    # context-parallel degrees tried per pipeline (one per pipeline: every stage of a plan has
    # the same submesh); only on uniform meshes (mixed_meshes=False)
    context_parallel: tuple[int, ...] = (1,)
    mixed_meshes: bool = True  # stages of one pipeline may pick different (dp, tp)
    # expert-parallel degrees tried per stage for models with routed experts
    # (Problem.experts > 0): None: every divisor of the stage's dp x cp x tp that divides
    # the expert count (torchtitan 0.3 and Megatron-Core borrow ep from those ranks)
    expert_parallel: tuple[int, ...] | None = None
    eps: float = 0.0  # bound candidates closer than a factor (1 + eps) merge; 0 = exact

    def __post_init__(self):
        for s in self.schedules:
            if s not in tuple(Schedule):
                raise PlanningError(f"schedule {s!r} is not known; choose from "
                                    f"{', '.join(Schedule)}")
        for r in self.recompute:
            if r not in RECOMPUTE:
                raise PlanningError(f"recompute {r!r} is not known; choose none, selective, full")
        if not self.schedules or not self.recompute or not self.zero:
            raise PlanningError("schedules, recompute and zero each need at least one choice")


@dataclass(frozen=True, slots=True)
class StageOption:
    mesh_shape: tuple[int, int]  # (dp, tp) over the group's devices, tp innermost
    recompute: str
    zero: int
    sequence_parallel: bool = False
    cp: int = 1  # context parallel: the group is dp x cp x tp devices (meshplan/context.py)
    # the stage is one of several (pp > 1): the module engine runs pipelines differently
    # (costmodel.estimate.default_runtime), so the price depends on it
    pipelined: bool = False
    ep: int = 1  # expert parallel: routed experts over ep of the dp x cp x tp ranks (Stage.ep)


@dataclass(frozen=True, slots=True)
class StagePlan:
    index: int
    units: tuple[int, int]  # [first, last) unit indices
    layers: tuple[int, int]  # [first, last) block indices
    group: int  # device group: devices [group * size, (group + 1) * size)
    devices: tuple[int, int]  # (first device, count)
    option: StageOption
    microbatch_size: int  # sequences per microbatch per data-parallel rank
    cost: StageCost
    time_s: float  # cost.time_s plus the send/recv to the next stage
    in_flight: float  # microbatches whose activations the stage holds at its peak
    memory_gib: float


@dataclass(frozen=True, slots=True)
class PipelinePlan:
    schedule: str
    pipeline_degree: int
    virtual_stages: int
    microbatches: int
    stages: tuple[StagePlan, ...]
    step_time_s: float
    bubble_s: float
    tail_s: float  # max once-per-step time
    combos_searched: int = 0
    dp_runs: int = 0


# -- schedules (the cost model's formulas) ---------------------------------------------------

def in_flight(schedule: str, stage: int, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak (costmodel.memory)."""
    return inflight_microbatches(schedule, stage, stages, microbatches,
                                 virtual_stages_for(schedule, virtual))


def pipeline_time_s(stage_times: Sequence[float], microbatches: int,
                    schedule: str = Schedule.ONE_F_ONE_B, virtual: int = 1) -> float:
    """Pipelined forward/backward time of one step (costmodel.pipeline.pipeline_step_time)."""
    return pipeline_step_time(stage_times, microbatches, schedule, virtual).step_s


# -- the problem ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """The inputs of the search: units, devices, batch, memory, and how stages are priced."""

    unit_layers: tuple[tuple[int, int], ...]  # block range of each unit
    unit_keys: tuple[str, ...]  # equal keys: equal costs
    num_devices: int
    devices_per_node: int
    global_batch: int
    memory_limit_gib: float
    cost_fn: Callable
    # optional floor of a stage's weights memory (GiB) on a (dp, tp) mesh of a p-stage
    # pipeline under ZeRO stage z: (p, dp, tp, z) -> GiB; shapes whose floor exceeds the
    # memory limit are skipped before any stage is priced
    weights_floor_gib: Callable | None = None
    dtype: str = ComputeDtype.FP32  # what the runtime can run depends on it (meshplan/support.py)
    experts: int = 0  # routed experts per MoE layer (0: a dense model, ep stays 1)

    @property
    def num_units(self) -> int:
        return len(self.unit_layers)

    @property
    def num_layers(self) -> int:
        return self.unit_layers[-1][1] if self.unit_layers else 0


def group_sizes(num_devices: int, devices_per_node: int) -> list[int]:
    """Device-group sizes a pipeline may use (Alpa's submesh rule): a divisor of a node's
    device count within one node, or whole nodes."""
    out = []
    for n in range(1, num_devices + 1):
        if num_devices % n:
            continue
        if (n <= devices_per_node and devices_per_node % n == 0) or n % devices_per_node == 0:
            out.append(n)
    return out


def stage_meshes(size: int, devices_per_node: int,
                 tensor_degrees: Sequence[int] | None = None,
                 context_degrees: Sequence[int] = (1,)) -> list[tuple[int, ...]]:
    """Logical (dp, tp) meshes of a group of ``size`` devices: tp stays inside a node; with
    context parallelism (dp, tp, cp), dp x cp x tp = size."""
    out = []
    for tp in range(1, min(size, devices_per_node) + 1):
        if size % tp or devices_per_node % tp:
            continue
        if tensor_degrees is not None and tp not in tensor_degrees:
            continue
        for cp in context_degrees:
            if (size // tp) % cp == 0:
                out.append((size // tp, tp) if cp == 1 else (size // tp // cp, tp, cp))
    return out


def _dp_tp_cp(mesh: tuple[int, ...]) -> tuple[int, int, int]:
    return (mesh[0], mesh[1], mesh[2] if len(mesh) > 2 else 1)


def stage_options(size: int, problem: Problem, space: SearchSpace, microbatches: int,
                  mesh: tuple[int, int] | None = None, sp: bool = False) -> list[StageOption]:
    meshes = [mesh] if mesh else stage_meshes(size, problem.devices_per_node, space.tensor_degrees)
    zeros = space.zero if size == problem.num_devices or space.pipeline_zero is None \
        else space.pipeline_zero
    out = []
    for dp, tp, cp in map(_dp_tp_cp, meshes):
        if sp and tp == 1:
            continue
        if support.data_parallel_rule(support.Candidate(
                dp=dp, microbatches=microbatches, global_batch=problem.global_batch)):
            continue  # the runtime needs equal per-rank microbatches
        mbs = problem.global_batch // (microbatches * dp)
        if space.microbatch_sizes is not None and mbs not in space.microbatch_sizes:
            continue
        for rc in space.recompute:
            for z in zeros:
                if z and dp == 1 and 0 in zeros:
                    continue  # ZeRO over one replica is plain data parallelism
                if support.zero_rule(support.Candidate(zero=z)):
                    continue
                for ep in expert_degrees(dp * cp * tp, problem.experts, space.expert_parallel):
                    if ep > 1 and EP_AXIS.problems(AxisContext(
                            {"dp": dp, "cp": cp, "tp": tp, EP: ep,
                             "pp": 2 if size < problem.num_devices else 1},
                            experts=problem.experts)):
                        continue  # the runtime does not run this ep (the table's rules)
                    out.append(StageOption((dp, tp), rc, z, sp, cp,
                                           pipelined=size < problem.num_devices, ep=ep))
    return out


def expert_degrees(ranks: int, experts: int, allowed: tuple[int, ...] | None) -> list[int]:
    """Expert-parallel degrees of a stage of ``ranks`` = dp x cp x tp devices: 1 for a dense
    model, else the axis table's degrees (meshplan/axes.py ``EP_AXIS.degrees``) that are
    ``allowed``."""
    if experts <= 0:
        return [1]
    out = [e for e in EP_AXIS.degrees(ranks, experts) if allowed is None or e in allowed]
    return out or [1]


# -- the search ----------------------------------------------------------------------------------

def search(problem: Problem, space: SearchSpace = SearchSpace()) -> PipelinePlan:
    """The plan with the lowest step time that fits memory (module docstring)."""
    return search_best(problem, space, keep=1)[0]


class _FloorBroken(Exception):  # a shape's bound fell under the cost function's floor
    pass


def search_best(problem: Problem, space: SearchSpace = SearchSpace(), *,
                keep: int = 1, within: float = INF, cap: float = INF,
                floors: bool = True) -> list[PipelinePlan]:
    """The ``keep`` best plans of distinct pipeline shapes, fastest first (a caller that
    prices plans more exactly than the search's tables re-ranks them), among those within
    a factor ``1 + within`` of the fastest: shapes beyond it are pruned unpriced. Plans
    slower than ``cap`` seconds are pruned too (PlanningError when none is faster)."""
    if problem.num_units < 1:
        raise PlanningError("the model has no operators to place")
    classes = RangeClasses(problem.unit_keys)
    cost_cache: dict = {}
    table_cache: dict = {}
    top: list[PipelinePlan] = []
    combos = 0
    runs = [0]

    def threshold() -> float:
        near = top[0].step_time_s * (1 + within) if top else INF
        return min(near, cap, top[-1].step_time_s if len(top) >= keep else INF)
    smallest_memory = [INF]

    def tables_for(size, b, mesh, v, sp, relaxed=False):
        key = (size, b, mesh, v, sp, relaxed)
        hops = 0.0 if relaxed else v
        if key not in table_cache:
            options = stage_options(size, problem, relaxed_space(space) if relaxed else space,
                                    b, mesh, sp)
            table_cache[key] = build_tables(classes, problem, options, b, hops,
                                            relaxed_cache if relaxed else cost_cache,
                                            need_memory=not relaxed,
                                            stage_blocks=problem.num_layers * size
                                            // problem.num_devices if v > 1 else None) \
                if options else None
        return table_cache[key]

    # lower bounds first (fastest options, no memory, no send/recv): visit the most promising
    # pipeline shapes first and stop at the first whose bound cannot beat the best plan. A
    # probe-free floor under each bound (``time_floor_s``) defers pricing it: the same order,
    # and shapes whose floor cannot beat the best plan are never priced
    relaxed_cache: dict = {}
    floor_of = getattr(problem.cost_fn, "time_floor_s", None) if floors else None
    if min(space.zero) != 0 or (space.pipeline_zero and min(space.pipeline_zero) != 0):
        floor_of = None  # the floor prices no ZeRO traffic
    pending = []
    for order, combo in enumerate(_combos(problem, space)):
        schedule, stages, virtual, b, mesh, sp = combo
        if not _may_fit(problem, space, stages, mesh):
            continue
        v = virtual_stages_for(schedule, virtual)
        f0 = floor_of(problem.num_devices // stages, b) if floor_of else 0.0
        pending.append((f0 / v + (b - 1 / v) * f0 / stages, order, combo))
    heapq.heapify(pending)
    bounded: list = []  # heap of (bound, order, combo) of the shapes priced so far

    def next_shape():
        """The next shape by (bound, order), None past the last (_FloorBroken: a bound
        under its floor)."""
        while pending and (not bounded or pending[0][:2] <= bounded[0][:2]):
            floor, order, combo = heapq.heappop(pending)
            if floor >= threshold():
                pending.clear()  # every later bound is at least its floor
                break
            schedule, stages, virtual, b, mesh, sp = combo
            v = virtual_stages_for(schedule, virtual)
            loose = tables_for(problem.num_devices // stages, b, mesh, v, sp, relaxed=True)
            if loose is None:
                continue
            s0, _ = cut([(loose, 0.0, INF)] * stages, INF, INF)
            bound = s0 / v + (b - 1 / v) * s0 / stages
            if bound < floor:
                raise _FloorBroken
            if np.isfinite(bound):
                heapq.heappush(bounded, (bound, order, combo))
        return heapq.heappop(bounded) if bounded else None

    while True:
        try:
            visit = next_shape()
        except _FloorBroken:  # not a bound for this cost function: search without floors
            return search_best(problem, space, keep=keep, within=within, cap=cap, floors=False)
        if visit is None:
            break
        bound, _, combo = visit
        if bound >= threshold():
            break
        schedule, stages, virtual, b, mesh, sp = combo
        tables = tables_for(problem.num_devices // stages, b, mesh,
                            virtual_stages_for(schedule, virtual), sp)
        if tables is None:
            continue
        found = _search_combo(problem, space, tables, schedule, stages, virtual, b,
                              threshold(), runs, smallest_memory)
        combos += 1
        if found is not None:
            top = sorted(top + [found], key=lambda p: p.step_time_s)[:keep]
            top = [p for p in top if p.step_time_s <= top[0].step_time_s * (1 + within)]
    if not top and cap < INF:
        raise PlanningError(f"no pipeline plan that fits is faster than {cap:.4g} s")
    if not top:
        raise MemoryLimitError(
            f"no pipeline plan fits {gib(problem.memory_limit_gib)} GiB per device on "
            f"{problem.num_devices} devices; the smallest stage found needs "
            f"{gib(smallest_memory[0])} GiB. Use more devices, a smaller batch, allow "
            "recompute='full' and zero=3, or raise memory_limit_gib.",
            min_memory_gib=smallest_memory[0])
    return [PipelinePlan(**{**_fields(p), "combos_searched": combos, "dp_runs": runs[0]})
            for p in top]


def _may_fit(problem: Problem, space: SearchSpace, stages: int, mesh) -> bool:
    if problem.weights_floor_gib is None:
        return True
    size = problem.num_devices // stages
    meshes = [mesh] if mesh else stage_meshes(size, problem.devices_per_node,
                                              space.tensor_degrees)
    return any(problem.weights_floor_gib(stages, dp, tp, max(space.zero))
               <= problem.memory_limit_gib for dp, tp, _ in map(_dp_tp_cp, meshes))


def relaxed_space(space: SearchSpace) -> SearchSpace:
    """The fastest per-microbatch choices only: no recompute if allowed (recompute adds
    forward work) and the lowest ZeRO stage (ZeRO-3 adds weight gathers). A cost function
    whose times grow this way (as the cost model's do) makes the bound valid."""
    order = RECOMPUTE  # cheapest first
    return replace(space, recompute=(min(space.recompute, key=order.index),),
                   zero=(min(space.zero),),
                   pipeline_zero=space.pipeline_zero and (min(space.pipeline_zero),))


def _fields(plan: PipelinePlan) -> dict:
    return {f: getattr(plan, f) for f in PipelinePlan.__slots__}


def _combos(problem: Problem, space: SearchSpace):
    """(schedule, stages p, virtual v, microbatches B, mesh or None, sequence parallel) in a
    deterministic order."""
    sizes = group_sizes(problem.num_devices, problem.devices_per_node)
    max_stages = min(space.max_stages or problem.num_units, problem.num_units)
    batches = space.microbatches or tuple(d for d in range(1, problem.global_batch + 1)
                                          if problem.global_batch % d == 0)
    for schedule in space.schedules:
        virtuals = space.virtual_stages if schedule == Schedule.INTERLEAVED else (1,)
        for size in sorted(sizes, reverse=True):
            stages = problem.num_devices // size
            if stages > max_stages or (space.pipeline_degrees is not None
                                       and stages not in space.pipeline_degrees):
                continue
            if schedule == Schedule.INTERLEAVED and stages == 1:
                continue
            meshes = [None] if space.mixed_meshes else \
                stage_meshes(size, problem.devices_per_node, space.tensor_degrees,
                             space.context_parallel)
            for virtual in virtuals:
                for b in batches:
                    if problem.global_batch % b:
                        continue
                    if schedule == Schedule.INTERLEAVED and b % stages:
                        continue  # Megatron-LM's interleaved schedule needs B % p == 0
                    if stages > 1 and support.candidate_problems(support.Candidate(
                            pp=stages, schedule=str(schedule), virtual_stages=virtual,
                            microbatches=b, global_batch=problem.global_batch,
                            dtype=problem.dtype, num_layers=problem.num_layers)):
                        continue  # a pipeline the runtime cannot run
                    for mesh in meshes:
                        for sp in space.sequence_parallel:
                            yield schedule, stages, virtual, b, mesh, sp


def _search_combo(problem, space, tables, schedule, stages, virtual, b, best_s, runs,
                  smallest_memory) -> PipelinePlan | None:
    positions = [(tables, in_flight(schedule, s, stages, b, virtual), problem.memory_limit_gib)
                 for s in range(stages)]
    v = virtual_stages_for(schedule, virtual)

    def run(t_max, u_max):
        runs[0] += 1
        return cut(positions, t_max, u_max)

    s0, cuts = run(INF, INF)
    if cuts is None:
        mem = tables.w + tables.r + tables.a * positions[-1][1]
        smallest_memory[0] = min(smallest_memory[0], float(np.min(mem)) if mem.size else INF)
        return None
    lower = s0 / v + (b - 1 / v) * s0 / stages
    if lower >= best_s:
        return None
    best: PipelinePlan | None = None
    u_values = bound_candidates(tables.u, space.eps)
    t_values = bound_candidates(tables.t, space.eps)
    # the smallest feasible bounds come from min-max paths (stagedp.bottleneck): a bound
    # admits a cut exactly when it is at least that value
    t_floor = bottleneck(positions, "t")  # no cut has a smaller largest stage time
    u_start = bisect.bisect_left(u_values, bottleneck(positions, "u"))
    for u_max in u_values[u_start:]:
        if u_max + s0 / v + (b - 1 / v) * t_floor >= best_s:
            break
        t_start = bisect.bisect_left(t_values, bottleneck(positions, "t", u_max=u_max))
        for t_max in t_values[t_start:]:
            if s0 / v + (b - 1 / v) * t_max + u_max >= best_s:
                break
            _, cuts = run(t_max, u_max)
            plan = _assemble(problem, tables, cuts, schedule, stages, virtual, b, positions)
            if plan.step_time_s < best_s:
                best, best_s = plan, plan.step_time_s
    return best


def _assemble(problem, tables, cuts, schedule, stages, virtual, b, positions) -> PipelinePlan:
    size = problem.num_devices // stages
    out = []
    for s, (j, k, o) in enumerate(cuts):
        c = int(tables.classes.index[j, k])
        opt = tables.options[o]
        cost = tables.stage_costs[o][c] or StageCost(
            time_s=float(tables.t[o, c]), step_s=float(tables.u[o, c]),
            weights_gib=float(tables.w[o, c]), activation_gib=float(tables.a[o, c]),
            transient_gib=float(tables.r[o, c]))
        m = positions[s][1]
        out.append(StagePlan(
            index=s, units=(j, k), layers=(problem.unit_layers[j][0], problem.unit_layers[k - 1][1]),
            group=s, devices=(s * size, size), option=opt,
            microbatch_size=problem.global_batch // (b * opt.mesh_shape[0]), cost=cost,
            time_s=float(tables.t[o, c]), in_flight=m,
            memory_gib=float(tables.w[o, c] + m * tables.a[o, c] + tables.r[o, c])))
    times = [st.time_s for st in out]
    pipe = pipeline_step_time(times, b, str(schedule), virtual)
    tail = max(st.cost.step_s for st in out)
    return PipelinePlan(schedule=str(schedule), pipeline_degree=stages,
                        virtual_stages=virtual_stages_for(schedule, virtual),
                        microbatches=b, stages=tuple(out), step_time_s=pipe.step_s + tail,
                        bubble_s=pipe.bubble_s, tail_s=tail)
