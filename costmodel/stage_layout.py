"""Stage layout: how a stage's placements cut its tensors, and what its activations hold.

trace -> **cost** -> solve -> run. The placement arithmetic every part of the cost model shares:
``split_factor`` (pieces a tensor is cut into), ``reshard_collectives`` (the collectives turning
one placement into another on one axis), ``dp_axis``, the placements each operator reads
(``_placements``, ``_received_placements``, ``_split_of``), ``chunked_loss_stage`` (the loss
computed on sequence chunks) and ``stage_activation_profile``, the activation bytes per layer of
one microbatch (``costmodel/memory.py`` does the counting).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from meshplan.costmodel.comm import Collective
from meshplan.costmodel.compute import DTYPE_BYTES, attention_saved_bytes
from meshplan.costmodel.eager import cached_element_bytes
from meshplan.costmodel.fusion import recomputed_inside
from meshplan.costmodel.kernel_paths import factory_source, value_shape
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import (ActivationProfile, activation_profile, alias_root,
                                       alternate_matmuls, tensor_bytes)
from meshplan.costmodel.partition import compiled_saved
from meshplan.graph import OpGraph, OpKind
from meshplan.placements import PARTIAL, REPLICATE, shard, shard_dim
from meshplan.plan import Stage


@lru_cache(maxsize=1 << 16)
def split_factor(placements: tuple[str, ...], mesh_shape: tuple[int, ...],
                 skip_axis: int | None = None) -> int:
    """How many pieces a tensor (or an operator's work) is cut into by these placements."""
    n = 1
    for axis, (pl, size) in enumerate(zip(placements, mesh_shape)):
        if pl != REPLICATE and axis != skip_axis:
            n *= size
    return n


def reshard_collectives(src: str, dst: str, *, needs_grad: bool) -> tuple[str | None, str | None]:
    """(forward collective, backward collective) turning placement ``src`` into ``dst`` on
    one axis. R->S is a local slice whose gradient is all-gathered."""
    if src == dst:
        return None, None
    if src == PARTIAL:
        if dst == REPLICATE:
            return Collective.ALL_REDUCE, None
        return Collective.REDUCE_SCATTER, (Collective.ALL_GATHER if needs_grad else None)
    if src.startswith("S"):
        if dst == REPLICATE:
            return Collective.ALL_GATHER, (Collective.REDUCE_SCATTER if needs_grad else None)
        if dst.startswith("S"):
            return Collective.ALL_TO_ALL, (Collective.ALL_TO_ALL if needs_grad else None)
        return None, None  # S -> P: local
    if dst.startswith("S"):
        return None, (Collective.ALL_GATHER if needs_grad else None)
    return None, None  # R -> P: local


def dp_axis(stage: Stage) -> int | None:
    """The data-parallel axis: named "dp", else the axis the first input's batch is split on."""
    if "dp" in stage.axis_names:
        return stage.axis_names.index("dp")
    for pl in stage.inputs.values():
        for axis, p in enumerate(pl):
            if p == shard(0):
                return axis
    return None


# -- memory: activations and buffers ----------------------------------------------------------

def stage_activation_profile(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
                             microbatches: int, seq_len: int, attention: str = "flash",
                             cache: dict | None = None,
                             fused: bool = False, precision: str = "",
                             compiled: bool = False,
                             local_factories: bool = False) -> ActivationProfile:
    """Activation bytes per layer of one microbatch on one device of ``stage``. It does not
    depend on recompute, ZeRO or the schedule, so ``cache`` keeps it for every plan that
    shares ``stage.ops``. ``fused``: the stack's fused kernels keep only what they
    materialize (``RuntimeModel.fused_activations``). ``precision``: the mixed precision of
    an engine that runs the model with eager autograd ("autocast" or "fsdp",
    ``RuntimeModel.eager_activations``), whose kept tensors are priced at the dtypes eager
    PyTorch holds them in (``memory.activation_profile``); "": every float in ``dtype``.
    ``compiled``: the blocks run under torch.compile, whose partitioner keeps its own
    choice of tensors (``_compiled_blocks``, costmodel/partition.py); the operators outside
    the blocks keep what eager autograd keeps. ``local_factories``: the engine runs the
    user's modules on each rank's shard (``RuntimeModel.local_factories``), so a tensor a
    factory sizes from another tensor's shape is split as that tensor
    (``factory_split``)."""
    m = max(1, microbatches)
    key = ("activations", id(stage.ops), id(stage.inputs), stage.mesh_shape, m, dtype,
           hw.device.name, seq_len, attention, fused, precision, compiled, local_factories)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is stage.ops and hit[1] is stage.inputs:
        return hit[2]
    placement = _placements(stage)
    read_as = _received_placements(stage, graph, placement)
    shape = stage.mesh_shape

    def placed_split(tensor: str) -> int:
        pl = placement.get(tensor) or read_as.get(tensor)
        return split_factor(pl, shape) if pl else 1

    def split_of(tensor: str) -> int:
        if local_factories:
            local = factory_split(graph, tensor,
                                  lambda t: placement.get(t) or read_as.get(t), shape)
            if local is not None:
                return local
        return placed_split(tensor)

    names = list(stage.ops)
    dbytes = DTYPE_BYTES[dtype]
    # s x s tensors an attention core keeps (materialized, or CPU math with dropout), each
    extra = max((attention_saved_bytes(graph.node(n), hw, attention, dtype, split_of(n) * m)
                 for n in names), default=0.0)
    sizes, cast = None, 0
    if precision:
        sizes = cached_element_bytes(graph, dtype=dtype, precision=precision)
        if precision == "autocast" and dbytes < 4:
            cast = dbytes

    def read_split(name: str, k: int) -> int:  # how ``name`` reads its input k
        op = stage.ops.get(name)
        if op is not None and k < len(op.inputs) and op.inputs[k]:
            return split_factor(op.inputs[k], shape)
        return split_of(graph.node(name).inputs[k])

    prof = activation_profile(graph, names, split_of=split_of, dtype_bytes=dbytes,
                              seq_len=seq_len, micro_fraction=1.0 / m,
                              attention_extra_per_node=extra,
                              recomputed=recomputed_inside(graph, names) if fused else None,
                              sizes=sizes, autocast_bytes=cast, read_split=read_split)
    if compiled:
        # autocast's copy of a matmul input is made as the matmul reads it (a sequence-
        # parallel input gathered first is cast whole): the least split of its readers
        read_as_copy: dict[str, int] = {}
        for n in names if cast else ():
            node = graph.node(n)
            if node.kind in (OpKind.MATMUL, OpKind.ATTENTION):
                for k, i in enumerate(node.inputs):
                    if i not in graph.param_map:
                        for v in (i, alias_root(i, graph, copies=True)):
                            read_as_copy[v] = min(read_as_copy.get(v, 1 << 30),
                                                  read_split(n, k))
        prof = _compiled_blocks(prof, graph, names, sizes, dbytes, cast, m, split_of, extra,
                                read_as_copy)
    if cache is not None:
        cache[key] = (stage.ops, stage.inputs, prof)
    return prof


def factory_split(graph: OpGraph, name: str, placement_of,
                  mesh_shape: tuple[int, ...]) -> int | None:
    """Pieces a factory's output is cut into on an engine that runs the user's modules on
    each rank's shard, or None where ``name`` is no factory sized from a tensor argument.

    The plan places every creation operator replicated (planner/manual.py: it reads no
    activation value), which is how the graph engine runs it: DTensor's ``new_factory``
    rule replicates a new shape, at the traced (global) sizes. The user's module instead
    reads the sizes off its local tensor (DeepSeek-V3's multi-latent attention builds its
    keys as ``kv_nope.new_empty(*kv_nope.shape[:-1], d)`` and copies into them: transformers
    ``DeepseekV3Attention.expand_kv``), so each dimension the factory keeps from its
    argument (same traced size) is cut as the argument is cut on it. Priced replicated, the
    keys of every DeepSeek-V3 layer were dp times their size (12 GiB per layer at dp 64 and
    4,096 tokens instead of 192 MiB). ``placement_of(tensor)``: its placements, or None."""
    src = factory_source(graph, name)
    src_pl = placement_of(src) if src is not None else None
    if src_pl is None:
        return None
    out, src_shape = graph.node(name).out.shape, value_shape(graph, src)
    n = 1
    for pl, size in zip(src_pl, mesh_shape):
        d = shard_dim(pl)
        if d is not None and d < min(len(out), len(src_shape)) and out[d] == src_shape[d]:
            n *= size
    return n


def _compiled_blocks(prof: ActivationProfile, graph: OpGraph, names: list[str], sizes,
                     dbytes: int, cast: int, m: int, split_of,
                     attention_extra: float = 0.0,
                     read_as_copy: dict | None = None) -> ActivationProfile:
    """``prof`` with each block's kept bytes as torch.compile's partitioner keeps them
    (costmodel/partition.py), each value at the dtype eager PyTorch gives it (``sizes``), a
    matmul's autocast copy at ``cast`` bytes, an attention's output with its fp32
    logsumexp and the s x s tensors of an attention that materializes them
    (``attention_extra``): under no recompute the min cut (the block's input included),
    under selective checkpointing the policy's saved outputs the backward reads (the block's
    input is counted in ``boundary``): every parameter matmul (the module engine's policy,
    ``kept_matmuls``) or torchtitan's alternate matmuls and attention (``kept_alternate``);
    Korthikanti's selective recompute (``kept_selective``) keeps no more than the cut."""
    inputs = dict(graph.inputs)

    def nbytes(value: str, per: int | None = None, read: bool = False) -> float:
        if per is None:
            per = sizes.get(value, dbytes) if sizes is not None else dbytes
        if read and read_as_copy and value in read_as_copy:  # autocast's copy, as read
            return tensor_bytes(value, graph, per, inputs) / m / max(1, read_as_copy[value])
        b = tensor_bytes(value, graph, per, inputs)
        node = graph.node(value) if value in graph else None
        if node is not None and node.kind == OpKind.ATTENTION and node.out is not None \
                and node.out.shape:  # SDPA's logsumexp, fp32, one per query row
            b += node.out.numel / node.out.shape[-1] * 4
        return b / m / max(1, split_of(value))

    def own(value: str, ops: set) -> bool:  # made in the block, not its input
        return value in ops or value.startswith(("cast:", "mask:"))

    by_layer: dict[int, list[str]] = {}
    for n in names:
        layer = graph.node(n).layer
        if layer >= 0:
            by_layer.setdefault(layer, []).append(n)
    recomputed = alternate_matmuls(graph)
    kept, selective, matmuls, alternate = dict(prof.kept), dict(prof.kept_selective), \
        dict(prof.kept_matmuls), dict(prof.kept_alternate)
    for layer, ops in by_layer.items():
        block = set(ops)
        attention = {n for n in ops if graph.node(n).kind == OpKind.ATTENTION}
        materialized = attention_extra * len(attention)
        kept[layer] = sum(compiled_saved(graph, ops, nbytes, cast=cast,
                                         sizes=sizes).values()) + materialized
        selective[layer] = min(selective.get(layer, kept[layer]), kept[layer])
        param_mm = {n for n in ops if graph.node(n).kind == OpKind.MATMUL
                    and any(i in graph.param_map for i in graph.node(n).inputs)}
        for table, tagged in ((matmuls, param_mm),
                              (alternate, {n for n in param_mm if n not in recomputed}
                               | attention)):
            saved = compiled_saved(graph, ops, nbytes, must_save=tagged, cast=cast,
                                   sizes=sizes)
            table[layer] = sum(b for v, b in saved.items() if own(v, block)) + (
                materialized if table is alternate else 0.0)
    return replace(prof, kept=kept, kept_selective=selective, kept_matmuls=matmuls,
                   kept_alternate=alternate)


def _placements(stage: Stage) -> dict:
    """Placement of every value the stage produces or takes as input."""
    placement = {n: stage.inputs.get(n) for n in stage.inputs}
    placement.update({n: op.output for n, op in stage.ops.items()})
    return placement


def _split_of(stage: Stage, graph: OpGraph):
    """How many pieces a value of ``stage`` is cut into, as ``stage_activation_profile``
    counts it (its placement here, or as its first consumer receives it)."""
    placement = _placements(stage)
    read_as = _received_placements(stage, graph, placement)

    def split_of(tensor: str) -> int:
        pl = placement.get(tensor) or read_as.get(tensor)
        return split_factor(pl, stage.mesh_shape) if pl else 1
    return split_of


def _received_placements(stage: Stage, graph: OpGraph, placement: dict) -> dict:
    """A tensor another stage produced lives here as its first consumer reads it (the
    placement the send/recv delivers, as ``p2p_bytes`` prices it), not whole."""
    read_as: dict[str, tuple[str, ...]] = {}
    for name in stage.ops:
        for k, src in enumerate(graph.node(name).inputs):
            if src not in placement and src not in graph.param_map \
                    and k < len(stage.ops[name].inputs):
                read_as.setdefault(src, stage.ops[name].inputs[k])
                read_as.setdefault(alias_root(src, graph), stage.ops[name].inputs[k])
    return read_as


def chunked_loss_stage(stage: Stage, graph: OpGraph, cache: dict | None = None) -> Stage:
    """``stage`` with the operators after its last block (final norm, head, the loss)
    computed on each rank's cp chunk: every one of them that reads an activation or a graph
    input (the labels, sliced to the rank's chunk) is split on the cp axis, reading its
    inputs as they are produced (no gather). The stage as PyTorch's context_parallel runs
    it (``RuntimeModel.cp_composable``); unchanged without a cp axis or a tail."""
    if "cp" not in stage.axis_names:
        return stage
    # the cache keeps the chunked operators only: stages that share ``stage.ops`` (every
    # recompute and ZeRO choice of one range in the pipeline search) differ in the rest
    key = ("chunked-loss", id(stage.ops))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is stage.ops:
        return replace(stage, ops=hit[1])
    ax = stage.axis_names.index("cp")
    names = list(stage.ops)
    last_block = max((i for i, n in enumerate(names) if graph.node(n).layer >= 0), default=-1)
    placement = _placements(stage)
    ops = dict(stage.ops)
    for name in names[last_block + 1:]:
        node, op = graph.node(name), stage.ops[name]
        reads = [k for k, i in enumerate(node.inputs)
                 if i not in graph.param_map and k < len(op.inputs) and op.inputs[k]]
        if not reads or not op.output or graph.node(name).kind == OpKind.CREATION:
            continue
        inputs = list(op.inputs)
        for k in reads:
            src = placement.get(node.inputs[k])
            if src:
                inputs[k] = _set_axis(inputs[k], ax, src[ax])
        out = op.output if op.output[ax] != REPLICATE else _set_axis(op.output, ax, shard(0))
        ops[name] = replace(op, inputs=tuple(inputs), output=out)
        placement[name] = out
    if cache is not None:
        cache[key] = (stage.ops, ops)
    return replace(stage, ops=ops)


def _set_axis(placements: tuple[str, ...], axis: int, value: str) -> tuple[str, ...]:
    return tuple(value if a == axis else p for a, p in enumerate(placements))


def _feeds_split(stage: Stage, graph: OpGraph, axis: int) -> set[str]:
    """Operators whose output is replicated on ``axis`` and reaches, through replicated
    views only, an operator split on it: where a replicated value's gradient is partial."""
    out: set[str] = set()
    for name in reversed(list(stage.ops)):  # consumers come later in graph order
        op = stage.ops[name]
        if not op.output or op.output[axis] != REPLICATE:
            continue
        for user in graph.users.get(name, ()):
            uop = stage.ops.get(user)
            if uop is not None and uop.output and (uop.output[axis] != REPLICATE or (
                    user in out and graph.node(user).kind == OpKind.VIEW)):
                out.add(name)
                break
    return out


def value_bytes(graph: OpGraph, name: str, dtype: str) -> float:
    """Bytes of one value (an operator's outputs or a graph input) in the compute dtype, as
    the operator walk prices its redistribution (the whole traced batch)."""
    return _bytes(graph, name, DTYPE_BYTES[dtype])


def _bytes(graph: OpGraph, name: str, dbytes: int) -> float:
    metas = graph.node(name).outputs if name in graph else \
        tuple(m for n, m in graph.inputs if n == name)
    return sum(mm.numel * (dbytes if mm.dtype.startswith(("float", "bfloat")) else
                           mm.bytes / max(1, mm.numel)) for mm in metas)
