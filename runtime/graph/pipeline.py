"""Execute a multi-stage plan with ``torch.distributed.pipelining``.

trace -> cost -> solve -> plan -> **run**. The exported training graph (model + loss,
traced on meta exactly as the planner did, at the shape of one microbatch) is cut at the
plan's stage boundaries (runtime/graph/pipeline_split.py); each stage fragment runs on its stage
submesh through the SPMD executor (runtime/graph/spmd.py), wrapped in a ``PipelineStage``; the
plan's schedule (GPipe, 1F1B, interleaved 1F1B) drives ``plan.training.microbatches``
microbatches through them.

Device layout (the convention of planner/manual.py, written down in docs/DEVELOPING.md):
global ranks are numbered row-major over ``(pp, *stage axes)``, e.g. ``(pp, dp, tp)``. Rank
group ``r`` (``pp`` index) owns devices ``[r * n, (r + 1) * n)`` with ``n`` devices per stage
mesh; stage ``i`` runs on rank group ``i % pp`` (with ``virtual_stages = v`` there are
``pp * v`` stages, the "loop" placement of interleaved 1F1B, Narayanan et al. 2021, Sec. 2.2).
Every rank with the same stage-mesh coordinate forms one pipeline lane (one ``pp`` process
group); activations cross stages as the local shard of that coordinate, so no
redistribution happens at a boundary: the receiver rebuilds the DTensor with the placement
the producer's plan gives the value.

Loss and gradients: the last stage computes the loss itself (it is part of the graph), the
mean over its microbatch. The schedule's loss function divides it by the number of
microbatches, so the summed microbatch losses and the accumulated gradients are the mean
over the global batch, as in one process (all microbatches have the same size). After the
schedule, gradients are redistributed to their parameters' placements (the data-parallel
all-reduce) and a parameter read by stages on different rank groups (tied embeddings) has
its gradient summed over those groups.

ZeRO per stage, as runtime/graph/parallelize.py does for one stage: a ZeRO-3 stage stores its
parameters sharded over the data-parallel axes (its gradients are reduce-scattered to those
shards), ZeRO-1/2 stages keep sharded fp32 masters that the optimizer steps (ZeRO-2's untied
gradients reduce-scattered into them in one flat buffer, runtime/graph/zero.py) and all-gather
the parameters after the step. What the runtime accepts is stated in meshplan/support.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from meshplan import support
from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.support import lists_rank_groups
from meshplan.graph import OpGraph
from meshplan.tracing import WRAPPER_PREFIX, export_training_graph, graph_from_export
from meshplan.plan import Plan
from meshplan.schedules import virtual_stages_for
from meshplan.runtime.engine import data_parallel_axes
from meshplan.runtime.graph.programs import place_tensor, runnable_graph_module, sharded_over
from meshplan.runtime.shared import TORCH_SCHEDULES, broadcast_from_last, meta_copy
from meshplan.runtime.graph.pipeline_split import StageGraph, split_stages
from meshplan.runtime.graph.context import natural_order
from meshplan.runtime import loss_weights, state
from meshplan.runtime.graph import lowering, zero
from meshplan.runtime.graph.engine import GraphEngine
from meshplan.runtime.graph.spmd import placement_texts, stage_executor, to_placements
from meshplan.placements import REPLICATE
from meshplan.planner.manual import stage_node_groups


@dataclass(frozen=True, slots=True)
class PipelineLayout:
    """Where the stages of a plan run (see the module docstring for the convention)."""

    pp: int  # rank groups
    virtual_stages: int  # stages per rank group
    stage_mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    microbatches: int
    microbatch_batch: int  # sequences in one microbatch, over the whole stage mesh

    @property
    def stage_size(self) -> int:
        n = 1
        for s in self.stage_mesh_shape:
            n *= s
        return n

    def rank_group(self, stage_index: int) -> int:
        return stage_index % self.pp


def pipeline_layout(plan: Plan) -> PipelineLayout:
    """Check a multi-stage plan against what the runtime executes (meshplan/support.py: the
    device convention, schedules, microbatches) and read its layout."""
    if lists_rank_groups(plan):
        raise PlanFileError(f"interleaved plan with virtual_stages={plan.training.virtual_stages} "
                            f"lists {plan.num_stages} stages, one per rank group; expand it "
                            "first (expand_interleaved)")
    support.check_plan(plan)
    t, first = plan.training, plan.stages[0]
    return PipelineLayout(pp=support.pipeline_degree(plan),
                          virtual_stages=virtual_stages_for(t.schedule, t.virtual_stages),
                          stage_mesh_shape=tuple(first.mesh_shape),
                          axis_names=tuple(first.axis_names), microbatches=t.microbatches,
                          microbatch_batch=t.global_batch // t.microbatches)


def expand_interleaved(plan: Plan, graph: OpGraph) -> Plan:
    """One stage record per virtual stage: the blocks cut into pp x v near-equal chunks in
    order, chunk j on rank group j % pp (Megatron's interleaved assignment, Narayanan et al.
    2021, Sec. 2.2). Each operator and parameter keeps the placement of the record that
    lists it; all records share one submesh shape."""
    pp, v = plan.num_stages, plan.training.virtual_stages
    if graph.num_layers % (pp * v):
        raise PlanFileError(f"{graph.num_layers} blocks do not split into pp x virtual_stages = "
                            f"{pp * v} equal chunks; choose virtual_stages dividing "
                            f"{graph.num_layers // pp if graph.num_layers % pp == 0 else 1}")
    ops, params = {}, {}
    for st in plan.stages:
        ops.update(st.ops)
        params.update(st.params)
    layer_of = {n.name: n.layer for n in graph.nodes}
    records = []
    for j, names in enumerate(stage_node_groups(graph, pp * v)):
        group = plan.stages[j % pp]
        layers = [layer_of[n] for n in names if layer_of[n] >= 0] or [0]
        records.append(replace(group, index=j, nodes=(names[0], names[-1]),
                               layers=(min(layers), max(layers) + 1),
                               inputs=dict(plan.stages[0].inputs), params=params,
                               ops={n: ops[n] for n in names if n in ops}))
    return replace(plan, stages=tuple(records))


class _StageModule(nn.Module):
    """One stage fragment as the pipeline sees it: local tensors in, local tensors out.

    Inputs are rebuilt as DTensors on the stage mesh (graph inputs of the first stage are
    cut from the full microbatch each rank holds, without communication); outputs are
    brought to their planned placements and sent as this rank's local shard. The last
    stage returns the loss as a plain scalar, the same on every rank of its mesh.
    """

    def __init__(self, gm: fx.GraphModule, run, mesh: DeviceMesh, *, first: bool, last: bool,
                 input_specs: Sequence[tuple], output_specs: Sequence[tuple],
                 loss_dtype: torch.dtype = torch.float32, input_grads: Sequence[bool] = (),
                 output_grads: Sequence[bool] = ()):
        super().__init__()
        self.gm = gm
        self._executor = run  # an SPMDExecutor (runtime/graph/spmd.py), or any callable
        self._run = getattr(run, "run", run)
        self._mesh = mesh
        self._first, self._last = first, last
        self._input_specs = list(input_specs)  # (placements, global shape, dtype) per input
        self._output_specs = list(output_specs)
        self._loss_dtype = loss_dtype
        # values no parameter reaches (token ids, masks, the no-grad rotary cos/sin) carry no
        # gradient between stages
        self._input_grads = list(input_grads) or [True] * len(self._input_specs)
        self._output_grads = list(output_grads) or [True] * len(self._output_specs)

    def example_inputs(self, device) -> tuple[torch.Tensor, ...]:
        """Empty tensors shaped as this rank receives the inputs (the first stage: whole
        microbatches; later stages: local shards)."""
        return tuple(_example(shape if self._first else _local_shape(shape, self._mesh, pl),
                              dtype, device, grad)
                     for (pl, shape, dtype), grad in zip(self._input_specs, self._input_grads))

    def example_outputs(self, device) -> tuple[torch.Tensor, ...]:
        if self._last:
            return (_example((), self._loss_dtype, device),)
        return tuple(_example(_local_shape(shape, self._mesh, pl), dtype, device, grad)
                     for (pl, shape, dtype), grad in zip(self._output_specs, self._output_grads))

    def _dtensor_inputs(self, xs) -> list:
        """The stage's inputs as DTensors on its mesh: the first stage distributes the data it
        is given, later stages wrap the local shards pipelining received."""
        ins = []
        for x, (placements, shape, _) in zip(xs, self._input_specs):
            if self._first:
                ins.append(distribute_tensor(x, self._mesh, placements, src_data_rank=None))
            else:
                ins.append(DTensor.from_local(x, self._mesh, placements, run_check=False,
                                              shape=shape, stride=_contiguous_stride(shape)))
        return ins

    def forward(self, *xs):
        executor = self._executor
        if getattr(executor, "lowered", False) and executor.steps is not None and \
                not executor.record:
            return self._forward_local(executor, xs)
        outs = self._run(*self._dtensor_inputs(xs))
        if self._last:
            loss = outs[0]
            if not isinstance(loss, DTensor):
                return loss
            # This rank's local loss, no collective: its gradient seed stands for the global
            # loss's (Replicate), which the executor turns into each rank's share (a partial
            # average's 1/dp). The reported loss is reduced once per step (forward_backward).
            self.loss_weight = _reduction_weight(loss.placements, self._mesh)
            self.loss_placements = tuple(loss.placements)
            return loss.to_local(grad_placements=[Replicate()] * self._mesh.ndim)
        return tuple(_local(o, self._mesh, pl) for o, (pl, _, _) in zip(outs, self._output_specs))

    def _forward_local(self, executor, xs):
        """The built lowered program, local shards in and out: what ``forward`` computes,
        with no DTensor at the boundary (runtime/graph/lowering.py, ``from_shard``/``to_shard``)."""
        if self._first:
            xs = [lowering.shard_of(x, self._mesh, pl)
                  for x, (pl, _, _) in zip(xs, self._input_specs)]
        outs, specs = executor.run_local(*xs)
        if self._last:
            loss, spec = outs[0], specs[0]
            if spec is None:
                return loss
            self.loss_weight = _reduction_weight(spec.placements, self._mesh)
            self.loss_placements = tuple(spec.placements)
            return lowering.to_shard(loss, spec, grad_as=[Replicate()] * self._mesh.ndim)
        sent = []
        for o, spec, (pl, _, _) in zip(outs, specs, self._output_specs):
            if spec is not None:
                o = lowering.to_planned_shard(o, spec, pl)
            sent.append(o.contiguous())  # P2P sends need contiguous buffers
        return tuple(sent)


def _reduction_weight(placements, mesh: DeviceMesh) -> float:
    """What one rank's local value of a scalar counts for when every rank's local values are
    summed: 1/size on an axis where it is replicated or a partial average, 1 on a partial
    sum."""
    w = 1.0
    for axis, p in enumerate(placements):
        if isinstance(p, Replicate) or (isinstance(p, Partial) and p.reduce_op == "avg"):
            w /= mesh.size(axis)
    return w


def _local_shape(shape, mesh: DeviceMesh, placements) -> tuple[int, ...]:
    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])


def _example(shape, dtype: torch.dtype, device, grad: bool = True) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).requires_grad_(
        grad and dtype.is_floating_point)


def needs_grad(gm: fx.GraphModule) -> dict[str, bool]:
    """Per node name: whether its value depends on a trainable parameter (outside a no-grad
    region such as Llama's rotary embedding)."""
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    out: dict[str, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            out[n.name] = n.target in trainable
        elif n.op == "placeholder":
            out[n.name] = False
        elif n.op == "call_function" and "wrap_with_set_grad_enabled" in str(n.target) and \
                n.args and n.args[0] is False:
            out[n.name] = False
        else:
            out[n.name] = any(out.get(a.name, True) for a in n.all_input_nodes)
    return out


def _local(value, mesh: DeviceMesh, placements) -> torch.Tensor:
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(placements):
            value = value.redistribute(mesh, placements)
        value = value.to_local()
    return value.contiguous()  # P2P sends need contiguous buffers (expand/slice give views)


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


class _MicrobatchMean:
    """The schedule's loss: the stage's own loss over n (the mean of n equal microbatches),
    or, with a step's labelled-target table (``labels``, runtime/loss_weights.py), weighed
    by microbatch j's labelled targets; the target the schedule splits is then the
    microbatch indices."""

    def __init__(self, n: int):
        self.n = n
        self.labels = None  # set per step by PipelineModel._run_schedule
        self.dp_rank, self.dp_axes, self.stage_modules = 0, (), []

    def __call__(self, output: torch.Tensor, target) -> torch.Tensor:
        if self.labels is None:
            return output / self.n
        last = next(m for m in self.stage_modules if hasattr(m, "loss_placements"))
        where = dict(dp_rank=self.dp_rank, placements=last.loss_placements,
                     dp_axes=self.dp_axes, mesh_shape=tuple(last._mesh.shape))
        j = int(target.reshape(-1)[0])
        w = loss_weights.weight(self.labels, j, **where)
        if getattr(last._executor, "lowered", True):
            return output * (w / self.n)
        # a stage run on DTensor (cp): its loss backward is the whole microbatch's mean's
        # (loss_weights.weight); the value keeps the forward's weight, the gradient that one
        g = loss_weights.weight(self.labels, j, dtensor_backward=True, **where)
        return output * (g / self.n) + (output * ((w - g) / self.n)).detach()


@dataclass
class PipelineModel(GraphEngine):
    """A model split into pipeline stages per the plan; ``train_step`` runs one optimizer step."""

    plan: Plan
    layout: PipelineLayout
    schedule: object
    stages: list  # this rank's PipelineStage objects
    params: dict  # parameter FQN (every tied alias) -> nn.Parameter(DTensor) on this rank
    tie_groups: list = field(default_factory=list)  # (process group, [parameters], via)
    device: torch.device = torch.device("cpu")
    buffer_names: frozenset = frozenset()  # FQNs in ``params`` that are module buffers
    masters: dict = field(default_factory=dict)  # ZeRO-1/2: id(param) -> sharded fp32 master
    zero_of: dict = field(default_factory=dict)  # id(param) -> ZeRO stage of its stage

    def _eval_forward(self, records, meta, sig):
        """The forward-only program (runtime/graph/engine.py): the stages' own, run by the
        schedule's forward-only pass (``eval_pipeline``)."""
        if self.plan.num_stages == 1:
            return super()._eval_forward(records, meta, sig)
        return eval_pipeline(self, self._pristine, meta, data_parallel_axes(self.plan.stages[0]),
                             loss_fn=self._loss_fn, signature=sig)

    def forward_backward(self, batch, labels: torch.Tensor | None = None,
                         dp_rank: int = 0) -> float:
        """Run the schedule on one global batch (a tensor or the tuple of flat graph inputs);
        gradients are left in ``.grad``. Returns the mean loss over the global batch (on
        every rank). ``labels``: labelled targets per data-parallel rank and microbatch
        (runtime/loss_weights.py), which weigh the microbatches' losses."""
        return self._mean_loss(self._run_schedule(batch, labels, dp_rank))

    def _run_schedule(self, batch, labels: torch.Tensor | None = None,
                      dp_rank: int = 0) -> torch.Tensor:
        """The schedule and the gradient sync; returns this rank's weighted share of the
        global mean loss (zero off the last stage), not yet summed over ranks."""
        inputs = tuple(x.to(self.device) for x in (batch if isinstance(batch, tuple) else (batch,)))
        losses: list = []
        loss_fn = self.schedule._loss_fn  # the _MicrobatchMean built with the schedule
        loss_fn.labels, loss_fn.dp_rank = labels, dp_rank
        loss_fn.dp_axes = data_parallel_axes(self.plan.stages[0])
        loss_fn.stage_modules = [st.submod for st in self.stages]
        # the target the schedule splits into microbatches: only a carrier (the loss is in the
        # graph), or microbatch j's index where the labelled targets weigh it
        target = inputs[0] if labels is None else \
            torch.arange(self.layout.microbatches, device=self.device)
        self.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
        self._finish_grads()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for loss in losses:
            total += loss.detach().to(torch.float64)
        if losses:  # the last stage's ranks hold local losses: weigh them into the mean
            total *= next((st.submod.loss_weight for st in self.stages
                           if hasattr(st.submod, "loss_weight")), 1.0)
        return total

    @staticmethod
    def _mean_loss(share: torch.Tensor) -> float:
        dist.all_reduce(share)
        return float(share.item())

    def train_step(self, batch: torch.Tensor, optimizer: torch.optim.Optimizer,
                   labels: torch.Tensor | None = None, dp_rank: int = 0) -> float:
        share = self._run_schedule(batch, labels, dp_rank)
        # The loss is summed over every rank after the optimizer step: a sum over the whole
        # world before it would hold each rank's step until the slowest stage is done.
        self.optimizer_step(optimizer)
        return self._mean_loss(share)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The update after ``forward_backward``: the optimizer steps, ZeRO-1/2 parameters
        are gathered from their masters, and every gradient is dropped."""
        optimizer.step()
        self.gather_masters()
        optimizer.zero_grad(set_to_none=True)
        for p in self.unique_params():
            p.grad = None

    def unique_params(self) -> list[nn.Parameter]:
        return list({id(p): p for p in self.params.values()}.values())

    def named_unique_params(self) -> dict[str, nn.Parameter]:
        """First FQN of every distinct parameter on this rank (tied ones once)."""
        out, seen = {}, set()
        for name, p in self.params.items():
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
        return out

    def optimizer_params(self) -> dict[str, nn.Parameter]:
        """What the optimizer steps, by FQN: the parameters, or their ZeRO-1/2 master shards
        (as ParallelModel.optimizer_params); buffers are not stepped."""
        return {fqn: self.masters.get(id(p), p) for fqn, p in self.named_unique_params().items()
                if fqn not in self.buffer_names}

    def named_buffers(self) -> dict[str, nn.Parameter]:
        """This rank's buffers (BatchNorm's running statistics, rotary tables) by FQN, placed
        as frozen replicated parameters (as ParallelModel.named_buffers)."""
        return {name: p for name, p in self.params.items() if name in self.buffer_names}

    @torch.no_grad()
    def _finish_grads(self) -> None:
        """Gradients to their storage: the data-parallel all-reduce (ZeRO-3: reduce-scatter
        to the parameter's shard), sums over the rank groups of tied parameters, and for
        ZeRO-1/2 the master's shard (ZeRO-2's untied parameters: one flat reduce-scatter
        into the masters, runtime/graph/zero.py)."""
        params = self.unique_params()
        tied = {id(p) for _, members, _ in self.tie_groups for p in members}
        flat = zero.reduce_scatter_grads([(p, self.masters[id(p)]) for p in params
                                          if id(p) in self.masters and id(p) not in tied
                                          and self.zero_of.get(id(p)) == 2])
        rest = [p for p in params if id(p) not in flat]
        lowering.reduce_partial_grads(rest)
        for p in rest:
            if p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(placements=p.placements)
        for group, members, via in self.tie_groups:
            for p in members:
                if p.grad is None:
                    p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh,
                                                p.placements, run_check=False)
                if via is None:  # the same storage on every rank group: sum the shards
                    dist.all_reduce(p.grad.to_local(), group=group)
                    continue
                # storages differ across rank groups (ZeRO-3 on some): sum unsharded copies
                common = p.grad.redistribute(placements=to_placements(via))
                dist.all_reduce(common.to_local(), group=group)
                p.grad = common.redistribute(placements=p.placements)
        for p in rest:
            master = self.masters.get(id(p))
            if master is not None and p.grad is not None:  # our slice, no communication
                master.grad, p.grad = p.grad.redistribute(placements=master.placements), None

    @torch.no_grad()
    def gather_masters(self) -> None:
        """ZeRO-1/2: parameters all-gathered from their stepped master shards."""
        params = [p for p in self.unique_params() if id(p) in self.masters]
        flat = zero.gather_into_params([(p, self.masters[id(p)]) for p in params])
        for p in params:
            if id(p) not in flat:
                p.copy_(self.masters[id(p)].redistribute(placements=p.placements))

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered to a full tensor on every rank, by FQN (for
        tests, checkpoints): runtime/state.py's path."""
        return state.full_state_dict(self)

    def full_grads(self) -> dict[str, torch.Tensor]:
        mine = {}
        for name in sorted(self.params):  # full_tensor is a collective over the stage mesh
            p = self.params[name]
            grad = self.masters[id(p)].grad if id(p) in self.masters else p.grad
            if grad is not None:
                mine[name] = grad.full_tensor().detach().cpu()
        return state.gather_stages(self.plan, mine)


def parallelize_pipeline(model: nn.Module, plan: Plan, example_inputs: Sequence[torch.Tensor], *,
                         loss_fn=None, graph: OpGraph | None = None,
                         lowered: bool = True, signature=None) -> PipelineModel:
    """Place ``model`` (real weights, on CPU) on the current process group as the pipeline
    ``plan`` describes; ``example_inputs`` is one global batch. Pass ``graph`` (the model's
    trace at that batch, meshplan.trace) to skip re-tracing for the fingerprint check."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize_pipeline runs inside a torchrun worker: "
                           "init_process_group first")
    support.check_plan(plan)
    if dist.get_world_size() != plan.num_devices:
        raise RuntimeError(f"plan needs {plan.num_devices} processes, this run has "
                           f"{dist.get_world_size()}; launch with --nproc_per_node "
                           f"{plan.num_devices}")
    # Check the model against the plan on the global batch (as planned), then trace the
    # graph the stages run at the shape of one microbatch: same nodes, smaller batch dim.
    meta_model = meta_copy(model)
    meta_inputs = tuple(torch.empty_like(x, device="meta") for x in example_inputs)
    if graph is None:
        graph = graph_from_export(export_training_graph(meta_model, meta_inputs, loss_fn,
                                                        signature=signature), model)
    plan.check_graph(graph)
    if plan.training.virtual_stages > 1 and lists_rank_groups(plan):
        plan = expand_interleaved(plan, graph)
    layout = pipeline_layout(plan)
    micro_inputs = tuple(x[:layout.microbatch_batch] for x in meta_inputs)
    ep = export_training_graph(meta_model, micro_inputs, loss_fn, signature=signature)
    device = _device()
    gm = runnable_graph_module(ep, device_type=device.type)
    pieces = split_stages(gm.graph, [st.nodes for st in plan.stages])

    world = init_device_mesh(device.type, (layout.pp, *layout.stage_mesh_shape),
                             mesh_dim_names=("pp", *layout.axis_names))
    mesh = world[layout.axis_names]
    lane = world["pp"].get_group()
    my_group = dist.get_rank() // layout.stage_size
    params, zero_of = _place_params(model, plan, pieces, mesh, layout, my_group, device,
                                    constants=_lifted_constants(gm))
    masters = _masters(params, zero_of, support.dp_axes(plan.stages[0]))

    values = {n.name: n for n in gm.graph.nodes}
    stages = []
    for piece in pieces:
        if layout.rank_group(piece.index) != my_group:
            continue
        module = _stage_module(piece, plan, gm, values, params, mesh, len(pieces),
                               block_prefix=WRAPPER_PREFIX + graph.block_module,
                               lowered=lowered)
        # Static shapes: the schedule then never runs a stage on uninitialised tensors to
        # infer them (garbage token ids would index out of range).
        stages.append(PipelineStage(module, piece.index, len(pieces), device,
                                    input_args=module.example_inputs(device),
                                    output_args=module.example_outputs(device), group=lane))
    schedule_cls = TORCH_SCHEDULES[plan.training.schedule]
    loss = _MicrobatchMean(layout.microbatches)
    if schedule_cls is ScheduleInterleaved1F1B:
        schedule = schedule_cls(stages, n_microbatches=layout.microbatches, loss_fn=loss,
                                scale_grads=False)
    else:
        schedule = schedule_cls(stages[0], n_microbatches=layout.microbatches, loss_fn=loss,
                                scale_grads=False)
    return PipelineModel(plan=plan, layout=layout, schedule=schedule, stages=stages,
                         params=params, device=device, masters=masters, zero_of=zero_of,
                         tie_groups=_tie_groups(model, plan, pieces, params, layout),
                         buffer_names=frozenset(
                             name for name, _ in model.named_buffers(remove_duplicate=False)))


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _lifted_constants(gm: fx.GraphModule) -> frozenset[str]:
    """get_attr targets that are neither parameters nor buffers: tensor constants the export
    lifted (Falcon's index tensors), kept on the graph module as traced."""
    named = {n for n, _ in gm.named_parameters(remove_duplicate=False)}
    named |= {n for n, _ in gm.named_buffers(remove_duplicate=False)}
    return frozenset(n.target for n in gm.graph.nodes if n.op == "get_attr"
                     and n.target not in named
                     and isinstance(_attr(gm, n.target), torch.Tensor))


def _attr(gm: nn.Module, target: str):
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name, None)


def _place_params(model, plan: Plan, pieces: list[StageGraph], mesh: DeviceMesh,
                  layout: PipelineLayout, my_group: int, device, *,
                  constants: frozenset[str] = frozenset()):
    """This rank's parameters as DTensors with their storage placements (the planned ones,
    ZeRO-3 stages also sharded over the data-parallel axes, as runtime/graph/parallelize.py
    stores them for one stage); tied names share one. Buffers the plan does not place
    (planner/manual.py places none, e.g. Llama's rotary ``inv_freq``) are replicated.
    Returns (FQN -> parameter, id(parameter) -> its stage's ZeRO stage)."""
    real = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    real.update(buffers)
    aliases = state.aliases(model)
    placed: dict[int, nn.Parameter] = {}
    params: dict[str, nn.Parameter] = {}
    zero_of: dict[int, int] = {}
    for piece in pieces:
        if layout.rank_group(piece.index) != my_group:
            continue
        stage = plan.stages[piece.index]
        for target in piece.param_targets:
            if target in constants:  # read from the graph module, as one stage reads it
                continue
            fqn = target.removeprefix(WRAPPER_PREFIX)
            names = aliases.get(fqn, [fqn])
            listed = [stage.params[n] for n in names if n in stage.params]
            if not listed and fqn in buffers:
                listed = [(REPLICATE,) * mesh.ndim]
            elif listed:
                listed = [_storage(stage, listed[0], plan)]
            if not listed:
                raise PlanFileError(f"stage {piece.index} reads parameter {fqn} but the plan gives "
                                    "it no placement in that stage; re-plan with this model")
            tensor = real[fqn]
            if id(tensor) not in placed:
                placed[id(tensor)] = nn.Parameter(
                    place_tensor(tensor, mesh, to_placements(listed[0], mesh), device),
                    requires_grad=tensor.requires_grad)
                if fqn not in buffers:
                    zero_of[id(placed[id(tensor)])] = stage.zero
            elif [str(p) for p in placed[id(tensor)].placements] != \
                    [str(p) for p in to_placements(listed[0], mesh)]:
                raise NotSupportedError(f"parameter {fqn} has different placements in two stages "
                                        "on the same devices; give it one placement")
            for name in names:
                params[name] = placed[id(tensor)]
    return params, zero_of


def _storage(stage, planned, plan: Plan) -> tuple[str, ...]:
    """Where a parameter lives: ZeRO-3 shards it over the data-parallel axes (the axes stage
    0 splits the batch over; every stage mesh has the same shape)."""
    planned = tuple(planned)
    return sharded_over(planned, support.dp_axes(plan.stages[0])) if stage.zero >= 3 else planned


def _masters(params: dict, zero_of: dict, axes) -> dict[int, nn.Parameter]:
    """ZeRO-1/2: an fp32 master per parameter, sharded over the data-parallel axes; the
    optimizer steps it and ``gather_masters`` copies it back (runtime/graph/parallelize.py)."""
    masters = {}
    for p in {id(p): p for p in params.values()}.values():
        if zero_of.get(id(p)) in (1, 2) and p.requires_grad:
            target = to_placements(sharded_over(placement_texts(p.placements), axes))
            masters[id(p)] = nn.Parameter(p.detach().float().redistribute(placements=target))
    return masters


def _stage_module(piece: StageGraph, plan: Plan, whole: fx.GraphModule, values: dict,
                  params: dict, mesh: DeviceMesh, num_stages: int, *,
                  block_prefix: str, lowered: bool = True) -> _StageModule:
    stage = plan.stages[piece.index]
    if piece.recomputed:
        # shape-only values of earlier stages (masks, rotary cos/sin) are rebuilt here: run
        # their operators as the stage that owns them plans them (every stage mesh has the
        # same shape), so they come out with the placement that stage would have sent
        owned = {name: st.ops[name] for st in plan.stages for name in piece.recomputed
                 if name in st.ops}
        stage = replace(stage, ops={**stage.ops, **owned})
    root = {t: params[t.removeprefix(WRAPPER_PREFIX)] if t.removeprefix(WRAPPER_PREFIX)
            in params else _attr(whole, t) for t in piece.param_targets}
    # bodies of higher-order operators (e.g. Llama's no-grad rotary embedding) as traced
    root.update({t: whole.get_submodule(t) for t in piece.subgraph_targets})
    gm = fx.GraphModule(root, piece.graph, class_name=f"Stage{piece.index}")
    run = stage_executor(gm, mesh, stage, dtype=plan.training.dtype, block_prefix=block_prefix,
                         lowered=lowered)
    first = piece.index == 0

    def spec(name):
        val = values[name].meta["val"]
        return (to_placements(_placement_of(plan, name, values, len(mesh.shape)), mesh),
                tuple(val.shape), val.dtype)
    last = piece.index == num_stages - 1
    grads = needs_grad(whole)
    return _StageModule(gm, run, mesh, first=first, last=last,
                        input_specs=[spec(n) for n in piece.inputs],
                        output_specs=[] if last else [spec(n) for n in piece.outputs],
                        input_grads=[grads.get(n, True) for n in piece.inputs],
                        output_grads=[] if last else [grads.get(n, True) for n in piece.outputs],
                        loss_dtype=values[piece.outputs[0]].meta["val"].dtype if last else
                        torch.float32)


def _placement_of(plan: Plan, name: str, values: dict, ndim: int) -> tuple[str, ...]:
    """The planned placement of a value crossing a boundary: a graph input's placement in stage
    0, or the output placement its producing stage plans; replicated when the plan is silent."""
    if values[name].op == "placeholder":
        return tuple(plan.stages[0].inputs.get(name, (REPLICATE,) * ndim))
    for st in plan.stages:
        op = st.ops.get(name)
        if op is not None and op.output:
            return tuple(op.output)
    return (REPLICATE,) * ndim


def _tie_groups(model, plan: Plan, pieces: list[StageGraph], params: dict,
                layout: PipelineLayout) -> list:
    """Process groups summing the gradient of a parameter read on several rank groups, as
    (group, parameters, via): ``via`` is None when every rank group stores the parameter
    alike, else the placement (data-parallel axes unsharded) the sum is taken in.

    Every rank creates every group in the same order (``new_group`` is collective)."""
    aliases = state.aliases(model)
    trained = {name for name, p in model.named_parameters(remove_duplicate=False)
               if p.requires_grad}
    owners: dict[str, set[int]] = {}
    storages: dict[str, set[tuple[str, ...]]] = {}
    for piece in pieces:
        stage = plan.stages[piece.index]
        for target in piece.param_targets:
            fqn = target.removeprefix(WRAPPER_PREFIX)
            key = aliases.get(fqn, [target])[0]
            if key in trained:  # buffers have no gradient to sum
                owners.setdefault(key, set()).add(layout.rank_group(piece.index))
                planned = next((stage.params[n] for n in aliases.get(fqn, [fqn])
                                if n in stage.params), None)
                if planned is not None:
                    storages.setdefault(key, set()).add(_storage(stage, planned, plan))
    rank = dist.get_rank()
    my_group, coord = divmod(rank, layout.stage_size)
    out = []
    for groups in sorted({tuple(sorted(g)) for g in owners.values() if len(g) > 1}):
        keys = sorted(k for k, g in owners.items() if tuple(sorted(g)) == groups)
        for c in range(layout.stage_size):
            pg = dist.new_group([g * layout.stage_size + c for g in groups])
            if my_group in groups and c == coord:
                for k in keys:
                    out.append((pg, [params[k]], _common(storages.get(k, set()),
                                                         support.dp_axes(plan.stages[0]))))
    return out


def _common(storages: set, axes) -> tuple[str, ...] | None:
    """None when one storage serves every rank group, else that storage with the
    data-parallel axes replicated (what ZeRO-3 adds is undone; the rest must agree)."""
    if len(storages) <= 1:
        return None
    plain = {tuple(REPLICATE if i in axes else p for i, p in enumerate(pl)) for pl in storages}
    if len(plain) > 1:
        raise NotSupportedError(f"a tied parameter has placements {sorted(plain)} on different "
                                "rank groups; give its copies one placement")
    return next(iter(plain))


# -- forward only (eval) -----------------------------------------------------------------------

class _EvalStageModule(_StageModule):
    """A stage of the forward-only pipeline: as ``_StageModule``, but the last stage returns
    the model's output, not a loss: this rank's rows of the microbatch (sharded over the
    data-parallel axes, full over the others)."""

    def __init__(self, *args, out_placements, out_shape, out_dtype, **kwargs):
        super().__init__(*args, **kwargs)
        self._out_placements = out_placements
        self._out_shape, self._out_dtype = out_shape, out_dtype

    def example_outputs(self, device) -> tuple[torch.Tensor, ...]:
        if not self._last:
            return super().example_outputs(device)
        return (_example(_local_shape(self._out_shape, self._mesh, self._out_placements),
                         self._out_dtype, device, False),)

    def forward(self, *xs):
        if not self._last:
            return super().forward(*xs)
        out = self._run(*self._dtensor_inputs(xs))[0]
        local = _local(out, self._mesh, self._out_placements)
        if isinstance(out, DTensor):  # cp: from the load-balanced layout to sequence order
            local = natural_order(local, out.placements, self._mesh).contiguous()
        return local


@dataclass
class EvalPipeline:
    """The forward-only pipeline of a ``PipelineModel``: the model's eval-mode forward (no
    loss; dropout off, BatchNorm on its running statistics) exported at the shape of one
    microbatch, cut where the training stages are cut, each fragment run on the training
    stages' own parameters (no copy) by the schedule's forward-only pass."""

    schedule: object
    stages: list
    lane: object  # the pipeline lane's process group (this stage-mesh coordinate)
    device: torch.device

    def __call__(self, batch: tuple) -> torch.Tensor:
        """This rank's rows of the outputs of every microbatch of the global ``batch``, in
        microbatch order, on every rank of the lane (broadcast from the last stage)."""
        inputs = tuple(x.to(self.device) for x in batch)
        has_first = any(st.is_first for st in self.stages)
        has_last = any(st.is_last for st in self.stages)
        with torch.no_grad():
            out = self.schedule.eval(*(inputs if has_first else ()))
        return broadcast_from_last(out.contiguous() if has_last else None, self.lane,
                                   self.device)


def eval_pipeline(pm: PipelineModel, model: nn.Module, example_inputs: Sequence[torch.Tensor],
                  dp_axes: Sequence[int], *, loss_fn=None, signature=None) -> EvalPipeline:
    """Build ``pm``'s forward-only pipeline. ``model`` is a meta copy of the user's model,
    ``example_inputs`` one global batch of the forward's inputs (meta, no targets)."""
    plan, layout = pm.plan, pm.layout
    micro = tuple(x[:layout.microbatch_batch] for x in example_inputs)
    ep = export_training_graph(meta_copy(model).eval(), micro, loss_fn, signature=signature,
                               loss=False)
    gm = runnable_graph_module(ep, device_type=pm.device.type)
    values = {n.name: n for n in gm.graph.nodes}
    # each operator goes to the training stage of the operator of the same name (an
    # eval-only operator to the stage of the one before it): the cut falls where it falls in
    # training, so every stage reads only the parameters its ranks hold
    stage_of = {name: k for k, st in enumerate(plan.stages) for name in st.ops}
    groups: list[list[str]] = [[] for _ in plan.stages]
    current = 0
    for n in gm.graph.nodes:
        if n.op == "call_function":
            current = max(current, stage_of.get(n.name, current))
            groups[current].append(n.name)
    if any(not g for g in groups):
        empty = next(k for k, g in enumerate(groups) if not g)
        raise NotSupportedError(f"the eval-mode forward has no operator in pipeline stage "
                                f"{empty}; evaluate with a single-stage plan")
    pieces = split_stages(gm.graph, [(g[0], g[-1]) for g in groups])
    if len(pieces[-1].outputs) != 1:
        raise NotSupportedError(f"the model's forward returns {len(pieces[-1].outputs)} "
                                "tensors; forward-only pipeline calls return one")
    mesh = next(p for p in pm.params.values()).device_mesh
    lane = pm.stages[0].group
    my_group = dist.get_rank() // layout.stage_size
    out_node = values[pieces[-1].outputs[0]]
    out_placements = [Shard(0) if a in dp_axes else Replicate() for a in range(mesh.ndim)]
    stages = []
    for piece in pieces:
        if layout.rank_group(piece.index) != my_group:
            continue
        st = plan.stages[piece.index]
        # the plan's placement of an operator the eval graph shares with the training graph
        # (same name, same number of inputs); DTensor's propagation lays out the others
        ops = {n: op for s in plan.stages for n, op in s.ops.items()
               if n in values and len(op.inputs) == len(values[n].all_input_nodes)}
        record = replace(st, ops={n: ops[n] for n in [*(g for g in groups[piece.index]),
                                                      *piece.recomputed] if n in ops})
        root = {t: pm.params[t.removeprefix(WRAPPER_PREFIX)]
                if t.removeprefix(WRAPPER_PREFIX) in pm.params else _attr(gm, t)
                for t in piece.param_targets}
        root.update({t: gm.get_submodule(t) for t in piece.subgraph_targets})
        frag = fx.GraphModule(root, piece.graph, class_name=f"EvalStage{piece.index}")
        run = stage_executor(frag, mesh, record, dtype=plan.training.dtype, lowered=False)

        def spec(name):
            val = values[name].meta["val"]
            return (to_placements(_placement_of(plan, name, values, mesh.ndim), mesh),
                    tuple(val.shape), val.dtype)
        last = piece.index == len(pieces) - 1
        module = _EvalStageModule(
            frag, run, mesh, first=piece.index == 0, last=last,
            input_specs=[spec(n) for n in piece.inputs],
            output_specs=[] if last else [spec(n) for n in piece.outputs],
            input_grads=[False] * len(piece.inputs),
            output_grads=[] if last else [False] * len(piece.outputs),
            out_placements=out_placements, out_shape=tuple(out_node.meta["val"].shape),
            out_dtype=out_node.meta["val"].dtype)
        stages.append(PipelineStage(module, piece.index, len(pieces), pm.device,
                                    input_args=module.example_inputs(pm.device),
                                    output_args=module.example_outputs(pm.device), group=lane))
    cls = TORCH_SCHEDULES[plan.training.schedule]
    schedule = cls(stages if cls is ScheduleInterleaved1F1B else stages[0],
                   n_microbatches=layout.microbatches)
    return EvalPipeline(schedule=schedule, stages=stages, lane=lane, device=pm.device)
