"""Operators: compute and activation communication of one microbatch of a stage.

trace -> **cost** -> solve -> run. ``_operator_pass`` walks a stage's operators once
(``_OperatorPass``, cached per placement): each operator's forward and backward time at its
per-device share (``operator_time``: eager kernels, fused and fp8 kernels, causal attention),
the collectives of each input edge whose placement differs from the one it reads
(``input_collectives``), and the recompute and tensor-parallel overlap built on them.
``OperatorPricer`` prices one operator and one edge the same way for the intra-op ILP and
``meshplan explain``; the eager-kernel walks are cached here (``_cached_eager_kernels``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.costmodel import fp8 as fp8_model
from meshplan.costmodel.comm import Collective, CollectivePrices
from meshplan.costmodel.compute import DTYPE_BYTES, OpTime, materialized_attention_time, op_time
from meshplan.costmodel.eager import EagerOp, MEMORY_BOUND, eager_kernels, eager_time
from meshplan.costmodel.fusion import fused_by_member, fused_time
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import alias_root, alternate_matmuls, causal_masks, mask_builders
from meshplan.costmodel.runtime_profiles import RuntimeModel
from meshplan.costmodel.stage_layout import (_bytes, _feeds_split, _placements, reshard_collectives,
                                             split_factor)
from meshplan.graph import OpGraph, OpKind
from meshplan.placements import PARTIAL, REPLICATE
from meshplan.plan import Stage
from meshplan.vocabulary import Recompute


@dataclass(frozen=True, slots=True)
class _OperatorPass:
    """What one walk over a stage's operators yields; it depends on the placements, the
    microbatch count and the contention only, not on recompute, ZeRO-1/2 or the schedule."""

    ops: dict  # the stage.ops and stage.inputs it was computed for (identity-checked)
    inputs: dict
    fwd: float
    bwd: float
    rec_full: float
    rec_sel: float
    rec_nonmatmul: float  # block operators other than parameter matmuls (module engine)
    comm_fwd: float
    comm_bwd: float
    comm_layers_fwd: float
    p2p_bytes: float
    consumer_out: dict
    # the tensor-parallel ("tp" axis) share of comm_fwd / comm_bwd / comm_layers_fwd, and the
    # parameter matmuls' compute it can overlap (RuntimeModel.tp_comm_overlap)
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    tp_layers_fwd: float = 0.0
    mm_fwd: float = 0.0
    mm_bwd: float = 0.0
    tp: int = 1
    # torchtitan's op-level selective AC: every block operator but its attention kernels and
    # its odd parameter matmuls (memory.alternate_matmuls)
    rec_alternate: float = 0.0


def _cached_operator_pass(cache: dict | None, stage: Stage, graph: OpGraph, hw: HardwareProfile,
                          dtype: str, m: int, contention: float, coll,
                          backend: str = "nccl", attention: str = "flash", *,
                          causal: bool = False, cp_composable: bool = False,
                          compiled: bool = False, fp8=None, eager: str = "",
                          skip_masks: bool = False, accumulating: int = 0) -> _OperatorPass:
    """The operator walk, reused across plans that share ``stage.ops`` (a sweep prices
    thousands of configurations over a few dozen placement sets). ``causal``: attention
    that reads a causal mask runs with ``is_causal=True`` (``RuntimeModel.causal_attention``);
    ``skip_masks``: the engine builds no causal mask (``RuntimeModel.causal_mask_skipped``),
    so the operators that only build one cost nothing (``memory.mask_builders``);
    ``accumulating``: the microbatches whose gradients eager autograd adds into ``.grad``
    (0: all ``m``; 1: none, where FSDP2 reduce-scatters each microbatch's gradients)."""
    accumulating = accumulating or m
    key = (id(stage.ops), id(stage.inputs), stage.mesh_shape, stage.devices[:1], m, dtype,
           contention, id(hw), backend, attention, causal, cp_composable, compiled, fp8, eager,
           skip_masks, accumulating)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit.ops is stage.ops and hit.inputs is stage.inputs:
        return hit
    kernels = _cached_eager_kernels(cache, graph, dtype, eager, accumulating, compiled) \
        if eager else None
    times = None
    if cache is not None:
        # operator times of this configuration, shared by every stage that holds the
        # operator with the same placement (the search's overlapping probes of a range)
        whole = graph.whole or graph  # a cut graph holds the whole one's operators
        tkey = ("op-times", id(whole), id(hw), id(kernels), dtype, m, contention,
                stage.mesh_shape, attention)
        hit = cache.get(tkey)
        if hit is None or hit[0] is not whole or hit[1] is not hw or hit[2] is not kernels:
            hit = cache[tkey] = (whole, hw, kernels, {})
        times = hit[3]
    result = _operator_pass(stage, graph, hw, dtype, m, contention, coll, attention,
                            causal=causal, cp_composable=cp_composable, compiled=compiled, fp8=fp8,
                            kernels=kernels, times=times, skip_masks=skip_masks)
    if cache is not None:
        cache[key] = result
    return result


def _recompute_s(ops: _OperatorPass, recompute: str,
                 runtime: RuntimeModel) -> tuple[float, float]:
    """(recomputed forward compute, its activation collectives) per microbatch. "full"
    reruns every block operator's forward with its collectives; "selective" the attention
    core (Korthikanti et al. 2022, section 5), or, in the module engine, every block
    operator but the parameter matmuls (``RuntimeModel.selective_keeps_matmuls``), or in
    torchtitan every one but the attention kernels and the odd unbiased parameter matmuls
    (``RuntimeModel.selective_alternate_matmuls``)."""
    if recompute == Recompute.FULL:
        return ops.rec_full, ops.comm_layers_fwd
    if recompute == Recompute.SELECTIVE:
        if runtime.selective_keeps_matmuls:
            return (ops.rec_alternate if runtime.selective_alternate_matmuls
                    else ops.rec_nonmatmul), 0.0
        return ops.rec_sel, 0.0
    return 0.0, 0.0


def _tp_overlap_hidden_s(ops: _OperatorPass, recompute: str) -> float:
    """Tensor-parallel communication hidden behind the parameter matmuls that consume or
    produce it, per microbatch (``RuntimeModel.tp_comm_overlap``). The overlap decomposes
    each all-gather + GEMM (and GEMM + reduce-scatter) into tp chunks exchanged in a ring
    while the previous chunk's GEMM runs (Wang et al., ASPLOS'23, "Overlap communication with
    dependent computation via decomposition"; Megatron-Core ``--tp-comm-overlap`` with
    Transformer Engine userbuffers; PyTorch's async TP, ``torch.distributed._symmetric_memory``
    as torchtitan enables it): one chunk of the communication stays exposed, and no more
    is hidden than the matmuls take. Per pass: hidden = comm - max(comm / tp, comm - matmuls)."""
    if ops.tp <= 1:
        return 0.0

    def hidden(comm: float, matmuls: float) -> float:
        return comm - max(comm / ops.tp, comm - matmuls) if comm > 0 else 0.0

    out = hidden(ops.tp_fwd, ops.mm_fwd) + hidden(ops.tp_bwd, ops.mm_bwd)
    if recompute == Recompute.FULL:  # the recomputed forward's collectives overlap the same way
        out += hidden(ops.tp_layers_fwd, ops.mm_fwd)
    return out


# the last walks, across estimates that share no cache (the search's final pricing of each
# candidate plan): (id(graph), dtype, precision, m, compiled) -> (graph, kernels)
_EAGER_WALKS: dict = {}


_EAGER_WALKS_KEPT = 64


def _cached_eager_kernels(cache: dict | None, graph: OpGraph, dtype: str, precision: str,
                          m: int, compiled: bool) -> dict:
    """``eager.eager_kernels`` of every operator of the graph (a stage reads its own): one
    walk per graph, dtype, precision and microbatch count, kept in ``cache``. A graph cut
    from a whole one (``OpGraph.whole``: the pipeline search's neighbourhoods, which eager.py
    prices as on the whole graph) reads the whole graph's walk: one walk, not one per range."""
    graph = graph.whole or graph
    key = ("eager-kernels", id(graph), dtype, precision, m, compiled)
    for store in (cache, _EAGER_WALKS):
        hit = store.get(key) if store is not None else None
        if hit is not None and hit[0] is graph:
            return hit[1]
    if m > 2:  # only ``.grad`` accumulation depends on m, as (m - 1) / m and the
        # accumulator's making as 1 / m: scale m = 2's walk
        def scaled(kernels, scale):
            return tuple(replace(k, read_bytes=k.read_bytes * scale,
                                 written_bytes=k.written_bytes * scale) for k in kernels)
        two = _cached_eager_kernels(cache, graph, dtype, precision, 2, compiled)
        kernels = {name: replace(op, accumulate=scaled(op.accumulate, 2 * (m - 1) / m),
                                 accumulate_first=scaled(op.accumulate_first, 2 / m))
                   if op.accumulate else op for name, op in two.items()}
    else:
        kernels = eager_kernels(graph, [n.name for n in graph.nodes], dtype=dtype,
                                precision=precision, microbatches=m, compiled=compiled)
    if cache is not None:
        cache[key] = (graph, kernels)
    if len(_EAGER_WALKS) >= _EAGER_WALKS_KEPT:
        _EAGER_WALKS.clear()
    _EAGER_WALKS[key] = (graph, kernels)
    return kernels


def _operator_pass(stage: Stage, graph: OpGraph, hw: HardwareProfile, dtype: str, m: int,
                   contention: float, coll, attention: str = "flash", *,
                   causal: bool = False, cp_composable: bool = False,
                   compiled: bool = False, fp8=None, kernels: dict | None = None,
                   times: dict | None = None, skip_masks: bool = False) -> _OperatorPass:
    """``kernels``: each operator's eager kernels (``RuntimeModel.eager_kernels``,
    costmodel/eager.py), None to price every operator with ``compute.op_time``.
    ``times``: {(operator, placement): OpTime} of this hardware, dtype, microbatch count,
    contention, mesh, attention and kernels, filled and read for the operators whose
    time reads nothing else (not attention, fused groups or fp8 linears)."""
    names = list(stage.ops)
    # the graph engine drops a causal mask only where queries and keys are the same length:
    # not under its context parallelism, where each rank's queries are a chunk of the
    # sequence; PyTorch's context_parallel runs causal SDPA on the balanced chunks
    masks = causal_masks(graph) if causal and (cp_composable or "cp" not in stage.axis_names) \
        else set()
    in_stage = set(names)
    shape = stage.mesh_shape
    placement = _placements(stage)
    needs_grad = graph.grad_nodes
    needs_data = graph.data_nodes
    sent: set[str] = set()
    dbytes = DTYPE_BYTES[dtype]

    fwd = bwd = rec_full = rec_sel = rec_nonmatmul = rec_alternate = 0.0
    recomputed_mm = alternate_matmuls(graph)
    comm_fwd = comm_bwd = comm_layers_fwd = p2p_bytes = 0.0
    tp_ax = stage.axis_names.index("tp") if "tp" in stage.axis_names else None
    tp_fwd = tp_bwd = tp_layers_fwd = mm_fwd = mm_bwd = 0.0
    # context parallelism (runtime/graph/context.py): a value gathered over cp for split consumers
    # (K, V) gets its partial gradient all-reduced once where it was gathered, not again at
    # each consumer; one gathered for replicated consumers (logits before the shifted loss)
    # gets the same gradient on every rank, and each keeps its chunk
    cp_ax = stage.axis_names.index("cp") if "cp" in stage.axis_names else None
    feeds_split = _feeds_split(stage, graph, cp_ax) if cp_ax is not None else set()
    consumer_out: dict[str, list[tuple[tuple[str, ...], tuple[str, ...]]]] = {}
    if skip_masks:  # the engine builds no causal mask (nor the key / value repeats it needs)
        unbuilt = mask_builders(graph)
        names = [n for n in names if n not in unbuilt]
    fused = fused_by_member(graph, names) if compiled else {}  # torch.compile's kernels
    reads = first_reads(stage, graph) if fp8 is not None else {}
    for name in names:
        node = graph.node(name)
        op = stage.ops[name]
        group = fused.get(name)
        w8 = fp8_model.fp8_weight_input(node, graph) if fp8 is not None else None
        tkey = (name, op) if times is not None and group is None and w8 is None and \
            node.kind != OpKind.ATTENTION and not compiled else None
        t = times.get(tkey) if tkey is not None else None
        if t is None:
            t = operator_time(node, op, graph, hw, dtype, shape, m, contention, group=group,
                              kernels=kernels, attention=attention, fp8=fp8,
                              causal=causal_attention(node, graph, masks,
                                                       cp_composable or cp_ax is None),
                              kv_chunks=ring_kv_chunks(node, op, shape, cp_ax, cp_composable),
                              x_src=_x_src(node, w8, graph, placement), out_read=reads.get(name))
            if tkey is not None:
                times[tkey] = t
        if w8 is not None and tp_ax is not None:  # tensorwise amax of TP-sharded casts
            af, ab = _amax_s(node, op, graph, shape, m, w8, fp8, tp_ax, coll, placement, reads)
            comm_fwd += af
            comm_layers_fwd += af
            tp_fwd += af
            tp_layers_fwd += af
            comm_bwd += ab
            tp_bwd += ab
        fwd += t.forward_s
        bwd += t.backward_s
        if node.layer >= 0:
            rec_full += t.forward_s
            if selective_recomputes(node, graph, group):
                rec_sel += t.forward_s
            if not (node.kind == OpKind.MATMUL
                    and any(i in graph.param_map for i in node.inputs)):
                rec_nonmatmul += t.forward_s
                if node.kind != OpKind.ATTENTION:
                    rec_alternate += t.forward_s
            else:
                mm_fwd += t.forward_s
                mm_bwd += t.backward_s
                if name in recomputed_mm:
                    rec_alternate += t.forward_s
        for k, p in enumerate(node.inputs):
            if p in graph.param_map and k < len(op.inputs):
                consumer_out.setdefault(p, []).append((op.output, op.inputs[k]))
        for i, src_name in enumerate(node.inputs):
            if src_name in graph.param_map or i >= len(op.inputs):
                continue
            src = placement.get(src_name)
            if times is None:
                nbytes = _bytes(graph, src_name, dbytes) / m
            else:  # the configuration's dtype and m: one size per tensor
                nbytes = times.get(("bytes", src_name))
                if nbytes is None:
                    nbytes = times[("bytes", src_name)] = _bytes(graph, src_name, dbytes) / m
            if src_name in graph and src_name not in in_stage:
                # sent once per microbatch; tensors that depend on no data (masks, positions)
                # are rebuilt by each stage instead of sent
                if src_name not in sent and src_name in needs_data:
                    sent.add(src_name)
                    p2p_bytes += nbytes / split_factor(op.inputs[i], shape)
                continue
            if src is None:
                continue
            for axis, tf, tb in input_collectives(
                    coll, shape, nbytes, src, op.inputs[i], op.output,
                    grad=src_name in needs_grad, cp_ax=cp_ax, cp_composable=cp_composable,
                    feeds_split=name in feeds_split,
                    fp8_axis=tp_ax, fp8_gathers=fp8_model.tp_gathers_in_fp8(
                        node, src_name, graph, fp8)):
                on_tp = axis == tp_ax and node.layer >= 0
                comm_fwd += tf
                comm_layers_fwd += tf if node.layer >= 0 else 0.0
                tp_fwd += tf if on_tp else 0.0
                tp_layers_fwd += tf if on_tp else 0.0
                comm_bwd += tb
                tp_bwd += tb if on_tp else 0.0
    return _OperatorPass(ops=stage.ops, inputs=stage.inputs, fwd=fwd, bwd=bwd, rec_full=rec_full, rec_sel=rec_sel,
                         rec_nonmatmul=rec_nonmatmul, rec_alternate=rec_alternate,
                         comm_fwd=comm_fwd, comm_bwd=comm_bwd, comm_layers_fwd=comm_layers_fwd,
                         p2p_bytes=p2p_bytes, consumer_out=consumer_out, tp_fwd=tp_fwd,
                         tp_bwd=tp_bwd, tp_layers_fwd=tp_layers_fwd, mm_fwd=mm_fwd,
                         mm_bwd=mm_bwd, tp=shape[tp_ax] if tp_ax is not None else 1)


# -- one operator and one input edge: the parts the operator walk and the intra-op ILP share --

def causal_attention(node, graph: OpGraph, masks: set, user_causal_ok: bool) -> bool:
    """An attention the engine runs with ``is_causal=True``: its mask is a causal pattern the
    trace built (``masks``), or the user's code asked for it (``user_causal_ok``: not under
    the graph engine's cp, whose queries are a chunk of the sequence)."""
    return node.kind == OpKind.ATTENTION and (
        len(node.inputs) > 3 and alias_root(node.inputs[3], graph) in masks
        or _user_causal(node) and user_causal_ok)


def selective_recomputes(node, graph: OpGraph, group=None) -> bool:
    """Whether Korthikanti et al.'s selective recompute runs ``node``'s forward again: the
    attention core (attention and softmax, or a fused group holding the softmax)."""
    return node.kind in (OpKind.ATTENTION, OpKind.SOFTMAX) or (
        group is not None and any(graph.node(n).kind == OpKind.SOFTMAX for n in group.members))


def ring_kv_chunks(node, op, shape: tuple[int, ...], cp_ax: int | None,
                   cp_composable: bool) -> int:
    """K/V chunks an attention runs as under ring context parallelism: PyTorch's
    ``context_parallel`` (the module engine, torchtitan) and Transformer Engine's p2p CP
    (Megatron-LM, NeMo) pass K and V around the cp ring and run one attention kernel per
    chunk of S / cp keys (head-tail balanced: a causal kernel on the diagonal chunk, full or
    half ones on the others). The graph engine all-gathers K and V (``cp_composable`` False)
    and runs one kernel over every key: 1."""
    if node.kind != OpKind.ATTENTION or cp_ax is None or not cp_composable \
            or op.output[cp_ax] == REPLICATE:
        return 1
    return shape[cp_ax]


def first_reads(stage: Stage, graph: OpGraph) -> dict:
    """The placement each value of ``stage`` is read in by its first consumer in the stage
    (a row-parallel linear's partial output: the sequence shard its reduce-scatter gives
    under sequence parallelism, or whole after an all-reduce)."""
    reads: dict[str, tuple[str, ...]] = {}
    for name, op in stage.ops.items():
        for k, src in enumerate(graph.node(name).inputs):
            if k < len(op.inputs) and src not in graph.param_map:
                reads.setdefault(src, op.inputs[k])
    return reads


def _x_src(node, w8: int | None, graph: OpGraph, placement: dict):
    """The placement a block linear's activation input is produced in (None: not one)."""
    if w8 is None:
        return None
    for k, name in enumerate(node.inputs):
        if k != w8 and name not in graph.param_map:
            return placement.get(name)
    return None


def _sharded(pl, axis: int) -> bool:
    return pl is not None and pl[axis] not in (REPLICATE, PARTIAL)


def _amax_s(node, op, graph: OpGraph, shape, m: int, w8: int, fp8, tp_ax: int, coll,
            placement: dict, reads: dict) -> tuple[float, float]:
    """(forward, backward) seconds of a block linear's tensorwise amax all-reduces over the
    TP axis in one microbatch (``fp8.amax_all_reduces``): latency-bound scalars."""
    if shape[tp_ax] == 1:
        return 0.0, 0.0
    x_src = _x_src(node, w8, graph, placement)
    xi = next((k for k, n in enumerate(node.inputs) if k != w8 and n not in graph.param_map),
              None)
    x_pl = x_src if x_src is not None and PARTIAL not in x_src else \
        (op.inputs[xi] if xi is not None and xi < len(op.inputs) else None)
    sharded = {"x": _sharded(x_pl, tp_ax), "w": _sharded(op.inputs[w8], tp_ax),
               "dy": _sharded(op.output, tp_ax) or _sharded(reads.get(node.name), tp_ax)}
    nf, nb = fp8_model.amax_all_reduces(fp8, sharded)
    a = fp8_model.amax_all_reduce_s(coll, tp_ax, shape[tp_ax]) if nf or nb else 0.0
    return nf * a, nb * a


def operator_time(node, op, graph: OpGraph, hw: HardwareProfile, dtype: str,
                  shape: tuple[int, ...], m: int, contention: float, *, group=None,
                  kernels: dict | None = None, attention: str = "flash", fp8=None,
                  causal: bool = False, kv_chunks: int = 1, x_src=None,
                  out_read=None) -> OpTime:
    """Forward and backward seconds of one operator placed as ``op`` (an OpPlacement) for
    one of ``m`` microbatches: fp8 GEMMs, a fused group (priced at its lead), eager kernels,
    materialized attention or ``compute.op_time``, plus the eager extras (autocast's casts,
    ``.grad`` sums) of a compute-bound operator. The operator walk below and the intra-op
    ILP (planner/pricing.py) both price operators with it. ``x_src``, ``out_read``: the
    placement a block linear's input is produced in and the one its output is first read
    in, where the fp8 recipe casts before a gather (``fp8.held_elements``)."""
    name = node.name
    shard = split_factor(op.output, shape) * m
    w8 = fp8_model.fp8_weight_input(node, graph) if fp8 is not None else None
    if w8 is not None and w8 < len(op.inputs):  # a block linear's GEMMs in fp8
        t = fp8_model.linear_time(
            node, hw, fp8, shard=shard,
            weight_numel=graph.param_map[node.inputs[w8]].numel
            / split_factor(op.inputs[w8], shape), contention=contention, microbatches=m,
            held=fp8_model.held_elements(node, op, graph, shape, m, w8, fp8, x_src, out_read),
            tensor_parallel=split_factor(op.inputs[w8], shape) > 1)
    elif group is not None:  # priced once, at its first fusible operator
        t = fused_time(group, hw, dtype, shard, contention=contention) \
            if name == group.lead else OpTime(0.0, 0.0)
    elif kernels is not None and node.kind in MEMORY_BOUND + (OpKind.VIEW, OpKind.LOSS):
        t = eager_time(kernels.get(name, EagerOp()), hw, shard, contention=contention)
    elif attention == "materialized" and node.kind == OpKind.ATTENTION:
        t = materialized_attention_time(node, hw, dtype, shard, contention=contention)
    else:
        t = op_time(node, hw, dtype, shard, contention=contention, causal=causal,
                    kv_chunks=kv_chunks)
    if kernels is not None and name in kernels and node.kind not in \
            MEMORY_BOUND + (OpKind.VIEW, OpKind.LOSS):  # autocast's casts, .grad sums
        extra = kernels[name]
        w = node.inputs.index(extra.weight) if extra.weight in node.inputs else -1
        wsplit = split_factor(op.inputs[w], shape) if 0 <= w < len(op.inputs) else 1
        e = eager_time(extra, hw, shard, wsplit, contention=contention)
        t = OpTime(t.forward_s + e.forward_s, t.backward_s + e.backward_s)
    return t


def input_collectives(coll, shape: tuple[int, ...], nbytes: float, src: tuple[str, ...],
                      dst: tuple[str, ...], out: tuple[str, ...], *, grad: bool,
                      cp_ax: int | None = None, cp_composable: bool = False,
                      feeds_split: bool = False, fp8_axis: int | None = None,
                      fp8_gathers: tuple[bool, bool] = (False, False)
                      ) -> list[tuple[int, float, float]]:
    """(axis, forward s, backward s) of the collectives that give an operator with output
    placement ``out`` its input of ``nbytes`` (one microbatch, global) produced as ``src``
    and read as ``dst``: the redistribution (``reshard_collectives``) and, for an input read
    whole by an operator split on the axis, the all-reduce of its partial gradient
    (Megatron's f/g). ``feeds_split``: the consumer's replicated output reaches a cp-split
    operator (``_feeds_split``). ``fp8_gathers``: (forward, backward) all-gathers on
    ``fp8_axis`` that move 1 byte per element where ``nbytes`` counts 2
    (``fp8.tp_gathers_in_fp8``)."""
    out_list = []
    for axis in range(len(shape)):
        if shape[axis] == 1:
            continue
        buf = nbytes / split_factor(src, shape, skip_axis=axis)
        f, b = reshard_collectives(src[axis], dst[axis], needs_grad=grad)
        if axis == cp_ax and b == Collective.REDUCE_SCATTER and dst[axis] == REPLICATE:
            gathered_kv = feeds_split or (out and out[axis] != REPLICATE)
            b = None if not gathered_kv else \
                Collective.REDUCE_SCATTER if cp_composable else Collective.ALL_REDUCE
        wire_f = 0.5 if fp8_gathers[0] and axis == fp8_axis and f == Collective.ALL_GATHER \
            else 1.0
        wire_b = 0.5 if fp8_gathers[1] and axis == fp8_axis and b == Collective.ALL_GATHER \
            else 1.0
        tf = coll(f, buf * wire_f, axis) if f else 0.0
        tb = coll(b, buf * wire_b, axis) if b else 0.0
        if grad and dst[axis] == REPLICATE and out and out[axis] != REPLICATE \
                and src[axis] == REPLICATE and axis != cp_ax:
            tb += coll(Collective.ALL_REDUCE, buf, axis)
        if tf or tb:
            out_list.append((axis, tf, tb))
    return out_list


@dataclass(frozen=True)
class OperatorPricer:
    """One operator of a plan's stage priced as the operator walk prices it, at any
    placement (``meshplan explain`` prices the chosen placement and its alternatives so):
    the stage's runtime, contention, eager kernels, fused groups and causal masks."""

    stage: Stage
    graph: OpGraph
    hw: HardwareProfile
    runtime: RuntimeModel
    dtype: str
    m: int
    contention: float
    coll: CollectivePrices
    kernels: dict | None
    fused: dict
    fp8: object
    masks: set
    # block matmuls torchtitan's op-level selective AC recomputes (memory.alternate_matmuls)
    alternate: frozenset = frozenset()

    def compute_s(self, node, op) -> float:
        """Forward, backward and recomputed forward of one microbatch."""
        if self.runtime.causal_mask_skipped and node.name in mask_builders(self.graph):
            return 0.0  # the engine builds no causal mask
        cp_ax = self.stage.axis_names.index("cp") if "cp" in self.stage.axis_names else None
        group = self.fused.get(node.name)
        t = operator_time(node, op, self.graph, self.hw, self.dtype, self.stage.mesh_shape,
                          self.m, self.contention, group=group, kernels=self.kernels,
                          attention=self.runtime.attention, fp8=self.fp8,
                          causal=causal_attention(node, self.graph, self.masks,
                                                   self.runtime.cp_composable or cp_ax is None),
                          kv_chunks=ring_kv_chunks(node, op, self.stage.mesh_shape, cp_ax,
                                                   self.runtime.cp_composable),
                          **self._fp8_held(node))
        rec = self.stage.recompute
        param_mm = node.kind == OpKind.MATMUL and any(i in self.graph.param_map
                                                       for i in node.inputs)
        if not self.runtime.selective_keeps_matmuls:
            sel = selective_recomputes(node, self.graph, group)
        elif self.runtime.selective_alternate_matmuls:
            sel = node.name in self.alternate if param_mm else node.kind != OpKind.ATTENTION
        else:
            sel = not param_mm
        again = node.layer >= 0 and (rec == Recompute.FULL or rec == Recompute.SELECTIVE and sel)
        return t.total_s + (t.forward_s if again else 0.0)

    def _fp8_held(self, node) -> dict:
        """operator_time's ``x_src`` / ``out_read`` for a block linear under fp8."""
        if self.fp8 is None:
            return {}
        w8 = fp8_model.fp8_weight_input(node, self.graph)
        return {"x_src": _x_src(node, w8, self.graph, _placements(self.stage)),
                "out_read": first_reads(self.stage, self.graph).get(node.name)}

    def input_comm_s(self, node, op) -> float:
        """The collectives giving ``node`` its activation inputs in one microbatch (forward,
        backward, and the forward again under full recompute), as the walk prices them."""
        stage, graph = self.stage, self.graph
        placement = _placements(stage)
        cp_ax = stage.axis_names.index("cp") if "cp" in stage.axis_names else None
        feeds = _feeds_split(stage, graph, cp_ax) if cp_ax is not None else set()
        again = 2 if stage.recompute == Recompute.FULL and node.layer >= 0 else 1
        total = 0.0
        for i, src_name in enumerate(node.inputs):
            if src_name in graph.param_map or i >= len(op.inputs):
                continue
            src = placement.get(src_name)
            if src is None or (src_name in graph and src_name not in stage.ops):
                continue  # not a value of this stage (sent by another stage: p2p)
            total += sum(tf * again + tb for _, tf, tb in input_collectives(
                self.coll, stage.mesh_shape, _bytes(graph, src_name, DTYPE_BYTES[self.dtype])
                / self.m, src, op.inputs[i], op.output, grad=src_name in graph.grad_nodes,
                cp_ax=cp_ax, cp_composable=self.runtime.cp_composable,
                feeds_split=node.name in feeds,
                fp8_axis=stage.axis_names.index("tp") if "tp" in stage.axis_names else None,
                fp8_gathers=fp8_model.tp_gathers_in_fp8(node, src_name, graph, self.fp8)))
        return total


def _user_causal(node) -> bool:
    """An attention the user's code calls with ``is_causal=True`` (no mask to recognise):
    every engine runs it so, and flash attention skips the blocks above the diagonal."""
    args, kwargs = node.parsed_args()
    return kwargs.get("is_causal", args[5] if len(args) > 5 else False) is True


def eager_kernel_table(graph: OpGraph, dtype: str, precision: str, microbatches: int = 1,
                       compiled: bool = False, cache: dict | None = None) -> dict:
    """Every operator's eager kernels (``eager.eager_kernels``), the walk the operator walk
    reads (one per graph, dtype, precision and microbatch count)."""
    return _cached_eager_kernels(cache, graph, dtype, precision, microbatches, compiled)
