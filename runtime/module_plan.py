"""Which single-stage plans the module engine (runtime/modules.py) can run, and as which
tensor-parallel styles. Pure: no process group.

trace -> cost -> solve -> plan -> **run**. ``tp_styles`` reads the plan's parameter placements
on the tensor-parallel axis as ``parallelize_module`` styles (a dict from module FQN to a
style, torchtitan's form); ``stage_refusal`` says why a plan cannot run that way, and
checks the user's forward on local shards by running it on meta (DECISIONS 63) with every sharded weight
at its local shape and the styles' input/output shapes (DECISIONS 27).
"""

from __future__ import annotations

import contextlib
import inspect
import shutil

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleOutput,
                                               RowwiseParallel,
                                               SequenceParallel)

from meshplan import axes, support
from meshplan.context import attention_calls
from meshplan.runtime.cp_modules import AttentionCalls
from meshplan.errors import PlanFileError
from meshplan.plan import Plan, Stage
from meshplan.graph import CallSignature
from meshplan.tracing import find_repeated_blocks, unflatten_call
from meshplan.runtime.engine import data_parallel_axes
from meshplan.runtime.shared import meta_copy
from meshplan.vocabulary import ENGINE_DTYPES, Engine, Recompute
from meshplan.placements import PARTIAL, REPLICATE, is_shard, shard
from meshplan.runtime.fused_parts import fused_layers



# -- the plan as tensor-parallel styles (pure) -------------------------------------------------

def _axes(stage: Stage) -> tuple[int | None, int | None, str | None]:
    """(data-parallel axis, tensor-parallel axis, refusal): at most one of each of size > 1."""
    dp = [a for a in data_parallel_axes(stage) if stage.mesh_shape[a] > 1]
    tp = [a for a, n in enumerate(stage.mesh_shape) if n > 1 and a not in data_parallel_axes(stage)
          and stage.axis_names[a] != "cp"]  # the context-parallel axis: runtime/cp_modules.py
    if len(dp) > 1 or len(tp) > 1:
        return None, None, (f"mesh {stage.mesh_shape} {stage.axis_names} has more than one "
                            "data-parallel or tensor-parallel axis of size > 1; the module engine "
                            "runs one of each (dp x tp)")
    dp_axis = dp[0] if dp else (data_parallel_axes(stage) or (None,))[0]
    return dp_axis, (tp[0] if tp else None), None


def _placement_of(stage: Stage, model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Planned placements by parameter identity (tied parameters share one entry)."""
    out = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if fqn in stage.params:
            out[id(p)] = tuple(stage.params[fqn])
    return out


def tp_styles(plan: Plan, model: nn.Module) -> tuple[dict, str | None]:
    """(module FQN -> ParallelStyle on the tensor-parallel axis, refusal reason or None).

    nn.Linear weight S(0) -> ColwiseParallel (bias S(0)), S(1) -> RowwiseParallel (bias R);
    nn.Embedding S(0) -> RowwiseParallel(input_layouts=Replicate()) (vocab-parallel),
    S(1) -> ColwiseParallel. A column-parallel nn.Linear that no row-parallel layer follows
    (the output head, the last layer of an nn.Sequential) gathers its output (Replicate), so
    the user's ``loss_fn`` sees whole outputs (``_gather_unpaired``). With sequence
    parallelism (Megatron's, Korthikanti et al. 2022) the residual stream is split by
    sequence (dim 1) between the layers: the embedding and row-parallel layers reduce-scatter
    to Shard(1), the norms on the residual stream (tp-replicated weights of the embedding's
    width) are SequenceParallel, all three leaving a DTensor (global shapes for the user's
    code); the module owning a block's column-parallel layers gathers the sequence once on
    entry (``GatherSequence``), and a column-parallel layer owned by the block or outside the
    blocks (the head) all-gathers its own Shard(1) input (DECISIONS 60)."""
    stage = plan.stages[0]
    _, tp, why = _axes(stage)
    if why or tp is None:
        return {}, why
    placed = _placement_of(stage, model)
    blocks, _ = find_repeated_blocks(model)
    owners = {}  # id(param) -> owning module FQNs
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mname, mod, pname))
    sp = plan.training.sequence_parallel
    # the residual stream stays a DTensor sharded by sequence (use_local_output=False): the
    # user's code between the layers then reads the global sequence length (HF Llama sizes
    # its positions, rotary table and mask from it) while each rank holds s / tp rows
    seq = dict(output_layouts=Shard(1), use_local_output=False) if sp else {}
    into = dict(input_layouts=Shard(1)) if sp else {}
    styles: dict = {}
    tied = ""  # reported after every layer's style is known: a missing style says more
    for fqn, p in model.named_parameters():
        if id(p) not in placed:
            return {}, f"the plan places no parameter {fqn}; re-plan this model"
        on_tp = placed[id(p)][tp]
        if on_tp == REPLICATE:
            continue
        mname, mod, pname = owners[id(p)][0]
        weight = placed.get(id(getattr(mod, "weight", None)), ())
        bias = getattr(mod, "bias", None)
        bias_tp = placed.get(id(bias), (REPLICATE,) * len(stage.mesh_shape))[tp] \
            if bias is not None else None
        w_tp = weight[tp] if weight else REPLICATE
        style = None
        if isinstance(mod, nn.Linear) and w_tp == shard(0) and bias_tp in (None, shard(0)):
            style = ColwiseParallel(**into)  # its output layout: _gather_unpaired below
        elif isinstance(mod, nn.Linear) and w_tp == shard(1) and bias_tp in (None, REPLICATE):
            style = RowwiseParallel(**seq)
        elif isinstance(mod, nn.Embedding) and w_tp == shard(0):
            style = RowwiseParallel(input_layouts=Replicate(), **seq)
        elif isinstance(mod, nn.Embedding) and w_tp == shard(1):
            style = ColwiseParallel(input_layouts=Replicate(), **(seq or dict(
                output_layouts=Replicate())))
        if style is None:
            return {}, (f"{mname}.{pname} is {on_tp} on the tensor-parallel axis (weight "
                        f"{w_tp}, bias {bias_tp}) in a {type(mod).__name__}; the module engine "
                        "maps only nn.Linear weight S(0)/S(1) with bias S(0)/R and nn.Embedding "
                        "S(0)/S(1) to ColwiseParallel/RowwiseParallel; the graph engine runs it")
        if len(owners[id(p)]) > 1 and not tied:
            tied = (f"{fqn} is tied to {owners[id(p)][1][0]} and {on_tp} on the "
                    "tensor-parallel axis; parallelize_module would untie it")
        size = p.shape[int(on_tp[2:-1])]
        if size % stage.mesh_shape[tp]:
            return {}, (f"{fqn} dim of size {size} is not divisible by tp="
                        f"{stage.mesh_shape[tp]}; choose a tp that divides it")
        styles[mname] = style
    if tied:
        return {}, tied
    probe = forward_probe(plan, model, set(styles))
    _gather_unpaired(styles, model, probe, into)
    # fused projections (split by size after the layer) are stored part by part
    # (runtime/fused_parts.py): each rank's shard holds whole parts, which the plan's
    # placements cannot say
    flow = _redistributed_on_the_way(styles, plan, tp,
                                     skip=set(fused_projections(probe, styles, model,
                                                                stage.mesh_shape[tp])))
    if flow:
        return {}, flow
    heads = heads_refusal(model, stage.mesh_shape[tp]) if styles else None
    if heads:
        return {}, heads
    if sp:
        styles.update(_replicated_embeddings(model, styles, blocks))
        styles.update(_sequence_parallel_norms(model, styles))
        gathered = _sequence_gathers(styles, blocks)
        for name in [n for n, st in styles.items() if isinstance(st, ColwiseParallel)
                     and n.rpartition(".")[0] in gathered]:
            # already Replicate on entry: no redistribute of its own, whose backward would
            # all-reduce each projection's input gradient instead of one reduce-scatter
            styles[name] = ColwiseParallel()
        styles.update(gathered)
    return styles, None


class _SplitCalls(TorchFunctionMode):
    """Records ``split`` calls on the outputs ``outs`` holds (id -> (module FQN, tensor))."""

    def __init__(self, outs: dict):
        super().__init__()
        self.outs, self.seen = outs, {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.split, torch.split) and args and id(args[0]) in self.outs:
            size = args[1] if len(args) > 1 else kwargs.get("split_size_or_sections",
                                                            kwargs.get("split_size"))
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            self.seen[self.outs[id(args[0])][0]] = (size, dim, args[0].dim())
        return func(*args, **kwargs)


def forward_probe(plan: Plan, model: nn.Module, names) -> tuple[list[str], dict] | None:
    """Run the model on meta (one microbatch of the plan's call) and see (the modules of
    ``names`` in the order they are first called, {module: (split size, dim, rank)} of the
    ``split`` calls on their outputs); None when the forward cannot run on meta."""
    stage = plan.stages[0]
    dp, _, _ = _axes(stage)
    call = _meta_call(plan, stage.mesh_shape[dp] if dp is not None else 1)
    if call is None:
        return None
    shadow = meta_copy(model)
    order: list[str] = []
    outs: dict = {}
    for name, mod in shadow.named_modules():
        if name in names:
            def hook(_m, _a, out, name=name):
                if name not in order:
                    order.append(name)
                if isinstance(out, torch.Tensor):
                    outs[id(out)] = (name, out)  # the tensor kept: its id stays unique
            mod.register_forward_hook(hook)
    splits = _SplitCalls(outs)
    try:
        with _as_tracers_see_it(), splits:
            _Forward(shadow)(*call[0], **call[1])
    except Exception:  # noqa: BLE001 - a forward meta cannot run: no probe
        return None
    return order, splits.seen


def _call_order(names: list[str], probe) -> list[str]:
    """``names`` (modules, in registration order) in the order the forward first calls
    them (``forward_probe``), else registration order."""
    if probe is None:
        return names
    first = {n: i for i, n in enumerate(probe[0])}
    return sorted(names, key=lambda n: (first.get(n, len(first)), names.index(n)))


def _gather_unpaired(styles: dict, model: nn.Module, probe, into: dict) -> None:
    """A column-parallel nn.Linear hands its local shard on only to a row-parallel layer
    (Megatron's pair: q/k/v then o, up then down); one that no row-parallel layer follows in
    the forward (the output head, the last layer of an nn.Sequential) gathers its output
    (Replicate), so the code after it and the user's ``loss_fn`` see whole outputs. In call
    order, the colwise layers before the next non-colwise style are paired when that style is
    an nn.Linear's RowwiseParallel."""
    mods = dict(model.named_modules())
    order = _call_order([n for n in mods if n in styles], probe)

    def colwise_linear(name):
        return isinstance(styles[name], ColwiseParallel) and isinstance(mods[name], nn.Linear)
    for i, name in enumerate(order):
        if not colwise_linear(name):
            continue
        nxt = next((m for m in order[i + 1:] if not colwise_linear(m)), None)
        paired = nxt is not None and isinstance(styles[nxt], RowwiseParallel) \
            and isinstance(mods[nxt], nn.Linear)
        if not paired:
            styles[name] = ColwiseParallel(**into, output_layouts=Replicate())


def _redistributed_on_the_way(styles: dict, plan: Plan, tp: int,
                              skip: set = frozenset()) -> str | None:
    """Why a column-parallel nn.Linear's local output would be wrong, or None. The module
    engine hands that shard on to the code after it as is, so it is exact only where the plan
    itself carries the output to the row-parallel layers without redistributing it on the
    tensor-parallel axis: every edge from the layer's operator to a row-parallel layer's
    reads it sharded (a slice of a replicated value is what the local shard holds; a gather to
    Replicate or a Partial is not). A router (a column-parallel gate whose output a softmax or
    top-k reads over the split dimension) is paired with the experts' row-parallel layers by
    call order, though the plan gathers its output first: each rank would route its own
    columns alone (found by a user's MoE at dp2 x tp2, losses 3e-3 off one process)."""
    graph, stage = plan.graph, plan.stages[0]
    if graph is None or not stage.ops:
        return None
    paired = [n for n, st in styles.items() if isinstance(st, ColwiseParallel) and n not in skip
              and not any(isinstance(o, Replicate) for o in st.output_layouts)]
    rowwise = {f"{n}.weight" for n, st in styles.items() if isinstance(st, RowwiseParallel)}
    consumers: dict = {}
    readers: dict = {}  # parameter FQN -> the placed operators that read it
    for node in graph.nodes:
        for i, src in enumerate(node.inputs):
            consumers.setdefault(src, []).append((node, i))
        if node.name in stage.ops:
            for fqn in node.params:
                readers.setdefault(fqn, []).append(node.name)
    for name in paired:
        starts = readers.get(f"{name}.weight", [])
        seen, todo = set(starts), list(starts)
        while todo:
            u = todo.pop()
            out = stage.ops[u].output[tp]
            for v, i in consumers.get(u, ()):
                op = stage.ops.get(v.name)
                if op is None or i >= len(op.inputs):
                    continue
                if not is_shard(op.inputs[i][tp]):
                    return (f"{name} is column-parallel and the plan gathers what it computes "
                            f"({out} -> {op.inputs[i][tp]} on the tensor-parallel axis) before "
                            f"{v.name} ({v.target}, {v.source or v.module_path}); the module "
                            "engine passes each rank's shard on as is; the graph engine runs "
                            "this plan")
                if v.name not in seen and not rowwise.intersection(v.params):
                    seen.add(v.name)
                    todo.append(v.name)
    return None


class GatherSequence(ParallelStyle):
    """Sequence parallelism's one all-gather per sublayer (Korthikanti et al. 2022, Fig. 5;
    torchtitan's ``PrepareModuleInput`` on attention and feed-forward): every argument of
    the module that is a DTensor sharded by sequence is made Replicate before its forward,
    so the column-parallel projections inside (q, k, v; gate, up) share one all-gather, and
    the backward reduce-scatters their summed input gradient once. Generic over the call
    signature (HF passes ``hidden_states=`` by keyword), which PrepareModuleInput is not."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(value):
            if isinstance(value, DTensor) and value.device_mesh == device_mesh and \
                    any(isinstance(p, Shard) for p in value.placements):
                return value.redistribute(device_mesh, [Replicate()] * device_mesh.ndim)
            return value

        def hook(_mod, args, kwargs):
            return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}
        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _sequence_gathers(styles: dict, blocks: str) -> dict:
    """The modules inside a block that own column-parallel layers (an attention, an MLP)
    gather the sequence once on entry; a column-parallel layer owned by the block itself
    gathers its own input (its input_layouts)."""
    out = {}
    for name, style in styles.items():
        parent = name.rpartition(".")[0]
        if isinstance(style, ColwiseParallel) and blocks and parent.startswith(blocks + ".") \
                and parent.rpartition(".")[0] != blocks and parent not in styles:
            out[parent] = GatherSequence()
    return out


def heads_refusal(model: nn.Module, tp: int) -> str | None:
    """The attention heads (transformers' config names) must split whole over tp."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    ints = [n if isinstance(n, int) else None for n in (heads, kv)]
    why = support.heads_rule(tp, *ints)
    return why[0] if why else None


def _replicated_embeddings(model: nn.Module, styles: dict, blocks: str) -> dict:
    """With sequence parallelism, an embedding kept whole on tp (the token embedding of a
    context-parallel plan, a vocabulary tp does not divide) hands the residual stream on
    split by sequence like a vocab-parallel one does: its output, the same on every tp
    rank, is cut to Shard(1) locally (no communication; the backward all-gathers)."""
    return {name: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                      use_local_output=False)
            for name, m in model.named_modules()
            if isinstance(m, nn.Embedding) and name not in styles
            and not (blocks and name.startswith(blocks + "."))}


def _sequence_parallel_norms(model: nn.Module, styles: dict) -> dict:
    """Norms on the residual stream: tp-replicated, as wide as the embedding's output."""
    width = {m.embedding_dim for name, m in model.named_modules()
             if isinstance(m, nn.Embedding) and name in styles}
    out = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if name not in styles and type(mod).__name__.endswith("Norm") and \
                isinstance(weight, torch.Tensor) and weight.numel() in width:
            out[name] = SequenceParallel(use_local_output=False)
    return out


def _forward_on_local_shards(plan: Plan, model: nn.Module, styles: dict) -> str | None:
    """Run the model on meta with every tensor-parallel weight at its local-shard shape (and
    gathered outputs where a style gathers them): does the user's forward work on shards?"""
    stage = plan.stages[0]
    dp, tp, _ = _axes(stage)
    call = _meta_call(plan, (stage.mesh_shape[dp] if dp is not None else 1))
    if call is None or not styles:
        return None
    n = stage.mesh_shape[tp]
    shadow = meta_copy(model)
    mods = dict(shadow.named_modules())
    # a fused projection's parts reach the user's code as DTensors of global shapes, and
    # the row-parallel layer after it reads them so (runtime/fused_parts.py): whole on meta
    whole = _fused_and_partners(plan, model, styles, n)
    for mname, style in styles.items():
        if mname in whole:
            continue
        mod = mods[mname]
        for pname, p in list(mod.named_parameters(recurse=False)):
            dim = _sharded_dim(mod, pname, style)
            if dim is None:
                continue
            shape = list(p.shape)
            shape[dim] //= n
            setattr(mod, pname, nn.Parameter(torch.empty(shape, device="meta", dtype=p.dtype)))
        _shape_hooks(mod, style, n)
    try:
        run_on_meta(_Forward(shadow), call[0], call[1])
    except Exception as exc:  # noqa: BLE001 - any failure means "not on local shards"
        return (f"the model's forward fails on tensor-parallel local shards ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); the graph engine runs this plan")
    return None


def _fused_and_partners(plan: Plan, model: nn.Module, styles: dict, tp: int) -> set[str]:
    """The fused projections (runtime/fused_parts.py) and the row-parallel nn.Linear that
    follows each in call order."""
    probe = forward_probe(plan, model, set(styles))
    fused = fused_projections(probe, styles, model, tp)
    if not fused:
        return set()
    mods = dict(model.named_modules())
    order = _call_order([n for n in mods if n in styles], probe)
    out = set(fused)
    for name in fused:
        after = order[order.index(name) + 1:]
        partner = next((m for m in after if isinstance(styles[m], RowwiseParallel)
                        and isinstance(mods[m], nn.Linear)), None)
        if partner is not None:
            out.add(partner)
    return out


def fused_projections(probe, styles: dict, model: nn.Module, tp: int) -> dict[str, int]:
    """runtime/fused_parts.py ``fused_layers`` from a ``forward_probe``."""
    return fused_layers(probe[1], styles, model, tp) if probe is not None and styles else {}


def fused_of(plan: Plan, model: nn.Module, styles: dict) -> dict[str, int]:
    """The fused projections of ``model`` under ``plan``'s tensor parallelism."""
    stage = plan.stages[0]
    _, tp, _ = _axes(stage)
    if tp is None or not styles:
        return {}
    return fused_projections(forward_probe(plan, model, set(styles)), styles, model,
                             stage.mesh_shape[tp])


def fused_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Module-engine pipelines do not install the fused projections' hooks yet."""
    styles, _ = tp_styles(plan, model)
    fused = fused_of(plan, model, styles)
    if fused:
        return (f"{sorted(fused)[0]} is a fused projection split by size, which module-engine "
                "pipelines do not shard by head yet; use pp=1 or tp=1, or the graph engine")
    return None


def _shape_hooks(mod: nn.Module, style, n: int) -> None:
    """Make the meta module's outputs the shapes the style gives the user's code: a
    column-parallel layer that gathers its output (the head) returns the whole width. A
    sequence-sharded output is a DTensor (``use_local_output=False``), whose shape is the
    global one, so the local weights alone give every other shape."""
    def widened(_m, _a, y):
        return y.new_empty((*y.shape[:-1], y.shape[-1] * n))
    if isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Replicate):
        mod.register_forward_hook(widened)


@contextlib.contextmanager
def _as_tracers_see_it():
    """``torch.compiler.is_compiling()`` and ``is_exporting()`` true, as inside torch.export:
    HF code then skips its data-dependent checks (``(mask == 0).all()``), which meta tensors
    cannot answer. Private flags (DECISIONS 63): torch sets them only inside export."""
    old = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    try:
        torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = old


def run_on_meta(module: nn.Module, args: tuple, kwargs: dict | None = None) -> torch.Tensor:
    """The first output tensor of ``module`` run eagerly on meta inputs (with the branches
    HF code takes under tracing, as the export did). A forward whose code asks its tensors for values fails on meta; it is
    exported instead (non-strict torch.export, whose fake tensors make such values symbolic;
    about 20x slower). Raises what the export raises when both fail."""
    kwargs = kwargs or {}
    try:
        with _as_tracers_see_it():
            out = module(*args, **kwargs)
        leaf = out if isinstance(out, torch.Tensor) else \
            next(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return leaf
    except Exception:  # noqa: BLE001 - retried with export, which raises the error we report
        ep = torch.export.export(module, args, kwargs, strict=False)
        node = next(n for n in ep.graph.nodes if n.op == "output")
        return node.args[0][0].meta["val"]


class _Forward(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return _call(self.model, args, kwargs)


def _sharded_dim(mod: nn.Module, pname: str, style) -> int | None:
    if isinstance(style, (SequenceParallel, GatherSequence, PrepareModuleOutput)):
        return None
    if isinstance(mod, nn.Embedding):
        return 0 if isinstance(style, RowwiseParallel) else 1
    if pname == "bias":
        return 0 if isinstance(style, ColwiseParallel) else None
    return 0 if isinstance(style, ColwiseParallel) else 1


def _meta_inputs(plan: Plan, dp_size: int) -> tuple | None:
    """One microbatch of this rank's positional inputs on meta (None when the call has
    keyword inputs, or records none)."""
    call = _meta_call(plan, dp_size)
    return None if call is None or call[1] else call[0]


def _meta_call(plan: Plan, dp_size: int) -> tuple[tuple, dict] | None:
    """One microbatch of this rank's model call on meta, (args, kwargs), from the plan's
    graph and its call signature, else from the call the plan file records (or token ids);
    the loss targets are not part of it."""
    t = plan.training
    rows = max(1, t.global_batch // (dp_size * t.microbatches))
    graph = plan.graph
    if graph is not None:
        flat = tuple(torch.empty((rows, *m.shape[1:]), dtype=getattr(torch, m.dtype),
                                 device="meta") for _, m in graph.inputs)
        sig = graph.signature or CallSignature(len(flat))
        args, kwargs, _ = unflatten_call(flat, sig)
        return args, kwargs

    def empty(r):
        return torch.empty((rows, *r["shape"][1:]), dtype=getattr(torch, r["dtype"]),
                           device="meta")
    args = sorted((r for r in plan.model.inputs if r.get("role") == "arg"),
                  key=lambda r: int(r["key"]))
    kwargs = [r for r in plan.model.inputs if r.get("role") == "kwarg"]
    if args or kwargs:  # a plan read from JSON: its recorded call (targets not needed)
        return tuple(empty(r) for r in args), {r["key"]: empty(r) for r in kwargs}
    if len(plan.stages[0].inputs) == 1:  # an older plan: token ids (the CLI's inputs)
        return (torch.zeros(rows, t.seq_len, dtype=torch.long, device="meta"),), {}
    return None


def model_output_shape(plan: Plan, model: nn.Module) -> tuple[int, ...]:
    """The shape of the model's outputs (logits) for one microbatch of the plan's global
    batch on one data-parallel rank, run on meta."""
    call = _meta_call(plan, 1)
    if call is None:
        raise PlanFileError("the plan records no model call; make it with example_inputs")
    return tuple(run_on_meta(_Forward(meta_copy(model)), call[0], call[1]).shape)


def _dropout(model: nn.Module) -> str | None:
    """The first active dropout of ``model``: an nn.Dropout with p > 0, or a float config
    value named like transformers' dropout keys (attention dropout goes to sdpa as a float)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return f"{name or 'the model'} is dropout p={m.p}"
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    for key, value in items:
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value > 0:
            return f"config {key}={value}"
    return None


def model_refusal(model: nn.Module, *, dtype: str, num_devices: int) -> str | None:
    """Why no plan of ``model`` in ``dtype`` on ``num_devices`` devices can run on the module
    engine, whatever its layout (``module_engine_refusal``'s plan-independent rules); None
    when some may. The search prices the graph engine for such a model."""
    drop = _dropout(model)
    if drop and num_devices > 1:
        return (f"{drop}: eager modules draw DTensor's dropout masks (per-shard on CPU, "
                "DTensor's own stream on GPU); the graph engine draws one process's masks, "
                "the same under every single-stage plan")
    if dtype not in ENGINE_DTYPES[Engine.MODULES]:
        return (f"dtype {dtype} needs loss scaling, which the module engine does not do; "
                "use bf16 or fp32, or the graph engine")
    return None


def ep_refusal(plan: Plan, model: nn.Module) -> str | None:
    """The axis table's expert-parallel rules with the model's experts (meshplan/axes.py);
    None when the plan has no expert parallelism or they hold."""
    stage = plan.stages[0]
    if stage.ep <= 1:
        return None
    return next(iter(axes.plan_problems(stage, experts=axes.routed_experts(model),
                                        pp=support.pipeline_degree(plan))), None)


def stage_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why the single-stage ``plan`` cannot run on ``model`` with PyTorch's composables; None
    when it can. Pure: needs no process group (the local-shard check runs the model on meta).
    Every plan, pipelines included, is asked through ``module_engine_refusal``
    (runtime/module_engine.py), which sends a pipeline's one-stage view here."""
    t, stage = plan.training, plan.stages[0]
    why = ep_refusal(plan, model)
    if why:
        return why
    if support.cp_degree(stage) > 1:
        why = cp_refusal(plan, model)
        if why:
            return why
    why = model_refusal(model, dtype=t.dtype, num_devices=plan.num_devices)
    if why:
        return why
    dp, tp, why = _axes(stage)
    if why:
        return why
    for name, placements in stage.inputs.items():
        if tp is not None and placements[tp] != REPLICATE:
            return (f"input {name} is {placements[tp]} on the tensor-parallel axis; the module "
                    "engine feeds every tensor-parallel rank the whole input")
    for fqn, placements in stage.params.items():
        if dp is not None and stage.mesh_shape[dp] > 1 and placements[dp] != REPLICATE \
                and not (stage.zero >= 3 and is_shard(placements[dp])):
            return (f"{fqn} is {placements[dp]} on the data-parallel axis; fully_shard keeps "
                    "parameters replicated or ZeRO-3-sharded there")
        if PARTIAL in placements:
            return f"{fqn} is stored Partial ({placements}); no composable stores a partial weight"
    norm = next((n for n, m in model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    split = [stage.axis_names[a] for a in range(len(stage.mesh_shape))
             if a != dp and stage.mesh_shape[a] > 1]
    if norm is not None and split:
        # over dp the module engine synchronises BatchNorm (runtime/sync_batchnorm.py); a
        # tensor- or context-parallel rank's activations are shards it would normalise alone
        return (f"{norm} is a BatchNorm and the plan splits the {'/'.join(split)} axis; the "
                "module engine synchronises BatchNorm over data-parallel ranks only (the "
                "graph engine normalises the global batch under any layout)")
    if norm is not None and stage.recompute != Recompute.NONE:
        return (f"{norm} is a BatchNorm and recompute={stage.recompute}: the recomputed forward "
                "would update its running statistics a second time; use recompute='none'")
    blocks, num = find_repeated_blocks(model)
    if stage.recompute != Recompute.NONE and not num:
        return (f"recompute={stage.recompute} wraps each repeated block, but the model has no "
                "nn.ModuleList or numbered nn.ModuleDict of blocks")
    styles, why = tp_styles(plan, model)
    if why:
        return why
    return _forward_on_local_shards(plan, model, styles)


def cp_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why torch's context parallelism (runtime/cp_modules.py) cannot run ``model``: it
    intercepts ``F.scaled_dot_product_attention``, unmasked (causal by ``is_causal=True``, or
    full); the model's forward is run on meta to see its attention calls (else the graph's)."""
    cp = support.cp_degree(plan.stages[0])
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(impl, str) and impl != "sdpa":
        return (f"cp={cp}: the model's attention is attn_implementation={impl!r}, which torch's "
                "context parallelism cannot intercept; build it with attn_implementation='sdpa'")
    dp, _, _ = _axes(plan.stages[0])
    call = _meta_call(plan, plan.stages[0].mesh_shape[dp] if dp is not None else 1)
    seen = AttentionCalls()
    try:
        if call is None:
            raise LookupError("no call recorded")
        with seen:
            _Forward(meta_copy(model))(*call[0], **call[1])
    except Exception:  # noqa: BLE001 - no call, or a forward meta cannot run (a data-dependent
        # branch: transformers' padding check): the traced graph's SDPA calls, else the
        # runtime checks each call
        if plan.graph is None:
            return None
        seen.calls = attention_calls(plan.graph)
    if not seen.calls:
        return (f"cp={cp} splits attention's sequence, but the model calls no "
                "torch.nn.functional.scaled_dot_product_attention (for transformers models: "
                "attn_implementation='sdpa'); use cp=1 or SDPA")
    if any(mask for mask, _, _ in seen.calls):
        return (f"cp={cp}: the model passes an explicit attn_mask to scaled_dot_product_attention;"
                " torch's context parallelism splits is_causal=True or unmasked attention only; "
                "use is_causal=True (or engine='graph', which splits an explicit mask)")
    if len({causal for _, causal, _ in seen.calls}) > 1:
        return (f"cp={cp}: the model mixes causal and full attention, which torch's context "
                "parallelism lays out differently (head-tail vs contiguous chunks); use cp=1")
    if any(drop for _, _, drop in seen.calls):
        return f"cp={cp}: attention dropout > 0 is not split by context parallelism; set it to 0"
    return None


def compiler_refusal() -> str | None:
    """Why torch.compile cannot compile here: CPU inductor builds C++ with a system compiler."""
    if torch.cuda.is_available() or any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return None
    return ("compile=True needs a C++ compiler for torch.compile's CPU code (inductor) and "
            "none of g++, c++, clang++ is on PATH; install one or pass compile=False")


def check_model(plan: Plan, model: nn.Module) -> None:
    """The plan names every parameter of ``model`` and counts as many trainable elements (the
    graph engine compares trace fingerprints; this engine exports nothing)."""
    stage = plan.stages[0]
    named = dict(model.named_parameters())
    missing = [f for f in named if f not in stage.params]
    count = sum(p.numel() for p in named.values() if p.requires_grad)
    if missing or count != plan.model.param_count:
        what = f"places no parameter {missing[0]}" if missing else \
            f"counts {plan.model.param_count} trainable parameters, this model {count}"
        raise PlanFileError(f"plan for {plan.model.name} {what}; make a plan for this model "
                            "(meshplan plan ...)")
    plan.check_param_ranks({fqn: p.ndim for fqn, p in named.items()})


def _call(model: nn.Module, args: tuple, kwargs: dict):
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    out = model(*args, **kwargs)
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out
