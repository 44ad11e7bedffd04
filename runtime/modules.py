"""The module engine: run a single-stage plan on the user's own nn.Module with PyTorch's
composables.

trace -> cost -> solve -> plan -> **run**. Where a plan's parameter placements are what
``parallelize_module``'s Colwise/Rowwise styles and ``fully_shard`` produce, the plan runs
as torchtitan's ``parallelize_llama`` would run it: ``apply_tp`` (a tensor-parallel plan is
data, a dict from module FQN to a style, derived from ``stage.params`` on the tensor-parallel
axis), then ``apply_ac`` (``checkpoint_wrapper`` per repeated block; selective recompute saves
the parameter matmuls), then ``apply_fsdp`` (``fully_shard`` per block and at the root, or
FSDP2's ``replicate`` for ZeRO-0). The user's forward runs unchanged on local shards; no graph
is exported. ``module_engine_refusal`` (runtime/module_engine.py, with ``build``, the entry
for ``meshplan.parallelize``) says why a plan is not expressible that way (pipeline
stages, fused or custom layers, placements with no style); such plans go to the graph engine
(runtime/graph/parallelize.py), which realises every operator's planned placement.

The activations' placements are those the styles give, not the plan's per-operator ones:
the computation is the same, only where the collectives fall may differ from what the plan
priced (DECISIONS 27).
"""

from __future__ import annotations

import importlib
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # private: torchtitan's
    checkpoint_wrapper)                                                    # choice, no public twin
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from meshplan import support
from meshplan.axes import EP_AXIS
from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.runtime import cp_modules
from meshplan.plan import Plan
from meshplan.runtime import fused_parts, loss_weights, state, sync_batchnorm
from meshplan.tracing import find_repeated_blocks, next_token_loss
from meshplan.vocabulary import Engine as EngineName, LossReduction, Recompute
from meshplan.runtime.module_plan import (_axes, _call, check_model,  # noqa: F401
                                          compiler_refusal, fused_of, stage_refusal,
                                          tp_styles)  # re-exported
from meshplan.runtime.shared import COMPUTE_DTYPES
from meshplan.runtime.grad_clip import clip_grad_norm_

# Outputs `selective` recompute keeps: the parameter matmuls; attention scores, softmax and
# pointwise ops are recomputed (Korthikanti et al. 2022, Sec. 5; as runtime/graph/spmd.py does).
_SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                       torch.ops.aten.linear.default}
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.",)


# -- applying the plan: torchtitan's parallelize_llama, step by step ---------------------------

def parallelize_model(model: nn.Module, *, mesh, dp_axis: str | None, tp_axis: str | None,
                      styles: dict, recompute: str, zero: int, dtype: str,
                      compile: bool = False, fsdp_mesh=None, expert_parallel=None) -> bool:
    """Tensor parallel, then expert parallel, then recompute, then compile, then FSDP
    (torchtitan's order) over ``fsdp_mesh`` (dp x cp flattened under context parallelism)
    or the dp axis. ``expert_parallel(model)``: splits the routed experts and returns their
    gradient reducer, whose parameters FSDP leaves alone (runtime/expert_parallel.py).
    Returns whether FSDP wraps the model."""
    if tp_axis is not None and styles:
        apply_tp(model, mesh[tp_axis], styles)
    ignored = set(expert_parallel(model).params) if expert_parallel is not None else None
    if recompute != Recompute.NONE:
        apply_ac(model, recompute)
    if compile:
        compile_blocks(model)
    if fsdp_mesh is None and dp_axis is not None:
        fsdp_mesh = mesh[dp_axis]
    if fsdp_mesh is not None and fsdp_mesh.size() > 1:
        apply_fsdp(model, fsdp_mesh, zero=zero, param_dtype=COMPUTE_DTYPES[dtype],
                   ignored_params=ignored)
        return True
    return False


def apply_tp(model: nn.Module, tp_mesh, styles: dict) -> None:
    parallelize_module(model, tp_mesh, styles)


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_IN_SELECTIVE \
        else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, recompute: str, *, blocks: str | None = None) -> None:
    """checkpoint_wrapper on every repeated block (non-reentrant); ``selective`` keeps the
    parameter matmuls' outputs and recomputes the rest. ``blocks``: the blocks' container
    (found in ``model`` when not given)."""
    container = model.get_submodule(find_repeated_blocks(model)[0] if blocks is None else blocks)
    context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) \
        if recompute == Recompute.SELECTIVE else None
    for key, block in list(container.named_children()):
        wrapped = checkpoint_wrapper(block, context_fn=context_fn) if context_fn \
            else checkpoint_wrapper(block)
        container.register_module(key, wrapped)


def apply_fsdp(model: nn.Module, dp_mesh, *, zero: int, param_dtype,
               blocks: str | None = None, ignored_params: set | None = None) -> None:
    """ZeRO over ``dp_mesh``: fully_shard per block then the root (ZeRO-3 reshards after
    forward; ZeRO-1/2 keep the gathered weights for backward); ZeRO-0 is FSDP2's replicate
    (whole weights, gradients all-reduced; DECISIONS 27)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    blocks = find_repeated_blocks(model)[0] if blocks is None else blocks
    # the blocks, not the parameterless modules between them (an nn.Sequential's activations)
    children = [c for c in model.get_submodule(blocks).children()
                if next(c.parameters(), None) is not None] if blocks else []
    if zero == 0:
        # private module: FSDP2-based replicate composes with DTensor tensor parallelism,
        # which DistributedDataParallel does not
        from torch.distributed._composable.replicate_with_fsdp import replicate
        for block in children:
            replicate(block, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored_params)
        replicate(model, mesh=dp_mesh, mp_policy=mp, ignored_params=ignored_params)
        return
    for block in children:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=zero >= 3,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=zero >= 3,
                ignored_params=ignored_params)


def compile_blocks(model: nn.Module, container: str | None = None) -> None:
    """torch.compile per repeated block (torchtitan's ``apply_compile``), in place
    (``nn.Module.compile``), so parameter names do not change."""
    why = compiler_refusal()
    if why:
        raise NotSupportedError(why)
    holder = model.get_submodule(find_repeated_blocks(model)[0] if container is None
                                 else container)
    for block in holder.children():
        block.compile()


def runtime_step(axis):
    """The function applying a table axis (meshplan/axes.py ``Axis.runtime_step``, named as
    ``"module:function"`` under meshplan.runtime so that the core imports no runtime)."""
    module, _, fn = axis.runtime_step.partition(":")
    return getattr(importlib.import_module(f"meshplan.runtime.{module}"), fn)


# -- the engine ------------------------------------------------------------------------------

def _dp_cp_mesh(mesh, dp_axis: str | None):
    """The mesh fully_shard shards weights and reduces gradients over with context
    parallelism: dp x cp flattened (torchtitan's ``dp_shard_cp``), or cp alone."""
    if dp_axis is None or mesh[dp_axis].size() == 1:
        return mesh["cp"]
    return mesh[dp_axis, "cp"]._flatten(f"{dp_axis}_cp")


def clean_fqn(fqn: str) -> str:
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


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty`` materialises each module's parameter on its own, so a weight
    shared by two modules (a tied embedding and head) came out as two tensors: trained
    apart, with half the gradient each. The ties are recorded first and restored after."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod, name))
    model.to_empty(device=device)
    for group in owners.values():
        first = getattr(group[0][0], group[0][1])
        for mod, name in group[1:]:
            setattr(mod, name, first)


def _zero_loss(out) -> torch.Tensor:
    out = getattr(out, "logits", out)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return out.float().sum() * 0.0


class ModuleEngineBase:
    """runtime/engine.py's ``Engine`` for the module engine's classes (``ModuleEngine``
    here, ``PipelineModuleEngine`` in runtime/module_pipeline.py), and the calls they share:
    the one clipping (runtime/grad_clip.py) and the one state path (runtime/state.py)."""

    name = EngineName.MODULES.value
    # what the user's loss_fn returns (meshplan/vocabulary.py LossReduction; set by build)
    loss_reduction: str = LossReduction.MEAN

    def compute_grads(self, args: tuple, kwargs: dict, targets: tuple,
                      labels: torch.Tensor | None) -> float:
        return self.train_step(args, kwargs, targets, labels=labels)

    def eval(self):
        return self.train(False)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.named_parameters().values())

    def optimizer_params(self) -> dict[str, nn.Parameter]:
        return self.named_parameters()

    def tied_elsewhere(self) -> set[int]:
        return set()  # a weight shared by two pipeline stages is refused (module_pipeline.py)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters (every alias) and buffers by the model's FQNs, as placed; FSDP's
        sharded parameters registered (an eval forward may leave them unsharded)."""
        out = {}
        for prefix, module in self._state_modules():
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
            for n, t in [*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)]:
                out[clean_fqn(n.removeprefix(prefix))] = t
        return out

    def sync_weights(self) -> None:
        pass  # the optimizer steps the parameters themselves

    def after_load(self, names: set[str]) -> None:
        self._unset_buffers -= set(names)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        return clip_grad_norm_(self, max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own FQNs, every buffer included."""
        return state.full_state_dict(self)

    def load_full_state_dict(self, sd: dict | None, *, broadcast_from_rank0: bool = False) -> None:
        """Load full tensors (every rank passes them, or rank 0 only with
        ``broadcast_from_rank0``), non-persistent buffers included."""
        state.load_full_state_dict(self, sd, broadcast_from_rank0=broadcast_from_rank0)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient as a full tensor, by FQN, from every stage (tests, debugging)."""
        local = {clean_fqn(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                else p.grad).cpu()
                 for n, p in self.named_parameters().items() if p.grad is not None}
        local = state.natural_rows(self, local)
        return state.gather_stages(self.plan, local)

    def _check_buffers(self) -> None:
        if self._unset_buffers:
            name = sorted(self._unset_buffers)[0]
            raise PlanFileError(f"buffer {name} of the meta-built model has no value; pass it "
                                "to load_full_state_dict (full_state_dict() includes it) or "
                                "call init_weights(fn)")


class ModuleEngine(ModuleEngineBase):
    """A single-stage plan applied to ``model`` in place with parallelize_module,
    checkpoint_wrapper and fully_shard; runtime/engine.py's ``Engine`` (ModuleEngineBase)."""

    def __init__(self, model: nn.Module, plan: Plan, *, loss_fn=None, device=None,
                 compile: bool = False):
        check_model(plan, model)
        reason = stage_refusal(plan, model) if plan.num_stages == 1 else (
            f"{plan.num_stages} pipeline stages: PipelineModuleEngine "
            "(runtime/module_pipeline.py) runs them")
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
        self._unset_buffers = {clean_fqn(n) for n, b in model.named_buffers() if b.is_meta}
        if not on_meta:
            model.to(self.device)
        styles, _ = tp_styles(plan, model)
        # context parallelism (runtime/cp_modules.py): weights replicated over cp, sharded
        # and their gradients reduced over dp x cp (torchtitan's dp_shard_cp mesh)
        self.cp_mesh = self.mesh["cp"] if support.cp_degree(stage) > 1 else None
        self.fsdp_mesh = _dp_cp_mesh(self.mesh, self.dp_axis) if self.cp_mesh is not None \
            else None
        # fused projections split by size (runtime/fused_parts.py): Megatron's row order
        tp_size = stage.mesh_shape[tp] if tp is not None else 1
        fused = fused_of(plan, model, styles)
        self.fused_rows = {f"{name}.{p}": (parts, tp_size) for name, parts in fused.items()
                           for p in ("weight", "bias")
                           if getattr(model.get_submodule(name), p, None) is not None}
        if not on_meta:
            with torch.no_grad():
                for fqn, (parts, n) in self.fused_rows.items():
                    t = model.get_parameter(fqn)
                    t.copy_(fused_parts.to_permuted(t, parts, n))
        hooked = [(model.get_submodule(name), model.get_submodule(name.rpartition(".")[0]),
                   parts) for name, parts in fused.items()]
        # expert parallelism (meshplan/axes.py EP_AXIS, runtime/expert_parallel.py)
        self.experts = None
        self.fsdp = parallelize_model(
            model, mesh=self.mesh, dp_axis=self.dp_axis,
            tp_axis=stage.axis_names[tp] if tp is not None else None, styles=styles,
            recompute=stage.recompute, zero=stage.zero, dtype=plan.training.dtype,
            compile=compile, fsdp_mesh=self.fsdp_mesh,
            expert_parallel=self._expert_step(stage) if stage.ep > 1 else None)
        if hooked:
            fused_parts.install(hooked, self.mesh[stage.axis_names[tp]])
        if on_meta:  # only the local shards get memory; weights come from load/init_weights
            to_empty_keeping_ties(model, self.device)
        if self.dp_size > 1:  # BatchNorm normalises the rows of every dp rank, as one process
            sync_batchnorm.synchronize(model, self.mesh[self.dp_axis].get_group())
        compute = COMPUTE_DTYPES[plan.training.dtype]
        # FSDP's MixedPrecisionPolicy casts the weights; without FSDP autocast does
        self._autocast = (lambda: torch.autocast(self.device.type, dtype=compute)) \
            if compute is not None and not self.fsdp else nullcontext
        # gradient sync once per step where the plan prices it so and gradients are not
        # sharded (ZeRO 0/1); ZeRO-2/3 reduce-scatter every microbatch (DECISIONS 27)
        self._defer_sync = self.fsdp and stage.zero < 2

    def _expert_step(self, stage):
        """The axis table's runtime step for ep, kept as the engine's gradient reducer."""
        def step(model):
            self.experts = runtime_step(EP_AXIS)(model, stage, device_type=self.device.type)
            return self.experts
        return step

    # -- training ------------------------------------------------------------------------
    def train_step(self, args: tuple, kwargs: dict | None = None, targets: tuple = (),
                   labels: torch.Tensor | None = None) -> float:
        """Forward and backward of every microbatch of this rank's shard; gradients synced
        (the expert shards' too: runtime/expert_parallel.py); the global mean loss."""
        if self.experts is None:
            return self._train_step(args, kwargs, targets, labels)
        self.experts.stash()
        loss = self._train_step(args, kwargs, targets, labels)
        self.experts.reduce()
        return loss

    def _loss(self, out, args, targets) -> torch.Tensor:
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out = out.float() if out.is_floating_point() else out
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if targets:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets[0].reshape(-1))
        return next_token_loss(out, args[0])

    def _train_step(self, args: tuple, kwargs: dict | None = None, targets: tuple = (),
                    labels: torch.Tensor | None = None) -> float:
        """Forward and backward of every microbatch of this rank's shard; gradients synced;
        the global mean loss (the same on every rank). ``labels``: the labelled targets per
        data-parallel rank and microbatch (runtime/loss_weights.py), which weigh each
        microbatch's loss so that the step's is the global batch's labelled mean."""
        self._check_buffers()
        if self.cp_mesh is not None:
            return self._cp_train_step(args, kwargs or {}, targets)
        n = self.plan.training.microbatches
        # a summed loss: each piece's sum counts whole (the averages over the n microbatches
        # and the dp ranks undone); per-sequence means: the pieces' rows weigh alike
        whole = n * self.dp_size if self.loss_reduction == LossReduction.SUM else 1.0
        if self.loss_reduction != LossReduction.MEAN:
            labels = None
        kwargs = kwargs or {}
        a = list(zip(*[_split(x, n, f"argument {i}") for i, x in enumerate(args)])) or [()] * n
        t = list(zip(*[_split(x, n, f"target {i}") for i, x in enumerate(targets)])) or [()] * n
        kw = [dict(zip(kwargs, vals)) for vals in
              zip(*[_split(v, n, f"keyword {k}") for k, v in kwargs.items()])] or [{}] * n
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(n):
            if self._defer_sync:
                self.model.set_requires_gradient_sync(i == n - 1)
            w = whole if labels is None else loss_weights.weight(labels, i, dp_rank=self.dp_rank)
            with self._autocast():
                out = _call(self.model, a[i], kw[i])
                # no labelled target here: weight 0, and a zero loss that still runs every
                # backward hook (FSDP's gradient sync) instead of the NaN of a mean over none
                loss = self._loss(out, a[i], t[i]) if w else _zero_loss(out)
            (loss * (w / n)).backward()
            total += loss.detach().to(torch.float64) * w
        total /= n * self.dp_size
        if self.dp_size > 1:
            dist.all_reduce(total, group=self.mesh[self.dp_axis].get_group())
        return float(total.item())

    def _cp_train_step(self, args: tuple, kwargs: dict, targets: tuple) -> float:
        """Context parallel: each microbatch's loss on this rank's chunks, summed over
        labelled tokens and divided by those of the global batch (the user's ``loss_fn`` on
        each chunk, weighted as its ``loss_reduction`` says: runtime/cp_modules.py
        ``chunk_loss``); fully_shard averages the gradients over dp x cp, so the loss is
        scaled by that size (gradients as one process's)."""
        n = self.plan.training.microbatches
        fn = self.loss_fn
        if fn is not None and not targets:
            raise NotSupportedError("loss_fn with cp > 1 and no targets: cp splits the loss by "
                                    "position; pass token-aligned targets, or use cp=1")
        whole = tuple(targets) if fn is not None else \
            ((targets[0] if targets else cp_modules.next_token_labels(args[0])),)
        reduction = self.loss_reduction if fn is not None else LossReduction.MEAN
        counted = cp_modules.loss_denominator(whole, reduction, self.dp_size).to(self.device)
        if self.dp_size > 1:
            dist.all_reduce(counted, group=self.mesh[self.dp_axis].get_group())
        a = list(zip(*[_split(x, n, f"argument {i}") for i, x in enumerate(args)]))
        kw = [dict(zip(kwargs, vals)) for vals in
              zip(*[_split(v, n, f"keyword {k}") for k, v in kwargs.items()])] or [{}] * n
        tg = list(zip(*[_split(t, n, f"target {j}") for j, t in enumerate(whole)]))
        scale = self.fsdp_mesh.size() / counted.clamp(min=1).item()
        rows = cp_modules.row_totals_over(self.cp_mesh)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i in range(n):
            if self._defer_sync:
                self.model.set_requires_gradient_sync(i == n - 1)
            with cp_modules.chunked_call(self.model, self.cp_mesh, a[i], kw[i], tg[i]) \
                    as (ai, kwi, ti):
                with self._autocast():
                    out = _call(self.model, ai, kwi)
                    loss = cp_modules.chunk_loss_sum(out, ti[0]) if fn is None else \
                        cp_modules.chunk_loss(out, ti, fn, reduction, rows)
                (loss * scale).backward()
            total += loss.detach().to(torch.float64)
        dist.all_reduce(total, group=self.fsdp_mesh.get_group())
        return float(total.item() / max(counted.item(), 1.0))

    def forward(self, args: tuple, kwargs: dict | None = None):
        self._check_buffers()
        if self.cp_mesh is not None:  # the chunks' outputs, gathered into natural order
            with torch.no_grad(), cp_modules.chunked_call(
                    self.model, self.cp_mesh, tuple(args), dict(kwargs or {})) as (a, kw, _):
                with self._autocast():
                    out = _call(self.model, a, kw)
            out = out.full_tensor() if isinstance(out, DTensor) else out
            return cp_modules.unshard(self.cp_mesh, out, causal=True)
        with torch.no_grad(), self._autocast():
            out = _call(self.model, tuple(args), dict(kwargs or {}))
        return out.full_tensor() if isinstance(out, DTensor) else out

    __call__ = forward

    def train(self, mode: bool = True) -> "ModuleEngine":
        self.model.train(mode)
        return self

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def _state_modules(self) -> list[tuple[str, nn.Module]]:
        return [("", self.model)]

    def init_weights(self, fn) -> None:
        """``fn(model)`` under no_grad: initialise a meta-built model's local shards."""
        with torch.no_grad():
            fn(self.model)
        self._unset_buffers.clear()
