"""Parameter traffic: the time of the gradient sync, ZeRO gathers and the optimizer step.

trace -> **cost** -> solve -> run. Prices what ``costmodel/params.py`` walks: the gradient sync
once per step (all-reduce or reduce-scatter, in buckets or one flat buffer), ZeRO-3 weight
all-gathers per microbatch (per use on meshplan's graph engine, ``per_use_sync_s``,
``zero3_unit_latency_s``) and what of them the runtime hides behind compute, ZeRO-1/2
updated-shard gathers, the optimizer step (``optimizer_step_s``) and the communication
buffers at the stage's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.costmodel.comm import Collective, CollectivePrices, _bandwidth_s
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import (GRAD_BYTES, MASTER_BYTES, grad_sync_buffer_bytes,
                                       optimizer_traffic_s, zero3_buffer_bytes)
from meshplan.costmodel.params import GradSync, ParamWalk
from meshplan.costmodel.runtime_profiles import RuntimeModel
from meshplan.plan import Stage
from meshplan.vocabulary import ComputeDtype, Recompute


OPTIMIZER_OPS_PER_TENSOR = {"adam": 10, "sgd": 3}  # torch.optim _single_tensor_adam / sgd


# -- pricing the parameter traffic --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _TrafficTimes:
    step_s: float  # exposed once per step: gradient sync, ZeRO-1/2 updated-shard gathers
    microbatch_s: float  # exposed per microbatch: per-use ZeRO-3 / per-microbatch reduce-scatter
    gather_exposed_s: float  # ZeRO-3 weight all-gathers per microbatch not hidden by compute
    # collective seconds hidden behind compute, per microbatch and once per step: the time
    # compute runs beside a collective (``DeviceSpec.overlap_slowdown`` prices its cost)
    hidden_microbatch_s: float = 0.0
    hidden_step_s: float = 0.0


class _Traffic:
    """One kind of parameter traffic. Priced one collective per tensor (``bucket_bytes``
    0: DTensor's per-parameter redistribute), or its bytes summed per (collective, axis)
    and priced per buffer: one flat buffer per group, or one per FSDP unit (``inf``), or
    DDP-sized buckets. NCCL picks ring or tree by the buffer's size, not each tensor's."""

    def __init__(self, coll: CollectivePrices, bucket_bytes: float, units: int):
        self.coll, self.bucket_bytes, self.units = coll, bucket_bytes, units
        self.tensor_s = 0.0
        self.buffered: dict[tuple[Collective, int], float] = {}

    def add(self, kind: Collective, nbytes: float, axis: int) -> None:
        if self.bucket_bytes > 0:
            self.buffered[(kind, axis)] = self.buffered.get((kind, axis), 0.0) + nbytes
        else:
            self.tensor_s += self.coll(kind, nbytes, axis)

    def time_s(self) -> float:
        return self.tensor_s + sum(self._buffers_s(k, b, a)
                                   for (k, a), b in self.buffered.items())

    def _buffers_s(self, kind: Collective, nbytes: float, axis: int) -> float:
        n = self.units if math.isinf(self.bucket_bytes) else _buckets(nbytes, self.bucket_bytes)
        return n * self.coll(kind, nbytes / n, axis)


def _param_traffic_s(params: ParamWalk, stage: Stage, coll: CollectivePrices,
                     runtime: RuntimeModel, *, forward_s: float, backward_s: float,
                     recompute_s: float) -> _TrafficTimes:
    """Gradient sync, ZeRO gathers and their overlap with compute (RuntimeModel)."""
    mb_sync, gather = _per_use_zero3_s([s for s in params.syncs if s.per_use], coll, runtime,
                                       recompute=stage.recompute, dpa=params.dp_axis)
    # FSDP2 issues one collective per block (and one for the root's parameters)
    units = max(1, len(params.unit_numel)) if runtime.sync_overlaps_backward else 1
    grads, updated, fsdp = _after_backward_traffic(params, stage.zero, coll, runtime, units)
    grad_sync, updated_gather = grads.time_s(), updated.time_s()
    gather += 2 * fsdp.time_s()  # forward and backward
    if runtime.sync_overlaps_backward:
        # per-block collectives behind the backward (and, for the updated shards, the next
        # step's forward, FSDP2's prefetch): the last block's stays exposed
        behind = backward_s + recompute_s
        e = runtime.overlap_efficiency
        hidden_mb = 0.0
        if runtime.reduce_scatter_per_microbatch and stage.zero >= 2:
            exposed_rs = _hidden_s(grad_sync, behind, units, e)
            mb_sync += exposed_rs
            hidden_mb = grad_sync - exposed_rs
            grad_sync = 0.0
        step = _hidden_s(grad_sync, behind, units, e) + \
            _hidden_s(updated_gather, forward_s, units, e)
        hidden_step = grad_sync + updated_gather - step
    else:
        # the gather of updated weights follows the optimizer step: nothing to overlap with
        hidden_mb = 0.0
        hidden_step = grad_sync * runtime.overlap_efficiency * runtime.grad_sync_overlap
        step = grad_sync - hidden_step + updated_gather
    compute = forward_s + backward_s + recompute_s
    ideal = max(0.0, gather - runtime.param_gather_overlap * compute)
    exposed = gather - runtime.overlap_efficiency * (gather - ideal)
    return _TrafficTimes(step_s=step, microbatch_s=mb_sync, gather_exposed_s=exposed,
                         hidden_microbatch_s=hidden_mb + gather - exposed,
                         hidden_step_s=hidden_step)


def _hidden_s(t: float, behind: float, units: int, efficiency: float = 1.0) -> float:
    """Exposed part of ``t`` split into ``units`` collectives issued as compute of
    ``behind`` seconds proceeds: all but the last unit's can hide, and ``efficiency`` of
    what can hide does (``RuntimeModel.overlap_efficiency``)."""
    if t <= 0:
        return 0.0
    ideal = max(t / units, t - behind)
    return t - efficiency * (t - ideal)


def _per_use_zero3_s(syncs: list[GradSync], coll: CollectivePrices, runtime: RuntimeModel, *,
                     recompute: str, dpa: int | None) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds per microbatch of ZeRO-3 as meshplan's graph
    engine runs it (``RuntimeModel.zero3_per_use``). Without recompute, each block's
    weights are gathered together in the forward and again in the backward, and their
    gradients reduce-scattered together: bandwidth per tensor, one latency per block (the
    weights outside the blocks: one before and one after them). Under recompute: per
    consumer, a gather in the forward and a reduce-scatter in the backward."""
    sync = gather = 0.0
    units: set[int] = set()
    for s in syncs:
        one_sync, one_gather = per_use_sync_s(s, coll, recompute=recompute)
        sync, gather = sync + one_sync, gather + one_gather
        if recompute == Recompute.NONE:
            units.add(s.layer)
    if units:
        n = len(units) + (1 if -1 in units else 0)
        unit_sync, unit_gather = zero3_unit_latency_s(coll, runtime, dpa)
        sync += n * unit_sync
        gather += n * unit_gather
    return sync, gather


def per_use_sync_s(s: GradSync, coll: CollectivePrices, *, recompute: str) -> tuple[float, float]:
    """(reduce-scatter, all-gather) seconds per microbatch one per-use ZeRO-3 sync adds:
    its bandwidth inside its block's collectives without recompute (their latency is
    ``zero3_unit_latency_s`` per block), whole collectives per consumer under recompute."""
    if recompute == Recompute.NONE:
        return (_bandwidth_s(coll, s.kind, s.grad_bytes, s.axis),
                2 * _bandwidth_s(coll, Collective.ALL_GATHER, s.weight_bytes, s.axis))
    return (s.uses * coll(s.kind, s.grad_bytes, s.axis),
            s.uses * coll(Collective.ALL_GATHER, s.weight_bytes, s.axis))


def zero3_unit_latency_s(coll: CollectivePrices, runtime: RuntimeModel,
                         dpa: int | None) -> tuple[float, float]:
    """(reduce-scatter, all-gather) latency per microbatch of one block's per-use ZeRO-3
    collectives: one reduce-scatter in the backward, an all-gather in the forward and one
    in the backward."""
    kind = Collective.ALL_REDUCE if runtime.reduce_scatter_as_all_reduce \
        else Collective.REDUCE_SCATTER
    return coll(kind, 1e-30, dpa), 2 * coll(Collective.ALL_GATHER, 1e-30, dpa)


def _after_backward_traffic(params: ParamWalk, zero: int, coll: CollectivePrices,
                            runtime: RuntimeModel,
                            units: int) -> tuple[_Traffic, _Traffic, _Traffic]:
    """(gradient sync, ZeRO-1/2 updated-shard all-gather, FSDP ZeRO-3 weight all-gather of
    one pass) of the parameters synced once per step. meshplan's graph engine syncs the
    gradients (and ZeRO-1/2 shards) in one flat buffer, FSDP2 per block, DDP in buckets."""
    bucket = math.inf if (runtime.flat_grad_sync and zero <= 2) \
        or runtime.sync_overlaps_backward else runtime.grad_bucket_bytes
    grads, updated = _Traffic(coll, bucket, units), _Traffic(coll, bucket, units)
    # FSDP2 gathers block by block; otherwise one all-gather per tensor
    fsdp = _Traffic(coll, bucket if runtime.sync_overlaps_backward else 0.0, units)
    for s in params.syncs:
        if s.per_use:
            continue
        grads.add(s.kind, s.grad_bytes, s.axis)
        if s.on_dp and zero >= 3:
            fsdp.add(Collective.ALL_GATHER, s.weight_bytes, s.axis)
        if s.on_dp and zero in (1, 2):
            # each rank stepped its shard of the master weights: the updated weights are
            # all-gathered after the optimizer (Rajbhandari et al. 2020, sec. 5: ZeRO-1/2
            # move the same volume as data parallelism, RS + AG = AR)
            updated.add(Collective.ALL_GATHER, s.weight_bytes, s.axis)
    return grads, updated, fsdp


def _optimizer_s(params: ParamWalk, hw: HardwareProfile, *, dtype: str, optimizer: str,
                 contention: float, runtime: RuntimeModel | None = None) -> float:
    """The optimizer step: its state read and written at memory bandwidth (the runtime's
    gradient and master widths: NeMo's bf16 gradients and 16-bit master remainders), plus
    kernels per tensor (the per-tensor fixed costs are CPU work on a CPU host and
    time-share its cores too)."""
    widths = {}
    if runtime is not None and dtype != ComputeDtype.FP32:
        widths["grad_bytes"] = runtime.grad_bytes
        if dtype == ComputeDtype.BF16:  # remainders need bf16 weights as their high half
            widths["master_bytes"] = runtime.master_bytes
    return optimizer_step_s(params.optimizer_numel, params.tensors, hw, dtype=dtype,
                            optimizer=optimizer, contention=contention, **widths)


def optimizer_step_s(numel: float, tensors: int, hw: HardwareProfile, *, dtype: str,
                     optimizer: str, contention: float, grad_bytes: float = GRAD_BYTES,
                     master_bytes: float = MASTER_BYTES) -> float:
    """The optimizer step over ``numel`` parameters in ``tensors`` tensors (``_optimizer_s``):
    linear in both, so the intra-op ILP prices it parameter by parameter."""
    dev = hw.device
    return (optimizer_traffic_s(numel, dtype=dtype, optimizer=optimizer, hw=hw,
                                grad_bytes=grad_bytes, master_bytes=master_bytes)
            + tensors * OPTIMIZER_OPS_PER_TENSOR.get(optimizer, 10)
            * (dev.kernel_latency_s + dev.framework_overhead_s)) * contention


def _buffer_bytes(params: ParamWalk, zero: int, runtime: RuntimeModel, *, dtype: str,
                  activation_bytes: float) -> float:
    """Communication buffers at the stage's peak.

    DDP's buckets live during the backward; the engine's flat sync copies the gradients
    after the backward has freed the activations: once to all-reduce (ZeRO 0/1,
    lowering.reduce_partial_grads), twice to reduce-scatter (ZeRO-2: padded blocks and
    their concatenation, runtime/graph/zero.py), so it raises the peak by what those copies
    exceed the activations. ZeRO-3 holds the largest gathered unit: a block, or the
    weights outside the blocks (embedding, head, final norm: one unit, -1), which with a
    large vocabulary is the largest (Llama 0.22B of benchmarks/local_shards.py: 0.24 GiB
    against 0.05 a block). ``unit_numel`` counts weights unsplit over dp already: the
    gathered copy of one unit, not dp of them. The engine frees a gathered unit after its
    last reader and gathers it again when the backward unpacks what autograd saved
    (runtime/graph/gathers.py _Regather), with or without recompute; FSDP2's prefetch holds the
    next block's gathered weights beside the current's.
    """
    buffers = grad_sync_buffer_bytes(runtime.grad_bucket_bytes, params.grads_bytes)
    synced = params.synced_bytes
    if runtime.flat_grad_sync and synced:
        copies = 2 if zero == 2 else 1
        buffers += max(0.0, copies * synced - activation_bytes)
    if zero >= 3:
        unit = max(params.unit_numel.values(), default=0.0)
        held = 2 if runtime.param_gather_overlap > 0 and not runtime.zero3_per_use else 1
        buffers += held * zero3_buffer_bytes(unit, dtype=dtype)
    return buffers


def _buckets(total_bytes: float, bucket_bytes: float) -> int:
    """Collectives a bucketed sync of ``total_bytes`` makes (one flat buffer: ``inf``)."""
    return max(1, math.ceil(total_bytes / bucket_bytes)) if total_bytes > 0 else 0
