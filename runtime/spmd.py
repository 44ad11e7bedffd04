"""The per-stage SPMD executor: graph fragment + DeviceMesh + planned placements -> callable.

trace -> cost -> solve -> plan -> **run**. One stage of a plan is an fx graph (the exported
training graph, or the fragment of it a pipeline stage owns) executed by an
``fx.Interpreter`` on DTensor values. Before each planned operator every DTensor argument is
redistributed to the placement the plan gives that input (``stage.ops[node].inputs[i]``), so
the plan is executed as written rather than as DTensor would choose; DTensor's
differentiable ``redistribute`` gives the matching collective in the backward pass (an
all-gather of a sharded parameter before use becomes a reduce-scatter of its gradient).

Recompute wraps each transformer block's node range in ``torch.utils.checkpoint``
(non-reentrant): ``full`` recomputes the whole block, ``selective`` saves the outputs of the
parameter matmuls and recomputes the rest (attention scores, softmax, pointwise ops), the
split of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", Sec. 5). Mixed precision runs the fragment under ``torch.autocast``: master weights
stay fp32, matmuls run in bf16/fp16.

That DTensor interpretation is the reference. By default the executor runs it once, on its
first call and without gradients, to build a lowered program (runtime/lowering.py): the same
operators on local shards, with each redistribution (planned, or DTensor-internal) as one
collective whose backward is its exact adjoint. Every call after that replays the lowered
program, which costs what hand-written tensor parallelism or FSDP costs
(benchmarks/runtime_overhead.py).

The pipeline runtime (runtime/pipeline.py) builds one ``SPMDExecutor`` per stage submesh.
"""

from __future__ import annotations

import re
from contextlib import nullcontext
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard  # private: no public name
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from meshplan.errors import NotSupportedError
from meshplan.runtime import context, lowering
from meshplan.runtime.pipeline_split import writes_in_place, written_attrs

try:  # non-reentrant checkpoint stops a recomputation early by raising this
    from torch.utils.checkpoint import _StopRecomputationError
except ImportError:  # pragma: no cover - older torch
    class _StopRecomputationError(Exception):
        pass
from meshplan.placements import parse_placement
from meshplan.plan import OpPlacement

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Operators whose outputs `selective` recompute keeps: the matmuls of parameter layers
# (linear/Conv1D lower to mm/addmm). Attention's bmm, softmax and pointwise ops are
# recomputed (Korthikanti et al. 2022, Sec. 5).
_SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def to_placements(texts: Sequence[str], mesh: DeviceMesh | None = None) -> list:
    """Plan strings ("R", "P", "S(d)") -> DTensor placements. With ``mesh``, a Shard on a
    one-rank mesh axis becomes Replicate: the rank holds the whole dim either way, but
    DTensor's view rules refuse to flatten or squeeze a sharded dim (a microbatch of one
    sequence "S(0)" on a dp axis of size 1 reshaped by a linear), so a plan that shards on
    a one-rank axis would crash at step 1."""
    out = []
    for axis, text in enumerate(texts):
        kind, dim = parse_placement(text)
        if kind == "S" and mesh is not None and mesh.size(axis) == 1:
            kind = "R"
        out.append(Replicate() if kind == "R" else Partial() if kind == "P" else Shard(dim))
    return out


def placement_texts(placements) -> tuple[str, ...]:
    """DTensor placements -> plan strings. A ``_StridedShard`` (what flattening a dim
    sharded on a later mesh axis gives, torch 2.13: not a Shard subclass) is "S(d)": read
    as "R" it hid a sharded value from the planned redistribution (Phi-3's logits reached
    the loss row-sharded on tp, and nll_loss refused the uneven rows)."""
    out = []
    for p in placements:
        if isinstance(p, (Shard, _StridedShard)):
            out.append(f"S({p.dim})")
        elif isinstance(p, Partial):
            out.append("P")
        else:
            out.append("R")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of graph nodes executed together; ``layer`` >= 0 marks a transformer block."""

    nodes: tuple[fx.Node, ...]
    layer: int = -1
    inputs: tuple[fx.Node, ...] = ()  # defined before the segment, read inside it
    outputs: tuple[fx.Node, ...] = ()  # defined inside, read after it


def block_index(node: fx.Node, block_prefix: str) -> int:
    """The repeated-block index of ``node`` from its module stack (-1 outside blocks)."""
    if not block_prefix:
        return -1
    pattern = re.compile(re.escape(block_prefix) + r"\.(\d+)(\.|$)")
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        m = pattern.match(path)
        if m:
            return int(m.group(1))
    return -1


def split_segments(gm: fx.GraphModule, block_prefix: str) -> list[Segment]:
    """Consecutive nodes grouped by block; each block's external inputs and outputs found."""
    groups: list[tuple[int, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        layer = block_index(node, block_prefix) if node.op == "call_function" else -1
        if groups and groups[-1][0] == layer:
            groups[-1][1].append(node)
        else:
            groups.append((layer, [node]))
    segments = []
    for layer, nodes in groups:
        inside = set(nodes)
        ins = {a: None for n in nodes for a in n.all_input_nodes if a not in inside}
        outs = {n: None for n in nodes if any(u not in inside for u in n.users)}
        segments.append(Segment(tuple(nodes), layer, tuple(ins), tuple(outs)))
    return segments


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_IN_SELECTIVE \
        else CheckpointPolicy.PREFER_RECOMPUTE


def _nested_shard(t) -> bool:
    """One tensor dim other than the first sharded over two or more mesh axes (the batch dim
    may be: it survives the flatten to 2-D that these operators do)."""
    dims = [p.dim for p in t.placements if isinstance(p, Shard) and p.dim != 0]
    return len(dims) != len(set(dims))


def check_executable(n: fx.Node, args) -> None:
    """Fail fast, naming the node, on placements DTensor hangs or fails on (torch 2.13):
    found by tests/harness/strategy_check.py on every planner rule."""
    if n.target is torch.ops.aten.embedding.default and isinstance(args[0], DTensor):
        vocab_axes = [i for i, p in enumerate(args[0].placements) if p == Shard(0)]
        ids = args[1]
        # ids sharded on a mesh axis after the vocab axis: the reduction's mask is the wrong
        # shape (found by tests/harness/strategy_check.py); before it (batch on dp, vocab on tp) works
        late_ids = isinstance(ids, DTensor) and vocab_axes and any(
            isinstance(p, Shard) and i > vocab_axes[0] for i, p in enumerate(ids.placements))
        if len(vocab_axes) > 1 or late_ids:
            raise NotSupportedError(
                f"operator {n.name} (embedding): a vocab-sharded (S(0)) table on mesh axes "
                f"{vocab_axes} with ids {placement_texts(getattr(ids, 'placements', ()))}; "
                "DTensor's masked embedding needs one vocab axis and ids sharded only on "
                "earlier mesh axes. Replicate the table or the ids on the other axes")
    if n.target in (torch.ops.aten.linear.default, sdpa_target()) and any(
            isinstance(a, DTensor) and a.ndim > 2 and _nested_shard(a) for a in args):
        raise NotSupportedError(
            f"operator {n.name} ({n.target}): an input has one dim sharded over several mesh "
            "axes, which DTensor cannot flatten for this operator (torch 2.13); shard that dim "
            "on one axis")


def sdpa_target():
    from meshplan.runtime.parallelize import sdpa_math
    return sdpa_math


@dataclass
class ExecStats:
    """What the executor did: redistributions it inserted and outputs off the plan."""

    redistributions: int = 0
    output_deviations: dict = field(default_factory=dict)  # node -> (planned, actual)
    observed: dict = field(default_factory=dict)  # node -> OpPlacement DTensor ran it with
    lowered: int = 0  # operators the lowered program runs on local shards
    on_dtensor: list = field(default_factory=list)  # operators it leaves on DTensor


class SPMDExecutor(fx.Interpreter):
    """Runs ``gm`` on ``mesh`` realising ``ops`` (node name -> OpPlacement) exactly.

    Call it with the fragment's inputs (DTensors, or plain tensors to be distributed with
    ``input_placements``); parameters are read from ``gm`` (reparametrise it with DTensor
    parameters first, see runtime/parallelize.py). Plain tensors created inside the graph
    become Replicate DTensors as they are made.
    """

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, ops: dict[str, OpPlacement], *,
                 input_placements: Sequence[Sequence[str]] = (), recompute: str = "none",
                 block_prefix: str = "", dtype: str = "fp32", record: bool = False,
                 lowered: bool = True):
        super().__init__(gm)
        if recompute not in ("none", "selective", "full"):
            raise NotSupportedError(f"recompute={recompute!r}; the runtime knows none, "
                                    "selective and full")
        if dtype not in COMPUTE_DTYPES:
            raise NotSupportedError(f"dtype={dtype!r}; the runtime knows {list(COMPUTE_DTYPES)}")
        self.mesh = mesh
        self.ops = ops
        self.input_placements = [to_placements(p, mesh) for p in input_placements]
        self.recompute = recompute
        self.compute_dtype = COMPUTE_DTYPES[dtype]
        self.segments = split_segments(gm, block_prefix) if recompute != "none" else \
            [Segment(tuple(gm.graph.nodes))]
        written = set(written_attrs(gm.graph, gm)) if recompute != "none" else set()
        for seg in self.segments:
            writer = next((n for n in seg.nodes if seg.layer >= 0 and n.op == "call_function"
                           and writes_in_place(n.target)
                           and any(a in written for a in n.all_input_nodes)), None)
            if writer is not None:
                raise NotSupportedError(
                    f"recompute={recompute!r} re-runs operator {writer.name} ({writer.target}), "
                    "which updates buffers in place (BatchNorm's running statistics would be "
                    "updated twice); plan this model with recompute='none'")
        self.stats = ExecStats()
        self.record = record
        # a context-parallel axis reads "S(d)" as the load-balanced layout (runtime/context.py),
        # which the lowered program does not know: such stages run on DTensor
        self.cp_axis = context.cp_axis_of(mesh)
        self.lowered = lowered and self.cp_axis is None
        self.steps: dict | None = None  # node -> lowering.Step, built by the first call
        self.block_prefix = block_prefix
        self.hoisted: dict = {}  # get_attr node -> (src, dst): gathered once per call
        self.bucket_of: dict = {}  # get_attr node -> (mesh axis, nodes gathered together)
        self._gathered: dict = {}
        self._frees = None  # node -> values it reads last (_last_uses)
        self._regather = None  # the saved-tensor hooks of the current replay (_Regather)
        self.specs: dict = {}  # node -> DTensorSpec structure of its value
        self._building = False  # the first call is running the reference to lower it
        self.leaves = lowering.ParamLeaves()  # parameters as plain local autograd leaves
        self.constant: set = set()  # nodes computed from shapes and buffers only
        self.folded: dict = {}  # constant node read by a non-constant one -> its local value
        self._folded_from: list = []  # (weak buffer, version) the folded values come from
        self._local_out = False  # run_local: outputs stay local shards
        self._collecting = False  # this call computes the constants (and folds them)

    # -- one node ------------------------------------------------------------------------
    def run_node(self, n: fx.Node):
        try:
            return self._run_node(n)
        except (NotSupportedError, _StopRecomputationError):
            raise
        except Exception as exc:  # noqa: BLE001 - name the operator that failed
            args = [placement_texts(self.env[a].placements) if isinstance(self.env.get(a), DTensor)
                    else "-" for a in n.all_input_nodes]
            raise RuntimeError(f"operator {n.name} ({n.target}) with input placements {args} "
                               f"failed: {type(exc).__name__}: {exc}") from exc

    def _run_node(self, n: fx.Node):
        if n.op != "call_function":
            out = super().run_node(n)
            if self._building:
                self.specs[n] = lowering.spec_tree(out)
            return out
        plan = self.ops.get(n.name)
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            moved = {a: self._planned(n, a, i, self.env[a], plan)
                     for i, a in enumerate(n.all_input_nodes)}
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), moved.__getitem__)
            if plan is not None:
                check_executable(n, args)
            recorder = lowering.Recorder() if self._building else None
            written = self._written_buffers(n, moved) if self._building else {}
            before = {a: t.clone() for a, t in written.items()}
            if recorder is None:
                out = self.call_function(n.target, args, kwargs)
            else:
                with recorder:
                    out = self.call_function(n.target, args, kwargs)
            updates = {a: (before[a], t.clone()) for a, t in written.items()}
        if self.record:
            self._observe(n, moved, out)
        if plan is not None and isinstance(out, DTensor) and plan.output and \
                placement_texts(out.placements) != tuple(plan.output):
            self.stats.output_deviations[n.name] = (tuple(plan.output),
                                                    placement_texts(out.placements))
        settled = self._settle(out)
        if self._building:
            self._lower(n, moved, args, kwargs, settled, recorder.calls if settled is out else None,
                        updates={a: (written[a], *u) for a, u in updates.items()})
        return settled

    def _written_buffers(self, n: fx.Node, moved: dict) -> dict:
        """Buffers ``n`` updates in place (BatchNorm's running statistics) -> their local
        tensors. The update must land in the stored buffer, so a plan that redistributes
        one first (its copy would be updated and dropped) is refused."""
        if n.op != "call_function" or not writes_in_place(n.target):
            return {}
        out = {}
        for a in n.all_input_nodes:
            value = self.env.get(a)
            if a.op != "get_attr" or not isinstance(value, DTensor) or value.requires_grad:
                continue
            if moved[a] is not value:
                raise NotSupportedError(
                    f"operator {n.name} ({n.target}) updates buffer {a.target} in place, but "
                    f"the plan moves it from {list(placement_texts(value.placements))} to "
                    f"{list(placement_texts(moved[a].placements))}, which would update a copy; "
                    "plan this input in its stored placement (R)")
            out[a] = value._local_tensor
        return out

    def _settle(self, out):
        if isinstance(out, DTensor) and any("MaskPartial" in type(p).__name__
                                            for p in out.placements):
            # A vocab-parallel embedding's partial output carries its lookup mask, which DTensor
            # (torch 2.13) cannot reduce after a later op (a dtype cast) or reduce-scatter:
            # reduce it here, where it is made; consumers planned to take "P" take "R".
            out = out.redistribute(self.mesh, [Replicate() if isinstance(p, Partial) else p
                                               for p in out.placements])
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.dim() > 0:
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim,
                                     run_check=False)
        return out

    def _observe(self, n: fx.Node, args: dict, out) -> None:
        def texts(v):
            return placement_texts(v.placements) if isinstance(v, DTensor) else ()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.stats.observed[n.name] = OpPlacement(
            inputs=tuple(texts(args[a]) for a in n.all_input_nodes), output=texts(first))

    def _planned(self, n: fx.Node, arg: fx.Node, i: int, value, plan: OpPlacement | None):
        if plan is None or not isinstance(value, DTensor) or i >= len(plan.inputs) or \
                not plan.inputs[i]:
            return value
        current = placement_texts(value.placements)
        # R -> P is DTensor-internal (an addend such as a bias joining a partial sum once):
        # keep R there and let the operator's own strategy make it Partial.
        target = tuple("R" if t == "P" and c == "R" else t for t, c in zip(plan.inputs[i], current))
        target = placement_texts(to_placements(target, self.mesh))  # one-rank axes: R
        if current == target:
            return value
        try:
            self.stats.redistributions += 1
            if self.cp_axis is not None and current[self.cp_axis] != target[self.cp_axis]:
                return context.move_cp(value, current, target, self.cp_axis, to_placements)
            return value.redistribute(self.mesh, to_placements(target, self.mesh))
        except Exception as exc:  # noqa: BLE001 - name the node and the placements
            raise NotSupportedError(
                f"operator {n.name} ({n.target}): cannot redistribute input {arg.name} from "
                f"{list(placement_texts(value.placements))} to the planned {list(target)}: "
                f"{exc}. 'P' targets are only reachable from 'P' or 'R'") from None

    # -- lowering: the first call builds the local program (runtime/lowering.py) -----------
    def _lower(self, n: fx.Node, moved: dict, args, kwargs, out, calls, *,
               updates: dict) -> None:
        moves = {a: (self.env[a]._spec, v._spec) for a, v in moved.items()
                 if isinstance(v, DTensor) and v is not self.env[a]}
        step = lowering.Step(n, moves, lowering.spec_tree(out))
        self.specs[n] = step.out_spec
        self.steps[n] = step
        target = n.target
        mutable = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        specs = pytree.tree_leaves(step.out_spec, is_leaf=lambda x: x is None)
        ok = not mutable and target not in lowering.KEEP_ON_DTENSOR and all(
            lowering.plain(p) for spec in specs if spec is not None for p in spec.placements)
        # Every attempt's verdict is agreed by the mesh before the next: all ranks then try
        # the same attempts and issue the same collectives (a lookup outside a rank's vocab
        # shard fails on some ranks only).
        if ok:
            kind = "aten" if lowering.aten_step(step, n, args, kwargs) else "call"
            # a composite run whole on local shards cannot partition or reduce inside
            # itself; where DTensor's decomposition does, only the recorded one is exact
            if kind == "call" and calls and lowering.partitions_or_reduces(calls):
                ok, step.why = False, "call: DTensor partitions or reduces inside it"
            else:
                ok = self._try_lowering(step, moved, out, kind, updates)
            if not ok and calls:
                recorded = lowering.record_steps(calls, moved, out)
                if recorded is not None:
                    step.subs, step.result = recorded
                    step.kind = "recorded"
                    ok = lowering.agree_across(self.mesh, [_same_updates(
                        updates, lambda: lowering.check_recorded(step, calls))])[0]
                    step.why = "" if ok else "its recorded decomposition differs from DTensor's"
        if not ok:
            step.kind = "dtensor"

    def _try_lowering(self, step, moved: dict, out, kind: str, updates: dict) -> bool:
        """Run ``step`` as ``kind`` on the reference's local inputs; True if it reproduces
        the reference's local output and its in-place buffer updates (``updates``)."""
        step.kind = kind
        if kind == "call":
            step.extra = lowering.broadcast_moves(step.node, moved, out)
        run = {"aten": lowering.run_aten, "call": lowering.run_call,
               "recorded": lowering.run_recorded}[kind]
        local = {a: lowering.local_tree(v) for a, v in moved.items()}
        try:  # moves come first in run(), so a local failure skips no collective
            ok = _same_updates(updates, lambda: lowering.agrees(run(step, local.__getitem__), out))
            step.why = "" if ok else f"its local result ({kind}) differs from DTensor's"
        except Exception as exc:  # noqa: BLE001 - the local call does not reproduce DTensor
            ok = False
            step.why = f"{kind}: {type(exc).__name__}: {exc}"
        return lowering.agree_across(self.mesh, [ok])[0]

    def build(self, *inputs) -> None:
        """Run the reference once (no grad) and lower every operator it can."""
        self.steps, self.specs, self._building = {}, {}, True
        # the reference run (and each lowering attempt) updates the running statistics; the
        # replay that follows this build is the call's one update
        saved = [(t, t.clone()) for t in self._buffers_written()]
        # and draws random numbers (dropout): the replay draws them again from the same state,
        # so a seeded run does not depend on when the executor was built
        devices = [] if self.mesh.device_type == "cpu" else [torch.cuda.current_device()]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                self._run_reference(*inputs, checkpointed=False)
        finally:
            self._building = False
            with torch.no_grad():
                for t, value in saved:
                    t.copy_(value)
        self._hoist()
        self.constant = constant_nodes(self.module)
        self.stats.on_dtensor = [s.node.name for s in self.steps.values() if s.kind == "dtensor"]
        self.stats.lowered = len(self.steps) - len(self.stats.on_dtensor)

    def _buffers_written(self) -> list[torch.Tensor]:
        """Local tensors of the buffers some operator of the graph updates in place."""
        out = []
        for g in written_attrs(self.module.graph, self.module):
            value = self.fetch_attr(g.target)
            if isinstance(value, torch.Tensor) and not value.requires_grad:
                out.append(value._local_tensor if isinstance(value, DTensor) else value)
        return out

    def _hoist(self) -> None:
        """Parameters every consumer gathers the same way (ZeRO-3) are gathered once, and
        the parameters first used by one transformer block share one collective (and one
        reduce-scatter of their gradients), as FSDP's per-block units do. Not under
        recompute, which re-gathers inside each block instead."""
        self.hoisted, self.bucket_of = {}, {}
        if self.recompute != "none":
            return
        nodes = list(self.module.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        in_block = [order[n] for n in nodes if n.op == "call_function" and
                    block_index(n, self.block_prefix) >= 0]
        first_block = min(in_block) if in_block else len(nodes)
        groups: dict = {}
        for g in nodes:
            spec = self.specs.get(g)
            if g.op != "get_attr" or not isinstance(spec, DTensorSpec) or not g.users:
                continue
            users = list(g.users)
            moves = {self.steps[u].moves.get(g) if u in self.steps else None for u in users}
            if len(moves) != 1 or None in moves:
                continue
            (src, dst), = moves
            self.hoisted[g] = (src, dst)
            for u in users:
                del self.steps[u].moves[g]
            self.specs[g] = dst
            axis = lowering.bucket_axis(src, dst)
            if axis is not None:
                first = min(users, key=order.get)
                layer = block_index(first, self.block_prefix)
                where = layer if layer >= 0 else ("pre" if order[first] < first_block else "post")
                groups.setdefault((where, axis, src.placements, dst.placements), []).append(g)
        for (_, axis, _, _), members in groups.items():
            if len(members) > 1:
                for m in members:
                    self.bucket_of[m] = (axis, members)

    def _value(self, a: fx.Node):
        """A node's local value as its consumers take it (hoisted gathers done once)."""
        if a not in self.hoisted:
            return self.env[a]
        if a not in self._gathered:
            shards = self._shards(a)
            gathered = self._gather(a, shards)
            self._gathered.update(gathered)
            if self._regather is not None:
                self._regather.register(gathered, shards)
        return self._gathered[a]

    def _shards(self, a: fx.Node) -> list:
        """The local shards ``_gather`` reads for ``a``'s bucket (kept by the regather hooks:
        the module's attributes are the parameters only while the call runs)."""
        if a in self.bucket_of:
            return [self.leaves.local(self.fetch_attr(m.target)) for m in self.bucket_of[a][1]]
        return [self.env[a]]

    def _gather(self, a: fx.Node, shards: list) -> dict:
        """ZeRO-3: the full parameter(s) of ``a``'s bucket (one collective per bucket)."""
        if a in self.bucket_of:
            axis, members = self.bucket_of[a]
            return dict(zip(members, lowering.gather_bucket(self.mesh, axis, shards)))
        return {a: lowering.move(shards[0], *self.hoisted[a])}

    def _last_uses(self) -> dict:
        """node -> the values whose last reader it is (graph order), so the replay drops
        each value (and each gathered ZeRO-3 parameter) as soon as nothing needs it."""
        if self._frees is None:
            last = {}
            for n in self.module.graph.nodes:
                for a in n.all_input_nodes:
                    last[a] = n
            self._frees = {}
            for a, n in last.items():
                self._frees.setdefault(n, []).append(a)
        return self._frees

    # -- the whole fragment ---------------------------------------------------------------
    def run(self, *inputs):
        if not self.lowered or self.record:
            return self._run_reference(*inputs)
        if self.steps is None:
            self.build(*inputs)
        return self._run_lowered(*inputs)

    def _autocast(self):
        return torch.autocast(self.mesh.device_type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype is not None)

    def _run_reference(self, *inputs, checkpointed: bool = True):
        inputs = [self._distribute(x, i) for i, x in
                  enumerate(self.module.graph.process_inputs(*inputs))]
        with implicit_replication(), self._autocast():
            self.env = {}
            self.args_iter = iter(inputs)
            return self._run_segments(self.run_node, checkpointed)

    def _run_lowered(self, *inputs):
        inputs = [self._distribute(x, i, comm=False) for i, x in
                  enumerate(self.module.graph.process_inputs(*inputs))]
        return self._replay(inputs)

    def run_local(self, *shards):
        """Replay the lowered program on local shards of the inputs (placed as the first
        call's inputs were); returns (local outputs, their DTensorSpec structure). Gradients
        cross this boundary as shards of the logical gradients (``lowering.from_shard`` /
        ``to_shard``). The first call must have been ``run`` (it builds the program)."""
        if self.steps is None:
            raise RuntimeError("run_local replays a lowered program: call run() first")
        inputs = [lowering.from_shard(x, self.specs[n]) if isinstance(self.specs.get(n),
                                                                     DTensorSpec) else x
                  for x, n in zip(shards, self.module.graph.find_nodes(op="placeholder"))]
        self._local_out = True
        try:
            out = self._replay(inputs)
        finally:
            self._local_out = False
        return out, fx.node.map_arg(self.module.graph.output_node().args[0], self.specs.get)

    def _replay(self, inputs):
        collect = self._collecting = self._fold_check()
        regather = self.hoisted and torch.is_grad_enabled()
        self._regather = _Regather(self) if regather else None
        hooks = torch.autograd.graph.saved_tensors_hooks(self._regather.pack,
                                                         self._regather.unpack) \
            if regather else nullcontext()
        with implicit_replication(), self._autocast(), hooks:
            self.env, self._gathered = {}, {}
            self.args_iter = iter(inputs)
            try:
                out = self._run_segments(self._replay_node, True)
            finally:
                self._gathered, self._collecting = {}, False
                if self._regather is not None:
                    self._regather.forward_done()
                self._regather = None
        if collect:
            self._fold_done()
        return out

    # -- constant folding: values made from shapes and buffers only ------------------------
    def _fold_sources(self) -> list:
        """(tensor, version, requires_grad) of every buffer the constants read."""
        out = []
        for g in self.module.graph.find_nodes(op="get_attr"):
            if g in self.constant:
                value = self.fetch_attr(g.target)
                if isinstance(value, torch.Tensor):
                    local = value._local_tensor if isinstance(value, DTensor) else value
                    out.append((local, local._version, value.requires_grad))
        return out

    def _fold_check(self) -> bool:
        """True if this call computes the constant values (first replay, or a buffer they
        are made from was replaced or written in place, e.g. by a checkpoint load); else
        the folded ones serve. A write through ``.data`` bumps no version: call
        ``refold()`` after one. A frozen parameter made trainable makes the constants be
        found again."""
        if not self.constant:
            return False
        now = self._fold_sources()
        if any(grad for _, _, grad in now):
            self.constant = constant_nodes(self.module)
            now = self._fold_sources()
        if self.folded and len(now) == len(self._folded_from) and all(
                ref() is t and v == version for (t, version, _), (ref, v) in
                zip(now, self._folded_from)):
            return False
        self.folded = {}
        return bool(self.constant)

    def refold(self) -> None:
        """Compute the folded constants again on the next call."""
        self.folded = {}

    def _fold_done(self) -> None:
        size = sum(v.numel() * v.element_size() for v in self.folded.values()
                   if isinstance(v, torch.Tensor))
        if size > FOLD_LIMIT_BYTES:  # not worth holding: compute them every call
            self.constant, self.folded = set(), {}
            return
        self._folded_from = [(weakref.ref(t), v) for t, v, _ in self._fold_sources()]

    def _run_segments(self, run_node, checkpointed: bool):
        try:
            return self._run_segments_once(run_node, checkpointed)
        finally:  # the executor outlives the call: keep no activation past it
            self.env, self.args_iter = {}, iter(())

    def _run_segments_once(self, run_node, checkpointed: bool):
        for seg in self.segments:
            if checkpointed and seg.layer >= 0 and self.recompute != "none":
                self._run_checkpointed(seg, run_node)
                continue
            frees = self._last_uses() if run_node == self._replay_node and \
                len(self.segments) == 1 else {}
            for node in seg.nodes:
                if node.op == "output":
                    value = self.fetch_args_kwargs_from_env(node)[0][0]
                    if run_node == self._replay_node and not self._local_out:
                        value = lowering.leave_tree(value, fx.node.map_arg(
                            node.args[0], lambda a: self.specs.get(a)))
                    return self.module.graph.process_outputs(value)
                self.env[node] = run_node(node)
                for a in frees.get(node, ()):  # nothing reads these again in this call
                    self.env.pop(a, None)
                    if self._gathered.pop(a, None) is not None and self._regather is not None:
                        self._regather.release(a)
        raise AssertionError("graph has no output node")

    def _replay_node(self, n: fx.Node):
        if n in self.constant:
            if not self._collecting:
                return self.folded.get(n)  # None for values only other constants read
            value = self._replay_one(n)
            if any(u not in self.constant for u in n.users):
                self.folded[n] = value.detach() if isinstance(value, torch.Tensor) else value
            return value
        return self._replay_one(n)

    def _replay_one(self, n: fx.Node):
        if n.op == "get_attr":
            return self.leaves.local(super().run_node(n))
        if n.op == "placeholder":
            return lowering.enter_tree(super().run_node(n))
        if n.op != "call_function":  # e.g. export's input guards: as the reference runs them
            saved = self.env
            self.env = {a: lowering.leave_tree(self._value(a), self.specs.get(a))
                        for a in n.all_input_nodes}
            try:
                return lowering.enter_tree(super().run_node(n))
            finally:
                self.env = saved
        step = self.steps[n]
        if step.moves:
            moved = {a: lowering.move(self._value(a), *step.moves[a]) if a in step.moves
                     else self._value(a) for a in n.all_input_nodes}
            value = moved.__getitem__
        else:  # the common case: inputs as they are (this runs once per node per call)
            value = self._value if self.hoisted else self.env.__getitem__
        try:
            if step.kind == "aten":
                return lowering.run_aten(step, value)
            if step.kind == "call":
                return lowering.run_call(step, value)
            if step.kind == "recorded":
                return lowering.run_recorded(step, value)
            moved = {a: value(a) for a in n.all_input_nodes}
            dt = {a: lowering.leave_tree(v, step.moves[a][1] if a in step.moves else self.specs[a])
                  for a, v in moved.items()}
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), dt.__getitem__)
            return lowering.enter_tree(self._settle(n.target(*args, **kwargs)), reduced=True)
        except (NotSupportedError, _StopRecomputationError):
            raise
        except Exception as exc:  # noqa: BLE001 - name the operator that failed
            raise RuntimeError(f"operator {n.name} ({n.target}) failed in the lowered program: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _distribute(self, x, i: int, comm: bool = True):
        if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
            return x
        placements = self.input_placements[i] if i < len(self.input_placements) else \
            [Replicate()] * self.mesh.ndim
        from torch.distributed.tensor import distribute_tensor
        # every rank holds the whole batch: the lowered program cuts its shard locally
        return distribute_tensor(x.to(self.mesh.device_type), self.mesh, placements,
                                 **({} if comm else {"src_data_rank": None}))

    def _run_checkpointed(self, seg: Segment, run_node) -> None:
        def block(*values):
            saved, self.env = self.env, dict(zip(seg.inputs, values))
            try:
                for node in seg.nodes:
                    self.env[node] = run_node(node)
                return tuple(self.env[o] for o in seg.outputs)
            finally:
                self.env = saved
        context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) \
            if self.recompute == "selective" else None
        kwargs = {"context_fn": context_fn} if context_fn else {}
        outs = checkpoint(block, *(self.env[i] for i in seg.inputs), use_reentrant=False,
                          **kwargs)
        self.env.update(zip(seg.outputs, outs))


class _Regather:
    """Saved-tensor hooks that keep ZeRO-3's gathered parameters out of what autograd saves:
    a saved tensor living in a gathered parameter's storage is packed as a ticket (which
    parameter, and the view's size, stride and offset) and gathered again when the backward
    unpacks it, one bucket at a time. So a block's full parameters live only while the block
    runs, forward or backward, as with FSDP's reshard-after-forward (Rajbhandari et al.
    2020, ZeRO stage 3); the backward pays a second all-gather per bucket, which the cost
    model prices (costmodel/estimate.py, ZeRO-3 gathers). Storages are matched by address
    only while the gathered tensor is alive (``release`` forgets it when it is dropped)."""

    def __init__(self, executor: "SPMDExecutor"):
        self.executor = executor
        self.by_storage: dict[int, tuple[fx.Node, int]] = {}  # storage address -> (node, -)
        self.live: dict[fx.Node, int] = {}
        self.shards: dict[fx.Node, list] = {}  # node -> the local shards its bucket gathers
        self.cache: tuple = (None, {})  # the last bucket gathered again in backward

    def register(self, gathered: dict, shards: list) -> None:
        for node, tensor in gathered.items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr:  # empty tensors have no storage to recognise
                self.by_storage[ptr] = (node, 0)
                self.live[node] = ptr
            self.shards[node] = shards

    def release(self, node: fx.Node) -> None:
        ptr = self.live.pop(node, None)
        if ptr is not None and self.by_storage.get(ptr, (None,))[0] is node:
            del self.by_storage[ptr]

    def forward_done(self) -> None:
        self.by_storage, self.live = {}, {}

    def pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or not self.by_storage:
            return t
        hit = self.by_storage.get(t.untyped_storage().data_ptr())
        if hit is None:
            return t
        return _Ticket(hit[0], tuple(t.size()), tuple(t.stride()), t.storage_offset(),
                       t.requires_grad)

    def unpack(self, packed):
        if not isinstance(packed, _Ticket):
            return packed
        key = self.executor.bucket_of.get(packed.node, (None, (packed.node,)))[1]
        if self.cache[0] != key:
            with torch.no_grad():
                self.cache = (key, self.executor._gather(packed.node, self.shards[packed.node]))
        base = self.cache[1][packed.node]
        return base.as_strided(packed.size, packed.stride, packed.offset)


@dataclass(frozen=True, slots=True)
class _Ticket:
    node: fx.Node
    size: tuple
    stride: tuple
    offset: int
    requires_grad: bool


def _same_updates(updates: dict, attempt) -> bool:
    """``attempt()`` (a lowering trial that may update buffers in place) run from the
    buffers as the reference found them; True if it also left them as the reference did.
    The buffers end as the reference left them. ``updates``: node -> (local tensor,
    before, after)."""
    with torch.no_grad():
        for t, before, _ in updates.values():
            t.copy_(before)
        try:
            ok = attempt()
            return ok and all(lowering.agrees(t, after) for t, _, after in updates.values())
        finally:
            for t, _, after in updates.values():
                t.copy_(after)


FOLD_LIMIT_BYTES = 256 * 2**20  # folded constants held beyond a call (masks, rotary tables)


def constant_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose values depend on no graph input and no trainable parameter (a causal
    mask, rotary cos/sin): runtime/pipeline_split.py's rule, with frozen parameters (the
    runtime's placed buffers) read as buffers. Call it where ``gm``'s attributes are the
    parameters the program runs with (inside the reparametrisation)."""
    from meshplan.runtime.pipeline_split import shape_only_nodes

    nodes = shape_only_nodes(gm.graph, frozen_params=True)
    return nodes | {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}


def stage_executor(gm: fx.GraphModule, mesh: DeviceMesh, stage, *, dtype: str = "fp32",
                   block_prefix: str = "", input_names: Sequence[str] = (),
                   lowered: bool = True) -> "SPMDExecutor":
    """The seam for runtime/pipeline.py: the executor running ``gm`` as ``stage`` plans it.

    ``stage`` is a meshplan.plan.Stage (its ops, inputs and recompute are read). Its ``run``
    takes the fragment's inputs (DTensors) and returns its outputs; once built, ``run_local``
    does the same on local shards. ``gm``'s attributes must be the DTensor parameters.
    """
    placements = [stage.inputs[name] for name in input_names if name in stage.inputs]

    executor = SPMDExecutor(gm, mesh, stage.ops, input_placements=placements,
                            recompute=stage.recompute, block_prefix=block_prefix, dtype=dtype,
                            lowered=lowered)
    return executor
