"""Collective communication time: latency + bytes / bandwidth with each algorithm's factor.

trace -> **cost** -> solve -> run. Bandwidth is the per-device bus bandwidth of the link
level the group spans (intra-node NVLink or inter-node InfiniBand). Ring algorithms
(Patarasuk & Yuan 2009; NCCL's "bus bandwidth" convention):
- all-reduce moves 2(n-1)/n of the buffer through each device;
- all-gather and reduce-scatter move (n-1)/n of the (full) buffer;
- all-to-all moves (n-1)/n of the buffer;
- broadcast moves the buffer once (pipelined ring); send/recv moves it once point to point.
Latency: (n-1) steps of the link's latency for ring collectives, 2(n-1) for all-reduce.
"""

from __future__ import annotations

from enum import StrEnum

from meshplan.costmodel.hardware import HardwareProfile


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


_BYTES_FACTOR = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.ALL_GATHER: lambda n: (n - 1) / n,
    Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Collective.ALL_TO_ALL: lambda n: (n - 1) / n,
    Collective.BROADCAST: lambda n: 1.0,
    Collective.SEND_RECV: lambda n: 1.0,
}
_LATENCY_STEPS = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1),
    Collective.ALL_GATHER: lambda n: n - 1,
    Collective.REDUCE_SCATTER: lambda n: n - 1,
    Collective.ALL_TO_ALL: lambda n: n - 1,
    Collective.BROADCAST: lambda n: n - 1,
    Collective.SEND_RECV: lambda n: 1,
}


def collective_time_s(hw: HardwareProfile, kind: Collective | str, nbytes: float,
                      group_size: int, *, crosses_nodes: bool = False) -> float:
    """Time of one collective over ``group_size`` devices on a buffer of ``nbytes``.

    For all-gather, ``nbytes`` is the gathered (full) buffer; for reduce-scatter, the
    buffer before scattering.
    """
    kind = Collective(kind)
    n = int(group_size)
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = hw.inter_node if crosses_nodes else hw.intra_node
    return (_LATENCY_STEPS[kind](n) * link.latency_s
            + _BYTES_FACTOR[kind](n) * nbytes / (link.bandwidth_gbps * 1e9))
