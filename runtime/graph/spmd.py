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

That DTensor interpretation is the reference. By default the executor runs it once, on its
first call and without gradients, to build a lowered program (runtime/graph/lowering.py): the same
operators on local shards, with each redistribution (planned, or DTensor-internal) as one
collective whose backward is its exact adjoint. Every call after that replays the lowered
program, which costs what hand-written tensor parallelism or FSDP costs
(benchmarks/runtime_overhead.py).

The pipeline runtime (runtime/graph/pipeline.py) builds one ``SPMDExecutor`` per stage submesh.

The executor is the interpreter loop; each other job has its own module: placements and
planned redistributions (runtime/graph/placing.py), recompute segments (runtime/graph/recompute.py),
building the lowered program (runtime/graph/lowerer.py, runtime/graph/lowering.py), ZeRO-3 gathers and
their buckets (runtime/graph/gathers.py), constant folding (runtime/graph/folding.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.experimental import implicit_replication

from meshplan.errors import NotSupportedError
from meshplan.plan import OpPlacement
from meshplan.runtime.graph import lowering
from meshplan.runtime.graph.folding import ConstantFolder
from meshplan.runtime.graph.gathers import ParamGathers
from meshplan.runtime.graph.lowerer import Lowerer
from meshplan.runtime.graph.pipeline_split import written_attrs
from meshplan.runtime.graph.placing import (Placer, check_executable, placement_texts,  # noqa: F401
                                      to_placements)  # (placement_texts, to_placements re-exported)
from meshplan.runtime.graph.recompute import check_recompute, run_checkpointed, segments_for
from meshplan.runtime.shared import COMPUTE_DTYPES
from meshplan.vocabulary import ComputeDtype, Recompute

try:  # non-reentrant checkpoint stops a recomputation early by raising this
    from torch.utils.checkpoint import _StopRecomputationError
except ImportError:  # pragma: no cover - older torch
    class _StopRecomputationError(Exception):
        pass


@dataclass
class ExecStats:
    """What the executor did: redistributions it inserted and outputs off the plan."""

    redistributions: int = 0
    output_deviations: dict = field(default_factory=dict)  # node -> (planned, actual)
    observed: dict = field(default_factory=dict)  # node -> OpPlacement DTensor ran it with
    lowered: int = 0  # operators the lowered program runs on local shards
    on_dtensor: list = field(default_factory=list)  # operators it leaves on DTensor


class SPMDExecutor(fx.Interpreter):
    """Runs ``gm`` on ``mesh`` realising ``ops`` (node name -> OpPlacement) exactly.

    Call it with the fragment's inputs (DTensors, or plain tensors to be distributed with
    ``input_placements``); parameters are read from ``gm``'s attributes, which must be the
    placed DTensor parameters (runtime/graph/parallelize.py ``install_params``). Plain tensors
    created inside the graph become Replicate DTensors as they are made.
    """

    def __init__(self, gm: fx.GraphModule, mesh: DeviceMesh, ops: dict[str, OpPlacement], *,
                 input_placements: Sequence[Sequence[str]] = (), recompute: str = Recompute.NONE,
                 block_prefix: str = "", dtype: str = ComputeDtype.FP32, record: bool = False,
                 lowered: bool = True):
        super().__init__(gm)
        check_recompute(recompute)
        if dtype not in COMPUTE_DTYPES:
            raise NotSupportedError(f"dtype={dtype!r}; the runtime knows {list(COMPUTE_DTYPES)}")
        self.mesh = mesh
        self.ops = ops
        self.input_placements = [to_placements(p, mesh) for p in input_placements]
        self.recompute = recompute
        self.compute_dtype = COMPUTE_DTYPES[dtype]
        self.segments = segments_for(gm, recompute, block_prefix)
        self.stats = ExecStats()
        self.placer = Placer(mesh, ops, self.stats)
        self.record = record
        # a context-parallel axis reads "S(d)" as the load-balanced layout (runtime/graph/context.py),
        # which the lowered program does not know: such stages run on DTensor
        self.lowered = lowered and self.placer.cp_axis is None
        self.steps: dict | None = None  # node -> lowering.Step, built by the first call
        self.specs: dict = {}  # node -> DTensorSpec structure of its value
        self.block_prefix = block_prefix
        self._lowerer: Lowerer | None = None  # while the first call builds the program
        self.leaves = lowering.ParamLeaves()  # parameters as plain local autograd leaves
        self.gathers = ParamGathers(mesh, lambda g: self.leaves.local(self.fetch_attr(g.target)))
        self.folder = ConstantFolder(gm, self.fetch_attr)
        self._frees = None  # node -> values it reads last (_last_uses)
        self._local_out = False  # run_local: outputs stay local shards
        self._owners: dict = {}  # attribute target -> (owning module, name): fetch_attr
        self._const_moves: dict = {}  # (folded node, move) -> (its value, moved): _move_input
        self._causal: dict = {}  # folded mask node -> (its value, causal?): _causal_mask
        self._prepared_for = None  # the folded values those two were made for
        self._const_inputs = None  # (input node, move) that a constant may feed

    # -- the reference: one node on DTensor ------------------------------------------------
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
        if n.op != "call_function":
            out = super().run_node(n)
            if self._lowerer is not None:
                self._lowerer.note(n, out)
            return out
        plan = self.ops.get(n.name)
        with self._set_current_node(n):
            moved = {a: self.placer.planned(n, a, i, self.env[a], plan)
                     for i, a in enumerate(n.all_input_nodes)}
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), moved.__getitem__)
            if plan is not None:
                check_executable(n, args)
            if self._lowerer is None:
                out, trial = self.call_function(n.target, args, kwargs), None
            else:
                out, trial = self._lowerer.call(
                    n, self.env, moved, lambda: self.call_function(n.target, args, kwargs))
        if self.record:
            self.placer.observe(n, moved, out)
        self.placer.note_output(n, plan, out)
        settled = self.placer.settle(out)
        if trial is not None:
            self._lowerer.lower(n, self.env, moved, args, kwargs, settled, out, trial)
        return settled

    # -- the first call builds the lowered program (runtime/graph/lowerer.py) ---------------------
    def build(self, *inputs) -> None:
        """Run the reference once (no grad) and lower every operator it can."""
        self._lowerer = Lowerer(self.mesh)
        self.steps, self.specs = self._lowerer.steps, self._lowerer.specs
        # the reference run (and each lowering attempt) updates the running statistics; the
        # replay that follows this build is the call's one update
        saved = [(t, t.clone()) for t in self._buffers_written()]
        # and draws random numbers (dropout): the replay draws them again from the same state,
        # so a seeded run does not depend on when the executor was built
        devices = [] if self.mesh.device_type == "cpu" else [torch.cuda.current_device()]
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                self._run_reference(*inputs, checkpointed=False)
        finally:
            self._lowerer = None
            with torch.no_grad():
                for t, value in saved:
                    t.copy_(value)
        self.gathers.plan(self.module.graph, self.steps, self.specs,
                          block_prefix=self.block_prefix, recompute=self.recompute)
        self.folder.find()
        for step in self.steps.values():
            step.fast = lowering.fast_aten(step)
        self.stats.on_dtensor = [s.node.name for s in self.steps.values() if s.kind == "dtensor"]
        self.stats.lowered = len(self.steps) - len(self.stats.on_dtensor)

    def _buffers_written(self) -> list[torch.Tensor]:
        """Local tensors of the buffers some operator of the graph updates in place."""
        out = []
        for g in written_attrs(self.module.graph, self.module):
            value = self.fetch_attr(g.target)
            if isinstance(value, torch.Tensor) and not value.requires_grad:
                out.append(value._local_tensor if isinstance(value, DTensor) else value)
        return out

    def _last_uses(self) -> dict:
        """node -> the values whose last reader it is (graph order), so the replay drops
        each value (and each gathered ZeRO-3 parameter) as soon as nothing needs it."""
        if self._frees is None:
            last = {}
            for n in self.module.graph.nodes:
                for a in n.all_input_nodes:
                    last[a] = n
            self._frees = {}
            for a, n in last.items():
                self._frees.setdefault(n, []).append(a)
        return self._frees

    def refold(self) -> None:
        """Compute the folded constants again on the next call (runtime/graph/folding.py)."""
        self.folder.refold()

    # -- the whole fragment ---------------------------------------------------------------
    def run(self, *inputs):
        if not self.lowered or self.record:
            return self._run_reference(*inputs)
        if self.steps is None:
            self.build(*inputs)
        return self._run_lowered(*inputs)

    def _autocast(self):
        return torch.autocast(self.mesh.device_type, dtype=self.compute_dtype,
                              enabled=self.compute_dtype is not None)

    def _run_reference(self, *inputs, checkpointed: bool = True):
        inputs = [self._distribute(x, i) for i, x in
                  enumerate(self.module.graph.process_inputs(*inputs))]
        with implicit_replication(), self._autocast():
            self.env = {}
            self.args_iter = iter(inputs)
            return self._run_segments(self.run_node, checkpointed)

    def _run_lowered(self, *inputs):
        inputs = [self._distribute(x, i, comm=False) for i, x in
                  enumerate(self.module.graph.process_inputs(*inputs))]
        return self._replay(inputs)

    def run_local(self, *shards):
        """Replay the lowered program on local shards of the inputs (placed as the first
        call's inputs were); returns (local outputs, their DTensorSpec structure). Gradients
        cross this boundary as shards of the logical gradients (``lowering.from_shard`` /
        ``to_shard``). The first call must have been ``run`` (it builds the program)."""
        if self.steps is None:
            raise RuntimeError("run_local replays a lowered program: call run() first")
        inputs = [lowering.from_shard(x, self.specs[n]) if isinstance(self.specs.get(n),
                                                                     DTensorSpec) else x
                  for x, n in zip(shards, self.module.graph.find_nodes(op="placeholder"))]
        self._local_out = True
        try:
            out = self._replay(inputs)
        finally:
            self._local_out = False
        return out, fx.node.map_arg(self.module.graph.output_node().args[0], self.specs.get)

    def _replay(self, inputs):
        collect = self.folder.begin()
        if not collect:
            self._prepare_constants()
        with implicit_replication(), self._autocast(), self.gathers.hooks():
            self.env = {}
            self.args_iter = iter(inputs)
            try:
                out = self._run_segments(self._replay_node, True)
            finally:
                self.folder.stop()
                self.gathers.end()
        if collect:
            self.folder.done()
        return out

    def _run_segments(self, run_node, checkpointed: bool):
        try:
            return self._run_segments_once(run_node, checkpointed)
        finally:  # the executor outlives the call: keep no activation past it
            self.env, self.args_iter = {}, iter(())

    def _run_segments_once(self, run_node, checkpointed: bool):
        replay = run_node == self._replay_node
        for seg in self.segments:
            if checkpointed and seg.layer >= 0 and self.recompute != Recompute.NONE:
                run_checkpointed(self, seg, run_node, self.recompute)
                continue
            frees = self._last_uses() if replay and len(self.segments) == 1 else {}
            for node in seg.nodes:
                if node.op == "output":
                    value = self.fetch_args_kwargs_from_env(node)[0][0]
                    if replay and not self._local_out:
                        value = lowering.leave_tree(value, fx.node.map_arg(
                            node.args[0], lambda a: self.specs.get(a)))
                    return self.module.graph.process_outputs(value)
                self.env[node] = run_node(node)
                for a in frees.get(node, ()):  # nothing reads these again in this call
                    self.env.pop(a, None)
                    self.gathers.release(a)
        raise AssertionError("graph has no output node")

    # -- the lowered program: one node on local shards ------------------------------------
    def _replay_node(self, n: fx.Node):
        if n in self.folder.constant:
            return self.folder.value(n, lambda: self._replay_one(n))
        return self._replay_one(n)

    def _value(self, a: fx.Node):
        return self.gathers.value(a, self.env)

    def _replay_one(self, n: fx.Node):
        if n.op == "get_attr":
            return self.leaves.local(super().run_node(n))
        if n.op == "placeholder":
            return lowering.enter_tree(super().run_node(n))
        if n.op != "call_function":  # e.g. export's input guards: as the reference runs them
            saved = self.env
            self.env = {a: lowering.leave_tree(self._value(a), self.specs.get(a))
                        for a in n.all_input_nodes}
            try:
                return lowering.enter_tree(super().run_node(n))
            finally:
                self.env = saved
        step = self.steps[n]
        if step.moves:
            moved = {a: lowering.move(self._value(a), *step.moves[a]) if a in step.moves
                     else self._value(a) for a in n.all_input_nodes}
            value = moved.__getitem__
        else:  # the common case: inputs as they are (this runs once per node per call)
            value = self._value if self.gathers.hoisted else self.env.__getitem__
        try:
            if step.fast is not None and not step.moves:  # most operators: inputs as they are
                return step.fast(value)
            if step.kind == "aten":
                return lowering.run_aten(step, value, self._move_input)
            if step.kind == "call":
                return lowering.run_call(step, value, self._move_input, self._causal_mask)
            if step.kind == "recorded":
                return lowering.run_recorded(step, value)
            moved = {a: value(a) for a in n.all_input_nodes}
            dt = {a: lowering.leave_tree(v, step.moves[a][1] if a in step.moves else self.specs[a])
                  for a, v in moved.items()}
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), dt.__getitem__)
            return lowering.enter_tree(self.placer.settle(n.target(*args, **kwargs)),
                                       reduced=True)
        except (NotSupportedError, _StopRecomputationError):
            raise
        except Exception as exc:  # noqa: BLE001 - name the operator that failed
            raise RuntimeError(f"operator {n.name} ({n.target}) failed in the lowered program: "
                               f"{type(exc).__name__}: {exc}") from exc

    def _prepare_constants(self) -> None:
        """At the start of a call that serves folded constants (outside every checkpointed
        region): each folded constant's moves (a causal mask cut to the batch shard) made
        once, and whether each folded attention mask is the causal one. The call, and the
        recomputation of its checkpointed blocks in the backward, then only read these, so
        both run the same operators (selective checkpointing replays the forward's
        operator list and refuses any difference); a call that folds anew reads none."""
        folded = self.folder.folded
        if folded is self._prepared_for:
            return
        if self._const_inputs is None:
            self._const_inputs = lowering.constant_inputs(self.steps)
        moves, causal = {}, {}
        with torch.no_grad():
            for a, move in self._const_inputs:
                if a in folded:
                    x = folded[a]
                    moves[(a, id(move))] = (x, lowering.move(x, *move))
            for step in self.steps.values():
                a = lowering.attention_mask_node(step)
                if a is None or a not in folded:
                    continue
                mask = folded[a]
                move = step.extra.get(a)
                if move is not None:
                    mask = moves[(a, id(move))][1]
                if mask.ndim >= 2:
                    causal[a] = (mask, lowering.is_causal_mask(mask, *mask.shape[-2:]))
        self._const_moves, self._causal, self._prepared_for = moves, causal, folded

    def _move_input(self, a: fx.Node, x: torch.Tensor, move: tuple) -> torch.Tensor:
        """``x`` (node ``a``'s local value) redistributed by ``move`` (src, dst specs); a
        folded constant's move as ``_prepare_constants`` made it for this very value."""
        hit = self._const_moves.get((a, id(move)))
        if hit is not None and hit[0] is x:
            return hit[1]
        return lowering.move(x, *move)

    def _causal_mask(self, a: fx.Node, mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
        """Whether attention mask node ``a`` holds the causal mask for this call
        (``_prepare_constants`` checked the folded value; no tensor operation here)."""
        hit = self._causal.get(a)
        return hit is not None and hit[0] is mask and hit[1] and \
            q_len == kv_len == mask.shape[-2] == mask.shape[-1]

    def fetch_attr(self, target: str):
        """The attribute ``target`` of the module, its owner looked up once: fx's
        ``fetch_attr`` walks the path with hasattr and getattr on every call, and the
        replay reads every parameter on every call."""
        owner = self._owners.get(target)
        if owner is None:
            path, _, name = target.rpartition(".")
            owner = (self.module.get_submodule(path) if path else self.module, name)
            self._owners[target] = owner
        return getattr(*owner)

    def _distribute(self, x, i: int, comm: bool = True):
        if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
            return x
        placements = self.input_placements[i] if i < len(self.input_placements) else \
            [Replicate()] * self.mesh.ndim
        from torch.distributed.tensor import distribute_tensor
        # every rank holds a global-shaped batch with its own rows in place (runtime/run.py
        # ``_global``): each cuts its shard locally. distribute_tensor's default
        # (src_data_rank=0) would scatter rank 0's tensor, so other data-parallel ranks
        # trained on rank 0's zeros where their rows belong (cp plans, which run unlowered)
        return distribute_tensor(x.to(self.mesh.device_type), self.mesh, placements,
                                 src_data_rank=None)


def stage_executor(gm: fx.GraphModule, mesh: DeviceMesh, stage, *, dtype: str = ComputeDtype.FP32,
                   block_prefix: str = "", input_names: Sequence[str] = (),
                   lowered: bool = True) -> "SPMDExecutor":
    """The seam for runtime/graph/pipeline.py: the executor running ``gm`` as ``stage`` plans it.

    ``stage`` is a meshplan.plan.Stage (its ops, inputs and recompute are read). Its ``run``
    takes the fragment's inputs (DTensors) and returns its outputs; once built, ``run_local``
    does the same on local shards. ``gm``'s attributes must be the DTensor parameters.
    """
    placements = [stage.inputs[name] for name in input_names if name in stage.inputs]

    executor = SPMDExecutor(gm, mesh, stage.ops, input_placements=placements,
                            recompute=stage.recompute, block_prefix=block_prefix, dtype=dtype,
                            lowered=lowered)
    return executor
