"""The placement vocabulary: DTensor's Replicate, Partial and Shard(d), in the two forms the
pipeline keeps them.

trace -> cost -> **solve** -> plan -> run. The plan file writes one string per mesh axis,
``"R"``, ``"P"`` or ``"S(d)"``; the planner's strategies compute with integers, ``R = -1``,
``P = -2`` and ``d >= 0`` for Shard(d), so that a placement is a hashable tuple and shard
arithmetic stays cheap. This module holds both forms and the conversions between them. The
DTensor objects themselves are made and read only by the runtime (``runtime/graph/placing.py``:
``to_placements``, ``placement_texts``), because the core imports nothing from
``torch.distributed``.
"""

from __future__ import annotations

import re

from meshplan.errors import PlanFileError

PLACEMENT_RE = re.compile(r"^(R|P|S\((\d+)\))$")

R, P = -1, -2  # Replicate, Partial; a non-negative int d is Shard(d)

Placement = tuple[int, ...]  # one entry per mesh axis


def parse_placement(text: str) -> tuple[str, int | None]:
    """"S(1)" -> ("S", 1); "R" -> ("R", None); "P" -> ("P", None)."""
    m = PLACEMENT_RE.match(text)
    if not m:
        raise PlanFileError(f"placement {text!r} is not one of 'R', 'P', 'S(dim)'")
    return (m.group(1)[0], int(m.group(2)) if m.group(2) is not None else None)


def shard_dim(text: str) -> int | None:
    """"S(2)" -> 2; "R" and "P" -> None."""
    return parse_placement(text)[1]


def placement_str(pl: Placement) -> tuple[str, ...]:
    """Planner integers -> plan strings, one per mesh axis: (-1, 0) -> ("R", "S(0)")."""
    return tuple("R" if p == R else "P" if p == P else f"S({p})" for p in pl)
