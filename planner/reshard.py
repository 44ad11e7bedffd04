"""Resharding edges: the time to turn one placement of a tensor into another.

trace -> cost -> **solve (edges)** -> run. DTensor redistributes one mesh axis at a time; per
axis the transition is a collective over that axis's devices, priced by the cost model
(``costmodel/comm.py: collective_time_s``):

=============  =========================  ==========================================
from -> to     collective                 bytes passed to collective_time_s
=============  =========================  ==========================================
S(d) -> R      all-gather                 the gathered buffer
S(d) -> S(e)   all-to-all                 the local buffer before the exchange
P -> R         all-reduce                 the buffer
P -> S(d)      reduce-scatter             the buffer before scattering
R -> S(d)      none (local slice)         0
R -> P         refused by the runtime     infinite (DTensor.redistribute: "redistributing
                                          to Partial is for internal use only", torch 2.13)
S(d) -> P      not executable by DTensor  infinite: pruned before any variable is made
=============  =========================  ==========================================

"The buffer" is the tensor's bytes divided by the Shard factors of the other axes. The
backward pass moves the gradient the other way: from the placement the consumer's gradient
comes out in to the producer's (a Partial output's gradient is Replicate).
"""

from __future__ import annotations

import math

from meshplan.costmodel.comm import Collective, axis_link, collective_time_s
from meshplan.placements import P, R, Placement

INF = math.inf
# runtime/ realises each planned input placement with DTensor.redistribute, which refuses
# Replicate -> Partial (measured on torch 2.13: meshplan run of a row-parallel addmm bias).
# Flip when the runtime learns it (a replicated bias kept on one rank, zeros elsewhere).
REPLICATE_TO_PARTIAL = False


class AxisLinks:
    """How each mesh axis of a (sub)mesh is wired (``costmodel.comm.axis_link``): collectives
    along an axis are priced on its link level, hierarchically when it spans nodes."""

    def __init__(self, hw, mesh_shape: tuple[int, ...], devices_per_node: int,
                 first_device: int = 0):
        self.hw = hw
        self.mesh_shape = tuple(mesh_shape)
        self.wiring = tuple(axis_link(self.mesh_shape, a, devices_per_node, first_device)
                            for a in range(len(mesh_shape)))

    def collective(self, kind: Collective, nbytes: float, axis: int) -> float:
        crosses, local = self.wiring[axis]
        return collective_time_s(self.hw, kind, nbytes, self.mesh_shape[axis],
                                 crosses_nodes=crosses, local_size=local)


def shard_factor(pl: Placement, mesh_shape: tuple[int, ...], skip: int = -1) -> int:
    n = 1
    for axis, p in enumerate(pl):
        if p >= 0 and axis != skip:
            n *= mesh_shape[axis]
    return n


def transition_s(links: AxisLinks, nbytes: float, src: Placement, dst: Placement) -> float:
    """Forward time to redistribute a tensor of ``nbytes`` (global) from ``src`` to ``dst``."""
    if src == dst:
        return 0.0
    total = 0.0
    shape = links.mesh_shape
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b or shape[axis] == 1:
            continue
        buf = nbytes / shard_factor(src, shape, skip=axis)
        if a >= 0 and b == R:
            total += links.collective(Collective.ALL_GATHER, buf, axis)
        elif a >= 0 and b >= 0:
            total += links.collective(Collective.ALL_TO_ALL, buf / shape[axis], axis)
        elif a == P and b == R:
            total += links.collective(Collective.ALL_REDUCE, buf, axis)
        elif a == P and b >= 0:
            total += links.collective(Collective.REDUCE_SCATTER, buf, axis)
        elif b == P and (a >= 0 or not REPLICATE_TO_PARTIAL):
            return INF
    return total


def grad_placement(consumed: Placement, split: tuple[int, ...]) -> Placement:
    """Placement of the gradient an operator returns for an input it consumed as ``consumed``:
    a Replicate input of an operator whose work is split on that axis gets a Partial grad."""
    return tuple((P if s >= 0 else R) if c == R else (R if c == P else c)
                 for c, s in zip(consumed, split))


def output_grad(pl: Placement) -> Placement:
    """The gradient a producer needs for its output: Partial outputs take a Replicate grad."""
    return tuple(R if p == P else p for p in pl)


def edge_s(links: AxisLinks, nbytes: float, produced: Placement, consumed: Placement,
           grad: Placement | None) -> float:
    """Forward redistribution plus the backward gradient's redistribution (None: no grad)."""
    fwd = transition_s(links, nbytes, produced, consumed)
    if fwd == INF or grad is None:
        return fwd
    return fwd + transition_s(links, nbytes, grad, output_grad(produced))
