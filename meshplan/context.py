"""Context parallelism (cp): the sequence of every activation split over a mesh axis "cp".

trace -> cost -> solve -> **assemble** -> run. Used by planner/manual.py (placements), the
planner's stage pricing, meshplan/support.py (what runs), ``meshplan show`` (chunks) and
the runtimes: the module engine runs torch's ``context_parallel`` with the same layout
(runtime/cp_modules.py; the per-operator placements below are then only what the cost
model prices), the graph engine realises the placements (runtime/graph/context.py).

The layout (Llama 3 paper Sec. 3.3.2; torchtitan's load balancer): the sequence is cut
into 2 x cp equal chunks and cp rank r holds chunk r and chunk 2cp-1-r, so under a causal
mask every rank does the same attention work. In a plan, "S(d)" on the cp axis means this
layout of dim d (not DTensor's contiguous Shard): the runtime permutes the dim into
``layout_order`` and then shards it contiguously.

Placements on the cp axis, in graph order (``planner/cp_placements.py``, ``CpPropagator``):
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

from meshplan.errors import NotSupportedError, PlanningError
from meshplan.graph import OpGraph, OpKind

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

def check_cp_model(graph: OpGraph, cp: int, seq_len: int) -> None:
    """Refuse, in one line each, what the K/V exchange cannot split."""
    if cp <= 1:
        return
    attention = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    if not attention:
        raise PlanningError(f"cp={cp} splits attention's sequence, but model "
                            f"{graph.model_name or '(unnamed)'} has no attention operator "
                            "(scaled_dot_product_attention; a transformers model: build it "
                            "with attn_implementation='sdpa'); use cp=1 (split the batch "
                            "with dp) or SDPA")
    layout_order(seq_len, cp)
    for n in attention:
        args, kwargs = n.parsed_args()
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        where = f"operator {n.name} ({n.target}) at {n.source or 'unknown source'}"
        if "scaled_dot_product_attention" not in n.target:
            raise NotSupportedError(f"cp={cp}: {where} is an attention variant the K/V "
                                    "exchange does not split; use cp=1 or "
                                    "scaled_dot_product_attention")
        if dropout not in (0, 0.0):
            raise NotSupportedError(f"cp={cp}: {where} has attention dropout {dropout}; "
                                    "set it to 0 or use cp=1")
        mask = n.inputs[3] if len(n.inputs) > 3 else None
        q = value_shape(graph, n.inputs[0])
        if mask is not None:
            m = value_shape(graph, mask)
            if len(m) < 2 or m[-2] not in (1, q[-2]) or m[-1] not in (1, value_shape(graph, n.inputs[1])[-2]):
                raise NotSupportedError(f"cp={cp}: {where} has a mask of shape {list(m)} that "
                                        "is not (..., queries, keys); the exchange splits the "
                                        "query dim only; use cp=1")


def graph_engine_cp_refusal(graph: OpGraph | None, sequence_parallel: bool = False) -> str | None:
    """What the graph engine's K/V exchange (runtime/graph/context.py) cannot split that the module
    engine's (torch's context_parallel, runtime/cp_modules.py) can: ``is_causal=True``, whose
    implicit mask would follow the local positions, and Megatron sequence parallelism inside
    tensor parallelism (which would split the sequence on both axes)."""
    if sequence_parallel:
        return ("the graph engine's cp does not compose with sequence_parallel (it would split "
                "the sequence on both the tp and the cp axis); set sequence_parallel=False")
    for n in (graph.nodes if graph is not None else ()):
        if n.kind != OpKind.ATTENTION:
            continue
        args, kwargs = n.parsed_args()
        if kwargs.get("is_causal", args[5] if len(args) > 5 else False) is True:
            return (f"the graph engine's cp splits an explicit mask only, and operator {n.name} "
                    f"at {n.source or 'unknown source'} uses is_causal=True")
    return None


def attention_calls(graph: OpGraph) -> list[tuple[bool, bool, bool]]:
    """(has an explicit mask, is_causal, dropout_p > 0) of every SDPA call in the traced graph:
    what the module engine's cp check sees when the model's forward cannot run on meta (a
    data-dependent branch, e.g. transformers' ``padding_mask.all()``); other attention
    variants are left out (the module engine's check then finds no SDPA call)."""
    out = []
    for n in graph.nodes:
        if n.kind != OpKind.ATTENTION or "scaled_dot_product_attention" not in n.target:
            continue
        args, kwargs = n.parsed_args()
        out.append((len(n.inputs) > 3, kwargs.get("is_causal", args[5] if len(args) > 5
                                                  else False) is True,
                    kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0) not in (0, 0.0)))
    return out


def value_shape(graph: OpGraph, name: str) -> tuple[int, ...]:
    if name in graph:
        out = graph.node(name).out
        return out.shape if out is not None else ()
    return next((m.shape for n, m in graph.inputs if n == name), ())


def insert_cp(placements: tuple[str, ...], cp_placement: str, axis: int = 1) -> tuple[str, ...]:
    """(dp, tp) placements -> (dp, cp, tp)."""
    return tuple(placements[:axis]) + (cp_placement,) + tuple(placements[axis:])
