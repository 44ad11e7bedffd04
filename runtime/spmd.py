"""The per-stage SPMD executor: graph fragment + DeviceMesh + planned placements -> callable.

trace -> cost -> solve -> plan -> **run**. One stage of a plan is an fx graph (the exported
training graph, or the fragment of it a pipeline stage owns) executed by an
``fx.Interpreter`` on DTensor values. Before each planned operator every DTensor argument is
redistributed to the placement the plan gives that input (``stage.ops[node].inputs[i]``), so
the plan is executed as written rather than as DTensor would choose; DTensor's
differentiable ``redistribute`` gives the matching collective in the backward pass (an
all-gather of a sharded parameter before use becomes a reduce-scatter of its gradient).

Recompute wraps each transformer block's node range in ``torch.utils.checkpoint``
(non-reentrant): ``full`` recomputes the whole block, ``selective`` saves the outputs of the
parameter matmuls and recomputes the rest (attention scores, softmax, pointwise ops), the
split of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", Sec. 5). Mixed precision runs the fragment under ``torch.autocast``: master weights
stay fp32, matmuls run in bf16/fp16.

The pipeline runtime (runtime/pipeline.py) builds one ``SPMDExecutor`` per stage submesh.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from meshplan.errors import NotSupportedError

try:  # non-reentrant checkpoint stops a recomputation early by raising this
    from torch.utils.checkpoint import _StopRecomputationError
except ImportError:  # pragma: no cover - older torch
    class _StopRecomputationError(Exception):
        pass
from meshplan.plan import OpPlacement, parse_placement

COMPUTE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

# Operators whose outputs `selective` recompute keeps: the matmuls of parameter layers
# (linear/Conv1D lower to mm/addmm). Attention's bmm, softmax and pointwise ops are
# recomputed (Korthikanti et al. 2022, Sec. 5).
_SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def to_placements(texts: Sequence[str]) -> list:
    """Plan strings ("R", "P", "S(d)") -> DTensor placements."""
    out = []
    for text in texts:
        kind, dim = parse_placement(text)
        out.append(Replicate() if kind == "R" else Partial() if kind == "P" else Shard(dim))
    return out


def placement_texts(placements) -> tuple[str, ...]:
    """DTensor placements -> plan strings."""
    out = []
    for p in placements:
        if isinstance(p, Shard):
            out.append(f"S({p.dim})")
        elif isinstance(p, Partial):
            out.append("P")
        else:
            out.append("R")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of graph nodes executed together; ``layer`` >= 0 marks a transformer block."""

    nodes: tuple[fx.Node, ...]
    layer: int = -1
    inputs: tuple[fx.Node, ...] = ()  # defined before the segment, read inside it
    outputs: tuple[fx.Node, ...] = ()  # defined inside, read after it


def block_index(node: fx.Node, block_prefix: str) -> int:
    """The repeated-block index of ``node`` from its module stack (-1 outside blocks)."""
    if not block_prefix:
        return -1
    pattern = re.compile(re.escape(block_prefix) + r"\.(\d+)(\.|$)")
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        m = pattern.match(path)
        if m:
            return int(m.group(1))
    return -1


def split_segments(gm: fx.GraphModule, block_prefix: str) -> list[Segment]:
    """Consecutive nodes grouped by block; each block's external inputs and outputs found."""
    groups: list[tuple[int, list[fx.Node]]] = []
    for node in gm.graph.nodes:
        layer = block_index(node, block_prefix) if node.op == "call_function" else -1
        if groups and groups[-1][0] == layer:
            groups[-1][1].append(node)
        else:
            groups.append((layer, [node]))
    segments = []
    for layer, nodes in groups:
        inside = set(nodes)
        ins = {a: None for n in nodes for a in n.all_input_nodes if a not in inside}
        outs = {n: None for n in nodes if any(u not in inside for u in n.users)}
        segments.append(Segment(tuple(nodes), layer, tuple(ins), tuple(outs)))
    return segments


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVED_IN_SELECTIVE \
        else CheckpointPolicy.PREFER_RECOMPUTE


def _nested_shard(t) -> bool:
    """One tensor dim other than the first sharded over two or more mesh axes (the batch dim
    may be: it survives the flatten to 2-D that these operators do)."""
    dims = [p.dim for p in t.placements if isinstance(p, Shard) and p.dim != 0]
    return len(dims) != len(set(dims))


def check_executable(n: fx.Node, args) -> None:
    """Fail fast, naming the node, on placements DTensor hangs or fails on (torch 2.13):
    found by runtime/strategy_check.py on every planner rule."""
    if n.target is torch.ops.aten.embedding.default and isinstance(args[0], DTensor):
        vocab_axes = [i for i, p in enumerate(args[0].placements) if p == Shard(0)]
        ids = args[1]
        # ids sharded on a mesh axis after the vocab axis: the reduction's mask is the wrong
        # shape (found by runtime/strategy_check.py); before it (batch on dp, vocab on tp) works
        late_ids = isinstance(ids, DTensor) and vocab_axes and any(
            isinstance(p, Shard) and i > vocab_axes[0] for i, p in enumerate(ids.placements))
        if len(vocab_axes) > 1 or late_ids:
            raise NotSupportedError(
                f"operator {n.name} (embedding): a vocab-sharded (S(0)) table on mesh axes "
                f"{vocab_axes} with ids {placement_texts(getattr(ids, 'placements', ()))}; "
                "DTensor's masked embedding needs one vocab axis and ids sharded only on "
                "earlier mesh axes. Replicate the table or the ids on the other axes")
    if n.target in (torch.ops.aten.linear.default, sdpa_target()) and any(
            isinstance(a, DTensor) and a.ndim > 2 and _nested_shard(a) for a in args):
        raise NotSupportedError(
            f"operator {n.name} ({n.target}): an input has one dim sharded over several mesh "
            "axes, which DTensor cannot flatten for this operator (torch 2.13); shard that dim "
            "on one axis")


def sdpa_target():
    from meshplan.runtime.parallelize import sdpa_math
    return sdpa_math


@dataclass
class ExecStats:
    """What the executor did: redistributions it inserted and outputs off the plan."""

    redistributions: int = 0
    output_deviations: dict = field(default_factory=dict)  # node -> (planned, actual)
    observed: dict = field(default_factory=dict)  # node -> OpPlacement DTensor ran it with


class SPMDExecutor(fx.Interpreter):
    """Runs ``gm`` on ``mesh`` realising ``ops`` (node name -> OpPlacement) exactly.

    Call it with the fragment's inputs (DTensors, or plain tensors to be distributed with
    ``input_placements``); parameters are read from ``gm`` (reparametrise it with DTensor
    parameters first, see runtime/parallelize.py). Plain tensors created inside the graph
    become Replicate DTensors as they are made.
    """

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, ops: dict[str, OpPlacement], *,
                 input_placements: Sequence[Sequence[str]] = (), recompute: str = "none",
                 block_prefix: str = "", dtype: str = "fp32", record: bool = False):
        super().__init__(gm)
        if recompute not in ("none", "selective", "full"):
            raise NotSupportedError(f"recompute={recompute!r}; the runtime knows none, "
                                    "selective and full")
        if dtype not in COMPUTE_DTYPES:
            raise NotSupportedError(f"dtype={dtype!r}; the runtime knows {list(COMPUTE_DTYPES)}")
        self.mesh = mesh
        self.ops = ops
        self.input_placements = [to_placements(p) for p in input_placements]
        self.recompute = recompute
        self.compute_dtype = COMPUTE_DTYPES[dtype]
        self.segments = split_segments(gm, block_prefix) if recompute != "none" else \
            [Segment(tuple(gm.graph.nodes))]
        self.stats = ExecStats()
        self.record = record

    # -- one node ------------------------------------------------------------------------
    def run_node(self, n: fx.Node):
        try:
            return self._run_node(n)
        except (NotSupportedError, _StopRecomputationError):
            raise
        except Exception as exc:  # noqa: BLE001 - name the operator that failed
            args = [placement_texts(self.env[a].placements) if isinstance(self.env.get(a), DTensor)
                    else "-" for a in n.all_input_nodes]
            raise RuntimeError(f"operator {n.name} ({n.target}) with input placements {args} "
                               f"failed: {type(exc).__name__}: {exc}") from exc

    def _run_node(self, n: fx.Node):
        plan = self.ops.get(n.name) if n.op == "call_function" else None
        if plan is None:
            out = super().run_node(n)
            if self.record and n.op == "call_function":
                self._observe(n, {a: self.env[a] for a in n.all_input_nodes}, out)
        else:
            with self._set_current_node(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                moved = {a: self._planned(n, a, i, self.env[a], plan)
                         for i, a in enumerate(n.all_input_nodes)}
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), moved.__getitem__)
                check_executable(n, args)
                out = self.call_function(n.target, args, kwargs)
            if self.record:
                self._observe(n, moved, out)
            if isinstance(out, DTensor) and plan.output and \
                    placement_texts(out.placements) != tuple(plan.output):
                self.stats.output_deviations[n.name] = (tuple(plan.output),
                                                        placement_texts(out.placements))
        if isinstance(out, DTensor) and any("MaskPartial" in type(p).__name__
                                            for p in out.placements):
            # A vocab-parallel embedding's partial output carries its lookup mask, which DTensor
            # (torch 2.13) cannot reduce after a later op (a dtype cast) or reduce-scatter:
            # reduce it here, where it is made; consumers planned to take "P" take "R".
            out = out.redistribute(self.mesh, [Replicate() if isinstance(p, Partial) else p
                                               for p in out.placements])
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.dim() > 0:
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim,
                                     run_check=False)
        return out

    def _observe(self, n: fx.Node, args: dict, out) -> None:
        def texts(v):
            return placement_texts(v.placements) if isinstance(v, DTensor) else ()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.stats.observed[n.name] = OpPlacement(
            inputs=tuple(texts(args[a]) for a in n.all_input_nodes), output=texts(first))

    def _planned(self, n: fx.Node, arg: fx.Node, i: int, value, plan: OpPlacement):
        if not isinstance(value, DTensor) or i >= len(plan.inputs) or not plan.inputs[i]:
            return value
        current = placement_texts(value.placements)
        # R -> P is DTensor-internal (an addend such as a bias joining a partial sum once):
        # keep R there and let the operator's own strategy make it Partial.
        target = tuple("R" if t == "P" and c == "R" else t for t, c in zip(plan.inputs[i], current))
        if current == target:
            return value
        try:
            self.stats.redistributions += 1
            return value.redistribute(self.mesh, to_placements(target))
        except Exception as exc:  # noqa: BLE001 - name the node and the placements
            raise NotSupportedError(
                f"operator {n.name} ({n.target}): cannot redistribute input {arg.name} from "
                f"{list(placement_texts(value.placements))} to the planned {list(target)}: "
                f"{exc}. 'P' targets are only reachable from 'P' or 'R'") from None

    # -- the whole fragment ---------------------------------------------------------------
    def run(self, *inputs):
        inputs = [self._distribute(x, i) for i, x in
                  enumerate(self.module.graph.process_inputs(*inputs))]
        autocast = torch.autocast(self.mesh.device_type, dtype=self.compute_dtype,
                                  enabled=self.compute_dtype is not None)
        with implicit_replication(), autocast:
            self.env = {}
            self.args_iter = iter(inputs)
            for seg in self.segments:
                if seg.layer >= 0 and self.recompute != "none":
                    self._run_checkpointed(seg)
                    continue
                for node in seg.nodes:
                    if node.op == "output":
                        value = self.fetch_args_kwargs_from_env(node)[0][0]
                        return self.module.graph.process_outputs(value)
                    self.env[node] = self.run_node(node)
        raise AssertionError("graph has no output node")

    def _distribute(self, x, i: int):
        if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
            return x
        placements = self.input_placements[i] if i < len(self.input_placements) else \
            [Replicate()] * self.mesh.ndim
        from torch.distributed.tensor import distribute_tensor
        return distribute_tensor(x.to(self.mesh.device_type), self.mesh, placements)

    def _run_checkpointed(self, seg: Segment) -> None:
        def block(*values):
            saved, self.env = self.env, dict(zip(seg.inputs, values))
            try:
                for node in seg.nodes:
                    self.env[node] = self.run_node(node)
                return tuple(self.env[o] for o in seg.outputs)
            finally:
                self.env = saved
        context_fn = partial(create_selective_checkpoint_contexts, _selective_policy) \
            if self.recompute == "selective" else None
        kwargs = {"context_fn": context_fn} if context_fn else {}
        outs = checkpoint(block, *(self.env[i] for i in seg.inputs), use_reentrant=False,
                          **kwargs)
        self.env.update(zip(seg.outputs, outs))


def stage_executor(gm: fx.GraphModule, mesh: DeviceMesh, stage, *, dtype: str = "fp32",
                   block_prefix: str = "", input_names: Sequence[str] = ()) -> Callable:
    """The seam for runtime/pipeline.py: a callable running ``gm`` as ``stage`` plans it.

    ``stage`` is a meshplan.plan.Stage (its ops, inputs and recompute are read). The callable
    takes the fragment's inputs and returns its outputs; call it under
    ``torch.nn.utils.stateless._reparametrize_module(gm, dtensor_params)``.
    """
    placements = [stage.inputs[name] for name in input_names if name in stage.inputs]

    def run(*inputs):
        return SPMDExecutor(gm, mesh, stage.ops, input_placements=placements,
                            recompute=stage.recompute, block_prefix=block_prefix,
                            dtype=dtype).run(*inputs)
    return run
