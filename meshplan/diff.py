"""Comparing two plans: what differs and what each difference costs in time and memory.

trace -> cost -> solve -> plan -> **read**. Pure functions of two Plans. Differences come
in three kinds, each priced from the plans' own predictions:

- training-wide (microbatches, schedule, dtype, ...): priced by the change of the step's
  time breakdown they move (schedule and microbatches move the bubble; the rest the step);
- per stage, stages paired by index when both plans have as many (devices, layers,
  recompute, ZeRO, placements in words): priced by the stage's change of compute and
  communication per microbatch and of memory per device, which the differences of one
  stage share;
- the totals (step time, throughput, MFU, peak memory, fits).

Nothing is re-estimated here, so a diff of two plan files needs no model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from meshplan.inspect import OUTSIDE, fmt_mem, fmt_range, fmt_time, stage_layer_words
from meshplan.plan import Plan, Stage

# Which breakdown entry a training-wide difference moves (others move the whole step).
MOVES = {"microbatches": "bubble", "microbatch_size": "bubble", "schedule": "bubble",
         "virtual_stages": "bubble"}


@dataclass(frozen=True, slots=True)
class Difference:
    where: str  # "model", "mesh", "training", "stage 2", "total"
    what: str
    a: str
    b: str
    time_s: float | None = None  # b - a, predicted; None where not attributable
    memory_gib: float | None = None  # b - a, per device
    shared: bool = False  # the cost is that of the whole stage, shared with its other rows


@dataclass(frozen=True, slots=True)
class PlanDiff:
    differences: tuple[Difference, ...]
    step_time_s: tuple[float, float]
    peak_memory_gib: tuple[float, float]

    @property
    def identical(self) -> bool:
        return not any(d.where != "total" for d in self.differences)


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    out: list[Difference] = []
    if a.model.fingerprint != b.model.fingerprint:
        out.append(Difference("model", "model", f"{a.model.name} ({a.model.fingerprint[:15]})",
                              f"{b.model.name} ({b.model.fingerprint[:15]})"))
    if a.mesh.shape != b.mesh.shape or a.mesh.name != b.mesh.name:
        out.append(Difference("mesh", "mesh", f"{a.mesh.name} {list(a.mesh.shape)}",
                              f"{b.mesh.name} {list(b.mesh.shape)}"))
    out += _training(a, b)
    out += _stages(a, b)
    pa, pb = a.predicted, b.predicted
    keys = list(dict.fromkeys([*pa.breakdown, *pb.breakdown]))
    for k in keys:
        va, vb = pa.breakdown.get(k, 0.0), pb.breakdown.get(k, 0.0)
        if abs(va - vb) > 1e-12:
            out.append(Difference("total", f"{k} time", fmt_time(va), fmt_time(vb), vb - va))
    out.append(Difference("total", "step time", fmt_time(pa.step_time_s), fmt_time(pb.step_time_s),
                          pb.step_time_s - pa.step_time_s))
    out.append(Difference("total", "tokens/s", f"{pa.tokens_per_s:,.0f}", f"{pb.tokens_per_s:,.0f}"))
    out.append(Difference("total", "MFU", f"{pa.mfu:.1%}", f"{pb.mfu:.1%}"))
    out.append(Difference("total", "peak memory / device", fmt_mem(pa.peak_memory_gib),
                          fmt_mem(pb.peak_memory_gib), None,
                          pb.peak_memory_gib - pa.peak_memory_gib))
    if pa.fits != pb.fits:
        out.append(Difference("total", "fits", str(pa.fits), str(pb.fits)))
    return PlanDiff(tuple(out), (pa.step_time_s, pb.step_time_s),
                    (pa.peak_memory_gib, pb.peak_memory_gib))


def _training(a: Plan, b: Plan) -> list[Difference]:
    out = []
    for f in fields(a.training):
        va, vb = getattr(a.training, f.name), getattr(b.training, f.name)
        if va == vb:
            continue
        part = MOVES.get(f.name)
        if part:
            t = b.predicted.breakdown.get(part, 0.0) - a.predicted.breakdown.get(part, 0.0)
        else:
            t = b.predicted.step_time_s - a.predicted.step_time_s
        out.append(Difference("training", f.name.replace("_", " "), str(va), str(vb), t, None,
                              shared=True))
    return out


def _stages(a: Plan, b: Plan) -> list[Difference]:
    if a.num_stages != b.num_stages:
        ta = ", ".join(_stage_line(s) for s in a.stages)
        tb = ", ".join(_stage_line(s) for s in b.stages)
        mem = b.predicted.peak_memory_gib - a.predicted.peak_memory_gib
        return [Difference("stages", "pipeline stages", f"{a.num_stages}: {ta}",
                           f"{b.num_stages}: {tb}", b.predicted.step_time_s - a.predicted.step_time_s,
                           mem, shared=True)]
    out = []
    for sa, sb in zip(a.stages, b.stages):
        rows = _stage_rows(sa, sb, a.graph, b.graph)
        if not rows:
            continue
        pa, pb = sa.predicted, sb.predicted
        t = (pb.compute_s + pb.comm_s) - (pa.compute_s + pa.comm_s)
        m = pb.memory.total_gib - pa.memory.total_gib
        out += [Difference(f"stage {sa.index}", what, va, vb, t, m, shared=True)
                for what, va, vb in rows]
        for name, va, vb in (("compute", pa.compute_s, pb.compute_s), ("comm", pa.comm_s, pb.comm_s)):
            if abs(va - vb) > 1e-12:
                out.append(Difference(f"stage {sa.index}", f"{name} per microbatch", fmt_time(va),
                                      fmt_time(vb), vb - va))
        for name in ("params_gib", "grads_gib", "optimizer_gib", "activations_gib", "buffers_gib"):
            va, vb = getattr(pa.memory, name), getattr(pb.memory, name)
            if abs(va - vb) > 1e-9:
                out.append(Difference(f"stage {sa.index}", name.removesuffix("_gib") + " memory",
                                      fmt_mem(va), fmt_mem(vb), None, vb - va))
    return out


def _only_changed(x: str, y: str) -> tuple[str, str]:
    """Keep the phrases ("mlp up: column-parallel over axis 1") that differ."""
    px, py = x.split("; "), y.split("; ")
    return ("; ".join(p for p in px if p not in py) or "-",
            "; ".join(p for p in py if p not in px) or "-")


def _stage_line(s: Stage) -> str:
    return f"[{s.layers[0]}, {s.layers[1]}) on {len(s.devices)}"


def _stage_rows(sa: Stage, sb: Stage, ga, gb) -> list[tuple[str, str, str]]:
    rows = []
    for name in ("devices", "mesh_shape", "layers", "recompute", "zero"):
        va, vb = getattr(sa, name), getattr(sb, name)
        if va != vb:
            if name == "devices":
                va, vb = f"{va[0]}-{va[-1]} ({len(va)})", f"{vb[0]}-{vb[-1]} ({len(vb)})"
            rows.append((name.replace("_", " "), str(va), str(vb)))
    wa, wb = stage_layer_words(sa, ga), stage_layer_words(sb, gb)
    groups: list[list] = []  # [first, last, words a, words b]
    for layer in sorted(set(wa) | set(wb)):
        x, y = wa.get(layer, "(not in this stage)"), wb.get(layer, "(not in this stage)")
        if x == y:
            continue
        g = groups[-1] if groups else None
        if g and g[2:] == [x, y] and g[1] == layer - 1 and layer != OUTSIDE and g[0] != OUTSIDE:
            g[1] = layer
        else:
            groups.append([layer, layer, x, y])
    rows += [(f"placements, {fmt_range(f, l)}", *_only_changed(x, y)) for f, l, x, y in groups]
    n_params = sum(1 for k in set(sa.params) | set(sb.params) if sa.params.get(k) != sb.params.get(k))
    n_ops = sum(1 for k in set(sa.ops) | set(sb.ops) if sa.ops.get(k) != sb.ops.get(k))
    if n_params or n_ops:
        rows.append(("placement records", f"{len(sa.params)} params, {len(sa.ops)} ops",
                     f"{n_params} params and {n_ops} ops placed differently"))
    return rows


def diff_text(d: PlanDiff, a: Plan | None = None, b: Plan | None = None, width: int = 120) -> str:
    from rich import box
    from rich.table import Table

    from meshplan.inspect import render

    title = "plan diff (b - a)"
    if a is not None and b is not None:
        title = f"plan diff: a = {a.model.name} on {a.mesh.name}, b = {b.model.name} on {b.mesh.name}"
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
              caption="(shared): the cost of the whole stage or step, which its differences "
                      "share" if any(x.shared for x in d.differences) else None,
              caption_justify="left")
    for col in ("where", "what", "a", "b", "time b-a", "memory b-a"):
        t.add_column(col, overflow="fold")
    if d.identical:
        t.add_row("-", "the plans place everything the same way", "", "", "", "")
    for x in d.differences:
        time = "" if x.time_s is None else _signed_time(x.time_s) + (" (shared)" if x.shared else "")
        mem = "" if x.memory_gib is None else ("+" if x.memory_gib >= 0 else "") + fmt_mem(
            x.memory_gib)
        t.add_row(x.where, x.what, x.a, x.b, time, mem)
    return render([t], width)


def _signed_time(s: float) -> str:
    return ("+" if s >= 0 else "-") + fmt_time(abs(s))
