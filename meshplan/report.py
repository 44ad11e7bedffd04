"""The plan report: one self-contained HTML page with pictures (inline SVG, no network).

trace -> cost -> solve -> plan -> **read**. Four pictures, drawn from the plan and the
estimate's own numbers (the schedule's pass times from ``estimate.plan_stage_costs``,
which needs the model's graph; the breakdown from ``plan.predicted``):

1. the pipeline schedule as a timeline: every stage's forward and backward passes of every
   microbatch laid out by the schedule's order and their dependencies (idle time, the
   bubble, stays empty);
2. memory per device, one stacked bar per stage (parameters, gradients, optimizer state,
   activations, buffers) against the device's capacity;
3. a per-layer placement map: one row per layer, one column per module with weights,
   coloured by how the weights are split (column-, row-, vocab-parallel, replicated);
4. the predicted step time broken into compute, communication, bubble and optimizer.

Then the same tables as ``meshplan show``. A small script counts the pictures the browser
laid out and writes the count to ``<body data-figures-rendered>`` (the test reads it back
from headless Chromium).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from meshplan.inspect import (batch_words, fmt_mem, fmt_time, param_styles, summary_text,
                              throughput)
from meshplan.plan import Plan, atomic_write
from meshplan.schedules import Schedule

# Okabe & Ito (2008) colour-blind-safe palette.
BLUE, ORANGE, GREEN, PURPLE = "#0072B2", "#E69F00", "#009E73", "#CC79A7"
SKY, VERMILION, YELLOW, GREY = "#56B4E9", "#D55E00", "#F0E442", "#BBBBBB"
MEMORY_PARTS = (("params_gib", "parameters", BLUE), ("grads_gib", "gradients", SKY),
                ("optimizer_gib", "optimizer", ORANGE), ("activations_gib", "activations", GREEN),
                ("buffers_gib", "buffers", PURPLE))
STYLE_COLOURS = {"replicated": GREY, "column-parallel": BLUE, "row-parallel": ORANGE,
                 "vocab-parallel": PURPLE, "hidden-parallel": SKY, "partial sums": VERMILION,
                 "split": GREEN}
BREAKDOWN_COLOURS = (BLUE, ORANGE, GREY, GREEN, PURPLE, SKY, VERMILION, YELLOW)
WIDTH = 900


@dataclass(frozen=True, slots=True)
class Block:
    """One pass of one microbatch on one stage in the timeline."""

    stage: int
    microbatch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float


def stage_order(schedule: str, stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The order in which a stage runs its passes: GPipe all forwards then all backwards;
    1F1B (and interleaved, drawn per physical stage) warms up with stages - stage - 1
    forwards, then alternates one forward and one backward (Narayanan et al. 2021)."""
    m = microbatches
    if schedule == Schedule.GPIPE:
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
        b += 1
    return order


def pass_times(plan: Plan, graph) -> list[tuple[float, float]]:
    """(forward, backward) seconds of one microbatch on each stage record, read from the
    estimate's stage costs (``estimate.plan_stage_costs``, the terms its pipeline time
    composes): the forward pass, and the backward with recompute and the stage's exposed
    communication, drawn with it; they add up to the estimate's ``microbatch_s``."""
    from meshplan.costmodel.estimate import plan_stage_costs
    from meshplan.costmodel.hardware import HardwareProfile

    costs = plan_stage_costs(plan, graph, HardwareProfile.from_dict(plan.mesh.hardware))
    return [(c.forward_s, c.backward_s + c.recompute_s + c.comm_s) for c in costs]


def timeline(plan: Plan, times: list[tuple[float, float]]) -> list[Block]:
    """Simulate the schedule with each stage's (forward, backward) pass ``times``
    (``pass_times``): a pass starts when its stage is free and its input is ready (forward i
    after the previous stage's forward i; backward i after the next stage's)."""
    n = plan.num_stages
    m = max(plan.training.microbatches, 1)
    orders = [stage_order(plan.training.schedule, s, n, m) for s in range(n)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * n
    pos = [0] * n
    blocks: list[Block] = []
    while any(pos[s] < len(orders[s]) for s in range(n)):
        progressed = False
        for s in range(n):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dep = (("F", s - 1, i) if s > 0 else None) if kind == "F" else \
                    (("B", s + 1, i) if s < n - 1 else ("F", s, i))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done.get(dep, 0.0) if dep else 0.0)
                dur = times[s][0 if kind == "F" else 1]
                done[(kind, s, i)] = free[s] = start + dur
                blocks.append(Block(s, i, kind, start, start + dur))
                pos[s] += 1
                progressed = True
        assert progressed, "schedule order deadlocks"  # internal invariant of stage_order
    return blocks


# -- pictures ------------------------------------------------------------------------------------

def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg class="figure" role="img" aria-label="{html.escape(label)}" '
            f'xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
            + "".join(body) + "</svg>")


def _rect(x, y, w, h, fill, title="", extra="") -> str:
    t = f"<title>{html.escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.5):.1f}" height="{h:.1f}" '
            f'fill="{fill}" {extra}>{t}</rect>')


def _text(x, y, s, anchor="start", extra="") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {extra}>{html.escape(s)}</text>'


def _legend(items, x, y) -> list[str]:
    out = []
    for label, colour in items:
        out += [_rect(x, y - 9, 10, 10, colour), _text(x + 14, y, label)]
        x += 24 + 7 * len(label)
    return out


def timeline_svg(plan: Plan, graph=None) -> str:
    n = plan.num_stages
    if graph is None:
        body = [_rect(70, 30, WIDTH - 90, 20, "#EEEEEE"),
                _text(80, 44, "pass times are priced from the model: pass --model (or a plan "
                      "made in this process) to draw the schedule")]
        return _svg(WIDTH, 60, body, "pipeline schedule timeline")
    blocks = timeline(plan, pass_times(plan, graph))
    end = max((b.end_s for b in blocks), default=0.0) or 1.0
    left, row, top = 70, max(12, min(28, 360 // max(n, 1))), 30
    scale = (WIDTH - left - 20) / end
    body = _legend([("forward", BLUE), ("backward", GREEN), ("idle (bubble)", "#EEEEEE")], left, 14)
    for s in range(n):
        y = top + s * row
        body.append(_rect(left, y, end * scale, row - 3, "#EEEEEE"))
        body.append(_text(left - 6, y + row / 2 + 2, f"stage {s}", "end"))
    for b in blocks:
        x, w = left + b.start_s * scale, (b.end_s - b.start_s) * scale
        colour = BLUE if b.kind == "F" else GREEN
        body.append(_rect(x, top + b.stage * row, w, row - 3, colour,
                          f"stage {b.stage} {b.kind}{b.microbatch}: {fmt_time(b.end_s - b.start_s)}",
                          'stroke="white" stroke-width="0.5"'))
        if w > 16 and row > 11:
            body.append(_text(x + w / 2, top + b.stage * row + row / 2 + 1, str(b.microbatch),
                              "middle", 'fill="white" font-size="9"'))
    y = top + n * row + 14
    body.append(_text(left, y, "0"))
    body.append(_text(WIDTH - 20, y, fmt_time(end), "end"))
    if plan.training.schedule == Schedule.INTERLEAVED:
        body.append(_text(WIDTH - 20, 14, f"interleaved ({plan.training.virtual_stages} chunks "
                          "per device) drawn per physical stage in 1F1B order", "end"))
    busy = sum(b.end_s - b.start_s for b in blocks)
    idle = 1 - busy / (end * n) if n else 0.0
    body.append(_text(left + (WIDTH - left - 20) / 2, y, f"the estimate's forward, and backward "
                      f"with recompute and communication, per microbatch; idle {idle:.0%} drawn, "
                      f"bubble {plan.predicted.bubble_fraction:.0%} predicted", "middle"))
    return _svg(WIDTH, y + 8, body, "pipeline schedule timeline")


def memory_svg(plan: Plan) -> str:
    stages = plan.stages
    cap = plan.predicted.memory_capacity_gib
    tallest = max([st.predicted.memory.total_gib for st in stages] + [cap, 1e-9])
    left, top, height = 70, 30, 240
    scale = height / (tallest * 1.08)
    slot = (WIDTH - left - 20) / max(len(stages), 1)
    bar = max(2.0, min(60.0, slot * 0.7))
    body = _legend([(label, c) for _, label, c in MEMORY_PARTS], left, 14)
    base = top + height
    for i, st in enumerate(stages):
        x = left + i * slot + (slot - bar) / 2
        y = base
        for field, label, colour in MEMORY_PARTS:
            v = getattr(st.predicted.memory, field)
            h = v * scale
            if h > 0:
                y -= h
                body.append(_rect(x, y, bar, h, colour, f"stage {st.index} {label}: {fmt_mem(v)}"))
        if len(stages) <= 24:
            body.append(_text(x + bar / 2, base + 13, f"stage {st.index}", "middle"))
    body.append(f'<line x1="{left}" x2="{WIDTH - 20}" y1="{base}" y2="{base}" stroke="black"/>')
    cy = base - cap * scale
    body.append(f'<line x1="{left}" x2="{WIDTH - 20}" y1="{cy:.1f}" y2="{cy:.1f}" '
                f'stroke="{VERMILION}" stroke-dasharray="6 3" stroke-width="1.5"/>')
    body.append(_text(left - 6, cy + 4, f"{cap:.0f} GiB", "end", f'fill="{VERMILION}"'))
    body.append(_text(left - 6, base, "0", "end"))
    body.append(_text(left, base + 28, "memory per device of each stage (all devices of a stage "
                      "hold the same); dashed: capacity"))
    return _svg(WIDTH, base + 36, body, "memory per device against capacity")


def _style_class(style: str) -> str:
    return style if style in STYLE_COLOURS else "split"


def placement_svg(plan: Plan, graph=None) -> str:
    graph = graph if graph is not None else plan.graph
    rows: list[tuple[int, int, dict]] = []  # (stage, layer, module -> [(axis, style)])
    columns: list[str] = []
    for st in plan.stages:
        styles = param_styles(st, graph)
        for layer in sorted(styles, key=lambda x: x if x >= 0 or st.layers[0] == 0 else 1 << 30):
            rows.append((st.index, layer, styles[layer]))
            for m in styles[layer]:
                if m not in columns:
                    columns.append(m)
    left, top = 110, 40
    col_w = max(40, min(110, (WIDTH - left - 20) // max(len(columns), 1)))
    row_h = max(3, min(18, 480 // max(len(rows), 1)))
    legend = [(k, v) for k, v in STYLE_COLOURS.items()]
    body = _legend(legend, left, 14)
    chars = max(4, int(col_w / 5.2))  # about 5 px per character at 9 px
    for j, name in enumerate(columns):
        short = name if len(name) <= chars else name[:chars - 1] + "\u2026"
        body.append(f'<g><title>{html.escape(name)}</title>' + _text(
            left + j * col_w + col_w / 2, top - 6, short, "middle", 'font-size="9"') + "</g>")
    prev_stage = None
    for i, (stage, layer, modules) in enumerate(rows):
        y = top + i * row_h
        if prev_stage is not None and stage != prev_stage:
            body.append(f'<line x1="0" x2="{WIDTH}" y1="{y - 0.5:.1f}" y2="{y - 0.5:.1f}" '
                        'stroke="black" stroke-width="1"/>')
        if prev_stage != stage or row_h >= 10 and (layer % max(1, 20 // row_h) == 0):
            label = f"s{stage} " + ("outside" if layer < 0 else f"layer {layer}")
            body.append(_text(left - 6, y + row_h - 1, label, "end",
                              f'font-size="{min(10, max(row_h, 7))}"'))
        prev_stage = stage
        for j, name in enumerate(columns):
            if name not in modules:
                continue
            items = modules[name]
            style = _style_class(items[0][1]) if items else "replicated"
            words = "; ".join(f"{s} over axis {a}" for a, s in items) or "replicated"
            body.append(_rect(left + j * col_w + 1, y, col_w - 2, row_h - (1 if row_h > 4 else 0),
                              STYLE_COLOURS[style], f"stage {stage}, layer {layer}, {name}: {words}"))
    y = top + len(rows) * row_h + 16
    body.append(_text(left, y, "weights by layer (rows) and module (columns); the colour is "
                      "the split on the first sharded mesh axis, hover for all"
                      + ("" if graph is not None else "; without the model's graph styles show "
                         "as 'split' (meshplan report --model SPEC names them)")))
    return _svg(WIDTH, y + 8, body, "per-layer placement map")


def breakdown_svg(plan: Plan) -> str:
    parts = [(k, v) for k, v in plan.predicted.breakdown.items() if v > 0]
    total = sum(v for _, v in parts) or 1.0
    left, top, h = 20, 34, 34
    scale = (WIDTH - 2 * left) / total
    body = _legend([(f"{k} {fmt_time(v)}", BREAKDOWN_COLOURS[i % len(BREAKDOWN_COLOURS)])
                    for i, (k, v) in enumerate(parts)], left, 14)
    x = left
    for i, (k, v) in enumerate(parts):
        w = v * scale
        body.append(_rect(x, top, w, h, BREAKDOWN_COLOURS[i % len(BREAKDOWN_COLOURS)],
                          f"{k}: {fmt_time(v)} ({v / total:.0%})"))
        if w > 40:
            body.append(_text(x + w / 2, top + h / 2 + 4, f"{v / total:.0%}", "middle",
                              'fill="white"'))
        x += w
    body.append(_text(left, top + h + 18, f"predicted step time {fmt_time(plan.predicted.step_time_s)}"
                      f"; parts as the cost model adds them (sum {fmt_time(total)})"))
    return _svg(WIDTH, top + h + 26, body, "time breakdown")


# -- the page ------------------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;margin:24px;max-width:960px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
.kpi{display:flex;gap:18px;flex-wrap:wrap}.kpi div{border:1px solid #ddd;padding:8px 12px;
border-radius:4px}.kpi b{display:block;font-size:18px}pre{font-size:11px;background:#f7f7f7;
padding:8px;overflow-x:auto}"""
_SCRIPT = """<script>
(function(){var n=0;document.querySelectorAll('svg.figure').forEach(function(s){
var r=s.getBoundingClientRect();if(r.width>0&&r.height>0&&s.querySelectorAll('rect').length>0)n++;});
document.body.setAttribute('data-figures-rendered',String(n));})();
</script>"""


def render_report(plan: Plan, graph=None) -> str:
    p, t = plan.predicted, plan.training
    unit, rate = throughput(plan)
    kpis = [("step time", fmt_time(p.step_time_s)), (unit, f"{rate:,.0f}"),
            ("MFU", f"{p.mfu:.1%}"), ("bubble", f"{p.bubble_fraction:.1%}"),
            ("peak memory", f"{fmt_mem(p.peak_memory_gib)} of {p.memory_capacity_gib:.0f} GiB"
             + ("" if p.fits else " (DOES NOT FIT)")),
            ("solver", f"{plan.solver.name}: {plan.solver.status}")]
    title = f"meshplan: {plan.model.name} on {plan.mesh.name}"
    graph = graph if graph is not None else plan.graph
    figures = [("Pipeline schedule", timeline_svg(plan, graph)),
               ("Memory per device", memory_svg(plan)),
               ("Placements by layer", placement_svg(plan, graph)),
               ("Time breakdown", breakdown_svg(plan))]
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>"
             f"{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>",
             f"<p>{plan.num_devices} devices (mesh {'x'.join(map(str, plan.mesh.shape))}), "
             f"{plan.model.param_count:,} parameters, global batch {batch_words(plan)}, "
             f"{t.microbatches} microbatches, {html.escape(t.schedule)}, {plan.num_stages} stages, "
             f"{t.dtype}.</p>",
             "<div class='kpi'>" + "".join(f"<div>{html.escape(k)}<b>{html.escape(v)}</b></div>"
                                           for k, v in kpis) + "</div>"]
    for name, svg in figures:
        parts.append(f"<h2>{name}</h2>{svg}")
    parts.append("<h2>Tables</h2><pre>" + html.escape(summary_text(plan, graph=graph)) + "</pre>")
    parts.append(_SCRIPT + "</body></html>\n")
    return "\n".join(parts)


def write_report(plan: Plan, path, graph=None) -> None:
    atomic_write(path, render_report(plan, graph))
