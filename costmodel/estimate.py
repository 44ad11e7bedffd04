"""Estimate: predicted step time and memory of any plan on its mesh.

trace -> **cost** -> solve -> run. ``estimate_plan(plan, graph)`` prices every stage of a
plan (one microbatch at a time) and composes them with the pipeline schedule:

- compute: every operator of the stage at its per-device share (``compute.op_time`` with
  shard = devices splitting its output x microbatches), forward, backward and recompute
  ("full": every block operator's forward again; "selective": the attention core);
- activation communication: each edge whose producer placement differs from the placement
  its consumer reads is a collective (``reshard_collectives``) in the forward and its mirror
  in the backward; an operator split on an axis that reads an activation replicated on that
  axis all-reduces the input gradient (Megatron's f/g operators). Exposed in full: tensor
  parallel communication sits on the critical path (Narayanan et al. 2021, section 3.3);
- pipeline: send/recv of the stage's boundary tensors per microbatch, forward and backward;
- gradient sync once per step: all-reduce (ZeRO 0/1) or reduce-scatter (ZeRO 2/3) of each
  replicated parameter's gradient over the axes that split its consumers; ZeRO-3 all-gathers
  weights before the forward and the backward of every microbatch (FSDP), or, in meshplan's
  graph engine, each block's weights in one all-gather in a microbatch's forward and one in
  its backward, with their gradients' reduce-scatter in the backward (``RuntimeModel.zero3_per_use``; gloo's
  reduce-scatter priced as the all-reduce it costs);
- CPU contention: compute slows by the ranks computing at once over the schedule's span
  (``plan_stage_costs``, ``pipeline.busy_ranks``), not by every process on the host;
- optimizer: the state it reads and writes at memory bandwidth, plus fixed costs per tensor.

Overlap is explicit (``RuntimeModel``): the fraction of the gradient sync hidden behind the
backward, and of ZeRO-3 all-gathers hidden behind compute, times the fraction of that the
backend really hides (``overlap_efficiency``: all on NCCL, none on gloo, where FSDP2's
collectives block the CPU thread).

This module composes a stage's costs and the plan's; the parts are priced beside it:
``runtime_profiles`` (``RuntimeModel``, ``default_runtime``), ``stage_layout`` (placement
arithmetic, the activation profile), ``operators`` (the operator pass), ``params`` (the
parameter walk) and ``param_traffic`` (gradient sync, ZeRO gathers, optimizer step).
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass, replace

from meshplan.costmodel import fp8 as fp8_model
from meshplan.costmodel import moe as moe_model
from meshplan.costmodel.comm import Collective, CollectivePrices, bandwidth_s, collective_time_s
from meshplan.costmodel.compute import DTYPE_BYTES, DTYPE_NAMES, contention_factor
from meshplan.costmodel.eager import (Kernel, fsdp_copy_out_bytes, fsdp_reduce_copy_in_bytes,
                                      kernels_time_s)
from meshplan.costmodel.fusion import fused_by_member
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import (GIB, activation_memory, alternate_matmuls, causal_masks,
                                       inflight_microbatches, mask_builders)
from meshplan.costmodel.operators import (OperatorPricer, _cached_eager_kernels,
                                          _cached_operator_pass, _operator_pass, _recompute_s,
                                          _tp_overlap_hidden_s, causal_attention,
                                          eager_kernel_table, input_collectives, operator_time,
                                          selective_recomputes)
from meshplan.costmodel.param_traffic import (OPTIMIZER_OPS_PER_TENSOR, _buffer_bytes, _optimizer_s,
                                              _param_traffic_s, optimizer_step_s, per_use_sync_s,
                                              zero3_unit_latency_s)
from meshplan.costmodel.params import (GradSync, ParamPart, ParamWalk, _cached_parameter_walk,
                                       _param_layer, param_layer, parameter_part, parameter_walk)
from meshplan.costmodel.pipeline import (PipelineTime, busy_ranks, chunked_step_time,
                                         pipeline_step_time)
from meshplan.costmodel.runtime_profiles import (BACKENDS, DDP_BUCKET_BYTES, PROFILES, RuntimeModel,
                                                 STACKS, default_runtime, megatron_runtime,
                                                 nemo_runtime, plan_runtime, runtime_hardware)
from meshplan.costmodel.stage_layout import (_split_of, chunked_loss_stage, dp_axis,
                                             reshard_collectives, split_factor,
                                             stage_activation_profile, value_bytes)
from meshplan.axes import EP_AXIS, Axis
from meshplan.graph import OpGraph
from meshplan.plan import Estimate, MemoryBreakdown, Plan, Stage, StagePrediction
from meshplan.schedules import Schedule
from meshplan.support import lists_rank_groups
from meshplan.vocabulary import ComputeDtype, Recompute


def axis_cost_terms(axis: Axis):
    """The function pricing a table axis on a stage (meshplan/axes.py ``Axis.cost_terms``,
    ``"module:function"`` under meshplan.costmodel); every pricer reaches an axis's terms
    through here."""
    module, _, fn = axis.cost_terms.partition(":")
    return getattr(importlib.import_module(f"meshplan.costmodel.{module}"), fn)

# the cost model's public names, defined here or in the modules it was split into
# (runtime_profiles, stage_layout, params, param_traffic, operators, comm), so that
# ``from meshplan.costmodel.estimate import ...`` keeps working; the _-names are
# imported from here by tests
__all__ = ['BACKENDS', 'CONTENTION_ITERATIONS', 'CollectivePrices', 'DDP_BUCKET_BYTES', 'GradSync',
           'OPTIMIZER_OPS_PER_TENSOR', 'OperatorPricer', 'PROFILES', 'ParamPart', 'ParamWalk',
           'RuntimeModel', 'STACKS', 'StageBreakdown', 'bandwidth_s', 'causal_attention',
           'chunk_groups', 'chunked_loss_stage', 'default_runtime', 'dp_axis', 'eager_kernel_table',
           'estimate_plan', 'input_collectives', 'megatron_runtime', 'nemo_runtime',
           'operator_pricer', 'operator_time', 'optimizer_step_s', 'param_layer', 'parameter_part',
           'parameter_walk', 'per_use_sync_s', 'plan_costs_and_contention', 'plan_pipeline_time',
           'plan_runtime', 'plan_stage_costs', 'rank_group_record', 'reshard_collectives',
           'runtime_hardware', 'selective_recomputes', 'split_factor', 'stage_activation_profile',
           'stage_cost', 'stage_costs', 'value_bytes', 'with_stage_predictions',
           'zero3_unit_latency_s', '_cached_eager_kernels', '_operator_pass',
           '_tp_overlap_hidden_s']


@dataclass(frozen=True, slots=True)
class StageBreakdown:
    """Costs of one stage: times per microbatch, once-per-step times, memory at its peak."""

    forward_s: float
    backward_s: float
    recompute_s: float
    # exposed activation/p2p/ZeRO-3 communication per microbatch, and the compute slowed
    # beside what is hidden (DeviceSpec.overlap_slowdown); grad_sync_s likewise once per step
    comm_s: float
    grad_sync_s: float  # exposed gradient sync, once per step
    optimizer_s: float
    memory: MemoryBreakdown | None  # None: priced with memory=False

    @property
    def microbatch_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.comm_s

    def prediction(self) -> StagePrediction:
        return StagePrediction(compute_s=self.forward_s + self.backward_s + self.recompute_s,
                               comm_s=self.comm_s + self.grad_sync_s, memory=self.memory)


def stage_cost(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
               optimizer: str, microbatches: int = 1, num_stages: int = 1,
               schedule: str = Schedule.ONE_F_ONE_B, virtual_stages: int = 1, seq_len: int = 0,
               processes_on_host: int = 1, runtime: RuntimeModel | None = None,
               compute_contention: float | None = None, cache: dict | None = None,
               memory: bool = True) -> StageBreakdown:
    """Costs of one stage. ``memory=False``: the times only, ``memory`` None (the pipeline
    search's lower bounds price thousands of stages whose memory they never read; the
    activation walk is a third of a stage's price). ``compute_contention`` (default: all ``processes_on_host``
    computing at once) slows the microbatch compute; the optimizer step, which every
    process runs at the same time, always takes the all-process contention.

    The steps, one function each: the operator walk (compute and activation collectives
    of one microbatch), recompute, pipeline send/recv, the parameter walk (model state and
    the collectives each gradient needs), the price of that parameter traffic after
    overlap, the optimizer step, then activation and buffer memory."""
    runtime = runtime or default_runtime(hw)
    m = max(1, microbatches)
    all_procs = contention_factor(hw, processes_on_host)
    contention = all_procs if compute_contention is None else compute_contention
    coll = CollectivePrices(stage, hw, backend=runtime.backend, cache=cache)
    if runtime.cp_composable:
        stage = chunked_loss_stage(stage, graph, cache)
    fp8 = fp8_model.fp8_pricing(dtype, runtime)
    ops = _cached_operator_pass(cache, stage, graph, hw, dtype, m, contention, coll,
                                runtime.backend, runtime.attention,
                                causal=runtime.causal_attention,
                                cp_composable=runtime.cp_composable, compiled=runtime.compiled,
                                fp8=fp8, eager=_eager_precision(stage, runtime),
                                accumulating=_accumulating_microbatches(stage, runtime, m),
                                skip_masks=runtime.causal_mask_skipped)
    recompute, comm_rec = _recompute_s(ops, stage.recompute, runtime)
    copy_fwd, copy_bwd = _fsdp_copy_out_s(stage, graph, hw, dtype, runtime, contention, m,
                                          cache=cache)
    tp_hidden = _tp_overlap_hidden_s(ops, stage.recompute) if runtime.tp_comm_overlap else 0.0
    p2p = _p2p_s(stage, hw, ops.p2p_bytes, num_stages=num_stages, schedule=schedule,
                 virtual_stages=virtual_stages)
    # the routed experts (costmodel/moe.py): grouped GEMMs at their tokens per expert, the
    # dispatch/combine all-to-alls and, under ep > 1, the experts' state over ep x efsdp
    moe = axis_cost_terms(EP_AXIS)(stage, graph, hw, dtype=dtype, optimizer=optimizer,
                                   microbatches=m, runtime=runtime, contention=contention,
                                   cache=cache, **_state_widths(dtype, runtime))
    fwd_s, bwd_s = ops.fwd + copy_fwd, ops.bwd + copy_bwd
    moe_comm = 0.0
    if moe is not None:
        fwd_s += moe.gemm_fwd_delta_s
        bwd_s += moe.gemm_bwd_delta_s
        moe_comm = moe.a2a_exposed_s + moe.gather_s
        if stage.recompute == Recompute.FULL:  # the forward again, its all-to-alls too
            recompute += moe.gemm_fwd_delta_s
            moe_comm += moe.a2a_fwd_s * (1 - runtime.ep_a2a_overlap)
    walk_stage = _without_routed_experts(stage, graph, cache) if moe is not None and \
        stage.ep > 1 else stage
    params = _cached_parameter_walk(cache, walk_stage, graph, ops.consumer_out, dtype=dtype,
                                    optimizer=optimizer, runtime=runtime)
    traffic = _param_traffic_s(params, stage, coll, runtime, forward_s=fwd_s,
                               backward_s=bwd_s, recompute_s=recompute)
    # compute beside a collective runs slower (DeviceSpec.overlap_slowdown)
    compute_mb = fwd_s + bwd_s + recompute
    slow = hw.device.overlap_slowdown
    comm_mb = (ops.comm_fwd + ops.comm_bwd + comm_rec - tp_hidden + p2p + moe_comm
               + traffic.gather_exposed_s + traffic.microbatch_s
               + overlap_cost_s(tp_hidden + traffic.hidden_microbatch_s, compute_mb, slow))
    grad_sync_s = traffic.step_s + overlap_cost_s(traffic.hidden_step_s, compute_mb, slow)
    optimizer_s = _optimizer_s(params, hw, dtype=dtype, optimizer=optimizer,
                               contention=all_procs, runtime=runtime)
    if moe is not None and stage.ep > 1:
        grad_sync_s += moe.grad_sync_s
        optimizer_s += optimizer_step_s(moe.optimizer_numel, len(stage.params) -
                                        len(walk_stage.params), hw, dtype=dtype,
                                        optimizer=optimizer, contention=all_procs,
                                        **_state_widths(dtype, runtime))
    if not memory:
        return StageBreakdown(forward_s=fwd_s, backward_s=bwd_s,
                              recompute_s=recompute, comm_s=comm_mb,
                              grad_sync_s=grad_sync_s, optimizer_s=optimizer_s, memory=None)

    prof = stage_activation_profile(stage, graph, hw, dtype=dtype, microbatches=m,
                                    seq_len=seq_len, attention=runtime.attention, cache=cache,
                                    fused=runtime.fused_activations,
                                    precision=_memory_precision(stage, runtime),
                                    compiled=runtime.compiled,
                                    local_factories=runtime.local_factories)
    kept, working = prof.stage_bytes(stage.recompute,
                                     keep_matmuls_only=runtime.selective_keeps_matmuls,
                                     alternate=runtime.selective_alternate_matmuls,
                                     without_masks=runtime.causal_mask_skipped)
    if fp8 is not None and stage.recompute != Recompute.FULL:  # fp8 inputs saved for the backward
        kept -= fp8_model.saved_input_bytes_saved(graph, stage.ops, _split_of(stage, graph),
                                                  1.0 / m, fp8)
    if moe is not None:
        # the traced graph holds the permuted tokens already (routed at ep = 1); the
        # busiest rank's excess and, under ep > 1, one layer's dispatch and combine
        # receive buffers come on top
        if stage.recompute != Recompute.FULL:
            kept += (runtime.moe_imbalance - 1) * moe.saved_bytes
        if stage.ep > 1:
            working += moe.buffer_bytes
    acts = activation_memory(kept, working, schedule=schedule, stage=stage.index,
                             num_stages=num_stages, microbatches=m, virtual_stages=virtual_stages)
    if _memory_precision(stage, runtime) == "autocast" and DTYPE_BYTES[dtype] < 4 \
            and stage.zero < 3:
        # each in-flight microbatch's forward ran in its own autocast region, whose cast
        # copies of the weights its backward keeps: one is the model state's low-precision
        # weights column, the others are not (DECISIONS 108)
        inflight = inflight_microbatches(schedule, stage.index, num_stages, m, virtual_stages)
        acts += (inflight - 1) * params.weights_bytes
    buffers = _buffer_bytes(params, stage.zero, runtime, dtype=dtype, activation_bytes=acts)
    buffers += fp8_model.weight_copy_bytes(stage, graph, fp8, lambda n: _param_layer(n, graph))
    ew = eg = eo = 0.0
    if moe is not None and stage.ep > 1:
        ew, eg, eo = moe.weights_bytes, moe.grads_bytes, moe.optimizer_bytes
    memory = MemoryBreakdown(params_gib=(params.weights_bytes + ew) / GIB,
                             grads_gib=(params.grads_bytes + eg) / GIB,
                             optimizer_gib=(params.optimizer_bytes + eo) / GIB,
                             activations_gib=acts / GIB, buffers_gib=buffers / GIB)
    return StageBreakdown(forward_s=fwd_s, backward_s=bwd_s,
                          recompute_s=recompute,
                     comm_s=comm_mb, grad_sync_s=grad_sync_s, optimizer_s=optimizer_s,
                     memory=memory)


def _state_widths(dtype: str, runtime: RuntimeModel) -> dict:
    """The runtime's gradient and master widths as ``_optimizer_s`` reads them."""
    widths = {}
    if dtype != ComputeDtype.FP32:
        widths["grad_bytes"] = runtime.grad_bytes
        if dtype == ComputeDtype.BF16:
            widths["master_bytes"] = runtime.master_bytes
    return widths


def _without_routed_experts(stage: Stage, graph: OpGraph, cache: dict | None) -> Stage:
    """The stage without its routed expert weights, for the parameter walk: under ep > 1
    costmodel/moe.py prices their state and gradient sync over ep x efsdp. One dict per
    parameter dict (by identity, kept beside it) so the walk's memo still hits."""
    experts = moe_model.routed_expert_params(graph)
    memo = cache.setdefault("moe-walk-params", {}) if cache is not None else {}
    hit = memo.get(id(stage.params))
    if hit is None or hit[0] is not stage.params:
        hit = memo[id(stage.params)] = (stage.params, {
            k: v for k, v in stage.params.items() if k not in experts})
    # a shallow copy with the other dict: ``replace`` would validate the record again on
    # every one of the search's thousands of probes
    out = copy.copy(stage)
    object.__setattr__(out, "params", hit[1])
    return out


def overlap_cost_s(hidden_s: float, compute_s: float, slow: float) -> float:
    """Compute time added where ``hidden_s`` seconds of communication run beside ``compute_s``
    seconds of compute that slows by ``slow`` meanwhile (``DeviceSpec.overlap_slowdown``,
    Lee et al. 2025: compute beside a collective takes 1 + slow times as long): the
    collectives overlap hidden_s / (1 + slow) seconds of unslowed compute, never more than
    there is, and each such second costs ``slow`` more."""
    if slow <= 0 or hidden_s <= 0:
        return 0.0
    return slow * min(hidden_s / (1 + slow), compute_s)


def _fsdp_active(stage: Stage, runtime: RuntimeModel) -> bool:
    """Whether FSDP2 wraps the stage in an engine whose mixed precision is FSDP2's: the
    module engine and torchtitan apply ``fully_shard`` where the dp (x cp) mesh has more
    than one rank (runtime/modules.py ``parallelize_model``)."""
    if runtime.mixed_precision != "fsdp":
        return False
    shape, names = stage.mesh_shape, stage.axis_names
    size = 1
    for axis in ("dp", "cp"):
        if axis in names:
            size *= shape[names.index(axis)]
    return size > 1


def _eager_precision(stage: Stage, runtime: RuntimeModel) -> str:
    """The mixed precision the stage's eager kernels run under, "" when they are priced
    one kernel per operator (``RuntimeModel.eager_kernels`` off)."""
    if not runtime.eager_kernels:
        return ""
    return "fsdp" if _fsdp_active(stage, runtime) else "autocast"


def _accumulating_microbatches(stage: Stage, runtime: RuntimeModel, m: int) -> int:
    """The microbatches whose gradients eager autograd adds into ``.grad`` (the eager
    kernels' ``accumulate``): none where FSDP2 reduce-scatters every microbatch's unsharded
    gradients and frees them (ZeRO-2/3 on the module engine and torchtitan: FSDP2's
    ``post_backward``; the sharded gradients it then adds up on its reduce stream, not the
    compute stream), else all ``m``."""
    if _fsdp_active(stage, runtime) and runtime.reduce_scatter_per_microbatch \
            and stage.zero >= 2:
        return 1
    return m


def _memory_precision(stage: Stage, runtime: RuntimeModel) -> str:
    """The mixed precision whose dtypes the stage's activations are kept in, "" where the
    engine keeps every float activation in the plan's dtype
    (``RuntimeModel.eager_activations``)."""
    if not runtime.eager_activations:
        return ""
    return "fsdp" if _fsdp_active(stage, runtime) else "autocast"


def _fsdp_copy_out_s(stage: Stage, graph: OpGraph, hw: HardwareProfile, dtype: str,
                     runtime: RuntimeModel, contention: float,
                     microbatches: int = 1, cache: dict | None = None) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch of FSDP2's copies on the compute stream,
    one kernel per FSDP unit (the blocks and the root) each: the all-gather copy-out
    (``eager.fsdp_copy_out_bytes``) before the forward, and again before the backward where
    ZeRO-3 resharded the weights after the forward; the gradients' copy-in to the
    reduction (``eager.fsdp_reduce_copy_in_bytes``) in the backward, every microbatch
    where the gradients are reduce-scattered every microbatch, else once per step, from the
    accumulated gradient FSDP2 keeps in the reduce dtype over the microbatches
    (``to_accumulated_grad_if_needed``). ZeRO-0 too: the module engine's ``replicate`` is
    FSDP2 with a shard group of one, which copies its weights out and its gradients in
    the same way (its all-reduce replaces the reduce-scatter)."""
    if not runtime.eager_kernels or not _fsdp_active(stage, runtime):
        return 0.0, 0.0
    key = ("fsdp-copy", id(stage.params), id(graph.params), graph.block_module,
           stage.mesh_shape, stage.axis_names, repr(stage.inputs), stage.zero, dtype,
           runtime, contention, microbatches)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is stage.params:
        return hit[1]
    out = _fsdp_copy_out_priced(stage, graph, hw, dtype, runtime, contention, microbatches)
    if cache is not None:
        cache[key] = (stage.params, out)
    return out


def _fsdp_copy_out_priced(stage: Stage, graph: OpGraph, hw: HardwareProfile, dtype: str,
                          runtime: RuntimeModel, contention: float,
                          microbatches: int) -> tuple[float, float]:
    shape, dpa = stage.mesh_shape, dp_axis(stage)
    units: dict[int, float] = {}
    for pname, pl in stage.params.items():
        info = graph.param_map.get(pname)
        if info is None or (info.tied_to is not None and info.tied_to in stage.params):
            continue
        layer = _param_layer(pname, graph)
        units[layer] = units.get(layer, 0.0) + info.numel / split_factor(pl, shape, skip_axis=dpa)
    one = sum(kernels_time_s([Kernel(0.0, fsdp_copy_out_bytes(n, dtype=dtype, passes=1))],
                             hw, 1.0) for n in units.values()) * contention
    per_mb = runtime.reduce_scatter_per_microbatch and stage.zero >= 2
    accumulated = not per_mb and microbatches > 1  # the copy-in reads the fp32 accumulator
    copy_in = sum(kernels_time_s([Kernel(0.0, fsdp_reduce_copy_in_bytes(
        n, dtype=ComputeDtype.FP32 if accumulated else dtype,
        reduce_bytes=runtime.grad_bytes))], hw, 1.0)
        for n in units.values()) * contention
    copy_in /= 1 if per_mb else max(1, microbatches)
    return one, (one if stage.zero >= 3 else 0.0) + copy_in


def _p2p_s(stage: Stage, hw: HardwareProfile, p2p_bytes: float, *, num_stages: int,
           schedule: str, virtual_stages: int) -> float:
    """Pipeline send/recv of the stage's boundary tensors per microbatch: a receive and a
    send in the forward and in the backward (one of each on the first and last stage);
    interleaving crosses the stage boundary once per virtual stage."""
    if num_stages <= 1:
        return 0.0
    crosses = len(stage.devices) >= hw.devices_per_node
    hops = (2 if 0 < stage.index < num_stages - 1 else 1) * 2  # recv+send, fwd+bwd
    p2p = hops / 2 * collective_time_s(hw, Collective.SEND_RECV, p2p_bytes, 2,
                                       crosses_nodes=crosses)
    if schedule == Schedule.INTERLEAVED:
        p2p *= max(1, virtual_stages)
    return p2p


def operator_pricer(plan: Plan, graph: OpGraph, stage_index: int) -> OperatorPricer:
    """The ``OperatorPricer`` of one stage record of ``plan`` (its contention from
    ``plan_costs_and_contention``)."""
    hw0 = HardwareProfile.from_dict(plan.mesh.hardware)
    runtime = plan_runtime(plan, hw0)
    hw = runtime_hardware(hw0, runtime)
    _, contention = plan_costs_and_contention(plan, graph, hw0, runtime=runtime)
    stage = plan.stages[stage_index]
    if runtime.cp_composable:
        stage = chunked_loss_stage(stage, graph)
    t = plan.training
    m = max(1, t.microbatches)
    precision = _eager_precision(stage, runtime)
    causal = runtime.causal_attention and (runtime.cp_composable or "cp" not in stage.axis_names)
    return OperatorPricer(
        stage=stage, graph=graph, hw=hw, runtime=runtime, dtype=t.dtype, m=m,
        contention=contention, coll=CollectivePrices(stage, hw, backend=runtime.backend),
        kernels=eager_kernel_table(graph, t.dtype, precision,
                                   _accumulating_microbatches(stage, runtime, m),
                                   runtime.compiled)
        if precision else None,
        fused=fused_by_member(graph, [n for n in stage.ops if n not in mask_builders(graph)]
                              if runtime.causal_mask_skipped else list(stage.ops))
        if runtime.compiled else {},
        fp8=fp8_model.fp8_pricing(t.dtype, runtime),
        masks=causal_masks(graph) if causal else set(),
        alternate=alternate_matmuls(graph) if runtime.selective_alternate_matmuls
        else frozenset())


def stage_costs(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
                optimizer: str, **kw) -> StagePrediction:
    """The StagePrediction written into a plan (kept for planners that call it)."""
    return stage_cost(stage, graph, hw, dtype=dtype, optimizer=optimizer, **kw).prediction()


def estimate_plan(plan: Plan, graph: OpGraph, *, runtime: RuntimeModel | None = None,
                  hw: HardwareProfile | None = None, cache: dict | None = None) -> Estimate:
    """Predicted step time, memory, MFU and throughput of ``plan``; never raises for memory."""
    hw = hw or HardwareProfile.from_dict(plan.mesh.hardware)
    t = plan.training
    runtime = runtime or plan_runtime(plan, hw)
    costs = plan_stage_costs(plan, graph, hw, runtime=runtime, cache=cache)
    pipe = plan_pipeline_time(plan, costs)
    tail = max(c.grad_sync_s + c.optimizer_s for c in costs)
    step = pipe.step_s + tail
    # the slowest rank group (one record, or the chunks it holds under uneven interleaving)
    units = chunk_groups(plan) or [[i] for i in range(len(costs))]
    unit = max(units, key=lambda u: sum(costs[i].microbatch_s for i in u))
    c, m = _summed(costs, unit), max(1, t.microbatches)
    worst = max(range(len(costs)), key=lambda i: costs[i].memory.total_gib)
    peak = costs[worst].memory.total_gib
    capacity = hw.device.memory_gib
    fits = peak <= capacity
    peak_flops = hw.device.peak_flops(DTYPE_NAMES[t.dtype])
    breakdown = {"forward": m * c.forward_s, "backward": m * c.backward_s,
                 "recompute": m * c.recompute_s,
                 "comm": m * c.comm_s + c.grad_sync_s, "bubble": pipe.bubble_s,
                 "optimizer": c.optimizer_s}
    return Estimate(
        step_time_s=step, peak_memory_gib=peak, memory_capacity_gib=capacity, fits=fits,
        mfu=plan.model.train_flops_per_step / (step * plan.num_devices * peak_flops) if step else 0.0,
        tokens_per_s=t.global_batch * t.seq_len / step if step else 0.0,
        bubble_fraction=pipe.bubble_s / step if step else 0.0, breakdown=breakdown,
        memory=costs[worst].memory,
        overflow="" if fits else _overflow_text(worst, costs[worst].memory, capacity),
    )


def with_stage_predictions(plan: Plan, graph: OpGraph, *, runtime: RuntimeModel | None = None,
                           hw: HardwareProfile | None = None, cache: dict | None = None) -> Plan:
    """The plan with every stage's ``predicted`` and the top-level Estimate filled in.
    ``hw``: the profile of ``plan.mesh.hardware`` when the caller has it; ``cache``: the
    cost model's memo, shared by the caller's plans on ``graph`` (a pipeline search prices
    its best shapes under every schedule: the same stages, walked once). The stages and
    the estimate are priced once, from one set of walks."""
    hw = hw or HardwareProfile.from_dict(plan.mesh.hardware)
    runtime = runtime or plan_runtime(plan, hw)
    cache = {} if cache is None else cache
    costs = plan_stage_costs(plan, graph, hw, runtime=runtime, cache=cache)
    stages = tuple(replace(st, predicted=c.prediction()) for st, c in zip(plan.stages, costs))
    plan = replace(plan, stages=stages)
    return replace(plan, predicted=estimate_plan(plan, graph, runtime=runtime, hw=hw,
                                                 cache=cache))


def chunk_groups(plan: Plan) -> list[list[int]] | None:
    """Record indices per rank group when an interleaved plan lists one record per virtual
    stage (chunk j on rank group j % pp; manual plans whose blocks do not split into
    pp x v equal chunks are written so); None for every other plan."""
    t = plan.training
    v = t.virtual_stages
    if t.schedule != Schedule.INTERLEAVED or v <= 1 or plan.num_stages <= v \
            or plan.num_stages % v or lists_rank_groups(plan):
        return None
    pp = plan.num_stages // v
    return [list(range(g, plan.num_stages, pp)) for g in range(pp)]


def plan_pipeline_time(plan: Plan, costs: list[StageBreakdown]) -> PipelineTime:
    """The pipelined span of ``plan`` from its records' costs (``plan_stage_costs``)."""
    t = plan.training
    m = max(1, t.microbatches)
    groups = chunk_groups(plan)
    if groups is None:
        return pipeline_step_time([c.microbatch_s for c in costs], m, t.schedule,
                                  t.virtual_stages)
    return chunked_step_time([sum(costs[j].microbatch_s for j in g) for g in groups],
                             max(c.microbatch_s for c in costs), m)


def _summed(costs: list[StageBreakdown], records) -> StageBreakdown:
    """Per-microbatch times of a rank group's records added; once-per-step terms and
    memory are the group's (every record of a group carries them)."""
    first = costs[records[0]]
    return replace(first, forward_s=sum(costs[j].forward_s for j in records),
                   backward_s=sum(costs[j].backward_s for j in records),
                   recompute_s=sum(costs[j].recompute_s for j in records),
                   comm_s=sum(costs[j].comm_s for j in records))


def rank_group_record(plan: Plan, records, cache: dict | None = None) -> Stage:
    """One record holding every chunk of a rank group (operators in graph order, all
    their parameters): what the group keeps in memory and syncs once per step. ``cache``:
    the cost model's memo, which keeps the joined dicts of the same chunk dicts (by
    identity), so that the operator walk's memo hits for every plan sharing them (a search
    prices one placement group's chunks under many schedules, ZeRO levels and ep degrees)."""
    sources = tuple((plan.stages[j].ops, plan.stages[j].params) for j in records)
    key = ("rank-group", tuple(id(d) for pair in sources for d in pair))
    hit = cache.get(key) if cache is not None else None
    if hit is not None and all(a is b for x, y in zip(hit[0], sources) for a, b in zip(x, y)):
        ops, params = hit[1], hit[2]
    else:
        ops, params = {}, {}
        for st_ops, st_params in sources:
            ops.update(st_ops)
            params.update(st_params)
        if cache is not None:
            cache[key] = (sources, ops, params)
    first, last = plan.stages[records[0]], plan.stages[records[-1]]
    return replace(first, ops=ops, params=params, layers=(first.layers[0], last.layers[1]),
                   nodes=(first.nodes[0], last.nodes[1]))


def _chunked_costs(plan: Plan, graph: OpGraph, hw: HardwareProfile, groups, kw: dict,
                   contention: float) -> list[StageBreakdown]:
    """Costs of the records of an uneven interleaved plan. Times per chunk: each chunk
    priced as the pipeline stage it is (its own send/recv, pp x v stages). Memory,
    gradient sync and optimizer per rank group: the group's chunks priced as one record
    at the group's place in the schedule (in-flight microbatches of interleaved 1F1B over
    pp groups), copied to each of its chunks."""
    chunk_kw = dict(kw, num_stages=plan.num_stages, schedule=Schedule.ONE_F_ONE_B, virtual_stages=1)
    costs = [stage_cost(st, graph, hw, compute_contention=contention, **chunk_kw)
             for st in plan.stages]
    group_kw = dict(kw, num_stages=len(groups))
    for g, records in enumerate(groups):
        union = replace(rank_group_record(plan, records, kw.get("cache")), index=g)
        gc = stage_cost(union, graph, hw, compute_contention=contention, **group_kw)
        for j in records:
            costs[j] = replace(costs[j], grad_sync_s=gc.grad_sync_s,
                               optimizer_s=gc.optimizer_s, memory=gc.memory)
    return costs


CONTENTION_ITERATIONS = 4  # fixed-point passes; converged to < 1% on the accuracy plans


def plan_stage_costs(plan: Plan, graph: OpGraph, hw: HardwareProfile, *,
                     runtime: RuntimeModel | None = None,
                     cache: dict | None = None) -> list[StageBreakdown]:
    """Every stage's StageBreakdown, with compute slowed by the ranks that compute at once.

    Start from all processes on the host computing at once (an upper bound), price the
    stages, count the ranks busy on average over the schedule's span
    (``pipeline.busy_ranks``: the complement of the bubble), re-price with that contention,
    and repeat: the busy count grows with the contention (compute stretches, the pipeline
    send/recv does not), the contention with the busy count, so the passes descend to the
    fixed point. Without contention (GPUs,
    or no more processes than cores) one pass.
    """
    return plan_costs_and_contention(plan, graph, hw, runtime=runtime, cache=cache)[0]


def plan_costs_and_contention(plan: Plan, graph: OpGraph, hw: HardwareProfile, *,
                              runtime: RuntimeModel | None = None,
                              cache: dict | None = None) -> tuple[list[StageBreakdown], float]:
    """``plan_stage_costs`` and the compute contention its stages were priced at (what
    ``meshplan explain`` prices one operator's candidates with)."""
    t = plan.training
    m = max(1, t.microbatches)
    runtime = runtime or plan_runtime(plan, hw)
    hw = runtime_hardware(hw, runtime, cache)
    on_host = min(plan.num_devices, hw.devices_per_node)
    kw = dict(dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
              num_stages=plan.num_stages, schedule=t.schedule, virtual_stages=t.virtual_stages,
              seq_len=t.seq_len, processes_on_host=on_host, runtime=runtime, cache=cache)
    groups = chunk_groups(plan)

    def price(contention):
        if groups is not None:
            return _chunked_costs(plan, graph, hw, groups, kw, contention)
        return [stage_cost(st, graph, hw, compute_contention=contention, **kw)
                for st in plan.stages]

    contention = contention_factor(hw, on_host)
    costs = price(contention)
    if contention <= 1.0:
        return costs, contention
    # ranks of the host in each rank group (plans larger than a node: this host's share)
    units = groups or [[i] for i in range(len(plan.stages))]
    ranks = [len(plan.stages[u[0]].devices) * on_host / max(1, plan.num_devices) for u in units]
    for _ in range(CONTENTION_ITERATIONS):
        pipe = plan_pipeline_time(plan, costs)
        busy = busy_ranks([sum(costs[j].microbatch_s for j in u) for u in units], ranks, m,
                          pipe.step_s)
        new = contention_factor(hw, busy)
        if abs(new - contention) <= 0.01 * contention:
            break
        contention = new
        costs = price(contention)
    return costs, contention


# -- helpers -----------------------------------------------------------------------------------

def _overflow_text(stage: int, mem: MemoryBreakdown, capacity: float) -> str:
    parts = {"params": mem.params_gib, "grads": mem.grads_gib, "optimizer": mem.optimizer_gib,
             "activations": mem.activations_gib, "buffers": mem.buffers_gib}
    top = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    return (f"stage {stage} needs {mem.total_gib:.1f} GiB per device, capacity {capacity:.1f} GiB "
            f"(over by {mem.total_gib - capacity:.1f} GiB; {top} GiB)")
