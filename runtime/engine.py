"""The engine interface: what ``ParallelRun`` (runtime/run.py) asks of every engine, and the
batch layout every engine reads.

trace -> cost -> solve -> plan -> **run**. Four classes run plans: the module engine's
``ModuleEngine`` (runtime/modules.py, one stage) and ``PipelineModuleEngine``
(runtime/module_pipeline.py), on PyTorch's composables; the graph engine's ``ParallelModel``
(runtime/graph/parallelize.py) and ``PipelineModel`` (runtime/graph/pipeline.py), whose
side of this interface is in runtime/graph/engine.py. Each implements ``Engine`` below, so
one run class drives them all, one function clips their gradients (runtime/grad_clip.py)
and one path reads and writes their full state (runtime/state.py).

Data layout: rank ``r`` of the data-parallel group holds rows ``[r*B/dp, (r+1)*B/dp)`` of the
global batch in the user's view; the plan's microbatch ``j`` is the ``j``-th chunk of every
rank's shard. Which rows meet in a microbatch does not change the loss or the gradients
(every microbatch has the same size and the loss is a weighted mean, runtime/loss_weights.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from meshplan import vocabulary
from meshplan.errors import MeshplanError
from meshplan.graph import CallSignature
from meshplan.placements import shard
from meshplan.plan import Plan


class DataError(MeshplanError):
    """A training step's data does not match the plan (shape, dtype, or ranks that must
    hold the same data do not)."""

    code = "BAD_DATA"


@runtime_checkable
class Engine(Protocol):
    """A plan placed on this process group. Every method is called on every rank (most are
    collectives); inputs are this rank's data-parallel shard, as the user passes them."""

    name: str  # vocabulary.Engine: "graph" or "modules"
    plan: Plan
    device: torch.device  # where inputs and this engine's collectives go

    def compute_grads(self, args: tuple, kwargs: dict, targets: tuple,
                      labels: torch.Tensor | None) -> float:
        """Forward and backward of every microbatch of this step (a pipeline's schedule
        included), gradients synced and left on ``optimizer_params()``; the global mean
        loss, the same on every rank. ``labels``: labelled targets per data-parallel rank and
        microbatch (runtime/loss_weights.py), None where the microbatches weigh alike."""

    def forward(self, args: tuple, kwargs: dict):
        """Forward only, no gradients: the model's outputs for this rank's shard, full over
        every axis but the data-parallel ones, in the sequence's natural order."""

    def train(self, mode: bool = True) -> "Engine":
        """Training or eval behaviour (dropout, batch-norm statistics) for what follows."""

    def optimizer_params(self) -> dict[str, nn.Parameter]:
        """What the user's optimizer steps on this rank, by FQN, each tensor once (DTensor
        shards; the graph engine's ZeRO-1/2 fp32 master shards in their parameters' place)."""

    def tied_elsewhere(self) -> set[int]:
        """ids of entries of ``optimizer_params()`` whose gradient a lower rank group holds
        too (a weight tied across pipeline stages): the global norm counts it there."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's placed parameters and buffers under the model's FQNs (every alias
        that this engine names; DTensors or plain tensors): what the state path reads and
        writes in place."""

    def sync_weights(self) -> None:
        """Bring what the forward reads up to date with what the optimizer stepped (the graph
        engine's ZeRO-1/2 parameters from their masters); a no-op where they are one."""

    def after_load(self, names: set[str]) -> None:
        """``names`` of ``state_tensors()`` were written: refresh what derives from them."""


TENSOR_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
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


def data_parallel_axes(stage) -> tuple[int, ...]:
    """Mesh axes of a plan's ``stage`` the batch is split over: the first graph input's S(0)
    axes (the same on every stage)."""
    if not stage.inputs:
        return ()
    first = next(iter(stage.inputs.values()))
    return tuple(i for i, p in enumerate(first) if p == shard(0))


def _mesh_coords(index: int, shape: Sequence[int]) -> list[int]:
    coords = []
    for size in reversed(tuple(shape)):
        coords.append(index % size)
        index //= size
    return coords[::-1]


def data_parallel_coordinate(plan: Plan, rank: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of global ``rank``: its row-major coordinate over the stage mesh's
    data-parallel axes (the axes the batch is split over), the same on every stage."""
    stage = plan.stages[0]
    coords = _mesh_coords(rank % len(stage.devices), stage.mesh_shape)
    dp_rank, dp_size = 0, 1
    for a in data_parallel_axes(stage):
        dp_rank = dp_rank * stage.mesh_shape[a] + coords[a]
        dp_size *= stage.mesh_shape[a]
    return dp_rank, dp_size


def input_placements(plan: Plan) -> dict[str, tuple[str, ...]]:
    """The plan's placement of each flat input, by name (the first stage that reads it)."""
    out: dict[str, tuple[str, ...]] = {}
    for st in plan.stages:
        for name, pl in st.inputs.items():
            out.setdefault(name, tuple(pl))
    return out


def split_over_dp(plan: Plan, record: dict, placements: dict | None = None) -> bool:
    """Whether the flat input of ``record`` is split by rows over the data-parallel axes
    (else every rank passes it whole). The module engine runs each data-parallel rank's
    module on that rank's rows of every input: the search may still leave an input
    replicated over a data-parallel axis (T5's decoder ids and labels on local:4, where
    the encoder ids are split), a per-operator choice that engine does not follow, so there
    every input is split wherever the first one is."""
    axes = data_parallel_axes(plan.stages[0])
    if plan.engine == vocabulary.Engine.MODULES:
        return bool(axes) and bool(record.get("shape"))
    pl = (placements if placements is not None else input_placements(plan)).get(
        record["name"], ())
    return any(a < len(pl) and pl[a] == shard(0) for a in axes)
