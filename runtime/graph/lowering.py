"""Lower a planned stage to local operators plus explicit collectives.

trace -> cost -> solve -> plan -> **run**. The reference executor (runtime/graph/spmd.py) runs
every operator of the traced graph on DTensor values, which is exact but pays DTensor's
dispatch (sharding propagation, wrapping, unwrapping) on every operator, forward and
backward: about 3x the step time of the same parallelism written by hand on CPU. This module
replays the same computation on plain local tensors:

1. **Setup, once per stage executor**: the reference executor runs the first call under
   ``no_grad`` and, at each operator, asks DTensor's own sharding propagator what it would
   do with the planned input placements: which inputs it would redistribute internally,
   which local arguments it would pass (view operators get local shapes), and what
   placement comes out. Operators DTensor decomposes (``aten.linear``), Python functions
   (attention's math form) and higher-order operators run as they are on the local shards.
   Every lowered operator's local result is compared with the reference's local shard, and
   the mesh agrees (an all-reduce of the verdicts) before anything is trusted; an operator
   that disagrees on any rank, a random operator, or one that needs DTensor's stateful
   placements (a vocab-parallel embedding's mask) keeps running on DTensor.
2. **Replay, every call**: local operators on local shards; each redistribution, planned
   or DTensor-internal, is one ``_Move`` (the same collective DTensor would issue).

Gradients follow from one rule: local autograd differentiates the SPMD program exactly, so
each collective's backward is its exact adjoint (all-gather <-> reduce-scatter, all-reduce
<-> all-reduce). The gradient a rank holds for a local value is then a *representation* of
the logical gradient with placements ``grad_placements(p)``: a replicated value's gradient
is a partial sum over the ranks that hold copies, a shard's is the shard of the gradient,
a partial sum's is replicated (an average's, replicated and divided by the group size).
At the boundary (parameters, stage inputs and outputs, operators left on DTensor) values
and gradients convert to and from DTensor with these placements, so the rest of the runtime
(gradient sync, ZeRO, pipelining) sees the DTensor gradients it always saw.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.utils._python_dispatch import TorchDispatchMode

_DISPATCHER = DTensor._op_dispatcher

# Operators DTensor handles with per-call state or special handlers: never lowered.
KEEP_ON_DTENSOR = set(_DISPATCHER._random_ops) | set(_DISPATCHER._custom_op_handlers)


def plain(p) -> bool:
    """Placements the lowered program carries: Shard, Replicate, Partial sum/avg."""
    return type(p) in (Shard, Replicate) or (type(p) is Partial and p.reduce_op in ("sum", "avg"))


def grad_placements(spec: DTensorSpec) -> tuple[tuple, float]:
    """How a rank's local gradient of a value placed as ``spec`` represents the logical
    gradient: (placements, scale), local = scale * (a local shard under placements)."""
    out, scale = [], 1.0
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Replicate):
            out.append(Partial("sum"))
        elif isinstance(p, Partial):
            out.append(Replicate())
            if p.reduce_op == "avg":
                scale /= spec.mesh.size(axis)
        else:
            out.append(p)
    return tuple(out), scale


def _with(spec: DTensorSpec, placements, dtype) -> DTensorSpec:
    """``spec`` with other placements and dtype; when the shards are the same (only
    Replicate and Partial swapped), the order in which mesh axes shard a dim is kept."""
    placements = tuple(placements)
    meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, dtype)
    if all(a == b or not (isinstance(a, Shard) or isinstance(b, Shard))
           for a, b in zip(spec.placements, placements)):
        strided = spec.use_strided_shard_as_shard_order
        return DTensorSpec(spec.mesh, placements, tensor_meta=meta,
                           shard_order=None if strided else spec.shard_order,
                           use_strided_shard_as_shard_order=strided)
    return DTensorSpec(spec.mesh, placements, tensor_meta=meta)


def reshard(x: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    """``redistribute_local_tensor`` that also goes Shard -> Partial: the shard zero-padded
    to the full dim (no communication) where one mesh axis shards that dim, else through
    Replicate."""
    if src.placements == dst.placements:
        return x
    placements = list(src.placements)
    for axis, (s, d) in enumerate(zip(src.placements, dst.placements)):
        if type(s) is Shard and type(d) is Partial and d.reduce_op == "sum" and \
                sum(isinstance(p, Shard) and p.dim == s.dim for p in placements) == 1:
            x = _zero_pad(x, src, axis, s.dim)
            placements[axis] = Partial("sum")
    if tuple(placements) != tuple(src.placements):
        src = _with(src, placements, x.dtype)
        if tuple(placements) == tuple(dst.placements):
            return x
    mid = tuple(Replicate() if isinstance(s, Shard) and isinstance(d, Partial) else s
                for s, d in zip(src.placements, dst.placements))
    if mid != tuple(src.placements):
        mid_spec = _with(src, mid, x.dtype)
        x = redistribute_local_tensor(x, _with(src, src.placements, x.dtype), mid_spec)
        src = mid_spec
    return redistribute_local_tensor(x, _with(src, src.placements, x.dtype),
                                     _with(dst, dst.placements, x.dtype))


def _zero_pad(x: torch.Tensor, spec: DTensorSpec, axis: int, dim: int) -> torch.Tensor:
    """This rank's shard of ``dim`` (sharded on mesh ``axis`` only) inside zeros of the full
    dim: a Partial(sum) whose sum over the axis is the whole tensor."""
    full = spec.tensor_meta.shape[dim]
    coord = spec.mesh.get_coordinate()[axis]
    _, offset = Shard.local_shard_size_and_offset(full, spec.mesh.size(axis), coord)
    shape = list(x.shape)
    shape[dim] = full
    out = x.new_zeros(shape)
    out.narrow(dim, offset, x.shape[dim]).copy_(x)
    return out


def convert_grad(g: torch.Tensor, of: DTensorSpec, to: DTensorSpec) -> torch.Tensor:
    """A gradient held for a value placed as ``of`` re-represented for placement ``to``
    (the same logical gradient: this is what a redistribution's backward does)."""
    pa, sa = grad_placements(of)
    pb, sb = grad_placements(to)
    if sa != 1.0:
        g = g / sa
    g = reshard(g, _with(of, pa, g.dtype), _with(to, pb, g.dtype))
    return g * sb if sb != 1.0 else g


class _Move(torch.autograd.Function):
    """A redistribution of a local shard; backward is its exact adjoint."""

    @staticmethod
    def forward(ctx, x, src, dst):
        ctx.src, ctx.dst = src, dst
        return redistribute_local_tensor(x, src, dst)

    @staticmethod
    def backward(ctx, g):
        return convert_grad(g, ctx.dst, ctx.src), None, None


class _Enter(torch.autograd.Function):
    """DTensor -> its local shard; the gradient goes back as a DTensor (grad_placements).
    ``reduced``: a replicated value's gradient goes back reduced (Replicate, not Partial),
    for DTensor operators whose backward accepts no partial gradient (a masked embedding)."""

    @staticmethod
    def forward(ctx, dt, reduced=False):
        ctx.spec, ctx.reduced = dt._spec, reduced
        local = dt._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        placements, scale = grad_placements(ctx.spec)
        if scale != 1.0:
            g = g / scale
        spec = _with(ctx.spec, placements, g.dtype)
        if ctx.reduced:
            settled = _with(ctx.spec, [Replicate() if isinstance(p, Partial) else p
                                       for p in placements], g.dtype)
            g, spec = reshard(g, spec, settled), settled
        # DTensor's own backward ops assume the (contiguous) strides of the forward spec
        return DTensor(g.contiguous(), spec, requires_grad=False), None


class _Leave(torch.autograd.Function):
    """Local shard -> DTensor with ``spec``; a DTensor gradient comes back as a local one."""

    @staticmethod
    def forward(ctx, x, spec):
        ctx.spec = spec
        return DTensor(x.view_as(x), _with(spec, spec.placements, x.dtype),
                       requires_grad=x.requires_grad)

    @staticmethod
    def backward(ctx, g):
        if not isinstance(g, DTensor):  # a plain tensor gradient is the replicated one
            g = DTensor(g, _with(ctx.spec, [Replicate()] * ctx.spec.mesh.ndim, g.dtype),
                        requires_grad=False)
        placements, scale = grad_placements(ctx.spec)
        local = reshard(g._local_tensor, g._spec, _with(ctx.spec, placements, g.dtype))
        return (local * scale if scale != 1.0 else local), None


class ParamLeaves:
    """Each trainable DTensor parameter's local shard as a plain autograd leaf (sharing its
    storage), so the lowered program reads parameters with no autograd function and local
    autograd accumulates their gradients as plain tensors. After each accumulation a hook
    moves the local gradient into ``param.grad``, a DTensor with the placements
    ``grad_placements`` gives (a replicated parameter's gradient is a partial sum), which is
    what the rest of the runtime (gradient sync, ZeRO, pipelining) reads: the same gradient
    ``_Enter`` hands back, without a DTensor operation per parameter per microbatch."""

    def __init__(self):
        self._leaves: dict = {}  # id(param) -> (weak param, weak local tensor, leaf)

    def local(self, p):
        """The value the lowered program reads for a fetched parameter or buffer. (The
        DTensor parameter itself is then not in the autograd graph: ``torch.autograd.grad``
        with respect to it, or hooks on it, see nothing; ``.grad`` is filled as before.)"""
        if not isinstance(p, DTensor):
            return p
        if not p.requires_grad:
            return p._local_tensor
        if not p.is_leaf:  # a computed weight: its gradient flows on to what it came from
            return _Enter.apply(p)
        held = self._leaves.get(id(p))
        if held is not None and held[0]() is p and held[1]() is p._local_tensor:
            return held[2]
        placements, scale = grad_placements(p._spec)
        if scale != 1.0:  # parameters are never Partial; keep the rule exact if one is
            return _Enter.apply(p)
        leaf = p._local_tensor.detach().requires_grad_(True)
        leaf.register_post_accumulate_grad_hook(
            _grad_to_param(weakref.ref(p), _with(p._spec, placements, p.dtype)))
        key = id(p)
        self._leaves[key] = (weakref.ref(p), weakref.ref(p._local_tensor), leaf)
        weakref.finalize(p, self._leaves.pop, key, None)  # a replaced parameter is let go
        return leaf


def _grad_to_param(ref, spec: DTensorSpec):
    """The hook moving a leaf's accumulated local gradient into its parameter's ``.grad``."""
    def hook(leaf):
        g, leaf.grad = leaf.grad, None
        param = ref()
        if param is None or g is None:
            return
        held = param.grad
        if held is None:
            param.grad = DTensor(g, spec if g.dtype == spec.tensor_meta.dtype else
                                 _with(spec, spec.placements, g.dtype), requires_grad=False)
        elif type(held) is DTensor and held._spec.placements == spec.placements and \
                held._local_tensor.shape == g.shape:
            held._local_tensor.add_(g)
        else:  # a gradient of other placements (zero_grad(set_to_none=False) after a sync)
            param.grad = held + DTensor(g, _with(spec, spec.placements, g.dtype),
                                        requires_grad=False)
    return hook


def _same(a, b, mesh) -> bool:
    """Placements that hold the same local values (any placement on a one-rank axis)."""
    return all(x == y or mesh.size(i) == 1 for i, (x, y) in enumerate(zip(a, b)))


class _Regrad(torch.autograd.Function):
    """Identity forward; backward re-represents the gradient: /pre, ``src`` -> ``dst``
    placements of ``spec``'s tensor, *post."""

    @staticmethod
    def forward(ctx, x, spec, src, dst, pre, post):
        ctx.args = spec, src, dst, pre, post
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        spec, src, dst, pre, post = ctx.args
        if pre != 1.0:
            g = g / pre
        g = reshard(g, _with(spec, src, g.dtype), _with(spec, dst, g.dtype))
        return (g * post if post != 1.0 else g), None, None, None, None, None


def _regrad(x, spec, src, dst, pre=1.0, post=1.0):
    if not isinstance(x, torch.Tensor) or not x.requires_grad or \
            (_same(src, dst, spec.mesh) and pre == 1.0 and post == 1.0):
        return x
    return _Regrad.apply(x, spec, tuple(src), tuple(dst), pre, post)


def _as_grad(placements) -> tuple:
    """The placements a local gradient crosses a boundary in: a partial value's gradient is
    replicated (as DTensor's ``from_local`` / ``to_local`` backward normalise it)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def from_shard(x: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """A received local shard of a value placed as ``spec`` into the lowered program: its
    gradient leaves as the shard of the logical gradient (what ``DTensor.from_local`` and
    ``_Enter`` give together)."""
    placements, scale = grad_placements(spec)
    return _regrad(x, spec, placements, _as_grad(spec.placements), pre=scale)


def to_shard(x: torch.Tensor, spec: DTensorSpec, *, grad_as=None) -> torch.Tensor:
    """A local value of the lowered program, placed as ``spec``, handed out as a local shard
    whose incoming gradient is the shard of the logical gradient under ``grad_as`` (default:
    ``spec``'s placements; a loss seeded as replicated: Replicate everywhere)."""
    placements, scale = grad_placements(spec)
    src = tuple(grad_as) if grad_as is not None else _as_grad(spec.placements)
    return _regrad(x, spec, src, placements, post=scale)


def to_planned_shard(x: torch.Tensor, spec: DTensorSpec, placements) -> torch.Tensor:
    """``to_shard`` after moving ``x`` to the planned ``placements`` where they differ."""
    placements = tuple(placements)
    if not _same(spec.placements, placements, spec.mesh):
        target = _with(spec, placements, x.dtype)
        x, spec = move(x, _with(spec, spec.placements, x.dtype), target), target
    return to_shard(x, spec)


def shard_of(x: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's shard of a tensor every rank holds whole (no communication)."""
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(x, mesh, placements, src_data_rank=None)._local_tensor


def leave(value, spec):
    """A local value back to a DTensor with ``spec`` (the inverse of ``_Enter``)."""
    if spec is None or not isinstance(value, torch.Tensor):
        return value
    return _Leave.apply(value, spec)


def enter_tree(value, reduced: bool = False):
    """``enter`` over a value that may be a tuple of DTensors (local values only)."""
    if isinstance(value, DTensor):
        return _Enter.apply(value, reduced)
    if isinstance(value, (tuple, list)):
        return type(value)(enter_tree(v, reduced) for v in value)
    return value


def leave_tree(value, spec):
    if isinstance(value, (tuple, list)) and isinstance(spec, (tuple, list)):
        return type(value)(leave_tree(v, s) for v, s in zip(value, spec))
    if isinstance(spec, DTensorSpec):
        return leave(value, spec)
    return value


def move(x: torch.Tensor, src: DTensorSpec, dst: DTensorSpec) -> torch.Tensor:
    return _Move.apply(x, src, dst)


def spec_tree(value):
    """The DTensorSpec structure of a reference output (None for non-DTensor leaves)."""
    if isinstance(value, DTensor):
        return value._spec
    if isinstance(value, (tuple, list)):
        return tuple(spec_tree(v) for v in value)
    return None


def local_tree(value):
    if isinstance(value, DTensor):
        return value._local_tensor
    if isinstance(value, (tuple, list)):
        return type(value)(local_tree(v) for v in value)
    return value


def agrees(local, ref) -> bool:
    """Whether a lowered operator's local result equals the reference's local shard."""
    if isinstance(ref, DTensor):
        ref = ref._local_tensor
    if isinstance(ref, torch.Tensor):
        if not isinstance(local, torch.Tensor) or isinstance(local, DTensor) or \
                local.shape != ref.shape or local.dtype != ref.dtype:
            return False
        if not local.dtype.is_floating_point:
            return torch.equal(local, ref)
        return bool(torch.allclose(local, ref, rtol=1e-4, atol=1e-5, equal_nan=True))
    if isinstance(ref, (tuple, list)):
        return isinstance(local, (tuple, list)) and len(local) == len(ref) and \
            all(agrees(a, b) for a, b in zip(local, ref))
    try:
        return bool(local == ref)
    except Exception:  # noqa: BLE001 - incomparable means not the same
        return False


@dataclass
class Step:
    """How one call_function node runs in the lowered program."""

    node: fx.Node
    moves: dict  # input node -> (src spec, dst spec): the plan's redistributions
    out_spec: object  # DTensorSpec structure of the output
    kind: str = "dtensor"  # "aten" (propagator's local call) | "call" (as is) |
    # "recorded" (DTensor's own decomposition, replayed) | "dtensor" (left on DTensor)
    flat: list = field(default_factory=list)  # aten: ("node", n, move|None) | ("const", v)
    tree_spec: object = None
    kwargs: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # call: input node -> implicit broadcast move
    subs: list = field(default_factory=list)  # recorded: the decomposition's SubSteps
    result: object = None  # recorded: where the output is among their values
    why: str = ""  # why a step stays on DTensor
    fast: object = None  # aten without moves: fast_aten's closure (made by the build)


def propagated_call(func, args, kwargs):
    """DTensor's local call of ``func`` on these (DTensor) arguments, from its own sharding
    propagator: (the args' tree spec, per flat argument ``("tensor", move or None)`` or
    ``("const", local value)`` (view operators get local shapes), trailing constants); None
    when DTensor has no strategy or uses a placement the lowered program does not carry."""
    try:
        info = _DISPATCHER.unwrap_to_op_info(func, args, kwargs)
        _DISPATCHER.sharding_propagator.propagate(info)
    except Exception:  # noqa: BLE001 - no strategy (a composite op, a decomposition)
        return None
    sharding = info.output_sharding
    if sharding is None:
        return None
    new, use_val = None, False
    if sharding.needs_redistribute:
        schema = sharding.redistribute_schema
        new = pytree.tree_leaves(schema.args_schema) if info.args_tree_spec \
            else schema.args_schema
        use_val = sharding.use_val_from_redistribute_schema
    entries = []
    for i, spec in enumerate(info.flat_args_schema):
        if isinstance(spec, DTensorSpec):
            target = new[i] if new is not None else spec
            if not all(plain(p) for p in (*spec.placements, *target.placements)):
                return None
            entries.append(("tensor", None if target == spec else (spec, target)))
        else:
            entries.append(("const", new[i] if use_val else info.local_args[i]))
    extra = list(new[len(entries):]) if use_val else []
    return info.args_tree_spec, entries, extra


def _flat(args, tree_spec) -> list:
    return pytree.tree_flatten(args)[0] if tree_spec else list(args)


def aten_step(step: Step, n: fx.Node, args, kwargs) -> bool:
    """Fill ``step`` with DTensor's local call for an aten operator; False if it has none."""
    op = n.target
    if not isinstance(op, torch._ops.OpOverload) or op in KEEP_ON_DTENSOR:
        return False
    call = propagated_call(op, args, kwargs)
    if call is None:
        return False
    tree_spec, entries, extra = call
    node_args = _flat(n.args, tree_spec)
    if len(node_args) != len(entries):
        return False
    flat = []
    for a, (kind, v) in zip(node_args, entries):
        if kind == "tensor" and not isinstance(a, fx.Node):
            return False
        flat.append(("node", a, v) if kind == "tensor" else ("const", v))
    flat.extend(("const", v) for v in extra)
    step.kind, step.flat, step.tree_spec = "aten", flat, tree_spec
    step.kwargs = dict(n.kwargs)
    return True


def run_aten(step: Step, value, mover=None) -> object:
    """Replay an aten step: ``value(node)`` gives the (planned-moved) local input;
    ``mover(node, x, (src, dst))`` redistributes it (default: ``move``)."""
    args = []
    for entry in step.flat:
        if entry[0] == "const":
            args.append(entry[1])
            continue
        x = value(entry[1])
        if entry[2] is not None:
            x = mover(entry[1], x, entry[2]) if mover else move(x, *entry[2])
        args.append(x)
    args = pytree.tree_unflatten(args, step.tree_spec) if step.tree_spec else tuple(args)
    kwargs = fx.node.map_aggregate(step.kwargs,
                                   lambda a: value(a) if isinstance(a, fx.Node) else a) \
        if step.kwargs else step.kwargs
    target = step.node.target
    # the local chain may hand a view a non-contiguous shard where DTensor's had a contiguous
    # one (strides of composite operators differ); reshape is view where it can be
    target = _VIEW_AS_RESHAPE.get(target, target)
    return target(*args, **kwargs)


_VIEW_AS_RESHAPE = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


class Recorder(TorchDispatchMode):
    """Records the aten calls a DTensor operator makes at the DTensor level (a composite
    operator's decomposition, a Python function's operators), with their DTensor values."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


@dataclass
class SubStep:
    """One recorded aten call: flat args are ("in", node) | ("val", index) | ("const", v),
    each tensor with an optional internal move; outputs fill values[index...]."""

    op: object
    flat: list
    tree_spec: object
    kwargs: dict
    n_out: int  # values this call defines (1, or the length of its tuple output)
    first: int  # index of its first value


def record_steps(calls: list, moved: dict, out) -> tuple[list, object] | None:
    """The recorded calls as SubSteps over local shards, and where the node's output is
    among their values; None when some call cannot be lowered."""
    where: dict[int, tuple] = {id(v): ("in", a) for a, v in moved.items()
                               if isinstance(v, torch.Tensor)}
    subs, count = [], 0
    for func, args, kwargs, result in calls:
        if func in KEEP_ON_DTENSOR or not isinstance(func, torch._ops.OpOverload) or \
                any(isinstance(v, DTensor) for v in kwargs.values()):
            return None
        if any(isinstance(a, DTensor) for a in pytree.tree_leaves(args)):
            call = propagated_call(func, args, kwargs)
            if call is None:
                return None
            tree_spec, entries, extra = call
            flat_args = _flat(args, tree_spec)
        else:  # plain tensors made inside the operator (a causal mask): run as they are
            flat_args, tree_spec = pytree.tree_flatten(args)
            entries, extra = [("const", a) for a in flat_args], []
        if len(flat_args) != len(entries):
            return None
        flat = []
        for a, (kind, v) in zip(flat_args, entries):
            if isinstance(a, torch.Tensor):
                ref = where.get(id(a))
                if ref is None:
                    if isinstance(a, DTensor):
                        return None  # a DTensor from outside the node
                    ref = ("const", a)
                flat.append((*ref, v if kind == "tensor" else None))
            else:
                flat.append(("const", v, None))
        flat.extend(("const", v, None) for v in extra)
        if func._schema.is_mutable and any(f[0] == "in" for f in flat):
            return None  # an in-place write to the node's input: replaying it twice is wrong
        outs = result if isinstance(result, (tuple, list)) else (result,)
        for k, o in enumerate(outs):
            if isinstance(o, DTensor) and not all(plain(p) for p in o.placements):
                return None
            if isinstance(o, torch.Tensor):
                where[id(o)] = ("val", count + k)
        subs.append(SubStep(func, flat, tree_spec,
                            {k: v for k, v in kwargs.items()}, len(outs), count))
        count += len(outs)

    def locate(o):
        if isinstance(o, (tuple, list)):
            found = [locate(x) for x in o]
            return None if any(f is None for f in found) else ("tuple", found)
        if isinstance(o, torch.Tensor):
            ref = where.get(id(o))
            return ref if ref is not None and ref[0] == "val" else None
        return ("const", o)
    result_ref = locate(out)
    return (subs, result_ref) if result_ref is not None else None


def partitions_or_reduces(calls: list) -> bool:
    """Whether DTensor's decomposition of a node (its recorded calls) moves a value into or
    out of ``Partial`` inside the node: a replicated bias joining a row-parallel matmul's
    partial sum is partitioned (``R -> P``: each rank adds ``b / n``). Running the composite
    operator itself on the local shards (a ``call`` step) adds the whole ``b`` on every rank
    instead, which the value check cannot see when ``b`` is zero (biases start at zero in
    BERT, GPT-J, nanoGPT) and which then doubles the bias gradient under tp=2; such nodes
    are replayed from their recorded decomposition, whose moves are exact."""
    for func, args, kwargs, _ in calls:
        if not any(isinstance(a, DTensor) for a in pytree.tree_leaves(args)):
            continue
        call = propagated_call(func, args, kwargs) if isinstance(func, torch._ops.OpOverload) \
            else None
        if call is None:
            continue
        for kind, v in call[1]:
            if kind == "tensor" and v is not None and any(
                    isinstance(a, Partial) != isinstance(b, Partial)
                    for a, b in zip(v[0].placements, v[1].placements)):
                return True
    return False


def run_recorded(step: Step, value) -> object:
    """Replay a recorded decomposition on local shards."""
    vals: list = []
    for sub in step.subs:
        args = []
        for kind, ref, mv in sub.flat:
            x = value(ref) if kind == "in" else vals[ref] if kind == "val" else ref
            if mv is not None:
                x = move(x, *mv)
            args.append(x)
        args = pytree.tree_unflatten(args, sub.tree_spec) if sub.tree_spec else tuple(args)
        op = _VIEW_AS_RESHAPE.get(sub.op, sub.op)
        out = op(*args, **sub.kwargs)
        vals.extend(out if sub.n_out > 1 or isinstance(out, (tuple, list)) else (out,))

    def build(ref):
        if ref[0] == "tuple":
            return tuple(build(r) for r in ref[1])
        return vals[ref[1]] if ref[0] == "val" else ref[1]
    return build(step.result)


def bucket_axis(src: DTensorSpec, dst: DTensorSpec) -> tuple[int, int] | None:
    """(mesh axis, tensor dim) of a parameter gather that can share one collective with
    others: Shard(dim) -> Replicate on exactly one mesh axis, the dim evenly divided and
    sharded by no other axis (other axes may shard other dims: a tensor-parallel weight's
    ZeRO-3 shard), else None."""
    diff = [i for i, (a, b) in enumerate(zip(src.placements, dst.placements)) if a != b]
    if len(diff) != 1:
        return None
    a = diff[0]
    p = src.placements[a]
    if type(p) is not Shard or not isinstance(dst.placements[a], Replicate) or \
            any(isinstance(q, Shard) and q.dim == p.dim for i, q in enumerate(src.placements)
                if i != a) or src.tensor_meta.shape[p.dim] % src.mesh.size(a):
        return None
    return a, p.dim


def _unstack(rows: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """n ranks' flat shards (``rows``: n x numel) as the tensor they cut along ``dim``."""
    n = rows.shape[0]
    full = rows.reshape(n, *shape)
    if dim:
        full = full.movedim(0, dim)
    return full.reshape(*shape[:dim], n * shape[dim], *shape[dim + 1:])


def _stack(g: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The adjoint of ``_unstack``: a full gradient as n rows of flat shards."""
    parts = g.reshape(*g.shape[:dim], n, g.shape[dim] // n, *g.shape[dim + 1:])
    if dim:
        parts = parts.movedim(dim, 0)
    return parts.reshape(n, -1)


class _BucketGather(torch.autograd.Function):
    """All-gather several shards in one collective (ZeRO-3 parameters of one block, each
    sharded along its own dim); backward reduce-scatters their gradients in one
    collective."""

    @staticmethod
    def forward(ctx, mesh, axis, dims, *shards):
        ctx.mesh, ctx.axis, ctx.dims = mesh, axis, dims
        ctx.shapes = [s.shape for s in shards]
        n = mesh.size(axis)
        flat = torch.cat([s.reshape(-1) for s in shards])
        full = flat.new_empty(n * flat.numel())
        dist.all_gather_single(full, flat, group=mesh.get_group(axis))
        rows, out, off = full.view(n, -1), [], 0
        for shape, dim in zip(ctx.shapes, dims):
            size = shape.numel()
            out.append(_unstack(rows[:, off:off + size], shape, dim))
            off += size
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        n = ctx.mesh.size(ctx.axis)
        # (autograd materializes an unused output's gradient as zeros of its dtype)
        parts = [_stack(g, n, dim) for g, dim in zip(grads, ctx.dims)]
        whole = torch.cat(parts, dim=1).reshape(-1)
        mine = whole.new_empty(whole.numel() // n)
        dist.reduce_scatter_single(mine, whole, group=ctx.mesh.get_group(ctx.axis))
        out, off = [], 0
        for shape in ctx.shapes:
            out.append(mine[off:off + shape.numel()].view(shape))
            off += shape.numel()
        return (None, None, None, *out)


def gather_bucket(mesh, axis: int, dims: tuple[int, ...], shards: list) -> tuple:
    return _BucketGather.apply(mesh, axis, tuple(dims), *shards)


def check_recorded(step: Step, calls: list) -> bool:
    """Each recorded call replayed on the recorded DTensors' local shards (every move is
    issued whatever the local results, so all ranks run the same collectives)."""
    ok = True
    for sub, (_, args, kwargs, result) in zip(step.subs, calls):
        flat_args = _flat(args, sub.tree_spec)
        local = []
        for (kind, ref, mv), a in zip(sub.flat, list(flat_args) + [None] * len(sub.flat)):
            x = a._local_tensor if isinstance(a, DTensor) else a if kind != "const" else ref
            if mv is not None:
                x = move(x, *mv)
            local.append(x)
        if not ok:
            continue
        try:
            args_l = pytree.tree_unflatten(local, sub.tree_spec) if sub.tree_spec \
                else tuple(local)
            ok = agrees(_VIEW_AS_RESHAPE.get(sub.op, sub.op)(*args_l, **sub.kwargs), result)
        except Exception:  # noqa: BLE001 - not reproduced locally
            ok = False
    return ok


def fast_aten(step: Step):
    """A closure replaying ``step`` (an aten step) with less per-call work than
    ``run_aten``, or None where its arguments need ``run_aten``'s general path: it calls
    the operator with the inputs in place (no redistribution, no nested argument lists, no
    node among the keyword arguments)."""
    if step.kind != "aten" or any(e[0] == "node" and e[2] is not None for e in step.flat):
        return None
    if step.tree_spec is not None and not _is_flat_tuple(step.tree_spec, len(step.flat)):
        return None
    if any(isinstance(v, fx.Node) for v in pytree.tree_leaves(step.kwargs)):
        return None
    target = _VIEW_AS_RESHAPE.get(step.node.target, step.node.target)
    kwargs = step.kwargs
    slots = tuple((e[0] == "node", e[1]) for e in step.flat)

    def run(value):
        return target(*[value(x) if is_node else x for is_node, x in slots], **kwargs)
    return run


def _is_flat_tuple(tree_spec, n: int) -> bool:
    """Whether ``tree_spec`` unflattens ``n`` leaves into the plain tuple of them."""
    try:
        leaves = list(range(n))
        return pytree.tree_unflatten(leaves, tree_spec) == tuple(leaves)
    except Exception:  # noqa: BLE001 - a spec of another arity
        return False


def run_call(step: Step, value, mover=None, causal=None) -> object:
    """Replay a call step: the node's own function, or its LOCAL_EQUIVALENT. ``causal(node,
    mask, q_len, kv_len)``, where given, says whether an attention's mask is the causal one:
    that call then passes ``is_causal=True`` and no mask, the kernel path an eager model
    without padding takes (the export materialized the mask; the result is the same)."""
    n = step.node
    if step.extra:
        plain_value = value

        def value(a):  # noqa: F811 - the inputs DTensor would have broadcast-sharded
            x = plain_value(a)
            if a not in step.extra:
                return x
            return mover(a, x, step.extra[a]) if mover else move(x, *step.extra[a])
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), value)
    target = LOCAL_EQUIVALENT.get(n.target, n.target)
    mask_node = attention_mask_node(step) if causal is not None else None
    if mask_node is not None:
        args, kwargs = _causal_attention(mask_node, args, kwargs, causal)
    return target(*args, **kwargs)


def constant_inputs(steps: dict) -> list:
    """(input node, move) of every redistributed input of an aten or call step: the moves
    a folded constant may need (``SPMDExecutor._prepare_constants``)."""
    out = []
    for step in steps.values():
        if step.kind == "aten":
            out += [(e[1], e[2]) for e in step.flat if e[0] == "node" and e[2] is not None]
        elif step.kind == "call":
            out += list(step.extra.items())
    return out


def attention_mask_node(step: Step) -> fx.Node | None:
    """The mask node of a call step that runs as ``scaled_dot_product_attention``."""
    if step.kind != "call" or \
            LOCAL_EQUIVALENT.get(step.node.target) is not F.scaled_dot_product_attention:
        return None
    n = step.node
    node = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    return node if isinstance(node, fx.Node) else None


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")


def _causal_attention(node: fx.Node, args, kwargs, causal):
    """sdpa's arguments with a causal constant mask (graph node ``node``) replaced by
    ``is_causal=True``."""
    bound = dict(zip(_SDPA_ARGS, args)) | dict(kwargs)
    mask = bound.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or \
            bound.get("is_causal") or bound.get("dropout_p", 0.0) or \
            not causal(node, mask, bound["query"].shape[-2], bound["key"].shape[-2]):
        return args, kwargs
    bound["attn_mask"], bound["is_causal"] = None, True
    return (), bound


def is_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether ``mask`` (boolean: True attends; or additive: 0 attends, a value at or below
    half the dtype's minimum masks) lets every query position attend exactly to the key
    positions at or before it, for every batch row and head: what ``is_causal=True`` does
    when queries and keys are equally long."""
    if q_len != kv_len or mask.ndim < 2 or tuple(mask.shape[-2:]) != (q_len, kv_len):
        return False
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, tril.expand_as(mask)))
    if not mask.dtype.is_floating_point:
        return False
    attends = mask == 0
    blocked = mask <= torch.finfo(mask.dtype).min / 2
    return bool(torch.equal(attends, tril.expand_as(mask))) and \
        bool(torch.equal(blocked, ~attends))


# Python functions the runtime substitutes for DTensor's sake, and what runs on local shards
# instead (local autograd needs no DTensor rule): attention's math form -> the fused kernel.
LOCAL_EQUIVALENT: dict = {}


def broadcast_moves(n: fx.Node, moved: dict, out) -> dict:
    """Replicated inputs DTensor shards implicitly when it broadcasts them against a sharded
    operand (a [batch, 1, s, s] mask beside batch-sharded scores): input node -> move."""
    if not isinstance(out, DTensor):
        return {}
    extra = {}
    for a, v in moved.items():
        if not isinstance(v, DTensor) or v.ndim == 0:
            continue
        lead = out.ndim - v.ndim
        target = list(v.placements)
        for axis, p in enumerate(out.placements):
            if isinstance(p, Shard) and isinstance(v.placements[axis], Replicate):
                d = p.dim - lead
                if 0 <= d < v.ndim and v.shape[d] == out.shape[p.dim] and v.shape[d] > 1:
                    target[axis] = Shard(d)
        if target != list(v.placements):
            extra[a] = (v._spec, _with(v._spec, target, v.dtype))
    return extra


def agree_across(mesh, flags: list[bool]) -> list[bool]:
    """Every flag true on every rank of ``mesh`` (MIN-reduced along each mesh axis)."""

    if not flags:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32,
                     device=mesh.device_type)
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.get_group(axis))
    return [bool(v) for v in t.tolist()]


def reduce_partial_grads(params: list) -> None:
    """Gradients that only need Partial(sum) -> Replicate to reach their parameter's
    placements are all-reduced together, one flat buffer per (mesh, placements, dtype), as
    DDP's buckets do; ``param.grad`` is replaced by the reduced DTensor. Others are left."""
    groups: dict = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or not isinstance(p, DTensor) or \
                tuple(g.placements) == tuple(p.placements):
            continue
        if all(a == b or (isinstance(a, Partial) and a.reduce_op == "sum" and
                          isinstance(b, Replicate))
               for a, b in zip(g.placements, p.placements)):
            key = (id(g.device_mesh), tuple(g.placements), tuple(p.placements), g.dtype)
            groups.setdefault(key, []).append(p)
    for members in groups.values():
        g0 = members[0].grad
        flat = torch.cat([p.grad._local_tensor.reshape(-1) for p in members])
        mesh = g0.device_mesh
        for axis, (a, b) in enumerate(zip(g0.placements, members[0].placements)):
            if a != b and mesh.size(axis) > 1:  # Partial(sum) -> Replicate: sum in place
                dist.all_reduce(flat, group=mesh.get_group(axis))
        off = 0
        for p in members:
            local = p.grad._local_tensor
            part = flat[off:off + local.numel()].view(local.shape)
            off += local.numel()
            p.grad = DTensor(part, DTensorSpec(p.device_mesh, tuple(p.placements),
                                               tensor_meta=p.grad._spec.tensor_meta),
                             requires_grad=False)
