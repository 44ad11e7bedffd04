"""Hand-written Megatron-style plans for tests and benchmarks: TP, SP, 2-D, ZeRO-3 variants.

trace -> cost -> solve -> plan -> **run**. Until the planners emit tensor-parallel plans,
the runtime's tests need them: these helpers rewrite a data-parallel plan (from
``unpriced_plan`` on a 1-D or 2-D mesh) into a variant by rewriting its stage records,
in two steps.

1. ``with_param_placements``: the batch goes to the data-parallel axis, every weight gets
   its Megatron placement on the tensor-parallel axis (Shoeybi et al. 2019, Sec. 3:
   column-parallel first matmul of attention and MLP, row-parallel second; vocab-parallel
   embedding). GPT-2's Conv1D weights are (in, out): column = S(1), row = S(0); Llama's
   Linear weights are (out, in): column = S(0), row = S(1). Operator placements are left
   empty.
2. ``with_observed_ops``: every operator's placements are filled in from one forward pass in
   which DTensor chose them (``ParallelModel.loss(record=True)``), then the sequence-parallel
   rewrite moves the residual stream's norms and pointwise ops to S(1) (the sequence) on the
   tensor-parallel axis (Korthikanti et al. 2022, Sec. 4.2.2); the executor then inserts
   the all-gather before each column-parallel matmul and the reduce-scatter after each
   row-parallel one, because the plan says so.

These are planning helpers that need a process group (step 2 runs the model); they live in
runtime/ for that reason and are not a planner.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import NotSupportedError
from meshplan.planner.assemble import mesh_info, model_info, training_config
from meshplan.graph import OpGraph, OpKind
from meshplan.plan import Estimate, OpPlacement, Plan, SolverInfo, Stage

# Megatron rules per model family: parameter-name suffix -> placement on the TP axis.
MEGATRON_RULES: dict[str, dict[str, str]] = {
    "gpt2": {  # transformers Conv1D: weight (in, out)
        "attn.c_attn.weight": "S(1)", "attn.c_attn.bias": "S(0)",
        "attn.c_proj.weight": "S(0)",
        "mlp.c_fc.weight": "S(1)", "mlp.c_fc.bias": "S(0)",
        "mlp.c_proj.weight": "S(0)",
        "wte.weight": "S(0)", "lm_head.weight": "S(0)",  # vocab-parallel (tied)
    },
    "llama": {  # nn.Linear: weight (out, in)
        "q_proj.weight": "S(0)", "k_proj.weight": "S(0)", "v_proj.weight": "S(0)",
        "o_proj.weight": "S(1)",
        "gate_proj.weight": "S(0)", "up_proj.weight": "S(0)", "down_proj.weight": "S(1)",
        # embed_tokens stays replicated: its vocab-parallel output (DTensor's MaskPartial)
        # cannot pass through RMSNorm's dtype cast before being reduced (torch 2.13)
        "lm_head.weight": "S(0)",
    },
}
# Embedding tables stay 1-D sharded in the 2-D variant: DTensor's masked (vocab-parallel)
# embedding output cannot be combined with a second sharded mesh axis (torch 2.13).
_VOCAB_PARALLEL = ("wte.weight", "lm_head.weight", "embed_tokens.weight")
# The other weight dimension, sharded on the data-parallel axis by the 2-D variant.
_OTHER_DIM = {"S(0)": "S(1)", "S(1)": "S(0)"}


def graph_shape(plan: Plan, name: str) -> tuple[int, ...]:
    graph = plan.graph
    if graph is None or name not in graph.param_map:
        return ()
    return graph.param_map[name].shape


def model_family(param_names) -> str:
    names = list(param_names)
    if any(n.endswith("attn.c_attn.weight") for n in names):
        return "gpt2"
    if any(n.endswith("self_attn.q_proj.weight") for n in names):
        return "llama"
    raise NotSupportedError("Megatron variants know GPT-2 (c_attn) and Llama (q_proj) "
                            "parameter names only")


def tp_placement(name: str, family: str) -> str:
    for suffix, placement in MEGATRON_RULES[family].items():
        if name.endswith(suffix):
            return placement
    return "R"


def unpriced_plan(graph: OpGraph, mesh) -> Plan:
    """A one-stage plan skeleton on ``mesh`` (replicated parameters, batch on every axis)
    without a cost estimate: the runtime's tests need placements, not predictions."""
    ndim = len(mesh.shape)
    stage = Stage(index=0, devices=tuple(range(mesh.num_devices)), mesh_shape=tuple(mesh.shape),
                  axis_names=tuple(mesh.axis_names), layers=(0, graph.num_layers),
                  nodes=(graph.nodes[0].name, graph.nodes[-1].name),
                  inputs={name: ("S(0)",) * ndim for name, _ in graph.inputs},
                  params={p.name: ("R",) * ndim for p in graph.params})
    unpriced = Estimate(step_time_s=0.0, peak_memory_gib=0.0, memory_capacity_gib=0.0,
                        fits=True, mfu=0.0, tokens_per_s=0.0)
    return Plan(model=model_info(graph), mesh=mesh_info(mesh), training=training_config(graph),
                stages=(stage,), predicted=unpriced,
                solver=SolverInfo(name="runtime-variant", status="hand-written"), graph=graph)


def with_param_placements(plan: Plan, *, tp_axis: int | None, dp_axis: int | None,
                          zero: int = 0, shard_2d: bool = False,
                          sequence_parallel: bool = False) -> Plan:
    """Step 1: batch on ``dp_axis``, Megatron weights on ``tp_axis``, ops left empty.

    ``shard_2d`` also shards each TP weight's other dimension over ``dp_axis`` (2-D weight
    sharding); ``zero=3`` shards every replicated weight's dim 0 over ``dp_axis``."""
    stage = plan.stages[0]
    ndim = len(stage.mesh_shape)
    family = model_family(stage.params) if tp_axis is not None else ""
    params = {}
    for name, old in stage.params.items():
        pl = ["R"] * ndim
        if tp_axis is not None:
            pl[tp_axis] = tp_placement(name, family)
        if dp_axis is not None:
            if shard_2d and pl[tp_axis] != "R" and len(graph_shape(plan, name)) == 2 \
                    and not name.endswith(_VOCAB_PARALLEL):
                pl[dp_axis] = _OTHER_DIM[pl[tp_axis]]
            elif zero >= 3:
                pl[dp_axis] = "S(0)"
        params[name] = tuple(pl)
    batch = tuple("S(0)" if i == dp_axis else "R" for i in range(ndim))
    new = replace(stage, params=params, inputs={k: batch for k in stage.inputs}, ops={},
                  zero=zero)
    training = replace(plan.training, sequence_parallel=sequence_parallel)
    return replace(plan, stages=(new,), training=training)


def with_observed_ops(plan: Plan, observed: dict[str, OpPlacement], graph: OpGraph, *,
                      tp_axis: int | None = None, hidden: int = 0) -> Plan:
    """Step 2: the ops DTensor chose, plus the sequence-parallel rewrite when the plan asks."""
    ops = dict(observed)
    stage = plan.stages[0]
    if stage.zero >= 3:  # ZeRO-3: all-gather every sharded weight over the DP axes before use
        dp_axes = [i for i, p in enumerate(next(iter(stage.inputs.values()))) if p == "S(0)"]
        for node in graph.nodes:
            if node.name in ops and node.params:
                op = ops[node.name]
                ins = tuple(tuple("R" if i in dp_axes else p for i, p in enumerate(pl))
                            if name in graph.param_map and pl else pl
                            for name, pl in zip(node.inputs, op.inputs))
                ops[node.name] = OpPlacement(inputs=ins, output=op.output)
    if plan.training.sequence_parallel:
        if tp_axis is None or not hidden:
            raise NotSupportedError("sequence parallelism needs a tensor-parallel axis and the "
                                    "model's hidden size")
        ops.update(sequence_parallel_ops(graph, ops, tp_axis=tp_axis, hidden=hidden))
    return replace(plan, stages=(replace(plan.stages[0], ops=ops),))


def sequence_parallel_ops(graph: OpGraph, ops: dict[str, OpPlacement], *, tp_axis: int,
                          hidden: int) -> dict[str, OpPlacement]:
    """Norms and pointwise ops of the residual stream (outputs batch x seq x hidden) take
    their activation inputs sharded on the sequence dim over ``tp_axis``."""
    seq = graph.inputs[0][1].shape[1]
    out = {}
    for node in graph.nodes:
        o = node.out
        residual_op = node.kind in (OpKind.NORM, OpKind.ELEMENTWISE) or \
            node.target.startswith(("aten.to.", "aten.alias."))  # dtype casts of the stream
        if node.name not in ops or o is None or len(o.shape) != 3 or o.shape[1] != seq \
                or o.shape[2] != hidden or not residual_op:
            continue
        planned = ops[node.name]
        inputs = []
        for name, pl in zip(node.inputs, planned.inputs):
            shape = graph.node(name).out.shape if name in graph and graph.node(name).out else ()
            if pl and len(shape) == 3 and shape[1] == seq:
                pl = tuple("S(1)" if i == tp_axis else p for i, p in enumerate(pl))
            inputs.append(pl)
        output = tuple("S(1)" if i == tp_axis else p for i, p in enumerate(planned.output))
        out[node.name] = OpPlacement(inputs=tuple(inputs), output=output)
    # Readers of the sequence-sharded stream outside it (the column-parallel matmuls) get it
    # replicated on the TP axis: SP's all-gather. A Partial there is no longer reachable.
    stream = set(out)
    for node in graph.nodes:
        if node.name in stream or node.name not in ops:
            continue
        planned = ops[node.name]
        inputs = tuple(tuple("R" if i == tp_axis and p == "P" else p for i, p in enumerate(pl))
                       if name in stream and pl else pl
                       for name, pl in zip(node.inputs, planned.inputs))
        if inputs != planned.inputs:
            out[node.name] = OpPlacement(inputs=inputs, output=planned.output)
    return out
