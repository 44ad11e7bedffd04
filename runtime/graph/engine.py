"""The graph engine's side of the engine interface (runtime/engine.py), shared by
``ParallelModel`` (one stage, runtime/graph/parallelize.py, whose ``build`` places a user's
model for ``meshplan.parallelize``) and ``PipelineModel`` (several, runtime/graph/pipeline.py).

trace -> cost -> solve -> plan -> **run**. The graph engine reads a global-shaped batch in
which each rank's own rows sit where the plan's data-parallel cut puts them (other rows are
never read by this rank), so ``compute_grads`` and ``forward`` lay each rank's shard out that
way. Forward-only calls run a separate eval program, exported from a meta copy of the model
on first use. With ZeRO-1/2 the optimizer steps fp32 master shards; the parameters the
programs read are gathered from them before the next use (``sync_weights``), and set from
the parameters after a load (``after_load``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from meshplan.graph import CallSignature
from meshplan.placements import REPLICATE
from meshplan.runtime import loss_weights
from meshplan.runtime.engine import (TENSOR_DTYPES, data_parallel_axes,
                                     data_parallel_coordinate, input_placements, plan_call,
                                     split_over_dp)
from meshplan.runtime.graph.programs import install_params, runnable_graph_module
from meshplan.runtime.graph.spmd import SPMDExecutor
from meshplan.runtime.shared import meta_copy
from meshplan.tracing import WRAPPER_PREFIX, export_training_graph
from meshplan.vocabulary import Engine
from meshplan.runtime.graph.context import natural_order


class GraphEngine:
    """runtime/engine.py's ``Engine`` for the graph engine's classes."""

    name = Engine.GRAPH.value
    _pristine: nn.Module | None = None  # meta copy of the user's model (eval programs)
    _loss_fn = None
    _eval = None  # the forward-only program, built on first use
    _stale = False  # the optimizer may have stepped ZeRO-1/2 masters since the last gather

    def bind(self, pristine: nn.Module, loss_fn=None) -> None:
        self._pristine, self._loss_fn = pristine, loss_fn

    @property
    def device(self) -> torch.device:  # PipelineModel keeps its own field
        return torch.device(self.mesh.device_type)

    def train(self, mode: bool = True) -> "GraphEngine":
        return self  # the training and eval programs are separate

    def compute_grads(self, args: tuple, kwargs: dict, targets: tuple,
                      labels: torch.Tensor | None) -> float:
        flat = [*args, *kwargs.values(), *targets]
        _, records = plan_call(self.plan)
        dp_rank, dp_size = data_parallel_coordinate(self.plan, dist.get_rank())
        if labels is not None:  # a microbatch with no labelled target weighs 0: not NaN
            first = len(args) + len(kwargs)
            flat[first] = loss_weights.guard_empty(flat[first], labels, dp_rank)
        batch = tuple(self._global(x, r, dp_rank, dp_size) for x, r in zip(flat, records))
        out = self.forward_backward(batch, labels=labels, dp_rank=dp_rank) \
            if labels is not None else self.forward_backward(batch)
        loss, finite = out if isinstance(out, tuple) else (out, True)
        if not finite:  # fp16 overflow: no parameter has a gradient, so the step is a no-op
            for p in self.optimizer_params().values():
                p.grad = None
            if dist.get_rank() == 0:
                warnings.warn("fp16 gradients overflowed: this step's gradients were dropped",
                              stacklevel=3)
        self._stale = True
        return loss

    def forward(self, args: tuple, kwargs: dict):
        flat = (*args, *kwargs.values())
        _, records = plan_call(self.plan)
        records = [r for r in records if r["role"] != "target"]
        dp_rank, dp_size = data_parallel_coordinate(self.plan, dist.get_rank())
        if self.plan.num_stages > 1:  # every microbatch through the stages, forward only
            batch = tuple(self._global(x, r, dp_rank, dp_size) for x, r in zip(flat, records))
            return self._eval_program(records)(batch)
        batch = tuple(self._global(x, r, dp_rank, dp_size, microbatches=1)
                      for x, r in zip(flat, records))
        out = self._eval_program(records)(*batch)
        if not isinstance(out, DTensor):
            return out
        mesh, dp_axes = out.device_mesh, data_parallel_axes(self.plan.stages[0])
        target = [Shard(0) if a in dp_axes else Replicate() for a in range(mesh.ndim)]
        local = out.redistribute(placements=target).to_local()

        return natural_order(local, out.placements, mesh)  # from the load-balanced layout

    def tied_elsewhere(self) -> set[int]:
        skip = set()
        rank = dist.get_rank()
        masters = self.masters or {}
        for group, params, *_ in getattr(self, "tie_groups", ()):  # (group, params, via)
            if rank != min(dist.get_process_group_ranks(group)):
                skip.update(id(p) for p in params)
                skip.update(id(masters[id(p)]) for p in params if id(p) in masters)
        return skip

    def state_tensors(self) -> dict[str, torch.Tensor]:
        # one stage: names of the exported graph (the wrapper's prefix first); pipeline: FQNs
        strip = self.plan.num_stages == 1
        return {(name.removeprefix(WRAPPER_PREFIX) if strip else name): t
                for name, t in self.params.items() if isinstance(t, DTensor)}

    def sync_weights(self) -> None:
        if self._stale and self.masters:
            self.gather_masters()
        self._stale = False

    @torch.no_grad()
    def after_load(self, names: set[str]) -> None:
        if self.masters:  # the masters from the parameters just written
            params = {id(p): p for p in self.unique_params()}
            for pid, master in self.masters.items():
                if pid in params:
                    master.to_local().copy_(params[pid].detach().redistribute(
                        placements=master.placements).to_local())
        self._stale = False

    # -- helpers ---------------------------------------------------------------------------
    def _global(self, x: torch.Tensor, rec: dict, dp_rank: int, dp_size: int,
                microbatches: int | None = None) -> torch.Tensor:
        """The global-batch tensor the engine cuts, with this rank's rows where its
        data-parallel cut puts them (microbatch j: the j-th chunk of every rank's rows)."""
        if dp_size == 1 or not split_over_dp(self.plan, rec):
            return x
        n = microbatches or self.plan.training.microbatches
        rows = x.shape[0] // n  # this rank's rows per microbatch
        full = x.new_zeros((x.shape[0] * dp_size, *x.shape[1:]))
        step = rows * dp_size
        for j in range(n):
            start = j * step + dp_rank * rows
            full[start:start + rows] = x[j * rows:(j + 1) * rows]
        return full

    def _eval_program(self, records):
        if self._eval is None:
            sig, _ = plan_call(self.plan)
            sig = CallSignature(sig.num_args, sig.kwarg_names, 0)
            meta = tuple(torch.empty(r["shape"], dtype=TENSOR_DTYPES[r["dtype"]], device="meta")
                         for r in records)
            self._eval = self._eval_forward(records, meta, sig)
        return self._eval

    def _eval_forward(self, records, meta, sig):
        """The forward-only program of one stage (``PipelineModel`` overrides it with its
        stages' programs, runtime/graph/pipeline.py)."""
        model = meta_copy(self._pristine).eval()
        ep = export_training_graph(model, meta, self._loss_fn, signature=sig, loss=False)
        gm = runnable_graph_module(ep, device_type=self.mesh.device_type)
        install_params(gm, self.params)
        placed = input_placements(self.plan)
        placements = [placed.get(r["name"], (REPLICATE,) * self.mesh.ndim) for r in records]
        # the plan's placements for the forward operators the eval graph shares with the
        # training graph (same node name and inputs): left to itself DTensor lays eval
        # batch norm out over channels (R, S(1)), which its conv rule then misreads
        planned = self.plan.stages[0].ops
        ops = {n.name: planned[n.name] for n in gm.graph.nodes
               if n.op == "call_function" and n.name in planned
               and len(planned[n.name].inputs) == len(n.all_input_nodes)}
        executor = SPMDExecutor(gm, self.mesh, ops, input_placements=placements,
                                dtype=self.plan.training.dtype, lowered=False)
        mesh = self.mesh

        def forward(*xs):
            # each rank's global tensor holds only its own rows (_global): cut the shard
            # locally (src_data_rank=None); the executor's reference path would scatter
            # rank 0's tensor, giving the other ranks its zero rows
            xs = [distribute_tensor(x.to(mesh.device_type), mesh, executor.input_placements[i],
                                    src_data_rank=None) for i, x in enumerate(xs)]
            with torch.no_grad():
                return executor.run(*xs)
        return forward
