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

# the plan-file form, one string per mesh axis (printing: ``shard``; parsing: ``parse_placement``)
REPLICATE = "R"  # DTensor Replicate(): every rank of the axis holds the whole tensor
PARTIAL = "P"  # DTensor Partial("sum"): each rank holds an addend of the tensor

# the planner's integer form
R, P = -1, -2  # Replicate, Partial; a non-negative int d is Shard(d)

Placement = tuple[int, ...]  # one entry per mesh axis


def shard(dim: int) -> str:
    """DTensor Shard(dim) in the plan-file form: 0 -> "S(0)"."""
    return f"S({dim})"


def is_shard(text: str) -> bool:
    """"S(d)" -> True; "R" and "P" -> False."""
    return text.startswith("S(")


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
    return tuple(REPLICATE if p == R else PARTIAL if p == P else shard(p) for p in pl)
