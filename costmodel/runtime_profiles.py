"""Runtime profiles: how the executing engine or stack schedules its work, as priced.

trace -> **cost** -> solve -> run. ``RuntimeModel`` holds the documented factors of one runtime
(overlap of the gradient sync and of ZeRO-3 all-gathers, what the backend really hides, gradient
buckets, fused kernels, the attention kernel, the optimizer's state). ``default_runtime`` builds
the profile of one of meshplan's engines or of another stack in ``STACKS`` (Megatron-LM, NeMo,
torchtitan: ``megatron_runtime``, ``nemo_runtime``) a plan can be priced for; ``plan_runtime``
the profile of a plan's own engine; ``runtime_hardware`` the hardware with attention on that
runtime's kernel. ``costmodel/estimate.py`` prices every stage under one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.costmodel.compute import ATTENTION_KERNELS
from meshplan.costmodel.eager import PRECISIONS
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GRAD_BYTES, MASTER_BYTES
from meshplan.errors import PlanningError
from meshplan.plan import Plan
from meshplan.vocabulary import ENGINES, Engine
from meshplan.costmodel.fp8 import recipe_for_engine


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
    selective_alternate_matmuls: with ``selective_keeps_matmuls``, torchtitan's own op-level
      policy instead (``memory.alternate_matmuls``): it keeps SDPA's outputs and every other
      parameter matmul's output of a block (the 1st, 3rd, ... ``aten.mm`` call) and
      recomputes the rest: in a Llama block k, o and up projections are recomputed and the
      attention kernel is not; a biased linear (``aten.addmm``) is neither counted nor kept.
    attention: the attention core's kernels: "flash" (fused, the s x s scores stay on chip:
      FlashAttention, cuDNN SDPA, what PyTorch's SDPA picks on GPUs) or "materialized"
      (scores and probabilities written to memory, as attention ran before fused kernels,
      e.g. Megatron-LM 2021: ``compute.materialized_attention_time``).
    causal_mask_skipped: the engine runs the user's modules eagerly, where a Hugging Face
      model without a padding mask builds no causal mask and calls SDPA with
      ``is_causal=True`` (``memory.causal_masks``): the masks the export made are not
      allocated (the module engine); False: the exported graph builds them (the graph
      engine).
    local_factories: the engine runs the user's modules on each rank's shard, where a
      factory sized from a tensor (``x.new_empty(...)``, ``zeros_like``) reads its sizes off
      the local tensor, so its output is split as that tensor
      (``stage_layout.factory_split``): the module engine, Megatron-Core, torchtitan. False:
      the graph engine, whose replay allocates the traced sizes and whose DTensor
      ``new_factory`` rule replicates a new shape (the plan's placement).
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
      device's ``attention_efficiency``, the kernel PyTorch's SDPA picks by default there
      (on Hopper cuDNN's since torch 2.9; DECISIONS 102).
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
      copy-out and its gradients' copy-in on the compute stream
      (``eager.fsdp_copy_out_bytes``, ``eager.fsdp_reduce_copy_in_bytes``). On for meshplan's
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
    eager_activations: the engine runs the model with eager autograd under its mixed
      precision (``mixed_precision``, or autocast where FSDP2 does not hold the stage), so
      its activations are kept at the dtypes eager PyTorch holds them in: autocast's fp32
      residual stream and its per-use casts, the fp32 chain inside a norm, the fp32 loss
      (``memory.activation_profile``). False: every float activation in the plan's dtype
      (a stack whose own model code keeps them so: Megatron-LM).
    engine, backend: the runtime these factors describe (``default_runtime``).
    ep_a2a_overlap: fraction of expert parallelism's dispatch and combine all-to-alls hidden
      behind compute (costmodel/moe.py). 0 for every engine and stack profile: torchtitan
      0.3's expert-parallel style and Megatron-Core's ``alltoall`` token dispatcher run them
      on the compute stream between the router and the grouped GEMMs (the dispatcher needs
      the token counts first); Megatron's ``--overlap-moe-expert-parallel-comm`` and
      DeepSeek-V3's DualPipe, which hide them ("both all-to-all and PP communication can be
      fully hidden", DeepSeek-V3 report arXiv 2412.19437 sec. 3.2.1), set it where a run
      used them.
    moe_host_syncs: device-to-host syncs of the routed token counts per MoE layer forward
      that the stack makes at any ep (costmodel/moe.py ``SYNC_KERNELS``; the all-to-all's
      split sizes at ep > 1 come on top for every runtime): 1 for Megatron-Core, whose
      Transformer Engine ``GroupedLinear`` takes its per-expert row counts as a host list
      (``m_splits``); 0 where the grouped GEMM reads them on the device
      (``torch._grouped_mm``'s ``offs``: torchtitan, transformers' experts).
    grouped_gemm_per_expert: the stack's grouped GEMM launches one GEMM per local expert
      (Transformer Engine's ``multi_stream_cublas_gemm``: Megatron-Core's
      ``--moe-grouped-gemm``), each costing at least a kernel latency; False: one grouped
      kernel (``torch._grouped_mm``, DeepGEMM).
    moe_imbalance: the busiest rank's routed tokens over the mean (costmodel/moe.py). 1.0:
      balanced routing, as NVIDIA's published MoE benchmarks force it (Megatron-Bridge
      docs/performance-summary.md: "we force-balance the token distribution among
      experts"); a run that does not force balance states its own measured factor.
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
    selective_alternate_matmuls: bool = False
    attention: str = "flash"
    causal_mask_skipped: bool = False
    local_factories: bool = False
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
    eager_activations: bool = False
    engine: str = Engine.GRAPH
    backend: str = "nccl"
    ep_a2a_overlap: float = 0.0
    moe_imbalance: float = 1.0
    moe_host_syncs: int = 0
    grouped_gemm_per_expert: bool = False

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
    """The runtime factors of the engine ``plan`` names, compiled when the plan says so,
    running the plan's fp8 recipe."""
    return with_fp8_recipe(with_compile(default_runtime(hw, engine=plan.engine,
                                                        pipeline=plan.num_stages > 1),
                                        plan.training.compiled), plan.training.fp8_recipe)


def with_fp8_recipe(runtime: RuntimeModel, recipe: str) -> RuntimeModel:
    """``runtime`` running the public fp8 recipe ``recipe`` (costmodel/fp8.py
    ``recipe_for_engine``; "": the engine's own). Transformer Engine's recipe keeps its
    cast-transpose kernels; a torchao recipe on a stack that ran Transformer Engine's is
    refused there."""
    if not recipe:
        return runtime

    name, gather = recipe_for_engine(recipe, runtime.engine)
    return replace(runtime, fp8_recipe=name, fp8_all_gather=gather)


def with_compile(runtime: RuntimeModel, compiled: bool) -> RuntimeModel:
    """``runtime`` with its repeated blocks under ``torch.compile`` where ``compiled``:
    torchao's fp8 amax / scale / cast fuse into one kernel per input. The one place the
    estimate, ``meshplan.estimate(compiled=True)`` and the stack layout search make it."""
    if not compiled:
        return runtime
    casts = "fused" if runtime.fp8_casts == "eager" else runtime.fp8_casts
    return replace(runtime, compiled=True, fp8_casts=casts)


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
                       attention="materialized", eager_kernels=False,
                       eager_activations=False, engine="megatron-2021")
    if engine == "torchtitan":
        # float8 (torchao): tensorwise scaling with the weights all-gathered in fp8
        # (``enable_fsdp_float8_all_gather``, as torchtitan's float8 runs are published)
        return replace(default_runtime(hw, engine=Engine.MODULES, backend=backend,
                                       pipeline=pipeline), engine="torchtitan",
                       fp8_recipe="torchao-tensorwise", fp8_all_gather=True,
                       selective_alternate_matmuls=True)
    if engine == Engine.MODULES:
        modules = RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=1.0,
                               zero3_per_use=False, reduce_scatter_as_all_reduce=gloo,
                               flat_grad_sync=False, full_grad_accumulation=False,
                               sync_overlaps_backward=True, reduce_scatter_per_microbatch=True,
                               selective_keeps_matmuls=True, causal_mask_skipped=True,
                               local_factories=True, causal_attention=True,
                               fsdp_keeps_shards=True, zero_over_cp=True, cp_composable=True,
                               overlap_efficiency=overlap,
                               eager_kernels=eager, mixed_precision="fsdp",
                               eager_activations=True, engine=engine, backend=backend)
        if pipeline:  # a pipelined stage keeps full gradients and reduces them once per step
            return replace(modules, full_grad_accumulation=True, sync_overlaps_backward=False,
                           reduce_scatter_per_microbatch=False)
        return modules
    return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=0.0, zero3_per_use=True,
                        reduce_scatter_as_all_reduce=gloo, flat_grad_sync=True,
                        full_grad_accumulation=True, causal_attention=True,
                        overlap_efficiency=overlap, eager_kernels=eager,
                        mixed_precision="autocast", eager_activations=True, engine=engine,
                        backend=backend)


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
      Engine's cast-transpose, fp8 inputs saved for the backward: costmodel/fp8.py);
    - mixtures of experts as its TEGroupedMLP runs them: one cuBLAS GEMM per local expert
      and the routed token counts synced to the host for ``m_splits``
      (``grouped_gemm_per_expert``, ``moe_host_syncs``: costmodel/moe.py).
    """
    return RuntimeModel(grad_bucket_bytes=0.0, param_gather_overlap=1.0, zero3_per_use=False,
                        reduce_scatter_as_all_reduce=backend == "gloo", flat_grad_sync=False,
                        full_grad_accumulation=True, sync_overlaps_backward=True,
                        reduce_scatter_per_microbatch=False, selective_keeps_matmuls=False,
                        causal_mask_skipped=True, local_factories=True,
                        causal_attention=True, fsdp_keeps_shards=False, zero_over_cp=True, cp_composable=True,
                        attention_kernel="cudnn", tp_comm_overlap=True,
                        overlap_efficiency=overlap, fp8_recipe="te-current",
                        fp8_casts="cast-transpose", fused_activations=True,
                        moe_host_syncs=1, grouped_gemm_per_expert=True,
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
