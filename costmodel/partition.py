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
rules as torch 2.13 states them (``solve_min_cut``):

- the backward reads what eager autograd's derivative formulas read
  (``memory.saved_inputs``), a stand-in for the decomposed joint graph's reads;
- a value cannot be recomputed (an infinite edge from the source) where it is the output of
  a compute-intensive operator (matmul, attention) or a random one, a reduction whose output
  is under a quarter of its inputs (``ban_recompute_reductions``), a block input or weight
  (primals), or a value a matmul or attention reads in the backward
  (``ban_recompute_materialized_backward``: recomputing it would materialize it anyway);
- weights and buffers cost nothing to save (``treat_parameters_as_free_to_save``), nor do
  values that depend on no input (a rotary table, a mask: held once per stage);
- a view is its base's storage (``memory.alias_root``, a copying reshape its own tensor).

Under selective activation checkpointing (``checkpoint`` with a policy, compiled after it as
torchtitan's ``apply_ac`` then ``apply_compile`` do) the policy's tags decide instead:
``MUST_SAVE`` values cannot be recomputed and every other value of the block must be
(``must_recompute``): the cut keeps the saved outputs the backward needs, so an output the
backward never reads (the block's last matmul, whose only reader is the residual add) is not
kept, though eager SAC keeps it.

Left out: the partitioner's tie-breaking weights (values nearer the backward, values whose
users are all fusible, doubled) and its bans on recomputing far-apart or long fusible chains,
which pick between cuts rather than change what a cut costs in the blocks measured.
Measured on this CPU with inductor and saved-tensor hooks: tests/test_compiled_memory.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from meshplan.costmodel.memory import alias_root, is_dropout, saved_inputs
from meshplan.graph import OpGraph, OpKind

_COMPUTE_INTENSIVE = (OpKind.MATMUL, OpKind.ATTENTION)


def compiled_saved(graph: OpGraph, names: Iterable[str], nbytes: Callable[[str], float],
                   must_save: frozenset | set | None = None,
                   cast_bytes: Callable[[str], float | None] | None = None) -> dict[str, float]:
    """The values one compiled block keeps for its backward (storages: view roots) and their
    bytes.

    ``names``: the block's operators; ``nbytes(value)``: the bytes of a value (a block input
    at the dtype the previous block hands over, a block value at the plan's dtype, split and
    per microbatch as the profile counts them); ``must_save``: the operators a selective
    checkpointing policy tags ``MUST_SAVE`` (None: no checkpointing, the partitioner's own
    choice); ``cast_bytes(value)``: under ``torch.autocast``, the bytes of the
    lower-precision copy a matmul or attention reads of a value held wider (None where it
    reads the value itself): the backward reads that copy, so it is what can be saved
    (a value ``("cast", root)`` of the result)."""
    import networkx as nx

    names = [n for n in names if n in graph]
    block = set(names)

    def root(value: str) -> str:
        return alias_root(value, graph, copies=True)

    produced = {root(n) for n in names if root(n) in block}
    casts: dict[str, str] = {}  # ("cast", root) values: the root each is a copy of
    sizes: dict[str, float] = {}

    def read(node, t: str) -> str:
        """The value ``node`` reads for its input ``t``: its storage, or autocast's copy."""
        r = root(t)
        if cast_bytes is None or node.kind not in _COMPUTE_INTENSIVE or t in graph.param_map:
            return r
        b = cast_bytes(r)
        if b is None:
            return r
        key = f"cast:{r}"
        casts[key], sizes[key] = r, b
        return key

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
        return {}
    params = set(graph.param_map)
    graph_inputs = {name for name, _ in graph.inputs}
    saved_tag = {root(n) for n in must_save} if must_save is not None else None

    g = nx.DiGraph()
    values: set[str] = set()
    for name in names:
        node = graph.node(name)
        r = root(name)
        values.add(r)
        for i in node.inputs:
            ri = read(node, i)
            values.add(ri)
            if ri in casts:
                values.add(casts[ri])
                g.add_edge(casts[ri] + "@out", ri + "@in", capacity=math.inf)
            if ri != r:
                g.add_edge(ri + "@out", r + "@in", capacity=math.inf)
    for v in values:
        if v in casts:  # autocast's copy: made in the block from its source
            g.add_edge(v + "@in", v + "@out", capacity=sizes[v])
            if saved_tag is not None:
                g.add_edge(v + "@in", "sink", capacity=math.inf)
            else:
                g.add_edge("source", v + "@in", capacity=math.inf)  # a matmul reads it back
            if v in required:
                g.add_edge(v + "@out", "sink", capacity=math.inf)
            continue
        # weights, buffers and values that depend on no input (rotary tables, masks: the
        # profile holds those once per stage) cost nothing to save
        free = v in params or (v not in graph and v not in graph_inputs) \
            or (v in graph and v not in graph.data_nodes)
        g.add_edge(v + "@in", v + "@out", capacity=0.0 if free else float(nbytes(v)))
        if v not in produced:  # a primal: a block input, a weight, a buffer
            g.add_edge("source", v + "@in", capacity=math.inf)
        elif saved_tag is not None:
            if v in saved_tag:
                g.add_edge("source", v + "@in", capacity=math.inf)
            else:  # the policy recomputes it: it cannot be saved
                g.add_edge(v + "@in", "sink", capacity=math.inf)
        elif _banned(graph.node(v), graph) or v in materialized:
            g.add_edge("source", v + "@in", capacity=math.inf)
        if v in required:
            g.add_edge(v + "@out", "sink", capacity=math.inf)
    if "source" not in g:
        return {}
    value, (reach, _) = nx.minimum_cut(g, "source", "sink")
    if math.isinf(value):  # no finite cut: keep every value the backward reads
        return {v: sizes[v] if v in casts else float(nbytes(v)) for v in required}
    cut = {v for v in values if v + "@in" in reach and v + "@out" not in reach}
    # the backward graph reads only what it needs: a saved value the recomputation of no
    # required value goes back to (the cut severed it from a forward-only value, such as
    # the block's output add under a recompute-everything policy) is dropped
    used, stack, seen = set(), [v for v in required if v in values], set()
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
    return {v: g[v + "@in"][v + "@out"]["capacity"] for v in used}


def _banned(node, graph: OpGraph) -> bool:
    """A block value the partitioner never recomputes (beside the backward's materialized
    reads): compute-intensive and random operators, and reductions to under a quarter of
    their inputs."""
    if node.kind in _COMPUTE_INTENSIVE or is_dropout(node):
        return True
    if node.kind == OpKind.REDUCTION and node.out is not None:
        ins = sum(graph.node(i).out.numel for i in node.inputs
                  if i in graph and graph.node(i).out is not None)
        return node.out.numel * 4 < ins
    return False
