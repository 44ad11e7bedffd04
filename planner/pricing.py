"""Pricing a stage's candidates: groups, compute, memory, gradient sync and resharding edges.

trace -> cost -> **solve (pricing)** -> run. ``planner/intra.py`` calls ``Pricer.problem`` to
turn a stage into groups of priced candidates and priced edges (seconds and GiB per device,
already multiplied by the number of identical layers a group stands for).

- Groups (anchors and their followers, sources, constants) come from planner/groups.py.
- Every price is the estimate's (one pricer, issue 27): an operator's time is
  ``estimate.operator_time`` (eager kernels, causal attention, contention of the graph
  engine's runtime), an input edge ``estimate.input_collectives``, a parameter
  ``estimate.parameter_part`` with its syncs priced as ``estimate._param_traffic_s`` prices
  them for the graph engine, the optimizer ``estimate.optimizer_step_s``. Terms the
  estimate pays once however many tensors share them (a flat gradient buffer's latency, a
  block's ZeRO-3 gathers) are fixed charges (``ilp.IlpFlag``).
- A parameter belongs to its first consumer in the stage (tied names count as one): that
  group pays its memory, gradient sync and optimizer step, in one variant per stage-wide
  (ZeRO level, data-parallel axis) the runtime can run (``Pricer._variants``: ZeRO shards
  every parameter of the stage over the axis the first input's batch is split on, so the
  variants of all groups must agree: conflicting flags). A tied weight's other readers reach
  it through an edge priced with the gradient sync their split adds.
"""

from __future__ import annotations

from meshplan.costmodel.comm import Collective, CollectivePrices, bandwidth_s as _bandwidth_s
from meshplan.costmodel.compute import contention_factor
from meshplan.costmodel.memory import GIB, causal_masks, loss_grad_bytes, tensor_bytes
from meshplan.costmodel.operators import (causal_attention, eager_kernel_table, input_collectives,
                                          operator_time, selective_recomputes)
from meshplan.costmodel.param_traffic import (optimizer_step_s, per_use_sync_s,
                                              zero3_unit_latency_s)
from meshplan.costmodel.params import param_layer, parameter_part
from meshplan.costmodel.runtime_profiles import default_runtime
from meshplan.costmodel.stage_layout import value_bytes
from meshplan.errors import PlanningError
from meshplan.graph import OpKind
from meshplan.plan import MemoryBreakdown, OpPlacement, Stage
from meshplan.planner import ilp
from meshplan.planner.groups import GroupBuilder
from meshplan.planner.stage_problem import NS, GroupChoice, Group, StageProblem, warn_fallbacks
from meshplan.planner.reshard import INF, REPLICATE_TO_PARTIAL, refused, shard_factor
from meshplan.placements import P, R, placement_str
from meshplan.vocabulary import Engine, Recompute


class Pricer(GroupBuilder):
    """Pass 2: every group's candidates and every edge priced with the estimate's parts."""

    def __init__(self, graph, names, rep, mesh_shape, hw, options, runtime=None):
        super().__init__(graph, names, rep, mesh_shape, options)
        self.hw = hw
        # the engine the single-stage plan runs on (plan.engine "graph"), priced by the
        # estimate's own parts: one operator, one input edge, one parameter at a time
        self.runtime = runtime or default_runtime(hw, engine=Engine.GRAPH)
        if self.runtime.engine != Engine.GRAPH or self.runtime.compiled:
            raise PlanningError(f"the intra-op ILP prices the eager graph engine, not "
                                f"{self.runtime.engine!r}{' compiled' if self.runtime.compiled else ''}; "
                                "price other engines' plans with meshplan.estimate")
        devices = 1
        for n in self.mesh:
            devices *= n
        self.coll = CollectivePrices(
            Stage(index=0, devices=tuple(range(devices)), mesh_shape=self.mesh,
                  axis_names=tuple(f"d{i}" for i in range(self.ndim)), layers=(0, 0),
                  nodes=("", "")), hw, backend=self.runtime.backend)
        # every process of the host computes at once in a single stage (estimate's
        # plan_stage_costs: busy ranks = all ranks without a bubble)
        self.all_procs = self.contention = contention_factor(hw, min(devices, hw.devices_per_node))
        self.kernels = eager_kernel_table(graph, options.dtype, "autocast") \
            if self.runtime.eager_kernels else None
        self.masks = causal_masks(graph) if self.runtime.causal_attention else set()
        self.needs_grad_set = graph.grad_nodes
        self.layer_of = {p.name: param_layer(p.name, graph) for p in graph.params}
        self._times: dict = {}
        self._edge_memo: dict = {}
        self._texts: dict = {}
        self._value_bytes: dict = {}

    # -- pass 2: prices ------------------------------------------------------------------------
    def problem(self, count, param_rep):
        self._build()
        warn_fallbacks(self.fallbacks)
        owner = self._owners(param_rep)
        roots = [n for n in self.names if self.root.get(n) == n]
        order = self.sources + roots
        index = {r: k for k, r in enumerate(order)}
        groups, charges = [], []
        for r in order:
            owned = tuple(p for p, (o, _) in owner.items() if o == r)
            group, group_charges = self._group(r, count.get(r, 1), owned, owner)
            groups.append(group)
            charges += [(key, cost, (index[r], a)) for key, cost, a in group_charges]
        edges = self._edges(index, owner, param_rep, groups)
        limit = self.o.memory_limit_gib if self.o.memory_limit_gib is not None \
            else self.hw.device.memory_gib
        flags, conflicts = self._flags_of(charges, groups)
        return StageProblem(tuple(groups), tuple(edges), self.rep, param_rep,
                            tuple(self.fallbacks), limit * GIB, self.o.microbatches,
                            flags=flags, conflicts=conflicts)

    def _owners(self, param_rep):
        owner = {}
        for n in self.names:
            r = self.rep[n]
            if r != n or self.root.get(n) != n:
                continue
            for k, i in enumerate(self.g.node(n).inputs):
                if i in self.g.param_map:
                    owner.setdefault(self._canonical(param_rep.get(i, i)), (n, k))
        return owner

    def _canonical(self, name):
        """A tied parameter is one parameter: it counts under the name it is tied to, as
        ``estimate.parameter_walk`` counts it (its other readers reach it through an edge)."""
        tied = self.g.param_map[name].tied_to
        return tied if tied is not None and tied in self.g.param_map else name

    def _variants(self):
        """The stage-wide (ZeRO level, data-parallel axis) a candidate may assume: the
        runtime shards every parameter of a ZeRO stage over the axis the first input's batch
        is split on (``estimate.dp_axis``), so each such axis is its own variant."""
        z = self.o.zero
        axes = [ax for ax in range(self.ndim) if self.mesh[ax] > 1]
        if z == 0:
            return [(0, None)]
        if z >= 3:  # ZeRO-3 where it pays, else none
            return [(0, None)] + [(3, ax) for ax in axes]
        return [(z, ax) for ax in axes] or [(z, None)]  # ZeRO-1/2 asked for: over a dp axis

    def _group(self, r, count, owned, owner):
        """The group's candidates and the fixed charges ``(key, cost_s, candidate)`` each
        turns on (``StageProblem.flags``)."""
        if r in self.sources:
            cands = tuple(GroupChoice(s, False, 0.0, 0.0, 0.0, MemoryBreakdown(), ((),),
                                      (s.output,), ())
                          for s in self.strategies[r])
            charges = []
            if r == self.sources[0]:  # the first input's batch split names the dp axis
                charges = [(("dp-axis", _dp_axis(c.strategy.output)), 0.0, a)
                           for a, c in enumerate(cands)]
            return Group(r, (r,), cands, 1, (), "input", is_source=True), charges
        cands, charges = [], []
        variants = self._variants() if owned else [(0, None)]
        for a, st in enumerate(self.strategies[r]):
            base = self._price(r, a, st, count)
            for zero, dpa in variants:
                c = self._with_params(base, a, st, r, owned, owner, zero, dpa, count)
                if c is None:
                    continue
                choice, mine = c
                charges += [(key, cost, len(cands)) for key, cost in mine]
                if owned:
                    charges.append((("variant", zero, dpa), 0.0, len(cands)))
                cands.append(choice)
        return Group(r, tuple(self.members[r]), tuple(cands), count, owned,
                     self.rules[r]), charges

    def _placement(self, pl):
        text = self._texts.get(pl)
        if text is None:
            text = self._texts[pl] = placement_str(pl)
        return text

    def _op_time(self, m, ins, out):
        key = (m, ins, out)
        t = self._times.get(key)
        if t is None:
            node = self.g.node(m)
            op = OpPlacement(tuple(self._placement(p) for p in ins), self._placement(out))
            t = self._times[key] = operator_time(
                node, op, self.g, self.hw, self.o.dtype, self.mesh, 1 / self.o.batch_fraction,
                self.contention, kernels=self.kernels, causal=self._causal(node))
        return t

    def _causal(self, node):
        return causal_attention(node, self.g, self.masks, True)

    def _recomputed(self, node) -> bool:
        """Whether the recompute policy runs ``node``'s forward again (estimate's rules)."""
        o = self.o
        if node.layer < 0:
            return False
        return o.recompute == Recompute.FULL or (o.recompute == Recompute.SELECTIVE
                                                and selective_recomputes(node, self.g))

    def _comm(self, src_name, consumer, produced, consumed, out):
        """Seconds per microbatch of the collectives giving ``consumer`` its input
        ``src_name`` (``estimate.input_collectives``; forward again under full recompute)."""
        grad = src_name in self.needs_grad_set
        nbytes = self._value_bytes.get(src_name)
        if nbytes is None:
            nbytes = self._value_bytes[src_name] = \
                value_bytes(self.g, src_name, self.o.dtype) * self.o.batch_fraction
        again = self.o.recompute == Recompute.FULL and consumer.layer >= 0
        key = (nbytes, produced, consumed, _split_mask(out), grad, again)
        t = self._edge_memo.get(key)
        if t is None:
            if refused(produced, consumed):
                t = INF  # DTensor will not redistribute to Partial
            else:
                t = sum(tf * (2 if again else 1) + tb for _, tf, tb in input_collectives(
                    self.coll, self.mesh, nbytes, self._placement(produced),
                    self._placement(consumed), self._placement(out), grad=grad))
            self._edge_memo[key] = t
        return t

    def _price(self, r, a, st, count):
        """Per microbatch x count: compute (and recompute), follower fix-ups; activations."""
        o, mesh, bf = self.o, self.mesh, self.o.batch_fraction
        compute = comm = kept = boundary = 0.0
        in_layer = self.g.node(r).layer >= 0
        for m in self.members[r]:
            node = self.g.node(m)
            ins, out = self.placed[m][a]
            t = self._op_time(m, ins, out)
            compute += t.total_s + (t.forward_s if self._recomputed(node) else 0.0)
            if m != r:  # follower fix-up: the producer's placement -> what this op consumes
                prod = node.inputs[0]
                comm += self._comm(prod, node, self.placed[prod][a][1], ins[0], out)
            seq2 = m in self.seq_squared
            if m in self.kept_roots and not (o.recompute == Recompute.SELECTIVE and seq2):
                per = 4 if m in self.loss_roots else self.sizes.get(m, 4 * self.scale)
                b = tensor_bytes(m, self.g, per, self.graph_inputs) * bf \
                    / shard_factor(out, mesh)
                kept += b
                if self._is_layer_output(m):
                    boundary += b
            if m in self.dropout_masks and not (o.recompute == Recompute.SELECTIVE and seq2):
                kept += tensor_bytes(m, self.g, 1, self.graph_inputs) * bf \
                    / shard_factor(out, mesh)  # a dropout's bool mask
            for t_ in self.casts.get(m, ()):  # autocast's copy of an input held wider
                k = node.inputs.index(t_)
                kept += tensor_bytes(t_, self.g, self.cast_bytes, self.graph_inputs) * bf \
                    / (shard_factor(ins[k], mesh) if k < len(ins) else 1)
        live = o.inflight_microbatches
        if o.recompute == Recompute.FULL and in_layer:
            # Megatron's full checkpointing: each layer keeps its output for the next layer;
            # the layer being recomputed holds its whole set once (costmodel/memory.py)
            act = boundary * count * live + kept
        else:
            act = kept * count * live
        # the backward's first working set beside everything kept: the loss's gradients of
        # the fp32 logits (memory.loss_grad_bytes, as the estimate adds it)
        for m in self.members[r]:
            node = self.g.node(m)
            if node.kind == OpKind.LOSS and node.inputs:
                ins = self.placed[m][a][0]
                act += loss_grad_bytes(node, self.g, 4, self.graph_inputs) * bf \
                    / (shard_factor(ins[0], mesh) if ins else 1)
        return compute * count, comm * count, act

    def _is_layer_output(self, name):
        layer = self.g.node(name).layer
        return any(self.g.node(u).layer != layer for u in self.g.users.get(name, ()))

    def _with_params(self, base, a, st, r, owned, owner, zero, dpa, count):
        """Add the owned parameters priced as ``estimate.parameter_part`` prices them under
        ZeRO ``zero`` over ``dpa``: memory, gradient sync, ZeRO gathers, the optimizer step;
        and the fixed charges (a flat buffer's latency, a block's ZeRO-3 gathers) they need."""
        compute, fixups, act = base  # per microbatch, already x count
        o, rt = self.o, self.runtime
        pbytes = gbytes = obytes = 0.0
        micro_comm = step_comm = optim_s = 0.0
        charges: dict = {}
        storage = []
        for p in owned:
            info = self.g.param_map[p]
            used = st.inputs[owner[p][1]]
            if P in used and not REPLICATE_TO_PARTIAL:
                return None  # a stored parameter cannot be read as Partial by the runtime
            stored = tuple(R if x == P else x for x in used)  # a bias read as P is stored whole
            out = self.placed[r][a][1]
            part = parameter_part(info, self._placement(stored),
                                  [(self._placement(out), self._placement(used))],
                                  self.layer_of[p], self.mesh, dpa, None, zero=zero,
                                  dtype=o.dtype, optimizer=o.optimizer, runtime=rt)
            if zero >= 3 and dpa is not None:
                stored = _zero_storage(stored, [dpa], info.shape, self.mesh) or stored
            storage.append(stored)
            pbytes += part.weights_bytes
            gbytes += part.grads_bytes
            obytes += part.optimizer_bytes
            optim_s += optimizer_step_s(part.optimizer_numel, 1, self.hw, dtype=o.dtype,
                                        optimizer=o.optimizer, contention=self.all_procs)
            mb, st_s, mine = self._sync_s(part.syncs, zero)
            micro_comm += mb
            step_comm += st_s
            for key, cost in mine.items():
                charges[key] = cost * (count * o.microbatches if key[0] == "zero3-unit" else 1)
        ins, out = zip(*(self.placed[m][a] for m in self.members[r]))
        mem = MemoryBreakdown(params_gib=pbytes * count / GIB, grads_gib=gbytes * count / GIB,
                              optimizer_gib=obytes * count / GIB, activations_gib=act / GIB)
        micro = compute + fixups + micro_comm * count
        step = (step_comm + optim_s) * count
        comm = (fixups + micro_comm * count) * o.microbatches + step_comm * count
        choice = GroupChoice(st, zero >= 3, micro, step, comm, mem, ins, out, tuple(storage),
                             zero=zero, dp_axis=dpa)
        return choice, list(charges.items())

    def _sync_s(self, syncs, zero):
        """(per microbatch, per step) seconds of gradient syncs and ZeRO gathers, as
        ``estimate._param_traffic_s`` prices them for the graph engine, less the latencies
        paid once per buffer or block: those come back as charges {key: seconds} (a block's
        per microbatch)."""
        o, rt, coll = self.o, self.runtime, self.coll
        micro = step = 0.0
        charges: dict = {}
        for s in syncs:
            if s.per_use:  # ZeRO-3 in the graph engine: per microbatch, per block
                sync, gather = per_use_sync_s(s, coll, recompute=o.recompute)
                micro += sync + gather
                if o.recompute == Recompute.NONE:
                    units = 2 if s.layer < 0 else 1  # the weights before and after the blocks
                    charges[("zero3-unit", s.axis, s.layer)] = units * sum(
                        zero3_unit_latency_s(coll, rt, s.axis))
                continue
            flat = rt.flat_grad_sync and zero <= 2
            traffic = [(s.kind, s.grad_bytes)]
            if s.on_dp and zero in (1, 2):  # the stepped shards gathered back
                traffic.append((Collective.ALL_GATHER, s.weight_bytes))
            for kind, nbytes in traffic:
                if flat:  # one buffer per (collective, axis): its latency charged once
                    step += _bandwidth_s(coll, kind, nbytes, s.axis)
                    charges[("flat", kind, s.axis)] = coll(kind, 1e-30, s.axis)
                else:
                    step += coll(kind, nbytes, s.axis)
        return micro, step, charges

    def _tied_sync_s(self, pname, owner_key, reader_key):
        """Per microbatch: what a tied weight's other reader adds to its gradient sync (an
        axis it splits that the owner's reader does not: ``estimate.parameter_walk`` reduces
        over the union of the readers' splits)."""
        read_o, owner_mask, zero, dpa = owner_key
        read_r, reader_mask = reader_key
        info = self.g.param_map[pname]
        stored = self._placement(tuple(R if x == P else x for x in read_o))
        owner = (self._placement(_mask_placement(owner_mask)), self._placement(read_o))
        reader = (self._placement(_mask_placement(reader_mask)), self._placement(read_r))
        times = []
        for outs in ([owner], [owner, reader]):
            part = parameter_part(info, stored, outs, self.layer_of[pname], self.mesh, dpa, None,
                                  zero=zero, dtype=self.o.dtype, optimizer=self.o.optimizer,
                                  runtime=self.runtime)
            micro, step, _ = self._sync_s(part.syncs, zero)
            times.append(micro + step / self.o.microbatches)
        return times[1] - times[0]

    def _flags_of(self, charges, groups):
        """Fixed charges and the stage-wide switches as flags; variants (ZeRO level, dp axis)
        conflict pairwise, and a ZeRO variant over axis d with a first input not split on d."""
        members: dict = {}
        costs: dict = {}
        for key, cost, va in charges:
            members.setdefault(key, []).append(va)
            costs[key] = cost
        keys = sorted(members, key=repr)
        flags = tuple(ilp.IlpFlag(repr(k), _units(costs[k]), tuple(members[k])) for k in keys)
        at = {k: i for i, k in enumerate(keys)}
        variants = [k for k in keys if k[0] == "variant"]
        axes = [k for k in keys if k[0] == "dp-axis"]
        conflicts = [(at[a], at[b]) for i, a in enumerate(variants) for b in variants[i + 1:]]
        conflicts += [(at[v], at[d]) for v in variants for d in axes
                      if v[1] > 0 and v[2] != d[1]]
        return flags, tuple(conflicts)

    # -- edges ---------------------------------------------------------------------------------
    def _edges(self, index, owner, param_rep, groups):
        counts: dict = {}
        for n in self.names:
            r = self.rep[n]
            if self.root.get(r) != r:
                continue
            for k, i in enumerate(self.g.node(n).inputs):
                if i in self.g.param_map:
                    pr = self._canonical(param_rep.get(i, i))
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
            # a consumer class: the placement it reads and which axes its output splits
            v_keys_list = [(c.strategy.inputs[k], _split_mask(c.member_outputs[0]))
                           for c in vg.candidates]
            v_keys = sorted(set(v_keys_list), key=repr)
            if isinstance(src, tuple):
                # a tied parameter's other reader: the estimate prices parameters' reads
                # through their gradient syncs only; a Partial read stays refused
                o_name, o_k = owner[src[1]]
                ug = groups[index[o_name]]
                u_out = [(c.strategy.inputs[o_k], _split_mask(c.member_outputs[0]), c.zero,
                          c.dp_axis) for c in ug.candidates]
                u_keys = sorted(set(u_out), key=repr)
                grad = self.g.param_map[src[1]].trainable
                cost = tuple(tuple(INF if refused(p[0], q[0]) else
                                   self._tied_sync_s(src[1], p, q) * cnt if grad else 0.0
                                   for q in v_keys) for p in u_keys)
                u = index[o_name]
            else:
                ug = groups[index[self.root[src]]]
                pos = ug.members.index(src)
                u_out = [c.member_outputs[pos] for c in ug.candidates]
                u_keys = sorted(set(u_out))
                cost = tuple(tuple(self._comm(src, node, p, q, _mask_placement(mask)) * cnt
                                   for q, mask in v_keys) for p in u_keys)
                u = index[self.root[src]]
            edges.append((u, index[r], tuple(u_keys.index(x) for x in u_out),
                          tuple(v_keys.index(x) for x in v_keys_list), cost))
        return edges


def _split_mask(out):
    return tuple(p != R for p in out)


def _mask_placement(mask):
    """An output placement with the same Replicate axes (all ``input_collectives`` reads)."""
    return tuple(0 if m else R for m in mask)


def _dp_axis(pl):
    """``estimate.dp_axis`` of a stage whose first input is placed ``pl``."""
    return next((ax for ax, p in enumerate(pl) if p == 0), None)


def _units(seconds: float) -> int:
    return int(round(seconds * NS))


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
