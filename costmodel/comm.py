"""Collective communication time: latency + bytes / bandwidth with each algorithm's factor.

trace -> **cost** -> solve -> run. Bandwidth is the per-device bus bandwidth of the link
level the group spans (intra-node NVLink or inter-node InfiniBand); a link may override
bandwidth and latency per collective (``LinkSpec.collectives``, fitted by calibrate).

Ring algorithms (Patarasuk & Yuan 2009; NCCL's "bus bandwidth" convention, nccl-tests
doc/PERFORMANCE.md), for a group of n devices and a buffer of B bytes:

=============== ========================== =================
collective      bytes through each device  latency steps
=============== ========================== =================
all-reduce      2 (n-1)/n * B              2 (n-1)
all-gather      (n-1)/n * B (B = gathered) n-1
reduce-scatter  (n-1)/n * B (B = input)    n-1
all-to-all      (n-1)/n * B                n-1
broadcast       B (pipelined ring)         n-1
send/recv       B                          1
=============== ========================== =================

time = steps * latency + bytes / bandwidth.

Hierarchical groups (an axis that spans nodes with ``local`` > 1 members per node) run
the two-level algorithm NCCL and Horovod use: all-reduce = reduce-scatter inside the node,
all-reduce across nodes on 1/local of the buffer, all-gather inside the node;
all-gather / reduce-scatter = the inter-node step on 1/local of the buffer plus the intra-node
step; all-to-all, broadcast and send/recv are priced on the inter-node link.

NCCL also runs all-reduce as a double binary tree and picks, per call, the algorithm its
model predicts faster (``tree=True``; NVIDIA/nccl src/graph/tuning.cc ``ncclTopoTuneModel``
and ``ncclTopoGetAlgoTime``, and Jeaugey, "Massively Scale Your Deep Learning Training with
NCCL 2.4", NVIDIA blog 2019). Its tree reduces up and broadcasts down a chain inside each
node and a binary tree across nodes: latency 2 ((local-1) a_intra + log2(nodes) a_inter)
against the ring's 2 (n-1) steps, and algorithm bandwidth 0.5 x 0.9 x bus bandwidth (the
tree's .9 factor) against the ring's n / (2 (n-1)) x bus bandwidth, so the tree moves a
buffer in n / (0.9 (n-1)) of the ring's bandwidth time. Small buffers on many ranks go
by tree, large ones by ring. Gloo has no tree (``tree=False``).
"""

from __future__ import annotations

import math
from enum import StrEnum

from meshplan.costmodel.hardware import HardwareProfile, LinkSpec
from meshplan.plan import Stage


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND_RECV = "send_recv"


def bytes_factor(kind: Collective, n: int) -> float:
    """Bytes through each device per byte of buffer (ring algorithms)."""
    return {Collective.ALL_REDUCE: 2 * (n - 1) / n, Collective.ALL_GATHER: (n - 1) / n,
            Collective.REDUCE_SCATTER: (n - 1) / n, Collective.ALL_TO_ALL: (n - 1) / n,
            Collective.BROADCAST: 1.0, Collective.SEND_RECV: 1.0}[kind]


def latency_steps(kind: Collective, n: int) -> int:
    return {Collective.ALL_REDUCE: 2 * (n - 1), Collective.ALL_GATHER: n - 1,
            Collective.REDUCE_SCATTER: n - 1, Collective.ALL_TO_ALL: n - 1,
            Collective.BROADCAST: n - 1, Collective.SEND_RECV: 1}[kind]


def flat_time_s(link: LinkSpec, kind: Collective | str, nbytes: float, n: int) -> float:
    """One ring collective over ``n`` devices on one link level."""
    kind = Collective(kind)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth_gbps, latency_s = link.for_collective(kind)
    return latency_steps(kind, n) * latency_s + bytes_factor(kind, n) * nbytes / (bandwidth_gbps * 1e9)


TREE_BANDWIDTH_FACTOR = 0.9  # NVIDIA/nccl src/graph/tuning.cc: tree busBw = min(busBw * .9, ...)


def tree_all_reduce_s(hw: HardwareProfile, nbytes: float, n: int, *, crosses_nodes: bool,
                      local_size: int | None, ring_bandwidth_s: float) -> float:
    """NCCL's double-binary-tree all-reduce (module docstring): chains of ``local`` ranks
    inside each node, a binary tree over the nodes; ``ring_bandwidth_s`` is the ring's
    bandwidth time for the same buffer and group."""
    if not crosses_nodes:
        local, nodes = n, 1
    else:
        local = int(local_size or 1)
        local = local if 1 <= local < n and n % local == 0 else 1
        nodes = n // local
    latency = 2 * ((local - 1) * hw.intra_node.for_collective(Collective.ALL_REDUCE)[1]
                   + math.ceil(math.log2(nodes)) * hw.inter_node.for_collective(
                       Collective.ALL_REDUCE)[1])
    return latency + ring_bandwidth_s * n / (TREE_BANDWIDTH_FACTOR * (n - 1))


def collective_time_s(hw: HardwareProfile, kind: Collective | str, nbytes: float,
                      group_size: int, *, crosses_nodes: bool = False,
                      local_size: int | None = None, tree: bool = False) -> float:
    """Time of one collective over ``group_size`` devices on a buffer of ``nbytes``.

    ``tree``: the backend also has NCCL's tree all-reduce and takes the faster of the two
    for this size and group (module docstring).
    """
    ring = _ring_time_s(hw, kind, nbytes, group_size, crosses_nodes=crosses_nodes,
                        local_size=local_size)
    if not tree or Collective(kind) != Collective.ALL_REDUCE or group_size <= 2 or nbytes <= 0:
        return ring
    latency = _ring_time_s(hw, kind, 1e-30, group_size, crosses_nodes=crosses_nodes,
                           local_size=local_size)
    return min(ring, tree_all_reduce_s(hw, nbytes, group_size, crosses_nodes=crosses_nodes,
                                       local_size=local_size, ring_bandwidth_s=ring - latency))


def _ring_time_s(hw: HardwareProfile, kind: Collective | str, nbytes: float,
                 group_size: int, *, crosses_nodes: bool = False,
                 local_size: int | None = None) -> float:
    """Time of one collective over ``group_size`` devices on a buffer of ``nbytes``.

    For all-gather, ``nbytes`` is the gathered (full) buffer; for reduce-scatter, the
    buffer before scattering. ``crosses_nodes`` picks the inter-node link; ``local_size``
    (members of the group inside one node, when the group crosses nodes) turns on the
    hierarchical algorithm when 1 < local_size < group_size.
    """
    kind = Collective(kind)
    n = int(group_size)
    if n <= 1 or nbytes <= 0:
        return 0.0
    if not crosses_nodes:
        return flat_time_s(hw.intra_node, kind, nbytes, n)
    local = int(local_size or 1)
    if local <= 1 or local >= n or n % local:
        return flat_time_s(hw.inter_node, kind, nbytes, n)
    nodes = n // local
    intra, inter = hw.intra_node, hw.inter_node
    if kind == Collective.ALL_REDUCE:
        return (flat_time_s(intra, Collective.REDUCE_SCATTER, nbytes, local)
                + flat_time_s(inter, Collective.ALL_REDUCE, nbytes / local, nodes)
                + flat_time_s(intra, Collective.ALL_GATHER, nbytes, local))
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return (flat_time_s(inter, kind, nbytes / local, nodes)
                + flat_time_s(intra, kind, nbytes, local))
    return flat_time_s(inter, kind, nbytes, n)


def axis_link(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int,
              first_device: int = 0) -> tuple[bool, int]:
    """(crosses_nodes, local_size) of the groups along ``axis`` of a row-major submesh
    whose first global device is ``first_device``.

    A group's members are ``stride`` apart (stride = product of the later axes); the group
    stays in a node when its whole span fits in one node.
    """
    stride = 1
    for s in mesh_shape[axis + 1:]:
        stride *= s
    n = mesh_shape[axis]
    span = stride * (n - 1) + 1
    start = first_device % devices_per_node
    if start + span <= devices_per_node:
        return False, n
    local = max(1, min(n, devices_per_node // stride)) if stride < devices_per_node else 1
    return True, local


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


def bandwidth_s(coll, kind: Collective, nbytes: float, axis: int) -> float:
    """A collective's time less its latency: the share of one buffer's time a tensor in it
    adds (a flat buffer pays its latency once)."""
    return _bandwidth_s(coll, kind, nbytes, axis)


def _bandwidth_s(coll, kind: Collective, nbytes: float, axis: int) -> float:
    """A collective's time less its latency (the time of an empty one)."""
    return coll(kind, nbytes, axis) - coll(kind, 1e-30, axis) if nbytes else 0.0
