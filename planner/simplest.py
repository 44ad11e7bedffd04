"""The simplest plan within the cost model's error band (issue 27).

trace -> cost -> **solve** (planner/hybrid, after both searches) -> assemble -> run. A plan
that the cost model predicts faster by less than the model's own measured error is not
reliably faster, and pipelines, ZeRO, recompute and context parallelism each cost memory,
launch complexity and runtime risk. So among plans whose predicted step time is within
``margin`` of the fastest, the planner keeps the simplest, in this order of importance:
fewer pipeline stages, then less ZeRO, then no recompute, then no context parallelism.

The search is greedy and lexicographic: the fewest pipeline stages whose best plan is
within the margin of the fastest; at that depth the lowest ZeRO stage within it; then no
recompute; then no cp. Each step is the pipeline search (planner/stagecost.plan_hybrid)
restricted to the simpler choice, sharing its probes, and every comparison is against the
fastest plan (margins never compound). The plan records the margin and the plan it beat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from meshplan.errors import MeshplanError
from meshplan.plan import Plan
from meshplan.planner.inter import SearchSpace, group_sizes
from meshplan.vocabulary import Recompute

# Median absolute step-time error of the cost model on 4 local gloo processes, the lowest of
# three runs (17.8-25.6%): benchmarks/results/costmodel_accuracy_cpu.md (2026-11-25).
CPU_MARGIN = 0.178
# Step-time MAPE against Megatron-LM's published A100 runs (Narayanan et al. 2021, Table 1),
# 10 rows: benchmarks/results/megatron_published.md.
GPU_MARGIN = 0.048


def error_margin(hw) -> float:
    """The cost model's measured step-time error on this kind of machine."""
    cpu = hw.device.name == "cpu" or hw.device.host_cores > 0
    return CPU_MARGIN if cpu else GPU_MARGIN


def complexity(plan: Plan) -> tuple[int, int, int, int]:
    """(pipeline stages, largest ZeRO stage, stages with recompute, uses cp): lower is simpler."""
    return (plan.num_stages, max(st.zero for st in plan.stages),
            sum(st.recompute != Recompute.NONE for st in plan.stages),
            int(any("cp" in st.axis_names for st in plan.stages)))


def describe(plan: Plan) -> str:
    """One line naming the layout: pp, the stage mesh, schedule, ZeRO, recompute, step."""
    st, t = plan.stages[0], plan.training
    mesh = " x ".join(f"{a}{n}" for a, n in zip(st.axis_names, st.mesh_shape))
    sched = t.schedule + (f" v={t.virtual_stages}" if t.virtual_stages > 1 else "")
    rc = sorted({s.recompute for s in plan.stages})
    return (f"pp={plan.num_stages} {mesh} {sched} mb={t.microbatches} "
            f"zero={max(s.zero for s in plan.stages)} recompute={'/'.join(rc)} "
            f"step {plan.predicted.step_time_s:.4g} s")


def simplest_within(fastest: Plan, space: SearchSpace, search: Callable[[SearchSpace], Plan],
                    *, num_devices: int, devices_per_node: int, margin: float) -> Plan:
    """The simplest plan within ``margin`` of ``fastest`` (module docstring). ``search``
    runs the pipeline search on a restricted space and returns its plan (or raises
    MeshplanError when none fits)."""
    limit = fastest.predicted.step_time_s * (1 + margin)
    chosen = fastest
    rejected: list[Plan] = []  # simpler plans outside the margin, first tried first

    def attempt(restricted: SearchSpace) -> Plan | None:
        try:
            plan = search(restricted)
        except MeshplanError:
            return None
        if complexity(plan) >= complexity(chosen) or not plan.predicted.fits:
            return None
        if plan.predicted.step_time_s > limit:
            rejected.append(plan)
            return None
        return plan

    # 1. fewer pipeline stages
    degrees = sorted({num_devices // s for s in group_sizes(num_devices, devices_per_node)})
    allowed = [d for d in degrees if d < fastest.num_stages
               and (space.pipeline_degrees is None or d in space.pipeline_degrees)]
    for d in allowed:
        found = attempt(replace(space, pipeline_degrees=(d,)))
        if found is not None:
            chosen = found
            break
    space = replace(space, pipeline_degrees=(chosen.num_stages,))
    # 2. less ZeRO
    zero = max(st.zero for st in chosen.stages)
    for z in sorted(z for z in space.zero if z < zero):
        found = attempt(_at_most_zero(space, z))
        if found is not None:
            chosen = found
            break
    space = _at_most_zero(space, max(st.zero for st in chosen.stages))
    # 3. no recompute, 4. no context parallelism
    for restricted in (replace(space, recompute=(Recompute.NONE,)),
                       replace(space, context_parallel=(1,))):
        if (Recompute.NONE in space.recompute and restricted.recompute == (Recompute.NONE,)
                and complexity(chosen)[2]) or (restricted.context_parallel == (1,)
                                               and complexity(chosen)[3]):
            found = attempt(restricted)
            if found is not None:
                chosen = found
    if chosen is fastest:
        if not rejected:
            return replace(fastest, solver=replace(fastest.solver, margin=margin))
        near = min(rejected, key=lambda p: p.predicted.step_time_s)
        slower = near.predicted.step_time_s / fastest.predicted.step_time_s - 1
        return replace(fastest, solver=replace(
            fastest.solver, margin=margin,
            runner_up=f"{describe(near)} (simpler, {slower:.1%} slower: outside the "
                      f"{margin:.1%} margin)"))
    gain = 1 - fastest.predicted.step_time_s / chosen.predicted.step_time_s
    return replace(chosen, solver=replace(
        chosen.solver, margin=margin,
        runner_up=f"{describe(fastest)} ({gain:.1%} faster, within the {margin:.1%} margin)"))


def _at_most_zero(space: SearchSpace, z: int) -> SearchSpace:
    pipeline = None if space.pipeline_zero is None else \
        tuple(x for x in space.pipeline_zero if x <= z)
    return replace(space, zero=tuple(x for x in space.zero if x <= z), pipeline_zero=pipeline)
