r"""The intra-operator ILP: pick one strategy per operator group, exactly, under a memory limit.

trace -> cost -> **solve (ILP)** -> run. ``planner/intra.py`` turns a stage into an
``IlpProblem`` (integer costs, one node per operator group, one edge per producer -> consumer
pair of groups); this module solves it with OR-Tools and nothing else about models.

The integer program. Nodes :math:`v \in V` with candidates :math:`a \in A_v`, node cost
:math:`c_{v,a}` (compute + gradient synchronisation + follower fix-ups, multiplied by the
number of identical layers the node stands for) and memory :math:`m_{v,a}`. Edges
:math:`(u,v) \in E` price the redistribution between the class :math:`\pi_u(a)` of the
producer's choice (its output placement) and the class :math:`\kappa_v(b)` of the consumer's
choice (the placement it consumes and the placement its gradient comes back in):
:math:`r_{e,p,q}`, with :math:`(p,q) \notin F_e` when DTensor cannot make the transition.

.. math::

    \min \sum_{v}\sum_{a} c_{v,a}\,x_{v,a} + \sum_{e=(u,v)}\sum_{(p,q)\in F_e} r_{e,p,q}\,y_{e,p,q}

    \text{s.t.}\quad \sum_{a \in A_v} x_{v,a} = 1 \quad \forall v          \qquad \text{(one choice)}

    \sum_{q:(p,q)\in F_e} y_{e,p,q} = \sum_{a:\pi_u(a)=p} x_{u,a} \quad \forall e, p
    \qquad \sum_{p:(p,q)\in F_e} y_{e,p,q} = \sum_{b:\kappa_v(b)=q} x_{v,b} \quad \forall e, q
    \qquad \text{(edges)}

    \sum_{v}\sum_{a} m_{v,a}\,x_{v,a} \le M \qquad \text{(memory)}

    w_f \ge \sum_{a:(v,a)\in S_f} x_{v,a} \quad \forall f, v
    \qquad w_f + w_g \le 1 \quad \forall (f,g) \in C \qquad \text{(flags)}

    x \in \{0,1\},\quad y \in \{0,1\} \text{ (CP-SAT) or } [0,1] \text{ (MIP)},\quad w \in [0,1].

Flags are fixed charges and stage-wide switches: flag :math:`f` is on when any candidate of
its set :math:`S_f` is chosen and then costs :math:`k_f` once (the objective gains
:math:`\sum_f k_f w_f`): one latency of a flat gradient buffer however many parameters it
carries, one per-block ZeRO-3 gather. Conflicting flags cannot both be on: one ZeRO level
and one data-parallel axis for the whole stage, as the runtime runs it. :math:`w` may be
continuous: at an integral :math:`x` the smallest feasible :math:`w` is integral.

The edge constraints are a transportation polytope between two one-hot vectors, so
:math:`y_{e,p,q} = [\pi_u(x_u)=p]\,[\kappa_v(x_v)=q]` exactly (integral even as an LP), and a
forbidden pair has no variable, so choices that need it cannot both be taken. Edge variables
live on placement classes, not on strategy pairs, which keeps them few. Edges whose cost is
zero everywhere are dropped; an edge with one class on either side folds into node costs.

Backend: a MIP solver through ``pywraplp`` (CBC, the default; SCIP, HiGHS) or CP-SAT.
Measured on GPT-style stages (``benchmarks/planner_scaling.py --backends``): GPT-3 175B on
an 8x8 A100 mesh (65 groups, 399 candidates): CBC 0.19 s, HiGHS 0.31 s, SCIP 0.45 s, CP-SAT
2.2 s; a 4-layer 1024-wide GPT on 2x8 (480 candidates, 6,033 edge variables): CBC 0.38 s,
HiGHS 1.7 s, SCIP 1.6 s, CP-SAT 16 s with one worker (4.1 s with ``linearization_level=2``,
14 s with two workers). The LP relaxation of this program is
nearly tight (edge variables form transportation polytopes), so LP-based branch and bound
closes it at the root where CP-SAT's search does not. CBC runs single-threaded and is
deterministic; it reports no deterministic time, so plans record ``time_s = 0`` with CBC
and CP-SAT's deterministic time with CP-SAT (docs/DECISIONS.md). A greedy feasible solution
seeds every backend's search (a MIP start for CBC and SCIP, a hint for CP-SAT; HiGHS's
pywraplp hint crashes in OR-Tools 9.15, so HiGHS starts cold); the status
and the optimality gap are returned by every backend.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from meshplan.errors import PlanningError


@dataclass(frozen=True, slots=True)
class IlpNode:
    name: str
    cost: tuple[int, ...]  # objective units per candidate
    memory: tuple[int, ...]  # memory units per candidate


@dataclass(frozen=True, slots=True)
class IlpEdge:
    u: int
    v: int
    u_class: tuple[int, ...]  # class of each candidate of u
    v_class: tuple[int, ...]  # class of each candidate of v
    cost: tuple[tuple[int | None, ...], ...]  # [u class][v class]; None: not executable


@dataclass(frozen=True, slots=True)
class IlpFlag:
    """A fixed charge: ``cost`` once when any (node, candidate) of ``members`` is chosen."""

    name: str
    cost: int
    members: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class IlpProblem:
    nodes: tuple[IlpNode, ...]
    edges: tuple[IlpEdge, ...]
    memory_limit: int | None = None
    flags: tuple[IlpFlag, ...] = ()
    conflicts: tuple[tuple[int, int], ...] = ()  # pairs of flag indices not both on


@dataclass(frozen=True, slots=True)
class IlpResult:
    choice: tuple[int, ...]
    objective: int
    status: str  # "optimal" | "feasible" | "infeasible"
    gap: float
    deterministic_time_s: float
    wall_s: float
    backend: str


# -- evaluation, brute force and greedy (the references the solver is tested against) ---------

def evaluate(problem: IlpProblem, choice: tuple[int, ...]) -> int | None:
    """Objective of a full choice, or None when an edge is forbidden or memory overflows."""
    total = sum(n.cost[a] for n, a in zip(problem.nodes, choice))
    for e in problem.edges:
        c = e.cost[e.u_class[choice[e.u]]][e.v_class[choice[e.v]]]
        if c is None:
            return None
        total += c
    on = flags_on(problem, choice)
    if any(on[f] and on[g] for f, g in problem.conflicts):
        return None
    total += sum(f.cost for f, o in zip(problem.flags, on) if o)
    if problem.memory_limit is not None and memory(problem, choice) > problem.memory_limit:
        return None
    return total


def flags_on(problem: IlpProblem, choice: tuple[int, ...]) -> list[bool]:
    """Which flags a full choice turns on."""
    return [any(choice[v] == a for v, a in f.members) for f in problem.flags]


def memory(problem: IlpProblem, choice: tuple[int, ...]) -> int:
    return sum(n.memory[a] for n, a in zip(problem.nodes, choice))


def min_memory(problem: IlpProblem) -> int:
    """Smallest memory of any choice: memory is separable per node."""
    return sum(min(n.memory) for n in problem.nodes)


def brute_force(problem: IlpProblem) -> tuple[int | None, tuple[int, ...] | None]:
    best, arg = None, None
    for choice in itertools.product(*(range(len(n.cost)) for n in problem.nodes)):
        val = evaluate(problem, choice)
        if val is not None and (best is None or val < best):
            best, arg = val, choice
    return best, arg


def greedy(problem: IlpProblem) -> tuple[int, ...] | None:
    """In node order, the cheapest candidate given the choices already made; if that overflows
    memory or hits a forbidden edge, the least-memory candidates. None when neither works.
    Where that breaks a conflict of flags, each flag in a conflict is tried with every flag
    it conflicts with banned, and the cheapest of those kept."""
    found = _greedy(problem, frozenset())
    if found is not None or not problem.conflicts:
        return found
    best = None
    for f in sorted({f for pair in problem.conflicts for f in pair}):
        against = {g for pair in problem.conflicts for g in pair if f in pair and g != f}
        trial = _greedy(problem, frozenset(m for g in against for m in problem.flags[g].members))
        if trial is not None and (best is None or evaluate(problem, trial) < evaluate(problem, best)):
            best = trial
    return best


def _greedy(problem: IlpProblem, banned: frozenset) -> tuple[int, ...] | None:
    into: dict[int, list[IlpEdge]] = {}
    for e in problem.edges:
        into.setdefault(max(e.u, e.v), []).append(e)
    choice: list[int] = []
    for i, node in enumerate(problem.nodes):
        best, arg = None, 0
        for a in range(len(node.cost)):
            if (i, a) in banned:
                continue
            trial = choice + [a]
            total = node.cost[a]
            for e in into.get(i, ()):
                c = e.cost[e.u_class[trial[e.u]]][e.v_class[trial[e.v]]]
                if c is None:
                    total = None
                    break
                total += c
            if total is not None and (best is None or total < best):
                best, arg = total, a
        choice.append(arg)
    if evaluate(problem, tuple(choice)) is not None:
        return tuple(choice)
    frugal = tuple(min((a for a in range(len(n.memory)) if (v, a) not in banned),
                       key=lambda a, n=n: (n.memory[a], n.cost[a]), default=0)
                   for v, n in enumerate(problem.nodes))
    return frugal if evaluate(problem, frugal) is not None else None


# -- the model, one constraint family per function ----------------------------------------------

BACKENDS = ("cbc", "highs", "scip", "cp-sat")


def solve(problem: IlpProblem, *, backend: str = "cbc", time_limit_s: float = 30.0,
          hint: tuple[int, ...] | None = None) -> IlpResult:
    """Solve exactly (up to the time limit). ``backend``: cbc | highs | scip | cp-sat."""
    if backend not in BACKENDS:
        raise PlanningError(f"ILP backend {backend!r} is not one of {', '.join(BACKENDS)}")
    start = time.perf_counter()
    problem = _fold_edges(problem)
    model = _CpSat() if backend == "cp-sat" else _Mip(backend)
    x = _choice_variables(model, problem)
    y = _edge_variables(model, problem, x)
    _memory_limit(model, problem, x)
    w = _flag_variables(model, problem, x)
    _objective(model, problem, x, y, w)
    if hint is not None:
        for v, a in enumerate(hint):
            for b, var in enumerate(x[v]):
                model.hint(var, int(a == b))
    status, objective, bound, det = model.solve(time_limit_s)
    if status == "infeasible":
        return IlpResult((), 0, "infeasible", 0.0, det, time.perf_counter() - start, backend)
    choice = tuple(next(a for a, var in enumerate(xs) if model.value(var) > 0.5) for xs in x)
    exact = evaluate(problem, choice)
    if exact is None:
        raise PlanningError(f"{backend} returned a choice that violates the model; report this")
    gap = 0.0 if status == "optimal" or exact == 0 else max(0.0, (exact - bound) / exact)
    return IlpResult(choice, exact, status, gap, det, time.perf_counter() - start, backend)


def _choice_variables(model, problem: IlpProblem) -> list[list]:
    """x[v][a] in {0,1}; exactly one candidate per node."""
    x = []
    for v, node in enumerate(problem.nodes):
        xs = [model.bool_var(f"x_{v}_{a}") for a in range(len(node.cost))]
        model.add_eq([(1, var) for var in xs], 1)
        x.append(xs)
    return x


def _edge_variables(model, problem: IlpProblem, x) -> dict:
    """y[e][p, q] for allowed class pairs; row and column sums equal the class indicators."""
    y = {}
    for i, e in enumerate(problem.edges):
        pairs = {(p, q): model.edge_var(f"y_{i}_{p}_{q}")
                 for p, row in enumerate(e.cost) for q, c in enumerate(row) if c is not None}
        y[i] = pairs
        for p in range(len(e.cost)):
            lhs = [(1, var) for (pp, _), var in pairs.items() if pp == p]
            lhs += [(-1, x[e.u][a]) for a, cls in enumerate(e.u_class) if cls == p]
            model.add_eq(lhs, 0)
        for q in range(len(e.cost[0]) if e.cost else 0):
            lhs = [(1, var) for (_, qq), var in pairs.items() if qq == q]
            lhs += [(-1, x[e.v][b]) for b, cls in enumerate(e.v_class) if cls == q]
            model.add_eq(lhs, 0)
    return y


def _memory_limit(model, problem: IlpProblem, x) -> None:
    """sum m[v,a] x[v,a] <= M."""
    if problem.memory_limit is None:
        return
    model.add_le([(m, x[v][a]) for v, node in enumerate(problem.nodes)
                  for a, m in enumerate(node.memory) if m], problem.memory_limit)


def _flag_variables(model, problem: IlpProblem, x) -> list:
    """w[f] >= the indicator of any of its candidates, node by node; conflicting flags sum
    to at most one."""
    w = []
    for i, f in enumerate(problem.flags):
        var = model.edge_var(f"w_{i}")
        by_node: dict[int, list[int]] = {}
        for v, a in f.members:
            by_node.setdefault(v, []).append(a)
        for v, cands in by_node.items():
            model.add_le([(1, x[v][a]) for a in cands] + [(-1, var)], 0)
        w.append(var)
    for f, g in problem.conflicts:
        model.add_le([(1, w[f]), (1, w[g])], 1)
    return w


def _objective(model, problem: IlpProblem, x, y, w) -> None:
    terms = [(c, x[v][a]) for v, node in enumerate(problem.nodes)
             for a, c in enumerate(node.cost) if c]
    for i, e in enumerate(problem.edges):
        terms += [(e.cost[p][q], var) for (p, q), var in y[i].items() if e.cost[p][q]]
    terms += [(f.cost, var) for f, var in zip(problem.flags, w) if f.cost]
    model.minimize(terms)


def _fold_edges(problem: IlpProblem) -> IlpProblem:
    """Fold self edges and one-class edges into node costs; drop all-zero edges. A candidate
    that a folded edge forbids is banned by a self edge whose only allowed class excludes it."""
    costs = [list(n.cost) for n in problem.nodes]
    banned: list[set[int]] = [set() for _ in problem.nodes]
    kept = []
    for e in problem.edges:
        n_u, n_v = len(e.cost), len(e.cost[0]) if e.cost else 0
        if e.u == e.v:
            for a in range(len(costs[e.u])):
                c = e.cost[e.u_class[a]][e.v_class[a]]
                banned[e.u].add(a) if c is None else costs[e.u].__setitem__(a, costs[e.u][a] + c)
        elif n_u == 1:
            for b in range(len(costs[e.v])):
                c = e.cost[0][e.v_class[b]]
                banned[e.v].add(b) if c is None else costs[e.v].__setitem__(b, costs[e.v][b] + c)
        elif n_v == 1:
            for a in range(len(costs[e.u])):
                c = e.cost[e.u_class[a]][0]
                banned[e.u].add(a) if c is None else costs[e.u].__setitem__(a, costs[e.u][a] + c)
        elif all(c == 0 for row in e.cost for c in row):
            continue
        else:
            kept.append(e)
    nodes = []
    for v, n in enumerate(problem.nodes):
        if banned[v]:
            cls = tuple(0 if a in banned[v] else 1 for a in range(len(n.cost)))
            kept.append(IlpEdge(v, v, cls, (0,) * len(n.cost), ((None,), (0,))))
        nodes.append(IlpNode(n.name, tuple(costs[v]), n.memory))
    return IlpProblem(tuple(nodes), tuple(kept), problem.memory_limit, problem.flags,
                      problem.conflicts)


# -- backends ----------------------------------------------------------------------------------

class _CpSat:
    def __init__(self):
        from ortools.sat.python import cp_model
        self.cp = cp_model
        self.m = cp_model.CpModel()
        self.solver = None

    def bool_var(self, name):
        return self.m.new_bool_var(name)

    edge_var = bool_var

    def add_eq(self, terms, rhs):
        self.m.add(sum(c * v for c, v in terms) == rhs)

    def add_le(self, terms, rhs):
        self.m.add(sum(c * v for c, v in terms) <= rhs)

    def minimize(self, terms):
        self.m.minimize(sum(c * v for c, v in terms))

    def hint(self, var, value):
        self.m.add_hint(var, value)

    def solve(self, time_limit_s):
        s = self.cp.CpSolver()
        s.parameters.max_time_in_seconds = float(time_limit_s)
        s.parameters.num_workers = 1  # deterministic: the same plan file for the same inputs
        s.parameters.linearization_level = 2  # the LP relaxation is nearly tight: use it fully
        status = s.solve(self.m)
        self.solver = s
        det = round(s.deterministic_time, 6)
        if status == self.cp.OPTIMAL:
            return "optimal", s.objective_value, s.best_objective_bound, det
        if status == self.cp.FEASIBLE:
            return "feasible", s.objective_value, s.best_objective_bound, det
        return "infeasible", 0, 0, det

    def value(self, var):
        return self.solver.boolean_value(var)


class _Mip:
    def __init__(self, backend: str):
        from ortools.linear_solver import pywraplp
        self.lp = pywraplp
        self.s = pywraplp.Solver.CreateSolver(backend.upper())
        self._hints: list = []
        self.backend = backend
        if self.s is None:
            raise PlanningError(f"MIP backend {backend!r} is not available in this OR-Tools; "
                                "use cp-sat, scip, cbc or highs")

    def bool_var(self, name):
        return self.s.IntVar(0, 1, name)

    def edge_var(self, name):
        return self.s.NumVar(0, 1, name)  # integral at every vertex (transportation polytope)

    # coefficients set one by one: pywraplp's expression API builds a Python object per
    # term, most of the model's build time on large stages
    def add_eq(self, terms, rhs):
        self._constraint(terms, rhs, rhs)

    def add_le(self, terms, rhs):
        self._constraint(terms, -self.s.infinity(), rhs)

    def _constraint(self, terms, lo, hi):
        ct = self.s.Constraint(float(lo), float(hi))
        for v, c in _summed(terms):
            ct.SetCoefficient(v, c)

    def minimize(self, terms):
        objective = self.s.Objective()
        for v, c in _summed(terms):
            objective.SetCoefficient(v, c)
        objective.SetMinimization()

    def hint(self, var, value):
        self._hints.append((var, value))  # pywraplp takes all hinted values at once

    def solve(self, time_limit_s):
        if self._hints and self.backend != "highs":  # pywraplp's HiGHS hint segfaults (9.15)
            self.s.SetHint([v for v, _ in self._hints], [float(x) for _, x in self._hints])
        self.s.SetTimeLimit(int(time_limit_s * 1000))
        status = self.s.Solve()
        if status == self.lp.Solver.OPTIMAL:
            return "optimal", self.s.Objective().Value(), self.s.Objective().BestBound(), 0.0
        if status == self.lp.Solver.FEASIBLE:
            return "feasible", self.s.Objective().Value(), self.s.Objective().BestBound(), 0.0
        return "infeasible", 0, 0, 0.0

    def value(self, var):
        return var.solution_value()


def _summed(terms) -> list:
    """(variable, coefficient) with repeated variables' coefficients added (keyed by the
    solver's index: pywraplp variables overload ``==``)."""
    coef: dict = {}
    for c, v in terms:
        i = v.index()
        coef[i] = (v, coef[i][1] + c) if i in coef else (v, c)
    return [(v, float(c)) for v, c in coef.values()]
