"""Pricing a stage's candidates: groups, compute, memory, gradient sync and resharding edges.

trace -> cost -> **solve (pricing)** -> run. ``planner/intra.py`` calls ``Pricer.problem`` to
turn a stage into groups of priced candidates and priced edges (seconds and GiB per device,
already multiplied by the number of identical layers a group stands for).

- Anchors are operators with their own decision; followers (a view or unary elementwise op
  whose only input comes from the same layer) take their producer's decision. A follower of
  a Partial-producing anchor that cannot keep Partial (dropout, gelu) stays an anchor, so the
  solver may choose a reduce-scatter there (sequence parallelism) instead of an all-reduce.
- Constant operators (built only from creation ops: masks, positions) are replicated.
- A parameter belongs to its first consumer in the stage: that group pays its memory,
  gradient sync and optimizer step. Its candidates come plain (storage = consumed placement;
  gradients all-reduced over each axis that splits the work) and as ZeRO-3 (storage further
  sharded on those axes; all-gather in forward and backward, reduce-scatter of gradients).
  Later consumers (tied weights) read it through an edge.
"""

from __future__ import annotations

import itertools

from meshplan.costmodel.comm import Collective
from meshplan.costmodel.compute import DTYPE_BYTES, op_time
from meshplan.costmodel.memory import (GIB, GRAD_BYTES, MASTER_BYTES, alias_root, is_seq_squared,
                                       moment_bytes, optimizer_traffic_s, saved_inputs)
from meshplan.plan import MemoryBreakdown
from meshplan.graph import OpKind
from meshplan.planner.intra import GroupChoice, Group, StageProblem, warn_fallbacks
from meshplan.planner.reshard import (REPLICATE_TO_PARTIAL, edge_s, grad_placement,
                                      output_grad, shard_factor)
from meshplan.placements import P, R
from meshplan.vocabulary import ComputeDtype, Recompute
from meshplan.planner.strategies import (Strategy, enumerate_strategies, follow,
                                         input_shapes, is_pointwise, keeps_partial, op_spec,
                                         replicated_strategy, tensor_of, tensor_placements)

_FLOAT = ("float32", "float16", "bfloat16", "float64")


class Pricer:
    def __init__(self, graph, names, rep, mesh_shape, hw, options, links):
        self.g, self.names, self.rep = graph, names, rep
        self.mesh, self.hw, self.o, self.links = mesh_shape, hw, options, links
        self.ndim = len(mesh_shape)
        self.in_stage = set(names)
        self.graph_inputs = dict(graph.inputs)
        self.scale = DTYPE_BYTES[options.dtype] / 4  # traced in fp32
        self.needs_grad, self.constant = self._flags()
        self.kept_roots = {alias_root(t, graph) for n in names
                           for t in saved_inputs(graph.node(n), graph)}
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

    # -- flags ---------------------------------------------------------------------------------
    def _flags(self):
        trainable = {p.name for p in self.g.params if p.trainable}
        grad, const = {}, {}
        for n in self.g.nodes:
            floating = n.out is not None and n.out.dtype in _FLOAT
            grad[n.name] = floating and any(i in trainable or grad.get(i, False)
                                            for i in n.inputs)
            # buffers and submodules the graph does not list are constants too
            const[n.name] = n.kind == OpKind.CREATION or (bool(n.inputs) and all(
                const.get(i, i not in self.g.param_map and i not in self.graph_inputs)
                for i in n.inputs))
        return grad, const

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

    # -- pass 2: prices ------------------------------------------------------------------------
    def problem(self, count, param_rep):

        self._build()
        warn_fallbacks(self.fallbacks)
        owner = self._owners(param_rep)
        roots = [n for n in self.names if self.root.get(n) == n]
        order = self.sources + roots
        index = {r: k for k, r in enumerate(order)}
        groups = []
        for r in order:
            owned = tuple(p for p, (o, _) in owner.items() if o == r)
            groups.append(self._group(r, count.get(r, 1), owned, owner))
        edges = self._edges(index, owner, param_rep, groups)
        limit = self.o.memory_limit_gib if self.o.memory_limit_gib is not None \
            else self.hw.device.memory_gib
        return StageProblem(tuple(groups), tuple(edges), self.rep, param_rep,
                            tuple(self.fallbacks), limit * GIB, self.o.microbatches)

    def _owners(self, param_rep):
        owner = {}
        for n in self.names:
            r = self.rep[n]
            if r != n or self.root.get(n) != n:
                continue
            for k, i in enumerate(self.g.node(n).inputs):
                if i in self.g.param_map:
                    owner.setdefault(param_rep.get(i, i), (n, k))
        return owner

    def _group(self, r, count, owned, owner):
        if r in self.sources:
            cands = tuple(GroupChoice(s, False, 0.0, 0.0, 0.0, MemoryBreakdown(), ((),),
                                      (s.output,), ())
                          for s in self.strategies[r])
            return Group(r, (r,), cands, 1, (), "input", is_source=True)
        cands = []
        for a, st in enumerate(self.strategies[r]):
            base = self._price(r, a, st, count)
            for zero in ((False, True) if self.o.zero >= 3 else (False,)):
                c = self._with_params(base, a, st, r, owned, owner, zero, count)
                if c is not None:
                    cands.append(c)
        return Group(r, tuple(self.members[r]), tuple(cands), count, owned, self.rules[r])

    def _price(self, r, a, st, count):
        """Per microbatch x count: compute, follower fix-ups; and the activations kept."""
        o, mesh, bf = self.o, self.mesh, self.o.batch_fraction
        compute = comm = kept = boundary = 0.0
        in_layer = self.g.node(r).layer >= 0
        for m in self.members[r]:
            node = self.g.node(m)
            ins, out = self.placed[m][a]
            split = st.work_split(mesh) if m == r else shard_factor(out, mesh)
            t = op_time(node, self.hw, o.dtype, split / bf)
            seq2 = m in self.seq_squared
            again = (o.recompute == Recompute.FULL and in_layer) or (
                o.recompute == Recompute.SELECTIVE and seq2)
            compute += t.total_s + (t.forward_s if again else 0.0)
            if m != r:  # follower fix-up: the producer's placement -> what this op consumes
                prod = node.inputs[0]
                nbytes = self._bytes(tensor_of(self.g, prod, node)) * bf
                comm += edge_s(self.links, nbytes, self.placed[prod][a][1], ins[0],
                               output_grad(ins[0]) if self.needs_grad[m] else None)
            if m in self.kept_roots and not (o.recompute == Recompute.SELECTIVE and seq2):
                b = sum(self._bytes(t_) for t_ in node.outputs) * bf / shard_factor(out, mesh)
                kept += b
                if self._is_layer_output(m):
                    boundary += b
        live = o.inflight_microbatches
        if o.recompute == Recompute.FULL and in_layer:
            # Megatron's full checkpointing: each layer keeps its output for the next layer;
            # the layer being recomputed holds its whole set once (costmodel/memory.py)
            act = boundary * count * live + kept
        else:
            act = kept * count * live
        return compute * count, comm * count, act

    def _is_layer_output(self, name):
        layer = self.g.node(name).layer
        return any(self.g.node(u).layer != layer for u in self.g.users.get(name, ()))

    def _with_params(self, base, a, st, r, owned, owner, zero, count):
        """Add the owned parameters: memory, gradient sync, optimizer step, ZeRO-3 gathers."""
        compute, fixups, act = base  # per microbatch, already x count
        o, mesh = self.o, self.mesh
        pbytes = gbytes = obytes = 0.0
        gathers = sync_s = optim_s = 0.0
        any_sync = False
        storage = []
        for p in owned:
            info = self.g.param_map[p]
            used = st.inputs[owner[p][1]]
            if P in used and not REPLICATE_TO_PARTIAL:
                return None  # a stored parameter cannot be read as Partial by the runtime
            local = info.numel / shard_factor(used, mesh)
            sync = [ax for ax in range(self.ndim)
                    if used[ax] == R and st.split[ax] >= 0 and mesh[ax] > 1] if info.trainable else []
            stored = tuple(R if x == P else x for x in used)  # a bias read as Partial is stored whole
            if zero and sync:
                stored = _zero_storage(stored, sync, info.shape, mesh)
                if stored is None:
                    return None
            any_sync = any_sync or bool(sync)
            storage.append(stored)
            n_store = info.numel / shard_factor(stored, mesh)
            # ZeRO-1/2 (plain storage): fp32 master + optimizer state split over the
            # gradient-sync axes (ZeRO paper, figure 1); ZeRO-2's gradients too in the paper,
            # but the graph engine accumulates them full-size over the microbatches and
            # reduce-scatters once per step (costmodel/estimate.py, full_grad_accumulation)
            div = 1
            if not zero and o.zero in (1, 2):
                for ax in sync:
                    div *= mesh[ax]
            copy_b = DTYPE_BYTES[o.dtype]
            # under fp32 the graph engine's ZeRO-1/2 master shard is a copy of its own
            master_b = MASTER_BYTES if o.dtype != ComputeDtype.FP32 or div > 1 else 0
            pbytes += n_store * (copy_b + master_b / div)
            if info.trainable:
                gbytes += n_store * GRAD_BYTES
                obytes += n_store * moment_bytes(o.optimizer) / div
                optim_s += optimizer_traffic_s(n_store / div, dtype=o.dtype, optimizer=o.optimizer,
                                               hw=self.hw)
            for ax in sync:
                if zero:  # FSDP gathers the weight for every microbatch's forward and backward
                    gathers += 2 * self.links.collective(
                        Collective.ALL_GATHER, local * copy_b, ax)
                    sync_s += self.links.collective(Collective.REDUCE_SCATTER, local * GRAD_BYTES, ax)
                elif o.zero in (1, 2):  # reduce (-scatter) grads, gather the stepped weights
                    kind = Collective.REDUCE_SCATTER if o.zero == 2 else Collective.ALL_REDUCE
                    sync_s += self.links.collective(kind, local * GRAD_BYTES, ax)
                    sync_s += self.links.collective(Collective.ALL_GATHER, local * copy_b, ax)
                else:
                    sync_s += self.links.collective(Collective.ALL_REDUCE, local * GRAD_BYTES, ax)
        if zero and not any_sync:
            return None
        ins, out = zip(*(self.placed[m][a] for m in self.members[r]))
        mem = MemoryBreakdown(params_gib=pbytes * count / GIB, grads_gib=gbytes * count / GIB,
                              optimizer_gib=obytes * count / GIB, activations_gib=act / GIB)
        micro = compute + fixups + gathers * count
        step = (sync_s + optim_s) * count
        comm = (fixups + gathers * count) * o.microbatches + sync_s * count
        return GroupChoice(st, zero, micro, step, comm, mem, ins, out, tuple(storage))

    def _bytes(self, meta) -> float:
        return meta.bytes * (self.scale if meta.dtype in _FLOAT else 1.0)

    # -- edges ---------------------------------------------------------------------------------
    def _edges(self, index, owner, param_rep, groups):
        counts: dict = {}
        for n in self.names:
            r = self.rep[n]
            if self.root.get(r) != r:
                continue
            for k, i in enumerate(self.g.node(n).inputs):
                if i in self.g.param_map:
                    pr = param_rep.get(i, i)
                    if owner.get(pr) == (r, k):
                        continue
                    key = (("param", pr), r, k)
                elif i in self.in_stage or i in self.root:
                    key = (self.rep[i] if i in self.in_stage else i, r, k)
                else:
                    continue  # a submodule or constant argument, not a tensor
                counts[key] = counts.get(key, 0) + 1
        edges = []
        for (src, r, k), cnt in counts.items():
            vg = groups[index[r]]
            node = self.g.node(r)
            if isinstance(src, tuple):
                o_name, o_k = owner[src[1]]
                ug = groups[index[o_name]]
                u_out = [c.strategy.inputs[o_k] for c in ug.candidates]
                nbytes = self.g.param_map[src[1]].numel * DTYPE_BYTES[self.o.dtype]
                grad = self.g.param_map[src[1]].trainable
            else:
                ug = groups[index[self.root[src]]]
                pos = ug.members.index(src)
                u_out = [c.member_outputs[pos] for c in ug.candidates]
                nbytes = self._bytes(tensor_of(self.g, src, node) if src in self.g
                                     else self.graph_inputs[src]) * self.o.batch_fraction
                grad = self.needs_grad.get(src, False)
            u_keys = sorted(set(u_out))
            v_keys_list = [(c.strategy.inputs[k],
                            grad_placement(c.strategy.inputs[k], c.strategy.split) if grad else None)
                           for c in vg.candidates]
            v_keys = sorted(set(v_keys_list), key=repr)
            cost = tuple(tuple(edge_s(self.links, nbytes, p, q, gq) * cnt
                               for q, gq in v_keys) for p in u_keys)
            edges.append((index[self.root[src]] if not isinstance(src, tuple)
                          else index[owner[src[1]][0]], index[r],
                          tuple(u_keys.index(x) for x in u_out),
                          tuple(v_keys.index(x) for x in v_keys_list), cost))
        return edges


def _zero_storage(used, sync, shape, mesh):
    """Storage for ZeRO-3: shard a parameter dim on every gradient-sync axis."""
    extra = 1
    for ax in sync:
        extra *= mesh[ax]
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        have = 1
        for ax, p in enumerate(used):
            if p == d:
                have *= mesh[ax]
        if shape[d] % (have * extra) == 0:
            return tuple(d if ax in sync else p for ax, p in enumerate(used))
    return None
