"""Reading plans: the summary table a person reads in 30 seconds.

trace -> cost -> solve -> plan -> **read**. Pure functions of a Plan; the CLI prints them.
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from meshplan.plan import Plan


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def summary_table(plan: Plan) -> list:
    p, t = plan.predicted, plan.training
    head = Table(title=f"meshplan plan: {plan.model.name} on {plan.mesh.name} "
                       f"(mesh {'x'.join(map(str, plan.mesh.shape))}, {plan.num_devices} devices)",
                 show_header=False, title_justify="left")
    head.add_column("what", style="bold")
    head.add_column("value")
    head.add_row("parameters", f"{plan.model.param_count:,}")
    head.add_row("global batch x seq", f"{t.global_batch} x {t.seq_len} "
                 f"({t.microbatches} microbatch{'es' if t.microbatches != 1 else ''}, {t.dtype}, "
                 f"{t.optimizer})")
    head.add_row("predicted step time", _fmt_time(p.step_time_s))
    head.add_row("throughput", f"{p.tokens_per_s:,.0f} tokens/s")
    head.add_row("MFU", f"{p.mfu * 100:.1f}%")
    head.add_row("pipeline bubble", f"{p.bubble_fraction * 100:.1f}%")
    head.add_row("peak memory / device", f"{p.peak_memory_gib:.3f} GiB of "
                 f"{p.memory_capacity_gib:.1f} GiB" + ("" if p.fits else "  [red]DOES NOT FIT[/red]"))
    head.add_row("time breakdown", ", ".join(f"{k} {_fmt_time(v)}" for k, v in p.breakdown.items()))
    head.add_row("solver", f"{plan.solver.name}: {plan.solver.status}, gap {plan.solver.gap:.2%}")
    for note in plan.solver.notes:
        head.add_row("note", note)

    stages = Table(title="stages", title_justify="left")
    for col in ("stage", "devices", "mesh", "layers", "recompute", "zero", "params", "grads",
                "optimizer", "activations", "compute", "comm"):
        stages.add_column(col)
    for st in plan.stages:
        m = st.predicted.memory
        devs = f"{st.devices[0]}-{st.devices[-1]}" if len(st.devices) > 1 else str(st.devices[0])
        stages.add_row(str(st.index), devs, "x".join(map(str, st.mesh_shape)),
                       f"{st.layers[0]}-{st.layers[1] - 1}" if st.layers[1] > st.layers[0] else "-",
                       st.recompute, str(st.zero), f"{m.params_gib:.3f}", f"{m.grads_gib:.3f}",
                       f"{m.optimizer_gib:.3f}", f"{m.activations_gib:.3f}",
                       _fmt_time(st.predicted.compute_s), _fmt_time(st.predicted.comm_s))
    return [head, stages]


def summary_text(plan: Plan, width: int = 110) -> str:
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    for table in summary_table(plan):
        console.print(table)
    return buf.getvalue()
