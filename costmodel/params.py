"""Parameters: each parameter's state on a stage and the collectives its gradient needs.

trace -> **cost** -> solve -> run. ``parameter_walk`` walks a stage's parameters once
(``ParamWalk``): for each, ``parameter_part`` gives its model-state bytes per device
(weights, gradients, optimizer state under the stage's ZeRO level) and its gradient syncs
(``GradSync``: all-reduce or reduce-scatter over the axes that split its consumers, ZeRO-3
gathers per use); a tied weight is walked once, with the readers of all its tied names.
``param_layer`` is the layer a parameter belongs to. ``costmodel/param_traffic.py`` prices
these syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.costmodel.comm import Collective
from meshplan.costmodel.memory import GRAD_BYTES, MASTER_BYTES, model_state_bytes
from meshplan.costmodel.runtime_profiles import RuntimeModel
from meshplan.costmodel.stage_layout import dp_axis, split_factor
from meshplan.graph import OpGraph, OpKind
from meshplan.placements import PARTIAL, REPLICATE
from meshplan.plan import Stage
from meshplan.vocabulary import ComputeDtype


@dataclass(frozen=True, slots=True)
class GradSync:
    """The collective one parameter's gradient needs on one mesh axis."""

    kind: Collective  # all-reduce, or reduce-scatter over dp under ZeRO-2/3
    axis: int
    grad_bytes: float  # the gradient (GRAD_BYTES per parameter)
    weight_bytes: float  # the weights in the compute dtype: what ZeRO all-gathers
    layer: int  # the block it belongs to, -1 outside the blocks
    uses: int  # operators that read it
    on_dp: bool  # on the data-parallel axis
    per_use: bool  # ZeRO-3 gathered and reduce-scattered where its block uses it, every


    # microbatch (RuntimeModel.zero3_per_use), not once per step


@dataclass(frozen=True, slots=True)
class ParamWalk:
    """What a stage's parameters hold on one device and the collectives they need."""

    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    optimizer_numel: float  # parameters this device's optimizer steps
    tensors: int  # parameter tensors it steps (fixed costs per tensor)
    unit_numel: dict  # block -> local parameters (-1: outside the blocks): ZeRO-3/FSDP units
    syncs: tuple[GradSync, ...]
    dp_axis: int | None
    # gradient bytes synced once per step after the backward: each parameter's gradient
    # once, however many mesh axes reduce it (the graph engine's one flat buffer,
    # ``lowering.reduce_partial_grads``, is reduced over every axis in turn)
    synced_bytes: float = 0.0


def parameter_walk(stage: Stage, graph: OpGraph, consumer_out: dict, *, dtype: str,
                   optimizer: str, runtime: RuntimeModel) -> ParamWalk:
    """Model state of every parameter the stage keeps (tied copies once) and the gradient
    collectives each trainable one needs (``_grad_syncs``); ``consumer_out`` maps a
    parameter to the (output, read-as) placements of the operators reading it."""
    shape = stage.mesh_shape
    dpa = dp_axis(stage)
    cpa = _zero_cp_axis(stage, runtime)
    zero = stage.zero
    fp32_grads = _embedding_weights(graph) if runtime.fp32_embedding_grads else set()
    weights = grads = opt = opt_numel = synced = 0.0
    tensors = 0
    unit_numel: dict[int, float] = {}
    syncs: list[GradSync] = []
    readers = _tied_readers(graph, consumer_out)
    for pname, pl in stage.params.items():
        info = graph.param_map.get(pname)
        if info is None or (info.tied_to is not None and info.tied_to in stage.params):
            continue
        outs = readers.get(pname, ())
        part = parameter_part(info, pl, outs, _param_layer(pname, graph), shape, dpa, cpa,
                              zero=zero, dtype=dtype, optimizer=optimizer, runtime=runtime,
                              fp32_grads=pname in fp32_grads)
        weights, grads, opt = weights + part.weights_bytes, grads + part.grads_bytes, \
            opt + part.optimizer_bytes
        opt_numel += part.optimizer_numel
        tensors += 1
        unit_numel[part.layer] = unit_numel.get(part.layer, 0.0) + part.numel
        syncs += part.syncs
        synced += part.synced_bytes
    return ParamWalk(weights_bytes=weights, grads_bytes=grads, optimizer_bytes=opt,
                     optimizer_numel=opt_numel, tensors=tensors, unit_numel=unit_numel,
                     syncs=tuple(syncs), dp_axis=dpa, synced_bytes=synced)


def _tied_readers(graph: OpGraph, consumer_out: dict) -> dict:
    """Parameter -> the (output, read-as) placements of every operator reading it under any
    of its tied names: the graph may read a tied weight under the name kept out of the walk
    (GPT-2's embedding reads ``lm_head.weight``, tied to ``transformer.wte.weight``)."""
    readers = {p: list(v) for p, v in consumer_out.items()}
    for p in graph.params:
        if p.tied_to is not None and p.tied_to in graph.param_map:
            both = consumer_out.get(p.name, []) + consumer_out.get(p.tied_to, [])
            readers[p.name] = readers[p.tied_to] = both
    return readers


@dataclass(frozen=True, slots=True)
class ParamPart:
    """One parameter's share of ``ParamWalk``: what it holds on one device and the
    collectives its gradient needs (the intra-op ILP prices each candidate with it)."""

    numel: float  # local elements before ZeRO's dp split
    layer: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    optimizer_numel: float
    syncs: tuple[GradSync, ...]
    synced_bytes: float  # its gradient bytes in the once-per-step flat sync


def parameter_part(info, pl: tuple[str, ...], outs, layer: int, shape: tuple[int, ...],
                   dpa: int | None, cpa: int | None, *, zero: int, dtype: str, optimizer: str,
                   runtime: RuntimeModel, fp32_grads: bool = False) -> ParamPart:
    """Model state and gradient collectives of one parameter stored as ``pl``, read by
    operators whose (output, read-as) placements are ``outs`` (``parameter_walk``).
    ``fp32_grads``: its gradient stays fp32 whatever ``runtime.grad_bytes`` says (NeMo's
    word embedding, ``RuntimeModel.fp32_embedding_grads``)."""
    # the ZeRO/FSDP group: dp, or dp x cp where the engine shards over both
    dp = (shape[dpa] if dpa is not None else 1) * (shape[cpa] if cpa is not None else 1)
    numel = info.numel / split_factor(pl, shape, skip_axis=dpa if zero >= 3 else None)
    gb = GRAD_BYTES if dtype == ComputeDtype.FP32 or fp32_grads else runtime.grad_bytes
    # the 16-bit remainder of a master needs bf16 weights as its high half (Apex's
    # store_param_remainders); fp16 or fp8 weights keep a whole fp32 master
    master = runtime.master_bytes if dtype == ComputeDtype.BF16 else MASTER_BYTES
    w, g, o = model_state_bytes(numel, dtype=dtype, optimizer=optimizer, zero=zero, dp=dp,
                                grad_bytes=gb, master_bytes=master)
    if runtime.full_grad_accumulation and (
            zero == 2 or (zero >= 3 and not runtime.zero3_per_use)):
        # the full gradient, reduce-scattered once per step (the graph engine's ZeRO-2;
        # a module-engine pipeline stage at ZeRO-2 or 3, DECISIONS 61)
        g = numel * gb
    if dtype == ComputeDtype.FP32 and dp > 1 and zero in (1, 2):
        # the fp32 shard the optimizer steps, beside the full weights: the graph
        # engine's ZeRO-1/2 master, FSDP2's shard (under bf16: the master counted in
        # the optimizer column)
        w += numel * MASTER_BYTES / dp
    elif dtype == ComputeDtype.FP32 and dp > 1 and zero == 0 and runtime.fsdp_keeps_shards:
        w += numel * MASTER_BYTES  # replicate's whole-tensor shard beside the gathered copy
    mine: list[GradSync] = []
    if info.trainable:
        mine = _grad_syncs(numel, pl, outs, layer, shape, dpa, zero=zero, dtype=dtype,
                           runtime=runtime, cpa=cpa, grad_bytes=gb)
        if dtype == ComputeDtype.FP8 and runtime.fp8_all_gather and layer >= 0 \
                and len(info.shape) == 2:  # a block linear's weight, gathered in fp8
            mine = [replace(s, weight_bytes=s.weight_bytes / 2) for s in mine]
    return ParamPart(numel=numel, layer=layer, weights_bytes=w, grads_bytes=g,
                     optimizer_bytes=o, optimizer_numel=numel / (dp if zero >= 1 else 1),
                     syncs=tuple(mine),
                     synced_bytes=max((s.grad_bytes for s in mine if not s.per_use),
                                      default=0.0))


def _cached_parameter_walk(cache: dict | None, stage: Stage, graph: OpGraph, consumer_out: dict,
                           *, dtype: str, optimizer: str, runtime: RuntimeModel) -> ParamWalk:
    """``parameter_walk``, kept in ``cache`` for stages that share their parameter dict and
    operator walk (by identity) and differ only in what the walk does not read: recompute,
    the pipeline position, the schedule (the search's probes of one range and ZeRO stage)."""
    if cache is None:
        return parameter_walk(stage, graph, consumer_out, dtype=dtype, optimizer=optimizer,
                              runtime=runtime)
    # dp_axis reads the stage's inputs where no axis is named dp; NeMo's fp32 embedding
    # gradient reads the graph's operators (a neighbourhood graph shares only its params)
    nodes = graph.nodes if runtime.fp32_embedding_grads else None
    key = ("param-walk", id(stage.params), id(consumer_out), id(graph.params), id(nodes),
           repr(stage.inputs), graph.block_module, stage.mesh_shape, stage.axis_names,
           stage.zero, dtype, optimizer, runtime)
    hit = cache.get(key)
    if hit is not None and hit[0] is stage.params and hit[1] is consumer_out and \
            hit[2] is graph.params and hit[4] is nodes:
        return hit[3]
    walk = parameter_walk(stage, graph, consumer_out, dtype=dtype, optimizer=optimizer,
                          runtime=runtime)
    cache[key] = (stage.params, consumer_out, graph.params, walk, nodes)
    return walk


def _zero_cp_axis(stage: Stage, runtime: RuntimeModel) -> int | None:
    """The cp axis when the engine's ZeRO/FSDP group spans dp x cp
    (``RuntimeModel.zero_over_cp``) and the stage shards state (ZeRO >= 1); else None."""
    if not runtime.zero_over_cp or stage.zero < 1 or "cp" not in stage.axis_names:
        return None
    a = stage.axis_names.index("cp")
    return a if stage.mesh_shape[a] > 1 else None


def _grad_syncs(numel: float, placement: tuple[str, ...], outs, layer: int,
                shape: tuple[int, ...], dpa: int | None, *, zero: int, dtype: str,
                runtime: RuntimeModel, cpa: int | None = None,
                grad_bytes: float = GRAD_BYTES) -> list[GradSync]:
    """The gradient is partial on an axis where an operator split on it reads the weight
    whole (R); a weight read as P (a row-parallel bias) has the same gradient everywhere.
    It is reduced where the weight is replicated, and always over dp (ZeRO shards keep
    their slice of the reduced gradient).

    ``cpa``: the cp axis belongs to the ZeRO group (dp x cp, as Megatron's distributed
    optimizer and torchtitan's FSDP over dp_shard x cp shard): the flattened group's
    reduce-scatter is priced as its hierarchical form, a reduce-scatter over cp of the
    whole gradient, then the dp axis's collective on the 1/cp piece each cp rank keeps;
    the updated (or ZeRO-3 gathered) weights come back the mirror way."""
    out = []
    cp = shape[cpa] if cpa is not None else 1
    synced_on_cp = cpa is not None and any(o[cpa] != REPLICATE and used[cpa] != PARTIAL
                                            for o, used in outs)
    for axis, size in enumerate(shape):
        if size == 1 or not any(o[axis] != REPLICATE and used[axis] != PARTIAL
                                for o, used in outs):
            continue
        if placement[axis] != REPLICATE and axis != dpa:
            continue
        on_dp = axis == dpa or axis == cpa
        kind = Collective.REDUCE_SCATTER if (axis == cpa or (on_dp and zero >= 2)) \
            else Collective.ALL_REDUCE
        if kind == Collective.REDUCE_SCATTER and runtime.reduce_scatter_as_all_reduce:
            kind = Collective.ALL_REDUCE
        piece = cp if axis == dpa and synced_on_cp else 1
        out.append(GradSync(kind=kind, axis=axis, grad_bytes=numel * grad_bytes / piece,
                            weight_bytes=numel * (4 if dtype == ComputeDtype.FP32 else 2) / piece,
                            layer=layer, uses=max(1, len(outs)), on_dp=on_dp,
                            per_use=axis == dpa and zero >= 3 and runtime.zero3_per_use))
    return out


def param_layer(name: str, graph: OpGraph) -> int:
    """The block a parameter belongs to (its ZeRO-3 / FSDP unit), -1 outside the blocks."""
    return _param_layer(name, graph)


def token_embedding_reads(graph: OpGraph) -> set[str]:
    """The weights of the embeddings indexed by the token ids (a graph input, through
    views), under the names the lookups read them by; not a position embedding, indexed by
    positions built inside the graph."""
    from_ids = {name for name, _ in graph.inputs}
    found = set()
    for n in graph.nodes:
        acts = [i for i in n.inputs if i not in graph.param_map]
        if n.kind == OpKind.VIEW and acts and acts[0] in from_ids:
            from_ids.add(n.name)
        if n.kind == OpKind.EMBEDDING and any(i in from_ids for i in acts):
            found.update(p for p in n.params if p in graph.param_map)
    return found


def with_ties(graph: OpGraph, names: set[str]) -> set[str]:
    """``names`` and every parameter name tied to one of them."""
    roots = {graph.param_map[p].tied_to or p for p in names}
    return set(names) | roots | {p.name for p in graph.params if p.tied_to in roots}


def _embedding_weights(graph: OpGraph) -> set[str]:
    """The word embedding under every name tied to it (GPT-2's lookup reads
    ``lm_head.weight``, tied to ``transformer.wte.weight``)."""
    return with_ties(graph, token_embedding_reads(graph))


def _param_layer(name: str, graph: OpGraph) -> int:
    prefix = graph.block_module + "."
    if graph.block_module and name.startswith(prefix):
        head = name[len(prefix):].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return -1
