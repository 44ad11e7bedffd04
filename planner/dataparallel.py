"""The data-parallel planner: the walking skeleton's search space (one plan).

trace -> cost -> **solve** -> run. Every parameter is replicated on every mesh axis and the
global batch is split over all devices; the first roofline estimate prices it. The ILP
planner (planner/intra) and the pipeline planner replace this search; it stays as the
baseline they must beat.
"""

from __future__ import annotations

import time

from meshplan.costmodel.estimate import estimate_plan, stage_costs
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.planner.assemble import (check_batch_divides, mesh_info, model_info,
                                       propagate_batch_sharding, training_config)
from meshplan.planner.graph import OpGraph
from meshplan.plan import Estimate, Plan, SolverInfo, Stage

NAME = "data-parallel"


def plan_data_parallel(graph: OpGraph, mesh, *, dtype: str = "fp32",
                       optimizer: str = "adam") -> Plan:
    start = time.perf_counter()
    training = training_config(graph, dtype=dtype, optimizer=optimizer)
    check_batch_divides(training.global_batch, mesh.num_devices)
    ndim = len(mesh.shape)
    batch = ("S(0)",) * ndim
    stage = Stage(
        index=0, devices=tuple(range(mesh.num_devices)), mesh_shape=tuple(mesh.shape),
        axis_names=tuple(mesh.axis_names), layers=(0, graph.num_layers),
        nodes=(graph.nodes[0].name, graph.nodes[-1].name),
        inputs={name: batch for name, _ in graph.inputs},
        params={p.name: ("R",) * ndim for p in graph.params},
        ops=propagate_batch_sharding(graph, batch),
    )
    hw = mesh.hardware if isinstance(mesh.hardware, HardwareProfile) else \
        HardwareProfile.from_dict(mesh.hardware)
    stage = _with_prediction(stage, graph, hw, training)
    plan = Plan(model=model_info(graph), mesh=mesh_info(mesh), training=training,
                stages=(stage,), predicted=_EMPTY,
                solver=SolverInfo(name=NAME, status="optimal (single candidate)"))
    estimate = estimate_plan(plan, graph)
    return Plan(model=plan.model, mesh=plan.mesh, training=plan.training, stages=plan.stages,
                predicted=estimate,
                solver=SolverInfo(name=NAME, status="optimal (single candidate)", gap=0.0,
                                  time_s=0.0, objective_s=estimate.step_time_s),
                graph=graph, wall_time_s=time.perf_counter() - start)


def _with_prediction(stage: Stage, graph: OpGraph, hw: HardwareProfile, training) -> Stage:
    from dataclasses import replace
    pred = stage_costs(stage, graph, hw, dtype=training.dtype, optimizer=training.optimizer)
    return replace(stage, predicted=pred)


_EMPTY = Estimate(step_time_s=0.0, peak_memory_gib=0.0, memory_capacity_gib=0.0, fits=True,
                  mfu=0.0, tokens_per_s=0.0)
