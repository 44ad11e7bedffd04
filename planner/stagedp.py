"""The stage dynamic program of planner/inter: cost tables over unit ranges and the bounded
shortest path that cuts the units into stages.

trace -> cost -> solve (planner/intra per stage, planner/inter -> **stagedp**) -> run.

A range of units ``[j, k)`` is priced once per *class*: ranges whose unit keys agree (and
that agree on being the last stage, which sends nothing onward) cost the same, so a model of
96 identical blocks has about 3 x 96 classes instead of 4,656 ranges. Tables hold, per stage
option ``o`` and class ``c``: time ``t`` (with the send/recv to the next stage), tail ``u``,
weights ``w``, held activations ``a`` and transient ``r``. An *additive* cost function
(``unit_cost(i, ..., leading=)`` attribute: a range costs its first unit as a stage of its
own plus each further unit's marginal cost after its predecessor) fills a table with prefix
sums; any other cost function is called once per class.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

INF = float("inf")


class RangeClasses:
    """Class id of every unit range ``[j, k)`` and one representative range per class."""

    def __init__(self, unit_keys: Sequence[str]):
        k_units = len(unit_keys)
        self.num_units = k_units
        ids: dict[tuple, int] = {}
        reps: list[tuple[int, int]] = []
        cls = np.full((k_units + 1, k_units + 1), -1, dtype=np.int64)
        keys = tuple(unit_keys)
        for j in range(k_units):
            for k in range(j + 1, k_units + 1):
                key = (keys[j:k], j == 0, k == k_units)
                c = ids.get(key)
                if c is None:
                    c = ids[key] = len(reps)
                    reps.append((j, k))
                cls[j, k] = c
        self.num_classes = len(reps)
        self.rep_first = np.array([r[0] for r in reps], dtype=np.int64)
        self.rep_last = np.array([r[1] for r in reps], dtype=np.int64)
        self.is_last = self.rep_last == k_units
        self.is_first = self.rep_first == 0
        # invalid ranges point at an extra column that is always infinite
        self.index = np.where(cls >= 0, cls, self.num_classes)


class Tables:
    """Per-option, per-class costs for one (group size, microbatch count)."""

    def __init__(self, classes: RangeClasses, options, costs: np.ndarray, stage_costs: list):
        self.classes = classes
        self.options = options
        self.t, self.u, self.w, self.a, self.r = costs  # each (options, classes)
        self.stage_costs = stage_costs  # stage_costs[o][c] -> StageCost or None (lazy)
        self._fit_cache: dict[tuple[float, float], np.ndarray] = {}

    def fits(self, in_flight: float, limit_gib: float) -> np.ndarray:
        key = (in_flight, limit_gib)
        if key not in self._fit_cache:
            with np.errstate(invalid="ignore"):  # 0 x inf: an impossible option, never fits
                self._fit_cache[key] = self.w + in_flight * self.a + self.r <= limit_gib
        return self._fit_cache[key]

    def best(self, in_flight: float, limit_gib: float, t_max: float, u_max: float):
        """Cheapest option per class within the bounds; (time per class + INF column, option)."""
        best, arg = self.best_many(((in_flight, limit_gib),), t_max, u_max)
        return best[0], arg[0]

    def best_many(self, positions: tuple, t_max: float, u_max: float, field: str = "t"):
        """``best`` for several (in-flight, limit) positions at once: (positions x classes+1
        values, positions x classes options). One vectorised pass instead of one per stage:
        the bounded search runs thousands of cuts. ``field`` "u": the smallest tail instead
        of the smallest time."""
        fits = self._fits_stack(positions)
        t = self.t if field == "t" else self.u
        if t_max < INF or u_max < INF:
            t = np.where((self.t <= t_max) & (self.u <= u_max), t, INF)
        masked = np.where(fits, t[None], INF)
        arg = masked.argmin(axis=1)
        best = np.take_along_axis(masked, arg[:, None, :], axis=1)[:, 0, :]
        return np.concatenate([best, np.full((len(positions), 1), INF)], axis=1), arg

    def _fits_stack(self, positions: tuple) -> np.ndarray:
        key = ("stack", positions)
        if key not in self._fit_cache:
            self._fit_cache[key] = np.stack([self.fits(m, limit) for m, limit in positions])
        return self._fit_cache[key]


def p2p_hops(first: bool, last: bool) -> float:
    """Send/recv a stage pays per microbatch, in units of one transfer of what it receives:
    the cost model's convention (costmodel/estimate.py): the first stage receives nothing,
    the last receives activations and sends their gradients back (1), the others also
    forward their own output and receive its gradient (2)."""
    return 0.0 if first else (1.0 if last else 2.0)


def build_tables(classes: RangeClasses, problem, options, microbatches: int, hops: float,
                 cache: dict, *, need_memory: bool = True,
                 stage_blocks: int | None = None) -> Tables:
    """Price every class under every option (``cache`` keeps cost-function answers).
    With ``stage_blocks``, ranges of another block count are impossible: the runtime cuts an
    interleaved plan's blocks into pp x v equal chunks whatever its stage records say
    (meshplan/support.py, ``interleaved_split_rule``), so each rank group holds that many."""
    n_opt, n_cls = len(options), classes.num_classes
    arrays = np.full((5, n_opt, n_cls), INF)  # t, u, w, a, r
    stage_costs: list = [None] * n_opt
    unit_cost = getattr(problem.cost_fn, "unit_cost", None)
    # a cost function that can price any range in full (``range_cost``) does so for models
    # of few units: exact tables, at the price of one probe per range class
    exact = getattr(problem.cost_fn, "range_cost", None) is not None and \
        classes.num_units <= getattr(problem.cost_fn, "exact_units", 0)
    # send/recv between stages (x v chunks under the interleaved schedule)
    factor = np.array([hops * p2p_hops(bool(f), bool(l))
                       for f, l in zip(classes.is_first, classes.is_last)])
    for o, opt in enumerate(options):
        mbs = problem.global_batch // (microbatches * opt.mesh_shape[0])
        row = _range_row if exact else _additive_row if unit_cost is not None else _generic_row
        stage_costs[o], recv = row(arrays[:, o], classes, problem, opt, mbs, cache, need_memory)
        arrays[0, o] += factor * np.where(np.isfinite(recv), recv, 0.0)
    if stage_blocks is not None:
        first = np.array([problem.unit_layers[j][0] for j in classes.rep_first])
        last = np.array([problem.unit_layers[k - 1][1] for k in classes.rep_last])
        arrays[0][:, (last - first) != stage_blocks] = INF
    return Tables(classes, options, arrays, stage_costs)


def _generic_row(row, classes, problem, opt, mbs, cache, need_memory=True):
    """Call the cost function once per class; returns (StageCosts, receive times)."""
    costs, recv = [], np.zeros(classes.num_classes)
    for c in range(classes.num_classes):
        j, k = int(classes.rep_first[c]), int(classes.rep_last[c])
        layers = (problem.unit_layers[j][0], problem.unit_layers[k - 1][1])
        key = (problem.unit_keys[j:k], j == 0, k == classes.num_units, opt, mbs)
        if key not in cache:
            cache[key] = problem.cost_fn(layers, opt.mesh_shape, mbs, opt.recompute, opt.zero)
        sc = cache[key]
        costs.append(sc)
        if sc is None:
            continue
        row[:, c] = (sc.time_s, sc.step_s, sc.weights_gib, sc.activation_gib, sc.transient_gib)
        recv[c] = sc.recv_s
    return costs, recv


def _range_row(row, classes, problem, opt, mbs, cache, need_memory=True):
    """Every class priced in full by ``cost_fn.range_cost(first, last, option, mbs)``."""
    recv = np.zeros(classes.num_classes)
    for c in range(classes.num_classes):
        j, k = int(classes.rep_first[c]), int(classes.rep_last[c])
        key = ("range", problem.unit_keys[j:k], j == 0, k == classes.num_units, opt, mbs,
               need_memory)
        if key not in cache:
            cache[key] = problem.cost_fn.range_cost(j, k, opt, mbs, need_memory=need_memory)
        sc = cache[key]
        if sc is None:
            continue
        row[:, c] = (sc.time_s, sc.step_s, sc.weights_gib, sc.activation_gib, sc.transient_gib)
        recv[c] = sc.recv_s
    return [None] * classes.num_classes, recv


def _additive_row(row, classes, problem, opt, mbs, cache, need_memory=True):
    """Range cost = its first unit's cost as a stage of its own plus the marginal cost of
    each further unit (prefix sums); returns (None per class, received bytes)."""
    n = classes.num_units
    unit_cost = problem.cost_fn.unit_cost
    lead = np.full((6, n), INF)
    marginal = np.zeros((6, n))
    # units of equal keys share one answer: one call per distinct key (a few for a model of
    # identical blocks), written to all their columns at once
    for leading, table in ((True, lead), (False, marginal)):
        for keys, (first, columns) in _unit_groups(problem.unit_keys, leading, cache).items():
            key = ("unit", keys, leading, opt, mbs)
            if key not in cache:
                cache[key] = unit_cost(first, opt, mbs, leading=leading,
                                       need_memory=need_memory)
            sc = cache[key]
            table[:, columns] = INF if sc is None else np.array(
                (sc.time_s, sc.step_s, sc.weights_gib, sc.activation_gib, sc.recv_s,
                 sc.transient_gib))[:, None]
    bad = ~np.isfinite(marginal[0])
    prefix = np.concatenate([np.zeros((6, 1)), np.cumsum(np.where(bad, 0.0, marginal), axis=1)],
                            axis=1)
    bad_prefix = np.concatenate([[0], np.cumsum(bad)])
    j, k = classes.rep_first, classes.rep_last
    sums = lead[:, j] + prefix[:, k] - prefix[:, j + 1]
    sums = np.where((bad_prefix[k] - bad_prefix[j + 1] > 0) | ~np.isfinite(lead[0, j]), INF, sums)
    row[:4] = sums[:4]
    row[4] = sums[5]
    return [None] * classes.num_classes, lead[4, j]


def _unit_groups(unit_keys: tuple, leading: bool, cache: dict) -> dict:
    """{unit keys of a leading unit (one key) or of a unit after its predecessor (two):
    (first such unit, all such units)}, in unit order; kept in ``cache``."""
    key = ("unit groups", unit_keys, leading)
    if key not in cache:
        groups: dict = {}
        for i in range(0 if leading else 1, len(unit_keys)):
            keys = unit_keys[i - (not leading):i + 1]
            groups.setdefault(keys, (i, []))[1].append(i)
        cache[key] = {k: (first, np.array(cols)) for k, (first, cols) in groups.items()}
    return cache[key]


def cut(tables_by_position: Sequence[tuple[Tables, float, float]], t_max: float,
        u_max: float):
    """The bounded shortest path: F[s][k] = min_j F[s-1][j] + c_s(j, k).

    ``tables_by_position[s]`` = (tables, in-flight microbatches, memory limit) of stage s.
    Returns (minimum summed time, [(j, k, option index) per stage]) or (INF, None).
    """
    first = tables_by_position[0][0]
    n = first.classes.num_units
    picked = _picked(tables_by_position, t_max, u_max, "t")
    f = np.full(n + 1, INF)
    f[0] = 0.0
    cols = np.arange(n + 1)
    trace = []
    for tables, m, limit in tables_by_position:
        costs, arg = picked[(id(tables), (m, limit))]
        cand = f[:, None] + costs
        j = cand.argmin(axis=0)
        f = cand[j, cols]
        trace.append((j, arg, tables))
    if not np.isfinite(f[n]):
        return INF, None
    stages, k = [], n
    for j, arg, tables in reversed(trace):
        jj = int(j[k])
        stages.append((jj, k, int(arg[tables.classes.index[jj, k]])))
        k = jj
    return float(f[n]), stages[::-1]


def _picked(tables_by_position, t_max: float, u_max: float, field: str) -> dict:
    """Every position's cheapest option per unit range (``field`` "t" or "u"), one
    vectorised pass per distinct table: (id(tables), (in-flight, limit)) -> (values indexed
    [j, k], option per class)."""
    index = tables_by_position[0][0].classes.index
    rows: dict = {}
    for tables, m, limit in tables_by_position:
        rows.setdefault(id(tables), (tables, {}))[1].setdefault((m, limit), None)
    picked = {}
    for tid, (tables, keys) in rows.items():
        positions = tuple(keys)
        best, arg = tables.best_many(positions, t_max, u_max, field)
        by_range = best[:, index]  # positions x (n + 1) x (n + 1)
        for r, key in enumerate(positions):
            picked[(tid, key)] = (by_range[r], arg[r])
    return picked


def bottleneck(tables_by_position: Sequence[tuple[Tables, float, float]], field: str,
               t_max: float = INF, u_max: float = INF) -> float:
    """The smallest achievable largest stage ``field`` ("t": time, "u": tail) over every
    cut that fits memory within the bounds (a min-max path: G[s][k] = min_j max(G[s-1][j],
    c_s(j, k))); INF when no cut fits. A bound ``x`` on that field admits a cut exactly
    when ``x`` >= this value, which replaces a binary search of ``cut`` calls."""
    n = tables_by_position[0][0].classes.num_units
    picked = _picked(tables_by_position, t_max, u_max, field)
    g = np.full(n + 1, INF)
    g[0] = -INF
    cols = np.arange(n + 1)
    for tables, m, limit in tables_by_position:
        costs, _ = picked[(id(tables), (m, limit))]
        cand = np.maximum(g[:, None], costs)
        g = cand[cand.argmin(axis=0), cols]
    return float(g[n])


def bound_candidates(values: np.ndarray, eps: float) -> list[float]:
    """Sorted distinct finite values; with eps > 0 keep one per factor (1 + eps)."""
    vals = np.unique(values[np.isfinite(values)])
    if eps <= 0 or len(vals) == 0:
        return vals.tolist()
    out = [float(vals[0])]
    for v in vals[1:]:
        if v > out[-1] * (1 + eps):
            out.append(float(v))
    if out[-1] != vals[-1]:
        out.append(float(vals[-1]))
    return out
