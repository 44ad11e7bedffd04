"""The sweep: every uniform hybrid configuration of a model on a mesh, priced, as a table.

trace -> cost -> **sweep** -> read. One trace; then for every Megatron-style configuration
(dp x tp x pp devices, microbatch size, schedule, virtual stages, recompute, sequence
parallelism, ZeRO stage) the predicted step time, memory per device and whether it fits,
as a pandas DataFrame (written as Parquet), with the Pareto front of time against memory
and the automatic plan marked.

The space (``configurations``): dp*tp*pp = devices; tp divides the attention heads and the
devices of a node (tensor parallelism across nodes is never competitive, Narayanan et al.
2021 section 3.3); pp <= layers; microbatch sizes divide the per-replica batch; schedules
gpipe, 1f1b and interleaved-1f1b (with every virtual-stage count that divides the layers
per stage) when pp > 1, one schedule when pp = 1; recompute none, selective, full;
sequence parallelism on or off when tp > 1; ZeRO 0-3 when dp > 1.

Speed: placements depend only on (dp, tp, pp, sequence parallelism, ZeRO-3); the other
choices change the training config and the stages' recompute/ZeRO fields. So one
``manual_plan`` is built per placement key and every other configuration is that plan with
those fields replaced, priced by ``meshplan.estimate`` (the same function manual_plan uses,
tested to agree).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace

from meshplan import support
from meshplan.api import autoparallel, default_dtype, estimate, manual_plan
from meshplan.costmodel.estimate import estimate_plan
from meshplan.errors import MeshplanError, NotSupportedError, SpecError
from meshplan.plan import Plan
from meshplan.planner.manual import attention_heads
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for
from meshplan.tracing import trace
from meshplan.vocabulary import RECOMPUTE, ComputeDtype

SHOW_PROGRESS_AFTER_S = 2.0  # a progress bar only for sweeps a person waits on
PLOT_FORMATS = (".png", ".svg", ".pdf")


@dataclass(frozen=True, slots=True)
class Config:
    dp: int
    tp: int
    pp: int
    microbatch_size: int
    schedule: str
    virtual_stages: int
    recompute: str
    sequence_parallel: bool
    zero: int

    @property
    def placement_key(self) -> tuple:
        """What the operator placements depend on; the rest is the training config."""
        return (self.dp, self.tp, self.pp, self.sequence_parallel, self.zero == 3)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(*, devices: int, devices_per_node: int, batch: int, layers: int,
                   heads: int, schedules=SCHEDULES,
                   recompute=RECOMPUTE, zeros=(0, 1, 2, 3),
                   dtype: str = ComputeDtype.FP32) -> list[Config]:
    """The space of the module docstring, less what the runtime cannot run
    (meshplan/support.py)."""
    out = []
    for tp in divisors(devices):
        if tp > devices_per_node or devices_per_node % tp or (heads and heads % tp):
            continue
        for pp in divisors(devices // tp):
            if pp > max(layers, 1):
                continue
            dp = devices // (tp * pp)
            if batch % dp:
                continue
            for mb in divisors(batch // dp):
                for sched, vs in _schedules(pp, layers, schedules):
                    for rc in recompute:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for z in (zeros if dp > 1 else (0,)):
                                if not _runs(pp, dp, mb, sched, vs, z, batch, dtype, layers):
                                    continue
                                out.append(Config(dp, tp, pp, mb, sched, vs, rc, sp, z))
    return out


def _runs(pp, dp, mb, schedule, virtual, zero, batch, dtype, layers) -> bool:
    """Whether the runtime runs this shape (meshplan/support.py)."""
    return not support.candidate_problems(support.Candidate(
        pp=pp, dp=dp, schedule=schedule, virtual_stages=virtual,
        microbatches=batch // (dp * mb), global_batch=batch, microbatch_size=mb, zero=zero,
        dtype=dtype, num_layers=layers))


def _schedules(pp: int, layers: int, schedules) -> list[tuple[str, int]]:
    if pp == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    out = [(s, 1) for s in schedules if s != Schedule.INTERLEAVED]
    if Schedule.INTERLEAVED in schedules and layers % pp == 0:
        out += [(Schedule.INTERLEAVED, v) for v in divisors(layers // pp) if v > 1]
    return out


def variant(base: Plan, c: Config) -> Plan:
    """``base`` (built for ``c.placement_key``) with the rest of ``c`` written in; ``c`` is a
    Config or any layout with its fields (meshplan/stacks/search.py's StackLayout)."""
    t = base.training
    training = replace(t, microbatch_size=c.microbatch_size,
                       microbatches=t.global_batch // (c.dp * c.microbatch_size),
                       schedule=c.schedule,
                       virtual_stages=virtual_stages_for(c.schedule, c.virtual_stages))
    stages = tuple(replace(st, recompute=c.recompute, zero=c.zero) for st in base.stages)
    return replace(base, training=training, stages=stages)


def run_sweep(model, mesh, example_inputs=(), *, graph=None, model_name: str = "",
              dtype: str | None = None, optimizer: str = "adam", output: str = "",
              plot: str = "", auto: bool = True, time_limit_s: float = 30.0,
              progress: bool = False, configs: list[Config] | None = None, workers: int = 0,
              model_spec: str = ""):
    """Price every configuration; returns a DataFrame (one row per configuration, plus one
    row ``kind == "auto"`` for the automatic plan) and writes it when ``output`` is given.

    ``workers`` processes (0: one per available core) price groups of configurations that
    share their placements; they receive the traced graph, so it is not rebuilt.
    ``model_spec`` (a ``file.py:factory`` spec the model was built from) makes each worker
    rebuild the model from it: a class defined in a user file cannot be pickled by name."""
    import pandas as pd

    if plot and not str(plot).lower().endswith(PLOT_FORMATS):
        raise SpecError(f"--plot {plot}: the picture is written as {', '.join(PLOT_FORMATS)}; "
                        "name the file with one of these suffixes")
    dtype = dtype or default_dtype(mesh)
    if graph is None:
        graph = trace(model, example_inputs, model_name=model_name or type(model).__name__)
    batch = graph.inputs[0][1].shape[0]
    if configs is None:
        configs = configurations(devices=mesh.num_devices, devices_per_node=mesh.devices_per_node,
                                 batch=batch, layers=graph.num_layers,
                                 heads=attention_heads(graph), dtype=dtype)
    groups: dict[tuple, list[Config]] = {}
    for c in configs:
        groups.setdefault(c.placement_key, []).append(c)
    jobs = sorted(groups.values(), key=len, reverse=True)
    job = dict(model=model, mesh=mesh, graph=graph, dtype=dtype, optimizer=optimizer)
    rows: list[dict] = []
    with _Progress(len(configs), enabled=progress) as bar:
        for chunk in _map(price_group, jobs, job, workers, rebuild=model_spec):
            rows += chunk
            bar.advance(len(chunk))
    order = {c: i for i, c in enumerate(configs)}
    rows.sort(key=lambda r: order[Config(**{k: r[k] for k in Config.__slots__})])
    frame = pd.DataFrame(rows)
    frame["kind"] = "uniform"
    frame["is_auto"] = False
    if auto:
        frame = _mark_auto(frame, model, mesh, graph, dtype, optimizer, time_limit_s)
    frame = _with_pareto(_ensure_columns(frame))
    for col in ("dp", "tp", "pp", "microbatch_size", "microbatches", "virtual_stages", "zero"):
        frame[col] = frame[col].astype("Int64")  # the automatic plan may have no dp/tp
    if output:
        _write_parquet(frame, output)
    if plot:
        plot_pareto(frame, plot, title=f"{graph.model_name} on {mesh.name}")
    return frame


def price_group(configs: list[Config], *, model, mesh, graph, dtype, optimizer) -> list[dict]:
    """Rows for configurations sharing one placement key: one manual_plan, then estimates."""
    c0 = configs[0]
    batch = graph.inputs[0][1].shape[0]
    try:
        base = manual_plan(model, mesh, graph=graph, dp=c0.dp, tp=c0.tp, pp=c0.pp,
                           microbatch_size=1, schedule=Schedule.GPIPE,  # variant() sets it
                           sequence_parallel=c0.sequence_parallel,
                           zero=3 if c0.zero == 3 else 0, dtype=dtype,
                           optimizer=optimizer)
    except MeshplanError as exc:
        base = str(exc)
    rows = []
    cache: dict = {}  # operator walks shared by the configurations of this placement group
    hw = mesh.hardware  # one profile object: the cache keys on it
    if not isinstance(base, str):
        base.check_model(graph.fingerprint)
    for c in configs:
        row = {**asdict(c), "microbatches": batch // (c.dp * c.microbatch_size)}
        if isinstance(base, str):
            rows.append({**row, "error": base})
            continue
        try:
            est = estimate_plan(variant(base, c), graph, hw=hw, cache=cache)
            rows.append({**row, **_estimate_columns(est), "error": ""})
        except MeshplanError as exc:
            rows.append({**row, "error": str(exc)})
    return rows


_JOB: dict = {}  # a worker's shared arguments (the model, mesh and graph), set once


def _init_worker(job: dict, rebuild: str = "") -> None:
    if rebuild:
        from meshplan.specs import parse_model_spec
        job = {**job, "model": parse_model_spec(rebuild).build("meta")}
    _JOB.update(job)


def _run_job(configs):
    return price_group(configs, **_JOB)


def _map(fn, jobs, job: dict, workers: int, rebuild: str = ""):
    """``price_group(jobs[i], **job)`` for every job, in 1 process or in worker processes
    (results as they finish). Workers start from a fork server, not by forking this process:
    a process that has imported pandas holds other threads (pyarrow's jemalloc background
    thread among them), and a child forked from it can deadlock on a lock one of them held;
    a sweep test hung that way. Each worker receives ``job`` (a meta model and the traced
    graph, tens of KB pickled) once. As with any start method but fork, a script that calls
    this with workers needs the ``if __name__ == "__main__":`` guard."""
    import multiprocessing
    import os

    workers = workers or len(os.sched_getaffinity(0))
    workers = min(workers, len(jobs))
    if workers <= 1 or "forkserver" not in multiprocessing.get_all_start_methods():
        for j in jobs:
            yield fn(j, **job)
        return
    from meshplan.runtime.shared import meta_copy

    # the workers need shapes only: send a meta copy, not a caller's real weights
    job = {**job, "model": None if rebuild else meta_copy(job["model"])}
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["meshplan.sweep"])  # imported once, in the server
    with ctx.Pool(workers, initializer=_init_worker, initargs=(job, rebuild)) as pool:
        yield from pool.imap_unordered(_run_job, jobs)


def _estimate_columns(est) -> dict:
    out = {"step_time_s": est.step_time_s, "tokens_per_s": est.tokens_per_s, "mfu": est.mfu,
           "peak_memory_gib": est.peak_memory_gib, "memory_capacity_gib": est.memory_capacity_gib,
           "fits": bool(est.fits), "bubble_fraction": est.bubble_fraction,
           "overflow": est.overflow}
    for k, v in est.breakdown.items():
        out[f"time_{k}_s"] = v
    return out


def _ensure_columns(frame):
    for col, default in (("step_time_s", math.nan), ("peak_memory_gib", math.nan),
                         ("fits", False), ("error", ""), ("overflow", "")):
        if col not in frame:
            frame[col] = default
    frame["fits"] = frame["fits"].fillna(False).astype(bool)
    frame["error"] = frame["error"].fillna("")
    frame["overflow"] = frame["overflow"].fillna("")
    return frame


def _mark_auto(frame, model, mesh, graph, dtype, optimizer, time_limit_s):
    import pandas as pd

    try:
        plan = autoparallel(model, mesh, graph=graph, dtype=dtype, optimizer=optimizer,
                            time_limit_s=time_limit_s)
    except MeshplanError as exc:  # e.g. nothing fits: say so in the data set
        return pd.concat([frame, pd.DataFrame([{"kind": "auto", "is_auto": True,
                                                "error": str(exc)}])], ignore_index=True)
    # price it with the same cost model as every other row (the solver's own objective is
    # kept in its own column)
    est, t = estimate(plan, graph), plan.training
    same = ((frame["pp"] == plan.num_stages) & (frame["microbatches"] == t.microbatches)
            & (frame["schedule"] == t.schedule)
            & (frame["step_time_s"] - est.step_time_s).abs().le(1e-9 * est.step_time_s)
            & (frame["peak_memory_gib"] - est.peak_memory_gib).abs().le(
                1e-9 * max(est.peak_memory_gib, 1e-12)))
    frame.loc[same, "is_auto"] = True
    row = {"kind": "auto", "is_auto": True, "pp": plan.num_stages,
           "microbatches": t.microbatches, "microbatch_size": t.microbatch_size,
           "schedule": t.schedule, "virtual_stages": t.virtual_stages,
           "sequence_parallel": t.sequence_parallel,
           "recompute": ",".join(sorted({st.recompute for st in plan.stages})),
           "zero": max(st.zero for st in plan.stages), "error": "",
           "solver": f"{plan.solver.name}: {plan.solver.status}",
           "solver_objective_s": plan.solver.objective_s, **_estimate_columns(est)}
    return pd.concat([frame, pd.DataFrame([row])], ignore_index=True)


def pareto_mask(times, mems) -> list[bool]:
    """True where no other point is at least as fast and as small, and strictly one of them."""
    order = sorted(range(len(times)), key=lambda i: (times[i], mems[i]))
    best = math.inf
    keep = [False] * len(times)
    for i in order:
        if mems[i] < best:
            keep[i] = True
            best = mems[i]
    return keep


def _with_pareto(frame):
    ok = frame["fits"] & frame["step_time_s"].notna()
    frame["pareto"] = False
    if ok.any():
        sub = frame[ok]
        mask = pareto_mask(list(sub["step_time_s"]), list(sub["peak_memory_gib"]))
        frame.loc[sub.index[mask], "pareto"] = True
    return frame


def _write_parquet(frame, path) -> None:
    import os
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".sweep.", suffix=".parquet", dir=directory)
    os.close(fd)
    try:
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def plot_pareto(frame, path, title: str = "") -> None:
    """Step time against peak memory per device; the Pareto front of fitting configurations
    as a line, configurations that do not fit in grey, the automatic plan as a star."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priced = frame[frame["step_time_s"].notna()]
    if priced.empty:
        raise NotSupportedError("no configuration could be priced; nothing to plot")
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=110)
    uni = priced[priced["kind"] == "uniform"]
    bad, good = uni[~uni["fits"]], uni[uni["fits"]]
    ax.scatter(bad["peak_memory_gib"], bad["step_time_s"], s=6, c="#BBBBBB", label="does not fit")
    ax.scatter(good["peak_memory_gib"], good["step_time_s"], s=8, c="#0072B2", label="fits")
    front = priced[priced["pareto"]].sort_values("peak_memory_gib")
    ax.plot(front["peak_memory_gib"], front["step_time_s"], "-o", c="#D55E00", ms=4,
            label="Pareto front")
    auto = priced[priced["kind"] == "auto"]
    if not auto.empty:
        ax.scatter(auto["peak_memory_gib"], auto["step_time_s"], marker="*", s=180,
                   c="#E69F00", edgecolors="black", zorder=5, label="automatic plan")
    cap = priced["memory_capacity_gib"].dropna()
    if not cap.empty:
        ax.axvline(cap.iloc[0], ls="--", c="#D55E00", lw=1, label="device memory")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    title = title or "configurations"
    ax.set_title(title if len(title) <= 70 else title[:67] + "...", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class _Progress:
    """A rich progress bar that appears only once the sweep has taken a couple of seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.start = time.perf_counter()
        self.bar = None

    def __enter__(self):
        return self

    def advance(self, n: int = 1):
        self.done += n
        if not self.enabled:
            return
        if self.bar is None and time.perf_counter() - self.start > SHOW_PROGRESS_AFTER_S:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                                TimeRemainingColumn(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("sweep", total=self.total, completed=self.done)
        elif self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        return False
