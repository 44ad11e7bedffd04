"""The public runtime: ``meshplan.parallelize(model, plan)`` -> a ``ParallelRun`` that the
user's own training loop drives, under torchrun, on any number of nodes.

trace -> cost -> solve -> plan -> **run**. This module is the seam between a user's loop and
the engines: it rebuilds the call the plan was made for (``plan.model.inputs``), places the
model (only local shards get memory when it was built on the meta device), and turns each
rank's data-parallel shard of a batch into what the engine reads. It checks every step's
data against the plan, and gives the user's stock optimizer the tensors to step
(``parameters()``), a global gradient-norm clip over every rank and stage, a forward-only
call, and full state dicts under the model's own names.

Engines: the graph engine (runtime/graph/parallelize.py one stage, runtime/graph/pipeline.py several)
runs every plan the planner emits; the module engine on PyTorch's composables
(runtime/modules.py) takes the plans it can express (``plan.engine``).

Data layout: rank ``r`` of the data-parallel group holds rows ``[r*B/dp, (r+1)*B/dp)`` of the
global batch in the user's view; the plan's microbatch ``j`` is the ``j``-th chunk of every
rank's shard. Which rows meet in a microbatch does not change the loss or the gradients
(every microbatch has the same size and the loss is a mean).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshplan.errors import MeshplanError, NotSupportedError, PlanFileError
from meshplan.plan import Plan
from meshplan.runtime import loss_weights
from meshplan.graph import CallSignature
from meshplan.vocabulary import ENGINES, Engine
from meshplan.placements import REPLICATE, shard
from meshplan.tracing import (WRAPPER_PREFIX, export_training_graph, flatten_call,
                                    unflatten_call)


class DataError(MeshplanError):
    """A training step's data does not match the plan (shape, dtype, or ranks that must
    hold the same data do not)."""


_TENSOR_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                  "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
                  "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
                  "bool": torch.bool}


def plan_call(plan: Plan) -> tuple[CallSignature, list[dict]]:
    """The call the plan was made for: its signature and one record per flat input. A plan
    written before inputs were recorded is a language model on token ids (batch x seq)."""
    records = [dict(r) for r in plan.model.inputs]
    if not records:
        records = [{"name": "inputs_0", "role": "arg", "key": "0", "dtype": "int64",
                    "shape": [plan.training.global_batch, plan.training.seq_len]}]
    sig = CallSignature(num_args=sum(r["role"] == "arg" for r in records),
                        kwarg_names=tuple(r["key"] for r in records if r["role"] == "kwarg"),
                        num_targets=sum(r["role"] == "target" for r in records))
    return sig, records


def collective_device() -> torch.device:
    """Where a tensor must live for the default process group's collectives: the current
    GPU under NCCL (which has no CPU tensors), the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _mesh_coords(index: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for size in reversed(tuple(shape)):
        coords.append(index % size)
        index //= size
    return coords[::-1]


class ParallelRun:
    """A model parallelized in place by a plan; see ``meshplan.parallelize``."""

    def __init__(self, engine, plan: Plan, model: nn.Module, *, loss_fn=None,
                 uninitialized: set[str] | None = None, pristine: nn.Module | None = None):
        self.engine = engine  # ParallelModel or PipelineModel (graph engine)
        self.plan = plan
        self.loss_fn = loss_fn
        self.signature, self.records = plan_call(plan)
        self._model = model  # the user's module: its names and state_dict keys
        from meshplan.runtime.graph.parallelize import meta_copy
        # init_weights builds full tensors from a meta copy of the model as the user built it
        self._pristine = pristine if pristine is not None else meta_copy(model)
        self._training = True
        self._checked = False
        self._masters_stale = False
        self._forward = None
        self._uninitialized = set(uninitialized or ())
        self._aliases = _aliases(self._pristine)
        self._dp_axes = _data_parallel_axes(plan)
        self.dp_rank, self.dp_size = data_parallel_coordinate(plan, dist.get_rank())
        self._placements = _input_placements(plan)

    # -- what the user's loop calls ------------------------------------------------------
    @property
    def engine_name(self) -> str:
        return Engine.GRAPH.value

    def parameters(self) -> list[nn.Parameter]:
        """What a stock torch optimizer steps on this rank (DTensor shards; with ZeRO-1/2 the
        fp32 master shards)."""
        return list(self.engine.optimizer_params().values())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return dict(self.engine.optimizer_params())

    def train(self, mode: bool = True) -> "ParallelRun":
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
        self._refresh_masters()
        for p in self.parameters():
            if p.grad is not None:
                raise DataError("gradients of the previous step are still there: call "
                                "optimizer.zero_grad() after optimizer.step() (the plan's "
                                f"{self.plan.training.microbatches} microbatch(es) are "
                                "accumulated inside train_step)")
        labels = None
        first = next((i for i, r in enumerate(self.records) if r["role"] == "target"), None)
        if first is not None:  # each microbatch weighed by its labelled targets
            labels = loss_weights.label_counts(flat[first], self.plan.training.microbatches,
                                               dp_rank=self.dp_rank, dp_size=self.dp_size,
                                               device=_engine_device(self.engine))
            if labels is not None:
                flat = list(flat)
                flat[first] = loss_weights.guard_empty(flat[first], labels, self.dp_rank)
        batch = tuple(self._global(x, r) for x, r in zip(flat, self.records))
        out = self.engine.forward_backward(batch, labels=labels, dp_rank=self.dp_rank) \
            if labels is not None else self.engine.forward_backward(batch)
        loss, finite = out if isinstance(out, tuple) else (out, True)
        if not finite:  # fp16 overflow: no parameter has a gradient, so the step is a no-op
            for p in self.parameters():
                p.grad = None
            if dist.get_rank() == 0:
                warnings.warn("fp16 gradients overflowed: this step's gradients were dropped",
                              stacklevel=2)
        self._masters_stale = True
        return loss

    def __call__(self, inputs):
        """Forward only (eval): the model's outputs for this rank's shard, laid out like the
        input shard (rows of this rank's data-parallel part)."""
        if self._training:
            raise NotSupportedError("call run.eval() before a forward-only call; train_step "
                                    "is the training forward")
        self._check_initialized()
        self._refresh_masters()
        flat = self._flat(inputs, (), with_targets=False)
        records = [r for r in self.records if r["role"] != "target"]
        if self.plan.num_stages > 1:  # every microbatch through the stages, forward only
            batch = tuple(self._global(x, r) for x, r in zip(flat, records))
            return self._eval_pipeline(records)(batch)
        batch = tuple(self._global(x, r, microbatches=1) for x, r in zip(flat, records))
        out = self._forward_program(records)(*batch)
        if not isinstance(out, DTensor):
            return out
        from meshplan.runtime.graph.context import natural_order

        mesh = out.device_mesh
        target = [Shard(0) if a in self._dp_axes else Replicate() for a in range(mesh.ndim)]
        local = out.redistribute(placements=target).to_local()
        return natural_order(local, out.placements, mesh)  # from the load-balanced layout

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale every gradient so that their global norm (over every rank and pipeline
        stage, each shard counted once) is at most ``max_norm``; returns the norm before."""
        if not max_norm > 0:
            raise DataError(f"max_norm={max_norm} must be a positive number")
        from meshplan.runtime.grad_clip import clip_grad_norm_
        return clip_grad_norm_(self.engine, max_norm, norm_type)

    # -- state -----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the model's own names (every alias of a tied weight),
        parameters and persistent buffers, on every rank (CPU)."""
        self._refresh_masters()
        mine = {}
        tensors = self._tensors()
        for name in sorted(tensors):  # full_tensor is a collective over the stage mesh
            mine[name] = tensors[name].full_tensor().detach().cpu()
        if self.plan.num_stages > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            for part in everyone:
                mine.update(part)
        out = {}
        for key in self._pristine.state_dict(keep_vars=True):
            source = next((a for a in self._aliases.get(key, [key]) if a in mine), None)
            if source is not None:
                out[key] = mine[source]
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state: Mapping[str, torch.Tensor] | None, *,
                             broadcast_from_rank0: bool = False, strict: bool = True) -> None:
        """Set the weights from full tensors under the model's names. Every rank passes the
        same state, or, with ``broadcast_from_rank0=True``, only rank 0 does (others pass
        None) and each tensor is broadcast from it, one at a time."""
        if broadcast_from_rank0:
            keys = [sorted(state) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(keys, src=0)
            names = keys[0]
        else:
            if state is None:
                raise DataError("load_full_state_dict(None): pass the state on every rank, or "
                                "broadcast_from_rank0=True with the state on rank 0")
            names = sorted(state)
        expected = set(self._pristine.state_dict(keep_vars=True))
        if strict:
            missing = sorted(expected - set(names))
            unexpected = sorted(set(names) - expected - set(_all_buffers(self._pristine)))
            if missing or unexpected:
                raise DataError(f"state dict does not match the model: missing {missing[:4]}"
                                f"{'...' if len(missing) > 4 else ''}, unexpected "
                                f"{unexpected[:4]}; pass the model's own state_dict() "
                                "(or strict=False)")
        tensors = self._tensors()
        for name in names:
            full = state[name] if state is not None and name in state else None
            if broadcast_from_rank0:
                meta = [(tuple(full.shape), full.dtype) if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(meta, src=0)
                wire = full.to(collective_device()) if dist.get_rank() == 0 else \
                    torch.empty(meta[0][0], dtype=meta[0][1], device=collective_device())
                dist.broadcast(wire, src=0)
                full = wire
            self._set(name, full, tensors)
        self._after_load()

    @torch.no_grad()
    def init_weights(self, fn: Callable[[nn.Module], None] | None = None) -> None:
        """Initialise the weights module by module, as ``model.apply(fn)`` would on one
        process (children before parents), on full tensors of one module at a time: every
        rank computes the same full values and keeps its shard, so the result is the same
        whatever the plan. ``fn=None`` calls each module's ``reset_parameters()``."""
        tensors = self._tensors()
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
                self._set(f"{prefix}{name}", t.detach(), tensors)
            if was_meta:
                module.to_empty(device="meta", recurse=False)
        self._after_load()

    # -- helpers ---------------------------------------------------------------------------
    def _tensors(self) -> dict[str, DTensor]:
        """This rank's placed tensors (parameters and buffers) by FQN."""
        # one stage: names of the exported graph (the wrapper's prefix first); pipeline: FQNs
        strip = self.plan.num_stages == 1
        return {(name.removeprefix(WRAPPER_PREFIX) if strip else name): t
                for name, t in self.engine.params.items() if isinstance(t, DTensor)}

    def _set(self, name: str, full: torch.Tensor, tensors: dict) -> None:
        target = next((tensors[a] for a in self._aliases.get(name, [name]) if a in tensors),
                      None)
        for alias in self._aliases.get(name, [name]):
            self._uninitialized.discard(alias)
        if target is None:
            return  # held by another pipeline stage's ranks
        if tuple(full.shape) != tuple(target.shape):
            raise DataError(f"{name}: state has shape {list(full.shape)}, the model "
                            f"{list(target.shape)}; load the state of this model")
        if not isinstance(target, DTensor):  # a plain (replicated) tensor of the module engine
            target.copy_(full.to(target.device, target.dtype))
            return
        from torch.distributed.tensor import distribute_tensor
        shard = distribute_tensor(full.to(target.device_mesh.device_type, target.dtype),
                                  target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(shard)

    def _after_load(self) -> None:
        masters = getattr(self.engine, "masters", None) or {}
        if masters:
            params = {id(p): p for p in self.engine.unique_params()}
            for pid, master in masters.items():
                if pid in params:
                    master.to_local().copy_(params[pid].detach().redistribute(
                        placements=master.placements).to_local())
        self._masters_stale = False

    def _refresh_masters(self) -> None:
        if self._masters_stale and getattr(self.engine, "masters", None):
            self.engine.gather_masters()
        self._masters_stale = False

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
            if _TENSOR_DTYPES.get(rec["dtype"]) not in (None, x.dtype):
                raise DataError(f"{_label(rec)} has dtype {x.dtype}, the plan {rec['dtype']}")
        if not self._checked:
            self._checked = True
            self._check_same_data(flat, records)
        return flat

    def _split_axes(self, rec: dict) -> list[int]:
        pl = self._placements.get(rec["name"], ())
        return [a for a in self._dp_axes if a < len(pl) and pl[a] == shard(0)]

    def _local_shape(self, rec: dict) -> tuple[int, ...]:
        shape = list(rec["shape"])
        if self._split_axes(rec) and shape:
            shape[0] //= self.dp_size
        return tuple(shape)

    def _global(self, x: torch.Tensor, rec: dict, microbatches: int | None = None):
        """The global-batch tensor the engine cuts, with this rank's rows where the engine's
        data-parallel cut puts them (other rows are never read by this rank)."""
        if not self._split_axes(rec) or self.dp_size == 1:
            return x
        n = microbatches or self.plan.training.microbatches
        rows = x.shape[0] // n  # this rank's rows per microbatch
        full = x.new_zeros((x.shape[0] * self.dp_size, *x.shape[1:]))
        step = rows * self.dp_size
        for j in range(n):
            start = j * step + self.dp_rank * rows
            full[start:start + rows] = x[j * rows:(j + 1) * rows]
        return full

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

    def _eval_pipeline(self, records):
        if self._forward is None:
            from meshplan.runtime.graph.pipeline import eval_pipeline

            sig = CallSignature(self.signature.num_args, self.signature.kwarg_names, 0)
            meta = tuple(torch.empty(r["shape"], dtype=_TENSOR_DTYPES[r["dtype"]], device="meta")
                         for r in records)
            self._forward = eval_pipeline(self.engine, self._pristine, meta, self._dp_axes,
                                          loss_fn=self.loss_fn, signature=sig)
        return self._forward

    def _forward_program(self, records):
        if self._forward is None:
            from meshplan.runtime.graph.parallelize import (install_params, meta_copy,
                                                      runnable_graph_module)
            from meshplan.runtime.graph.spmd import SPMDExecutor
            from torch.distributed.tensor import distribute_tensor

            pm = self.engine
            sig = CallSignature(self.signature.num_args, self.signature.kwarg_names, 0)
            meta = tuple(torch.empty(r["shape"], dtype=_TENSOR_DTYPES[r["dtype"]], device="meta")
                         for r in records)
            model = meta_copy(self._pristine).eval()
            ep = export_training_graph(model, meta, self.loss_fn, signature=sig, loss=False)
            gm = runnable_graph_module(ep, device_type=pm.mesh.device_type)
            install_params(gm, pm.params)
            placements = [self._placements.get(r["name"], (REPLICATE,) * pm.mesh.ndim)
                          for r in records]
            # the plan's placements for the forward operators the eval graph shares with the
            # training graph (same node name and inputs): left to itself DTensor lays eval
            # batch norm out over channels (R, S(1)), which its conv rule then misreads
            planned = self.plan.stages[0].ops
            ops = {n.name: planned[n.name] for n in gm.graph.nodes
                   if n.op == "call_function" and n.name in planned
                   and len(planned[n.name].inputs) == len(n.all_input_nodes)}
            executor = SPMDExecutor(gm, pm.mesh, ops, input_placements=placements,
                                    dtype=self.plan.training.dtype, lowered=False)

            def forward(*xs):
                # each rank's global tensor holds only its own rows (_global): cut the shard
                # locally (src_data_rank=None); the executor's reference path would scatter
                # rank 0's tensor, giving the other ranks its zero rows
                xs = [distribute_tensor(x.to(pm.mesh.device_type), pm.mesh,
                                        executor.input_placements[i], src_data_rank=None)
                      for i, x in enumerate(xs)]
                with torch.no_grad():
                    return executor.run(*xs)
            self._forward = forward
        return self._forward


class ModuleRun(ParallelRun):
    """A ``ParallelRun`` whose engine is the module engine (runtime/modules.py): the user's
    module itself, parallelized with parallelize_module, checkpoint wrappers and
    fully_shard; the checks of the data are the same."""

    @property
    def engine_name(self) -> str:
        return Engine.MODULES.value

    def parameters(self) -> list[nn.Parameter]:
        return self.engine.parameters()

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return self.engine.named_parameters()

    def train(self, mode: bool = True) -> "ModuleRun":
        self.engine.train(mode)
        return super().train(mode)

    def train_step(self, inputs, targets=()) -> float:
        if not self._training:
            raise NotSupportedError("train_step in eval mode: call run.train() first")
        self._check_initialized()
        flat = self._flat(inputs, targets, with_targets=True)
        for p in self.parameters():
            if p.grad is not None:
                raise DataError("gradients of the previous step are still there: call "
                                "optimizer.zero_grad() after optimizer.step()")
        args, kwargs, targets = unflatten_call(flat, self.signature)
        labels = loss_weights.label_counts(
            targets[0] if targets else None, self.plan.training.microbatches,
            dp_rank=self.dp_rank, dp_size=self.dp_size, device=self.engine.device)
        return self.engine.train_step(args, kwargs, targets, labels=labels)

    def __call__(self, inputs):
        if self._training:
            raise NotSupportedError("call run.eval() before a forward-only call; train_step "
                                    "is the training forward")
        self._check_initialized()
        flat = self._flat(inputs, (), with_targets=False)
        sig = CallSignature(self.signature.num_args, self.signature.kwarg_names, 0)
        args, kwargs, _ = unflatten_call(flat, sig)
        return self.engine.forward(args, kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        if not max_norm > 0:
            raise DataError(f"max_norm={max_norm} must be a positive number")
        return float(self.engine.clip_grad_norm_(max_norm, norm_type))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        keys = self._pristine.state_dict().keys()  # torch's keys: persistent buffers only
        full = self.engine.full_state_dict()
        return {k: full[k] for k in keys if k in full}

    def load_full_state_dict(self, state, *, broadcast_from_rank0: bool = False,
                             strict: bool = True) -> None:
        if state is None and not broadcast_from_rank0:
            raise DataError("load_full_state_dict(None): pass the state on every rank, or "
                            "broadcast_from_rank0=True with the state on rank 0")
        if strict and state is not None:
            expected = set(self._pristine.state_dict())
            missing = sorted(expected - set(state))
            if missing:
                raise DataError(f"state dict does not match the model: missing {missing[:4]}"
                                f"{'...' if len(missing) > 4 else ''}; pass the model's own "
                                "state_dict() (or strict=False)")
        self.engine.load_full_state_dict(dict(state or {}),
                                         broadcast_from_rank0=broadcast_from_rank0)
        self._uninitialized -= set(state or {})
        if broadcast_from_rank0 or not strict:
            self._uninitialized.clear()

    def init_weights(self, fn=None) -> None:
        super().init_weights(fn)
        self.engine._unset_buffers.clear()

    def _tensors(self) -> dict:
        return self.engine.named_tensors()

    def _after_load(self) -> None:
        pass


def parallelize(model: nn.Module, plan: Plan, *, loss_fn: Callable | None = None,
                init_weights: Callable[[nn.Module], None] | None = None,
                engine: str | None = None, compile: bool = False) -> "ParallelRun":
    """Parallelize ``model`` in place per ``plan`` on the current process group (under
    torchrun); returns the ``ParallelRun`` the training loop drives.

    ``model`` is usually built under ``torch.device("meta")``: only each rank's shards get
    memory, and the weights come from ``run.load_full_state_dict(state)`` or ``init_weights``
    (called module by module as ``model.apply`` would; ``reset_parameters`` when the model
    has real weights is not needed). A model with real weights is sharded as it is.
    ``loss_fn(outputs, *targets)`` must be the loss the plan was made with. The plan says
    which engine runs it (``plan.engine``); ``engine="graph"`` forces the graph engine.
    ``compile=True`` (module engine only) compiles each repeated block with torch.compile."""
    stack = engine or getattr(plan, "engine", "")
    if stack in ("torchtitan", "megatron"):
        raise NotSupportedError(f"this plan was made for {stack} (meshplan plan --for {stack}): "
                                f"run it there after `meshplan export plan.json --to {stack}`, "
                                "or plan without --for to run it with meshplan")
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
    if engine == Engine.MODULES:
        from meshplan.runtime.module_pipeline import PipelineModuleEngine
        from meshplan.runtime.modules import ModuleEngine

        from meshplan.runtime.graph.parallelize import meta_copy

        uninitialized = {name for name, t in model.named_parameters() if t.is_meta}
        pristine = meta_copy(model)  # before the engine wraps the model in place
        cls = PipelineModuleEngine if plan.num_stages > 1 else ModuleEngine
        run = ModuleRun(cls(model, plan, loss_fn=loss_fn, compile=compile), plan, model,
                        loss_fn=loss_fn, uninitialized=uninitialized, pristine=pristine)
        if init_weights is not None:
            run.init_weights(init_weights)
        return run
    from meshplan.runtime.graph.parallelize import parallelize_graph

    sig, records = plan_call(plan)
    meta_inputs = tuple(torch.empty(r["shape"], dtype=_TENSOR_DTYPES.get(r["dtype"], torch.float32),
                                    device="meta") for r in records)
    uninitialized = {name for name, t in list(model.named_parameters(remove_duplicate=False))
                     + list(model.named_buffers(remove_duplicate=False)) if t.is_meta}
    engine = parallelize_graph(model, plan, meta_inputs, loss_fn=loss_fn, signature=sig)
    run = ParallelRun(engine, plan, model, loss_fn=loss_fn, uninitialized=uninitialized)
    if init_weights is not None:
        run.init_weights(init_weights)
    return run


# -- small helpers ---------------------------------------------------------------------------

def data_parallel_coordinate(plan: Plan, rank: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of global ``rank``: its row-major coordinate over the stage mesh's
    data-parallel axes (the axes the batch is split over), the same on every stage."""
    stage = plan.stages[0]
    coords = _mesh_coords(rank % len(stage.devices), stage.mesh_shape)
    dp_rank, dp_size = 0, 1
    for a in _data_parallel_axes(plan):
        dp_rank = dp_rank * stage.mesh_shape[a] + coords[a]
        dp_size *= stage.mesh_shape[a]
    return dp_rank, dp_size


def _data_parallel_axes(plan: Plan) -> tuple[int, ...]:
    from meshplan.runtime.graph.parallelize import data_parallel_axes
    return data_parallel_axes(plan.stages[0])


def _input_placements(plan: Plan) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for st in plan.stages:
        for name, pl in st.inputs.items():
            out.setdefault(name, tuple(pl))
    return out


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            list(model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _all_buffers(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_buffers(remove_duplicate=False)]


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


def _engine_device(engine) -> torch.device:
    """Where the graph engine's collectives run (NCCL needs CUDA tensors)."""
    device = getattr(engine, "device", None)
    return torch.device(device) if device is not None else torch.device(engine.mesh.device_type)


def _label(rec: dict) -> str:
    role = {"arg": "positional input", "kwarg": "keyword input", "target": "target"}[rec["role"]]
    return f"{role} {rec['key']!s}"


def _describe(sig: CallSignature) -> str:
    parts = [f"{sig.num_args} positional input(s)"]
    if sig.kwarg_names:
        parts.append(f"keyword inputs {list(sig.kwarg_names)}")
    parts.append(f"{sig.num_targets} target(s)")
    return ", ".join(parts)
