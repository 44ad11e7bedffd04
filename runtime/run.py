"""The public runtime: ``meshplan.parallelize(model, plan)`` -> a ``ParallelRun`` that the
user's own training loop drives, under torchrun, on any number of nodes.

trace -> cost -> solve -> plan -> **run**. This module is the seam between a user's loop and
the engines: it rebuilds the call the plan was made for (``plan.model.inputs``), checks every
step's data against it (shapes, dtypes, and that ranks sharing a data-parallel coordinate
pass the same rows), counts the labelled targets of the global batch
(runtime/loss_weights.py), and gives the user's stock optimizer the tensors to step
(``parameters()``), a global gradient-norm clip over every rank and stage
(runtime/grad_clip.py), a forward-only call, and full state dicts under the model's own
names (runtime/state.py). Only each rank's shards get memory when the model was built on
the meta device.

Engines: one ``ParallelRun`` drives any engine through the interface of runtime/engine.py.
The plan says which (``plan.engine``): the module engine on PyTorch's composables
(runtime/modules.py one stage, runtime/module_pipeline.py several) for the plans it can
express, the graph engine (runtime/graph/) for every plan the planner emits. Each rank
passes its data-parallel shard of the batch (runtime/engine.py says which rows).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from meshplan.errors import MeshplanError, NotSupportedError, PlanFileError
from meshplan.graph import CallSignature
from meshplan.plan import Plan
from meshplan.runtime import loss_weights, module_engine, state
from meshplan.runtime.graph import parallelize as graph_parallelize
from meshplan.runtime.shared import meta_copy
from meshplan.runtime.engine import (TENSOR_DTYPES, DataError, collective_device,  # noqa: F401
                                     data_parallel_coordinate, input_placements, plan_call,
                                     split_over_dp)  # re-exported: the worker, meshplan
from meshplan.support import batch_norm_rule, loss_reduction_rule, stack_refusal
from meshplan.tracing import flatten_call, unflatten_call
from meshplan.vocabulary import ENGINES, Engine, LossReduction
from meshplan.runtime.grad_clip import clip_grad_norm_
from meshplan.runtime.sync_batchnorm import batch_norms


class ParallelRun:
    """A model parallelized in place by a plan; see ``meshplan.parallelize``. ``engine`` is
    any runtime/engine.py ``Engine``."""

    loss_reduction: str = LossReduction.MEAN  # what loss_fn returns (parallelize sets it)

    def __init__(self, engine, plan: Plan, model: nn.Module, *, loss_fn=None,
                 uninitialized: set[str] | None = None, pristine: nn.Module):
        self.engine = engine
        self.plan = plan
        self.loss_fn = loss_fn
        self.signature, self.records = plan_call(plan)
        self._model = model  # the user's module
        # a meta copy of the model as the user built it: its names, state_dict keys and ties;
        # init_weights builds full tensors from it
        self._pristine = pristine
        self._training = True
        self._checked = False
        self._uninitialized = set(uninitialized or ())
        self._aliases = state.aliases(pristine)
        self._placements = input_placements(plan)
        self.dp_rank, self.dp_size = data_parallel_coordinate(plan, dist.get_rank())

    # -- what the user's loop calls ------------------------------------------------------
    @property
    def engine_name(self) -> str:
        return self.engine.name

    def parameters(self) -> list[nn.Parameter]:
        """What a stock torch optimizer steps on this rank (DTensor shards; with the graph
        engine's ZeRO-1/2 the fp32 master shards)."""
        return list(self.engine.optimizer_params().values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.engine.optimizer_params())

    def train(self, mode: bool = True) -> "ParallelRun":
        self.engine.train(mode)
        self._training = mode
        return self

    def eval(self) -> "ParallelRun":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self._training

    def train_step(self, inputs, targets=()) -> float:
        """Forward and backward of every microbatch of this step (the pipeline schedule
        included), gradients synced; returns the global mean loss (the same on every rank).
        ``inputs`` (a tensor, tuple or dict) and ``targets`` are this rank's data-parallel
        shard. Then step the optimizer over ``parameters()`` and zero its gradients."""
        if not self._training:
            raise NotSupportedError("train_step in eval mode: call run.train() first")
        self._check_initialized()
        flat = self._flat(inputs, targets, with_targets=True)
        self.engine.sync_weights()
        for p in self.parameters():
            if p.grad is not None:
                raise DataError("gradients of the previous step are still there: call "
                                "optimizer.zero_grad() after optimizer.step() (the plan's "
                                f"{self.plan.training.microbatches} microbatch(es) are "
                                "accumulated inside train_step)")
        args, kwargs, targets = unflatten_call(flat, self.signature)
        # each microbatch weighed by its labelled targets over the global batch (a loss_fn
        # that returns a sum or per-sequence means: the engine weighs its pieces alike)
        labels = loss_weights.label_counts(
            targets[0] if targets else None, self.plan.training.microbatches,
            dp_rank=self.dp_rank, dp_size=self.dp_size, device=self.engine.device)
        if self.loss_reduction != LossReduction.MEAN:
            labels = None
        return self.engine.compute_grads(args, kwargs, targets, labels)

    def __call__(self, inputs):
        """Forward only (eval): the model's outputs for this rank's shard, laid out like the
        input shard (rows of this rank's data-parallel part)."""
        if self._training:
            raise NotSupportedError("call run.eval() before a forward-only call; train_step "
                                    "is the training forward")
        self._check_initialized()
        self.engine.sync_weights()
        flat = self._flat(inputs, (), with_targets=False)
        args, kwargs, _ = unflatten_call(flat, CallSignature(self.signature.num_args,
                                                             self.signature.kwarg_names, 0))
        return _plain_outputs(self.engine.forward(args, kwargs))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale every gradient so that their global norm (over every rank and pipeline
        stage, each shard and each tied weight counted once) is at most ``max_norm``;
        returns the norm before."""
        if not max_norm > 0:
            raise DataError(f"max_norm={max_norm} must be a positive number")
        if not (norm_type > 0):  # inf passes; 0, negatives and nan have no norm to clip by
            raise DataError(f"norm_type={norm_type} must be a positive number or inf "
                            "(2.0 is the usual)")
        return clip_grad_norm_(self.engine, max_norm, norm_type)

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own names (every alias of a tied weight),
        parameters and persistent buffers, on every rank (CPU)."""
        return state.full_state_dict(self.engine, self._pristine.state_dict(keep_vars=True),
                                     self._aliases)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor] | None, *,
                             broadcast_from_rank0: bool = False, strict: bool = True) -> None:
        """Set the weights from full tensors under the model's names (non-persistent buffers
        may be given too). Every rank passes the same state, or, with
        ``broadcast_from_rank0=True``, only rank 0 does (others pass None) and each tensor
        is broadcast from it."""
        expected = set(self._pristine.state_dict(keep_vars=True))
        buffers = {n for n, _ in self._pristine.named_buffers(remove_duplicate=False)}

        def check(names: list[str]) -> None:  # on every rank, before any tensor moves
            missing = sorted(expected - set(names))
            unexpected = sorted(set(names) - expected - buffers)
            if missing or unexpected:
                raise DataError(f"state dict does not match the model: missing {missing[:4]}"
                                f"{'...' if len(missing) > 4 else ''}, unexpected "
                                f"{unexpected[:4]}; pass the model's own state_dict() "
                                "(or strict=False)")
        keys = state.load_full_state_dict(self.engine, state_dict,
                                          broadcast_from_rank0=broadcast_from_rank0,
                                          names=self._aliases, check=check if strict else None)
        for key in keys:
            self._uninitialized.difference_update(self._aliases.get(key, [key]))

    @torch.no_grad()
    def init_weights(self, fn: Callable[[nn.Module], None] | None = None) -> None:
        """Initialise the weights module by module, as ``model.apply(fn)`` would on one
        process (children before parents), on full tensors of one module at a time: every
        rank computes the same full values and keeps its shard, so the result is the same
        whatever the plan. ``fn=None`` calls each module's ``reset_parameters()``."""
        tensors, done = self.engine.state_tensors(), set()
        for prefix, module in _post_order(self._pristine):
            own = list(module.named_parameters(recurse=False)) + \
                list(module.named_buffers(recurse=False))
            if not own:
                continue
            was_meta = any(t.is_meta for _, t in own)
            if was_meta:
                module.to_empty(device="cpu", recurse=False)
                for _, b in module.named_buffers(recurse=False):
                    b.zero_()  # e.g. num_batches_tracked, which reset_parameters may not touch
            if fn is not None:
                fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
            for name, t in list(module.named_parameters(recurse=False)) + \
                    list(module.named_buffers(recurse=False)):
                key = f"{prefix}{name}"
                state.set_full(key, t.detach(), tensors, self._aliases)
                self._uninitialized.difference_update(self._aliases.get(key, [key]))
                done.update(self._aliases.get(key, [key]))
            if was_meta:
                module.to_empty(device="meta", recurse=False)
        self.engine.after_load(done)

    # -- helpers ---------------------------------------------------------------------------
    def _check_initialized(self) -> None:
        if self._uninitialized:
            names = sorted(self._uninitialized)
            raise DataError(f"{len(names)} tensors were built on the meta device and never "
                            f"given values ({', '.join(names[:3])}{'...' if len(names) > 3 else ''}); "
                            "call run.load_full_state_dict(state) or run.init_weights(fn) "
                            "(or pass init_weights= to meshplan.parallelize)")

    def _flat(self, inputs, targets, *, with_targets: bool) -> tuple[torch.Tensor, ...]:
        try:
            flat, sig = flatten_call(inputs, targets)
        except MeshplanError as exc:
            raise DataError(str(exc)) from None
        want = self.signature if with_targets else CallSignature(
            self.signature.num_args, self.signature.kwarg_names, 0)
        if sig != want:
            raise DataError(f"the plan was made for a call with {_describe(want)}; this step "
                            f"passed {_describe(sig)}")
        records = self.records if with_targets else \
            [r for r in self.records if r["role"] != "target"]
        for x, rec in zip(flat, records):
            expected = self._local_shape(rec)
            if tuple(x.shape) != expected:
                raise DataError(f"{_label(rec)} has shape {list(x.shape)}; this rank "
                                f"(data-parallel rank {self.dp_rank} of {self.dp_size}) "
                                f"expects its shard of shape {list(expected)} of the global "
                                f"{rec['shape']}")
            if TENSOR_DTYPES.get(rec["dtype"]) not in (None, x.dtype):
                raise DataError(f"{_label(rec)} has dtype {x.dtype}, the plan {rec['dtype']}")
        if not self._checked:
            self._checked = True
            self._check_same_data(flat, records)
        return flat


    def _local_shape(self, rec: dict) -> tuple[int, ...]:
        shape = list(rec["shape"])
        if shape and split_over_dp(self.plan, rec, self._placements):
            shape[0] //= self.dp_size
        return tuple(shape)


    def _check_same_data(self, flat, records) -> None:
        """Ranks with the same data-parallel coordinate (tensor-parallel peers, pipeline
        stages) must hold the same data: compare a checksum of each input once."""
        sums = []
        gen = torch.Generator().manual_seed(0)
        for x in flat:
            v = x.detach().reshape(-1).to("cpu", torch.float64)
            w = torch.rand(v.numel(), generator=gen, dtype=torch.float64)
            sums.append(float((v * w).sum()))
        local = torch.tensor([float(self.dp_rank), *sums], dtype=torch.float64,
                             device=collective_device())
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, local)
        local, gathered = local.cpu(), [g.cpu() for g in gathered]
        for other in gathered:
            if int(other[0]) == self.dp_rank and not torch.allclose(other[1:], local[1:],
                                                                    rtol=1e-9, atol=0):
                bad = int(((other[1:] - local[1:]).abs() > 1e-9 * local[1:].abs()).nonzero()[0])
                raise DataError(f"{_label(records[bad])} differs between ranks of data-parallel "
                                f"rank {self.dp_rank} (tensor-parallel peers or pipeline "
                                "stages); give them the same shard: index data by "
                                "run.dp_rank and run.dp_size, not by the global rank")


def parallelize(model: nn.Module, plan: Plan, *, loss_fn: Callable | None = None,
                init_weights: Callable[[nn.Module], None] | None = None,
                engine: str | None = None, compile: bool = False,
                loss_reduction: str = LossReduction.MEAN) -> "ParallelRun":
    """Parallelize ``model`` in place per ``plan`` on the current process group (under
    torchrun); returns the ``ParallelRun`` the training loop drives.

    ``model`` is usually built under ``torch.device("meta")``: only each rank's shards get
    memory, and the weights come from ``run.load_full_state_dict(state)`` or ``init_weights``
    (called module by module as ``model.apply`` would; ``reset_parameters`` when the model
    has real weights is not needed). A model with real weights is sharded as it is.
    ``loss_fn(outputs, *targets)`` must be the loss the plan was made with, and
    ``loss_reduction`` what it returns over its labelled targets: "mean" (default), "sum", or
    "sequence" (each row's mean, averaged over the rows; docs/running.md). The plan says
    which engine runs it (``plan.engine``); ``engine="graph"`` forces the graph engine.
    ``compile=True`` (module engine only) compiles each repeated block with torch.compile."""
    why = stack_refusal(engine or getattr(plan, "engine", Engine.GRAPH),
                        replan="engine='auto' (meshplan plan --engine auto)")
    if why:  # a plan priced for another stack (costmodel/runtime_profiles.STACKS)
        raise NotSupportedError(why)
    if not dist.is_available() or not dist.is_initialized():
        raise NotSupportedError("meshplan.parallelize runs inside a torchrun worker: call "
                                "torch.distributed.init_process_group() first (gloo on CPU, "
                                "nccl on GPU)")
    if not isinstance(plan, Plan):
        raise PlanFileError(f"plan must be a meshplan.Plan (Plan.from_json(path)), got "
                            f"{type(plan).__name__}")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise PlanFileError(f"the plan is for {plan.num_devices} devices but this run has "
                            f"{world} processes; launch with torchrun --nproc-per-node "
                            f"{plan.num_devices} (or nodes x processes = {plan.num_devices})")
    device = plan.mesh.hardware.get("device", {}).get("name", "") \
        if isinstance(plan.mesh.hardware, dict) else ""
    if device and device != "cpu" and not torch.cuda.is_available() and dist.get_rank() == 0:
        warnings.warn(f"this plan was made for {device} devices and runs on CPU processes: "
                      "its predicted step time and memory do not apply here", stacklevel=2)
    engine = engine or plan.engine
    if engine not in ENGINES:
        raise PlanFileError(f"engine={engine!r} is not 'graph' or 'modules'")
    if compile and engine != Engine.MODULES:
        raise NotSupportedError("compile=True runs on the module engine only; this plan runs "
                                f"on the graph engine ({plan.engine_note or 'engine=graph'}); "
                                "pass compile=False")
    why = loss_reduction_rule(plan, loss_reduction, loss_fn is not None, engine)
    if why:
        raise NotSupportedError(why[0])
    for why in batch_norm_rule(plan, bool(batch_norms(model))):  # a plan file made without it
        raise PlanFileError(f"plan cannot run this model: {why}")

    uninitialized = {name for name, t in list(model.named_parameters(remove_duplicate=False))
                     + list(model.named_buffers(remove_duplicate=False)) if t.is_meta}
    pristine = meta_copy(model)  # before an engine wraps the model in place
    if engine == Engine.MODULES:
        placed = module_engine.build(model, plan, loss_fn=loss_fn, compile=compile,
                                     loss_reduction=loss_reduction)
    else:
        placed = graph_parallelize.build(model, plan, loss_fn=loss_fn, pristine=pristine)
    run = ParallelRun(placed, plan, model, loss_fn=loss_fn, uninitialized=uninitialized,
                      pristine=pristine)
    run.loss_reduction = loss_reduction
    if init_weights is not None:
        run.init_weights(init_weights)
    return run


# -- small helpers ---------------------------------------------------------------------------

def _post_order(model: nn.Module, prefix: str = ""):
    """(prefix, module) as ``model.apply`` visits them: children first; shared modules once."""
    seen: set[int] = set()

    def visit(mod, pre):
        if id(mod) in seen:
            return
        seen.add(id(mod))
        for name, child in mod.named_children():
            yield from visit(child, f"{pre}{name}.")
        yield pre, mod
    yield from visit(model, prefix)


def _label(rec: dict) -> str:
    role = {"arg": "positional input", "kwarg": "keyword input", "target": "target"}[rec["role"]]
    return f"{role} {rec['key']!s}"


def _describe(sig: CallSignature) -> str:
    parts = [f"{sig.num_args} positional input(s)"]
    if sig.kwarg_names:
        parts.append(f"keyword inputs {list(sig.kwarg_names)}")
    parts.append(f"{sig.num_targets} target(s)")
    return ", ".join(parts)


def _plain_outputs(out):
    """The outputs as plain tensors: a gathered output (a column-parallel head's
    ``use_local_output`` gather) arrives as functional collectives' ``AsyncCollectiveTensor``,
    a subclass a user's ``torch.save`` / ``torch.load(weights_only=True)`` refuses."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.wait() if isinstance(t, AsyncCollectiveTensor) else t, out)
