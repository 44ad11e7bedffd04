"""Execute a plan: Plan + model -> DeviceMesh, DTensor parameters, a training step.

trace -> cost -> solve -> plan -> **run**. Runs inside each torchrun worker and reads as the
steps of a plan: trace the model on meta exactly as the planner did (node names then match
``stage.ops``), build the stage's DeviceMesh, distribute every parameter with its storage
placement (the planned one; with ZeRO-3 also sharded over the data-parallel axes), and hand
the graph to the SPMD executor (runtime/graph/spmd.py), which realises every operator's planned
input placements, recompute and mixed precision. A training step accumulates gradients over
``plan.training.microbatches``, brings each gradient to its parameter's storage placement
(the data-parallel all-reduce, or a reduce-scatter with ZeRO) and steps a torch.optim
optimizer; ZeRO-1/2 step fp32 master shards and all-gather the parameters after.

Multi-stage plans go to the pipeline runtime (runtime/graph/pipeline.py), which reuses the same
executor per stage submesh. Both build on runtime/graph/programs.py (the exported program made
runnable on DTensor, parameters placed); ``build`` here is the graph engine's entry for
``meshplan.parallelize``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from meshplan import support
from meshplan.errors import NotSupportedError, PlanFileError
from meshplan.tracing import (WRAPPER_PREFIX, export_training_graph,
                                    find_repeated_blocks, graph_from_export)
from meshplan.plan import Plan, Stage
from meshplan.runtime import loss_weights, state
from meshplan.runtime.graph import lowering, zero
from meshplan.runtime.engine import TENSOR_DTYPES, data_parallel_axes, plan_call
from meshplan.runtime.graph.engine import GraphEngine
from meshplan.runtime.graph.pipeline import _reduction_weight, parallelize_pipeline
from meshplan.runtime.graph.programs import (install_params, place_tensor, runnable_graph_module,
                                             sharded_over, storage_placements)
from meshplan.runtime.graph.spmd import SPMDExecutor, placement_texts, to_placements  # noqa: F401 (re-exported)
from meshplan.runtime.shared import meta_copy
from meshplan.vocabulary import ComputeDtype
from meshplan.placements import shard
from meshplan.runtime.graph.optim import LocalShardAdam, LocalShardSGD

# fp16 needs loss scaling (Micikevicius et al. 2018, Sec. 3.3). A constant scale of 2**10
# keeps tiny gradients of small models above fp16's subnormal range; a step whose
# gradients overflow is skipped.
FP16_LOSS_SCALE = 2.0 ** 10


@dataclass(frozen=True)
class TracedProgram:
    """The exported training graph (at the microbatch shape) and its OpGraph."""

    exported: torch.export.ExportedProgram
    graph: object
    microbatches: int
    # plan node name -> node name in ``exported`` where the microbatch trace named its
    # nodes differently (a no-op expand to a batch of one is not traced); None: the same
    rename: dict | None = None


@dataclass
class ParallelModel(GraphEngine):
    """A model placed on its mesh per the plan; ``train_step`` runs one optimizer step."""

    plan: Plan
    mesh: DeviceMesh
    gm: torch.fx.GraphModule
    params: dict  # graph parameter/buffer name -> nn.Parameter(DTensor) / DTensor; ties share
    input_placements: list
    block_prefix: str = ""
    program: object = None  # the TracedProgram, reusable by the next parallelize_graph call
    masters: dict = field(default_factory=dict)  # ZeRO-1/2: id(param) -> sharded fp32 master
    last_stats: object = None
    lowered: bool = True  # run the lowered program (runtime/graph/lowering.py), not DTensor per op
    _executor: object = None
    _ops_of: object = None  # the stage ops ``_renamed`` was made from
    _renamed: dict = field(default_factory=dict)

    def __post_init__(self):
        install_params(self.gm, self.params)

    @property
    def stage(self) -> Stage:
        return self.plan.stages[0]

    def _run_ops(self) -> dict:
        """The stage's operator placements keyed by the executed graph's node names."""
        ops = self.stage.ops
        rename = self.program.rename if self.program is not None else None
        if not rename:
            return ops
        if self._ops_of is not ops:
            self._ops_of = ops
            self._renamed = {rename[k]: v for k, v in ops.items() if k in rename}
        return self._renamed

    def loss(self, *inputs: torch.Tensor, record: bool = False) -> DTensor:
        """Forward of one (micro)batch (the flat graph inputs, global shapes): the global loss
        as a DTensor. ``record`` keeps the placements every operator ran with in
        ``last_stats.observed``."""
        ops = self._run_ops()
        executor = self._executor if not record and self._executor is not None and \
            self._executor.ops is ops else SPMDExecutor(
                self.gm, self.mesh, ops, input_placements=self.input_placements,
                recompute=self.stage.recompute, block_prefix=self.block_prefix,
                dtype=self.plan.training.dtype, record=record, lowered=self.lowered)
        if not record:  # the lowered program is built by the first call and then reused
            self._executor = executor
        out = executor.run(*inputs)
        self.last_stats = executor.stats
        return out.float()

    def forward_backward(self, batch, labels: torch.Tensor | None = None,
                         dp_rank: int = 0) -> tuple[float, bool]:
        """Forward and backward of every microbatch of one global batch (a tensor or the
        tuple of flat graph inputs), then the gradient sync: gradients are left on what
        ``optimizer_params`` returns. Returns (global mean loss, gradients finite).
        ``labels``: labelled targets per data-parallel rank and microbatch
        (runtime/loss_weights.py), weighing each microbatch's loss on this rank
        (data-parallel rank ``dp_rank``) so that the step's is the global labelled mean."""
        inputs = batch if isinstance(batch, tuple) else (batch,)
        n = self.plan.training.microbatches
        if inputs[0].shape[0] % n:
            raise PlanFileError(f"batch of {inputs[0].shape[0]} sequences does not split into "
                                f"{n} microbatches; use a batch divisible by {n}")
        scale = FP16_LOSS_SCALE if self.plan.training.dtype == ComputeDtype.FP16 else 1.0
        if labels is None:
            total = None
            for chunk in zip(*(x.chunk(n) for x in inputs)):
                loss = self.loss(*chunk)
                (loss * (scale / n)).backward()
                total = loss.detach() if total is None else total + loss.detach()
            ok = self._sync_grads(scale)
            return float(total.full_tensor().item()) / n, ok
        # weighted: each rank's own loss value (what its placements say it is a mean over)
        # times its weight; the reported loss is the sum of every rank's share
        share = torch.zeros((), dtype=torch.float64, device=self.mesh.device_type)
        for j, chunk in enumerate(zip(*(x.chunk(n) for x in inputs))):
            loss = self.loss(*chunk)
            where = dict(placements=loss.placements, dp_axes=data_parallel_axes(self.stage),
                         mesh_shape=self.stage.mesh_shape)
            w = loss_weights.weight(labels, j, dp_rank=dp_rank, **where)
            # on DTensor (cp stages run unlowered) the loss's backward is the whole
            # microbatch's mean's, whatever the forward's own-rows value (loss_weights.weight)
            g = w if self._executor.lowered else loss_weights.weight(
                labels, j, dp_rank=dp_rank, dtensor_backward=True, **where)
            local = loss.to_local(grad_placements=[Replicate()] * self.mesh.ndim)
            (local * (g * scale / n)).backward()
            share += local.detach().double() * (w / n) * \
                _reduction_weight(loss.placements, self.mesh)
        ok = self._sync_grads(scale)
        dist.all_reduce(share)
        return float(share.item()), ok

    def train_step(self, batch, optimizer: torch.optim.Optimizer, *,
                   grads_out: dict | None = None, labels: torch.Tensor | None = None,
                   dp_rank: int = 0) -> float:
        """Forward and backward of every microbatch, gradient sync, optimizer step.
        ``grads_out`` (a dict) receives every gradient as a full tensor, by FQN; ``labels``
        as in ``forward_backward``."""
        loss, ok = self.forward_backward(batch, labels, dp_rank)
        if grads_out is not None:
            for fqn, p in self.optimizer_params().items():
                if p.grad is not None:
                    grads_out[fqn] = p.grad.full_tensor()
        if ok:
            optimizer.step()
            self.gather_masters()
        optimizer.zero_grad(set_to_none=True)
        for p in self.unique_params():
            p.grad = None
        return loss

    def _sync_grads(self, scale: float) -> bool:
        finite = True
        params = self.unique_params()
        flat: set[int] = set()  # ZeRO-2 gradients reduce-scattered into their masters
        if not self.masters or self.stage.zero == 1:
            # data parallelism and ZeRO-1: one flat all-reduce per group (ZeRO-1 then keeps
            # its master's shard below, without communication)
            lowering.reduce_partial_grads(params)
        else:
            flat = zero.reduce_scatter_grads([(p, self.masters[id(p)]) for p in params
                                              if id(p) in self.masters])
        for p in params:
            if id(p) in flat:
                master = self.masters[id(p)]
                if scale != 1.0:
                    master.grad = master.grad / scale
                    finite = finite and bool(torch.isfinite(master.grad.to_local()).all())
                continue
            if p.grad is None:
                continue
            master = self.masters.get(id(p))
            target = master.placements if master is not None and self.stage.zero == 2 \
                else p.placements
            grad = p.grad.redistribute(placements=target) \
                if tuple(p.grad.placements) != tuple(target) else p.grad
            if master is not None:  # ZeRO-1: all-reduced grad, keep our shard (no comm)
                grad = grad.redistribute(placements=master.placements)
            if scale != 1.0:
                grad = grad / scale
                finite = finite and bool(torch.isfinite(grad.to_local()).all())
            if master is not None:
                master.grad, p.grad = grad, None
            else:
                p.grad = grad
        if scale != 1.0:  # every rank skips the step if any rank overflowed
            flag = torch.tensor([0.0 if finite else 1.0], device=self.mesh.device_type)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return flag.item() == 0.0
        return True

    def gather_masters(self) -> None:
        params = self.unique_params()
        flat = zero.gather_into_params([(p, self.masters[id(p)]) for p in params
                                        if id(p) in self.masters])
        with torch.no_grad():
            for p in params:
                master = self.masters.get(id(p))
                if master is not None and id(p) not in flat:
                    p.copy_(master.redistribute(placements=p.placements))

    def unique_params(self) -> list[nn.Parameter]:
        return list({id(p): p for p in self.params.values() if isinstance(p, nn.Parameter)}.values())

    def named_unique_params(self) -> dict[str, nn.Parameter]:
        """First FQN of every distinct parameter (tied ones once), in graph order."""
        out, seen = {}, set()
        for name, p in self.params.items():
            if isinstance(p, nn.Parameter) and id(p) not in seen:
                seen.add(id(p))
                out[name.removeprefix(WRAPPER_PREFIX)] = p
        return out

    def optimizer_params(self) -> dict[str, nn.Parameter]:
        """What the optimizer steps, by FQN: the parameters, or their ZeRO-1/2 master shards."""
        return {fqn: self.masters.get(id(p), p) for fqn, p in self.named_unique_params().items()}

    def named_buffers(self) -> dict[str, DTensor]:
        """Every buffer the graph reads (BatchNorm's running statistics, rotary tables), by
        FQN, as placed (replicated): what a checkpoint saves beside the parameters."""
        return {name.removeprefix(WRAPPER_PREFIX): t for name, t in self.params.items()
                if not isinstance(t, nn.Parameter)}

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered to a full tensor, by FQN (for tests and
        checkpoints): runtime/state.py's path."""
        return state.full_state_dict(self)


def build(model: nn.Module, plan, *, loss_fn=None, pristine: nn.Module):
    """The graph engine for ``plan`` on ``model`` (real weights are placed as they are; a
    meta model gets only its local shards). ``pristine``: a meta copy of the model as the
    user built it, which the eval programs are exported from."""
    sig, records = plan_call(plan)
    meta = tuple(torch.empty(r["shape"], dtype=TENSOR_DTYPES.get(r["dtype"], torch.float32),
                             device="meta") for r in records)
    engine = parallelize_graph(model, plan, meta, loss_fn=loss_fn, signature=sig)
    engine.bind(pristine, loss_fn)
    return engine


def parallelize_graph(model: nn.Module, plan: Plan, example_inputs: Sequence[torch.Tensor], *,
                loss_fn=None, program: "TracedProgram | None" = None,
                lowered: bool = True, signature=None) -> ParallelModel:
    """Place ``model`` (real weights, on CPU) on the current process group per ``plan``.

    ``program`` reuses the trace of an earlier call on the same model and shapes
    (``ParallelModel.program``), which saves the export when several plans run in a row.
    ``lowered=False`` runs every operator on DTensor (the reference executor) instead of
    the lowered program (runtime/graph/lowering.py)."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize_graph runs inside a torchrun worker: "
                           "init_process_group first")
    support.check_plan(plan)  # what the runtime executes (meshplan/support.py)
    refused = support.graph_engine_cp_rule(plan)
    if refused:  # on every rank, before any collective
        raise NotSupportedError(refused[0])
    if plan.num_stages > 1:
        return parallelize_pipeline(model, plan, example_inputs, loss_fn=loss_fn,
                                    lowered=lowered, signature=signature)
    if dist.get_world_size() != plan.num_devices:
        raise PlanFileError(f"plan needs {plan.num_devices} processes, this run has "
                            f"{dist.get_world_size()}; launch with --nproc_per_node "
                            f"{plan.num_devices}")
    # Trace on meta, exactly as the planner did: node names and the fingerprint then agree
    # with the plan (a trace on CPU differs in no-op layout ops such as contiguous).
    meta_inputs = tuple(torch.empty_like(x, device="meta") for x in example_inputs)
    if program is None or program.microbatches != plan.training.microbatches:
        ep = export_training_graph(meta_copy(model), meta_inputs, loss_fn, signature=signature)
        graph = graph_from_export(ep, model)
        ep, rename = microbatch_program(model, plan, ep, meta_inputs, loss_fn, signature)
        program = TracedProgram(ep, graph, plan.training.microbatches, rename)
    ep, graph = program.exported, program.graph
    plan.check_graph(graph)

    stage = plan.stages[0]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, stage.mesh_shape, mesh_dim_names=stage.axis_names)
    gm = runnable_graph_module(ep, device_type=device_type)
    params = distribute_params(model, gm, mesh, stage, device_type)
    pm = ParallelModel(plan=plan, mesh=mesh, gm=gm, params=params, program=program,
                       lowered=lowered,
                       input_placements=[stage.inputs[name] for name, _ in graph.inputs],
                       block_prefix=WRAPPER_PREFIX + find_repeated_blocks(model)[0])
    if stage.zero in (1, 2):
        axes = data_parallel_axes(stage)
        for p in pm.unique_params():
            target = to_placements(sharded_over(placement_texts(p.placements), axes), mesh)
            pm.masters[id(p)] = nn.Parameter(p.detach().redistribute(placements=target))
    return pm


def microbatch_program(model, plan: Plan, ep, meta_inputs, loss_fn, signature=None):
    """The exported graph at the microbatch shape (views in the graph carry global shapes),
    and the renaming of the plan's node names into it (None when the names agree)."""
    n = plan.training.microbatches
    if n == 1:
        return ep, None
    if meta_inputs[0].shape[0] % n:
        raise PlanFileError(f"global batch {meta_inputs[0].shape[0]} does not split into "
                            f"{n} microbatches")
    micro = tuple(x[: x.shape[0] // n] for x in meta_inputs)
    ep_micro = export_training_graph(meta_copy(model), micro, loss_fn, signature=signature)
    names = [n_.name for n_ in ep.graph.nodes]
    if [n_.name for n_ in ep_micro.graph.nodes] == names:
        return ep_micro, None
    return ep_micro, match_nodes(ep.graph, ep_micro.graph)


def match_nodes(whole: torch.fx.Graph, micro: torch.fx.Graph) -> dict[str, str]:
    """Node names of the global-batch graph -> those of the microbatch graph, matched in
    order by operator. At a batch of one torch.export drops no-op operators (an ``expand``
    of a mask to the batch size), which shifts the numbered names after it; every other
    operator must match, or the graphs are refused."""
    import difflib

    def ops(g):
        return [n_ for n_ in g.nodes if n_.op == "call_function"]
    a, b = ops(whole), ops(micro)
    matcher = difflib.SequenceMatcher(None, [str(n_.target) for n_ in a],
                                      [str(n_.target) for n_ in b], autojunk=False)
    rename = {}
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        dropped = tag == "delete" and all(
            n_.target in _NO_OP_AT_BATCH_ONE for n_ in a[i1:i2])
        if tag not in ("equal",) and not dropped:
            raise NotSupportedError(
                "the model traces to a different graph at the microbatch shape than at the "
                f"global batch ({[str(n_.target) for n_ in a[i1:i2]]} became "
                f"{[str(n_.target) for n_ in b[j1:j2]]}); gradient accumulation needs a "
                "shape-independent graph: use fewer microbatches")
        rename.update((x.name, y.name) for x, y in zip(a[i1:i2], b[j1:j2]))
    return rename


# operators torch.export leaves out of a trace when they do nothing at a batch of one
_NO_OP_AT_BATCH_ONE = {torch.ops.aten.expand.default, torch.ops.aten.view.default,
                       torch.ops.aten.squeeze.dim, torch.ops.aten.unsqueeze.default,
                       torch.ops.aten.alias.default}


def distribute_params(model: nn.Module, gm, mesh: DeviceMesh, stage: Stage,
                      device_type: str) -> dict[str, nn.Parameter]:
    """Every graph parameter as a DTensor with its storage placement; tied ones share one."""
    real = dict(model.named_parameters(remove_duplicate=False))
    params, by_id = {}, {}
    for name, meta_param in gm.named_parameters(remove_duplicate=False):
        if id(meta_param) not in by_id:
            fqn = name.removeprefix(WRAPPER_PREFIX)
            if fqn not in stage.params:
                raise PlanFileError(f"the plan places no parameter {fqn}; re-plan this model")
            by_id[id(meta_param)] = nn.Parameter(place_tensor(
                real[fqn], mesh, to_placements(storage_placements(stage, fqn), mesh), device_type,
                torch.float32))
        params[name] = by_id[id(meta_param)]
    real_buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, _ in gm.named_buffers(remove_duplicate=False):  # e.g. rotary inv_freq
        fqn = name.removeprefix(WRAPPER_PREFIX)
        if fqn in real_buffers:
            params[name] = place_tensor(real_buffers[fqn], mesh, [Replicate()] * mesh.ndim,
                                        device_type)
    return params


def make_optimizer(params, plan: Plan, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The plan's optimizer over DTensor parameters (fp32 master weights); it steps each
    parameter on its local shard when its gradient is in the same placements
    (runtime/graph/optim.py), which the gradient sync in ``train_step`` arranges."""
    params = list(params.values()) if isinstance(params, dict) else list(params)
    if plan.training.optimizer == "sgd":
        return LocalShardSGD(params, lr=lr, momentum=0.9)
    return LocalShardAdam(params, lr=lr, foreach=False)
