"""Megatron-style plans written by hand: dp x tp x pp, microbatches, schedule, recompute,
sequence parallelism and ZeRO, as the same ``Plan`` the solver writes.

trace -> cost -> solve (here: a rule, not a search) -> **assemble** -> run. Behind
``meshplan.manual_plan``. Devices are numbered row-major over (pp, dp, cp, tp): tp innermost
(inside a node), then cp, dp, pp outermost; stage s owns devices [s*dp*cp*tp, (s+1)*...) as a
(dp, tp) mesh ("dp", "tp" kept at size 1), or with cp > 1 (dp, cp, tp) (meshplan/context.py).

Placements come from propagating two rules through the graph in order (Shoeybi et al.
2019, Megatron-LM section 3; Korthikanti et al. 2022 for sequence parallelism):
- the batch dim is S(0) on dp for everything computed from the inputs; scalars become P;
- on tp, a matmul with a weight that reads a tp-replicated activation is column-parallel
  (weight split on its output-feature dim, output S(last)); one that reads a tp-sharded
  activation is row-parallel (weight split on its input-feature dim, output P). So in a
  block the matmuls fed by a norm are column-parallel and the ones fed by attention or the
  activation function are row-parallel, whatever the modules are called. The role comes
  from the graph, the weight dim from the operator (Conv1D's addmm (in, out), Linear's (out, in));
- the token embedding and the output head are vocab-parallel (weight S(0) on tp; the
  embedding's output is P and all-reduced, the loss reads S(-1) logits as DTensor's
  loss_parallel does); the position embedding is replicated;
- P is resolved at its first non-view consumer: all-reduce to R, or, with sequence
  parallelism, reduce-scatter to S(seq) (the norms, dropouts and residual adds then run
  sequence-split, and the next column-parallel matmul all-gathers);
- views, elementwise ops and attention carry a split dim through (views by shape);
- batch norm reads its input all-gathered (global batch statistics), its output batch-split.
ZeRO-3 stores each weight S(d) on dp (the first dim dp divides) and ops read it R.
"""

from __future__ import annotations

import time
from dataclasses import replace
from itertools import accumulate
from numbers import Integral

from meshplan.costmodel.estimate import with_stage_predictions
from meshplan.context import check_cp_model, insert_cp
from meshplan.planner.cp_placements import CpPropagator
from meshplan.planner.views import _args, _norm_dim, map_view_dim
from meshplan.errors import MeshError, PlanningError
from meshplan.planner.assemble import check_batch_divides, mesh_info, model_info, training_config
from meshplan.graph import OpGraph, OpKind, OpNode
from meshplan.planner.strategies import BATCH_NORMS
from meshplan.schedules import Schedule, virtual_stages_for
from meshplan.placements import PARTIAL, REPLICATE, shard, shard_dim
from meshplan.plan import Estimate, OpPlacement, Plan, SolverInfo, Stage
from meshplan.vocabulary import RECOMPUTE, ComputeDtype, Recompute
from meshplan.costmodel.params import token_embedding_reads, with_ties

NAME = "manual"


def build_manual_plan(graph: OpGraph, mesh, *, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
                      microbatch_size: int = 1, schedule: str = Schedule.ONE_F_ONE_B,
                      virtual_stages: int = 1, recompute: str = Recompute.NONE,
                      sequence_parallel: bool = False, zero: int = 0,
                      dtype: str = ComputeDtype.FP32, optimizer: str = "adam",
                      vocab_parallel_cp: bool = False, priced: bool = True,
                      stage_layers: tuple[int, ...] = (), ep: int = 1) -> Plan:
    """A Megatron-style plan (see the module docstring). ``ep``: the expert-parallel degree
    each stage records (meshplan/axes.py; ranks borrowed from dp x cp x tp, no devices added). ``vocab_parallel_cp``: keep the token
    embedding vocab-parallel under cp too, as Megatron-LM and torchtitan run it (a plan
    priced for those stacks); meshplan's graph engine replicates it (``with_cp_axis``).
    ``stage_layers``: a stack's own split, blocks per chunk (pp x v entries, one record each)."""
    start = time.perf_counter()
    _check(graph, mesh, dp=dp, tp=tp, pp=pp, cp=cp, microbatch_size=microbatch_size,
           schedule=schedule, virtual_stages=virtual_stages, recompute=recompute, zero=zero)
    if int(ep) < 1:
        raise PlanningError(f"ep={ep} must be at least 1")
    # selective recompute and sequence parallelism with cp are built (Megatron-LM / NeMo
    # run them; priced with engine="megatron"); meshplan's runtimes refuse them
    # (support.context_parallel_plan_rule)
    training = training_config(graph, dtype=dtype, optimizer=optimizer, schedule=schedule,
                               virtual_stages=virtual_stages_for(schedule, virtual_stages),
                               sequence_parallel=bool(sequence_parallel and tp > 1),
                               microbatch_size=microbatch_size,
                               microbatches=graph.inputs[0][1].shape[0] // (dp * microbatch_size))
    per_stage = dp * cp * tp
    v = training.virtual_stages
    L = graph.num_layers
    # uneven interleaved chunks: one record per virtual stage, chunk j on rank group j % pp
    # (the layout runtime/pipeline and runtime/module_pipeline run); a given split that is
    # the default one is priced as the default (one price per layout)
    bounds = chunk_bounds(L, pp * v) if v > 1 and L % (pp * v) else layer_bounds(L, pp)
    if stage_layers:
        given = split_bounds(L, pp * v, stage_layers)
        even = v > 1 and not L % (pp * v) and len(set(stage_layers)) == 1
        bounds = bounds if even or given == bounds else given
    groups = stage_node_groups(graph, len(bounds), bounds)
    prop = Propagator(graph, dp=dp, tp=tp, sp=training.sequence_parallel,
                       seq_len=training.seq_len, zero=zero)
    cprop = CpPropagator(graph, training.seq_len) if cp > 1 else None
    if cprop is not None and not vocab_parallel_cp:
        prop.vocab = set()  # see with_cp_axis
    shape, axes = ((dp, tp), ("dp", "tp"))
    stages = []
    for s, names in enumerate(groups):
        ops = {n: prop.visit(graph.node(n)) for n in names}
        params = {p: prop.storage(p) for p in stage_params(graph, names)}
        inputs = {name: (shard(0), REPLICATE) for name, _ in graph.inputs}
        if cprop is not None:
            for n in names:
                cprop.visit(graph.node(n))
            shape, axes, ops, params, inputs = with_cp_axis(
                cprop.gather_kv_early(names), dp, cp, tp, ops, params, inputs)
        g = s % pp  # rank group
        stages.append(Stage(index=s, devices=tuple(range(g * per_stage, (g + 1) * per_stage)),
                            mesh_shape=shape, axis_names=axes, layers=bounds[s],
                            nodes=(names[0], names[-1]), recompute=recompute, zero=zero,
                            inputs=inputs, params=params, ops=ops, ep=int(ep)))
    placeholder = Estimate(step_time_s=0.0, peak_memory_gib=0.0, memory_capacity_gib=0.0,
                           fits=True, mfu=0.0, tokens_per_s=0.0)
    solver = SolverInfo(name=NAME, status="given (manual plan)")
    plan = Plan(model=model_info(graph), mesh=mesh_info(mesh), training=training,
                stages=tuple(stages), predicted=placeholder, solver=solver, graph=graph)
    if not priced:  # the caller prices variants of it (meshplan/stacks/search.py)
        return plan
    plan = with_stage_predictions(plan, graph)
    solver = replace(solver, objective_s=plan.predicted.step_time_s)
    return replace(plan, solver=solver, wall_time_s=time.perf_counter() - start)


def with_cp_axis(cp_records: dict, dp: int, cp: int, tp: int, ops: dict, params: dict,
                 inputs: dict):
    """A (dp, tp) stage's placements with the cp axis added: (shape, axis names, ops,
    params, inputs). Weights and graph inputs are replicated over cp.

    DTensor's sharding propagation grows steeply with the mesh's rank (a 3-D mesh made a
    tiny Llama step take minutes on CPU), so one-rank dp/tp axes are left out. cp stages
    run on DTensor (runtime/graph/context.py), whose backward cannot turn the partial gradient of
    a vocab-parallel embedding's output into its masked partial (torch 2.13): the caller's
    Propagator keeps the token embedding replicated on tp (``vocab = set()``)."""
    keep = tuple(a for a, n in enumerate((dp, cp, tp)) if n > 1 or a == 1)
    shape = tuple((dp, cp, tp)[a] for a in keep)
    axes = tuple(("dp", "cp", "tp")[a] for a in keep)
    ops = {n: _with_cp(pl, *cp_records[n], keep) for n, pl in ops.items()}
    params = {p: _keep(insert_cp(pl, REPLICATE), keep) for p, pl in params.items()}
    inputs = {name: _keep(insert_cp(pl, REPLICATE), keep) for name, pl in inputs.items()}
    return shape, axes, ops, params, inputs


def _keep(placements: tuple[str, ...], keep: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(placements[a] for a in keep) if placements else placements


def _with_cp(pl: OpPlacement, cp_inputs: tuple[str, ...], cp_out: str,
             keep: tuple[int, ...]) -> OpPlacement:
    """(dp, tp) placements + the cp axis's -> the stage mesh's axes."""
    return OpPlacement(inputs=tuple(_keep(insert_cp(p, c), keep) if p else p
                                    for p, c in zip(pl.inputs, cp_inputs)),
                       output=_keep(insert_cp(pl.output, cp_out), keep) if pl.output else ())


def _check(graph, mesh, *, dp, tp, pp, cp, microbatch_size, schedule, virtual_stages, recompute,
           zero):
    for key, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp),
                       ("microbatch_size", microbatch_size), ("virtual_stages", virtual_stages)):
        if int(value) < 1:
            raise PlanningError(f"{key}={value} must be at least 1")
    if dp * cp * tp * pp != mesh.num_devices:
        names, values = ("dp*cp*tp*pp", (dp, cp, tp, pp)) if cp > 1 else \
            ("dp*tp*pp", (dp, tp, pp))
        raise MeshError(f"{names} = {'*'.join(map(str, values))} = {dp * cp * tp * pp} devices, "
                        f"but mesh {mesh.name or mesh.shape} has {mesh.num_devices}; choose "
                        "degrees whose product is the mesh size")
    if cp > 1:
        check_cp_model(graph, cp, graph.inputs[0][1].shape[1] if
                       len(graph.inputs[0][1].shape) > 1 else 1)
    Schedule.parse(schedule)
    if recompute not in RECOMPUTE:
        raise PlanningError(f"recompute={recompute!r}; choose one of {', '.join(RECOMPUTE)}")
    if zero not in (0, 1, 2, 3):
        raise PlanningError(f"zero={zero}; ZeRO stages are 0, 1, 2, 3")
    if virtual_stages > 1 and schedule != Schedule.INTERLEAVED:
        raise PlanningError(f"virtual_stages={virtual_stages} needs schedule='interleaved-1f1b'")
    if pp > max(1, graph.num_layers):
        raise PlanningError(
            f"pp={pp} exceeds the {graph.num_layers} blocks of the model; choose pp <= "
            f"{graph.num_layers}" if graph.num_layers else
            f"pp={pp}: the model has no repeated blocks (an nn.ModuleList or numbered "
            "nn.ModuleDict of layers) to cut into pipeline stages; choose pp=1")
    if schedule == Schedule.INTERLEAVED and graph.num_layers + 2 < pp * virtual_stages:
        raise PlanningError(f"interleaved 1F1B cuts the {graph.num_layers} blocks into "
                            f"pp*virtual_stages = {pp * virtual_stages} chunks, of at least one "
                            "block each but the first (embedding only) and the last (head "
                            f"only); choose pp*virtual_stages <= {graph.num_layers + 2}")
    batch = graph.inputs[0][1].shape[0]
    check_batch_divides(batch, dp * microbatch_size, "dp x microbatch_size")
    heads = attention_heads(graph)
    if tp > 1 and heads and heads % tp:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        raise PlanningError(f"tp={tp} must divide the number of attention heads {heads}; "
                            f"choose tp in {ok}")


def attention_heads(graph: OpGraph) -> int:
    for n in graph.nodes:
        if n.kind == OpKind.ATTENTION and n.out is not None and len(n.out.shape) == 4:
            return n.out.shape[1]
    return 0


def layer_bounds(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal block ranges; earlier stages get the extra blocks."""
    base, extra = divmod(num_layers, pp)
    return split_bounds(num_layers, pp, [base + (s < extra) for s in range(pp)])


def split_bounds(num_layers: int, chunks: int, counts) -> list[tuple[int, int]]:
    """The block ranges of a given split: ``counts[j]`` blocks in chunk j, contiguous."""
    if not isinstance(counts, (list, tuple)) or \
            not all(isinstance(c, Integral) and not isinstance(c, bool) for c in counts):
        raise PlanningError(f"stage_layers={counts!r}: blocks per chunk are whole numbers; "
                            f"give {chunks} ints summing to the model's {num_layers}")
    counts = [int(c) for c in counts]
    if len(counts) != chunks or sum(counts) != num_layers or min(counts) < 0:
        raise PlanningError(f"stage_layers={list(counts)}: needs pp x virtual_stages = {chunks} "
                            f"counts of blocks summing to the model's {num_layers}; fix the split")
    ends = list(accumulate(counts))
    return list(zip([0] + ends[:-1], ends))


def chunk_bounds(num_layers: int, chunks: int) -> list[tuple[int, int]]:
    """Contiguous block ranges of ``chunks`` interleaved chunks that differ by at most one
    block, the lighter ones at the two ends, alternately first and last: those chunks also
    hold the embedding and the output head and loss. Llama 3 cut its 126 layers for 16
    pipeline stages this way, one layer fewer on the first and the last stage (Llama Team
    2024, arXiv 2407.21783, section 3.3.2). Up to ``num_layers + 2`` chunks: with one block
    per chunk, the first chunk holds only the embedding and the last only the final norm,
    head and loss, as that section describes the first and last model chunks."""
    if not 1 <= chunks <= num_layers + 2:
        raise PlanningError(f"{chunks} chunks need 1 <= chunks <= {num_layers} blocks + 2 "
                            "(an embedding-only first and a head-only last chunk)")
    size = -(-num_layers // chunks)  # ceil
    sizes = [size] * chunks
    ends = [i // 2 if i % 2 == 0 else chunks - 1 - i // 2 for i in range(chunks)]
    for i in range(size * chunks - num_layers):
        sizes[ends[i]] -= 1
    return split_bounds(num_layers, chunks, sizes)


def stage_node_groups(graph: OpGraph, pp: int,
                      bounds: list[tuple[int, int]] | None = None) -> list[list[str]]:
    """Nodes of each stage in graph order: a block's ops go to the stage owning the block;
    ops outside blocks go to the stage of the last block seen (stage 0 before any).
    ``bounds``: the stages' block ranges (default ``layer_bounds(num_layers, pp)``)."""
    owner = {}
    bounds = bounds or layer_bounds(graph.num_layers, pp)
    for s, (a, b) in enumerate(bounds):
        for layer in range(a, b):
            owner[layer] = s
    groups: list[list[str]] = [[] for _ in range(pp)]
    # a last stage without blocks (chunk_bounds) holds what follows the last block
    last_block = max((i for i, n in enumerate(graph.nodes) if n.layer >= 0), default=None)
    head = pp - 1 if pp > 1 and bounds[-1][0] == bounds[-1][1] else None
    current = 0
    for i, n in enumerate(graph.nodes):
        if n.layer >= 0:
            current = max(current, owner.get(n.layer, current))
        after = head is not None and last_block is not None and i > last_block
        groups[head if after else current].append(n.name)
    if any(not g for g in groups):
        raise PlanningError(f"pp={pp}: a stage got no operators (the model's blocks were not "
                            "found by the tracer); choose a smaller pp")
    return groups


def token_embedding_weights(graph: OpGraph, tp: int) -> set[str]:
    """Weights of embeddings indexed by the token ids (a graph input), and their ties, when
    tp divides the vocabulary: these are vocab-parallel."""
    out = {p for p in token_embedding_reads(graph)
           if tp > 1 and graph.param_map[p].shape[0] % tp == 0}
    return with_ties(graph, out)


def stage_params(graph: OpGraph, names) -> list[str]:
    """Parameters the stage's operators read, with every name tied to them (the runtime
    looks each name of the module up)."""
    seen: dict[str, None] = {}
    for n in names:
        for p in graph.node(n).params:
            if p in graph.param_map:  # buffers (e.g. rotary inv_freq) are not placed
                seen.setdefault(p, None)
    roots = {graph.param_map[p].tied_to or p for p in seen}
    for p in graph.params:
        if p.name in roots or p.tied_to in roots:
            seen.setdefault(p.name, None)
    return list(seen)


# -- placement propagation ------------------------------------------------------------------

def splits_dim(node: OpNode, in_shape: tuple[int, ...], d: int) -> bool:
    """Whether ``node`` is a split/chunk along dim ``d``."""
    args = _args(node)
    return ("aten.split" in node.target or "aten.chunk" in node.target) and len(args) >= 3 \
        and isinstance(args[2], int) and _norm_dim(args[2], len(in_shape)) == d


def is_batch_norm(node: OpNode) -> bool:
    return node.target.rsplit(".", 1)[0].removeprefix("aten.") in BATCH_NORMS


class Propagator:
    """Megatron-style placements of a graph's operators for (dp, tp, sp, zero), walked in
    graph order from the inputs; the planner's stage pricing (planner/stagecost.py) reuses
    it to price uniform stages."""

    def __init__(self, graph: OpGraph, *, dp: int, tp: int, sp: bool, seq_len: int, zero: int):
        self.g, self.dp, self.tp, self.sp, self.seq, self.zero = graph, dp, tp, sp, seq_len, zero
        self.state: dict[str, tuple[str, str]] = {n: (shard(0), REPLICATE)
                                                  for n, _ in graph.inputs}
        self.consumed: dict[str, tuple[str, str]] = {}  # parameter -> placement ops read
        self.vocab = token_embedding_weights(graph, tp)

    def _shape(self, name: str) -> tuple[int, ...]:
        if name in self.g:
            out = self.g.node(name).out
            return out.shape if out is not None else ()
        return next((m.shape for n, m in self.g.inputs if n == name), ())

    def storage(self, param: str) -> tuple[str, str]:
        root = self.g.param_map[param].tied_to or param
        use = self.consumed.get(param) or next(
            (v for k, v in self.consumed.items() if (self.g.param_map[k].tied_to or k) == root),
            (REPLICATE, REPLICATE))
        tp_pl = REPLICATE if use[1] == PARTIAL else use[1]
        dp_pl = REPLICATE
        if self.zero >= 3 and self.dp > 1:
            shape = self.g.param_map[param].shape
            taken = shard_dim(tp_pl) if shard_dim(tp_pl) is not None else -1
            for d, s in enumerate(shape):
                if d != taken and s % self.dp == 0:
                    dp_pl = shard(d)
                    break
        return (dp_pl, tp_pl)

    def visit(self, node: OpNode) -> OpPlacement:
        g = self.g
        ins = [self.state.get(i, (REPLICATE, REPLICATE)) if i not in g.param_map
               else (REPLICATE, REPLICATE) for i in node.inputs]
        is_param = [i in g.param_map for i in node.inputs]
        out_rank = len(node.out.shape) if node.out is not None else 0
        acts = [k for k, p in enumerate(is_param) if not p and node.inputs[k] in self.state]
        # dp axis: batch-split ops stay batch-split; scalars of a split batch are partial
        dp_split = any(ins[k][0] != REPLICATE for k in acts) and node.kind != OpKind.CREATION
        dp_out = ((PARTIAL if out_rank == 0 else shard(0)) if dp_split else REPLICATE)
        consumed = [list(p) for p in ins]
        tp_out = REPLICATE
        if is_batch_norm(node):
            # statistics of the global batch (SyncBatchNorm's): the input is gathered on
            # every axis and normalised whole, and each rank's consumers slice their batch
            # shard back (planner/strategies.py gives batch norm the same single strategy)
            consumed = [[REPLICATE, REPLICATE] for _ in ins]
            tp_out = REPLICATE
        elif self.tp > 1 and node.kind != OpKind.CREATION:
            tp_out = self._tp_rule(node, ins, is_param, consumed, acts)
        for k, p in enumerate(is_param):
            if p:
                self.consumed.setdefault(node.inputs[k], (REPLICATE, consumed[k][1]))
        self.state[node.name] = (dp_out, tp_out)
        return OpPlacement(inputs=tuple(tuple(c) for c in consumed), output=(dp_out, tp_out))

    def _resolve_partial(self, k: int, node_in: str, consumed) -> str:
        shape = self._shape(node_in)
        if self.sp and len(shape) >= 2 and self.seq in shape[:2]:
            d = list(shape).index(self.seq)
            consumed[k][1] = shard(d)
            return shard(d)
        consumed[k][1] = REPLICATE
        return REPLICATE

    def _tp_rule(self, node: OpNode, ins, is_param, consumed, acts) -> str:
        kind = node.kind
        names = node.inputs
        if kind == OpKind.VIEW:
            if not acts:
                return REPLICATE
            src = ins[acts[0]][1]
            if src == PARTIAL:
                return PARTIAL
            if src.startswith("S") and splits_dim(node, self._shape(names[acts[0]]),
                                                   shard_dim(src)):
                # DTensor gathers the dim it splits (GPT-2's fused q/k/v), and each chunk
                # is sliced back to its shard by its consumer (R -> S is local)
                consumed[acts[0]][1] = REPLICATE
                return src
            if src.startswith("S"):
                d = map_view_dim(node, self._shape(names[acts[0]]), shard_dim(src))
                if d is None:
                    consumed[acts[0]][1] = REPLICATE  # gather before an unmappable view
                    return REPLICATE
                return shard(d)
            return REPLICATE
        # partial inputs are reduced at their first non-view consumer
        for k in acts:
            if ins[k][1] == PARTIAL:
                ins[k] = (ins[k][0], self._resolve_partial(k, names[k], consumed))
        weights = [k for k, p in enumerate(is_param) if p and len(self.g.param_map[names[k]].shape) >= 2]
        if kind == OpKind.EMBEDDING and weights:
            w = names[weights[0]]
            if w in self.vocab:
                consumed[weights[0]][1] = shard(0)
                return PARTIAL
            return REPLICATE
        if kind == OpKind.MATMUL and weights:
            return self._matmul(node, ins, is_param, consumed, acts, weights[0])
        split = [(k, ins[k][1]) for k in acts if ins[k][1].startswith("S")]
        if not split:
            return REPLICATE
        k0, pl = split[0]
        d = shard_dim(pl) + (len(node.out.shape) - len(self._shape(names[k0])) if node.out else 0)
        out_rank = len(node.out.shape) if node.out is not None else 0
        if kind == OpKind.LOSS:
            if shard_dim(pl) == len(self._shape(names[k0])) - 1:
                consumed[k0][1] = REPLICATE  # DTensor gathers the class dim (no loss-parallel)
                return REPLICATE
            return PARTIAL
        if kind == OpKind.NORM and d == out_rank - 1:
            for k, _ in split:
                consumed[k][1] = REPLICATE
            return REPLICATE
        if kind == OpKind.REDUCTION and out_rank < len(self._shape(names[k0])):
            return PARTIAL if out_rank == 0 else pl
        # replicated full-size activations are sliced to match (R -> S is local)
        for k in acts:
            if ins[k][1] == REPLICATE and self._shape(names[k]) == node.out.shape:
                consumed[k][1] = shard(d)
        for k, p in enumerate(is_param):
            if p and self.g.param_map[names[k]].shape and node.out is not None \
                    and len(self.g.param_map[names[k]].shape) == out_rank - d and d >= 0:
                consumed[k][1] = shard(0)
        return shard(d) if 0 <= d < out_rank else REPLICATE

    def _matmul(self, node, ins, is_param, consumed, acts, wk) -> str:
        w = self.g.param_map[node.inputs[wk]]
        out_dim_of_weight = 0 if "linear" in node.target else 1  # nn.Linear (out, in); Conv1D (in, out)
        act = acts[0] if acts else None
        act_pl = ins[act][1] if act is not None else REPLICATE
        out_rank = len(node.out.shape)
        bias = [k for k, p in enumerate(is_param) if p and len(self.g.param_map[node.inputs[k]].shape) == 1]
        if shard_dim(act_pl) == len(self._shape(node.inputs[act])) - 1:
            consumed[wk][1] = shard(1 - out_dim_of_weight)  # row-parallel
            for k in bias:
                consumed[k][1] = PARTIAL
            return PARTIAL
        if node.out.shape[-1] % self.tp or w.shape[out_dim_of_weight] % self.tp:
            if act is not None:
                consumed[act][1] = REPLICATE
            return REPLICATE
        if act is not None:
            consumed[act][1] = REPLICATE  # column-parallel reads the full activation
        consumed[wk][1] = shard(out_dim_of_weight)
        for k in bias:
            consumed[k][1] = shard(0)
        return shard(out_rank - 1)
