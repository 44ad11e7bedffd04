"""The intra-operator planner: split every operator of one stage over one (sub)mesh.

trace -> cost -> **solve (intra-op)** -> run. ``solve_stage`` reads as its steps:

1. group the stage's operators: repeated identical layers share one set of decisions
   (``_representatives``), and followers (views, unary elementwise ops) ride on their
   producer's decision (``_groups``);
2. list each group's candidates (``planner/strategies.py``) and price them with the
   estimate's own parts (``planner/pricing.py``: one operator, one input edge, one
   parameter's state and gradient sync, the optimizer step, as ``costmodel.estimate`` prices
   the graph engine), per-device memory (parameters, gradients, optimizer state, activations
   kept for backward), and one ZeRO level and data-parallel axis for the whole stage;
3. solve the integer program exactly (``planner/ilp.py``) under the memory limit;
4. read the choice back as per-node placements (``StageSolution``).

The pipeline planner calls ``solve_stage`` once per (layer range, submesh) candidate; pass a
``StageCache`` to reuse answers for structurally equal stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GIB
from meshplan.errors import MemoryLimitError, PlanningError
from meshplan.plan import MemoryBreakdown, OpPlacement, SolverInfo
from meshplan.planner import ilp
from meshplan.graph import OpGraph
from meshplan.placements import placement_str
from meshplan.planner.pricing import Pricer  # the pricing half of the builder
from meshplan.planner.reshard import INF
from meshplan.planner.stage_problem import NS, StageOptions, StageProblem

@dataclass(frozen=True)
class StageSolution:
    """The chosen placements and what they cost on one device of the stage's mesh.

    ``time_s = microbatches x microbatch_s + step_s`` is the solver's objective.
    """

    time_s: float
    microbatch_s: float  # forward + backward (+ recompute) + activation comm of one microbatch
    step_s: float  # once per step: gradient sync and optimizer step
    compute_s: float  # of the whole step
    comm_s: float  # of the whole step
    memory: MemoryBreakdown  # activations already multiplied by inflight_microbatches
    params: dict  # parameter -> storage placement strings
    ops: dict  # node -> OpPlacement
    inputs: dict  # graph/stage input -> placement strings
    solver: SolverInfo
    choice: tuple[int, ...] = field(default=(), repr=False)
    zero: int = 0  # the stage's ZeRO level (every candidate chosen assumes it)


class StageCache:
    """Answers of ``solve_stage`` keyed by stage structure, submesh and options."""

    def __init__(self):
        self._data: dict = {}

    def get(self, key):
        return self._data.get(key)

    def put(self, key, value):
        self._data[key] = value

    def __len__(self):
        return len(self._data)


# -- the entry point -----------------------------------------------------------------------------

def solve_stage(graph: OpGraph, node_names, mesh_shape, axis_names, hardware: HardwareProfile,
                options: StageOptions = StageOptions(), *, devices_per_node: int | None = None,
                cache: StageCache | None = None) -> StageSolution:
    """Best placements for the operators ``node_names`` (graph order) on a ``mesh_shape`` mesh.

    Raises MemoryLimitError when no candidate combination fits ``options.memory_limit_gib``.
    """
    names = tuple(node_names)
    key = None
    if cache is not None:
        key = (_structure_key(graph, names), tuple(mesh_shape), tuple(axis_names),
               hardware.name, devices_per_node, options)
        hit = cache.get(key)
        if hit is not None:
            return _rename(hit, graph, names) if hit[1] != names else hit[0]
    problem = build_problem(graph, names, tuple(mesh_shape), hardware, options,
                            devices_per_node=devices_per_node)
    solution = solve_problem(problem, graph, names, tuple(mesh_shape), options)
    if cache is not None:
        cache.put(key, (solution, names))
    return solution


def build_problem(graph: OpGraph, names: tuple[str, ...], mesh_shape: tuple[int, ...],
                  hw: HardwareProfile, options: StageOptions, *,
                  devices_per_node: int | None = None) -> StageProblem:
    if devices_per_node is not None and devices_per_node != hw.devices_per_node:
        hw = replace(hw, devices_per_node=devices_per_node)
    rep, param_rep, count = _representatives(graph, names)
    pricer = Pricer(graph, names, rep, mesh_shape, hw, options)
    return pricer.problem(count, param_rep)


def solve_problem(problem: StageProblem, graph: OpGraph, names, mesh_shape,
                  options: StageOptions) -> StageSolution:
    ip = to_ilp(problem)
    floor = ilp.min_memory(ip)
    if floor > ip.memory_limit:
        need = floor / GIB
        raise MemoryLimitError(
            f"no sharding strategy fits {problem.memory_limit_bytes / GIB:.4g} GiB per device "
            f"on a {'x'.join(map(str, mesh_shape))} mesh: the most memory-frugal one needs "
            f"{need:.4g} GiB. Use more devices, a smaller (micro)batch, recompute, or raise "
            "memory_limit_gib.", min_memory_gib=need)
    hint = ilp.greedy(ip)
    result = ilp.solve(ip, backend=options.backend, time_limit_s=options.time_limit_s, hint=hint)
    if result.status == "infeasible":
        raise PlanningError(f"the {options.backend} solver found no feasible plan within "
                            f"{options.time_limit_s} s; raise time_limit_s")
    return read_solution(problem, result, graph, names, mesh_shape, options)


# -- step 1: representatives of identical layers ----------------------------------------------

def _representatives(graph: OpGraph, names: tuple[str, ...]):
    """node -> representative node (first identical layer in the stage), multiplicities."""
    by_layer: dict[int, list[str]] = {}
    for n in names:
        layer = graph.node(n).layer
        if layer >= 0:
            by_layer.setdefault(layer, []).append(n)
    first_of: dict[str, int] = {}
    rep: dict[str, str] = {n: n for n in names}
    param_rep: dict[str, str] = {}
    count: dict[str, int] = {n: 1 for n in names}
    fps = graph.layer_fingerprints
    for layer in sorted(by_layer):
        fp = fps[layer] if layer < len(fps) else f"layer{layer}"
        if fp not in first_of:
            first_of[fp] = layer
            continue
        base = by_layer[first_of[fp]]
        mine = by_layer[layer]
        if len(base) != len(mine):
            continue
        for a, b in zip(base, mine):
            rep[b] = a
            count[a] += 1
            count[b] = 0
            na, nb = graph.node(a), graph.node(b)
            for pa, pb in zip(na.params, nb.params):
                param_rep[pb] = pa
    return rep, param_rep, count


def _structure_key(graph: OpGraph, names: tuple[str, ...]):
    """Stages with the same layer fingerprints and the same non-layer nodes cost the same."""
    layers, others = [], []
    for n in names:
        node = graph.node(n)
        if node.layer >= 0:
            if not layers or layers[-1][0] != node.layer:
                layers.append((node.layer, graph.layer_fingerprints[node.layer]
                               if node.layer < graph.num_layers else ""))
        else:
            others.append(n)
    return graph.fingerprint, tuple(fp for _, fp in layers), tuple(others)


def _rename(hit, graph, names):
    """A cached solution for an equal stage with other node names: map position to position."""
    solution, old = hit
    mapping = dict(zip(old, names))
    ops = {mapping[k]: v for k, v in solution.ops.items()}
    old_params = [p for n in old for p in graph.node(n).params]
    new_params = [p for n in names for p in graph.node(n).params]
    pmap = dict(zip(old_params, new_params))
    params = {pmap.get(k, k): v for k, v in solution.params.items()}
    return replace(solution, params=params, ops=ops)


# -- step 3: integer program ----------------------------------------------------------------

def to_ilp(problem: StageProblem) -> ilp.IlpProblem:
    m = problem.microbatches
    nodes = []
    for g in problem.groups:
        nodes.append(ilp.IlpNode(
            g.anchor, tuple(_units(c.microbatch_s * m + c.step_s) for c in g.candidates),
            tuple(int(math.ceil(c.memory.total_gib * GIB)) for c in g.candidates)))
    edges = tuple(ilp.IlpEdge(u, v, uc, vc, tuple(tuple(None if c == INF else _units(c * m)
                                                          for c in row) for row in cost))
                  for u, v, uc, vc, cost in problem.edges)
    limit = int(problem.memory_limit_bytes)
    return ilp.IlpProblem(tuple(nodes), edges, limit, problem.flags, problem.conflicts)


def _units(seconds: float) -> int:
    return int(round(seconds * NS))


# -- step 4: reading the choice back -----------------------------------------------------------

def read_solution(problem: StageProblem, result: ilp.IlpResult, graph: OpGraph, names,
                  mesh_shape, options: StageOptions) -> StageSolution:
    ops_rep: dict[str, OpPlacement] = {}
    inputs: dict[str, tuple] = {}
    params: dict[str, tuple] = {}
    n_mb = problem.microbatches
    micro = step = comm = 0.0
    mem = [0.0] * 5
    for g, a in zip(problem.groups, result.choice):
        c = g.candidates[a]
        micro += c.microbatch_s
        step += c.step_s
        comm += c.comm_s
        for i, val in enumerate((c.memory.params_gib, c.memory.grads_gib, c.memory.optimizer_gib,
                                 c.memory.activations_gib, c.memory.buffers_gib)):
            mem[i] += val
        if g.is_source:
            inputs[g.anchor] = placement_str(c.member_outputs[0])
            continue
        for m, ins, out in zip(g.members, c.member_inputs, c.member_outputs):
            ops_rep[m] = OpPlacement(inputs=tuple(placement_str(p) for p in ins),
                                     output=placement_str(out))
        for p, st in zip(g.owned_params, c.storage):
            params[p] = placement_str(st)
    for u, v, uc, vc, cost in problem.edges:
        edge = cost[uc[result.choice[u]]][vc[result.choice[v]]]
        micro += edge
        comm += edge * n_mb
    # fixed charges: flat buffers' latencies (step) and per-block ZeRO-3 latencies (every
    # microbatch's, already summed over the microbatches), all communication
    charged = sum(f.cost for f, on in zip(problem.flags, ilp.flags_on(to_ilp(problem),
                                                                       result.choice)) if on) / NS
    step += charged
    comm += charged
    zero = max((g.candidates[a].zero for g, a in zip(problem.groups, result.choice)
                if g.owned_params), default=0)
    ops = {n: ops_rep[problem.rep[n]] for n in names if problem.rep[n] in ops_rep}
    for p, r in problem.param_rep.items():
        if r in params:
            params[p] = params[r]
    _tied_params(graph, params, len(mesh_shape))
    notes = (f"memory limit {problem.memory_limit_bytes / GIB:.6g} GiB per device",) + tuple(
        f"no sharding rule for {n} ({graph.node(n).target}): replicated"
        for n in problem.fallbacks)
    solver = SolverInfo(name=f"meshplan-intra-ilp/{result.backend}", status=result.status,
                        gap=round(result.gap, 6), time_s=result.deterministic_time_s,
                        objective_s=result.objective / NS, notes=notes)
    memory = MemoryBreakdown(*mem)
    total = micro * n_mb + step
    return StageSolution(time_s=total, microbatch_s=micro, step_s=step, compute_s=total - comm,
                         comm_s=comm, memory=memory, params=params, ops=ops, inputs=inputs,
                         solver=solver, choice=result.choice, zero=zero)


def _tied_params(graph: OpGraph, params: dict, ndim: int) -> None:
    """Tied names share the placement of the name the graph reads."""
    for p in graph.params:
        if p.name in params:
            continue
        for q in graph.params:
            if q.name in params and (q.tied_to == p.name or p.tied_to == q.name or
                                     (p.tied_to is not None and p.tied_to == q.tied_to)):
                params[p.name] = params[q.name]
                break
