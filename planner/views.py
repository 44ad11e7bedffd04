"""Where a dimension goes through a view-class operator (transpose, permute, expand, slice,
select, view / reshape): read by the manual-plan propagator (planner/manual.py) and the cp-axis
propagator (planner/cp_placements.py); below both, so that neither imports the other for it
(issue 40).
"""

from __future__ import annotations

from meshplan.graph import OpNode


def _args(node: OpNode) -> list:
    return node.parsed_args()[0]


def _norm_dim(d, rank: int) -> int:
    return d + rank if isinstance(d, int) and d < 0 else d


def map_view_dim(node: OpNode, in_shape: tuple[int, ...], d: int) -> int | None:
    """The output dim carrying input dim ``d`` through a view-class op, or None."""
    out = node.out.shape if node.out is not None else ()
    target = node.target
    args = _args(node)
    rank_in, rank_out = len(in_shape), len(out)
    if any(k in target for k in ("alias", "detach", "contiguous", "clone", "_to_copy", "aten.to.",
                                 "getitem", "split", "chunk", "cat", "stack")):
        return d if d < rank_out else None
    if "transpose" in target and len(args) >= 3:
        a, b = _norm_dim(args[1], rank_in), _norm_dim(args[2], rank_in)
        return b if d == a else a if d == b else d
    if "aten.t." in target:
        return 1 - d if rank_in == 2 else d
    if "permute" in target and len(args) >= 2:
        dims = [_norm_dim(x, rank_in) for x in args[1]]
        return dims.index(d) if d in dims else None
    if "expand" in target:
        return d + rank_out - rank_in
    if "slice" in target or "narrow" in target:
        return d if rank_in == rank_out and out[d] == in_shape[d] else None
    if "select" in target and len(args) >= 2:
        dim = _norm_dim(args[1], rank_in)
        return None if dim == d else (d if d < dim else d - 1)
    # view / reshape / unsqueeze / squeeze / flatten: match the prefix product
    prefix = 1
    for s in in_shape[:d]:
        prefix *= s
    acc = 1
    for e, s in enumerate(out):
        if acc == prefix and s > 1 and (s % in_shape[d] == 0 or in_shape[d] % s == 0):
            return e
        acc *= s
        if acc > prefix:
            break
    return None
