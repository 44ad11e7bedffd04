"""The module engine's pipelines: a multi-stage plan run with ``torch.distributed.pipelining``
on stage modules cut from the user's own model.

trace -> cost -> solve -> plan -> **run**. torchtitan's way (``pipeline_llama``): every
(virtual) stage this rank holds is a copy of the user's model (a meta copy when the model is
on meta) with the blocks of the other stages deleted and the layers before the blocks
(embedding) or after them (final norm, head) replaced by ``nn.Identity`` where another stage
owns them; each stage module is then parallelized as runtime/modules.py parallelizes one
stage (``apply_tp``, ``apply_ac``, ``apply_fsdp`` over the stage's own dp x tp submesh) and
wrapped in a ``PipelineStage``; the plan's schedule (GPipe, 1F1B, interleaved 1F1B) drives
the microbatches. ``pipeline_refusal`` says why a plan cannot run this way (the graph engine,
runtime/graph/pipeline.py, then runs it); it runs every stage's forward on meta (DECISIONS 63), which is what
refuses a model whose forward does not run with its blocks removed (DECISIONS 49), and
``structure_refusal`` compares the stages' aten operators, module by module, with the whole
model's forward (a cut that drops or repeats a module keeps every shape: issue 42).
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from meshplan import support
from meshplan.axes import EP_AXIS, ROUTED, find_experts
from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.plan import Plan
from meshplan.schedules import virtual_stages_for
from meshplan.runtime import cp_modules, loss_weights
from meshplan.runtime.modules import (ModuleEngineBase, _dp_cp_mesh, apply_ac, apply_fsdp,
                                      apply_tp, clean_fqn, compile_blocks, runtime_step,
                                      to_empty_keeping_ties)
from meshplan.runtime.expert_parallel import ep_mesh
from meshplan.runtime.module_plan import (_as_tracers_see_it, _axes, _call, _Forward, _meta_inputs,
                                          check_model, fused_refusal, run_on_meta, stage_refusal,
                                          tp_styles)
from meshplan.runtime.shared import COMPUTE_DTYPES, TORCH_SCHEDULES, broadcast_from_last, meta_copy
from meshplan.tracing import find_block_paths, next_token_loss
from meshplan.vocabulary import Recompute

_ROOT = "module."  # the stage wrapper's attribute in front of every FQN


# -- the split (pure) --------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageCut:
    """What virtual stage ``index`` keeps of the model."""

    index: int
    record: int  # the plan's stage record (zero, recompute) for this stage
    blocks: tuple[str, ...]  # keys kept in the blocks' container (with their activations)
    first: bool  # keeps the modules before the blocks (embedding)
    last: bool  # keeps the modules after the blocks (norm, head)


def single_stage_view(plan: Plan) -> Plan:
    """The plan as one stage with every stage's parameters: what the tensor-parallel styles
    and the single-stage checks read (every stage shares one submesh shape)."""
    params: dict = {}
    for st in plan.stages:
        params.update(st.params)
    return replace(plan, stages=(replace(plan.stages[0], params=params),))


def _layout(plan: Plan) -> tuple[int, int]:
    """(rank groups pp, virtual stages per group v)."""
    v = virtual_stages_for(plan.training.schedule, plan.training.virtual_stages)
    return support.pipeline_degree(plan), v


def _outer_owners(model: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Modules holding parameters outside the blocks, registered before / after them."""
    before, after, seen = [], [], False
    for name, mod in model.named_modules():
        if name == container:
            seen = True
            continue
        # the blocks' container at the root (an nn.Sequential of layers) holds every module
        inside = not container or name.startswith(container + ".")
        if inside or not any(True for _ in mod.parameters(recurse=False)):
            continue
        (after if seen else before).append(name)
    return before, after


def stage_cuts(plan: Plan, model: nn.Module) -> tuple[str, list[StageCut]]:
    """(blocks' container, one cut per virtual stage); raises NotSupportedError with the
    reason when the model does not split along the plan's stages."""
    paths = find_block_paths(model)
    parents = {p.rpartition(".")[0] for p in paths}
    if not paths or len(parents) != 1:
        raise NotSupportedError(f"the model has {len(parents)} stacks of repeated blocks; the "
                                "module engine cuts pipeline stages from one stack")
    container = parents.pop()
    keys = [p.rpartition(".")[2] for p in paths]
    pp, v = _layout(plan)
    n = pp * v
    if plan.num_stages == n:  # one record per virtual stage: its layer range
        ranges = [tuple(st.layers) for st in plan.stages]
    elif len(keys) % n == 0:
        ranges = [(j * len(keys) // n, (j + 1) * len(keys) // n) for j in range(n)]
    else:
        raise NotSupportedError(f"{len(keys)} blocks do not split into pp x virtual_stages = {n} "
                                "equal stages")
    if ranges[0][0] != 0 or ranges[-1][1] != len(keys) or \
            any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise NotSupportedError(f"stage layer ranges {ranges} are not contiguous over the "
                                f"{len(keys)} blocks")
    kept = _members(model.get_submodule(container), keys, ranges)
    cuts = [StageCut(j, j if plan.num_stages == n else j % pp, kept[j], j == 0, j == n - 1)
            for j in range(n)]
    _check_against_plan(plan, model, container, cuts)
    return container, cuts


def _members(holder: nn.Module, keys: list[str], ranges) -> list[tuple[str, ...]]:
    """The container's children each stage keeps, in order: its blocks and the children
    without parameters that follow each of them (the activation modules between the layers
    of an nn.Sequential: ``Linear, GELU, Linear``), those before the first block with the
    first stage. Dropping them would run the layers back to back: a different function,
    with the shapes unchanged (issue 42)."""
    stage_of = {k: j for j, (a, b) in enumerate(ranges) for k in keys[a:b]}
    kept: list[list[str]] = [[] for _ in ranges]
    owner = 0
    for key in holder._modules:
        owner = stage_of.get(key, owner)
        kept[owner].append(key)
    return [tuple(k) for k in kept]


def _check_against_plan(plan: Plan, model: nn.Module, container: str, cuts) -> None:
    """Every parameter goes to the stage whose record lists it, and no weight is shared by
    two stages (a tied embedding and head would need a gradient exchange)."""
    before, after = _outer_owners(model, container)
    stage_of_module = {m: 0 for m in before} | {m: len(cuts) - 1 for m in after}
    for cut in cuts:
        for key in cut.blocks:
            stage_of_module[f"{container}.{key}" if container else key] = cut.index
    where: dict[int, set[int]] = {}
    # records per rank group (interleaved, as manual.py writes them) list contiguous layers,
    # not the interleaved assignment: only per-stage records are checked
    planned = single_stage_view(plan).stages[0].params if plan.num_stages == len(cuts) else {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            owner = next((s for m, s in stage_of_module.items()
                          if mname == m or mname.startswith(m + ".")), None)
            if owner is None:
                raise NotSupportedError(f"parameter {mname}.{pname} is in no pipeline stage")
            where.setdefault(id(p), set()).add(owner)
            fqn = f"{mname}.{pname}" if mname else pname
            record = plan.stages[cuts[owner].record]
            if fqn in planned and fqn not in record.params:
                raise NotSupportedError(f"{fqn} runs in stage {owner} of the module split but "
                                        f"the plan places it in another stage")
    shared = [s for s in where.values() if len(s) > 1]
    if shared:
        raise NotSupportedError(f"a weight is shared by pipeline stages {sorted(shared[0])} "
                                "(tied embedding and head); the graph engine runs this plan")


def cut_stage(model: nn.Module, container: str, cut: StageCut) -> nn.Module:
    """A copy of ``model`` holding only ``cut``'s part; parameter names unchanged."""
    on_meta = any(t.is_meta for t in model.parameters())
    if on_meta:
        stage = meta_copy(model)
    else:
        stage = copy.deepcopy(model)
    holder = stage.get_submodule(container)
    for key in list(holder._modules):  # private _modules: ModuleList's __delitem__ renumbers
        if key not in cut.blocks:
            del holder._modules[key]
    before, after = _outer_owners(model, container)
    gone: list[str] = []
    for name in (before if not cut.first else []) + (after if not cut.last else []):
        if any(name.startswith(g + ".") for g in gone):
            continue
        gone.append(name)
        parent, _, leaf = name.rpartition(".")
        gone_module = nn.Identity()
        if not cut.first and isinstance(stage.get_submodule(name), nn.Embedding):
            gone_module = LaterStageEmbedding()
        setattr(stage.get_submodule(parent) if parent else stage, leaf, gone_module)
    return stage


class LaterStageEmbedding(nn.Identity):
    """An embedding of the first stage, in a later stage's copy of the model's forward: the
    hidden states the stage receives pass through (where the token embedding read the
    ids), and an embedding of integers computed inside the forward (learned positions of
    ``torch.arange(t)``, nanoGPT's ``wpe``) adds nothing, its term already in the hidden
    states. ``pipeline_refusal`` checks in the traced graph that such an embedding's output
    is only added (``added_embeddings_refusal``). An nn.Identity, so that the stage's
    tensor-parallel styles and FSDP skip it as they skip the other removed modules."""

    def forward(self, x):
        if x.is_floating_point():
            return x
        return torch.zeros((), dtype=torch.get_default_dtype(), device=x.device)


def added_embeddings_refusal(plan: Plan, model: nn.Module) -> str | None:
    """An nn.Embedding that does not read a model input (positions from ``torch.arange``)
    must only be added to (``LaterStageEmbedding`` stands for it in later stages as zero);
    read from the plan's traced graph (no graph: not checked)."""
    graph = plan.graph
    if graph is None:
        return None
    inputs = {name for name, _ in graph.inputs}
    users = graph.users
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Embedding):
            continue
        for node in graph.nodes:
            if f"{name}.weight" not in node.params or node.kind != "embedding":
                continue
            if any(i in inputs for i in node.inputs):
                continue
            bad = [u for u in users.get(node.name, ()) if not graph.node(u).target.startswith(
                "aten.add")]
            if bad:
                return (f"{name} embeds positions computed in the forward and its output "
                        f"goes to {graph.node(bad[0]).target}, not only to an add; a later "
                        "pipeline stage cannot stand in for it; the graph engine runs this plan")
    return None


class StageModule(nn.Module):
    """A stage as ``PipelineStage`` sees it: tensors in, one tensor out (``.logits`` of an HF
    output). Later stages feed the hidden states through the Identity embedding."""

    def __init__(self, module: nn.Module, autocast: torch.dtype | None = None, *,
                 sequence_mesh=None, first: bool = True):
        super().__init__()
        self.module = module
        self.autocast = autocast  # the compute dtype where no fully_shard casts the weights
        # sequence parallelism: the residual stream is a DTensor split by sequence over
        # ``sequence_mesh`` (the tp submesh); it crosses stages as this rank's rows
        self.sequence_mesh, self.first = sequence_mesh, first
        # context parallelism: this rank's global positions while a cp step runs (set by
        # PipelineModuleEngine), given to models that take position_ids
        self.cp_positions: torch.Tensor | None = None

    def forward(self, *args):
        if self.sequence_mesh is not None and not self.first:
            args = tuple(DTensor.from_local(a, self.sequence_mesh, [Shard(1)], run_check=False)
                         if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
        kwargs = {} if self.cp_positions is None or len(args) != 1 else \
            cp_modules.call_kwargs(self.module, self.cp_positions, args[0].shape[0], {})
        if self.autocast is None:
            out = _call(self.module, args, kwargs)
        else:
            with torch.autocast(args[0].device.type, dtype=self.autocast):
                out = _call(self.module, args, kwargs)
        return out.to_local() if isinstance(out, DTensor) else out


def model_pipeline_refusal(model: nn.Module, roles: list) -> str | None:
    """Why the module engine runs no pipeline of ``model`` called with inputs of these
    ``roles`` (planner/assemble.model_info's), whatever the plan; None when some may run."""
    stats = next((n for n, m in model.named_modules()
                  if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats),
                 None)
    if stats is not None:
        return (f"{stats} keeps running statistics, which a pipeline stage would update per "
                "data-parallel shard; the graph engine computes them over the global batch")
    if "kwarg" in roles or roles.count("target") > 1:
        return ("the plan's call has keyword inputs or several targets; module-engine pipelines "
                "feed positional inputs to the first stage and one target to the loss")
    return None


def pipeline_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why a multi-stage plan cannot run on the module engine; None when it can."""
    t = plan.training
    if t.schedule not in TORCH_SCHEDULES:
        return f"schedule {t.schedule} has no torch.distributed.pipelining schedule here"
    ep, (_, virtual) = max(st.ep for st in plan.stages), _layout(plan)
    if ep > 1 and virtual > 1:
        return (f"ep={ep} with {virtual} virtual stages per rank ({t.schedule}): expert "
                "parallelism inside interleaved pipelines is not checked against one process "
                "yet; use a schedule with one stage per rank (1f1b, gpipe) with ep")
    if len({(tuple(s.mesh_shape), tuple(s.axis_names)) for s in plan.stages}) != 1:
        return "pipeline stages on submeshes of different shapes"
    why = model_pipeline_refusal(model, [r.get("role") for r in plan.model.inputs])
    if why:
        return why
    view = single_stage_view(plan)
    why = stage_refusal(view, model) or fused_refusal(view, model) or \
        added_embeddings_refusal(plan, model)
    if why:
        return why
    try:
        container, cuts = stage_cuts(plan, model)
    except NotSupportedError as exc:
        return str(exc)
    return _forward_with_blocks_removed(plan, model, container, cuts, _meta_inputs)


def _routed_by_shape(hidden_states, top_k_index, top_k_weights):
    """A routed-expert module's output as its shape and its inputs' dependence: what the meta
    runs below need of it (meshplan/axes.py ``ROUTED``: the output has the hidden states'
    shape; ``ExpertParallel`` relies on the same)."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def _meta_model(model: nn.Module) -> nn.Module:
    """A meta copy of ``model`` for the stage checks, its routed-expert modules computing by
    shape (``_routed_by_shape``). transformers' eager experts loop over the experts hit
    (``nonzero``, then a Python loop over its rows): a count that meta tensors and the
    export's unbacked sizes cannot give, so the check refused every such MoE model
    (GuardOnDataDependentSymNode) though the stages run it on real tensors. The experts sit
    inside a block and see the same inputs whatever the cut, so the check loses nothing:
    the whole model and its stages are run with the same stand-in."""
    copy_ = meta_copy(model)
    for name, (kind, _) in find_experts(copy_).items():
        if kind == ROUTED:
            copy_.get_submodule(name).forward = _routed_by_shape
    return copy_


def _forward_with_blocks_removed(plan, model, container, cuts, meta_inputs) -> str | None:
    """Run every stage's forward on meta, feeding each the previous one's output: the last
    must give what the whole model gives."""
    stage = plan.stages[0]
    dp, _, _ = _axes(stage)
    x = meta_inputs(plan, stage.mesh_shape[dp] if dp is not None else 1)
    if x is None:
        return "the plan records no inputs to run the stages on"
    # the stages take the positional inputs only (flat order: arguments, then targets)
    roles = [r.get("role") for r in plan.model.inputs]
    x = x[:roles.count("arg")] if "arg" in roles else x
    inputs = x
    try:
        whole = run_on_meta(_Forward(_meta_model(model)), x)
        for cut in cuts:
            out = run_on_meta(StageModule(cut_stage(_meta_model(model), container, cut)), x)
            x = (torch.empty(out.shape, dtype=out.dtype, device="meta"),)
    except Exception as exc:  # noqa: BLE001 - any failure means "cannot run cut"
        return (f"the model's forward fails with blocks removed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); the graph engine runs this plan")
    if tuple(out.shape) != tuple(whole.shape):
        return (f"the last stage gives shape {list(out.shape)}, the whole model "
                f"{list(whole.shape)}; the graph engine runs this plan")
    return structure_refusal(model, container, cuts, inputs)


# -- the structural self-check (issue 42) ------------------------------------------------------

class _OpsByUnit(TorchDispatchMode):
    """Counts the aten operators each unit runs: a unit is a member of the blocks' container
    (a block, or an activation module between blocks) or a module outside the blocks that
    holds parameters (embedding, final norm, head), named as in the user's model. Operators
    outside every unit (the root forward's positions and masks, which each stage recomputes
    for itself; rotary tables) are not counted."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.counts: Counter = Counter()
        self.handles: list = []

    def watch(self, model: nn.Module, units: list[str]) -> None:
        for unit in units:
            try:
                mod = model.get_submodule(unit)
            except AttributeError:  # not in this stage
                continue
            if isinstance(mod, LaterStageEmbedding):  # a removed embedding's stand-in: adds zero
                continue
            self.handles.append(mod.register_forward_pre_hook(self._enter(unit)))
            self.handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, unit: str):
        def hook(module, args) -> None:
            self.stack.append(unit)
        return hook

    def _leave(self, module, args, out) -> None:
        self.stack.pop()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stack:
            self.counts[(self.stack[-1], str(func.overloadpacket))] += 1
        return func(*args, **(kwargs or {}))


def _first_tensor(out):
    out = out.logits if hasattr(out, "logits") else out
    return next((t for t in torch.utils._pytree.tree_leaves(out)
                 if isinstance(t, torch.Tensor)), None)


def _record(boundary: dict, name: str):
    def hook(module, args, out) -> None:
        boundary[name] = tuple(_first_tensor(out).shape)
    return hook


def structure_refusal(model: nn.Module, container: str, cuts, x: tuple) -> str | None:
    """The stages, run on meta one after another as the schedule runs them, must execute the
    model's operators: for every unit (``_OpsByUnit``) and aten operator, as many calls over
    all stages as the whole model's forward makes, and each stage must hand on a value of the
    shape the whole model has at that boundary (the output of the stage's last container
    member). A stage that drops or repeats a module (an activation between the layers of an
    nn.Sequential, issue 42) is refused here, when the plan is made: the graph engine runs
    the plan. A forward that does not run eagerly on meta (it was exported instead, see
    ``run_on_meta``) gives no evidence here; the shape check above still applies."""

    before, after = _outer_owners(model, container)
    members = [f"{container}.{k}" if container else k for cut in cuts for k in cut.blocks]
    holder = model.get_submodule(container)
    members += [f"{container}.{k}" if container else k for k in holder._modules
                if (f"{container}.{k}" if container else k) not in members]
    units = [*before, *members, *after]
    boundary: dict[str, tuple] = {}
    whole_ops = _OpsByUnit()
    try:
        with _as_tracers_see_it():
            ref = _meta_model(model)
            whole_ops.watch(ref, units)
            for cut in cuts[:-1]:
                last = f"{container}.{cut.blocks[-1]}" if container else cut.blocks[-1]
                ref.get_submodule(last).register_forward_hook(_record(boundary, last))
            with whole_ops:
                _Forward(ref)(*x)
            stage_ops: Counter = Counter()
            for cut in cuts:
                part = cut_stage(_meta_model(model), container, cut)
                ops = _OpsByUnit()
                ops.watch(part, units)
                with ops:
                    out = _first_tensor(StageModule(part)(*x))
                ops.close()
                stage_ops.update(ops.counts)
                if not cut.last:
                    last = f"{container}.{cut.blocks[-1]}" if container else cut.blocks[-1]
                    if tuple(out.shape) != boundary.get(last):
                        return (f"stage {cut.index} hands on shape {list(out.shape)} where the "
                                f"model has {list(boundary.get(last, ()))} after {last}; the "
                                "graph engine runs this plan")
                # as the schedule hands it on: an activation that requires grad (autograd
                # state changes which aliasing operators some code dispatches)
                x = (torch.empty(out.shape, dtype=out.dtype, device="meta",
                                 requires_grad=out.requires_grad),)
    except Exception:  # noqa: BLE001 - not eagerly runnable on meta: no structural evidence
        return None
    finally:
        whole_ops.close()
    for key in sorted(set(whole_ops.counts) | set(stage_ops)):
        want, got = whole_ops.counts[key], stage_ops[key]
        if want != got:
            unit, op = key
            kind = type(model.get_submodule(unit)).__name__
            return (f"the pipeline stages run {op} in module {unit!r} ({kind}) {got} time(s), "
                    f"the model's forward {want} (the stage cut "
                    f"{'drops' if got < want else 'repeats'} it); the graph engine runs this plan")
    return None


# -- the engine ------------------------------------------------------------------------------

class PipelineModuleEngine(ModuleEngineBase):
    """A multi-stage plan on stage modules cut from ``model`` (this rank's stages only), run by
    a torch.distributed.pipelining schedule; runtime/engine.py's ``Engine`` (ModuleEngineBase)."""

    def __init__(self, model: nn.Module, plan: Plan, *, loss_fn=None, device=None,
                 compile: bool = False):

        view = single_stage_view(plan)
        check_model(view, model)
        reason = pipeline_refusal(plan, model)
        if reason:
            raise NotSupportedError(f"plan not expressible in the module engine: {reason}")
        self.plan, self.loss_fn = plan, loss_fn
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        pp, v = _layout(plan)
        st = plan.stages[0]
        world = init_device_mesh(self.device.type, (pp, *st.mesh_shape),
                                 mesh_dim_names=("pp", *st.axis_names))
        self.pp_group = world["pp"].get_group()
        pp_rank = world["pp"].get_local_rank()
        dp, tp, _ = _axes(st)
        self.dp_axis = st.axis_names[dp] if dp is not None else None
        self.dp_size = st.mesh_shape[dp] if dp is not None else 1
        self.dp_rank = world[self.dp_axis].get_local_rank() if self.dp_axis else 0
        self.dp_group = world[self.dp_axis].get_group() if self.dp_size > 1 else None
        styles, _ = tp_styles(view, model)
        # context parallelism inside each stage (runtime/cp_modules.py): weights sharded and
        # gradients reduced over dp x cp; activations cross stages as this rank's chunks
        self.cp_mesh = world["cp"] if support.cp_degree(st) > 1 else None
        fsdp_mesh = _dp_cp_mesh(world, self.dp_axis) if self.cp_mesh is not None else \
            (world[self.dp_axis] if self.dp_size > 1 else None)
        self.fsdp_mesh = fsdp_mesh
        container, cuts = stage_cuts(plan, model)
        on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self._unset_buffers = {n for n, b in model.named_buffers() if b.is_meta}
        self.stages, self.modules = [], []
        # expert parallelism inside each stage (meshplan/axes.py EP_AXIS): the stage's MoE
        # layers split over the ep ranks of its dp axis (one mesh for every stage of this rank,
        # built by every rank alike); one gradient reducer per stage, run once per step
        self.expert_grads = []
        experts_mesh = ep_mesh(st, self.device.type, pp=pp) if st.ep > 1 else None
        mine = [c for c in cuts if c.index % pp == pp_rank]
        for cut in mine:
            part = cut_stage(model, container, cut)
            if not on_meta:
                part.to(self.device)
            names = {n for n, m in part.named_modules() if not isinstance(m, nn.Identity)}
            if tp is not None and styles:
                apply_tp(part, world[st.axis_names[tp]],
                         {k: s for k, s in styles.items() if k in names})
            ignored = None
            if experts_mesh is not None:
                grads = runtime_step(EP_AXIS)(part, st, mesh=experts_mesh,
                                              device_type=self.device.type)
                self.expert_grads.append(grads)
                ignored = set(grads.params)
            record = plan.stages[cut.record]
            if record.recompute != Recompute.NONE:
                apply_ac(part, record.recompute, blocks=container)
            if compile:
                compile_blocks(part, container)
            # bf16: fully_shard's MixedPrecisionPolicy casts the weights (fp32 gradient
            # reduction), or autocast where there is no data parallelism; activations and
            # their gradients cross the stages in the dtype the stage computes them in
            compute = COMPUTE_DTYPES[plan.training.dtype]
            sp = tp is not None and bool(styles) and plan.training.sequence_parallel
            wrapped = StageModule(part, autocast=compute if fsdp_mesh is None else None,
                                  sequence_mesh=world[st.axis_names[tp]] if sp else None,
                                  first=cut.first)
            if fsdp_mesh is not None:
                apply_fsdp(wrapped, fsdp_mesh, zero=record.zero,
                           param_dtype=compute, blocks=(_ROOT + container).rstrip("."),
                           ignored_params=ignored)
            if on_meta:
                to_empty_keeping_ties(wrapped, self.device)
            self.modules.append(wrapped)
            self.stages.append(PipelineStage(wrapped, cut.index, len(cuts), self.device,
                                             group=self.pp_group))
        self.has_first = any(c.first for c in mine)
        self.has_last = any(c.last for c in mine)
        n = plan.training.microbatches
        cls = TORCH_SCHEDULES[plan.training.schedule]
        self.schedule = cls(self.stages if cls is ScheduleInterleaved1F1B else self.stages[0],
                            n_microbatches=n, loss_fn=self._loss)
        self._targets_mode = None
        self._labels = None  # this step's labelled-target table (train_step)

    # -- training ------------------------------------------------------------------------
    def _loss(self, out, target):
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out = out.float() if out.is_floating_point() else out
        mode, = self._targets_mode
        if mode == "none":  # forward only: no loss is wanted
            return torch.zeros((), device=out.device)
        if mode == "cp":  # this chunk's summed loss, weighted (cp_modules.pipeline_train_step)
            summed = cp_modules.chunk_loss_sum(out, target) if self.loss_fn is None else \
                cp_modules.chunk_loss(out, (target,), self.loss_fn, self.loss_reduction,
                                      cp_modules.row_totals_over(self.cp_mesh))
            self._cp_sums.append(summed.detach())
            return summed * self._cp_scale
        if self._labels is not None and mode in ("fn", "ce"):
            # this microbatch's share of the global labelled mean (runtime/loss_weights.py);
            # the schedule divides by n and FSDP averages over dp, hence n * dp
            n, labelled = self.plan.training.microbatches, loss_weights.count(target)
            if not labelled:  # a zero loss, not the NaN of a mean over no targets
                return out.sum() * 0.0
            w = n * self.dp_size * labelled / float(self._labels.sum())
            return w * (self.loss_fn(out, target) if mode == "fn" else
                        F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1)))
        if mode == "fn":
            return self.loss_fn(out, target)
        if mode == "fn0":  # loss_fn(outputs) without targets; the target was only a carrier
            return self.loss_fn(out)
        if mode == "ce":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
        return next_token_loss(out, target)

    def train_step(self, args: tuple, kwargs: dict | None = None, targets: tuple = (),
                   labels: torch.Tensor | None = None) -> float:
        """Every microbatch through the schedule; gradients synced (FSDP on the last
        microbatch); the global mean loss on every rank. ``labels``: labelled targets per
        data-parallel rank and microbatch, which weigh the microbatches' losses. The expert
        shards' gradients (ep inside the stages) are reduced once, after every microbatch's
        backward (runtime/expert_parallel.py ``ExpertGrads``)."""
        for grads in self.expert_grads:
            grads.stash()
        loss = self._train_step(args, kwargs, targets, labels)
        for grads in self.expert_grads:
            grads.reduce()
        return loss

    def _train_step(self, args: tuple, kwargs: dict | None, targets: tuple,
                    labels: torch.Tensor | None) -> float:
        self._check_buffers()
        self._labels = labels
        if kwargs or len(targets) > 1:
            raise NotSupportedError("module-engine pipelines take positional inputs and at most "
                                    "one target tensor (loss_fn(outputs, target)); the graph "
                                    "engine runs other calls")
        if self.cp_mesh is not None:
            return cp_modules.pipeline_train_step(self, args, targets)
        n = self.plan.training.microbatches
        for i, x in enumerate([*args, *targets]):
            if isinstance(x, torch.Tensor) and x.shape[0] % n:
                raise PlanFileError(f"input {i} has {x.shape[0]} rows, which do not split into "
                                    f"the plan's {n} microbatches; pass this rank's shard of a "
                                    f"batch divisible by {n}")
        self._targets_mode = (("fn",) if targets else ("fn0",)) if self.loss_fn is not None \
            else ("ce",) if targets else ("lm",)
        target = (targets[0] if targets else args[0]).to(self.device)
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        losses: list = []
        self.schedule.step(*(args if self.has_first else ()),
                           target=target if self.has_last else None,
                           losses=losses if self.has_last else None)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.has_last:
            total += torch.stack([x.detach().double() for x in losses]).mean()
        total /= self.dp_size
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's ranks add a loss
        return float(total.item())

    def forward(self, args: tuple, kwargs: dict | None = None):
        """Forward only: every microbatch through the stages by the schedule's own
        forward-only pass (``schedule.eval``: no backward, no gradients kept), the outputs of
        this rank's data-parallel shard merged on the last stage and broadcast from it to
        the other stages' ranks of its pipeline lane, so every rank returns its shard's
        outputs (full over tensor parallel)."""
        self._check_buffers()
        if kwargs:
            raise NotSupportedError("module-engine pipelines take positional inputs; the graph "
                                    "engine runs calls with keyword inputs")
        n = self.plan.training.microbatches
        for i, x in enumerate(args):
            if isinstance(x, torch.Tensor) and x.shape[0] % n:
                raise PlanFileError(f"input {i} has {x.shape[0]} rows, which do not split into "
                                    f"the plan's {n} microbatches; pass this rank's shard of a "
                                    f"batch divisible by {n}")
        args = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args)
        # the last stage still calls the schedule's loss; ("none",) makes it a constant (the
        # first input only carries the microbatch split to it)
        self._targets_mode = ("none",)
        region = cp_modules.pipeline_region(self, [args[0]]) if self.cp_mesh is not None else \
            contextlib.nullcontext([args[0]])
        with torch.no_grad(), region as (first,):
            out = self.schedule.eval(*((first, *args[1:]) if self.has_first else ()),
                                     target=first if self.has_last else None)
        if self.has_last:
            out = out.full_tensor() if isinstance(out, DTensor) else out
            out = out.contiguous()
            if self.cp_mesh is not None:  # the chunks gathered into natural order
                out = cp_modules.unshard(self.cp_mesh, out, causal=True)
        return broadcast_from_last(out if self.has_last else None, self.pp_group, self.device)

    __call__ = forward

    def train(self, mode: bool = True) -> "PipelineModuleEngine":
        for m in self.modules:
            m.train(mode)
        return self

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {clean_fqn(n.removeprefix(_ROOT)): p for m in self.modules
                for n, p in m.named_parameters() if p.requires_grad}

    def _state_modules(self) -> list[tuple[str, nn.Module]]:
        return [(_ROOT, m) for m in self.modules]

    def init_weights(self, fn) -> None:
        with torch.no_grad():
            for m in self.modules:
                fn(m.module)
        self._unset_buffers.clear()
