"""Sharding strategies of one operator on an N-D mesh, in DTensor's vocabulary.

trace -> cost -> **solve (strategies)** -> run. For every operator of the OpGraph this module
lists the ways its work can be split over the mesh: a ``Strategy`` maps the placement each
input is consumed in to the placement of the output, one entry per mesh axis, with
DTensor's placements encoded as ints (``R`` = Replicate, ``P`` = Partial, ``d >= 0`` =
Shard(d)). ``planner/intra.py`` prices the strategies and ``planner/ilp.py`` picks one.

How strategies are generated. Every rule describes the operator as an einsum over an
iteration space (``OpSpec``): each iteration dimension maps to one dimension of some of the
operands and of the output. A strategy gives each mesh axis one iteration dimension to split
(or none). Operands that hold that dimension are ``Shard``-ed on it, the others stay
``Replicate``; an output that lacks a split dimension (a contraction or a reduction) is
``Partial``. This is how DTensor's own rules are built for matmuls
(``torch.distributed.tensor._ops._einsum_strategy.gen_einsum_strategies``: batch, m, n or k
per mesh axis), and its pointwise, reduction, norm, softmax and embedding rules give the
same candidates; ``tests/test_strategies.py`` checks the matmul family against DTensor's
registered strategies on a fake process group. Dimensions DTensor refuses to split stay
unsplittable here (a normalised dimension, a softmax dimension, a loss's class dimension).

Project rules where DTensor has no registered strategy or where the runtime needs a
narrower one (listed as ``PROJECT_RULES``):
- ``scaled_dot_product_attention``: batch- and head-sharded only (CPU attention runs as its
  math decomposition; no sequence/context parallel candidates);
- ``cross_entropy_loss`` / ``nll_loss``: batch-sharded with a Partial (mean) output; the
  class dimension is never split (no loss-parallel);
- ``linear`` / ``matmul`` / ``einsum``: composite in DTensor (decomposed at dispatch); here
  priced as one einsum with the same per-axis candidates as their ``mm`` decomposition;
- ``rms_norm``: the same candidates as ``layer_norm``;
- ``batch_norm`` (training): replicated only, so its statistics are those of the global
  batch (an input split on the batch is all-gathered first, which the solver prices);
  DTensor's channel split is left out because the running statistics are stored replicated
  and updated in place;
- follower views (``view``/``reshape``/``transpose``/``permute``/``split``/...): the output
  placement follows the input's; a split of a sharded dimension the view cannot keep is first
  gathered (``Replicate``), as DTensor's view rule does.

Operators with no rule fall back to replication (the caller warns and records them).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace

from meshplan.placements import P, R, Placement
from meshplan.graph import OpGraph, OpKind, OpNode

PROJECT_RULES = ("aten.scaled_dot_product_attention", "aten.cross_entropy_loss",
                 "aten.nll_loss", "aten.linear", "aten.matmul", "aten.einsum",
                 "aten.rms_norm", "aten.batch_norm", "follower views")
# Batch normalisation in training (running statistics updated in place): replicated only.
BATCH_NORMS = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit_functional",
               "_native_batch_norm_legit", "instance_norm")


@dataclass(frozen=True, slots=True)
class OpSpec:
    """An operator as an einsum: ``operands[k][j]`` is the iteration dim of dim j of input k
    (None: never split, e.g. a broadcast size-1 dim); ``output`` the same for the output."""

    sizes: tuple[int, ...]  # size of each iteration dimension
    splittable: tuple[bool, ...]
    operands: tuple[tuple[int | None, ...] | None, ...]  # None: not a tensor operand
    output: tuple[int | None, ...]
    rule: str  # where the candidates come from, for explain
    addends: tuple[int, ...] = ()  # inputs added to the output (a bias): Partial where it is


@dataclass(frozen=True, slots=True)
class Strategy:
    """One candidate: per-axis placements of the inputs (node.inputs order) and the output."""

    inputs: tuple[Placement, ...]
    output: Placement
    split: tuple[int, ...]  # per mesh axis: the iteration dim it splits, or -1

    def work_split(self, mesh_shape: tuple[int, ...]) -> int:
        n = 1
        for axis, d in enumerate(self.split):
            if d >= 0:
                n *= mesh_shape[axis]
        return n


# -- parsing the traced node --------------------------------------------------------------------

def input_shapes(graph: OpGraph, node: OpNode) -> tuple[tuple[int, ...] | None, ...]:
    """Shape of each of ``node.inputs`` (a parameter, a graph input or a node's output)."""
    graph_inputs = dict(graph.inputs)
    out = []
    for name in node.inputs:
        if name in graph.param_map:
            out.append(graph.param_map[name].shape)
        elif name in graph_inputs:
            out.append(graph_inputs[name].shape)
        elif name in graph:
            out.append(tensor_of(graph, name, node).shape)
        else:
            out.append(None)
    return tuple(out)


def tensor_of(graph: OpGraph, producer: str, consumer: OpNode):
    """The TensorMeta ``consumer`` reads from ``producer`` (getitem picks one of several)."""
    prod = graph.node(producer)
    if len(prod.outputs) > 1 and consumer.target.endswith("getitem>"):
        args, _ = consumer.parsed_args()
        idx = args[1] if len(args) > 1 and isinstance(args[1], int) else 0
        return prod.outputs[idx]
    return prod.outputs[0]


# -- einsum specs per operator family -------------------------------------------------------------

_LETTERS = "abcdefghijlopqruvwxyz"  # batch-like letters; k, m, n, s, t reserved below


def _einsum(equation: str, shapes, out_shape, splittable: set[str] | None, rule: str) -> OpSpec | None:
    """Spec from an einsum equation whose operands are the node's inputs, in order. Size-1
    operand dims that broadcast against a larger iteration dim are never split."""
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",") if lhs or shapes else []
    if len(terms) != len(shapes) or len(out) != len(out_shape):
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        if shape is None or len(shape) != len(term):
            return None
        for c, s in zip(term, shape):
            sizes[c] = max(sizes.get(c, 1), s)
    for c, s in zip(out, out_shape):
        sizes[c] = max(sizes.get(c, 1), s)
    letters = list(sizes)
    index = {c: i for i, c in enumerate(letters)}

    def dims(term, shape):
        return tuple(index[c] if shape[j] == sizes[c] and sizes[c] > 1 else None
                     for j, c in enumerate(term))
    return OpSpec(sizes=tuple(sizes[c] for c in letters),
                  splittable=tuple(splittable is None or c in splittable for c in letters),
                  operands=tuple(dims(t, s) for t, s in zip(terms, shapes)),
                  output=dims(out, out_shape), rule=rule)


def _aligned(shape, full_letters: str) -> str:
    """Letters of a tensor broadcast (right-aligned) against ``full_letters``."""
    return full_letters[len(full_letters) - len(shape):] if shape else ""


def _broadcast_spec(shapes, out_shape, fixed_dims: set[int], rule: str) -> OpSpec | None:
    if len(out_shape) > len(_LETTERS) or any(s is None or len(s) > len(out_shape) for s in shapes):
        return None
    letters = _LETTERS[:len(out_shape)]
    eq = ",".join(_aligned(s, letters) for s in shapes) + "->" + letters
    ok = {c for i, c in enumerate(letters) if i not in fixed_dims}
    return _einsum(eq, shapes, out_shape, ok, rule)


def op_spec(graph: OpGraph, node: OpNode) -> OpSpec | None:
    """The einsum spec of an anchor operator, or None when no rule covers it."""
    if node.out is None or len(node.outputs) != 1:
        return None
    shapes = input_shapes(graph, node)
    out = node.out.shape
    args, kwargs = node.parsed_args()
    n_tensor = sum(1 for a in args if a == "%") + sum(
        1 for a in args if isinstance(a, list) for x in a if x == "%")
    if n_tensor != len(node.inputs):
        return None  # a tensor passed twice: positions are ambiguous, replicate
    op = node.target.rsplit(".", 1)[0]
    name = op.removeprefix("aten.")
    if name in BATCH_NORMS:
        # Statistics over the whole batch (SyncBatchNorm's semantics): the batch and spatial
        # dims are never split. DTensor could split channels, but the running statistics
        # are stored replicated and updated in place; a channel shard would update a copy.
        return OpSpec(sizes=tuple(out), splittable=(False,) * len(out),
                      operands=(None,) * len(node.inputs), output=tuple(range(len(out))),
                      rule="meshplan:batch_norm (global statistics, replicated)")
    if name in ("mm", "bmm", "addmm", "baddbmm"):
        core = {"mm": "mk,kn->mn", "addmm": "mk,kn->mn", "bmm": "bmk,bkn->bmn",
                "baddbmm": "bmk,bkn->bmn"}[name]
        if name in ("addmm", "baddbmm"):
            outl = core.split("->")[1]
            core = _aligned(shapes[0], outl) + "," + core
        spec = _einsum(core, shapes, out, None, f"dtensor:aten.{name}")
        return replace(spec, addends=(0,)) if spec and name in ("addmm", "baddbmm") else spec
    if name == "linear":
        batch = _LETTERS[:len(shapes[0]) - 1]
        eq = f"{batch}k,nk" + (",n" if len(shapes) > 2 else "") + f"->{batch}n"
        spec = _einsum(eq, shapes, out, None, "meshplan:linear (as addmm)")
        return replace(spec, addends=(2,)) if spec and len(shapes) > 2 else spec
    if name == "matmul" and len(shapes) == 2 and shapes[1] is not None and len(shapes[1]) == 2:
        batch = _LETTERS[:len(shapes[0]) - 1]
        return _einsum(f"{batch}k,kn->{batch}n", shapes, out, None, "meshplan:matmul (as mm)")
    if name == "matmul" and len(shapes) == 2 and len(shapes[0]) == len(shapes[1]) >= 3:
        batch = _LETTERS[:len(shapes[0]) - 2]
        return _einsum(f"{batch}mk,{batch}kn->{batch}mn", shapes, out, None,
                       "meshplan:matmul (as bmm)")
    if name == "einsum" and args and isinstance(args[0], str) and "." not in args[0]:
        return _einsum(args[0], shapes, out, None, "meshplan:einsum")
    if name == "scaled_dot_product_attention" and len(shapes) >= 3:
        heads_kv = "h" if shapes[1][1] == shapes[0][1] else "g"
        terms = ["bhsd", f"b{heads_kv}td", f"b{heads_kv}td"]
        if len(shapes) > 3:
            terms.append(_aligned(shapes[3], "bhst"))
        return _einsum(",".join(terms) + "->bhsd", shapes, out, {"b", "h"},
                       "meshplan:sdpa (batch/head)")
    if name == "embedding":
        idx = _LETTERS[:len(shapes[1])]
        return _einsum(f"vk,{idx}->{idx}k", shapes, out, None, "dtensor:aten.embedding")
    if name in ("layer_norm", "rms_norm"):
        ns = args[1] if len(args) > 1 and isinstance(args[1], list) else [out[-1]]
        letters = _LETTERS[:len(out)]
        norm = letters[len(out) - len(ns):]
        terms = [letters] + [norm] * (len(shapes) - 1)
        return _einsum(",".join(terms) + "->" + letters, shapes, out,
                       set(letters) - set(norm), f"dtensor:aten.{name}" if name == "layer_norm"
                       else "meshplan:rms_norm (as layer_norm)")
    if node.kind == OpKind.SOFTMAX:
        dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
        return _broadcast_spec(shapes, out, {dim % len(out)}, f"dtensor:{op}")
    if node.kind == OpKind.LOSS:
        logits = _LETTERS[:len(shapes[0])]
        target = logits[0] + logits[2:]
        kept = logits[0] + logits[2:] if len(out) else ""
        if len(shapes) != 2 or shapes[1] is None or len(shapes[1]) != len(target):
            return None
        return _einsum(f"{logits},{target}->{kept}", shapes, out, set(target),
                       "meshplan:cross_entropy (batch)")
    if node.kind == OpKind.REDUCTION and len(shapes) == 1:
        return _reduction_spec(name, shapes[0], out, args, kwargs, op)
    if is_pointwise(node) or (node.kind == OpKind.VIEW and name in ("cat", "stack")):
        fixed = set()
        if name in ("cat", "stack"):
            if name == "stack" or not args or not isinstance(args[0], list):
                return None
            fixed = {(args[1] if len(args) > 1 else 0) % len(out)}
            shapes = tuple(tuple(s if i not in fixed else out[i] for i, s in enumerate(sh))
                           for sh in shapes)  # every piece splits like the output off the cat dim
        return _broadcast_spec(shapes, out, fixed, f"dtensor:{op}")
    return None


_LINEAR_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min")


def _reduction_spec(name, shape, out, args, kwargs, op) -> OpSpec | None:
    letters = _LETTERS[:len(shape)]
    if len(shape) > len(_LETTERS):
        return None
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if name == "cumsum":
        d = dims % len(shape)
        return _einsum(f"{letters}->{letters}", (shape,), out, set(letters) - {letters[d]},
                       f"dtensor:{op}")
    if dims is None or dims == []:
        reduced = set(range(len(shape)))
    else:
        reduced = {d % len(shape) for d in ([dims] if isinstance(dims, int) else dims)}
    keepdim = (args[2] if len(args) > 2 else kwargs.get("keepdim", False)) is True
    out_letters = "".join(c if i not in reduced else ("Z" if keepdim else "")
                          for i, c in enumerate(letters))
    if len(out_letters) != len(out):
        return None
    ok = set(letters) if name in _LINEAR_REDUCTIONS else set(letters) - {
        letters[d] for d in reduced}
    spec = _einsum(f"{letters}->{out_letters}", (shape,), out, ok | {"Z"}, f"dtensor:{op}")
    return spec


# -- enumerating strategies --------------------------------------------------------------------

def enumerate_strategies(spec: OpSpec, mesh_shape: tuple[int, ...]) -> tuple[Strategy, ...]:
    """Every assignment of mesh axes to splittable iteration dims that divides evenly."""
    choices = [-1] + [d for d, ok in enumerate(spec.splittable) if ok and spec.sizes[d] > 1]
    out: list[Strategy] = []
    for split in itertools.product(choices, repeat=len(mesh_shape)):
        factor: dict[int, int] = {}
        for axis, d in enumerate(split):
            if d >= 0:
                factor[d] = factor.get(d, 1) * mesh_shape[axis]
        if any(spec.sizes[d] % f for d, f in factor.items()):
            continue
        output = _place(spec.output, split, partial=True)
        inputs = tuple(_place(dims, split) if dims is not None else (R,) * len(split)
                       for dims in spec.operands)
        if spec.addends and P in output:  # a bias joins a partial sum once, as Partial
            inputs = tuple(tuple(P if o == P else p for p, o in zip(pl, output))
                           if k in spec.addends else pl for k, pl in enumerate(inputs))
        out.append(Strategy(inputs=inputs, output=output, split=split))
    return tuple(out)


def _place(dims: tuple[int | None, ...], split: tuple[int, ...], partial: bool = False) -> Placement:
    pl = []
    for d in split:
        if d < 0:
            pl.append(R)
        elif d in dims:
            pl.append(dims.index(d))
        else:
            pl.append(P if partial else R)
    return tuple(pl)


def replicated_strategy(node: OpNode, ndim: int) -> Strategy:
    return Strategy(inputs=tuple((R,) * ndim for _ in node.inputs), output=(R,) * ndim,
                    split=(-1,) * ndim)


def tensor_placements(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[Placement, ...]:
    """All Replicate/Shard placements of a tensor that divide evenly (sources: graph inputs)."""
    choices = [R] + [d for d, s in enumerate(shape) if s > 1]
    out = []
    for pl in itertools.product(choices, repeat=len(mesh_shape)):
        factor: dict[int, int] = {}
        for axis, d in enumerate(pl):
            if d >= 0:
                factor[d] = factor.get(d, 1) * mesh_shape[axis]
        if all(shape[d] % f == 0 for d, f in factor.items()):
            out.append(tuple(pl))
    return tuple(out)


# -- followers: views and unary elementwise ops ------------------------------------------------

# Pointwise operators (DTensor registers them with its pointwise rule): every output element
# depends on the same element of each (broadcast) input, so any dim may be split.
POINTWISE = re.compile(
    r"aten\.(add|sub|rsub|mul|div|true_divide|pow|neg|exp|exp2|expm1|log|log1p|log2|tanh|"
    r"sigmoid|silu|gelu|relu|relu6|leaky_relu|elu|selu|mish|hardtanh|hardswish|hardsigmoid|"
    r"softplus|dropout|native_dropout|where|masked_fill|eq|ne|lt|le|gt|ge|__and__|__or__|"
    r"bitwise_and|bitwise_or|bitwise_not|logical_and|logical_or|logical_not|rsqrt|sqrt|abs|"
    r"clamp|clamp_min|clamp_max|erf|sin|cos|reciprocal|square|sign|maximum|minimum|lerp|"
    r"addcmul|addcdiv|fill|copy|type_as|_to_copy|to|clone|alias|detach|contiguous|"
    r"zeros_like|ones_like|full_like|isnan|isinf|nan_to_num)\.")
_RESHAPES = ("view", "_unsafe_view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze")


def is_pointwise(node: OpNode) -> bool:
    return bool(POINTWISE.match(node.target))


_P_PRESERVING = re.compile(r"aten\.(neg|mul|div|to|_to_copy|clone|alias|detach|contiguous|view|"
                           r"_unsafe_view|reshape|transpose|t|permute|unsqueeze|squeeze|flatten|"
                           r"unflatten|expand|movedim)\.")


def keeps_partial(node: OpNode) -> bool:
    """Linear unary ops (scaling, views, casts) map Partial to Partial."""
    return bool(_P_PRESERVING.match(node.target)) or node.target.endswith("getitem>")


def follow(node: OpNode, in_shape: tuple[int, ...], pl: Placement,
           mesh_shape: tuple[int, ...]) -> tuple[Placement, Placement]:
    """(placement the follower consumes, placement it produces) given its producer's ``pl``.

    Axes the operator cannot carry through are first turned into Replicate (gathered or
    reduced), as DTensor's view and pointwise rules redistribute them.
    """
    out_shape = node.out.shape if node.out is not None else ()
    dim_map = _dim_map(node, in_shape, out_shape)
    fixed, result = list(pl), []
    counts: dict[int, int] = {}
    for axis, p in enumerate(pl):
        if p == P and not keeps_partial(node):
            fixed[axis] = R
        elif p >= 0:
            target = dim_map.get(p) if dim_map is not None else None
            if target is None:
                fixed[axis] = R
            else:
                counts[target] = counts.get(target, 1) * mesh_shape[axis]
    for axis, p in enumerate(fixed):
        if p >= 0:
            t = dim_map[p]
            result.append(t if out_shape[t] % counts[t] == 0 else R)
            if result[-1] == R:
                fixed[axis] = R
        else:
            result.append(p)
    return tuple(fixed), tuple(result)


def _dim_map(node: OpNode, in_shape, out_shape) -> dict[int, int] | None:
    """Input dim -> output dim for the dims a sharding may stay on."""
    name = node.target.rsplit(".", 1)[0].removeprefix("aten.")
    args, _ = node.parsed_args()
    n_in = len(in_shape)
    if node.kind != OpKind.VIEW or name in ("clone", "alias", "detach", "contiguous", "to",
                                            "_to_copy") or node.target.endswith("getitem>"):
        if node.kind != OpKind.VIEW and not is_pointwise(node):
            return None
        return {d: d for d in range(n_in)} if tuple(in_shape) == tuple(out_shape) else None
    if name in ("transpose", "t"):
        if name == "t":
            a, b = 0, n_in - 1
        else:
            a, b = args[1] % n_in, args[2] % n_in
        m = {d: d for d in range(n_in)}
        m[a], m[b] = b, a
        return m
    if name == "permute":
        perm = [d % n_in for d in args[1]]
        return {src: dst for dst, src in enumerate(perm)}
    if name in ("slice", "narrow", "split", "split_with_sizes", "chunk"):
        dim = (args[1] if len(args) > 1 and isinstance(args[1], int) else 0)
        if name in ("split", "split_with_sizes", "chunk"):
            dim = args[2] if len(args) > 2 else 0
        dim %= max(n_in, 1)
        return {d: d for d in range(n_in) if d != dim or in_shape[d] == out_shape[d]}
    if name == "select":
        dim = args[1] % n_in
        return {d: (d if d < dim else d - 1) for d in range(n_in) if d != dim}
    if name == "expand":
        off = len(out_shape) - n_in
        return {d: d + off for d in range(n_in) if in_shape[d] == out_shape[d + off]}
    if name in _RESHAPES:
        return _reshape_map(in_shape, out_shape)
    if name == "view_as_complex":  # (..., n, 2) real -> (..., n) complex: the pair dim goes
        return {d: d for d in range(n_in - 1)}
    if name == "view_as_real":  # (..., n) complex -> (..., n, 2) real
        return {d: d for d in range(n_in)}
    return None


def _reshape_map(in_shape, out_shape) -> dict[int, int]:
    """Reshape: a sharded input dim stays sharded on the output dim that starts its group."""
    m: dict[int, int] = {}
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == 1 and (out_shape[j] != 1):
            i += 1
            continue
        if out_shape[j] == 1 and in_shape[i] != 1:
            j += 1
            continue
        gi, gj = [i], [j]
        a, b = in_shape[i], out_shape[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(in_shape):
                    return m
                a *= in_shape[i]
                gi.append(i)
            else:
                j += 1
                if j >= len(out_shape):
                    return m
                b *= out_shape[j]
                gj.append(j)
        m[gi[0]] = gj[0]
        i, j = i + 1, j + 1
    return m
