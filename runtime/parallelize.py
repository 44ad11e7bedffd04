"""Execute a plan: Plan + model -> DeviceMesh, DTensor parameters, a training step.

trace -> cost -> solve -> plan -> **run**. Runs inside each torchrun worker. The exported
training graph (model + loss, the same graph the planner saw) is executed by an
``fx.Interpreter`` on DTensor values: parameters are distributed with their planned
placements, the batch with its planned input placement, and DTensor propagates and
redistributes the rest. Gradients come back in the parameters' placements (a Partial
gradient of a replicated parameter becomes the data-parallel all-reduce) and a torch.optim
optimizer steps the DTensor parameters.

Two rewrites make the exported graph runnable on DTensor: ``aten._assert_*`` metadata checks
are dropped (no sharding rule, no effect), and on CPU scaled-dot-product attention runs as
its math decomposition because DTensor has no rule for the CPU flash kernel's backward.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from meshplan.errors import NotSupportedError
from meshplan.planner.trace import _WRAPPER_PREFIX, export_training_graph, graph_from_export
from meshplan.plan import Plan, parse_placement


def to_placements(texts: Sequence[str]) -> list:
    out = []
    for text in texts:
        kind, dim = parse_placement(text)
        out.append(Replicate() if kind == "R" else Partial() if kind == "P" else Shard(dim))
    return out


def sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
    """scaled_dot_product_attention as matmul + softmax + matmul (every op has a DTensor rule)."""
    if dropout_p:
        raise NotSupportedError("attention dropout is not supported by the runtime; set the "
                                "model's attention dropout to 0")
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def meta_copy(model: nn.Module) -> nn.Module:
    """The same module with every parameter and buffer on the meta device (ties kept),
    without copying any weight."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def runnable_graph_module(ep: torch.export.ExportedProgram, *, device_type: str) -> torch.fx.GraphModule:
    gm = ep.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_function":  # traced on meta: make tensors on our device instead
            node.args, node.kwargs = torch.fx.node.map_aggregate(
                (node.args, node.kwargs),
                lambda a: torch.device(device_type) if isinstance(a, torch.device) else a)
        if node.op == "call_function" and str(node.target).startswith("aten._assert"):
            gm.graph.erase_node(node)
        elif device_type == "cpu" and node.target is torch.ops.aten.scaled_dot_product_attention.default:
            node.target = sdpa_math
    gm.recompile()
    return gm


class _DTensorInterpreter(torch.fx.Interpreter):
    """Runs the graph on DTensors; plain tensors made inside the graph become Replicate."""

    def __init__(self, gm, mesh: DeviceMesh):
        super().__init__(gm)
        self.mesh = mesh

    def run_node(self, n):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.dim() > 0:
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim,
                                     run_check=False)
        return out


@dataclass
class ParallelModel:
    """A model placed on its mesh per the plan; ``train_step`` runs one optimizer step."""

    plan: Plan
    mesh: DeviceMesh
    gm: torch.fx.GraphModule
    params: dict  # graph parameter name -> nn.Parameter(DTensor)
    input_placements: list

    def loss(self, batch: torch.Tensor) -> DTensor:
        x = distribute_tensor(batch, self.mesh, self.input_placements[0])
        with implicit_replication(), torch.nn.utils.stateless._reparametrize_module(
                self.gm, self.params):
            return _DTensorInterpreter(self.gm, self.mesh).run(x)

    def train_step(self, batch: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
        loss = self.loss(batch)
        with implicit_replication():
            loss.backward()
        for p in self.unique_params():
            if p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(placements=p.placements)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.full_tensor().item())

    def unique_params(self) -> list[nn.Parameter]:
        return list({id(p): p for p in self.params.values()}.values())

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered to a full tensor (for tests and checkpoints)."""
        return {name.removeprefix(_WRAPPER_PREFIX): p.full_tensor() for name, p in self.params.items()}


def parallelize(model: nn.Module, plan: Plan, example_inputs: Sequence[torch.Tensor], *,
                loss_fn=None) -> ParallelModel:
    """Place ``model`` (real weights, on CPU) on the current process group per ``plan``."""
    if not dist.is_initialized():
        raise RuntimeError("parallelize runs inside a torchrun worker: init_process_group first")
    if plan.num_stages != 1:
        raise NotSupportedError(f"this plan has {plan.num_stages} pipeline stages; the runtime "
                                "runs single-stage plans only so far")
    if dist.get_world_size() != plan.num_devices:
        raise RuntimeError(f"plan needs {plan.num_devices} processes, this run has "
                           f"{dist.get_world_size()}; launch with --nproc_per_node "
                           f"{plan.num_devices}")
    # Trace on meta, exactly as the planner did: node names and the fingerprint then agree
    # with the plan (a trace on CPU differs in no-op layout ops such as contiguous).
    meta_inputs = tuple(torch.empty_like(x, device="meta") for x in example_inputs)
    ep = export_training_graph(meta_copy(model), meta_inputs, loss_fn)
    graph = graph_from_export(ep, model)
    plan.check_model(graph.fingerprint)

    stage = plan.stages[0]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, stage.mesh_shape, mesh_dim_names=stage.axis_names)
    gm = runnable_graph_module(ep, device_type=device_type)
    real = dict(model.named_parameters(remove_duplicate=False))
    params, by_id = {}, {}
    for name, meta_param in gm.named_parameters(remove_duplicate=False):
        if id(meta_param) not in by_id:  # tied parameters share one DTensor
            fqn = name.removeprefix(_WRAPPER_PREFIX)
            tensor = real[fqn].detach().to(device_type)
            by_id[id(meta_param)] = nn.Parameter(
                distribute_tensor(tensor, mesh, to_placements(stage.params[fqn])))
        params[name] = by_id[id(meta_param)]
    inputs = [to_placements(stage.inputs[name]) for name, _ in graph.inputs]
    return ParallelModel(plan=plan, mesh=mesh, gm=gm, params=params, input_placements=inputs)


def make_optimizer(params, plan: Plan, lr: float = 1e-3) -> torch.optim.Optimizer:
    if plan.training.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr, foreach=False)
