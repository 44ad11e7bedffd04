"""Grouping a stage's operators for the intra-op ILP: anchors, followers, sources, strategies.

trace -> cost -> **solve (grouping)** -> run. Pass 1 of ``planner/pricing.py``'s ``Pricer``:

- Anchors are operators with their own decision; followers (a view or unary elementwise op
  whose only input comes from the same layer) take their producer's decision. A follower of
  a Partial-producing anchor that cannot keep Partial (dropout, gelu) stays an anchor, so the
  solver may choose a reduce-scatter there (sequence parallelism) instead of an all-reduce.
- Constant operators (built only from creation ops: masks, positions) are replicated.
- Graph (or stage) inputs are sources: a group whose candidates are the input's placements.
"""

from __future__ import annotations

import itertools

from meshplan.costmodel.memory import (alias_root, is_dropout, is_seq_squared,
                                       keeps_autocast_copy, saved_inputs)
from meshplan.costmodel.compute import DTYPE_BYTES
from meshplan.costmodel.eager import cached_element_bytes
from meshplan.graph import OpKind
from meshplan.placements import P, R
from meshplan.planner.strategies import (Strategy, enumerate_strategies, follow,
                                         input_shapes, is_pointwise, keeps_partial, op_spec,
                                         replicated_strategy, tensor_of, tensor_placements)

_FLOAT = ("float32", "float16", "bfloat16", "float64")


class GroupBuilder:
    """Pass 1: the stage's groups, each group's members and strategies (``_build``)."""

    def __init__(self, graph, names, rep, mesh_shape, options):
        self.g, self.names, self.rep = graph, names, rep
        self.mesh, self.o = tuple(mesh_shape), options
        self.ndim = len(mesh_shape)
        self.in_stage = set(names)
        self.graph_inputs = dict(graph.inputs)
        self.scale = DTYPE_BYTES[options.dtype] / 4  # traced in fp32
        self.constant = self._constants()
        self._kept(graph, names, DTYPE_BYTES[options.dtype])
        seq = graph.inputs[0][1].shape[-1] if graph.inputs and graph.inputs[0][1].shape else 0
        self.seq_squared = {n for n in names if is_seq_squared(n, graph, seq)}
        # pass-1 state
        self.strategies: dict[str, tuple[Strategy, ...]] = {}
        self.root: dict[str, str] = {}
        self.placed: dict[str, list] = {}  # member -> per root strategy: (inputs, output)
        self.members: dict[str, list[str]] = {}
        self.rules: dict[str, str] = {}
        self.fallbacks: list[str] = []
        self.sources: list[str] = []

    def _kept(self, graph, names, dbytes: int) -> None:
        """What the graph engine keeps for the backward, as ``memory.activation_profile``
        prices it for an engine running eager autograd under autocast (the graph engine):
        ``kept_roots`` the tensors kept at their eager dtypes (``sizes``), ``casts`` the
        inputs each matmul / attention keeps an autocast copy of (``cast_bytes`` each
        element), ``loss_roots`` the logits whose fp32 log-probabilities the loss keeps,
        ``dropout_masks`` the dropouts that keep a bool mask."""
        self.sizes = cached_element_bytes(graph, dtype=self.o.dtype, precision="autocast")
        self.cast_bytes = dbytes if dbytes < 4 else 0
        self.kept_roots, self.casts, self.loss_roots = set(), {}, set()
        self.dropout_masks = set()  # dropouts whose bool mask is kept (one byte an element)
        for n in names:
            node = graph.node(n)
            for t in saved_inputs(node, graph):
                root = alias_root(t, graph, copies=True)
                if is_dropout(node):
                    self.dropout_masks.add(n)
                    continue
                if keeps_autocast_copy(node, root, graph, self.sizes, self.cast_bytes, dbytes):
                    self.casts.setdefault(n, []).append(t)
                    continue
                if node.kind == OpKind.LOSS:
                    self.loss_roots.add(root)
                self.kept_roots.add(root)

    # -- constants -----------------------------------------------------------------------------
    def _constants(self):
        """Operators built only from creation ops (masks, positions): replicated."""
        const = {}
        for n in self.g.nodes:
            # buffers and submodules the graph does not list are constants too
            const[n.name] = n.kind == OpKind.CREATION or (bool(n.inputs) and all(
                const.get(i, i not in self.g.param_map and i not in self.graph_inputs)
                for i in n.inputs))
        return const

    # -- pass 1: groups and strategies ------------------------------------------------------------
    def _build(self):
        for n in self.names:
            if self.rep[n] != n:
                continue
            node = self.g.node(n)
            for i in node.inputs:
                if i not in self.g.param_map and i not in self.in_stage and i not in self.root \
                        and (i in self.graph_inputs or i in self.g):  # not a submodule
                    self._source(i, node)
            parent = self._follower_parent(node)
            if parent is not None:
                self._attach(node, parent)
            else:
                self._anchor(node)

    def _source(self, name, consumer):
        shape = self.graph_inputs[name].shape if name in self.graph_inputs else \
            tensor_of(self.g, name, consumer).shape
        strategies = tuple(Strategy((), pl, (-1,) * self.ndim)
                           for pl in tensor_placements(shape, self.mesh))
        self._add_root(name, strategies, "input")
        self.sources.append(name)

    def _add_root(self, name, strategies, rule):
        self.strategies[name] = strategies
        self.root[name] = name
        self.placed[name] = [(s.inputs, s.output) for s in strategies]
        self.members[name] = [name]
        self.rules[name] = rule

    def _follower_parent(self, node):
        if len(node.inputs) != 1 or not (node.kind == OpKind.VIEW or is_pointwise(node)):
            return None
        (i,) = node.inputs
        if i not in self.in_stage or i not in self.root or self.constant[node.name]:
            return None
        if self.g.node(i).layer != node.layer or node.out is None:
            return None
        if not keeps_partial(node) and any(P in out for _, out in self.placed[i]):
            return None
        return i

    def _attach(self, node, parent):
        root = self.root[parent]
        in_shape = tensor_of(self.g, parent, node).shape
        self.root[node.name] = root
        self.placed[node.name] = [follow(node, in_shape, out, self.mesh)
                                  for _, out in self.placed[parent]]
        self.placed[node.name] = [((fixed,), out) for fixed, out in self.placed[node.name]]
        self.members[root].append(node.name)

    def _anchor(self, node):
        if self.constant[node.name] or node.out is None:
            self._add_root(node.name, (replicated_strategy(node, self.ndim),), "constant")
            return
        if node.kind == OpKind.VIEW and len(node.inputs) == 1:
            self._add_root(node.name, self._view_strategies(node), "view")
            return
        spec = op_spec(self.g, node)
        strategies = enumerate_strategies(spec, self.mesh) if spec is not None else ()
        if not strategies:
            self.fallbacks.append(node.name)
            self._add_root(node.name, (replicated_strategy(node, self.ndim),), "fallback: R")
            return
        self._add_root(node.name, strategies, spec.rule)

    def _view_strategies(self, node):
        (i,) = node.inputs
        shape = input_shapes(self.g, node)[0]
        choices = [R, P] + [d for d, s in enumerate(shape) if s > 1]
        seen, out = set(), []
        for pl in itertools.product(choices, repeat=self.ndim):
            fixed, res = follow(node, shape, tuple(pl), self.mesh)
            if (fixed, res) not in seen and fixed == tuple(pl):
                seen.add((fixed, res))
                out.append(Strategy((fixed,), res, (-1,) * self.ndim))
        return tuple(out)
