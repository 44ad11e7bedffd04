"""The public entry points: autoparallel, manual_plan, estimate.

Each reads as the pipeline: trace -> build the search space -> estimate costs -> solve ->
assemble the plan. The work lives in meshplan.planner and meshplan.costmodel.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.nn as nn

from meshplan.costmodel.estimate import STACKS, estimate_plan
from meshplan.errors import MemoryLimitError, NotSupportedError, PlanningError
from meshplan.mesh import Mesh
from meshplan.planner.assemble import check_training_options
from meshplan.planner.hybrid import plan_auto, search_space
from meshplan.graph import OpGraph
from meshplan.context import graph_engine_cp_refusal
from meshplan.support import (FP8_REFUSAL, batch_norm_rule, check_batch_norm_stats,
                              check_plan, cp_degree, graph_engine_cp_rule, has_batch_norm,
                              loss_reduction_rule, plan_problems)
from meshplan.tracing import Inputs, trace
from meshplan.plan import Estimate, Plan
from meshplan.schedules import Schedule
from meshplan.vocabulary import (PRICED_ONLY_DTYPES, BatchNormStats, ComputeDtype, Engine,
                                 LossReduction,
                                 Recompute)


def default_dtype(mesh: Mesh) -> str:
    """bf16 mixed precision on GPUs, fp32 on CPU processes (CPU bf16 matmuls are slow)."""
    return ComputeDtype.FP32 if mesh.hardware.device.name == "cpu" else ComputeDtype.BF16


def as_mesh(mesh) -> Mesh:
    """A Mesh, or a mesh spec string as the command line takes it ("local:4",
    "dgx-h100:nodes=2", "cluster.json")."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        from meshplan.specs import parse_mesh_spec
        return parse_mesh_spec(mesh)
    raise PlanningError(f"mesh={mesh!r} is a {type(mesh).__name__}; pass a meshplan.Mesh "
                        "(Mesh.local(4), Mesh.preset('dgx-h100', nodes=2)) or a spec string "
                        "such as 'local:4'")


def _check_search_options(*, microbatches, max_stages, time_limit_s, memory_limit_gib) -> None:
    """autoparallel's numeric options: one line naming the bad value."""
    if microbatches is not None:
        bad = [m for m in microbatches if not isinstance(m, int) or isinstance(m, bool) or m < 1]
        if bad or not len(microbatches):
            raise PlanningError(f"microbatches={list(microbatches)!r}: give microbatch counts "
                                "as positive integers, e.g. [1, 2, 4], or None for all")
    if max_stages is not None and (not isinstance(max_stages, int) or max_stages < 1):
        raise PlanningError(f"max_stages={max_stages!r}: at least 1 pipeline stage, or None")
    if not time_limit_s > 0:
        raise PlanningError(f"time_limit_s={time_limit_s!r}: the solver's time limit must be "
                            "positive (seconds)")
    if memory_limit_gib is not None and not memory_limit_gib > 0:
        raise PlanningError(f"memory_limit_gib={memory_limit_gib!r}: must be positive, or None "
                            "for the devices' capacity")


def _check_context_parallel(degrees, mesh: Mesh) -> None:
    """Every context-parallel degree tried must be a positive int dividing the mesh's devices
    (a degree that divides nothing would otherwise be dropped from the search unsaid)."""
    try:
        degrees = tuple(degrees)
    except TypeError:
        degrees = (degrees,)
    n = mesh.num_devices
    bad = [d for d in degrees if not isinstance(d, int) or isinstance(d, bool) or d < 1 or n % d]
    if bad or not degrees:
        ok = tuple(d for d in range(1, n + 1) if n % d == 0)
        raise PlanningError(f"context_parallel={degrees!r}: {bad[0] if bad else 'no degree'} "
                            f"does not divide the mesh's {n} devices; choose degrees from {ok}")


def check_example_call(model: nn.Module, example_inputs, example_targets, loss_fn) -> None:
    """Before tracing: a model called with token ids has positions for the sequence, and a
    model without loss_fn or targets is called with token ids (the default loss is the
    next-token loss on the first input)."""
    from meshplan.specs import check_positions

    first = example_inputs
    if isinstance(first, dict):
        first = first.get("input_ids", next(iter(first.values()), None))
    elif isinstance(first, (tuple, list)):
        first = first[0] if first else None
    if not isinstance(first, torch.Tensor):
        return
    integer = not first.is_floating_point() and not first.is_complex()
    if integer and first.dim() == 2:
        check_positions(model, first.shape[1], what="example_inputs")
    has_targets = example_targets is not None and (
        isinstance(example_targets, torch.Tensor) or len(example_targets) > 0)
    if loss_fn is None and not has_targets and not integer:
        raise PlanningError(
            f"example_inputs start with a {first.dtype} tensor of shape {tuple(first.shape)}, "
            "and with neither loss_fn nor example_targets the loss is the next-token loss on "
            "token ids; pass example_targets=(y,) (cross entropy) and/or loss_fn=")


def autoparallel(model: nn.Module, mesh: Mesh, example_inputs: Inputs = (), *,
                 example_targets: Sequence[torch.Tensor] | torch.Tensor = (),
                 loss_fn: Callable | None = None, optimizer: str = "adam",
                 dtype: str | None = None, memory_limit_gib: float | None = None,
                 microbatches: Sequence[int] | None = None, schedules: Sequence[str] | None = None,
                 recompute: Sequence[str] | None = None, max_stages: int | None = None,
                 time_limit_s: float = 30.0, model_name: str = "",
                 graph: OpGraph | None = None, engine: str = "auto",
                 context_parallel: Sequence[int] = (1,), margin: float | None = None,
                 loss_reduction: str = LossReduction.MEAN,
                 batch_norm: str = BatchNormStats.BATCH) -> Plan:
    """Find the fastest plan for ``model`` on ``mesh`` that fits every device's memory.

    ``example_inputs`` is one GLOBAL batch, usually on the meta device: a tensor (token ids,
    batch x seq), a tuple (positional model arguments) or a dict (keyword arguments).
    ``example_targets`` go only to ``loss_fn(outputs, *targets)``; with neither targets nor
    loss_fn the language-model default applies (next-token loss on the first input).
    Pass ``graph`` to reuse a trace. ``engine`` ("auto", "modules", "graph") picks the
    runtime recorded in the plan (``choose_engine``). ``context_parallel`` lists the
    context-parallel degrees the search tries with everything else, e.g. (1, 2, 4, 8, 16)
    for long sequences (default: none). Among plans whose predicted step time is within
    ``margin`` of the fastest (default: the cost model's measured error on this kind of
    machine, planner/simplest.py; 0 keeps the fastest) the simplest is returned: fewer
    pipeline stages, less ZeRO, no recompute, no cp; ``plan.solver`` records the margin and
    the faster plan it beat. ``loss_reduction``: what ``loss_fn`` returns over its labelled
    targets ("mean", "sum" or "sequence", docs/running.md). ``batch_norm``: a model with
    BatchNorm normalises each step's whole batch, as one process does ("batch": the plan has
    one microbatch, the dp ranks share their statistics); "microbatch" lets the search cut the
    batch into microbatches, each normalised alone, as one process accumulating gradients
    over them.
    """
    mesh = as_mesh(mesh)
    check_batch_norm_stats(batch_norm, PlanningError)
    _check_search_options(microbatches=microbatches, max_stages=max_stages,
                          time_limit_s=time_limit_s, memory_limit_gib=memory_limit_gib)
    _check_context_parallel(context_parallel, mesh)
    dtype = dtype or default_dtype(mesh)
    check_training_options(dtype=dtype, optimizer=optimizer)
    if dtype in PRICED_ONLY_DTYPES:  # the search plans what meshplan's runtimes run
        raise PlanningError(f"autoparallel: {FP8_REFUSAL} (manual_plan(..., engine=...))")
    if graph is None:
        check_example_call(model, example_inputs, example_targets, loss_fn)
        graph = trace(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                      model_name=model_name or type(model).__name__)
    microbatches = _batch_norm_microbatches(graph, batch_norm, microbatches)
    # the pipeline search (stages, submeshes, microbatches, schedule, recompute, ZeRO) and
    # the single-stage intra-op ILP compete under one cost model (planner/hybrid); raises
    # MemoryLimitError (with min_memory_gib) when nothing fits
    space = search_space(microbatches=microbatches, schedules=schedules, recompute=recompute,
                         max_stages=max_stages, context_parallel=context_parallel)
    # the search prices the engine that will run its plan: the module engine unless the
    # caller or the model rules it out; should it refuse the plan found, the search runs
    # again priced for the graph engine, which runs every plan
    searched = _engine_to_price(model, mesh, dtype, engine)
    from meshplan.planner.clusters import layer_units
    from meshplan.planner.stagecost import MegatronStageCost

    # one set of placements and cost-model walks for every search below (the engines share
    # them; the probes' prices are kept per engine)
    cost = MegatronStageCost(graph, layer_units(graph), mesh.hardware,
                             num_devices=mesh.num_devices, dtype=dtype, optimizer=optimizer)
    kw = dict(dtype=dtype, optimizer=optimizer, memory_limit_gib=memory_limit_gib, space=space,
              time_limit_s=time_limit_s, margin=margin, cost=cost)
    start = time.perf_counter()
    # where the module engine runs no pipeline of this model at all, pipelines are priced
    # as the graph engine runs them within the same search (one search, not a second one
    # after choose_engine refuses its plan)
    pipelines = _pipeline_engine(model, graph, searched, engine)
    try:
        plan = choose_engine(plan_auto(graph, mesh, engine=searched, pipeline_engine=pipelines,
                                       **kw), model, engine)
    except MemoryLimitError:
        if searched == Engine.GRAPH or engine == Engine.MODULES:
            raise
        # nothing fits as the module engine runs it (FSDP2's copies): the graph engine's
        # plans, priced as it runs them (DECISIONS 44)
        plan = choose_engine(plan_auto(graph, mesh, engine=Engine.GRAPH, **kw), model,
                             Engine.GRAPH)
        plan = replace(plan, engine_note="no plan fits memory as the module engine runs it")
        searched = Engine.GRAPH
    priced = pipelines if pipelines and plan.num_stages > 1 else searched
    if plan.engine != priced:
        note = plan.engine_note
        plan = replace(plan_auto(graph, mesh, engine=plan.engine, **kw), engine_note=note)
    _check_model_rules(plan, model)
    _check_loss_rule(plan, model, loss_fn, example_targets, loss_reduction)
    plan = replace(plan, training=replace(plan.training, batch_norm=batch_norm))
    return replace(plan, wall_time_s=time.perf_counter() - start)


def _batch_norm_microbatches(graph: OpGraph, batch_norm: str,
                             microbatches: Sequence[int] | None) -> Sequence[int] | None:
    """The microbatch counts the search may try: one for a model with BatchNorm normalising
    the whole batch (the rows one process normalises together), else ``microbatches``."""
    if batch_norm != BatchNormStats.BATCH or not has_batch_norm(graph):
        return microbatches
    if microbatches and any(m != 1 for m in microbatches):
        raise PlanningError(f"microbatches={tuple(microbatches)} with a BatchNorm model: each "
                            "microbatch would be normalised alone, not the whole batch one "
                            "process normalises; drop microbatches=, or pass "
                            "batch_norm='microbatch' to normalise each microbatch as gradient "
                            "accumulation does")
    return (1,)


def _pipeline_engine(model: nn.Module | None, graph: OpGraph, searched: str,
                     engine: str) -> str | None:
    """The graph engine where the search prices the module engine but that engine runs no
    pipeline of ``model`` (module_pipeline.model_pipeline_refusal) and the caller left the
    engine to meshplan; else None (pipelines priced as ``searched``)."""
    if searched != Engine.MODULES or engine != "auto" or model is None:
        return None
    from meshplan.planner.assemble import input_records
    from meshplan.runtime.module_pipeline import model_pipeline_refusal

    roles = [r.get("role") for r in input_records(graph)]
    return Engine.GRAPH if model_pipeline_refusal(model, roles) else None


def _engine_to_price(model: nn.Module | None, mesh: Mesh, dtype: str, engine: str) -> str:
    """The engine the search prices: "graph" when asked for or when the module engine
    refuses the model whatever the plan (runtime/module_plan.model_refusal)."""
    if engine == Engine.GRAPH or model is None:
        return Engine.GRAPH
    if engine not in ENGINE_CHOICES:
        raise PlanningError(f"engine={engine!r} is not one of {', '.join(ENGINE_CHOICES)}")
    if engine in STACKS:
        raise PlanningError(f"engine={engine!r}: autoparallel searches for meshplan's own "
                            "engines ('auto', 'modules', 'graph'); price a layout as "
                            f"{engine} runs it with manual_plan(..., engine={engine!r})")
    from meshplan.runtime.module_plan import model_refusal

    why = model_refusal(model, dtype=dtype, num_devices=mesh.num_devices)
    if why and engine == Engine.MODULES:
        raise NotSupportedError(f"engine='modules': {why}")
    return Engine.GRAPH if why else Engine.MODULES


def manual_plan(model: nn.Module, mesh: Mesh, example_inputs: Inputs = (), *,
                example_targets: Sequence[torch.Tensor] | torch.Tensor = (),
                dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
                microbatch_size: int | None = None,
                schedule: str = Schedule.ONE_F_ONE_B, virtual_stages: int = 1,
                recompute: str = Recompute.NONE,
                sequence_parallel: bool = False, zero: int = 0, dtype: str | None = None,
                optimizer: str = "adam", loss_fn: Callable | None = None,
                model_name: str = "", graph: OpGraph | None = None,
                engine: str = "auto", stage_layers: Sequence[int] = (),
                loss_reduction: str = LossReduction.MEAN,
                batch_norm: str = BatchNormStats.BATCH,
                fp8_recipe: str | None = None, ep: int = 1) -> Plan:
    """A Megatron-style plan written by hand (dp x cp x tp x pp devices), estimated.

    ``ep`` > 1 splits each MoE layer's routed experts over ``ep`` ranks borrowed from the
    stage's data-parallel ranks (it adds no devices; meshplan/axes.py ``EP_AXIS`` says what
    runs), on the module engine.

    ``microbatch_size``: rows per microbatch per data-parallel rank; None: 1, or for a model
    with BatchNorm all of the rank's rows (one microbatch: BatchNorm normalises the rows
    one process normalises together). ``batch_norm="microbatch"`` lets a BatchNorm model's
    batch be cut into microbatches, each normalised alone (as gradient accumulation does);
    with "batch" (the default) a plan with several microbatches is refused.

    ``fp8_recipe`` (with ``dtype="fp8"``): the scaling recipe to price, "tensorwise",
    "tensorwise-fp8-all-gather" (FSDP gathers the weights in fp8 too) or "rowwise"
    (torchao, torchtitan); "tensorwise" only for Megatron-LM / NeMo (Transformer Engine's
    current scaling). Default: the engine's own (costmodel/fp8.py). Recorded in
    ``plan.training.fp8_recipe``.

    ``stage_layers``: repeated blocks per pipeline chunk, in chunk order (pp x
    virtual_stages counts, e.g. a stack's own split); empty: near-equal chunks
    (planner/manual.py ``layer_bounds`` / ``chunk_bounds``).

    ``cp`` > 1 splits every activation's sequence over a context-parallel mesh axis
    (meshplan/context.py); the stage mesh is then (dp, cp, tp). A ``loss_fn`` then runs on
    each rank's sequence chunk, weighted as ``loss_reduction`` ("mean", "sum", "sequence")
    says; one that cannot be split so is refused here (docs/running.md).

    Never raises for memory: a plan that does not fit has ``predicted.fits == False`` and
    ``predicted.overflow`` says what overflows. Pass ``graph`` to reuse a trace.
    """
    from meshplan.planner.manual import build_manual_plan

    mesh = as_mesh(mesh)
    dtype = dtype or default_dtype(mesh)
    check_training_options(dtype=dtype, optimizer=optimizer)
    recipe = check_fp8_recipe(fp8_recipe, dtype, engine, mesh.hardware)
    if graph is None:
        check_example_call(model, example_inputs, example_targets, loss_fn)
        graph = trace(model, example_inputs, loss_fn=loss_fn, example_targets=example_targets,
                      model_name=model_name or type(model).__name__)
    check_batch_norm_stats(batch_norm, PlanningError)
    whole = batch_norm == BatchNormStats.BATCH and has_batch_norm(graph)
    if microbatch_size is None:  # one microbatch per rank when BatchNorm needs the whole batch
        microbatch_size = max(1, graph.inputs[0][1].shape[0] // max(dp, 1)) if whole else 1
    if whole and pp > 1 and schedule != Schedule.GPIPE:
        raise PlanningError(f"pp={pp} with schedule {schedule!r} and a BatchNorm model: the "
                            "schedule needs a microbatch per stage, and each microbatch would "
                            "be normalised alone, not the whole batch one process normalises; "
                            "use schedule='gpipe' (the whole batch as one microbatch), or pass "
                            "batch_norm='microbatch' to normalise each microbatch as gradient "
                            "accumulation does")
    _check_axes(model, dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep), engine)
    plan = build_manual_plan(graph, mesh, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep,
                             microbatch_size=microbatch_size,
                             schedule=schedule, virtual_stages=virtual_stages,
                             recompute=recompute, sequence_parallel=sequence_parallel,
                             zero=zero, dtype=dtype, optimizer=optimizer,
                             vocab_parallel_cp=engine in STACKS,
                             stage_layers=stage_layers)
    plan = replace(plan, training=replace(plan.training, batch_norm=batch_norm))
    for why in batch_norm_rule(plan, whole):
        raise PlanningError(why)
    if recipe:
        plan = replace(plan, training=replace(plan.training, fp8_recipe=recipe))
    if engine in STACKS:
        return priced_for_stack(plan, graph, engine, model)
    # a plan Plan.from_json would refuse (e.g. 1F1B with fewer microbatches than stages) is
    # refused here, with the same reason (meshplan/support.py)
    check_plan(plan, PlanningError)
    _check_model_rules(plan, model)
    plan = choose_engine(plan, model, engine)
    _check_loss_rule(plan, model, loss_fn, example_targets, loss_reduction)
    return _priced_for_engine(plan, graph, engine)


def _check_axes(model: nn.Module | None, degrees: dict, engine: str) -> None:
    """The axis table's rules (meshplan/axes.py) for a hand-written layout, one line each:
    a plan priced for another stack is checked against the model only (that stack runs it)."""
    from meshplan import axes

    ctx = axes.AxisContext(degrees=degrees, engine=engine if engine in (Engine.MODULES, Engine.GRAPH) else "",
                           experts=axes.routed_experts(model) if model is not None else None)
    for axis in axes.AXES.values():
        if ctx.degree(axis.name) == 1:
            continue
        # the last rule is what meshplan's runtime runs: a stack's plan is run by the stack
        rules = axis.rules if engine not in STACKS else axis.rules[:-1]
        for i, rule in enumerate(rules):
            for why in rule(ctx):
                raise (NotSupportedError if i == len(axis.rules) - 1 else PlanningError)(why)


def check_fp8_recipe(recipe: str | None, dtype: str, engine: str, hardware) -> str:
    """The public fp8 recipe a plan of ``dtype`` priced for ``engine`` records: ``recipe``
    checked (one line: a recipe without dtype 'fp8', a name no engine of that family runs,
    hardware without fp8 tensor cores), or the engine's own under fp8, "" otherwise."""
    from meshplan.costmodel import fp8 as fp8_model
    from meshplan.costmodel.estimate import default_runtime

    if recipe is not None and dtype != ComputeDtype.FP8:
        raise PlanningError(f"fp8_recipe={recipe!r} with dtype {dtype!r}: a recipe says how "
                            "fp8 GEMMs scale; pass dtype='fp8' with it, or drop fp8_recipe")
    if dtype != ComputeDtype.FP8:
        return ""
    priced = engine if engine in STACKS else "torchtitan"  # fp8 is priced as a stack runs it
    if recipe is None:
        rt = default_runtime(hardware, engine=priced)
        recipe = fp8_model.public_recipe(rt.fp8_recipe, rt.fp8_all_gather)
    name, _ = fp8_model.recipe_for_engine(recipe, priced)
    fp8_model.check_fp8_hardware(hardware, name)
    return recipe


def _check_loss_rule(plan: Plan, model: nn.Module | None, loss_fn: Callable | None,
                     example_targets, reduction: str) -> None:
    """``loss_reduction`` on this plan's engine (meshplan/support.py), and a loss_fn with
    context parallelism on the module engine, which calls it on each rank's sequence chunk:
    it must split by position as ``reduction`` says (runtime/cp_modules.py
    ``loss_split_refusal``: its targets one value per position, and the chunks' weighted
    combination equal to the whole sequence's loss on random data)."""
    why = loss_reduction_rule(plan, reduction, loss_fn is not None)
    if why:
        raise PlanningError(why[0])
    cp = cp_degree(plan.stages[0])
    if loss_fn is None or cp == 1 or plan.engine != Engine.MODULES or model is None:
        return
    from meshplan.runtime.cp_modules import loss_split_refusal
    from meshplan.runtime.module_plan import model_output_shape

    targets = (example_targets,) if isinstance(example_targets, torch.Tensor) else \
        tuple(example_targets or ())
    why = loss_split_refusal(loss_fn, model_output_shape(plan, model), targets, reduction, cp)
    if why:
        raise PlanningError(why)


def _check_model_rules(plan: Plan, model: nn.Module | None) -> None:
    """The rules that read the model as well as the plan (meshplan/support.py), checked when
    the plan is made so that no plan fails at run time on them."""
    if model is None:
        return
    from meshplan.runtime.module_plan import heads_refusal

    stage = plan.stages[0]
    why = heads_refusal(model, dict(zip(stage.axis_names, stage.mesh_shape)).get("tp", 1))
    if why:
        raise PlanningError(why)


# what autoparallel / manual_plan / estimate take as engine=: "auto" (the module engine where
# it runs the plan), one of meshplan's engines, or a stack to price the plan as
ENGINE_CHOICES = ("auto", Engine.MODULES, Engine.GRAPH) + tuple(STACKS)


def priced_for_stack(plan: Plan, graph: OpGraph, stack: str, model: nn.Module | None = None) -> Plan:
    """``plan`` priced as another stack runs it (``costmodel.estimate.STACKS``: Megatron-LM /
    NeMo, torchtitan), a what-if estimate: it is priced whether or not meshplan's runtimes
    run it, and ``engine_note`` says whether they can by the plan's rules
    (meshplan/support.py; the model-specific checks of ``choose_engine``, which run the
    model on meta stage by stage, are left to ``manual_plan(engine='auto')``: minutes for a
    405B pipeline)."""
    from meshplan.costmodel.estimate import default_runtime, with_stage_predictions
    from meshplan.costmodel.hardware import HardwareProfile

    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    from meshplan.costmodel.runtime_profiles import with_fp8_recipe

    runtime = with_fp8_recipe(default_runtime(hw, engine=stack, pipeline=plan.num_stages > 1),
                              plan.training.fp8_recipe)
    problems = plan_problems(plan)
    ours = (f"meshplan's runtimes cannot run it ({problems[0]})" if problems else
            "meshplan can run this layout too: make the plan with engine='auto' "
            "(plan --engine auto) to run it with meshplan.parallelize")
    plan = with_stage_predictions(replace(plan, engine=stack), graph, runtime=runtime)
    return replace(plan, engine_note=f"priced as {STACKS[stack]} runs it; {ours}")


def choose_engine(plan: Plan, model: nn.Module | None, engine: str = "auto") -> Plan:
    """Record which runtime executes ``plan``: the module engine (PyTorch's composables)
    wherever the plan is expressible in it, the graph engine otherwise (with the reason).
    ``engine="graph"`` keeps the graph engine; ``"modules"`` insists on the module engine."""
    if engine not in ENGINE_CHOICES:
        raise PlanningError(f"engine={engine!r} is not one of {', '.join(ENGINE_CHOICES)}")
    ep = max(st.ep for st in plan.stages)
    if ep > 1 and (engine == Engine.GRAPH or model is None):
        raise NotSupportedError(f"ep={ep} on the graph engine: expert parallelism runs on the "
                                "module engine only; plan it with the model and engine='auto'")
    if engine == Engine.GRAPH or model is None:
        note = "chosen by the caller (engine='graph')" if engine == Engine.GRAPH else \
            "planned from a graph without its model"
        why = graph_engine_cp_refusal(plan.graph, plan.training.sequence_parallel) \
            if cp_degree(plan.stages[0]) > 1 else None
        if why:
            raise NotSupportedError(f"cp on the graph engine ({note}): {why}; the module "
                                    "engine runs it: pass the model and engine='auto'")
        pipeline_why = graph_engine_cp_rule(plan)
        if pipeline_why:
            raise NotSupportedError(f"{pipeline_why[0]} (graph engine {note})")
        return replace(plan, engine=Engine.GRAPH, engine_note=note)
    from meshplan.runtime.module_engine import module_engine_refusal

    reason = module_engine_refusal(plan, model)
    if reason and ep > 1:
        raise NotSupportedError(f"ep={ep} runs on the module engine only, which cannot run "
                                f"this plan: {reason.removesuffix('; the graph engine runs this plan')}")
    if reason and engine == Engine.MODULES:
        raise NotSupportedError(f"engine='modules': {reason}")
    if reason and cp_degree(plan.stages[0]) > 1:
        # context parallelism the graph engine cannot run either (meshplan/support.py)
        graph_why = graph_engine_cp_refusal(plan.graph, plan.training.sequence_parallel) or \
            next(iter(graph_engine_cp_rule(plan) + plan_problems(
                replace(plan, engine=Engine.GRAPH))), None)
        if graph_why:
            module = reason.removesuffix("; the graph engine runs this plan")
            raise NotSupportedError(f"{module}; nor can the graph engine: {graph_why}")
    return replace(plan, engine=Engine.GRAPH if reason else Engine.MODULES,
                   engine_note=reason or "")


def _priced_for_engine(plan: Plan, graph: OpGraph, engine: str) -> Plan:
    """The plan's predictions for the engine that runs it. The search prices the graph
    engine; a plan the module engine runs is re-priced with its runtime (prefetch and
    backward overlap, per-microbatch reduce-scatter, FSDP2's fp32 shards beside the gathered
    weights); under "auto" a plan that fits only
    as the graph engine runs it stays on the graph engine (DECISIONS 44)."""
    from meshplan.costmodel.estimate import with_stage_predictions

    if plan.engine == Engine.GRAPH:
        return plan
    priced = with_stage_predictions(plan, graph)
    if engine == "auto" and plan.predicted is not None and plan.predicted.fits \
            and not priced.predicted.fits and max(st.ep for st in plan.stages) == 1:
        return replace(plan, engine=Engine.GRAPH, engine_note=(
            f"the module engine needs {priced.predicted.peak_memory_gib:.1f} GiB per device "
            f"(its FSDP2 buffers and weight copies), over "
            f"{priced.predicted.memory_capacity_gib:.1f}"))
    return priced


def estimate(plan: Plan, graph: OpGraph | None = None, *, hardware=None,
             engine: str | None = None, compiled: bool = False,
             fp8_recipe: str | None = None) -> Estimate:
    """Predicted step time and memory of ``plan`` (made by autoparallel or manual_plan).

    The graph is ``plan.graph`` or the one passed (a plan read from a file carries none:
    re-trace the model with meshplan.trace and pass it; the fingerprints must agree).
    ``hardware`` (a HardwareProfile) re-prices the plan on other hardware; by default the
    profile recorded in the plan prices it. ``engine`` prices it for another runtime than
    the one it names: "graph", "modules", or a stack ("megatron" for Megatron-LM / NeMo,
    "torchtitan"). ``compiled``: price the repeated blocks as ``torch.compile`` runs them
    (``meshplan.parallelize(..., compile=True)`` on the module engine, torchtitan's
    ``compile.enable``): pointwise and reduction chains between matmuls fused into one
    kernel each (costmodel/fusion.py); default eager. The graph engine does not compile
    (``parallelize`` refuses ``compile=True`` there): for its plans this prices a what-if.
    ``fp8_recipe``: price an fp8 plan under another recipe than the one it records
    (``manual_plan``'s values). Never raises for memory (``fits`` says).
    """
    graph = graph if graph is not None else plan.graph
    if graph is None:
        raise NotSupportedError("estimating a plan loaded from a file needs its model: pass "
                                "graph=meshplan.trace(model, inputs) (or `meshplan estimate "
                                "plan.json --model SPEC`)")
    plan.check_model(graph.fingerprint)
    runtime = None
    compiled = compiled or plan.training.compiled
    if fp8_recipe is not None:
        from meshplan.costmodel.hardware import HardwareProfile

        hw = hardware or HardwareProfile.from_dict(plan.mesh.hardware)
        recipe = check_fp8_recipe(fp8_recipe, plan.training.dtype, engine or plan.engine, hw)
        plan = replace(plan, training=replace(plan.training, fp8_recipe=recipe))
    if engine is not None or compiled or plan.training.fp8_recipe:
        from meshplan.costmodel.estimate import PROFILES, default_runtime
        from meshplan.costmodel.hardware import HardwareProfile
        from meshplan.costmodel.runtime_profiles import with_compile, with_fp8_recipe

        if engine is not None and engine not in PROFILES:
            raise PlanningError(f"engine={engine!r} is not one of {', '.join(PROFILES)}")
        hw = hardware or HardwareProfile.from_dict(plan.mesh.hardware)
        runtime = with_fp8_recipe(
            with_compile(default_runtime(hw, engine=engine or plan.engine,
                                         pipeline=plan.num_stages > 1), compiled),
            plan.training.fp8_recipe)
    return estimate_plan(plan, graph, hw=hardware, runtime=runtime)
