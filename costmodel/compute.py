"""Compute time of one operator on one device: a roofline with size-dependent efficiency.

trace -> **cost** -> solve -> run. An operator's per-device work is its FLOPs and bytes
divided by the number of devices that split it. Forward time is
``max(flops / (peak x eff(flops)), bytes / (bandwidth x eff(bytes))) + kernel latency``.
Backward classes:
- matmul-class (matmul, attention, embedding's dense grad): two matmuls of the forward's
  size (grad of input and grad of weight) -> 2 x forward;
- memory-bound ops (elementwise, norm, softmax, loss): read output grad + saved input and
  write input grad -> 2 x forward bytes;
- views cost nothing in either direction.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodel.hardware import HardwareProfile
from meshplan.planner.graph import OpKind, OpNode

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_FREE = (OpKind.VIEW, OpKind.CREATION)
_MATMUL = (OpKind.MATMUL, OpKind.ATTENTION)


@dataclass(frozen=True, slots=True)
class OpTime:
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def op_time(node: OpNode, hw: HardwareProfile, dtype: str = "fp32", shard: int = 1) -> OpTime:
    """Forward and backward time of ``node`` when ``shard`` devices split its work evenly."""
    if node.kind in _FREE:
        return OpTime(0.0, 0.0)
    dev = hw.device
    scale = DTYPE_BYTES.get(dtype, 4) / 4  # traced in fp32; mixed precision moves fewer bytes
    flops = node.flops / shard
    nbytes = (node.bytes_read + node.bytes_written) * scale / shard
    t_flops = flops / (dev.peak_flops(DTYPE_NAMES.get(dtype, dtype)) * dev.matmul_efficiency(flops)) \
        if flops else 0.0
    t_bytes = nbytes / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency(nbytes)) \
        if nbytes else 0.0
    forward = max(t_flops, t_bytes) + dev.kernel_latency_s
    backward = 2 * forward if node.kind in _MATMUL or node.flops else 2 * forward
    return OpTime(forward, backward)
