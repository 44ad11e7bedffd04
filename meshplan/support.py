"""What the runtime executes: the rules a plan (or a candidate of the search) must follow.

trace -> cost -> solve -> plan -> run, read by three of them. The search skips candidates
these rules refuse (planner/inter, planner/stagedp, planner/hybrid, meshplan/sweep),
``Plan.from_json`` refuses a plan that breaks one when it is loaded, and the runtime
(runtime/graph/parallelize.py, runtime/graph/pipeline.py) refuses with the same words before it builds
anything. Every rule is a pure function returning the reasons (one line each: the value,
the rule, the fix) that a configuration cannot run; an empty tuple means it runs.

Core layer: this module reads ``meshplan.plan`` records only, never torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshplan import axes
from meshplan.errors import NotSupportedError
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for
from meshplan.placements import shard
from meshplan.vocabulary import (BATCH_NORM_STATS, ENGINE_DTYPES, ENGINES, EXPORT_TARGET,
                                 LOSS_REDUCTIONS, PRICED_ONLY_DTYPES, TRAINED_DTYPES,
                                 BatchNormStats, ComputeDtype, Engine, LossReduction,
                                 Recompute)

if TYPE_CHECKING:  # annotations only: Plan.from_dict asks these rules (meshplan/plan.py)
    from meshplan.plan import Plan

# the pipeline schedules the runtime drives (torch.distributed.pipelining)
ZERO_STAGES = (0, 1, 2, 3)  # all run inside pipeline stages too (runtime/graph/pipeline.py)
# fp8 (vocabulary.PRICED_ONLY_DTYPES) is priced for estimation and export only
# (costmodel/fp8.py): a plan may say it, and loads, and a stack (engine='torchtitan' or
# 'megatron') prices it; meshplan's runtimes refuse it
FP8_REFUSAL = ("dtype 'fp8' is priced for estimation and export; meshplan's runtimes train "
               "bf16/fp32; price it with engine='torchtitan' or 'megatron', or use dtype='bf16'")


@dataclass(frozen=True, slots=True)
class Candidate:
    """The shape of a uniform configuration, as the search and the sweep enumerate it.

    ``dp`` and ``zero`` are those of one stage; ``microbatch_size`` is 0 when unknown;
    ``num_layers`` (repeated blocks) is None when the caller does not know them."""

    pp: int = 1
    dp: int = 1
    schedule: str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    microbatches: int = 1
    global_batch: int = 1
    microbatch_size: int = 0
    zero: int = 0
    dtype: str = ComputeDtype.FP32
    num_layers: int | None = None
    cp: int = 1  # context-parallel degree (meshplan/context.py)
    seq_len: int = 0  # 0 when unknown


# -- the rules -----------------------------------------------------------------------------------

def schedule_rule(c: Candidate) -> tuple[str, ...]:
    if c.schedule not in SCHEDULES:
        return (f"schedule {c.schedule!r} is not one the runtime drives; choose one of "
                f"{', '.join(SCHEDULES)}",)
    return ()


def virtual_stage_rule(c: Candidate) -> tuple[str, ...]:
    """Interleaving needs the interleaved schedule, two or more rank groups, and blocks that
    cut into pp x v equal chunks (runtime/graph/pipeline.expand_interleaved)."""
    v = c.virtual_stages
    if v < 1:
        return (f"virtual_stages={v} must be at least 1",)
    if v > 1 and c.schedule != Schedule.INTERLEAVED:
        return (f"virtual_stages={v} needs schedule 'interleaved-1f1b', not {c.schedule!r}; "
                "set virtual_stages=1",)
    if c.schedule == Schedule.INTERLEAVED and c.pp > 1 and c.num_layers is not None and \
            c.num_layers % (c.pp * v):
        return (f"{c.num_layers} blocks do not split into pp x virtual_stages = {c.pp * v} "
                f"equal chunks; choose virtual_stages with pp x virtual_stages dividing "
                f"{c.num_layers}",)
    return ()


def microbatch_rule(c: Candidate) -> tuple[str, ...]:
    """The batch cuts into equal microbatches; torch's 1F1B needs at least one microbatch per
    rank group, its interleaved 1F1B a count divisible by its rounds (max(1, B // pp))."""
    b = c.microbatches
    if b < 1 or c.global_batch % b:
        return (f"global batch {c.global_batch} is not divisible into {b} microbatches; "
                "choose a divisor",)
    if c.pp > 1 and c.schedule != Schedule.GPIPE and b < c.pp:
        return (f"schedule {c.schedule!r} needs at least as many microbatches as pipeline "
                f"rank groups: {b} < pp={c.pp}; use more microbatches or 'gpipe'",)
    if c.pp > 1 and c.schedule == Schedule.INTERLEAVED and b % max(1, b // c.pp):
        return (f"interleaved 1F1B runs {b} microbatches in rounds of pp={c.pp}; {b} is not a "
                f"multiple of its {b // c.pp} rounds; use a multiple of {c.pp}",)
    return ()


def data_parallel_rule(c: Candidate) -> tuple[str, ...]:
    """Every data-parallel rank gets the same number of sequences in every microbatch."""
    if c.dp < 1:
        return (f"dp={c.dp} must be at least 1",)
    if c.microbatches >= 1 and c.global_batch % (c.dp * c.microbatches):
        return (f"global batch {c.global_batch} does not split over dp={c.dp} x "
                f"{c.microbatches} microbatches; choose dp x microbatches dividing it",)
    if c.microbatch_size and c.microbatch_size * c.dp * c.microbatches != c.global_batch:
        return (f"microbatch_size {c.microbatch_size} x dp {c.dp} x microbatches "
                f"{c.microbatches} != global batch {c.global_batch}; fix microbatch_size",)
    return ()


def zero_rule(c: Candidate) -> tuple[str, ...]:
    if c.zero not in ZERO_STAGES:
        return (f"zero={c.zero}; ZeRO stages are {', '.join(map(str, ZERO_STAGES))}",)
    return ()


def dtype_rule(c: Candidate) -> tuple[str, ...]:
    """fp16 needs loss scaling, which only the single-stage runtime does; fp8 is priced,
    not run."""
    if c.dtype in PRICED_ONLY_DTYPES:
        return (FP8_REFUSAL,)
    if c.dtype not in TRAINED_DTYPES:
        return (f"dtype {c.dtype!r} is not one of {', '.join(TRAINED_DTYPES)}",)
    if c.dtype == ComputeDtype.FP16 and c.pp > 1:
        return ("dtype 'fp16' with pp > 1 needs loss scaling, which the pipeline runtime does "
                "not do yet; use dtype 'bf16' or 'fp32' when pp > 1",)
    return ()


def context_parallel_rule(c: Candidate) -> tuple[str, ...]:
    """The load-balanced layout cuts the sequence into 2 x cp equal chunks
    (meshplan/context.py)."""
    if c.cp < 1:
        return (f"cp={c.cp} must be at least 1",)
    if c.cp > 1 and c.seq_len and c.seq_len % (2 * c.cp):
        return (f"sequence length {c.seq_len} is not divisible by 2 x cp = {2 * c.cp}; the "
                "load-balanced layout cuts it into 2 x cp chunks; choose cp with 2 x cp "
                f"dividing {c.seq_len}",)
    return ()


RULES = (schedule_rule, virtual_stage_rule, microbatch_rule, data_parallel_rule, zero_rule,
         dtype_rule, context_parallel_rule)


def candidate_problems(c: Candidate) -> tuple[str, ...]:
    """Why a candidate configuration cannot run (empty: it runs)."""
    return tuple(reason for rule in RULES for reason in rule(c))


# -- plans ---------------------------------------------------------------------------------------

def lists_rank_groups(plan: Plan) -> bool:
    """An interleaved plan written with one stage record per rank group (as planner/manual.py
    and planner/inter write it) rather than one per virtual stage."""
    n = len(plan.stages[0].devices)
    return plan.training.schedule == Schedule.INTERLEAVED and \
        plan.num_stages * n == plan.num_devices and plan.training.virtual_stages > 1


def pipeline_degree(plan: Plan) -> int:
    """Rank groups of the plan (1 for a single stage)."""
    v = plan.training.virtual_stages
    if plan.num_stages == 1 or lists_rank_groups(plan) or v < 1 or plan.num_stages % v:
        return plan.num_stages
    return plan.num_stages // v


def data_parallel_degree(plan: Plan) -> int:
    """Size of the axes the batch is split over: stage 0's first input's S(0) axes, else an
    axis named 'dp'."""
    st = plan.stages[0]
    axes = dp_axes(st)
    n = 1
    for a in axes:
        n *= st.mesh_shape[a]
    return n


def dp_axes(stage) -> tuple[int, ...]:
    if stage.inputs:
        first = next(iter(stage.inputs.values()))
        return tuple(i for i, p in enumerate(first) if p == shard(0))
    return tuple(i for i, name in enumerate(stage.axis_names) if name == "dp")


def candidate_of(plan: Plan) -> Candidate:
    t = plan.training
    return Candidate(pp=pipeline_degree(plan), dp=data_parallel_degree(plan),
                     schedule=t.schedule, virtual_stages=t.virtual_stages,
                     microbatches=t.microbatches, global_batch=t.global_batch,
                     microbatch_size=t.microbatch_size if plan.num_stages > 1 else 0,
                     zero=max(st.zero for st in plan.stages), dtype=t.dtype,
                     num_layers=plan.model.num_layers if lists_rank_groups(plan) else None,
                     cp=cp_degree(plan.stages[0]), seq_len=t.seq_len)


def cp_degree(stage) -> int:
    """Size of the stage mesh's "cp" axis (1 without one)."""
    names = tuple(stage.axis_names)
    return stage.mesh_shape[names.index("cp")] if "cp" in names else 1


def context_parallel_plan_rule(plan: Plan) -> tuple[str, ...]:
    """A cp axis runs, on every stage alike:
    - on the module engine, one stage or a pipeline (runtime/cp_modules.py: torch's
      ``context_parallel``; SDPA with ``is_causal=True`` or unmasked, head-tail chunks, K/V
      all-gathered per attention call; TP with or without sequence parallelism inside; FSDP /
      ZeRO over dp x cp; pipeline stages pass each rank's chunks);
    - on the graph engine (runtime/graph/context.py) for plans the module engine refuses or that
      ask for it (engine='graph'): SDPA with an explicit mask, without sequence parallelism
      (meshplan/api.choose_engine refuses the rest when the plan is made, from the traced
      graph), pipelines at two or more sequences per microbatch (``graph_engine_cp_rule``,
      checked by choose_engine when the plan is made and by parallelize_graph)."""
    cps = {cp_degree(st) for st in plan.stages}
    cp = max(cps)
    if len(cps) > 1:
        return (f"stages have different cp degrees {sorted(cps)}; every stage needs the same",)
    if cp > 1 and any(st.recompute == Recompute.SELECTIVE for st in plan.stages):
        return (f"recompute 'selective' with cp={cp}: the selective checkpoint's replay "
                "diverges from the forward around the cp exchange (tests/"
                "test_context_parallel.py); use recompute 'full' or 'none' with cp",)
    return ()


def graph_engine_cp_rule(plan: Plan) -> tuple[str, ...]:
    """What the graph engine's cp (runtime/graph/context.py) cannot run, whatever the model:
    a pipeline at one sequence per microbatch (its load-balanced layout pass cannot split a
    one-sequence microbatch's broadcast operands; it failed on stage 0 inside the schedule
    while the other stage waited out the gloo timeout). Checked when a plan is given to the
    graph engine (meshplan/api.choose_engine) and again in parallelize_graph; not a plan
    rule, so that the cost model still prices Llama 3's CP16 x PP16 at one sequence per
    microbatch, which the module engine's pipelines run."""
    cp = cp_degree(plan.stages[0])
    if cp > 1 and plan.num_stages > 1 and plan.training.microbatch_size == 1:
        return (f"cp={cp} with pipeline stages at microbatch size 1 on the graph engine: its "
                "load-balanced layout pass cannot split the broadcast operands of a "
                "one-sequence microbatch; use microbatch_size >= 2, or pp=1 with cp",)
    return ()


# -- which engine runs what ----------------------------------------------------------------
# The module engine (runtime/modules.py, runtime/module_pipeline.py, runtime/cp_modules.py:
# parallelize_module, fully_shard, checkpoint wrappers, torch.distributed.pipelining,
# context_parallel) runs every plan it can express; the graph engine (runtime/graph/) runs the
# plans below, which PyTorch's composables cannot express today, each with the reason.
# runtime/module_engine.module_engine_refusal (module_plan.stage_refusal, module_pipeline.pipeline_refusal) give the
# one-line reason per plan; plan.engine_note records it. The search prices the engine that
# will run its plan (DECISIONS 79).
GRAPH_ONLY = (
    ("per-operator placements with no composable style",
     "a weight stored Partial, an input sharded on the tensor-parallel axis, a weight sharded "
     "on the data-parallel axis below ZeRO-3, or a Linear/Embedding sharding that maps onto no "
     "Colwise/Rowwise/SequenceParallel style: parallelize_module shards modules, not operators"),
    ("models whose layers map onto no tensor-parallel style or fail on local shards",
     "GPT-2's Conv1D with tp > 1, reshapes that bake in the global head count: the graph "
     "engine runs the exported operators on DTensor, which carries global shapes"),
    ("dropout with more than one device",
     "eager modules draw DTensor's per-shard masks; the graph engine draws one process's masks, "
     "so a plan's loss equals one process whatever the layout"),
    ("fp16 (loss scaling)",
     "the module engine trains fp32 and bf16; fp16 needs a loss scaler in the step"),
    ("BatchNorm (running statistics) split over tensor- or context-parallel ranks or "
     "pipeline stages",
     "the module engine synchronises BatchNorm over data-parallel ranks only "
     "(runtime/sync_batchnorm.py; torch's SyncBatchNorm has no CPU kernels); the graph "
     "engine computes the global batch's statistics under any layout (DECISIONS 18)"),
    ("pipelines whose stages are not one block stack, or share a weight across stages",
     "torch.distributed.pipelining stage modules are copies of the model with other stages' "
     "blocks removed: a tied embedding/head on two stages has no owner there"),
    ("pipelines with keyword inputs or several targets",
     "the module pipelines feed positional inputs to the first stage and one target to the loss"),
    ("context parallelism over attention with an explicit mask, mixed causal/full attention",
     "torch's context_parallel shards SDPA with is_causal or no mask only (DECISIONS 74)"),
)



def loss_reduction_rule(plan: Plan, reduction: str, has_loss_fn: bool,
                        engine: str | None = None) -> tuple[str, ...]:
    """``loss_reduction`` (what the user's loss_fn returns, vocabulary.LossReduction) on
    ``plan`` run by ``engine`` (default: the plan's). The module engine weighs every piece
    of a step by it (runtime/modules.py, runtime/cp_modules.py ``chunk_loss``); the graph
    engine's weighting and module pipelines' summed losses without cp read a mean only."""
    if reduction not in LOSS_REDUCTIONS:
        return (f"loss_reduction={reduction!r} is not one of {', '.join(LOSS_REDUCTIONS)}: "
                "what loss_fn returns over its labelled targets (a mean, a sum, or each "
                "sequence's mean averaged over the sequences)",)
    if reduction == LossReduction.MEAN:
        return ()
    if not has_loss_fn:
        return (f"loss_reduction={reduction!r} without a loss_fn: the built-in losses are "
                "means; pass loss_fn= or leave loss_reduction='mean'",)
    engine = engine or plan.engine
    if engine != Engine.MODULES:
        return (f"loss_reduction={reduction!r} on the {engine} engine, whose loss weighting "
                "reads a mean over labelled targets; use engine='modules' or a loss_fn that "
                "returns that mean",)
    if reduction == LossReduction.SUM and plan.num_stages > 1 and cp_degree(plan.stages[0]) == 1:
        return ("loss_reduction='sum' on a module-engine pipeline without context parallelism "
                "is not weighted yet; use pp=1, cp > 1, or a loss_fn that returns the mean",)
    return ()


def module_engine_dtype_rule(plan: Plan) -> tuple[str, ...]:
    """The module engine (runtime/modules.py, runtime/module_pipeline.py) runs fp32 and bf16
    plans, one stage or a pipeline: fp32, or bf16 with fp32 master weights (fully_shard's
    MixedPrecisionPolicy, autocast without data parallelism); fp16 needs loss scaling (fp8:
    dtype_rule's one line, on either engine)."""
    t = plan.training
    runs = ENGINE_DTYPES[Engine.MODULES]
    if plan.engine == Engine.MODULES and t.dtype not in runs + PRICED_ONLY_DTYPES:
        return (f"engine 'modules' with dtype {t.dtype!r}: the module engine runs "
                f"{' and '.join(runs)} (fp16 needs loss scaling); set engine "
                "'graph' or dtype 'bf16'",)
    return ()


def heads_rule(tp: int, heads: int | None, kv_heads: int | None) -> tuple[str, ...]:
    """Each tensor-parallel rank holds whole attention heads: ``tp`` must divide the query
    heads and the key/value heads (grouped-query attention: Llama 3 405B's 8 KV heads run
    at tp = 1, 2, 4, 8). The module engine's column-parallel projections cannot compute part
    of a head, and the graph engine's head reshape of an unevenly split K/V fails at run time
    (DTensor: "Cannot unflatten unevenly sharded tensor"), so both are refused when the plan
    is made. None: the model does not say."""
    out = []
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if tp > 1 and n and n % tp:
            fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            out.append(f"{name}={n} is not divisible by tp={tp}: a tensor-parallel rank would "
                       f"hold part of a head; choose tp in {{{fits}}}")
    return tuple(out[:1])


def stage_layout_rule(plan: Plan) -> tuple[str, ...]:
    """The pipeline runtime's device convention (docs/DEVELOPING.md, pipeline layout): stages
    listed in order, every stage on the same submesh shape, stage i on rank group i % pp."""
    if plan.num_stages == 1:
        return ()
    t = plan.training
    v = virtual_stages_for(t.schedule, t.virtual_stages)
    if not lists_rank_groups(plan) and plan.num_stages % v:
        return (f"{plan.num_stages} stages are not a multiple of virtual_stages={v}; an "
                "interleaved plan has pp x virtual_stages stages",)
    pp = pipeline_degree(plan)
    first = plan.stages[0]
    n = len(first.devices)
    out = []
    for i, st in enumerate(plan.stages):
        if st.index != i:
            out.append(f"stage record {i} has index {st.index}; list stages in order")
        if tuple(st.mesh_shape) != tuple(first.mesh_shape) or \
                tuple(st.axis_names) != tuple(first.axis_names):
            out.append(f"stage {i} has mesh {list(st.mesh_shape)} {list(st.axis_names)} but "
                       f"stage 0 has {list(first.mesh_shape)}; the pipeline runtime needs the "
                       "same submesh shape for every stage")
            continue
        group = i % pp
        want = tuple(range(group * n, (group + 1) * n))
        if tuple(st.devices) != want:
            out.append(f"stage {i} runs on devices {list(st.devices)[:8]}; the runtime places "
                       f"stage i on rank group i % pp, here devices {list(want)[:8]} (see "
                       "docs/DEVELOPING.md, pipeline layout)")
    if pp * n != plan.num_devices:
        out.append(f"{pp} rank groups x {n} devices per stage = {pp * n}, but the mesh has "
                   f"{plan.num_devices} devices")
    return tuple(out)


def interleaved_split_rule(plan: Plan) -> tuple[str, ...]:
    """An interleaved plan listing one record per rank group runs its blocks cut into
    pp x v equal chunks (runtime/graph/pipeline.expand_interleaved), whatever ranges the records
    give: each record must then hold num_layers / pp blocks, or the plan would run otherwise
    than it was priced."""
    if not lists_rank_groups(plan):
        return ()
    pp, blocks = plan.num_stages, plan.model.num_layers
    want = blocks // pp
    for st in plan.stages:
        held = st.layers[1] - st.layers[0]
        if blocks % pp == 0 and held != want:
            return (f"interleaved stage {st.index} holds blocks [{st.layers[0]}, "
                    f"{st.layers[1]}) ({held}); the runtime gives each of the {pp} rank groups "
                    f"{want} of the {blocks} blocks; cut the stages evenly or re-plan",)
    return ()


# aten operators whose statistics are those of the rows they see together (the batch, and
# the spatial or sequence positions); planner/strategies.py runs them replicated
BATCH_STATISTICS_OPS = ("batch_norm", "native_batch_norm",
                        "_native_batch_norm_legit_functional", "_native_batch_norm_legit")


def has_batch_norm(graph) -> bool:
    """Whether the traced training graph normalises over its batch (BatchNorm in training)."""
    return any(n.target.rsplit(".", 1)[0].removeprefix("aten.") in BATCH_STATISTICS_OPS
               for n in graph.nodes)


def check_batch_norm_stats(value: str, error: type = NotSupportedError) -> None:
    if value not in BATCH_NORM_STATS:
        raise error(f"batch_norm={value!r} is not one of {', '.join(BATCH_NORM_STATS)}: "
                    "'batch' normalises each step's whole batch, as one process does")


def batch_norm_rule(plan: Plan, batch_norm: bool) -> tuple[str, ...]:
    """A model with BatchNorm (``batch_norm``) normalises the step's whole batch, as the
    user's one process does, unless the plan opts into per-microbatch statistics
    (``training.batch_norm == "microbatch"``): microbatches would cut the rows that are
    normalised together, silently (issue 42: manual_plan(dp=2) at its default microbatch
    size trained 0.014 off one process)."""
    t = plan.training
    if not batch_norm or t.batch_norm != BatchNormStats.BATCH or t.microbatches <= 1:
        return ()
    rows = t.global_batch // data_parallel_degree(plan)
    return (f"the model has BatchNorm and the plan cuts each step's batch into "
            f"{t.microbatches} microbatches, so each microbatch would be normalised alone, "
            f"not the {t.global_batch} rows one process normalises together; use one "
            f"microbatch (microbatch_size={rows} rows per data-parallel rank), or pass "
            "batch_norm='microbatch' to normalise each microbatch as gradient accumulation "
            "over the same microbatches does",)


def axes_rule(plan: Plan, engine: str = "") -> tuple[str, ...]:
    """The axis table's rules (meshplan/axes.py) on each stage, the model unknown; with
    ``engine`` (a plan read from a file), the engine's too."""
    pp = pipeline_degree(plan)
    found: list[str] = []
    for st in plan.stages:
        found += [w for w in axes.plan_problems(st, engine=engine, pp=pp) if w not in found]
    return tuple(found)


def plan_problems(plan: Plan) -> tuple[str, ...]:
    """Why ``plan`` cannot run (empty: it runs)."""
    if not plan.stages:
        return ("the plan has no stages; re-plan",)
    out = stage_layout_rule(plan) + interleaved_split_rule(plan) + \
        context_parallel_plan_rule(plan) + module_engine_dtype_rule(plan) + axes_rule(plan)
    c = candidate_of(plan)
    if plan.num_stages == 1:
        # one stage: the schedule, microbatch size and interleaving are not used by the
        # single-stage runtime (it accumulates gradients over the microbatches)
        out += microbatch_rule(c) + zero_rule(c) + dtype_rule(c) + context_parallel_rule(c)
    else:
        out += candidate_problems(c)
    return out


def stack_refusal(engine: str, *, where: str = "this plan", path: str = "plan.json",
                  replan: str = "--engine auto (without --for)") -> str:
    """Why meshplan's runtimes do not run a plan whose ``engine`` is a stack it was priced
    for (``costmodel.runtime_profiles.STACKS``: ``plan --for`` or ``--manual --engine``), and
    what to do instead, in one line; "" for meshplan's own engines (and for a name that is
    no profile, which the plan file's schema and ``parallelize``'s engine check refuse).
    ``meshplan run`` and ``meshplan.parallelize`` raise it before any process starts or any
    module is touched; ``path`` is the plan file in the export command shown."""
    target = EXPORT_TARGET.get(engine)
    if target is None:
        return ""
    export = f"`meshplan export {path} --to {target}`"
    how = (f"run it there after {export}" if target == engine else
           f"export its layout for {target} with {export} (meshplan writes no {engine} "
           "configuration)")
    return (f"{where} was made for {engine}, a stack meshplan does not run: {how}; or "
            f"re-plan with {replan} to run it with meshplan")


def export_problems(plan: Plan) -> tuple[str, ...]:
    """Why ``plan`` cannot be read from a file: those of ``plan_problems``, except that a
    plan in an estimation-only dtype (fp8) loads when its layout would run in bf16."""
    if plan.engine not in ENGINES:
        return ()  # priced for another stack: its rules are checked by `meshplan export`
    if plan.training.dtype in PRICED_ONLY_DTYPES:
        from dataclasses import replace

        plan = replace(plan, training=replace(plan.training, dtype=ComputeDtype.BF16))
    return plan_problems(plan) + tuple(w for w in axes_rule(plan, plan.engine)
                                       if w not in axes_rule(plan))


def check_plan(plan: Plan, error: type = NotSupportedError) -> None:
    """Raise ``error`` with the first reason ``plan`` cannot run (the runtime raises
    NotSupportedError, ``Plan.from_json`` PlanFileError)."""
    problems = plan_problems(plan)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise error(f"plan cannot run: {problems[0]}{more}")
