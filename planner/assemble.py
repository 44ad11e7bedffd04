"""Assembling plans: the parts of a Plan every planner fills the same way.

trace -> cost -> solve -> **assemble** -> run. Planners decide placements; this module turns
a decision into the ``meshplan.plan/v1`` records (model and mesh headers, training config,
stage records) so that every planner writes the same file for the same decision.
"""

from __future__ import annotations

from meshplan.errors import PlanningError
from meshplan.graph import OpGraph, OpKind
from meshplan.plan import ModelInfo, MeshInfo, OpPlacement, TrainingConfig
from meshplan.schedules import Schedule
from meshplan.vocabulary import DTYPES, ComputeDtype
from meshplan.placements import PARTIAL, REPLICATE

OPTIMIZERS = ("adam", "sgd")


def model_info(graph: OpGraph) -> ModelInfo:
    return ModelInfo(name=graph.model_name, fingerprint=graph.fingerprint,
                     param_count=graph.param_count, train_flops_per_step=graph.train_flops,
                     num_layers=graph.num_layers, num_nodes=len(graph.nodes),
                     inputs=input_records(graph), loss=graph.loss)


def input_records(graph: OpGraph) -> tuple[dict, ...]:
    """The call the plan was made for: every flat graph input with its role in the call
    (positional argument, keyword argument or loss target), global shape and dtype. The
    runtime rebuilds the example call from these and checks each step's data against them."""
    roles = graph.signature.roles() if graph.signature is not None else \
        tuple(("arg", str(i)) for i in range(len(graph.inputs)))
    return tuple({"name": name, "role": role, "key": key, "shape": list(meta.shape),
                  "dtype": meta.dtype} for (name, meta), (role, key) in zip(graph.inputs, roles))


def mesh_info(mesh) -> MeshInfo:
    return MeshInfo(name=mesh.name, shape=tuple(mesh.shape), axis_names=tuple(mesh.axis_names),
                    devices_per_node=mesh.devices_per_node, hardware=mesh.hardware.to_dict())


def batch_and_seq(graph: OpGraph) -> tuple[int, int]:
    """Global batch and sequence length from the first graph input (token ids: batch x seq)."""
    if not graph.inputs:
        raise PlanningError("the traced graph has no tensor inputs; pass example_inputs")
    shape = graph.inputs[0][1].shape
    return (shape[0] if shape else 1), (shape[1] if len(shape) > 1 else 1)


def check_training_options(*, dtype: str, optimizer: str) -> None:
    if dtype not in DTYPES:
        raise PlanningError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if optimizer not in OPTIMIZERS:
        raise PlanningError(f"optimizer={optimizer!r} is not supported; choose one of "
                            f"{', '.join(OPTIMIZERS)}")


def check_batch_divides(global_batch: int, degree: int, what: str = "data-parallel degree") -> None:
    if global_batch % degree:
        ok = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise PlanningError(f"global batch {global_batch} is not divisible by the {what} {degree}; "
                            f"degrees that divide it: {ok}. Change the batch or the mesh.")


def training_config(graph: OpGraph, *, microbatches: int = 1, microbatch_size: int = 0,
                    dtype: str = ComputeDtype.FP32, optimizer: str = "adam",
                    schedule: str = Schedule.ONE_F_ONE_B, virtual_stages: int = 1,
                    sequence_parallel: bool = False) -> TrainingConfig:
    batch, seq = batch_and_seq(graph)
    return TrainingConfig(global_batch=batch, seq_len=seq, microbatches=microbatches,
                          microbatch_size=microbatch_size, dtype=dtype, optimizer=optimizer,
                          schedule=schedule, virtual_stages=virtual_stages,
                          sequence_parallel=sequence_parallel)


def propagate_batch_sharding(graph: OpGraph, batch_placement: tuple[str, ...],
                             node_names: tuple[str, ...] | None = None) -> dict[str, OpPlacement]:
    """Operator placements of a plan that splits only the batch: an operator whose input is
    batch-sharded is batch-sharded (dim 0 of its output), a scalar reduction of a sharded
    value is partial, everything else is replicated."""
    ndim = len(batch_placement)
    replicated = (REPLICATE,) * ndim
    partial = tuple(PARTIAL if p != REPLICATE else REPLICATE for p in batch_placement)
    state: dict[str, tuple[str, ...]] = {name: batch_placement for name, _ in graph.inputs}
    ops: dict[str, OpPlacement] = {}
    names = node_names if node_names is not None else tuple(n.name for n in graph.nodes)
    for name in names:
        node = graph.node(name)
        ins = tuple(state.get(i, replicated) for i in node.inputs)
        sharded = any(p != replicated and PARTIAL not in p for p in ins)
        out = node.out
        if sharded and out is not None and len(out.shape) == 0:
            pl = partial
        elif sharded and out is not None and node.kind != OpKind.CREATION:
            pl = batch_placement
        else:
            pl = replicated
        state[name] = pl
        ops[name] = OpPlacement(inputs=ins, output=pl)
    return ops
