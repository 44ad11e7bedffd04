"""Context parallelism (cp): the sequence of every activation split over a mesh axis "cp".

trace -> cost -> solve -> **assemble** -> run. Used by meshplan/manual.py (placements), the
planner's stage pricing, meshplan/support.py (what runs), ``meshplan show`` (chunks) and
the runtime (runtime/context.py, the K/V exchange).

The layout (Llama 3 paper Sec. 3.3.2; torchtitan's load balancer): the sequence is cut
into 2 x cp equal chunks and cp rank r holds chunk r and chunk 2cp-1-r, so under a causal
mask every rank does the same attention work. In a plan, "S(d)" on the cp axis means this
layout of dim d (not DTensor's contiguous Shard): the runtime permutes the dim into
``layout_order`` and then shards it contiguously.

Placements on the cp axis, in graph order (``CpPropagator``):
- graph inputs are "R" (each rank of a data-parallel group gets whole sequences); the first
  non-view operator that reads a sequence-long graph input reads it "S(seq dim)";
- an operator with a sequence-split activation input keeps the split (views map the dim,
  broadcasting aligns it); replicated operands with the sequence length on that dim
  (positions, RoPE tables, position embeddings, masks) are read split too, which is where
  the layout gives each rank its own positions; operands of size 1 there stay "R";
- attention reads Q split and K, V "R" (all-gathered over cp, as Llama 3 does), the mask
  split on its query dim; its output stays split; a queries x keys mask computed from
  positions is built split on its query rows (each rank makes only its rows);
- anything else that meets a split (a slice of the sequence, a flatten of batch and
  sequence, the loss, a matmul contracting the sequence) reads it "R" (all-gathered).
"""

from __future__ import annotations

import ast

from meshplan.errors import NotSupportedError, PlanningError
from meshplan.planner.graph import OpGraph, OpKind, OpNode

R = "R"
CP_AXIS = "cp"


def layout_order(seq: int, cp: int) -> list[int]:
    """Sequence positions in the order the cp ranks hold them: rank 0's two chunks, then
    rank 1's, ... (rank r: chunk r and chunk 2cp-1-r of 2cp)."""
    if seq % (2 * cp):
        raise PlanningError(f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}; "
                            f"the load-balanced layout cuts it into 2 x cp chunks; choose a "
                            f"sequence length that is a multiple of {2 * cp} or a smaller cp")
    c = seq // (2 * cp)
    out: list[int] = []
    for r in range(cp):
        out += list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c,
                                                             (2 * cp - r) * c))
    return out


def rank_chunks(seq: int, cp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, end) sequence chunks cp rank ``rank`` holds."""
    layout_order(seq, cp)  # validates
    c = seq // (2 * cp)
    return (rank * c, (rank + 1) * c), ((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)


def chunk_words(seq: int, cp: int, limit: int = 4) -> str:
    """Each cp rank's sequence chunks, for ``meshplan show`` and the report."""
    ranks = [f"rank {r}: " + " + ".join(f"[{a}, {b})" for a, b in rank_chunks(seq, cp, r))
             for r in range(min(cp, limit))]
    more = f"; ... rank {cp - 1}: " + " + ".join(
        f"[{a}, {b})" for a, b in rank_chunks(seq, cp, cp - 1)) if cp > limit else ""
    return (f"cp={cp}: sequence {seq} in {2 * cp} chunks of {seq // (2 * cp)}, each rank a head "
            f"and a tail chunk; " + "; ".join(ranks) + more)


def causal_work(seq: int, cp: int) -> list[int]:
    """Query-key pairs each cp rank scores under a causal mask (the balance the layout buys)."""
    return [sum(q + 1 for a, b in rank_chunks(seq, cp, r) for q in range(a, b))
            for r in range(cp)]


# -- checks on the model -------------------------------------------------------------------------

def _call_args(node: OpNode) -> tuple[list, dict]:
    try:
        args, kwargs = ast.literal_eval(node.args_repr)
        return list(args), dict(kwargs)
    except (ValueError, SyntaxError, TypeError):
        return [], {}


def check_cp_model(graph: OpGraph, cp: int, seq_len: int) -> None:
    """Refuse, in one line each, what the K/V exchange cannot split."""
    if cp <= 1:
        return
    attention = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    if not attention:
        raise PlanningError(f"cp={cp} splits attention's sequence, but model "
                            f"{graph.model_name or '(unnamed)'} has no attention operator; use cp=1 "
                            "(split the batch with dp instead)")
    layout_order(seq_len, cp)
    for n in attention:
        args, kwargs = _call_args(n)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        where = f"operator {n.name} ({n.target}) at {n.source or 'unknown source'}"
        if "scaled_dot_product_attention" not in n.target:
            raise NotSupportedError(f"cp={cp}: {where} is an attention variant the K/V "
                                    "exchange does not split; use cp=1 or "
                                    "scaled_dot_product_attention")
        if causal is True:
            raise NotSupportedError(f"cp={cp}: {where} uses is_causal=True, whose implicit "
                                    "mask follows local positions, not the load-balanced "
                                    "layout; pass an explicit mask (attn_mask) or use cp=1")
        if dropout not in (0, 0.0):
            raise NotSupportedError(f"cp={cp}: {where} has attention dropout {dropout}; "
                                    "set it to 0 or use cp=1")
        mask = n.inputs[3] if len(n.inputs) > 3 else None
        q = _shape(graph, n.inputs[0])
        if mask is not None:
            m = _shape(graph, mask)
            if len(m) < 2 or m[-2] not in (1, q[-2]) or m[-1] not in (1, _shape(graph, n.inputs[1])[-2]):
                raise NotSupportedError(f"cp={cp}: {where} has a mask of shape {list(m)} that "
                                        "is not (..., queries, keys); the exchange splits the "
                                        "query dim only; use cp=1")


def _shape(graph: OpGraph, name: str) -> tuple[int, ...]:
    if name in graph:
        out = graph.node(name).out
        return out.shape if out is not None else ()
    return next((m.shape for n, m in graph.inputs if n == name), ())


# -- placements ----------------------------------------------------------------------------------

def _sdim(p: str) -> int | None:
    return int(p[2:-1]) if p.startswith("S(") else None


_MOVABLE_VIEWS = ("unsqueeze", "expand", "reshape", "view", "transpose", "clone", "alias")


class CpPropagator:
    """The cp-axis placement of every operator's inputs and output, walked in graph order
    (the rules of the module docstring). ``visit`` returns (input placements, output)."""

    def __init__(self, graph: OpGraph, seq_len: int):
        from meshplan.manual import map_view_dim

        self.g, self.seq, self._map = graph, seq_len, map_view_dim
        self.state: dict[str, str] = {n: R for n, _ in graph.inputs}
        self.records: dict[str, tuple[tuple[str, ...], str]] = {}
        # graph inputs (and their views) with a sequence dim: name -> that dim
        self.seeds = {n: 1 for n, m in graph.inputs if len(m.shape) >= 2 and m.shape[1] == seq_len}

    def _view_dim(self, node: OpNode, src: str, d: int) -> int | None:
        shape = _shape(self.g, src)
        e = self._map(node, shape, d)
        out = node.out.shape if node.out is not None else ()
        if e is None or e >= len(out) or out[e] != shape[d]:
            return None
        if not any(k in node.target for k in ("view", "reshape", "flatten", "squeeze")):
            return e  # transpose, permute, expand, slice elsewhere: the dim is moved whole
        before = 1
        for s in out[:e]:
            before *= s
        want = 1
        for s in shape[:d]:
            want *= s
        return e if before == want else None

    def visit(self, node: OpNode) -> tuple[tuple[str, ...], str]:
        g = self.g
        ins = [R if i in g.param_map else self.state.get(i, R) for i in node.inputs]
        acts = [k for k, i in enumerate(node.inputs) if i not in g.param_map and i in self.state]
        out_shape = node.out.shape if node.out is not None else ()
        consumed = list(ins)
        if node.kind == OpKind.VIEW:
            src = next((node.inputs[k] for k in acts), None)
            if src is not None and src in self.seeds:
                e = self._view_dim(node, src, self.seeds[src])
                if e is not None:
                    self.seeds[node.name] = e
            split = [(k, _sdim(ins[k])) for k in acts if _sdim(ins[k]) is not None]
            out = R
            if split:
                k, d = split[0]
                if "aten.stack" in node.target:
                    e = None
                elif "aten.cat" in node.target:
                    args, _ = _call_args(node)
                    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
                    dim = dim + len(out_shape) if dim < 0 else dim
                    e = d if dim != d and all(_sdim(ins[j]) == d for j in acts) else None
                else:
                    e = self._view_dim(node, node.inputs[k], d)
                if e is None:
                    consumed = [R if j in acts else c for j, c in enumerate(consumed)]
                else:
                    out = f"S({e})"
            return self._done(node, consumed, out)
        split = [(k, _sdim(ins[k])) for k in acts if _sdim(ins[k]) is not None]
        if not split and node.kind == OpKind.ELEMENTWISE and len(out_shape) >= 2 and \
                out_shape[-2:] == (self.seq, self.seq):
            # a seq x seq mask made from positions (queries x keys): each rank builds only
            # its own query rows, from the query-side operand
            rows = [k for k in acts if len(_shape(g, node.inputs[k])) >= 2 and
                    _shape(g, node.inputs[k])[-2] == self.seq]
            if rows:
                d = len(_shape(g, node.inputs[rows[0]])) - 2
                consumed[rows[0]] = ins[rows[0]] = f"S({d})"
                split = [(rows[0], d)]
        if not split and node.kind not in (OpKind.CREATION, OpKind.LOSS):
            seeded = [k for k in acts if node.inputs[k] in self.seeds]
            if seeded:
                k = seeded[0]
                consumed[k] = f"S({self.seeds[node.inputs[k]]})"
                ins[k] = consumed[k]
                split = [(k, self.seeds[node.inputs[k]])]
        if not split:
            return self._done(node, consumed, R)
        if node.kind == OpKind.ATTENTION:
            return self._attention(node, ins, consumed)
        rank = len(out_shape)
        k0, d0 = split[0]
        # pointwise operators broadcast from the right; the others (embedding appends a
        # dim, linear and norms keep the leading dims) keep the leading dims in place
        shift = rank - len(_shape(g, node.inputs[k0])) if node.kind in (
            OpKind.ELEMENTWISE, OpKind.SOFTMAX) else 0
        d = d0 + shift
        gather = node.kind in (OpKind.LOSS, OpKind.CREATION) or not (0 <= d < rank) or \
            out_shape[d] != self.seq or len(node.outputs) != 1
        if node.kind == OpKind.MATMUL and len(acts) > 1:  # activation x activation
            gather = gather or d >= rank - 1
            if not gather:
                for k in acts[1:]:
                    consumed[k] = R
                consumed[k0] = f"S({d0})"
                return self._done(node, consumed, f"S({d})")
        for k in acts:
            shape = _shape(g, node.inputs[k])
            dk = d - (rank - len(shape)) if shift or node.kind == OpKind.ELEMENTWISE else d
            if gather:
                consumed[k] = R
            elif 0 <= dk < len(shape) and shape[dk] == self.seq:
                consumed[k] = f"S({dk})"
            elif 0 <= dk < len(shape) and shape[dk] != 1:
                gather = True
        if gather:
            consumed = [R if j in acts else c for j, c in enumerate(consumed)]
            return self._done(node, consumed, R)
        return self._done(node, consumed, f"S({d})")

    def _attention(self, node: OpNode, ins, consumed):
        q = _shape(self.g, node.inputs[0])
        if _sdim(ins[0]) != len(q) - 2:
            return self._done(node, [R] * len(consumed), R)
        consumed = [f"S({len(q) - 2})", R, R] + [R] * (len(consumed) - 3)
        if len(node.inputs) > 3:
            m = _shape(self.g, node.inputs[3])
            if len(m) >= 2 and m[-2] == self.seq:
                consumed[3] = f"S({len(m) - 2})"
        return self._done(node, consumed, f"S({len(node.out.shape) - 2})")

    def _done(self, node: OpNode, consumed, out: str):
        self.state[node.name] = out
        self.records[node.name] = (tuple(consumed), out)
        return tuple(consumed), out

    def gather_kv_early(self, names) -> dict[str, tuple[tuple[str, ...], str]]:
        """The records of ``names`` with K and V gathered before the views that feed
        attention (grouped-query attention's repeat_kv is unsqueeze, expand, reshape): the
        exchange then moves the kv heads, not their copies (num_heads / num_kv_heads less)."""
        g, records = self.g, dict(self.records)
        users: dict[str, list[str]] = {}
        for n in g.nodes:
            for i in n.inputs:
                users.setdefault(i, []).append(n.name)
        for name in names:
            node = g.node(name)
            if node.kind != OpKind.ATTENTION or records[name][1] == R:
                continue
            for src in node.inputs[1:3]:
                while src in records and g.node(src).kind == OpKind.VIEW and \
                        len(users.get(src, ())) == 1 and records[src][1] != R and \
                        any(k in g.node(src).target for k in _MOVABLE_VIEWS):
                    view = g.node(src)
                    consumed = tuple(R if i == 0 else c for i, c in enumerate(records[src][0]))
                    records[src] = (consumed, R)
                    src = view.inputs[0]
        return {n: records[n] for n in names}


def insert_cp(placements: tuple[str, ...], cp_placement: str, axis: int = 1) -> tuple[str, ...]:
    """(dp, tp) placements -> (dp, cp, tp)."""
    return tuple(placements[:axis]) + (cp_placement,) + tuple(placements[axis:])
