"""What a ``torch.compile``d block keeps for its backward: AOTAutograd's min-cut partition.

trace -> **cost** -> solve -> plan -> run. Under ``torch.compile`` a block's forward and
backward are one joint graph that AOTAutograd splits in two
(``torch._functorch.partitioners.min_cut_rematerialization_partition``, inductor's default).
It saves the cheapest set of forward values from which the backward can recompute every
value it reads, as a minimum cut of a flow graph (networkx): each value is an edge of its
byte size; data dependencies, the backward's reads and the values that cannot be recomputed
are edges of infinite capacity. The kept bytes follow from that cut, not from the tensors
eager autograd saves (``memory.activation_profile``): a normalisation keeps its input and
its small ``rsqrt``, not its fp32 chain; a SwiGLU keeps its two matmul outputs and the
product, not the SiLU.

The flow graph here is built on the traced operators of one block with the partitioner's
rules as torch 2.13 states them (``solve_min_cut``, ``should_ban_recomputation``):

- the backward reads what eager autograd's derivative formulas read
  (``memory.saved_inputs``), a stand-in for the decomposed joint graph's reads;
- a value cannot be recomputed (an infinite edge from the source) where it is the output of
  a compute-intensive operator (matmul, attention), a block input or weight (primals), a
  reduction whose output is under a quarter of its inputs (``ban_recompute_reductions``), a
  value a matmul or attention reads in the backward (``ban_recompute_materialized_backward``:
  recomputing it would materialize it anyway), or an operator outside the partitioner's
  recomputable list (``ban_recompute_not_in_allowlist``, torch's own
  ``get_default_op_list``; an operator that decomposes before partitioning,
  ``CompositeImplicitAutograd``, is judged by what it is: ``cat``, ``embedding``,
  ``baddbmm`` are banned, ``layer_norm``, ``softmax`` are not);
- a dropout keeps its random mask, one byte an element, which cannot be recomputed; its
  output is recomputed from its input and the mask; a dropout of probability 0, like a
  cast to the dtype a value already has, is its input;
- weights and buffers cost nothing to save (``treat_parameters_as_free_to_save``), nor do
  values that depend on no input (a rotary table, a mask: the profile holds those once
  per stage, ``boundary[-1]``);
- a view is its base's storage (``memory.alias_root``, a copying reshape its own tensor).

Under selective activation checkpointing (``checkpoint`` with a policy, compiled after it as
torchtitan's ``apply_ac`` then ``apply_compile`` do) the policy's tags decide instead:
``MUST_SAVE`` values cannot be recomputed and every other value of the block must be
(``must_recompute``); the backward graph then reads only what it needs, so a saved output
the backward never reads (the block's last projection, whose only reader is the residual
add) is not kept, though eager SAC keeps it.

Left out: the partitioner's tie-breaking weights (values nearer the backward, values whose
users are all fusible, doubled) and its bans on recomputing far-apart or long fusible
chains, which pick between cuts rather than change what a cut costs in the blocks measured.
Identical blocks with the same value sizes share one cut (``_CUTS``): a search prices the
same block at many placements and microbatch counts.
Measured on this CPU with inductor and saved-tensor hooks: tests/test_compiled_memory.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

from meshplan.costmodel.kernel_paths import is_float, value_dtype
from meshplan.costmodel.memory import _dropout_p, alias_root, is_dropout, saved_inputs
from meshplan.graph import OpGraph, OpKind

_COMPUTE_INTENSIVE = (OpKind.MATMUL, OpKind.ATTENTION)
_CASTS = ("aten.to.", "aten._to_copy", "aten.type_as")
# (id(graph), block signature, relative sizes) -> (graph, the saved values' positions in the
# block's order); the graph is held so that its id is not reused while the entry lives
_CUTS: dict = {}


def compiled_saved(graph: OpGraph, names: Iterable[str], nbytes: Callable[..., float],
                   must_save: frozenset | set | None = None, cast: int = 0,
                   sizes: dict | None = None) -> dict[str, float]:
    """The values one compiled block keeps for its backward (storages: view roots; autocast
    copies ``"cast:<value>"``, dropout masks ``"mask:<dropout>"``) and their bytes.

    ``names``: the block's operators; ``nbytes(value, per=None, read=False)``: the bytes of a
    value (at ``per`` bytes an element if given, split as a matmul reads it if ``read``; a block input at the dtype the previous block hands
    over, a block value at the dtype eager PyTorch gives it, split and per microbatch as the
    profile counts them); ``must_save``: the operators a selective checkpointing policy tags
    ``MUST_SAVE`` (None: no checkpointing, the partitioner's own choice); ``cast``: under
    ``torch.autocast``, the bytes an element of the compute dtype (0 otherwise): a matmul or
    attention reads its own copy of a float input held wider (``sizes``), and that copy is
    what its backward reads; ``sizes``: bytes an element of each value
    (``eager.element_bytes``), to see such inputs and the casts that change nothing."""
    names = tuple(n for n in names if n in graph)
    key = (id(graph), names, frozenset(must_save) if must_save is not None else None,
           id(sizes), cast)
    hit = _STRUCTURES.get(key)
    if hit is None or hit[0] is not graph or hit[1] is not sizes:
        if len(_STRUCTURES) >= 4096:
            _STRUCTURES.clear()
        hit = _STRUCTURES[key] = (graph, sizes, _structure(graph, names, must_save, cast,
                                                           sizes))
    st = hit[2]
    if st is None:
        return {}
    costs = {}
    for v in st.order:
        if v.startswith("mask:"):
            costs[v] = float(nbytes(v[len("mask:"):], 1))
        elif v.startswith("cast:"):  # split as the matmul reads it (``read_split``)
            costs[v] = float(nbytes(v[len("cast:"):], cast, True))
        else:
            costs[v] = 0.0 if v in st.free else float(nbytes(v))
    top = max(costs.values(), default=0.0) or 1.0
    cut_key = (id(graph), st.signature, tuple(round(costs[v] / top, 9) for v in st.order))
    cut = _CUTS.get(cut_key)
    if cut is None or cut[0] is not graph:
        if len(_CUTS) >= 4096:
            _CUTS.clear()
        cut = _CUTS[cut_key] = (graph, frozenset(
            st.order.index(v) for v in _min_cut(st, costs)))
    return {st.order[i]: costs[st.order[i]] for i in cut[1]}


@dataclass(frozen=True)
class _Structure:
    """One block's flow graph without its byte sizes: the values in the order the block meets
    them (``order``), their data dependencies, how each enters the graph (``kinds``:
    "source", cannot be recomputed; "sink", must be; "": the cut decides), those the
    backward reads, those free to save, and a signature that names none of them (identical
    blocks share it)."""

    order: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]
    kinds: dict
    required: frozenset
    free: frozenset
    signature: tuple


_STRUCTURES: dict = {}


def _structure(graph: OpGraph, names: tuple[str, ...], must_save, cast: int,
               sizes: dict | None) -> _Structure | None:
    block = set(names)

    def root(value: str) -> str:
        seen = 0
        while seen < 64:
            value = alias_root(value, graph, copies=True)
            node = graph.node(value) if value in graph else None
            if node is None or not node.inputs:
                return value
            if is_dropout(node) and _dropout_p(node) == 0 or \
                    sizes is not None and node.target.startswith(_CASTS) \
                    and sizes.get(value) == sizes.get(node.inputs[0]):
                value = node.inputs[0]  # the very tensor it was given
                seen += 1
                continue
            return value
        return value

    produced = {root(n) for n in names if root(n) in block}
    made: dict[str, str] = {}  # "cast:"/"mask:" values -> the value each is made from

    def read(node, t: str) -> str:
        """The value ``node``'s backward reads for ``t``: its storage, autocast's copy of
        it, or a dropout's mask."""
        r = root(t)
        if is_dropout(node) and r == node.name:
            made[f"mask:{r}"] = node.inputs[0]
            return f"mask:{r}"
        if not cast or sizes is None or node.kind not in _COMPUTE_INTENSIVE \
                or t in graph.param_map or sizes.get(r, 0) <= cast \
                or not is_float(value_dtype(graph, r)):
            return r
        made[f"cast:{r}"] = r
        return f"cast:{r}"

    required: set[str] = set()
    materialized: set[str] = set()
    for name in names:
        node = graph.node(name)
        reads = [read(node, t) for t in saved_inputs(node, graph)]
        required.update(reads)
        if node.kind in _COMPUTE_INTENSIVE:
            materialized.update(reads)
    required.discard("")
    if not required:
        return None
    params = set(graph.param_map)
    graph_inputs = {name for name, _ in graph.inputs}
    saved_tag = {root(n) for n in must_save} if must_save is not None else None

    order: dict[str, int] = {}  # values numbered in the order the block meets them
    edges: list[tuple[str, str]] = []  # data dependencies between values
    for name in names:
        node = graph.node(name)
        r = root(name)
        for i in node.inputs:
            ri = root(i)
            order.setdefault(ri, len(order))
            if ri != r:
                edges.append((ri, r))
        order.setdefault(r, len(order))
    for key, src in made.items():
        order.setdefault(root(src), len(order))
        order.setdefault(key, len(order))
        if key.startswith("mask:"):  # the dropout's output is remade from input and mask
            edges.append((key, key[len("mask:"):]))
        else:  # autocast's copy, made from its source
            edges.append((root(src), key))

    def kind(v: str) -> str:
        if v.startswith("mask:"):
            return "source"  # random: never recomputed
        if v.startswith("cast:"):
            return "sink" if saved_tag is not None else "source"  # read back by a matmul
        if v not in produced:
            return "source"  # a primal: a block input, a weight, a buffer
        if saved_tag is not None:
            return "source" if v in saved_tag else "sink"
        if v in materialized or _banned(graph.node(v), graph):
            return "source"
        return ""

    values = tuple(order)
    free = frozenset(v for v in values if not v.startswith(("mask:", "cast:")) and (
        v in params or (v not in graph and v not in graph_inputs)
        or (v in graph and v not in graph.data_nodes)))
    kinds = {v: kind(v) for v in values}
    signature = (tuple(graph.node(n).target for n in names),
                 tuple(sorted({(order[a], order[b]) for a, b in edges})),
                 tuple((kinds[v], v in required, v in free) for v in values))
    return _Structure(order=values, edges=tuple(edges), kinds=kinds,
                      required=frozenset(required), free=free, signature=signature)


def _min_cut(st: _Structure, costs: dict[str, float]) -> set[str]:
    """The saved values: a minimum cut of the partitioner's flow graph, less the saved
    values no required value is recomputed from."""
    import networkx as nx

    values, required = st.order, st.required
    g = nx.DiGraph()
    for a, b in st.edges:
        g.add_edge(a + "@out", b + "@in", capacity=math.inf)
    for v in values:
        g.add_edge(v + "@in", v + "@out", capacity=costs[v])
        if st.kinds[v] == "source":
            g.add_edge("source", v + "@in", capacity=math.inf)
        elif st.kinds[v] == "sink":
            g.add_edge(v + "@in", "sink", capacity=math.inf)
        if v in required:
            g.add_edge(v + "@out", "sink", capacity=math.inf)
    if "source" not in g or "sink" not in g:
        return set()
    _, (reach, _) = nx.minimum_cut(g, "source", "sink")
    cut = {v for v in values if v + "@in" in reach and v + "@out" not in reach}
    # the backward graph reads only what it needs: a saved value the recomputation of no
    # required value goes back to (the cut severed it from a forward-only value, such as
    # the block's output add under a recompute-everything policy) is dropped
    present = set(values)
    used, stack, seen = set(), [v for v in required if v in present], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in cut:
            used.add(v)
            continue
        stack.extend(p[:-len("@out")] for p in g.predecessors(v + "@in")
                     if p.endswith("@out"))
    return used


def _banned(node, graph: OpGraph) -> bool:
    """A block value the partitioner never recomputes (beside the backward's materialized
    reads): compute-intensive operators, operators outside its recomputable list, and
    reductions to under a quarter of their inputs."""
    if node.kind in _COMPUTE_INTENSIVE:
        return True
    if is_dropout(node):
        return False  # remade from its input and its mask
    if not _recomputable(node.target):
        return True
    if node.kind == OpKind.REDUCTION and node.out is not None:
        ins = sum(graph.node(i).out.numel for i in node.inputs
                  if i in graph and graph.node(i).out is not None)
        return node.out.numel * 4 < ins
    return False


@lru_cache(maxsize=None)
def _recomputable(target: str) -> bool:
    """Whether the partitioner may recompute the aten operator ``target`` (torch's
    ``get_default_op_list().recomputable_ops``, by overload packet), or one that decomposes
    before partitioning (``CompositeImplicitAutograd``)."""
    import torch
    from torch._functorch.partitioners import get_default_op_list

    parts = target.split(".")
    if len(parts) < 2 or parts[0] != "aten":
        return True  # not an aten operator (getitem): nothing to recompute
    if f"aten.{parts[1]}" in {str(o) for o in get_default_op_list().recomputable_ops}:
        return True
    packet = getattr(torch.ops.aten, parts[1], None)
    if packet is None:
        return False
    overload = getattr(packet, parts[2] if len(parts) > 2 else "default", None)
    if overload is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(),
                                                          "CompositeImplicitAutograd")
