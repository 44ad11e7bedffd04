"""The cp-axis placement of every operator (context parallelism, meshplan/context.py): the
rules of meshplan/context.py's docstring walked over the graph. Planner layer: it maps views
with ``map_view_dim`` (planner/views.py), as the manual-plan propagator does."""

from __future__ import annotations

from meshplan.context import value_shape
from meshplan.graph import OpGraph, OpKind, OpNode
from meshplan.placements import REPLICATE, shard, shard_dim
from meshplan.planner.views import map_view_dim

# -- placements ----------------------------------------------------------------------------------

_MOVABLE_VIEWS = ("unsqueeze", "expand", "reshape", "view", "transpose", "clone", "alias")


class CpPropagator:
    """The cp-axis placement of every operator's inputs and output, walked in graph order
    (the rules of the module docstring). ``visit`` returns (input placements, output)."""

    def __init__(self, graph: OpGraph, seq_len: int):
        self.g, self.seq, self._map = graph, seq_len, map_view_dim
        self.state: dict[str, str] = {n: REPLICATE for n, _ in graph.inputs}
        self.records: dict[str, tuple[tuple[str, ...], str]] = {}
        # graph inputs (and their views) with a sequence dim: name -> that dim
        self.seeds = {n: 1 for n, m in graph.inputs if len(m.shape) >= 2 and m.shape[1] == seq_len}

    def _view_dim(self, node: OpNode, src: str, d: int) -> int | None:
        shape = value_shape(self.g, src)
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
        ins = [REPLICATE if i in g.param_map else self.state.get(i, REPLICATE)
               for i in node.inputs]
        acts = [k for k, i in enumerate(node.inputs) if i not in g.param_map and i in self.state]
        out_shape = node.out.shape if node.out is not None else ()
        consumed = list(ins)
        if node.kind == OpKind.VIEW:
            src = next((node.inputs[k] for k in acts), None)
            if src is not None and src in self.seeds:
                e = self._view_dim(node, src, self.seeds[src])
                if e is not None:
                    self.seeds[node.name] = e
            split = [(k, shard_dim(ins[k])) for k in acts if shard_dim(ins[k]) is not None]
            out = REPLICATE
            if split:
                k, d = split[0]
                if "aten.stack" in node.target:
                    e = None
                elif "aten.cat" in node.target:
                    args, _ = node.parsed_args()
                    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
                    dim = dim + len(out_shape) if dim < 0 else dim
                    e = d if dim != d and all(shard_dim(ins[j]) == d for j in acts) else None
                else:
                    e = self._view_dim(node, node.inputs[k], d)
                if e is None:
                    consumed = [REPLICATE if j in acts else c for j, c in enumerate(consumed)]
                else:
                    out = shard(e)
            return self._done(node, consumed, out)
        split = [(k, shard_dim(ins[k])) for k in acts if shard_dim(ins[k]) is not None]
        if not split and node.kind == OpKind.ELEMENTWISE and len(out_shape) >= 2 and \
                out_shape[-2:] == (self.seq, self.seq):
            # a seq x seq mask made from positions (queries x keys): each rank builds only
            # its own query rows, from the query-side operand
            rows = [k for k in acts if len(value_shape(g, node.inputs[k])) >= 2 and
                    value_shape(g, node.inputs[k])[-2] == self.seq]
            if rows:
                d = len(value_shape(g, node.inputs[rows[0]])) - 2
                consumed[rows[0]] = ins[rows[0]] = shard(d)
                split = [(rows[0], d)]
        if not split and node.kind not in (OpKind.CREATION, OpKind.LOSS):
            seeded = [k for k in acts if node.inputs[k] in self.seeds]
            if seeded:
                k = seeded[0]
                consumed[k] = shard(self.seeds[node.inputs[k]])
                ins[k] = consumed[k]
                split = [(k, self.seeds[node.inputs[k]])]
        if not split:
            return self._done(node, consumed, REPLICATE)
        if node.kind == OpKind.ATTENTION:
            return self._attention(node, ins, consumed)
        rank = len(out_shape)
        k0, d0 = split[0]
        # pointwise operators broadcast from the right; the others (embedding appends a
        # dim, linear and norms keep the leading dims) keep the leading dims in place
        shift = rank - len(value_shape(g, node.inputs[k0])) if node.kind in (
            OpKind.ELEMENTWISE, OpKind.SOFTMAX) else 0
        d = d0 + shift
        gather = node.kind in (OpKind.LOSS, OpKind.CREATION) or not (0 <= d < rank) or \
            out_shape[d] != self.seq or len(node.outputs) != 1
        if node.kind == OpKind.MATMUL and len(acts) > 1:  # activation x activation
            gather = gather or d >= rank - 1
            if not gather:
                for k in acts[1:]:
                    consumed[k] = REPLICATE
                consumed[k0] = shard(d0)
                return self._done(node, consumed, shard(d))
        for k in acts:
            shape = value_shape(g, node.inputs[k])
            dk = d - (rank - len(shape)) if shift or node.kind == OpKind.ELEMENTWISE else d
            if gather:
                consumed[k] = REPLICATE
            elif 0 <= dk < len(shape) and shape[dk] == self.seq:
                consumed[k] = shard(dk)
            elif 0 <= dk < len(shape) and shape[dk] != 1:
                gather = True
        if gather:
            consumed = [REPLICATE if j in acts else c for j, c in enumerate(consumed)]
            return self._done(node, consumed, REPLICATE)
        return self._done(node, consumed, shard(d))

    def _attention(self, node: OpNode, ins, consumed):
        q = value_shape(self.g, node.inputs[0])
        if shard_dim(ins[0]) != len(q) - 2:
            return self._done(node, [REPLICATE] * len(consumed), REPLICATE)
        consumed = [shard(len(q) - 2), REPLICATE, REPLICATE] + [REPLICATE] * (len(consumed) - 3)
        if len(node.inputs) > 3:
            m = value_shape(self.g, node.inputs[3])
            if len(m) >= 2 and m[-2] == self.seq:
                consumed[3] = shard(len(m) - 2)
        return self._done(node, consumed, shard(len(node.out.shape) - 2))

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
            if node.kind != OpKind.ATTENTION or records[name][1] == REPLICATE:
                continue
            for src in node.inputs[1:3]:
                while src in records and g.node(src).kind == OpKind.VIEW and \
                        len(users.get(src, ())) == 1 and records[src][1] != REPLICATE and \
                        any(k in g.node(src).target for k in _MOVABLE_VIEWS):
                    view = g.node(src)
                    consumed = tuple(REPLICATE if i == 0 else c
                                     for i, c in enumerate(records[src][0]))
                    records[src] = (consumed, REPLICATE)
                    src = view.inputs[0]
        return {n: records[n] for n in names}


