"""Resharding edges: which redistributions DTensor can make, and shard arithmetic.

trace -> cost -> **solve (edges)** -> run. DTensor redistributes one mesh axis at a time; the
time of each transition is the estimate's (``costmodel.estimate.input_collectives``, which
the intra-op ILP calls through planner/pricing.py):

=============  =========================  ==========================================
from -> to     collective                 note
=============  =========================  ==========================================
S(d) -> R      all-gather                 its gradient reduce-scattered back
S(d) -> S(e)   all-to-all
P -> R         all-reduce
P -> S(d)      reduce-scatter
R -> S(d)      none (local slice)         its gradient all-gathered back
R -> P         refused by the runtime     (DTensor.redistribute: "redistributing
                                          to Partial is for internal use only", torch 2.13)
S(d) -> P      not executable by DTensor  pruned before any variable is made
=============  =========================  ==========================================
"""

from __future__ import annotations

import math

from meshplan.placements import P, Placement

INF = math.inf
# runtime/ realises each planned input placement with DTensor.redistribute, which refuses
# Replicate -> Partial (measured on torch 2.13: meshplan run of a row-parallel addmm bias).
# Flip when the runtime learns it (a replicated bias kept on one rank, zeros elsewhere).
REPLICATE_TO_PARTIAL = False


def shard_factor(pl: Placement, mesh_shape: tuple[int, ...], skip: int = -1) -> int:
    n = 1
    for axis, p in enumerate(pl):
        if p >= 0 and axis != skip:
            n *= mesh_shape[axis]
    return n


def refused(produced: Placement, consumed: Placement) -> bool:
    """Whether DTensor cannot turn ``produced`` into ``consumed``: nothing becomes Partial
    (S -> P never; R -> P refused by the runtime unless ``REPLICATE_TO_PARTIAL``)."""
    return any(q == P and p != P and (p >= 0 or not REPLICATE_TO_PARTIAL)
               for p, q in zip(produced, consumed))
