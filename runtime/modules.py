"""The module engine: run a single-stage plan on the user's own nn.Module with PyTorch's
composables.

trace -> cost -> solve -> plan -> **run**. Where a plan's parameter placements are what
``parallelize_module``'s Colwise/Rowwise styles and ``fully_shard`` produce, the plan runs
as torchtitan's ``parallelize_llama`` would run it: ``apply_tp`` (a tensor-parallel plan is
data, a dict from module FQN to a style, derived from ``stage.params`` on the tensor-parallel
axis), then ``apply_ac`` (``checkpoint_wrapper`` per repeated block; selective recompute saves
the parameter matmuls), then ``apply_fsdp`` (``fully_shard`` per block and at the root, or
FSDP2's ``replicate`` for ZeRO-0). The user's forward runs unchanged on local shards; no graph
is exported. ``module_engine_refusal`` says why a plan is not expressible that way (pipeline
stages, fused or custom layers, placements with no style); such plans go to the graph engine
(runtime/parallelize.py), which realises every operator's planned placement.

The activations' placements are those the styles give, not the plan's per-operator ones:
the computation is the same, only where the collectives fall may differ from what the plan
priced (DECISIONS 18).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # private: torchtitan's
    checkpoint_wrapper)                                                    # choice, no public twin
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.plan import Plan, Stage
from meshplan.planner.trace import find_repeated_blocks, next_token_loss
from meshplan.runtime.parallelize import data_parallel_axes, meta_copy

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}
# Outputs `selective` recompute keeps: the parameter matmuls; attention scores, softmax and
# pointwise ops are recomputed (Korthikanti et al. 2022, Sec. 5; as runtime/spmd.py does).
_SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                       torch.ops.aten.linear.default}
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.",)


# -- the plan as tensor-parallel styles (pure) -------------------------------------------------

def _axes(stage: Stage) -> tuple[int | None, int | None, str | None]:
    """(data-parallel axis, tensor-parallel axis, refusal): at most one of each of size > 1."""
    dp = [a for a in data_parallel_axes(stage) if stage.mesh_shape[a] > 1]
    tp = [a for a, n in enumerate(stage.mesh_shape) if n > 1 and a not in data_parallel_axes(stage)]
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
    S(1) -> ColwiseParallel. A column-parallel layer outside the repeated blocks (the output
    head) gathers its output (Replicate), so the loss sees whole logits. With sequence
    parallelism (Megatron's, Korthikanti et al. 2022) the residual stream is split by
    sequence (dim 1) between the layers: the embedding and row-parallel layers reduce-scatter
    to Shard(1), column-parallel layers all-gather Shard(1) inputs, and the norms on the
    residual stream (tp-replicated weights of the embedding's width) are SequenceParallel."""
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
    seq = dict(output_layouts=Shard(1)) if sp else {}
    into = dict(input_layouts=Shard(1)) if sp else {}
    styles: dict = {}
    tied = ""  # reported after every layer's style is known: a missing style says more
    for fqn, p in model.named_parameters():
        if id(p) not in placed:
            return {}, f"the plan places no parameter {fqn}; re-plan this model"
        on_tp = placed[id(p)][tp]
        if on_tp == "R":
            continue
        mname, mod, pname = owners[id(p)][0]
        weight = placed.get(id(getattr(mod, "weight", None)), ())
        bias = getattr(mod, "bias", None)
        bias_tp = placed.get(id(bias), ("R",) * len(stage.mesh_shape))[tp] if bias is not None else None
        w_tp = weight[tp] if weight else "R"
        inner = bool(blocks) and mname.startswith(blocks + ".")
        style = None
        if isinstance(mod, nn.Linear) and w_tp == "S(0)" and bias_tp in (None, "S(0)"):
            style = ColwiseParallel(**into) if inner \
                else ColwiseParallel(**into, output_layouts=Replicate())
        elif isinstance(mod, nn.Linear) and w_tp == "S(1)" and bias_tp in (None, "R"):
            style = RowwiseParallel(**seq)
        elif isinstance(mod, nn.Embedding) and w_tp == "S(0)":
            style = RowwiseParallel(input_layouts=Replicate(), **seq)
        elif isinstance(mod, nn.Embedding) and w_tp == "S(1)":
            style = ColwiseParallel(input_layouts=Replicate(), output_layouts=seq.get(
                "output_layouts", Replicate()))
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
    if sp:
        styles.update(_sequence_parallel_norms(model, styles))
    return styles, None


def _sequence_parallel_norms(model: nn.Module, styles: dict) -> dict:
    """Norms on the residual stream: tp-replicated, as wide as the embedding's output."""
    width = {m.embedding_dim for name, m in model.named_modules()
             if isinstance(m, nn.Embedding) and name in styles}
    out = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        if name not in styles and type(mod).__name__.endswith("Norm") and \
                isinstance(weight, torch.Tensor) and weight.numel() in width:
            out[name] = SequenceParallel(use_local_output=True)
    return out


def _forward_on_local_shards(plan: Plan, model: nn.Module, styles: dict) -> str | None:
    """Run the model on meta with every tensor-parallel weight at its local-shard shape (and
    gathered outputs where a style gathers them): does the user's forward work on shards?"""
    stage = plan.stages[0]
    dp, tp, _ = _axes(stage)
    inputs = _meta_inputs(plan, (stage.mesh_shape[dp] if dp is not None else 1))
    if inputs is None or not styles:
        return None
    n = stage.mesh_shape[tp]
    shadow = meta_copy(model)
    mods = dict(shadow.named_modules())
    for mname, style in styles.items():
        mod = mods[mname]
        for pname, p in list(mod.named_parameters(recurse=False)):
            dim = _sharded_dim(mod, pname, style)
            if dim is None:
                continue
            shape = list(p.shape)
            shape[dim] //= n
            setattr(mod, pname, nn.Parameter(torch.empty(shape, device="meta", dtype=p.dtype)))
        _shape_hooks(mod, style, n)
    try:  # exported (non-strict) as the planner traces: HF code makes data-dependent checks
        torch.export.export(_Forward(shadow), inputs, strict=False)
    except Exception as exc:  # noqa: BLE001 - any failure means "not on local shards"
        return (f"the model's forward fails on tensor-parallel local shards ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); the graph engine runs this plan")
    return None


def _shape_hooks(mod: nn.Module, style, n: int) -> None:
    """Make the meta module's inputs and outputs the local shapes the style gives them."""
    def resized(t, dim, factor):
        shape = list(t.shape)
        shape[dim] = shape[dim] * factor if factor >= 1 else shape[dim] // round(1 / factor)
        return t.new_empty(shape)
    if isinstance(style, SequenceParallel):
        return
    first = style.input_layouts[0]
    if isinstance(first, Shard) and first.dim == 1:  # all-gather the sequence first
        mod.register_forward_pre_hook(lambda _m, args: (resized(args[0], 1, n), *args[1:]))
    out = style.output_layouts[0]
    if isinstance(style, ColwiseParallel) and isinstance(out, Replicate):
        mod.register_forward_hook(lambda _m, _a, y: resized(y, -1, n))
    elif isinstance(style, ColwiseParallel) and isinstance(out, Shard) and out.dim == 1:
        mod.register_forward_hook(lambda _m, _a, y: resized(resized(y, -1, n), 1, 1 / n))
    elif isinstance(style, RowwiseParallel) and isinstance(out, Shard):
        mod.register_forward_hook(lambda _m, _a, y: resized(y, 1, 1 / n))


class _Forward(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return _call(self.model, args, {})


def _sharded_dim(mod: nn.Module, pname: str, style) -> int | None:
    if isinstance(style, SequenceParallel):
        return None
    if isinstance(mod, nn.Embedding):
        return 0 if isinstance(style, RowwiseParallel) else 1
    if pname == "bias":
        return 0 if isinstance(style, ColwiseParallel) else None
    return 0 if isinstance(style, ColwiseParallel) else 1


def _meta_inputs(plan: Plan, dp_size: int) -> tuple | None:
    """One microbatch of this rank's inputs on meta, from the plan's graph (or token ids)."""
    t = plan.training
    rows = max(1, t.global_batch // (dp_size * t.microbatches))
    graph = plan.graph
    if graph is not None:
        return tuple(torch.empty((rows, *m.shape[1:]), dtype=getattr(torch, m.dtype),
                                 device="meta") for _, m in graph.inputs)
    if len(plan.stages[0].inputs) == 1:  # a plan read from JSON: token ids (the CLI's inputs)
        return (torch.zeros(rows, t.seq_len, dtype=torch.long, device="meta"),)
    return None


def module_engine_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why ``plan`` cannot run on ``model`` with PyTorch's composables; None when it can.
    Pure: needs no process group (the local-shard check runs the model on meta)."""
    if plan.num_stages > 1:
        return (f"plan has {plan.num_stages} pipeline stages; the module engine runs one "
                "stage (the graph engine runs pipelines)")
    t, stage = plan.training, plan.stages[0]
    if t.dtype not in COMPUTE_DTYPES:
        return (f"dtype {t.dtype} needs loss scaling, which the module engine does not do; "
                "use bf16 or fp32, or the graph engine")
    dp, tp, why = _axes(stage)
    if why:
        return why
    for name, placements in stage.inputs.items():
        if tp is not None and placements[tp] != "R":
            return (f"input {name} is {placements[tp]} on the tensor-parallel axis; the module "
                    "engine feeds every tensor-parallel rank the whole input")
    for fqn, placements in stage.params.items():
        if dp is not None and stage.mesh_shape[dp] > 1 and placements[dp] != "R" \
                and not (stage.zero >= 3 and placements[dp].startswith("S(")):
            return (f"{fqn} is {placements[dp]} on the data-parallel axis; fully_shard keeps "
                    "parameters replicated or ZeRO-3-sharded there")
        if "P" in placements:
            return f"{fqn} is stored Partial ({placements}); no composable stores a partial weight"
    blocks, num = find_repeated_blocks(model)
    if stage.recompute != "none" and not num:
        return (f"recompute={stage.recompute} wraps each repeated block, but the model has no "
                "nn.ModuleList or numbered nn.ModuleDict of blocks")
    styles, why = tp_styles(plan, model)
    if why:
        return why
    return _forward_on_local_shards(plan, model, styles)


# -- applying the plan: torchtitan's parallelize_llama, step by step ---------------------------

def parallelize_model(model: nn.Module, *, mesh, dp_axis: str | None, tp_axis: str | None,
                      styles: dict, recompute: str, zero: int, dtype: str) -> bool:
    """Tensor parallel, then recompute, then FSDP. Returns whether FSDP wraps the model."""
    if tp_axis is not None and styles:
        apply_tp(model, mesh[tp_axis], styles)
    if recompute != "none":
        apply_ac(model, recompute)
    if dp_axis is not None and mesh[dp_axis].size() > 1:
        apply_fsdp(model, mesh[dp_axis], zero=zero, param_dtype=COMPUTE_DTYPES[dtype])
        return True
    return False


def apply_tp(model: nn.Module, tp_mesh, styles: dict) -> None:
    parallelize_module(model, tp_mesh, styles)


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_IN_SELECTIVE \
        else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, recompute: str) -> None:
    """checkpoint_wrapper on every repeated block (non-reentrant); ``selective`` keeps the
    parameter matmuls' outputs and recomputes the rest."""
    container = model.get_submodule(find_repeated_blocks(model)[0])
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) \
        if recompute == "selective" else None
    for key, block in list(container.named_children()):
        wrapped = checkpoint_wrapper(block, context_fn=context_fn) if context_fn \
            else checkpoint_wrapper(block)
        container.register_module(key, wrapped)


def apply_fsdp(model: nn.Module, dp_mesh, *, zero: int, param_dtype) -> None:
    """ZeRO over ``dp_mesh``: fully_shard per block then the root (ZeRO-3 reshards after
    forward; ZeRO-1/2 keep the gathered weights for backward); ZeRO-0 is FSDP2's replicate
    (whole weights, gradients all-reduced; DECISIONS 18)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    blocks = find_repeated_blocks(model)[0]
    children = list(model.get_submodule(blocks).children()) if blocks else []
    if zero == 0:
        # private module: FSDP2-based replicate composes with DTensor tensor parallelism,
        # which DistributedDataParallel does not
        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in children:
            replicate(block, mesh=dp_mesh, mp_policy=mp)
        replicate(model, mesh=dp_mesh, mp_policy=mp)
        return
    for block in children:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=zero >= 3)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=zero >= 3)


# -- the engine ------------------------------------------------------------------------------

def _call(model: nn.Module, args: tuple, kwargs: dict):
    params = inspect.signature(model.forward).parameters
    if "use_cache" in params and "use_cache" not in kwargs:
        kwargs = {**kwargs, "use_cache": False}
    out = model(*args, **kwargs)
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else out


def _clean(fqn: str) -> str:
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def _split(value, n: int, what: str):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.shape[0] % n:
            raise PlanFileError(f"{what} has {value.shape[0]} rows, which do not split into the "
                                f"plan's {n} microbatches; pass this rank's shard of a batch "
                                f"divisible by {n}")
        return value.chunk(n)
    return [value] * n


class ModuleEngine:
    """A single-stage plan applied to ``model`` in place with parallelize_module,
    checkpoint_wrapper and fully_shard; the interface meshplan.parallelize returns."""

    def __init__(self, model: nn.Module, plan: Plan, *, loss_fn=None, device=None):
        reason = module_engine_refusal(plan, model)
        if reason:
            raise NotSupportedError(f"plan not expressible in the module engine: {reason}")
        if not dist.is_initialized():
            raise RuntimeError("ModuleEngine runs inside a torchrun worker: init_process_group first")
        if dist.get_world_size() != plan.num_devices:
            raise PlanFileError(f"plan needs {plan.num_devices} processes, this run has "
                                f"{dist.get_world_size()}; launch with --nproc_per_node "
                                f"{plan.num_devices}")
        stage = plan.stages[0]
        self.plan, self.model, self.loss_fn = plan, model, loss_fn
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.mesh = init_device_mesh(self.device.type, stage.mesh_shape,
                                     mesh_dim_names=stage.axis_names)
        dp, tp, _ = _axes(stage)
        self.dp_axis = stage.axis_names[dp] if dp is not None else None
        self.dp_rank = self.mesh[self.dp_axis].get_local_rank() if self.dp_axis else 0
        self.dp_size = stage.mesh_shape[dp] if dp is not None else 1
        on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        self._unset_buffers = {_clean(n) for n, b in model.named_buffers() if b.is_meta}
        if not on_meta:
            model.to(self.device)
        styles, _ = tp_styles(plan, model)
        self.fsdp = parallelize_model(
            model, mesh=self.mesh, dp_axis=self.dp_axis,
            tp_axis=stage.axis_names[tp] if tp is not None else None, styles=styles,
            recompute=stage.recompute, zero=stage.zero, dtype=plan.training.dtype)
        if on_meta:  # only the local shards get memory; weights come from load/init_weights
            model.to_empty(device=self.device)
        compute = COMPUTE_DTYPES[plan.training.dtype]
        # FSDP's MixedPrecisionPolicy casts the weights; without FSDP autocast does
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=compute)) \
            if compute is not None and not self.fsdp else nullcontext
        # gradient sync once per step where the plan prices it so and gradients are not
        # sharded (ZeRO 0/1); ZeRO-2/3 reduce-scatter every microbatch (DECISIONS 18)
        self._defer_sync = self.fsdp and stage.zero < 2

    # -- training ------------------------------------------------------------------------
    def _loss(self, out, args, targets) -> torch.Tensor:
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out = out.float() if out.is_floating_point() else out
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if targets:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[0].reshape(-1))
        return next_token_loss(out, args[0])

    def train_step(self, args: tuple, kwargs: dict | None = None, targets: tuple = ()) -> float:
        """Forward and backward of every microbatch of this rank's shard; gradients synced;
        the global mean loss (the same on every rank)."""
        self._check_buffers()
        n = self.plan.training.microbatches
        kwargs = kwargs or {}
        a = list(zip(*[_split(x, n, f"argument {i}") for i, x in enumerate(args)])) or [()] * n
        t = list(zip(*[_split(x, n, f"target {i}") for i, x in enumerate(targets)])) or [()] * n
        kw = [dict(zip(kwargs, vals)) for vals in
              zip(*[_split(v, n, f"keyword {k}") for k, v in kwargs.items()])] or [{}] * n
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(n):
            if self._defer_sync:
                self.model.set_requires_gradient_sync(i == n - 1)
            with self._autocast():
                loss = self._loss(_call(self.model, a[i], kw[i]), a[i], t[i])
            (loss / n).backward()
            total += loss.detach().to(torch.float64)
        total /= n * self.dp_size
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.mesh[self.dp_axis].get_group())
        return float(total.item())

    def forward(self, args: tuple, kwargs: dict | None = None):
        self._check_buffers()
        with torch.no_grad(), self._autocast():
            out = _call(self.model, tuple(args), dict(kwargs or {}))
        return out.full_tensor() if isinstance(out, DTensor) else out

    __call__ = forward

    def train(self, mode: bool = True) -> "ModuleEngine":
        self.model.train(mode)
        return self

    def eval(self) -> "ModuleEngine":
        return self.train(False)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so that their global norm is at most ``max_norm``; returns the norm
        before clipping. Gradients on one DTensor layout are normed together (torch's
        get_total_norm), then the groups' norms combined."""
        groups: dict = {}
        for p in self.parameters():
            if p.grad is not None:
                g = p.grad
                key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
                groups.setdefault(key, []).append(g)
        norms = []
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=False)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms \
            else torch.zeros((), device=self.device)
        torch.nn.utils.clip_grads_with_norm_(self.parameters(), max_norm, total, foreach=False)
        return total

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own FQNs, persistent and non-persistent buffers."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        for name, buf in self.model.named_buffers():
            sd.setdefault(_clean(name), buf.detach().clone())
        return sd

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient as a full tensor, by FQN (for tests and debugging)."""
        return {_clean(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                for n, p in self.model.named_parameters() if p.grad is not None}

    def load_full_state_dict(self, sd: dict, *, broadcast_from_rank0: bool = False) -> None:
        """Load full tensors (every rank passes them, or rank 0 only with
        ``broadcast_from_rank0``); non-persistent buffers in ``sd`` are copied too."""
        persistent = set(get_model_state_dict(self.model).keys())
        extra = {_clean(n) for n, _ in self.model.named_buffers()} - persistent
        # strict: a missing weight or an unknown name raises (torch's message names it)
        set_model_state_dict(self.model, {k: v for k, v in sd.items() if k not in extra},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=broadcast_from_rank0,
                                                      strict=not broadcast_from_rank0))
        with torch.no_grad():
            for name, buf in self.model.named_buffers():
                if _clean(name) in sd and _clean(name) not in persistent:
                    buf.copy_(sd[_clean(name)])
        self._unset_buffers -= set(sd) | persistent

    def init_weights(self, fn) -> None:
        """``fn(model)`` under no_grad: initialise a meta-built model's local shards."""
        with torch.no_grad():
            fn(self.model)
        self._unset_buffers.clear()

    def _check_buffers(self) -> None:
        if self._unset_buffers:
            name = sorted(self._unset_buffers)[0]
            raise PlanFileError(f"buffer {name} of the meta-built model has no value; pass it "
                                "to load_full_state_dict (full_state_dict() includes it) or "
                                "call init_weights(fn)")
