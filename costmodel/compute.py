"""Compute time of one operator on one device: a roofline with size-dependent efficiency.

trace -> **cost** -> solve -> run. An operator's per-device work is its FLOPs and bytes
divided by the number of devices that split it (``shard``). Forward time is

    max(flops / (peak x eff(flops)), bytes / (bandwidth x eff(bytes)))
        + kernel latency + framework overhead

all times the host contention: CPU processes sharing fewer cores than there are processes
time-share them (the ranks that compute at the same time, not all processes: a pipeline
rank waiting in the bubble sleeps in a blocking receive), and the framework's per-operator
work (Python dispatch, DTensor, autograd) is CPU work too, so it slows like the kernels
(measured on the 2-core development host:
the runtime's forward + backward of a 1-layer GPT-2 took 37 ms per rank with 4 processes at
a quarter of the batch each, 36 ms with 1 process at the whole batch; ``meshplan calibrate``
fitted 0.82 effective cores there, under other users' load). The cores are
``device.effective_cores`` when a calibration fitted them from N-process runs of the
runtime, else ``device.host_cores``.
A measured table (``HardwareProfile.measured_ops``: ``op_signature -> [forward_s,
backward_s]``) replaces the roofline for operators it lists.

Backward, by operator class:
- matmul: grad of input and grad of weight are two matmuls of the forward's size
  -> 2 x forward FLOPs (Narayanan et al. 2021, section 5.1: backward = 2 x forward);
- attention: flash-attention's backward runs 5 matmuls against the forward's 2 (Dao et
  al. 2022, algorithm 4) -> 2.5 x forward FLOPs; where the runtime's attention writes its
  s x s scores to memory (``RuntimeModel.attention="materialized"``, attention before fused
  kernels), ``materialized_attention_time`` prices its kernels one by one instead;
- embedding: a scatter-add of the output gradient into the weight -> the forward's bytes;
- memory-bound ops (elementwise, norm, softmax, reduction, loss): read the output grad and
  the saved input, write the input grad -> 2 x the forward's bytes;
- views and creation ops cost nothing in either direction.
Recomputing an operator costs its forward time again (``OpTime.forward_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshplan.costmodel.hardware import HardwareProfile
from meshplan.graph import OpKind, OpNode
from meshplan.vocabulary import ComputeDtype

# fp8: the block linears' GEMMs in fp8 (costmodel/fp8.py), everything else bf16
DTYPE_NAMES = {ComputeDtype.FP32: "float32", ComputeDtype.BF16: "bfloat16",
               ComputeDtype.FP16: "float16", ComputeDtype.FP8: "bfloat16"}
DTYPE_BYTES = {ComputeDtype.FP32: 4, ComputeDtype.BF16: 2, ComputeDtype.FP16: 2,
               ComputeDtype.FP8: 2}
FREE_KINDS = (OpKind.VIEW, OpKind.CREATION)
BACKWARD_FLOPS_FACTOR = {OpKind.MATMUL: 2.0, OpKind.ATTENTION: 2.5}  # sources in the docstring
BACKWARD_BYTES_FACTOR = {OpKind.EMBEDDING: 1.0}  # everything else memory-bound: 2.0


@dataclass(frozen=True, slots=True)
class OpTime:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def recompute_s(self) -> float:
        return self.forward_s


def op_signature(node: OpNode, dtype: str, shard: int = 1) -> str:
    """Key of the measured table: target, global output shapes, dtype and the split."""
    shapes = ";".join("x".join(map(str, o.shape)) for o in node.outputs)
    return f"{node.target}|{shapes}|{dtype}|/{shard}"


def roofline_s(hw: HardwareProfile, flops: float, nbytes: float, dtype: str,
               kind: OpKind | None = None, work: float | None = None) -> float:
    """max(compute time, memory time) of one kernel, without fixed costs. Attention
    (``kind``) runs at the device's fused-attention efficiency where the profile gives one,
    read at ``work`` (``attention_work``: the FLOPs of one query row of one head); other
    kernels at their FLOPs."""
    dev = hw.device
    attention = kind == OpKind.ATTENTION and dev.attention_efficiency is not None
    curve = dev.attention_efficiency if attention else dev.matmul_efficiency
    at = work if attention and work is not None else flops
    t_flops = flops / (dev.peak_flops(DTYPE_NAMES.get(dtype, dtype)) * curve(at)) \
        if flops > 0 else 0.0
    t_bytes = nbytes / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency(nbytes)) \
        if nbytes > 0 else 0.0
    return max(t_flops, t_bytes)


def attention_work(node: OpNode, flops: float, shard: int = 1) -> float:
    """The work a fused attention kernel's efficiency depends on: the FLOPs of one query row
    of one head (4 x keys x head dim forward; ``flops`` on this device, ``shard`` devices
    splitting its batch, heads or queries). A flash kernel streams every key block past each
    tile of query rows, paying a fixed cost per tile (loading Q, rescaling and writing O), so
    its efficiency follows the keys each row sees, not the batch, the heads or the number of
    rows (benchmarks/gpu/kernel_fit.py fits the presets' curves on this work: rms 2% over
    seq 1K-16K). SDPA takes unbatched (queries, dim) inputs too: their rows are the queries.
    An output without (..., queries, dim) dimensions: ``flops``."""
    out = node.out
    if out is None or len(out.shape) < 2:
        return flops
    rows = math.prod(out.shape[:-1])
    return flops * shard / rows if rows > 0 else flops


def op_time(node: OpNode, hw: HardwareProfile, dtype: str = ComputeDtype.FP32, shard: int = 1, *,
            contention: float = 1.0, causal: bool = False, kv_chunks: int = 1) -> OpTime:
    """Forward and backward time of ``node`` when ``shard`` devices split its work evenly.

    ``contention`` (>= 1) slows compute when processes share CPU cores (estimate.py
    derives it from ``device.host_cores``). ``causal``: an attention the engine runs with
    ``is_causal=True``; flash attention skips the blocks above the diagonal, half of the
    FLOPs the operator counts (Dao 2023, FlashAttention-2, section 3.1.1; its TFLOP/s for
    causal attention are quoted on half the FLOPs, as ``attention_efficiency`` is).
    ``kv_chunks``: ring context parallelism (``operators.ring_kv_chunks``) runs an attention
    as one kernel per K/V chunk, each row seeing 1 / kv_chunks of the keys at a time, so the
    attention curve is read at 1 / kv_chunks of a row's work.
    """
    if node.kind in FREE_KINDS:
        return OpTime(0.0, 0.0)
    measured = hw.measured_ops.get(op_signature(node, dtype, shard))
    if measured:
        return OpTime(float(measured[0]), float(measured[1]))
    dev = hw.device
    scale = DTYPE_BYTES.get(dtype, 4) / 4  # traced in fp32; mixed precision moves fewer bytes
    flops = node.flops / shard * (0.5 if causal and node.kind == OpKind.ATTENTION else 1.0)
    nbytes = (node.bytes_read + node.bytes_written) * scale / shard
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    work = attention_work(node, flops, shard) / max(1, kv_chunks) \
        if node.kind == OpKind.ATTENTION else None
    forward = (roofline_s(hw, flops, nbytes, dtype, node.kind, work) + fixed) * contention
    if node.flops:
        factor = BACKWARD_FLOPS_FACTOR.get(node.kind, 2.0)
        backward = (roofline_s(hw, factor * flops, factor * nbytes, dtype, node.kind,
                               None if work is None else factor * work)
                    + 2 * fixed) * contention
    else:
        factor = BACKWARD_BYTES_FACTOR.get(node.kind, 2.0)
        backward = (roofline_s(hw, 0.0, factor * nbytes, dtype) + fixed) * contention
    return OpTime(forward, backward)


def contention_factor(hw: HardwareProfile, processes_on_host: float) -> float:
    """How much slower each process computes when ``processes_on_host`` compute at once on
    the host's cores (1 for dedicated devices such as GPUs). A float: estimate.py passes the
    average number of ranks computing at once in a pipeline (``pipeline.busy_ranks``), since
    a rank blocked on a receive or idle in the bubble leaves its core to the busy ones."""
    if hw.device.host_cores <= 0:
        return 1.0
    cores = hw.device.effective_cores or hw.device.host_cores
    return max(1.0, processes_on_host / cores)


ATTENTION_KERNELS = ("flash", "materialized")  # RuntimeModel.attention


def attention_dropout(node: OpNode) -> bool:
    """Whether an attention operator drops probabilities out (its ``dropout_p`` > 0)."""
    args, kwargs = node.parsed_args()
    p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
    return isinstance(p, (int, float)) and p > 0


def materialized_attention_time(node: OpNode, hw: HardwareProfile, dtype: str = ComputeDtype.FP16,
                                shard: int = 1, *, contention: float = 1.0) -> OpTime:
    """An attention core that writes its b x heads x s x s scores and probabilities to
    memory, as attention ran before fused kernels (Megatron-LM 2021's ParallelAttention:
    baddbmm for Q K^T, one fused scale-mask-softmax kernel, dropout on the probabilities,
    bmm with V; "standard attention", Dao et al. 2022, algorithm 0). Each kernel is
    priced on the roofline with its own fixed cost; E = the s x s elements on this device:

    forward: Q K^T (half the FLOPs, writes E), softmax (reads and writes E), dropout
    (reads E, writes E and a 1-byte mask), P V (half the FLOPs, reads E);
    backward: dP = dO V^T (writes E) and dV = P^T dO (reads E), dropout (reads E and the
    mask, writes E), softmax (reads the probabilities and their gradient, writes E),
    dQ = dS K and dK = dS^T Q (each reads E).

    Dropout's kernels are priced only when the operator has ``dropout_p`` > 0. The
    fused kernel's forward reads only the causal half (Megatron's upper-triangular
    softmax); priced in full here, as cuBLAS computes every score.
    """
    measured = hw.measured_ops.get(op_signature(node, dtype, shard))
    if measured:
        return OpTime(float(measured[0]), float(measured[1]))
    out = node.out
    if out is None or len(out.shape) < 2:
        return op_time(node, hw, dtype, shard, contention=contention)
    db = DTYPE_BYTES.get(dtype, 4)
    seq = out.shape[-2]
    e = out.numel // out.shape[-1] * seq / shard  # scores on this device
    x = out.numel * db / shard  # one of q, k, v, o on this device
    half = node.flops / 2 / shard  # each of the two matmuls (and each backward matmul)
    fixed = hw.device.kernel_latency_s + hw.device.framework_overhead_s
    dropout = attention_dropout(node)

    def kernels(*work: tuple[float, float]) -> float:
        return sum(roofline_s(hw, f, b, dtype) + fixed for f, b in work)

    scores = e * db
    drop = [(0.0, 2 * scores + e)] if dropout else []
    forward = kernels((half, 2 * x + scores), (0.0, 2 * scores), *drop, (half, scores + 2 * x))
    backward = kernels((half, 2 * x + scores), (half, scores + 2 * x), *drop,
                       (0.0, 3 * scores), (half, scores + 2 * x), (half, scores + 2 * x))
    return OpTime(forward * contention, backward * contention)


def attention_saved_bytes(node: OpNode, hw: HardwareProfile, attention: str, dtype: str,
                          shard: int = 1) -> float:
    """Bytes an attention operator keeps for its backward beyond q, k, v and the output.

    A runtime with materialized attention: ``materialized_attention_saved_bytes``. On CPU,
    torch's SDPA runs flash attention for CPU (``_scaled_dot_product_flash_attention_for_cpu``:
    q, k, v, the output and the logsumexp) with or without a mask, in fp32 and bf16, and
    takes its math path only when ``dropout_p`` > 0; the math path keeps the probabilities,
    the dropout mask (in the compute dtype) and the dropped probabilities, 3 s x s tensors
    (torch 2.13, counted with saved-tensor hooks). Flash kernels keep nothing s x s."""
    if node.kind != OpKind.ATTENTION:
        return 0.0
    if attention == "materialized":
        return materialized_attention_saved_bytes(node, dtype, shard)
    out = node.out
    if hw.device.name != "cpu" or not attention_dropout(node) or out is None \
            or len(out.shape) < 2:
        return 0.0
    return 3 * DTYPE_BYTES.get(dtype, 4) * out.numel // out.shape[-1] * out.shape[-2] / shard


def materialized_attention_saved_bytes(node: OpNode, dtype: str, shard: int = 1) -> float:
    """Bytes a materialized attention core keeps for its backward beyond q, k, v and the
    output: the softmax output, and with dropout its mask (1 byte) and the dropped
    probabilities P V reads."""
    out = node.out
    if out is None or len(out.shape) < 2:
        return 0.0
    db = DTYPE_BYTES.get(dtype, 4)
    e = out.numel // out.shape[-1] * out.shape[-2] / shard
    return e * (2 * db + 1 if attention_dropout(node) else db)
