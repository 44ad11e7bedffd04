"""Why a plan chose a placement: the alternatives at one operator or layer, re-priced.

trace -> cost -> solve -> plan -> **read**. For an operator of a plan this module lists
the placements the solver could have given it on its stage mesh, prices each one with the
cost model (compute split, the operator's own collectives, memory of its weights and
output), and says what ruled each one out: a dimension the mesh axis does not divide, the
device's memory, or a higher local cost than the chosen placement.

The pricing is local: it does not see resharding between an operator and its neighbours,
which the solver does see. A candidate that is locally cheaper than the chosen one is
therefore reported as such ("cheaper here; the solver pays for it elsewhere, or it lies
outside the search space of <solver>"), never hidden. Plans loaded from a file carry no
graph: ``retrace`` rebuilds it from the model spec and checks the model fingerprint.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from meshplan.costmodel.compute import DTYPE_BYTES
from meshplan.costmodel.memory import GIB
from meshplan.errors import MeshplanError, PlanFileError, SpecError
from meshplan.placements import PARTIAL, REPLICATE, is_shard, shard, shard_dim
from meshplan.plan import Plan, Stage

# Operator kinds worth explaining on their own: the ones that carry weights or most FLOPs.
HEAVY_KINDS = ("matmul", "attention", "embedding", "norm", "loss")


def retrace(plan: Plan, model_spec: str):
    """The OpGraph of ``plan``'s model, rebuilt from ``model_spec`` and the plan's batch."""
    from meshplan.specs import parse_model_spec

    if plan.graph is not None:
        return plan.graph
    spec = parse_model_spec(model_spec)
    graph = spec.load_for_plan(plan, device="meta").trace(spec.name)
    plan.check_model(graph.fingerprint)
    return graph


@dataclass(frozen=True, slots=True)
class Alternative:
    """One placement of an operator on its stage mesh and its price (one step).

    From the local re-pricing: the operator's compute, its own collectives and its memory
    (weights with their gradients and optimizer state, plus its output). From the solver
    (``planner.singlestage.alternatives``): the whole plan's time and memory per device
    with this candidate in place of the chosen one (compute/comm then are NaN).
    """

    label: str  # per-axis style in words, e.g. "column over tp, batch over dp"
    output: tuple[str, ...]  # output placements
    weight: tuple[str, ...]  # placements of the operator's weight ((), if it has none)
    time_s: float
    memory_gib: float
    chosen: bool
    verdict: str  # "chosen", or what ruled it out
    compute_s: float = math.nan
    comm_s: float = math.nan


@dataclass(frozen=True, slots=True)
class NodeExplanation:
    node: str
    target: str
    module_path: str
    layer: int
    stage: int
    chosen_output: tuple[str, ...]
    alternatives: tuple[Alternative, ...]
    source: str  # who priced the alternatives


def find_stage(plan: Plan, node_name: str) -> Stage:
    for st in plan.stages:
        if node_name in st.ops:
            return st
    names = [n for st in plan.stages for n in st.ops]
    raise SpecError(f"node {node_name!r} is not in this plan; it has {len(names)} operators, "
                    f"e.g. {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")


def layer_nodes(plan: Plan, graph, layer: int) -> list[str]:
    """The operators of ``layer`` worth explaining (weights or FLOPs), in graph order."""
    layers = sorted({graph.node(n).layer for st in plan.stages for n in st.ops if n in graph})
    if layer not in layers:
        valid = [x for x in layers if x >= 0]
        raise SpecError(f"layer {layer} does not exist in this plan; valid layers are "
                        f"{valid[0]}-{valid[-1]}" + (" and -1 (outside blocks)" if -1 in layers else "")
                        if valid else f"layer {layer} does not exist; valid layers: {layers}")
    out = []
    for st in plan.stages:
        for name in st.ops:
            node = graph.node(name) if name in graph else None
            if node is not None and node.layer == layer and (
                    node.params or str(node.kind) in HEAVY_KINDS[:2]):
                out.append(name)
    return out


def _weight(node, graph):
    """(weight name, its shape, (in_dim, out_dim)) for a matmul with a 2-D weight, else None."""
    for p in node.params:
        info = graph.param_map.get(p)
        if info is not None and len(info.shape) == 2:
            # aten.linear keeps nn.Linear's (out, in) weight; mm/addmm read an (in, out) matrix
            dims = (1, 0) if "linear" in node.target else (0, 1)
            return p, info.shape, dims
    return None


def _styles(node, graph) -> list[tuple[str, str, str]]:
    """Per-axis choices: (word, output placement, weight placement)."""
    out = node.out
    ndim = len(out.shape) if out is not None else 0
    styles = [("replicated", REPLICATE, REPLICATE)]
    if ndim >= 1:
        styles.append(("batch", shard(0), REPLICATE))
    w = _weight(node, graph) if str(node.kind) == "matmul" else None
    if w is not None and ndim >= 1:
        _, _, (din, dout) = w
        styles.append(("column", shard(ndim - 1), shard(dout)))
        styles.append(("row", PARTIAL, shard(din)))
    elif str(node.kind) == "embedding" and node.params:
        styles.append(("vocab", PARTIAL, shard(0)))
    if ndim >= 3:  # (batch, seq, hidden) activations; attention's (batch, heads, seq, dim)
        styles.append(("heads" if str(node.kind) == "attention" else "sequence", shard(1),
                       REPLICATE))
    return styles


def _divides(node, graph, out_pl, w_pl, mesh_shape) -> str:
    """Empty when every sharded dimension divides by its axes' sizes, else the reason."""
    need: dict[tuple[str, int], int] = {}
    for axis, (o, w) in enumerate(zip(out_pl, w_pl)):
        for role, pl in (("output", o), ("weight", w)):
            if shard_dim(pl) is not None:
                key = (role, shard_dim(pl))
                need[key] = need.get(key, 1) * mesh_shape[axis]
    wshape = _weight(node, graph)[1] if _weight(node, graph) else ()
    if str(node.kind) == "embedding" and node.params:
        wshape = graph.param_map[node.params[0]].shape
    for (what, dim), n in need.items():
        shape = node.out.shape if what == "output" else wshape
        if dim >= len(shape):
            return f"{what} has no dim {dim}"
        if shape[dim] % n:
            return f"{what} dim {dim} of size {shape[dim]} is not divisible by {n} devices"
    return ""


def price(node, graph, stage: Stage, pricer, out_pl, w_pl, *, optimizer: str,
          inputs=None) -> tuple[float, float, float]:
    """(compute_s, comm_s, memory_gib) of one placement of ``node`` for one step, priced by
    the estimate's own parts (``estimate.OperatorPricer``: the operator walk's compute and
    input collectives; ``estimate.parameter_part``: its weights' state and gradient sync):
    compute and the collectives of its inputs for every microbatch, its weights' sync once.
    ``inputs``: the placements it reads (default: ``_read_as`` of the placement)."""
    from meshplan.costmodel.params import (_embedding_weights, _zero_cp_axis, param_layer,
                                           parameter_part)
    from meshplan.costmodel.stage_layout import dp_axis
    from meshplan.plan import OpPlacement

    mesh = stage.mesh_shape
    if inputs is None:
        inputs = _read_as(node, graph, stage, out_pl, w_pl)
    op = OpPlacement(tuple(tuple(x) for x in inputs), tuple(out_pl))
    m = pricer.m
    compute = m * pricer.compute_s(node, op)
    comm = m * pricer.input_comm_s(node, op)
    state = 0.0
    # as the estimate's parameter walk: ZeRO over dp x cp where the runtime shards over both,
    # NeMo's fp32 word-embedding gradient
    cpa = _zero_cp_axis(stage, pricer.runtime)
    fp32_grads = _embedding_weights(graph) if pricer.runtime.fp32_embedding_grads else set()
    for k, p in enumerate(node.inputs):
        info = graph.param_map.get(p)
        if info is None or k >= len(op.inputs):
            continue
        stored = tuple(REPLICATE if x == PARTIAL else x for x in op.inputs[k])
        part = parameter_part(info, stored, [(op.output, op.inputs[k])], param_layer(p, graph),
                              mesh, dp_axis(stage), cpa, zero=stage.zero, dtype=pricer.dtype,
                              optimizer=optimizer, runtime=pricer.runtime,
                              fp32_grads=p in fp32_grads)
        state += part.weights_bytes + part.grads_bytes + part.optimizer_bytes
        comm += sum(pricer.coll(s.kind, s.grad_bytes, s.axis) for s in part.syncs)
    out_split = 1
    for axis, o in enumerate(out_pl):
        if is_shard(o):
            out_split *= mesh[axis]
    act_bytes = (node.out.numel if node.out is not None else 0) * DTYPE_BYTES[pricer.dtype] / out_split
    return compute, comm, (state + act_bytes) / GIB


def as_planned(plan: Plan, graph, stage_index: int) -> dict:
    """node -> (compute_s, comm_s, memory_gib) of every operator of one stage record at the
    placements the plan gives it (``price``; the chosen rows of ``explain``)."""
    from meshplan.costmodel.estimate import operator_pricer

    pricer = operator_pricer(plan, graph, stage_index)
    stage = pricer.stage
    out = {}
    for name, op in stage.ops.items():
        w = _weight(graph.node(name), graph)
        w_pl = tuple(op.inputs[graph.node(name).inputs.index(w[0])]) if w else \
            (REPLICATE,) * len(stage.mesh_shape)
        out[name] = price(graph.node(name), graph, stage, pricer, tuple(op.output), w_pl,
                          optimizer=plan.training.optimizer, inputs=op.inputs)
    return out


def _read_as(node, graph, stage: Stage, out_pl, w_pl) -> tuple:
    """The placements a candidate reads: its weight as ``w_pl``; an activation split on the
    dim it is contracted over where the output is partial (row-parallel), whole where the
    weight is split and the output is not (column-parallel, vocab), else like the output
    where the shapes agree (batch, sequence, heads), else as planned."""
    planned = stage.ops[node.name].inputs
    w = _weight(node, graph)
    out = []
    for k, name in enumerate(node.inputs):
        if k >= len(planned):
            break
        if name in graph.param_map:
            if w is not None and name == w[0] or str(node.kind) == "embedding":
                out.append(tuple(w_pl))
            elif w is not None:  # a bias: split with a column-parallel output, else whole
                out.append(tuple(shard(0) if wp != REPLICATE and is_shard(o) else REPLICATE
                                 for o, wp in zip(out_pl, w_pl)))
            else:
                out.append(tuple(planned[k]))
            continue
        rank = len(graph.node(name).out.shape) if name in graph and graph.node(name).out \
            is not None else None
        per_axis = []
        for axis, (o, wp) in enumerate(zip(out_pl, w_pl)):
            if o == PARTIAL and wp != REPLICATE and rank:
                per_axis.append(shard(rank - 1))
            elif wp != REPLICATE:
                per_axis.append(REPLICATE)
            elif is_shard(o) and node.out is not None and rank == len(node.out.shape):
                per_axis.append(o)
            else:
                per_axis.append(planned[k][axis])
        out.append(tuple(per_axis))
    return tuple(out)


def _words(output: tuple[str, ...], stage: Stage) -> str:
    words = []
    for axis, p in enumerate(output):
        if p != REPLICATE and stage.mesh_shape[axis] > 1:
            what = "partial" if p == PARTIAL else f"dim {shard_dim(p)}"
            words.append(f"{what} over {stage.axis_names[axis]}")
    return ", ".join(words) or "replicated"


def solver_alternatives(plan: Plan, graph, node_name: str) -> tuple[Alternative, ...] | None:
    """The intra-op solver's own candidates, for single-stage plans it made; else None."""
    if plan.num_stages != 1 or not plan.solver.name.startswith("meshplan-intra-ilp"):
        return None
    try:
        from meshplan.planner.singlestage import alternatives
    except ImportError:
        return None
    try:
        alts = alternatives(replace(plan, graph=graph), node_name)
    except MeshplanError:
        return None
    stage = plan.stages[0]
    return tuple(Alternative(label=_words(tuple(a.output), stage) + (" (ZeRO-3)" if a.zero3 else ""),
                             output=tuple(a.output), weight=(), time_s=a.time_s,
                             memory_gib=a.memory_gib, chosen=a.chosen, verdict=a.reason)
                 for a in alts)


def explain_node(plan: Plan, graph, node_name: str) -> NodeExplanation:
    stage = find_stage(plan, node_name)
    if node_name not in graph:
        raise PlanFileError(f"node {node_name!r} is in the plan but not in the traced model; "
                            "the plan was made for another model")
    node = graph.node(node_name)
    solved = solver_alternatives(plan, graph, node_name)
    if solved is not None:
        return NodeExplanation(node=node_name, target=node.target, module_path=node.module_path,
                               layer=node.layer, stage=stage.index,
                               chosen_output=tuple(stage.ops[node_name].output),
                               alternatives=solved,
                               source=f"{plan.solver.name} (whole-plan objective per candidate)")
    from meshplan.costmodel.estimate import operator_pricer

    chosen_out = stage.ops[node_name].output
    pricer = operator_pricer(plan, graph, plan.stages.index(stage))
    rows = _candidate_rows(node, graph, pricer.stage, pricer, plan.training)
    chosen = next(r for r in rows if r[6])
    alts = [Alternative(label, out_pl, w_pl, compute + comm, mem, is_chosen,
                        _verdict(compute, comm, mem, is_chosen, bad, chosen, stage,
                                 plan.predicted.memory_capacity_gib), compute, comm)
            for label, out_pl, w_pl, compute, comm, mem, is_chosen, bad in rows]
    alts.sort(key=lambda a: (not a.chosen, a.verdict.startswith("invalid"), a.time_s))
    return NodeExplanation(node=node_name, target=node.target, module_path=node.module_path,
                           layer=node.layer, stage=stage.index, chosen_output=tuple(chosen_out),
                           alternatives=tuple(alts), source="meshplan.explain (local re-pricing)")


def _candidate_rows(node, graph, stage, pricer, t) -> list[list]:
    """Every placement style of ``node`` on each split axis, re-priced locally:
    [label, output, weight, compute s, comm s, memory GiB, chosen, why invalid]; the
    planned placement comes first when it is none of these styles."""
    chosen_out = stage.ops[node.name].output
    w = _weight(node, graph)
    chosen_w = stage.params.get(w[0]) if w else None
    if chosen_w is None and node.params and node.params[0] in stage.params:
        chosen_w = stage.params[node.params[0]]
    chosen_w = tuple(chosen_w) if chosen_w else (REPLICATE,) * len(stage.mesh_shape)
    styles = _styles(node, graph)
    axes = [i for i, s in enumerate(stage.mesh_shape) if s > 1]
    seen = set()
    rows = []
    for combo in itertools.product(styles, repeat=len(axes)):
        out_pl = [REPLICATE] * len(stage.mesh_shape)
        w_pl = [REPLICATE] * len(stage.mesh_shape)
        words = []
        for axis, (word, o, wp) in zip(axes, combo):
            out_pl[axis], w_pl[axis] = o, wp
            if word != "replicated":
                words.append(f"{word} over {stage.axis_names[axis]}")
        out_pl, w_pl = tuple(out_pl), tuple(w_pl)
        if (out_pl, w_pl) in seen:
            continue
        seen.add((out_pl, w_pl))
        is_chosen = out_pl == tuple(chosen_out) and (not w or w_pl == chosen_w)
        # the chosen placement reads what the plan says it reads
        compute, comm, mem = price(node, graph, stage, pricer, out_pl, w_pl,
                                   optimizer=t.optimizer,
                                   inputs=stage.ops[node.name].inputs if is_chosen else None)
        rows.append([", ".join(words) or "replicated", out_pl, w_pl if w else (), compute, comm,
                     mem, is_chosen, _divides(node, graph, out_pl, w_pl, stage.mesh_shape)])
    if not any(r[6] for r in rows):  # the solver chose a placement outside these styles
        compute, comm, mem = price(node, graph, stage, pricer, tuple(chosen_out), chosen_w,
                                   optimizer=t.optimizer, inputs=stage.ops[node.name].inputs)
        rows.insert(0, ["as planned", tuple(chosen_out), chosen_w if w else (), compute, comm,
                        mem, True, ""])
    return rows


def _verdict(compute: float, comm: float, mem: float, is_chosen: bool, bad: str, chosen: list,
             stage, capacity_gib: float) -> str:
    """Why a candidate was not chosen, against the chosen row: invalid, over memory, slower,
    a tie, or locally cheaper (the solver weighed the whole plan)."""
    if is_chosen:
        return "chosen"
    if bad:
        return f"invalid: {bad}"
    stage_mem = stage.predicted.memory.total_gib
    if capacity_gib and stage_mem - chosen[5] + mem > capacity_gib:
        return (f"memory: stage would need {stage_mem - chosen[5] + mem:.2f} GiB of "
                f"{capacity_gib:.1f} GiB")
    delta = compute + comm - (chosen[3] + chosen[4])
    if abs(delta) < 1e-6:
        return "same local cost (tie)"
    if delta > 0:
        return f"slower by {_fmt(delta)} per step"
    return f"locally cheaper by {_fmt(-delta)} *"


def _fmt(s: float) -> str:
    from meshplan.inspect import fmt_time

    return fmt_time(s)


def choice_text(plan: Plan) -> str:
    """Why this layout: the margin within which the simplest plan was kept and the plan it
    beat (planner/simplest.py); empty for plans made without one."""
    s = plan.solver
    if not s.margin:
        return ""
    lines = [f"layout: the simplest plan (fewer stages, less ZeRO, no recompute, no cp) "
             f"within {s.margin:.1%} of the fastest predicted step time (the cost model's "
             f"measured error on this kind of machine)"]
    lines.append(f"runner-up: {s.runner_up}" if s.runner_up else
                 "runner-up: none (no simpler plan fits within the margin)")
    return "\n".join(lines)


def explain(plan: Plan, graph, *, node: str | None = None, layer: int | None = None
            ) -> list[NodeExplanation]:
    if (node is None) == (layer is None):
        raise SpecError("explain needs exactly one of --node NAME or --layer N")
    if node is not None:
        return [explain_node(plan, graph, node)]
    return [explain_node(plan, graph, n) for n in layer_nodes(plan, graph, layer)]


LOCAL_NOTE = ("* local pricing does not see resharding between this operator and its "
              "neighbours; the solver does, or the placement lies outside its search space ({})")


def explain_text(expls: list[NodeExplanation], plan: Plan | None = None, width: int = 120,
                 limit: int = 0) -> str:
    """Tables of alternatives; ``limit`` > 0 keeps the chosen one and the best others."""
    from rich import box
    from rich.table import Table

    from meshplan.inspect import render

    tables = []
    if plan is not None:  # expert parallelism: which ranks hold which experts
        from meshplan.inspect import expert_table
        experts = expert_table(plan)
        if experts is not None:
            tables.append(experts)
    for e in expls:
        t = Table(title=f"{e.node} ({e.target}, {e.module_path or '-'}, layer {e.layer}, stage "
                        f"{e.stage}): output {list(e.chosen_output)}", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, caption_justify="left",
                  caption=f"priced by {e.source}" + ("; " + LOCAL_NOTE.format(
                      plan.solver.name if plan else "the planner") if any(
                      a.verdict.endswith("*") for a in e.alternatives) else ""))
        whole = not any(math.isfinite(a.compute_s) for a in e.alternatives)
        cols = ("placement", "output", "weight", "compute", "comm", "memory GiB", "verdict")
        if whole:
            cols = ("placement", "output", "plan time", "plan memory GiB", "verdict")
        for col in cols:
            t.add_column(col, overflow="fold")
        shown = e.alternatives[:limit] if limit else e.alternatives
        for a in shown:
            mark = ("* " if a.chosen else "  ") + a.label
            if whole:
                t.add_row(mark, " ".join(a.output), _fmt(a.time_s) if math.isfinite(a.time_s)
                          else "-", f"{a.memory_gib:.4f}", a.verdict)
            else:
                t.add_row(mark, " ".join(a.output), " ".join(a.weight) or "-", _fmt(a.compute_s),
                          _fmt(a.comm_s), f"{a.memory_gib:.4f}", a.verdict)
        if len(shown) < len(e.alternatives):
            t.add_row(*[""] * (len(cols) - 1), f"... {len(e.alternatives) - len(shown)} more "
                      "(explain --node shows all)")
        tables.append(t)
    return render(tables, width)
