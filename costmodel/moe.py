"""Mixture of experts: the routed experts of a traced graph and the price of expert parallelism.

trace -> **cost** -> solve -> run. A stage with ``ep`` > 1 splits each MoE layer's routed
experts over ``ep`` ranks borrowed from its dp x cp x tp ranks (the plan's ``Stage.ep``,
torchtitan 0.3's ``expert_parallel_degree``; Megatron-Core's ``--expert-model-parallel-size``
with expert-TP 1, its MoE parallel folding) and shards the experts' state over the rest,
``efsdp = dp * cp * tp / ep``. ``estimate.stage_cost`` calls ``ep_cost_terms`` for every stage
holding routed experts, so ``meshplan.estimate``, ``explain``, ``report`` and the pipeline
search (planner/stagecost.py prices its candidates with ``stage_cost``) read one price:

- **dispatch and combine**: per MoE layer, an all-to-all of each rank's routed tokens to
  the ranks holding their experts and one back, in the forward and again (their
  gradients) in the backward. Each rank sends tokens x top_k x hidden x dtype bytes, of
  which (ep - 1) / ep leave it. Inside one node the all-to-all runs on NVLink; an ep group
  spanning nodes sends the share bound for other nodes over InfiniBand while the in-node
  share crosses NVLink at the same time (``all_to_all_s``: each rank's NIC and NVLink
  ports work in parallel, as NCCL's all-to-all over its p2p channels runs them; the
  slower of the two sets the time).
- **grouped GEMM**: the routed experts' GEMMs at the tokens each local expert receives,
  ``tokens_per_expert``: every expert's rows are padded to the grouped kernel's M tile
  (``GROUPED_M_TILE``), and each group's GEMM reads its expert's weights, so few tokens
  per expert make the kernel memory-bound (the roofline of ``compute.roofline_s`` on the
  bytes the local experts' GEMMs move). The priced operator time of the traced grouped
  GEMM is replaced by this one.
- **routing imbalance**: the busiest rank's share over the mean, ``RuntimeModel.moe_imbalance``
  (1.0 where the run forces balanced routing, as NVIDIA's published MoE benchmarks do:
  Megatron-Bridge docs/performance-summary.md, "we force-balance the token distribution
  among experts"). The grouped GEMMs and the all-to-all scale by it.
- **expert state**: weights, gradients and optimizer state of the routed experts divided by
  ``ep`` (each rank holds its experts) and by ``efsdp`` as the stage's ZeRO stage shards
  state over data parallelism (torchtitan's FSDP over efsdp; Megatron's distributed
  optimizer over the expert-data-parallel group); their gradients are reduced over efsdp
  only, and ZeRO-3 gathers them over efsdp.
- **dispatch buffers and permuted activations**: the permuted tokens (tokens x top_k x
  hidden) the grouped GEMMs read, saved for the backward, and the dispatch/combine receive
  buffers of one layer alive in the working set.
- **overlap**: the fraction of the all-to-all the stack hides behind compute,
  ``RuntimeModel.ep_a2a_overlap`` (0 unless the stack documents an overlap).
- **fixed cost per MoE layer and microbatch** (``RuntimeModel.moe_host_syncs``,
  ``RuntimeModel.grouped_gemm_per_expert``): the forward's device-to-host syncs of the
  routed token counts, each draining the GPU (``SYNC_KERNELS`` kernel latencies): the
  all-to-all's split sizes are host lists (``all_to_all_single``'s ``input_split_sizes`` /
  ``output_split_sizes``: torchtitan 0.3's expert-parallel dispatch and meshplan's
  runtime/expert_parallel.py call ``.tolist()`` on them; Megatron-Core's alltoall
  dispatcher copies them to the host, Megatron-LM issue #1598), and so are Transformer
  Engine's ``GroupedLinear`` ``m_splits`` (Megatron-Core's TEGroupedMLP, at any ep); and a
  grouped GEMM that Transformer Engine runs as one cuBLAS GEMM per local expert
  (transformer_engine/common/gemm/cublaslt_gemm.cu ``multi_stream_cublas_gemm``: a loop
  of ``num_gemms`` launches over 4 streams), which takes at least one kernel latency per
  expert: few tokens per expert make it launch-bound (``grouped_gemm_time_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.costmodel.comm import Collective, collective_time_s, flat_time_s
from meshplan.costmodel.compute import DTYPE_BYTES, DTYPE_NAMES, op_time
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.stage_layout import split_factor
from meshplan.costmodel.memory import GRAD_BYTES, model_state_bytes
from meshplan.graph import OpGraph
from meshplan.opcount import _GROUPED_MM
from meshplan.plan import Stage

# The grouped kernel's tile along M (tokens): every expert's rows are padded to a multiple
# of it. DeepGEMM's contiguous grouped layout requires each expert segment aligned to the
# GEMM M block size (deepseek-ai/DeepGEMM README, "Grouped GEMMs (contiguous layout)"),
# 128 on Hopper (``get_mk_alignment_for_contiguous_layout``); CUTLASS's Hopper grouped GEMM
# that torch._grouped_mm runs uses 128-row tiles (aten/src/ATen/native/cuda/GroupMM.cu,
# TileShape 128 x ...). Rows past an expert's last token are computed and thrown away.
GROUPED_M_TILE = 128
# Each kernel launch of the dispatch and combine (permute, all-to-all, unpermute) costs the
# device's kernel latency; 3 kernels per direction (permute, the collective, unpermute:
# Megatron-Core's MoEAlltoAllTokenDispatcher token_permutation / token_unpermutation)
DISPATCH_KERNELS = 3
# A device-to-host sync of the routed token counts drains the GPU's queue: the GPU idles
# while the count is copied to the host (one small kernel: the copy) and again until the
# host's next launch reaches it (a second). A small kernel costs the preset's
# ``kernel_latency_s`` whatever its size (measured 5.3-5.8 us on a lent H100 and H200,
# benchmarks/results/eager_kernels_gpu.md).
SYNC_KERNELS = 2


@dataclass(frozen=True, slots=True)
class MoELayer:
    """One block's routed experts, read from the traced graph."""

    layer: int  # block index (OpNode.layer)
    gemms: tuple[str, ...]  # the routed experts' grouped GEMM operators, in order
    experts: int  # routed experts
    top_k: float  # experts per token (rows of the grouped GEMM / tokens)
    hidden: int  # model width: the first grouped GEMM's K
    pairs: int  # token-expert pairs of the traced (global) batch
    params: tuple[str, ...]  # the routed experts' weights (E, ., .)
    numel: int  # their parameters


def _tokens(graph: OpGraph) -> int:
    """Tokens of the traced global batch: the first input's batch x sequence."""
    shape = graph.inputs[0][1].shape if graph.inputs else (1,)
    return max(1, math.prod(shape[:2]))


def moe_layers(graph: OpGraph) -> dict[int, MoELayer]:
    """{block: MoELayer} of every block holding routed experts (grouped GEMMs over
    3-D expert weights); empty for a dense model."""
    g = graph.whole or graph
    hit = _MEMO.get(id(g))
    if hit is None or hit[0] is not g:
        if len(_MEMO) > 16:
            _MEMO.clear()
        hit = _MEMO[id(g)] = (g, _moe_layers(g), None)
    return hit[1]


# id(graph) -> (graph, its MoE layers, its expert parameter names): hashing a frozen graph
# of thousands of operators per call would cost more than the price
_MEMO: dict = {}


def _moe_layers(graph: OpGraph) -> dict[int, MoELayer]:
    gemms: dict[int, list] = {}
    for n in graph.nodes:
        if _GROUPED_MM.search(n.target) and n.flops > 0 and n.layer >= 0:
            gemms.setdefault(n.layer, []).append(n)
    if not gemms:
        return {}
    prefix = graph.block_module + "."
    experts_of: dict[int, list] = {}
    for p in graph.params:
        if len(p.shape) == 3 and ".experts." in p.name + "." and p.name.startswith(prefix):
            head = p.name[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                experts_of.setdefault(int(head), []).append(p)
    tokens = _tokens(graph)
    out = {}
    for layer, nodes in gemms.items():
        params = experts_of.get(layer, [])
        if not params:
            continue
        first = nodes[0]
        rows, n_out = first.outputs[0].shape[0], first.outputs[0].shape[-1]
        k_in = round(first.flops / (2 * rows * n_out)) if rows and n_out else 0
        out[layer] = MoELayer(
            layer=layer, gemms=tuple(n.name for n in nodes), experts=params[0].shape[0],
            top_k=rows / tokens, hidden=k_in, pairs=rows, params=tuple(p.name for p in params),
            numel=sum(p.numel for p in params))
    return out


def routed_expert_params(graph: OpGraph) -> frozenset[str]:
    """Names of every routed expert weight of the graph."""
    layers = moe_layers(graph)
    g = graph.whole or graph
    hit = _MEMO[id(g)]
    if hit[2] is None:
        hit = _MEMO[id(g)] = (hit[0], hit[1],
                              frozenset(p for m in layers.values() for p in m.params))
    return hit[2]


def all_to_all_s(hw: HardwareProfile, nbytes: float, n: int) -> float:
    """One all-to-all over ``n`` consecutive ranks, each sending ``nbytes`` split evenly over
    the group (its own share stays). Inside a node: NVLink's ring price. Across nodes: the
    share bound for other nodes over InfiniBand and the in-node share over NVLink at once,
    the slower of the two (module docstring); latency per peer on the link it crosses."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    local = min(n, hw.devices_per_node)
    if local >= n:
        return flat_time_s(hw.intra_node, Collective.ALL_TO_ALL, nbytes, n)
    bw_in, lat_in = hw.intra_node.for_collective(Collective.ALL_TO_ALL)
    bw_out, lat_out = hw.inter_node.for_collective(Collective.ALL_TO_ALL)
    t_in = (local - 1) * lat_in + nbytes * (local - 1) / n / (bw_in * 1e9)
    t_out = (n - local) * lat_out + nbytes * (n - local) / n / (bw_out * 1e9)
    return max(t_in, t_out)


@dataclass(frozen=True, slots=True)
class EPTerms:
    """What the routed experts add to one stage, per microbatch unless said."""

    a2a_fwd_s: float  # dispatch + combine all-to-alls of every MoE layer, forward
    a2a_bwd_s: float  # and their gradients in the backward
    a2a_exposed_s: float  # forward + backward all-to-all left after the stack's overlap
    gemm_fwd_delta_s: float  # grouped GEMMs by mechanism minus the traced operators' price
    gemm_bwd_delta_s: float
    tokens_per_expert: float  # rows each local expert's GEMM receives (one microbatch)
    # the routed experts' state on one device under ep x efsdp (ep > 1; 0 at ep = 1, where
    # the parameter walk prices them as the stage places them)
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    optimizer_numel: float
    grad_sync_s: float  # reduce over efsdp, once per step (ep > 1)
    gather_s: float  # ZeRO-3 all-gathers over efsdp per microbatch, forward + backward
    saved_bytes: float  # permuted tokens kept for the backward, per microbatch
    buffer_bytes: float  # dispatch/combine receive buffers of one layer (working set)


def _dp_cp_tp(stage: Stage) -> tuple[int, int, int]:
    size = dict(zip(stage.axis_names, stage.mesh_shape))
    return size.get("dp", 1), size.get("cp", 1), size.get("tp", 1)


def stage_moe_layers(stage: Stage, graph: OpGraph) -> list[MoELayer]:
    """The MoE layers whose grouped GEMMs the stage runs."""
    layers = moe_layers(graph)
    if not layers:
        return []
    return [m for m in layers.values() if m.gemms[0] in stage.ops]


def grouped_gemm_time_s(hw: HardwareProfile, dtype: str, *, flops: float, groups: float,
                        rows: float, k: int, n: int, imbalance: float = 1.0,
                        contention: float = 1.0,
                        per_expert: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one device's grouped GEMM: ``groups`` experts of
    ``rows`` tokens each, (rows x k) by (k x n), ``flops`` in all (forward). Rows padded to
    ``GROUPED_M_TILE``; the device's matmul curve read at one group's padded FLOPs; the
    memory side reads every local expert's weights and the tokens (the backward: weights
    read, their gradients written, twice the token traffic). ``per_expert``: the stack
    launches one GEMM per local expert (Transformer Engine's grouped GEMM, module
    docstring), so each GEMM call takes at least ``groups`` kernel latencies (the backward's
    two calls, data and weight gradients, twice that); else one grouped kernel per call."""
    dev = hw.device
    b = DTYPE_BYTES.get(dtype, 2)
    flops *= imbalance
    rows *= imbalance
    padded = math.ceil(rows / GROUPED_M_TILE) * GROUPED_M_TILE if rows > 0 else 0
    fill = rows / padded if padded else 1.0
    per_group = 2 * padded * k * n
    eff = dev.matmul_efficiency(per_group) * fill
    peak = dev.peak_flops(DTYPE_NAMES.get(dtype, dtype))
    weights = groups * k * n * b
    acts = groups * rows * (k + n) * b
    bw = dev.memory_bandwidth_gbps * 1e9

    def t(f, nbytes):
        tf = f / (peak * eff) if f > 0 and eff > 0 else 0.0
        tb = nbytes / (bw * dev.memory_efficiency(nbytes)) if nbytes > 0 else 0.0
        return max(tf, tb)
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    if per_expert and groups >= 1:
        launches = math.ceil(groups) * dev.kernel_latency_s
        fwd = (max(t(flops, weights + acts), launches) + dev.framework_overhead_s) \
            * contention
        bwd = (max(t(2 * flops, 2 * weights + 2 * acts), 2 * launches)
               + 2 * dev.framework_overhead_s) * contention
        return fwd, bwd
    fwd = (t(flops, weights + acts) + fixed) * contention
    bwd = (t(2 * flops, 2 * weights + 2 * acts) + 2 * fixed) * contention
    return fwd, bwd


def ep_cost_terms(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
                  optimizer: str, microbatches: int, runtime, contention: float = 1.0,
                  grad_bytes: float | None = None, master_bytes: float | None = None,
                  cache: dict | None = None) -> EPTerms | None:
    """The routed experts' price on one stage (module docstring); None where the stage
    holds no routed experts. The axis table's cost hook for ``ep``. ``cache``: the cost
    model's memo (stages sharing their operator dict, by identity, and the same layout)."""
    if not moe_layers(graph):
        return None
    if cache is not None:
        key = ("moe-terms", id(stage.ops), id(graph.whole or graph), stage.mesh_shape,
               stage.axis_names, stage.devices[:1], stage.ep, stage.zero, dtype, optimizer,
               microbatches, runtime, contention, grad_bytes, master_bytes)
        hit = cache.get(key)
        if hit is not None and hit[0] is stage.ops:
            return hit[1]
        terms = ep_cost_terms(stage, graph, hw, dtype=dtype, optimizer=optimizer,
                              microbatches=microbatches, runtime=runtime,
                              contention=contention, grad_bytes=grad_bytes,
                              master_bytes=master_bytes)
        cache[key] = (stage.ops, terms)
        return terms
    layers = stage_moe_layers(stage, graph)
    if not layers:
        return None
    dp, cp, tp = _dp_cp_tp(stage)
    ep = max(1, stage.ep)
    m = max(1, microbatches)
    ranks = dp * cp * tp
    efsdp = max(1, ranks // ep)
    b = DTYPE_BYTES.get(dtype, 2)
    # the tokens cross the all-to-all in the activations' dtype, bf16 under an fp8 recipe
    # too (DTYPE_BYTES): Megatron-Core's alltoall dispatcher and torchtitan's expert-parallel
    # style move the hidden states as the model holds them (fp8 dispatch is DeepEP's,
    # DeepSeek-V3 report sec. 3.3.2)
    wire = b
    imbalance = getattr(runtime, "moe_imbalance", 1.0)
    overlap = getattr(runtime, "ep_a2a_overlap", 0.0)
    per_expert = getattr(runtime, "grouped_gemm_per_expert", False)
    # the forward's token-count syncs per MoE layer (module docstring): the stack's own at
    # any ep, and the all-to-all's split sizes where ep > 1
    syncs = getattr(runtime, "moe_host_syncs", 0) + (1 if ep > 1 else 0)
    sync_s = syncs * SYNC_KERNELS * hw.device.kernel_latency_s
    a2a_f = a2a_b = dfwd = dbwd = saved = buf = 0.0
    tpe = 0.0
    numel = 0
    for ml in layers:
        # token-expert pairs on this rank per microbatch: each of the dp x cp x tp ranks
        # dispatches its own tokens (sequence-parallel shares under tp) when ep > 1; at
        # ep = 1 the experts run where the tokens are, split over dp x cp
        pairs = ml.pairs / (dp * cp * m) / (tp if ep > 1 else 1)
        nbytes = pairs * ml.hidden * wire * imbalance
        one = all_to_all_s(hw, nbytes, ep) + DISPATCH_KERNELS * hw.device.kernel_latency_s \
            if ep > 1 else 0.0
        a2a_f += 2 * one  # dispatch + combine
        a2a_b += 2 * one
        groups = ml.experts / ep
        rows = pairs * ep / ml.experts if ep > 1 else pairs / ml.experts
        tpe = rows
        for name in ml.gemms:
            node = graph.node(name)
            op = stage.ops[name]
            shard = split_factor(op.output, stage.mesh_shape) * m
            priced = op_time(node, hw, dtype, shard, contention=contention)
            osplit = split_factor(op.output, stage.mesh_shape)
            # ep > 1: every one of the dp x cp x tp ranks computes its share of the pairs;
            # ep = 1: the experts run as the stage places them (tp splits their columns)
            flops = node.flops / (ranks * m) if ep > 1 else node.flops / shard
            nsplit = 1 if ep > 1 else max(1, osplit // (dp * cp))
            n_out = node.outputs[0].shape[-1]
            k_in = round(node.flops / (2 * node.outputs[0].shape[0] * n_out))
            f, bk = grouped_gemm_time_s(hw, dtype, flops=flops, groups=groups, rows=rows,
                                        k=k_in, n=max(1, n_out // nsplit),
                                        imbalance=imbalance, contention=contention,
                                        per_expert=per_expert)
            dfwd += f - priced.forward_s
            dbwd += bk - priced.backward_s
        dfwd += sync_s
        # the permuted tokens the grouped GEMMs read (saved for the backward) and, in the
        # working set, one layer's dispatch and combine receive buffers
        saved += pairs * ml.hidden * wire * imbalance
        buf = max(buf, 2 * pairs * ml.hidden * wire * imbalance)
        numel += ml.numel
    exposed = (a2a_f + a2a_b) * (1 - overlap)
    weights = grads = opt = opt_numel = sync = gather = 0.0
    if ep > 1:
        kw = {}
        if grad_bytes is not None:
            kw["grad_bytes"] = grad_bytes
        if master_bytes is not None:
            kw["master_bytes"] = master_bytes
        local = numel / ep
        weights, grads, opt = model_state_bytes(local, dtype=dtype, optimizer=optimizer,
                                                zero=stage.zero, dp=efsdp, **kw)
        opt_numel = local / (efsdp if stage.zero >= 1 else 1)
        gbytes = local * (grad_bytes if grad_bytes is not None else GRAD_BYTES)
        kind = Collective.REDUCE_SCATTER if stage.zero >= 2 else Collective.ALL_REDUCE
        # efsdp ranks are ep apart: inside a node when ep x efsdp fits one
        crosses = ranks > hw.devices_per_node
        local_size = max(1, hw.devices_per_node // ep) if crosses else None
        sync = collective_time_s(hw, kind, gbytes, efsdp, crosses_nodes=crosses,
                                 local_size=local_size)
        sync *= 1 - getattr(runtime, "grad_sync_overlap", 0.0)
        if stage.zero >= 3 and efsdp > 1:
            g = collective_time_s(hw, Collective.ALL_GATHER, local * b, efsdp,
                                  crosses_nodes=crosses, local_size=local_size)
            gather = 2 * g * (1 - getattr(runtime, "param_gather_overlap", 1.0))
    return EPTerms(a2a_fwd_s=a2a_f, a2a_bwd_s=a2a_b, a2a_exposed_s=exposed,
                   gemm_fwd_delta_s=dfwd, gemm_bwd_delta_s=dbwd, tokens_per_expert=tpe,
                   weights_bytes=weights, grads_bytes=grads, optimizer_bytes=opt,
                   optimizer_numel=opt_numel, grad_sync_s=sync, gather_s=gather,
                   saved_bytes=saved, buffer_bytes=buf)
