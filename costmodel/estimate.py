"""Estimate: predicted step time and memory of a plan on its mesh.

trace -> **cost** -> solve -> run. First roofline estimate for single-stage plans (the
walking skeleton's data-parallel plans): per-operator compute split by the operator's
output placements, one gradient all-reduce per replicated parameter over every mesh axis
that splits its consumer's work, optimizer step at memory bandwidth, no overlap.
"""

from __future__ import annotations

from meshplan.costmodel.comm import Collective, collective_time_s
from meshplan.costmodel.compute import DTYPE_BYTES, DTYPE_NAMES, op_time
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.errors import NotSupportedError
from meshplan.planner.graph import OpGraph, OpKind
from meshplan.plan import Estimate, MemoryBreakdown, Plan, Stage, StagePrediction

GIB = 2.0 ** 30
# bytes per parameter kept across steps: fp32 master weights (4) + fp32 gradients (4)
# + Adam's two fp32 moments (8) = 16 (ZeRO paper, Rajbhandari et al. 2020, section 3.1);
# mixed precision adds a 2-byte low-precision copy of the weights.
OPTIMIZER_BYTES = {"adam": 8, "sgd": 4}


def split_factor(placements: tuple[str, ...], mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a tensor (or an operator's work) is cut into by these placements."""
    n = 1
    for pl, size in zip(placements, mesh_shape):
        if pl != "R":
            n *= size
    return n


def stage_costs(stage: Stage, graph: OpGraph, hw: HardwareProfile, *, dtype: str,
                optimizer: str) -> StagePrediction:
    """Compute, communication and memory of one stage for the whole step on one device."""
    compute = 0.0
    activations = 0.0
    consumer_split: dict[str, list[tuple[str, ...]]] = {}
    for name, op in stage.ops.items():
        node = graph.node(name)
        shard = split_factor(op.output, stage.mesh_shape)
        compute += op_time(node, hw, dtype, shard).total_s
        if node.kind not in (OpKind.VIEW, OpKind.CREATION):
            activations += node.bytes_written * DTYPE_BYTES[dtype] / 4 / shard
        for p in node.params:
            consumer_split.setdefault(p, []).append(op.output)

    comm = 0.0
    weight_bytes = grad_bytes = opt_bytes = 0.0
    wbytes = DTYPE_BYTES[dtype]
    for name, pl in stage.params.items():
        info = graph.param_map[name]
        if info.tied_to is not None and info.tied_to in stage.params:
            continue
        numel = info.numel / split_factor(pl, stage.mesh_shape)
        weight_bytes += numel * (4 + (wbytes if dtype != "fp32" else 0))
        grad_bytes += numel * 4
        opt_bytes += numel * OPTIMIZER_BYTES.get(optimizer, 8)
        for axis, size in enumerate(stage.mesh_shape):
            if pl[axis] != "R" or size == 1:
                continue
            if any(out[axis] != "R" for out in consumer_split.get(name, ())):
                comm += collective_time_s(hw, Collective.ALL_REDUCE, numel * 4, size,
                                          crosses_nodes=_crosses(stage, axis, hw))
    memory = MemoryBreakdown(params_gib=weight_bytes / GIB, grads_gib=grad_bytes / GIB,
                             optimizer_gib=opt_bytes / GIB, activations_gib=activations / GIB)
    return StagePrediction(compute_s=compute, comm_s=comm, memory=memory)


def _crosses(stage: Stage, axis: int, hw: HardwareProfile) -> bool:
    stride = 1
    for s in stage.mesh_shape[axis + 1:]:
        stride *= s
    return stride * (stage.mesh_shape[axis] - 1) >= hw.devices_per_node or \
        stride >= hw.devices_per_node


def estimate_plan(plan: Plan, graph: OpGraph) -> Estimate:
    if plan.num_stages != 1:
        raise NotSupportedError("the first roofline estimate prices single-stage plans only; "
                                "pipeline plans need the full cost model")
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    t = plan.training
    stage = plan.stages[0]
    pred = stage_costs(stage, graph, hw, dtype=t.dtype, optimizer=t.optimizer)
    n_local_params = pred.memory.params_gib * GIB / (4 + (DTYPE_BYTES[t.dtype] if t.dtype != "fp32" else 0))
    # Adam touches weights, grads and two moments: ~16 bytes read and written per parameter
    optimizer_s = 2 * 16 * n_local_params / (hw.device.memory_bandwidth_gbps * 1e9)
    step = pred.compute_s + pred.comm_s + optimizer_s
    capacity = hw.device.memory_gib
    peak = pred.memory.total_gib
    n = plan.num_devices
    peak_flops = hw.device.peak_flops(DTYPE_NAMES[t.dtype])
    fits = peak <= capacity
    return Estimate(
        step_time_s=step, peak_memory_gib=peak, memory_capacity_gib=capacity, fits=fits,
        mfu=plan.model.train_flops_per_step / (step * n * peak_flops) if step else 0.0,
        tokens_per_s=t.global_batch * t.seq_len / step if step else 0.0,
        bubble_fraction=0.0,
        breakdown={"compute": pred.compute_s, "comm": pred.comm_s, "bubble": 0.0,
                   "optimizer": optimizer_s},
        memory=pred.memory,
        overflow="" if fits else f"needs {peak:.2f} GiB per device, capacity {capacity:.2f} GiB",
    )
