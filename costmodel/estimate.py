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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from meshplan.costmodel.comm import Collective, axis_link, collective_time_s
from meshplan.costmodel.compute import (ATTENTION_KERNELS, DTYPE_BYTES, DTYPE_NAMES,
                                        attention_saved_bytes, contention_factor,
                                        materialized_attention_time, op_time, OpTime)
from meshplan.costmodel.eager import (MEMORY_BOUND, PRECISIONS, EagerOp, eager_kernels,
                                      eager_time, fsdp_copy_out_bytes, kernels_time_s,
                                      Kernel)
from meshplan.costmodel.fusion import fused_by_member, fused_time, recomputed_inside
from meshplan.costmodel import fp8 as fp8_model
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.errors import PlanningError
from meshplan.costmodel.memory import (GIB, GRAD_BYTES, MASTER_BYTES, ActivationProfile,
                                       activation_memory,
                                       activation_profile, alias_root, causal_masks,
                                       grad_sync_buffer_bytes, model_state_bytes,
                                       optimizer_traffic_s, zero3_buffer_bytes)
from meshplan.costmodel.pipeline import (PipelineTime, busy_ranks, chunked_step_time,
                                         pipeline_step_time)
from meshplan.graph import OpGraph, OpKind
from meshplan.plan import Estimate, MemoryBreakdown, Plan, Stage, StagePrediction
from meshplan.schedules import Schedule
from meshplan.support import lists_rank_groups
from meshplan.vocabulary import ENGINES, ComputeDtype, Engine, Recompute
from meshplan.placements import PARTIAL, REPLICATE, shard

# other stacks a plan can be priced for (``default_runtime``): what-if estimates of
# configurations those stacks run, whether or not meshplan's runtimes do
STACKS = {"megatron": "Megatron-LM / NeMo (Megatron-Core with Transformer Engine)",
          "megatron-2021": "Megatron-LM as of SC'21 (attention through memory, gradients "
                           "all-reduced after the pipeline flush)",
          "nemo": "NeMo's Megatron GPT recipes as NVIDIA's dgxc-benchmarking 24.09-24.11 "
                  "runs them (Megatron-Core with Transformer Engine, Apex's distributed "
                  "fused Adam: bf16 gradients, fp32 master kept as 16-bit remainders)",
          "torchtitan": "torchtitan (FSDP2, eager)"}
PROFILES = ENGINES + tuple(STACKS)
BACKENDS = ("gloo", "nccl")
DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch DDP bucket_cap_mb default (25 MiB)
OPTIMIZER_OPS_PER_TENSOR = {"adam": 10, "sgd": 3}  # torch.optim _single_tensor_adam / sgd


@dataclass(frozen=True, slots=True)
class RuntimeModel:
    """How the executing runtime schedules communication (documented factors).

    grad_sync_overlap: fraction of the gradient sync hidden behind the backward. 0 by
      default: Megatron-LM (2021) reduces gradients after the pipeline flush, and
      meshplan's runtime redistributes them after ``loss.backward()``.
    param_gather_overlap: fraction of a microbatch's compute that can hide ZeRO-3 weight
      all-gathers (FSDP prefetches the next layer during the current one): 1.0.
    grad_bucket_bytes: gradients are synced in buckets of this size (DDP, Megatron) or, when
      0, one collective per parameter tensor (DTensor's per-parameter redistribute).
    zero3_per_use: ZeRO-3 as meshplan's runtime runs it: the dp-sharded weights a block
      first uses are gathered S(0) -> R together, in one all-gather per microbatch
      (runtime/graph/gathers.py ``ParamGathers``; under recompute, once per consumer instead), freed
      after their last reader and gathered again in the backward when autograd unpacks
      what it saved (gathers.py ``_Regather``: two all-gathers per microbatch), and the gather's
      backward reduce-scatters their gradients P -> S(0) in one collective in every
      microbatch's backward, so the step-level sync finds them already sharded
      (runtime/graph/parallelize.py ``_sync_grads``). False: FSDP's all-gather before the forward
      and again before the backward, one reduce-scatter per step (Rajbhandari et al. 2020,
      section 7.2.2: 3x the data-parallel volume).
    flat_grad_sync: every gradient that needs an all-reduce goes in one flat buffer per step
      (runtime/graph/lowering.py ``reduce_partial_grads``), and with ZeRO-1/2 the reduce-scatter of
      the gradients and the all-gather of the updated shards take one flat buffer each
      (runtime/graph/zero.py): one latency per collective, and a buffer the size of the
      gradients.
    full_grad_accumulation: ZeRO-2 as meshplan's graph engine runs it: every microbatch's
      backward accumulates into the parameter's full-size gradient, reduce-scattered into
      the master shard once per step after the last microbatch (runtime/graph/parallelize.py
      ``_sync_grads``, runtime/graph/zero.py ``reduce_scatter_grads``), so the gradients are not
      divided by dp at the peak; False: a reduce-scatter per microbatch (DeepSpeed's
      partitioned gradients), gradients divided by dp.
    reduce_scatter_as_all_reduce: the backend's reduce-scatter costs a full all-reduce
      (gloo: measured on the 2-core host with torch 2.13, 2 processes, 16 MiB fp32:
      reduce_scatter_tensor 56 ms, all_reduce 39 ms, all_gather 25 ms; 4 MiB: 7.0 / 5.0 /
      12.7 ms, shared machine - the reduce-scatter is never cheaper than the all-reduce).
    sync_overlaps_backward: the data-parallel gradient collectives are issued per block
      as the backward produces its gradients (FSDP2's ``fully_shard`` and ``replicate``
      post-backward hooks), so all but the last block's sync hides behind the backward of
      the microbatch that syncs: exposed = max(one block's sync, sync - that backward).
    reduce_scatter_per_microbatch: ZeRO-2/3 gradients are reduce-scattered in every
      microbatch's backward (FSDP2 without ``set_requires_gradient_sync(False)``, as the
      module engine runs ZeRO-2/3), so they are sharded at the peak and the sync is paid
      m times, each overlapping its microbatch's backward.
    selective_keeps_matmuls: selective recompute keeps only each block's input and its
      parameter matmuls' outputs and recomputes every other block operator (the module
      engine's op-level policy, as torchtitan's); False: Korthikanti et al.'s selective,
      which recomputes only the attention core (the graph engine, runtime/graph/spmd.py).
    attention: the attention core's kernels: "flash" (fused, the s x s scores stay on chip:
      FlashAttention, cuDNN SDPA, what PyTorch's SDPA picks on GPUs) or "materialized"
      (scores and probabilities written to memory, as attention ran before fused kernels,
      e.g. Megatron-LM 2021: ``compute.materialized_attention_time``).
    causal_mask_skipped: the engine runs the user's modules eagerly, where a Hugging Face
      model without a padding mask builds no causal mask and calls SDPA with
      ``is_causal=True`` (``memory.causal_masks``): the masks the export made are not
      allocated (the module engine); False: the exported graph builds them (the graph
      engine).
    causal_attention: an attention whose mask is the causal pattern the trace built runs
      with ``is_causal=True``, so flash attention skips the blocks above the diagonal
      (``compute.op_time`` ``causal``): the module engine (the eager model builds no mask)
      and the graph engine (its replay finds the folded causal mask and drops it,
      runtime/graph/spmd.py ``_causal_mask``, DECISIONS 67). Compute only; the masks' memory is
      ``causal_mask_skipped``.
    fsdp_keeps_shards: the engine's data parallelism is FSDP2 (``fully_shard``, and
      ``replicate``, which is FSDP2 with a shard group of one), which keeps each parameter's
      shard (the whole tensor under ``replicate``) as the optimizer's parameter and
      all-gathers an unsharded copy for the forward and the backward: a copy ZeRO-3 frees
      after each block and ZeRO-0/1/2 keep from the forward to the backward. Under bf16
      the shard is the fp32 master the model-state table counts already; in fp32 it is a
      second copy beside the unsharded one (benchmarks/gloo_costs.py ``fsdp-memory``, 2
      gloo processes, two 4 MiB layers: live 8 -> 16 MiB over the forward under
      ``replicate``, 4 -> 12 MiB under ``fully_shard(reshard_after_forward=False)``). Only ZeRO-0 sets this
      apart from the graph engine, whose fp32 ZeRO-1/2 keep a master shard beside the
      full weights too (runtime/graph/parallelize.py); both are counted in ``parameter_walk``.
    zero_over_cp: the ZeRO/FSDP group is dp x cp, not dp: optimizer state (ZeRO >= 1),
      gradients (>= 2) and weights (3) are divided by dp x cp, as Megatron-LM's
      distributed optimizer (its data-parallel group with context parallelism,
      ``get_data_parallel_group(with_context_parallel=True)``) and torchtitan's FSDP over
      the flattened dp_shard x cp mesh shard them (DESIGN.md, "ZeRO 1/2/3"); the module
      engine's fully_shard over the flattened dp x cp mesh. False: the graph engine, whose
      ZeRO shards over dp only.
    cp_composable: context parallelism as PyTorch's ``context_parallel`` runs SDPA
      (torchtitan; Llama 3, arXiv 2407.21783 sec. 3.3.2: K/V all-gathered, sequence in
      2 x cp chunks paired head and tail): causal attention skips the blocks above the
      diagonal on every rank, balanced by the head-tail pairing, with no mask in memory;
      K and V are all-gathered over cp in each layer's forward and their gradients
      reduce-scattered in its backward (the all-gather's adjoint; not all-reduced); the
      loss runs on each rank's chunk (the head after the last block, its logits and the
      cross entropy at 1/cp, no logits gathered). False: the graph engine's DTensor
      context parallelism (runtime/graph/context.py): attention under an explicit mask, the
      K/V gradients all-reduced, the logits gathered before the shifted loss.
    attention_kernel: the fused attention kernel the stack runs ("fa2", "fa3", "cudnn"),
      priced on the device's curve for it (``DeviceSpec.attention_kernels``); "": the
      device's ``attention_efficiency`` (PyTorch SDPA's flash backend, FlashAttention-2).
    tp_comm_overlap: tensor-parallel all-gathers and reduce-scatters overlapped with the
      matmuls next to them, decomposed into tp chunks (``_tp_overlap_hidden_s``):
      Megatron-Core's ``--tp-comm-overlap`` (NeMo's recipes turn it on with TP), torchtitan's
      async TP (needs torch.compile). False: exposed in full (meshplan's runtimes).
    overlap_efficiency: of the collective time the factors above hide behind compute
      (``sync_overlaps_backward``, ``param_gather_overlap``), the fraction really hidden.
      1 on NCCL, where a collective issued with ``async_op=False`` is queued on its stream
      and the CPU goes on issuing compute. 0 on gloo: FSDP2 issues its gradient
      reductions and its all-gathers with ``async_op=False`` (torch 2.13,
      ``_fsdp_collectives.foreach_reduce``, ``FSDPParamGroup.unshard``), and a gloo
      collective called that way blocks the calling thread until it is done, so nothing
      runs beside it (a profile of 4 gloo processes, module engine, dp=4: every block's
      all-reduce waited for inside ``post_backward``). ``default_runtime`` sets it from the
      backend; a RuntimeModel built by hand keeps 1 unless told.
    compiled: the repeated blocks run under ``torch.compile`` (meshplan's
      ``parallelize(..., compile=True)``, torchtitan's ``compile.enable``): the pointwise
      and reduction operators between matmuls fuse into one kernel each, priced on their
      external bytes once (costmodel/fusion.py); False: eager, every operator its own
      kernel reading and writing HBM (``compute.op_time``).
    eager_kernels: operators outside torch.compile's fused kernels are priced as the kernels
      eager PyTorch launches for them (costmodel/eager.py: dtypes as they run, autocast's
      casts, autograd's backward kernels and gradient sums, the loss on fp32 logits) and,
      with ``mixed_precision="fsdp"`` where FSDP2 wraps the stage, FSDP2's all-gather
      copy-out on the compute stream (``eager.fsdp_copy_out_bytes``). On for meshplan's
      engines and torchtitan on GPUs; off for Megatron-LM / NeMo, whose Transformer Engine
      and hand-fused kernels (fused layer norm, bias-GeLU, scale-mask-softmax, RoPE) run
      the elementwise work in few kernels, priced one kernel per operator
      (``compute.op_time``), and off on CPU hosts, whose per-operator costs ``meshplan
      calibrate`` fits on ``op_time``'s terms.
    mixed_precision: how a bf16/fp16 run holds its weights eagerly: "autocast" (fp32
      weights, ``torch.autocast`` casting matmul and attention inputs: meshplan's graph
      engine, runtime/graph/spmd.py) or "fsdp" (FSDP2's ``MixedPrecisionPolicy`` gathers
      bf16 weights: torchtitan, and meshplan's module engine where FSDP wraps the stage,
      autocast where it does not, runtime/modules.py ``_autocast``).
    fp8_recipe, fp8_casts, fp8_all_gather: how the stack runs a ``dtype="fp8"`` plan
      (costmodel/fp8.py): the scaling recipe ("torchao-tensorwise", "torchao-rowwise",
      "te-current"), its cast kernels ("eager", "fused", "cast-transpose") and whether
      FSDP all-gathers the block linears' weights in fp8 (torchtitan's
      ``enable_fsdp_float8_all_gather``). Read only under fp8.
    grad_bytes, master_bytes: bytes per parameter, under bf16/fp16, of the accumulated
      gradient and of the master copy in the optimizer state (``memory.state_bytes_per_param``):
      4 and 4 where gradients are fp32 main grads and the master an fp32 copy (Megatron-LM
      forces ``accumulate_allreduce_grads_in_fp32`` under bf16, megatron/training/
      arguments.py; torch FSDP2's fp32 shard); 2 and 2 for NeMo's recipes on Apex's
      ``DistributedFusedAdam`` (``nemo_runtime``). The gradient sync moves ``grad_bytes``.
    fp32_embedding_grads: the input embedding's gradient stays fp32 whatever
      ``grad_bytes`` says (NeMo's ``with_fp32_embedding_grads``, default True).
    fused_activations: the stack runs each elementwise chain between matmuls as one fused
      kernel whose backward rebuilds the chain's intermediates from the tensors it
      materializes (``fusion.recomputed_inside``): Transformer Engine's fused RMSNorm /
      LayerNorm, Megatron-Core's fused SwiGLU and RoPE. False: eager autograd keeps every
      intermediate its backward reads.
    engine, backend: the runtime these factors describe (``default_runtime``).
    """

    grad_sync_overlap: float = 0.0
    param_gather_overlap: float = 1.0
    grad_bucket_bytes: float = DDP_BUCKET_BYTES
    zero3_per_use: bool = False
    reduce_scatter_as_all_reduce: bool = False
    flat_grad_sync: bool = False
    full_grad_accumulation: bool = False
    sync_overlaps_backward: bool = False
    reduce_scatter_per_microbatch: bool = False
    selective_keeps_matmuls: bool = False
    attention: str = "flash"
    causal_mask_skipped: bool = False
    causal_attention: bool = False
    fsdp_keeps_shards: bool = False
    zero_over_cp: bool = False
    cp_composable: bool = False
    attention_kernel: str = ""
    tp_comm_overlap: bool = False
    overlap_efficiency: float = 1.0
    compiled: bool = False
    fp8_recipe: str = "torchao-tensorwise"
    fp8_casts: str = "eager"
    fp8_all_gather: bool = False
    eager_kernels: bool = False
    mixed_precision: str = "autocast"
    grad_bytes: float = GRAD_BYTES
    master_bytes: float = MASTER_BYTES
    fp32_embedding_grads: bool = False
    fused_activations: bool = False
    engine: str = Engine.GRAPH
    backend: str = "nccl"

    def __post_init__(self):
        if self.engine not in PROFILES:
            raise PlanningError(f"engine={self.engine!r} is not one of {', '.join(PROFILES)}; "
                                 "pass the engine the plan names (Plan.engine) or a stack "
                                 "to price it for")
        if self.backend not in BACKENDS:
            raise PlanningError(f"backend={self.backend!r} is not one of {', '.join(BACKENDS)}; "
                                 "gloo runs CPU processes, nccl GPUs")
        if self.attention not in ATTENTION_KERNELS:
            raise PlanningError(f"attention={self.attention!r} is not one of "
                                f"{', '.join(ATTENTION_KERNELS)}; \"flash\" for fused attention "
                                "kernels, \"materialized\" where the s x s scores go to memory")
        if self.mixed_precision not in PRECISIONS:
            raise PlanningError(f"mixed_precision={self.mixed_precision!r} is not one of "
                                f"{', '.join(PRECISIONS)}; \"autocast\" for fp32 weights "
                                "under torch.autocast, \"fsdp\" for FSDP2's bf16 weights")
        if not 0.0 <= self.overlap_efficiency <= 1.0:
            raise PlanningError(f"overlap_efficiency={self.overlap_efficiency!r} is not a "
                                "fraction in [0, 1]; 1 hides every overlapped collective")


def plan_runtime(plan: Plan, hw: HardwareProfile) -> RuntimeModel:
    """The runtime factors of the engine ``plan`` names, compiled when the plan says so."""
    runtime = default_runtime(hw, engine=plan.engine, pipeline=plan.num_stages > 1)
    if plan.training.compiled:
        casts = "fused" if runtime.fp8_casts == "eager" else runtime.fp8_casts
        runtime = replace(runtime, compiled=True, fp8_casts=casts)
    return runtime


def default_runtime(hw: HardwareProfile, *, engine: str = Engine.GRAPH,
                    backend: str | None = None, pipeline: bool = False) -> RuntimeModel:
    """The runtime factors of the engine that executes the plan (``Plan.engine``) on its
    collective backend (default: gloo for CPU processes, NCCL for GPUs).

    "graph" (runtime/graph/parallelize.py, runtime/graph/spmd.py): ZeRO-2 accumulates full gradients
    over the microbatches, ZeRO-3 gathers each block's weights when first used with nothing
    prefetching them, so no overlap; gradients (and ZeRO-1/2 shards) are synced after the
    backward in one flat buffer per group (``lowering.reduce_partial_grads``,
    runtime/graph/zero.py): one latency, not one per 25 MiB bucket. Both engines run an
    attention whose traced mask is the causal pattern with ``is_causal=True``.

    "modules" (runtime/modules.py, torchtitan's composition): ``fully_shard`` per block
    prefetches the next block's all-gather during the current block's compute (FSDP2's
    implicit forward/backward prefetch), so ZeRO-3 gathers hide behind compute; gradients
    are reduced per block (FSDP2's ``replicate`` for ZeRO-0, ``fully_shard`` otherwise) as
    the backward produces them, overlapping it (on NCCL; on gloo nothing overlaps:
    ``overlap_efficiency``); in fp32 FSDP2 keeps each parameter's shard beside the gathered
    copy (``fsdp_keeps_shards``); ZeRO-0/1 sync on the last microbatch only
    (``set_requires_gradient_sync``) and accumulate full gradients, ZeRO-2/3
    reduce-scatter every microbatch and keep sharded gradients (DECISIONS 27).

    "modules" with ``pipeline`` (runtime/module_pipeline.py): torch.distributed.pipelining
    (torch 2.13, ``PipelineStage.backward_maybe_with_nosync``) runs every microbatch's
    backward of an FSDP-wrapped stage with ``set_requires_gradient_sync(False)``, so
    gradients accumulate at full size (fp32, the reduce dtype), and its ``REDUCE_GRAD``
    action (``perform_reduce_grad``) reduce-scatters them once, after the last microbatch's
    backward: one sync per step, behind no compute of this stage (DECISIONS 61).

    gloo's reduce-scatter costs a full all-reduce (RuntimeModel docstring), either engine.
    """
    if backend is None:
        backend = "gloo" if hw.device.host_cores > 0 or hw.device.name == "cpu" else "nccl"
    gloo = backend == "gloo"
    overlap = 0.0 if gloo else 1.0
    # eager kernels priced one by one on GPUs (RuntimeModel.eager_kernels)
    eager = hw.device.host_cores <= 0 and hw.device.name != "cpu"
    if engine == "megatron":
        return megatron_runtime(backend=backend, overlap=overlap)
    if engine == "nemo":
        return nemo_runtime(backend=backend, overlap=overlap)
    if engine == "megatron-2021":
        # Megatron-LM 2021 (Narayanan et al., SC'21; examples/sc21): Q K^T, the fused
        # scale-mask-softmax and P V through memory (no fused attention yet), gradients in one
        # contiguous buffer all-reduced after the pipeline flush, nothing overlapped: the
        # graph engine's terms with materialized attention (DECISIONS 55)
        return replace(default_runtime(hw, engine=Engine.GRAPH, backend=backend),
                       attention="materialized", eager_kernels=False, engine="megatron-2021")
    if engine == "torchtitan":
        # float8 (torchao): tensorwise scaling with the weights all-gathered in fp8
        # (``enable_fsdp_float8_all_gather``, as torchtitan's float8 runs are published)
        return replace(default_runtime(hw, engine=Engine.MODULES, backend=backend,
                                       pipeline=pipeline), engine="torchtitan",
                       fp8_recipe="torchao-tensorwise", fp8_all_gather=True)
    if engine == Engine.MODULES and pipeline:
        return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=1.0, zero3_per_use=False,
                            reduce_scatter_as_all_reduce=gloo, flat_grad_sync=False,
                            full_grad_accumulation=True, sync_overlaps_backward=False,
                            reduce_scatter_per_microbatch=False, selective_keeps_matmuls=True,
                            causal_mask_skipped=True, causal_attention=True,
                            fsdp_keeps_shards=True, zero_over_cp=True, cp_composable=True,
                            overlap_efficiency=overlap, eager_kernels=eager,
                            mixed_precision="fsdp", engine=engine, backend=backend)
    if engine == Engine.MODULES:
        return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=1.0, zero3_per_use=False,
                            reduce_scatter_as_all_reduce=gloo, flat_grad_sync=False,
                            full_grad_accumulation=False, sync_overlaps_backward=True,
                            reduce_scatter_per_microbatch=True, selective_keeps_matmuls=True,
                            causal_mask_skipped=True, causal_attention=True,
                            fsdp_keeps_shards=True, zero_over_cp=True, cp_composable=True,
                            overlap_efficiency=overlap, eager_kernels=eager,
                            mixed_precision="fsdp", engine=engine, backend=backend)
    return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=0.0, zero3_per_use=True,
                        reduce_scatter_as_all_reduce=gloo, flat_grad_sync=True,
                        full_grad_accumulation=True, causal_attention=True,
                        overlap_efficiency=overlap, eager_kernels=eager,
                        mixed_precision="autocast", engine=engine, backend=backend)


def megatron_runtime(*, backend: str = "nccl", overlap: float = 1.0) -> RuntimeModel:
    """Megatron-LM / NeMo as Megatron-Core runs a GPT with Transformer Engine:

    - distributed optimizer (``--use-distributed-optimizer``, plan ``zero=1``): the fp32
      main gradients stay whole in one contiguous buffer, accumulated over the microbatches
      and reduce-scattered once per step, the fp32 master weights and Adam moments sharded
      over the data-parallel group with context parallelism (dp x cp); the updated bf16
      weights all-gathered back (Megatron-LM docs/source/api-guide/dist_optimizer.md:
      6 + 12/d bytes per parameter);
    - ``--overlap-grad-reduce`` / ``--overlap-param-gather``: gradient buckets reduced as
      the backward produces them, updated weights gathered as the next forward needs them;
    - fused attention (cuDNN, Transformer Engine's FusedAttention backend on Hopper) with
      the causal pattern and no
      mask tensor; selective recompute is Korthikanti et al.'s (the attention core);
    - context parallelism on causal, head-tail balanced chunks, loss on each chunk (the
      same terms as ``cp_composable``; Megatron exchanges K/V in a ring of send/recv, the
      same bytes per rank as the all-gather priced here);
    - ``--tp-comm-overlap``: tensor-parallel collectives overlapped with the GEMMs;
    - fp16 with loss scaling in pipelines (nothing to price beyond the fp16 GEMMs);
    - fp8 as NeMo's FP8 "current scaling" (per-tensor scales of the step, Transformer
      Engine's cast-transpose, fp8 inputs saved for the backward: costmodel/fp8.py).
    """
    return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=1.0, zero3_per_use=False,
                        reduce_scatter_as_all_reduce=backend == "gloo", flat_grad_sync=False,
                        full_grad_accumulation=True, sync_overlaps_backward=True,
                        reduce_scatter_per_microbatch=False, selective_keeps_matmuls=False,
                        causal_mask_skipped=True, causal_attention=True,
                        fsdp_keeps_shards=False, zero_over_cp=True, cp_composable=True,
                        attention_kernel="cudnn", tp_comm_overlap=True,
                        overlap_efficiency=overlap, fp8_recipe="te-current",
                        fp8_casts="cast-transpose", fused_activations=True,
                        engine="megatron", backend=backend)


def nemo_runtime(*, backend: str = "nccl", overlap: float = 1.0) -> RuntimeModel:
    """NeMo's Megatron GPT (NeMo 2.0's ``MegatronGPTModel`` with ``mcore_gpt``, the NeMo
    24.09 container) as NVIDIA's dgxc-benchmarking llama3.1 recipes run it (their
    llama3.1_*.yaml, v24.11.1): Megatron-Core's model with Transformer Engine as
    ``megatron_runtime`` prices it, trained with ``optim.name: distributed_fused_adam``
    (Apex's ``DistributedFusedAdam`` through NeMo's ``MegatronDistributedFusedAdam``),
    ``grad_sync_dtype: bf16``, ``contiguous_grad_buffer`` and ``contiguous_param_buffer``:

    - gradients accumulate in one contiguous bf16 buffer (2 bytes a parameter) and are
      reduce-scattered in bf16; the word embedding's in fp32 (``_with_fp32_optimizer``,
      ``with_fp32_embedding_grads`` default True: megatron_gpt_model.py
      ``configure_optimizers``);
    - bf16 weights with fp32 Adam state: NeMo sets ``store_params=False,
      store_param_remainders=True`` (megatron_base_model.py ``setup_optimization``), so the
      optimizer keeps the moments and the 16 low bits of each fp32 master (4 + 4 + 2 bytes),
      sharded over the data-parallel group with context parallelism
      (``get_data_parallel_group(with_context_parallel=True)``, nemo/core/optim/
      distributed_adam.py).
    Under fp8 the recipes set ``fp8_params``, and NeMo then stores fp32 masters
    (``store_params=True``): 4 bytes."""
    return replace(megatron_runtime(backend=backend, overlap=overlap), grad_bytes=2.0,
                   master_bytes=2.0, fp32_embedding_grads=True, engine="nemo")


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


@dataclass(frozen=True, slots=True)
class StageBreakdown:
    """Costs of one stage: times per microbatch, once-per-step times, memory at its peak."""

    forward_s: float
    backward_s: float
    recompute_s: float
    comm_s: float  # exposed activation/p2p/ZeRO-3 communication per microbatch
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
                                fp8=fp8, eager=_eager_precision(stage, runtime))
    recompute, comm_rec = _recompute_s(ops, stage.recompute, runtime)
    copy_fwd, copy_bwd = _fsdp_copy_out_s(stage, graph, hw, dtype, runtime, contention)
    tp_hidden = _tp_overlap_hidden_s(ops, stage.recompute) if runtime.tp_comm_overlap else 0.0
    p2p = _p2p_s(stage, hw, ops.p2p_bytes, num_stages=num_stages, schedule=schedule,
                 virtual_stages=virtual_stages)
    params = _cached_parameter_walk(cache, stage, graph, ops.consumer_out, dtype=dtype,
                                    optimizer=optimizer, runtime=runtime)
    traffic = _param_traffic_s(params, stage, coll, runtime, forward_s=ops.fwd + copy_fwd,
                               backward_s=ops.bwd + copy_bwd, recompute_s=recompute)
    comm_mb = (ops.comm_fwd + ops.comm_bwd + comm_rec - tp_hidden + p2p
               + traffic.gather_exposed_s + traffic.microbatch_s)
    optimizer_s = _optimizer_s(params, hw, dtype=dtype, optimizer=optimizer,
                               contention=all_procs)
    if not memory:
        return StageBreakdown(forward_s=ops.fwd + copy_fwd, backward_s=ops.bwd + copy_bwd,
                              recompute_s=recompute, comm_s=comm_mb,
                              grad_sync_s=traffic.step_s, optimizer_s=optimizer_s, memory=None)

    prof = stage_activation_profile(stage, graph, hw, dtype=dtype, microbatches=m,
                                    seq_len=seq_len, attention=runtime.attention, cache=cache,
                                    fused=runtime.fused_activations)
    kept, working = prof.stage_bytes(stage.recompute,
                                     keep_matmuls_only=runtime.selective_keeps_matmuls,
                                     without_masks=runtime.causal_mask_skipped)
    if fp8 is not None and stage.recompute != Recompute.FULL:  # fp8 inputs saved for the backward
        kept -= fp8_model.saved_input_bytes_saved(graph, stage.ops, _split_of(stage, graph),
                                                  1.0 / m, fp8)
    acts = activation_memory(kept, working, schedule=schedule, stage=stage.index,
                             num_stages=num_stages, microbatches=m, virtual_stages=virtual_stages)
    buffers = _buffer_bytes(params, stage.zero, runtime, dtype=dtype, activation_bytes=acts)
    buffers += fp8_model.weight_copy_bytes(stage, graph, fp8, lambda n: _param_layer(n, graph))
    memory = MemoryBreakdown(params_gib=params.weights_bytes / GIB,
                             grads_gib=params.grads_bytes / GIB,
                             optimizer_gib=params.optimizer_bytes / GIB,
                             activations_gib=acts / GIB, buffers_gib=buffers / GIB)
    return StageBreakdown(forward_s=ops.fwd + copy_fwd, backward_s=ops.bwd + copy_bwd,
                          recompute_s=recompute,
                     comm_s=comm_mb, grad_sync_s=traffic.step_s, optimizer_s=optimizer_s,
                     memory=memory)


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


def _fsdp_copy_out_s(stage: Stage, graph: OpGraph, hw: HardwareProfile, dtype: str,
                     runtime: RuntimeModel, contention: float) -> tuple[float, float]:
    """(forward, backward) seconds per microbatch of FSDP2's all-gather copy-out on the
    compute stream (``eager.fsdp_copy_out_bytes``), one copy per FSDP unit (the blocks and
    the root) and gather: before the forward, and again before the backward where ZeRO-3
    resharded the weights after the forward."""
    if not runtime.eager_kernels or stage.zero < 1 or not _fsdp_active(stage, runtime):
        return 0.0, 0.0
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
    return one, (one if stage.zero >= 3 else 0.0)


class CollectivePrices:
    """Seconds of one collective on one axis of a stage's mesh (``coll(kind, bytes,
    axis)``). Identical layers ask for the same collectives again and again: each is priced
    once, in ``cache`` when given (shared by every stage on the same devices)."""

    __slots__ = ("hw", "shape", "links", "tree", "memo")

    def __init__(self, stage: Stage, hw: HardwareProfile, *, backend: str,
                 cache: dict | None = None):
        self.hw = hw
        self.shape = stage.mesh_shape
        first = stage.devices[0] if stage.devices else 0
        self.links = [axis_link(self.shape, a, hw.devices_per_node, first)
                      for a in range(len(self.shape))]
        self.tree = backend == "nccl"  # NCCL picks ring or tree; gloo rings
        self.memo = {} if cache is None else cache.setdefault(
            ("collectives", self.shape, first, id(hw), backend), {})

    def __call__(self, kind: Collective, nbytes: float, axis: int) -> float:
        key = (kind, nbytes, axis)
        t = self.memo.get(key)
        if t is None:
            crosses, local = self.links[axis]
            t = self.memo[key] = collective_time_s(self.hw, kind, nbytes, self.shape[axis],
                                                   crosses_nodes=crosses, local_size=local,
                                                   tree=self.tree)
        return t


def _recompute_s(ops: _OperatorPass, recompute: str,
                 runtime: RuntimeModel) -> tuple[float, float]:
    """(recomputed forward compute, its activation collectives) per microbatch. "full"
    reruns every block operator's forward with its collectives; "selective" the attention
    core (Korthikanti et al. 2022, section 5), or, in the module engine, every block
    operator but the parameter matmuls (``RuntimeModel.selective_keeps_matmuls``)."""
    if recompute == Recompute.FULL:
        return ops.rec_full, ops.comm_layers_fwd
    if recompute == Recompute.SELECTIVE:
        return (ops.rec_nonmatmul if runtime.selective_keeps_matmuls else ops.rec_sel), 0.0
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


# -- parameters: model state and the collectives their gradients need --------------------

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
    key = ("param-walk", id(stage.params), id(consumer_out), id(graph.params),
           graph.block_module, stage.mesh_shape, stage.axis_names, stage.zero, dtype,
           optimizer, runtime)
    hit = cache.get(key)
    if hit is not None and hit[0] is stage.params and hit[1] is consumer_out and \
            hit[2] is graph.params:
        return hit[3]
    walk = parameter_walk(stage, graph, consumer_out, dtype=dtype, optimizer=optimizer,
                          runtime=runtime)
    cache[key] = (stage.params, consumer_out, graph.params, walk)
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


# -- pricing the parameter traffic --------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _TrafficTimes:
    step_s: float  # exposed once per step: gradient sync, ZeRO-1/2 updated-shard gathers
    microbatch_s: float  # exposed per microbatch: per-use ZeRO-3 / per-microbatch reduce-scatter
    gather_exposed_s: float  # ZeRO-3 weight all-gathers per microbatch not hidden by compute


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
        if runtime.reduce_scatter_per_microbatch and stage.zero >= 2:
            mb_sync += _hidden_s(grad_sync, behind, units, e)
            grad_sync = 0.0
        step = _hidden_s(grad_sync, behind, units, e) + \
            _hidden_s(updated_gather, forward_s, units, e)
    else:
        # the gather of updated weights follows the optimizer step: nothing to overlap with
        step = grad_sync * (1 - runtime.overlap_efficiency * runtime.grad_sync_overlap) \
            + updated_gather
    compute = forward_s + backward_s + recompute_s
    ideal = max(0.0, gather - runtime.param_gather_overlap * compute)
    exposed = gather - runtime.overlap_efficiency * (gather - ideal)
    return _TrafficTimes(step_s=step, microbatch_s=mb_sync, gather_exposed_s=exposed)


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
                 contention: float) -> float:
    """The optimizer step: its state read and written at memory bandwidth, plus kernels
    per tensor (the per-tensor fixed costs are CPU work on a CPU host and time-share its
    cores too)."""
    return optimizer_step_s(params.optimizer_numel, params.tensors, hw, dtype=dtype,
                            optimizer=optimizer, contention=contention)


def optimizer_step_s(numel: float, tensors: int, hw: HardwareProfile, *, dtype: str,
                     optimizer: str, contention: float) -> float:
    """The optimizer step over ``numel`` parameters in ``tensors`` tensors (``_optimizer_s``):
    linear in both, so the intra-op ILP prices it parameter by parameter."""
    dev = hw.device
    return (optimizer_traffic_s(numel, dtype=dtype, optimizer=optimizer, hw=hw)
            + tensors * OPTIMIZER_OPS_PER_TENSOR.get(optimizer, 10)
            * (dev.kernel_latency_s + dev.framework_overhead_s)) * contention


# -- memory: activations and buffers ----------------------------------------------------------

def stage_activation_profile(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
                             microbatches: int, seq_len: int, attention: str = "flash",
                             cache: dict | None = None,
                             fused: bool = False) -> ActivationProfile:
    """Activation bytes per layer of one microbatch on one device of ``stage``. It does not
    depend on recompute, ZeRO or the schedule, so ``cache`` keeps it for every plan that
    shares ``stage.ops``. ``fused``: the stack's fused kernels keep only what they
    materialize (``RuntimeModel.fused_activations``)."""
    m = max(1, microbatches)
    key = ("activations", id(stage.ops), id(stage.inputs), stage.mesh_shape, m, dtype,
           hw.device.name, seq_len, attention, fused)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is stage.ops and hit[1] is stage.inputs:
        return hit[2]
    placement = _placements(stage)
    read_as = _received_placements(stage, graph, placement)
    shape = stage.mesh_shape

    def split_of(tensor: str) -> int:
        pl = placement.get(tensor) or read_as.get(tensor)
        return split_factor(pl, shape) if pl else 1

    names = list(stage.ops)
    dbytes = DTYPE_BYTES[dtype]
    # s x s tensors an attention core keeps (materialized, or CPU math with dropout), each
    extra = max((attention_saved_bytes(graph.node(n), hw, attention, dtype, split_of(n) * m)
                 for n in names), default=0.0)
    prof = activation_profile(graph, names, split_of=split_of, dtype_bytes=dbytes,
                              seq_len=seq_len, micro_fraction=1.0 / m,
                              attention_extra_per_node=extra,
                              recomputed=recomputed_inside(graph, names) if fused else None)
    if cache is not None:
        cache[key] = (stage.ops, stage.inputs, prof)
    return prof


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


# -- operators: compute and activation communication of one microbatch --------------------------

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


def _cached_operator_pass(cache: dict | None, stage: Stage, graph: OpGraph, hw: HardwareProfile,
                          dtype: str, m: int, contention: float, coll,
                          backend: str = "nccl", attention: str = "flash", *,
                          causal: bool = False, cp_composable: bool = False,
                          compiled: bool = False, fp8=None, eager: str = "") -> _OperatorPass:
    """The operator walk, reused across plans that share ``stage.ops`` (a sweep prices
    thousands of configurations over a few dozen placement sets). ``causal``: attention
    that reads a causal mask runs with ``is_causal=True`` (``RuntimeModel.causal_attention``)."""
    key = (id(stage.ops), id(stage.inputs), stage.mesh_shape, stage.devices[:1], m, dtype,
           contention, id(hw), backend, attention, causal, cp_composable, compiled, fp8, eager)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit.ops is stage.ops and hit.inputs is stage.inputs:
        return hit
    kernels = _cached_eager_kernels(cache, graph, dtype, eager, m, compiled) if eager else None
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
                            kernels=kernels, times=times)
    if cache is not None:
        cache[key] = result
    return result


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
    if m > 2:  # only ``.grad`` accumulation depends on m, as (m - 1) / m: scale m = 2's walk
        scale = 2 * (m - 1) / m
        two = _cached_eager_kernels(cache, graph, dtype, precision, 2, compiled)
        kernels = {name: replace(op, accumulate=tuple(
            replace(k, read_bytes=k.read_bytes * scale, written_bytes=k.written_bytes * scale)
            for k in op.accumulate))
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
                   times: dict | None = None) -> _OperatorPass:
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

    fwd = bwd = rec_full = rec_sel = rec_nonmatmul = 0.0
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
    fused = fused_by_member(graph, names) if compiled else {}  # torch.compile's kernels
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
                                                       cp_composable or cp_ax is None))
            if tkey is not None:
                times[tkey] = t
        fwd += t.forward_s
        bwd += t.backward_s
        if node.layer >= 0:
            rec_full += t.forward_s
            if selective_recomputes(node, graph, group):
                rec_sel += t.forward_s
            if not (node.kind == OpKind.MATMUL
                    and any(i in graph.param_map for i in node.inputs)):
                rec_nonmatmul += t.forward_s
            else:
                mm_fwd += t.forward_s
                mm_bwd += t.backward_s
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
                    feeds_split=name in feeds_split):
                on_tp = axis == tp_ax and node.layer >= 0
                comm_fwd += tf
                comm_layers_fwd += tf if node.layer >= 0 else 0.0
                tp_fwd += tf if on_tp else 0.0
                tp_layers_fwd += tf if on_tp else 0.0
                comm_bwd += tb
                tp_bwd += tb if on_tp else 0.0
    return _OperatorPass(ops=stage.ops, inputs=stage.inputs, fwd=fwd, bwd=bwd, rec_full=rec_full, rec_sel=rec_sel,
                         rec_nonmatmul=rec_nonmatmul,
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


def operator_time(node, op, graph: OpGraph, hw: HardwareProfile, dtype: str,
                  shape: tuple[int, ...], m: int, contention: float, *, group=None,
                  kernels: dict | None = None, attention: str = "flash", fp8=None,
                  causal: bool = False) -> OpTime:
    """Forward and backward seconds of one operator placed as ``op`` (an OpPlacement) for
    one of ``m`` microbatches: fp8 GEMMs, a fused group (priced at its lead), eager kernels,
    materialized attention or ``compute.op_time``, plus the eager extras (autocast's casts,
    ``.grad`` sums) of a compute-bound operator. The operator walk below and the intra-op
    ILP (planner/pricing.py) both price operators with it."""
    name = node.name
    shard = split_factor(op.output, shape) * m
    w8 = fp8_model.fp8_weight_input(node, graph) if fp8 is not None else None
    if w8 is not None and w8 < len(op.inputs):  # a block linear's GEMMs in fp8
        t = fp8_model.linear_time(
            node, hw, fp8, shard=shard,
            weight_numel=graph.param_map[node.inputs[w8]].numel
            / split_factor(op.inputs[w8], shape), contention=contention, microbatches=m)
    elif group is not None:  # priced once, at its first fusible operator
        t = fused_time(group, hw, dtype, shard, contention=contention) \
            if name == group.lead else OpTime(0.0, 0.0)
    elif kernels is not None and node.kind in MEMORY_BOUND + (OpKind.VIEW, OpKind.LOSS):
        t = eager_time(kernels.get(name, EagerOp()), hw, shard, contention=contention)
    elif attention == "materialized" and node.kind == OpKind.ATTENTION:
        t = materialized_attention_time(node, hw, dtype, shard, contention=contention)
    else:
        t = op_time(node, hw, dtype, shard, contention=contention, causal=causal)
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
                      feeds_split: bool = False) -> list[tuple[int, float, float]]:
    """(axis, forward s, backward s) of the collectives that give an operator with output
    placement ``out`` its input of ``nbytes`` (one microbatch, global) produced as ``src``
    and read as ``dst``: the redistribution (``reshard_collectives``) and, for an input read
    whole by an operator split on the axis, the all-reduce of its partial gradient
    (Megatron's f/g). ``feeds_split``: the consumer's replicated output reaches a cp-split
    operator (``_feeds_split``)."""
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
        tf = coll(f, buf, axis) if f else 0.0
        tb = coll(b, buf, axis) if b else 0.0
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

    def compute_s(self, node, op) -> float:
        """Forward, backward and recomputed forward of one microbatch."""
        cp_ax = self.stage.axis_names.index("cp") if "cp" in self.stage.axis_names else None
        group = self.fused.get(node.name)
        t = operator_time(node, op, self.graph, self.hw, self.dtype, self.stage.mesh_shape,
                          self.m, self.contention, group=group, kernels=self.kernels,
                          attention=self.runtime.attention, fp8=self.fp8,
                          causal=causal_attention(node, self.graph, self.masks,
                                                   self.runtime.cp_composable or cp_ax is None))
        rec = self.stage.recompute
        again = node.layer >= 0 and (rec == Recompute.FULL or rec == Recompute.SELECTIVE and (
            not (node.kind == OpKind.MATMUL and any(i in self.graph.param_map for i in node.inputs))
            if self.runtime.selective_keeps_matmuls
            else selective_recomputes(node, self.graph, group)))
        return t.total_s + (t.forward_s if again else 0.0)

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
                feeds_split=node.name in feeds))
        return total


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
        kernels=eager_kernel_table(graph, t.dtype, precision, m, runtime.compiled)
        if precision else None,
        fused=fused_by_member(graph, list(stage.ops)) if runtime.compiled else {},
        fp8=fp8_model.fp8_pricing(t.dtype, runtime),
        masks=causal_masks(graph) if causal else set())


def _user_causal(node) -> bool:
    """An attention the user's code calls with ``is_causal=True`` (no mask to recognise):
    every engine runs it so, and flash attention skips the blocks above the diagonal."""
    args, kwargs = node.parsed_args()
    return kwargs.get("is_causal", args[5] if len(args) > 5 else False) is True


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


def rank_group_record(plan: Plan, records) -> Stage:
    """One record holding every chunk of a rank group (operators in graph order, all
    their parameters): what the group keeps in memory and syncs once per step."""
    ops, params = {}, {}
    for j in records:
        ops.update(plan.stages[j].ops)
        params.update(plan.stages[j].params)
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
        union = replace(rank_group_record(plan, records), index=g)
        gc = stage_cost(union, graph, hw, compute_contention=contention, **group_kw)
        for j in records:
            costs[j] = replace(costs[j], grad_sync_s=gc.grad_sync_s,
                               optimizer_s=gc.optimizer_s, memory=gc.memory)
    return costs


def runtime_hardware(hw: HardwareProfile, runtime: RuntimeModel,
                     cache: dict | None = None) -> HardwareProfile:
    """``hw`` with fused attention priced on the runtime's kernel
    (``RuntimeModel.attention_kernel``); kept in ``cache`` so that the prices cached by
    ``id(hw)`` stay tied to one live object."""
    device = hw.device.with_attention_kernel(runtime.attention_kernel)
    if device is hw.device:
        return hw
    key = ("hardware", id(hw), runtime.attention_kernel)
    hit = cache.get(key) if cache is not None else None
    if hit is not None and hit[0] is hw:
        return hit[1]
    out = replace(hw, device=device)
    if cache is not None:
        cache[key] = (hw, out)
    return out


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


def value_bytes(graph: OpGraph, name: str, dtype: str) -> float:
    """Bytes of one value (an operator's outputs or a graph input) in the compute dtype, as
    the operator walk prices its redistribution (the whole traced batch)."""
    return _bytes(graph, name, DTYPE_BYTES[dtype])


def eager_kernel_table(graph: OpGraph, dtype: str, precision: str, microbatches: int = 1,
                       compiled: bool = False, cache: dict | None = None) -> dict:
    """Every operator's eager kernels (``eager.eager_kernels``), the walk the operator walk
    reads (one per graph, dtype, precision and microbatch count)."""
    return _cached_eager_kernels(cache, graph, dtype, precision, microbatches, compiled)


def _bytes(graph: OpGraph, name: str, dbytes: int) -> float:
    metas = graph.node(name).outputs if name in graph else \
        tuple(m for n, m in graph.inputs if n == name)
    return sum(mm.numel * (dbytes if mm.dtype.startswith(("float", "bfloat")) else
                           mm.bytes / max(1, mm.numel)) for mm in metas)


def param_layer(name: str, graph: OpGraph) -> int:
    """The block a parameter belongs to (its ZeRO-3 / FSDP unit), -1 outside the blocks."""
    return _param_layer(name, graph)


def _embedding_weights(graph: OpGraph) -> set[str]:
    """The parameters an embedding lookup reads (the word embedding)."""
    return {i for n in graph.nodes if n.kind == OpKind.EMBEDDING for i in n.inputs
            if i in graph.param_map}


def _param_layer(name: str, graph: OpGraph) -> int:
    prefix = graph.block_module + "."
    if graph.block_module and name.startswith(prefix):
        head = name[len(prefix):].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return -1


def bandwidth_s(coll, kind: Collective, nbytes: float, axis: int) -> float:
    """A collective's time less its latency: the share of one buffer's time a tensor in it
    adds (a flat buffer pays its latency once)."""
    return _bandwidth_s(coll, kind, nbytes, axis)


def _bandwidth_s(coll, kind: Collective, nbytes: float, axis: int) -> float:
    """A collective's time less its latency (the time of an empty one)."""
    return coll(kind, nbytes, axis) - coll(kind, 1e-30, axis) if nbytes else 0.0


def _buckets(total_bytes: float, bucket_bytes: float) -> int:
    """Collectives a bucketed sync of ``total_bytes`` makes (one flat buffer: ``inf``)."""
    return max(1, math.ceil(total_bytes / bucket_bytes)) if total_bytes > 0 else 0
