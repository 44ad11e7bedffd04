"""Placements for the graph engine: the plan's strings as DTensor placements, and each
operator's inputs moved to the placements the plan gives them.

trace -> cost -> solve -> plan -> **run**. The SPMD executor (runtime/graph/spmd.py) asks a
``Placer`` before every planned operator to redistribute each DTensor argument to the
placement the plan gives that input (``stage.ops[node].inputs[i]``), so the plan is executed
as written rather than as DTensor would choose; DTensor's differentiable ``redistribute``
gives the matching collective in the backward pass (an all-gather of a sharded parameter
before use becomes a reduce-scatter of its gradient). After the operator, ``settle`` turns
what DTensor cannot carry further (a masked partial, a plain tensor) into a DTensor that
it can.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # private: no public name

from meshplan.errors import NotSupportedError
from meshplan.placements import PARTIAL, REPLICATE, parse_placement, shard
from meshplan.plan import OpPlacement
from meshplan.runtime.graph import context
from meshplan.runtime.graph.pipeline_split import writes_in_place
from meshplan.runtime.graph.programs import sdpa_math


def to_placements(texts: Sequence[str], mesh: DeviceMesh | None = None) -> list:
    """Plan strings ("R", "P", "S(d)") -> DTensor placements. With ``mesh``, a Shard on a
    one-rank mesh axis becomes Replicate: the rank holds the whole dim either way, but
    DTensor's view rules refuse to flatten or squeeze a sharded dim (a microbatch of one
    sequence "S(0)" on a dp axis of size 1 reshaped by a linear), so a plan that shards on
    a one-rank axis would crash at step 1."""
    out = []
    for axis, text in enumerate(texts):
        _, dim = parse_placement(text)
        if text == PARTIAL:
            out.append(Partial())
        elif text == REPLICATE or (mesh is not None and mesh.size(axis) == 1):
            out.append(Replicate())
        else:
            out.append(Shard(dim))
    return out


def placement_texts(placements) -> tuple[str, ...]:
    """DTensor placements -> plan strings. A ``_StridedShard`` (what flattening a dim
    sharded on a later mesh axis gives, torch 2.13: not a Shard subclass) is "S(d)": read
    as "R" it hid a sharded value from the planned redistribution (Phi-3's logits reached
    the loss row-sharded on tp, and nll_loss refused the uneven rows)."""
    out = []
    for p in placements:
        if isinstance(p, (Shard, _StridedShard)):
            out.append(shard(p.dim))
        elif isinstance(p, Partial):
            out.append(PARTIAL)
        else:
            out.append(REPLICATE)
    return tuple(out)


def _nested_shard(t) -> bool:
    """One tensor dim other than the first sharded over two or more mesh axes (the batch dim
    may be: it survives the flatten to 2-D that these operators do)."""
    dims = [p.dim for p in t.placements if isinstance(p, Shard) and p.dim != 0]
    return len(dims) != len(set(dims))


def check_executable(n: fx.Node, args) -> None:
    """Fail fast, naming the node, on placements DTensor hangs or fails on (torch 2.13):
    found by tests/harness/strategy_check.py on every planner rule."""
    if n.target is torch.ops.aten.embedding.default and isinstance(args[0], DTensor):
        vocab_axes = [i for i, p in enumerate(args[0].placements) if p == Shard(0)]
        ids = args[1]
        # ids sharded on a mesh axis after the vocab axis: the reduction's mask is the wrong
        # shape (found by tests/harness/strategy_check.py); before it (batch on dp, vocab on tp) works
        late_ids = isinstance(ids, DTensor) and vocab_axes and any(
            isinstance(p, Shard) and i > vocab_axes[0] for i, p in enumerate(ids.placements))
        if len(vocab_axes) > 1 or late_ids:
            raise NotSupportedError(
                f"operator {n.name} (embedding): a vocab-sharded (S(0)) table on mesh axes "
                f"{vocab_axes} with ids {placement_texts(getattr(ids, 'placements', ()))}; "
                "DTensor's masked embedding needs one vocab axis and ids sharded only on "
                "earlier mesh axes. Replicate the table or the ids on the other axes")
    if n.target in (torch.ops.aten.linear.default, sdpa_math) and any(
            isinstance(a, DTensor) and a.ndim > 2 and _nested_shard(a) for a in args):
        raise NotSupportedError(
            f"operator {n.name} ({n.target}): an input has one dim sharded over several mesh "
            "axes, which DTensor cannot flatten for this operator (torch 2.13); shard that dim "
            "on one axis")


class Placer:
    """Moves an operator's DTensor inputs to their planned placements and settles its output;
    counts what it did in ``stats`` (the executor's ExecStats)."""

    def __init__(self, mesh: DeviceMesh, ops: dict[str, OpPlacement], stats):
        self.mesh = mesh
        self.ops = ops
        self.stats = stats
        # a context-parallel axis reads "S(d)" as the load-balanced layout (runtime/graph/context.py)
        self.cp_axis = context.cp_axis_of(mesh)

    def planned(self, n: fx.Node, arg: fx.Node, i: int, value, plan: OpPlacement | None):
        """``value`` (input ``i`` of ``n``, made by ``arg``) in the placement the plan gives it."""
        if plan is None or not isinstance(value, DTensor) or i >= len(plan.inputs) or \
                not plan.inputs[i]:
            return value
        current = placement_texts(value.placements)
        # R -> P is DTensor-internal (an addend such as a bias joining a partial sum once):
        # keep R there and let the operator's own strategy make it Partial.
        target = tuple(REPLICATE if t == PARTIAL and c == REPLICATE else t
                       for t, c in zip(plan.inputs[i], current))
        target = placement_texts(to_placements(target, self.mesh))  # one-rank axes: R
        if current == target:
            return value
        try:
            self.stats.redistributions += 1
            if self.cp_axis is not None and current[self.cp_axis] != target[self.cp_axis]:
                return context.move_cp(value, current, target, self.cp_axis, to_placements)
            # a partial value stays the partial it is where the plan keeps it partial: the plan
            # writes "P" for any pending reduction, and DTensor refuses P(avg) -> P(sum) (a
            # mean over a sharded dim, e.g. an auxiliary loss term, is P(avg))
            places = [value.placements[k] if c == PARTIAL and t == PARTIAL else p
                      for k, (c, t, p) in enumerate(zip(current, target,
                                                         to_placements(target, self.mesh)))]
            return value.redistribute(self.mesh, tuple(places))
        except Exception as exc:  # noqa: BLE001 - name the node and the placements
            raise NotSupportedError(
                f"operator {n.name} ({n.target}): cannot redistribute input {arg.name} from "
                f"{list(placement_texts(value.placements))} to the planned {list(target)}: "
                f"{exc}. 'P' targets are only reachable from 'P' or 'R'") from None

    def settle(self, out):
        """``out`` as later operators can take it: a masked partial reduced, a plain
        (non-scalar) tensor made a Replicate DTensor."""
        if isinstance(out, DTensor) and any("MaskPartial" in type(p).__name__
                                            for p in out.placements):
            # A vocab-parallel embedding's partial output carries its lookup mask, which DTensor
            # (torch 2.13) cannot reduce after a later op (a dtype cast) or reduce-scatter:
            # reduce it here, where it is made; consumers planned to take "P" take "R".
            reduced = out.redistribute(self.mesh, [Replicate() if isinstance(p, Partial) else p
                                                   for p in out.placements])
            # The gradient must come back reduced as well: the consumers' backward may hand
            # it over as P(sum) (a column-parallel matmul's input gradient), and DTensor's
            # redistribute backward cannot turn P(sum) into the masked partial (torch 2.13,
            # "Redistribution from one partial type ... is unsupported"). Crossing to the
            # local tensor and back with grad_placements = the reduced placements makes
            # from_local's backward all-reduce that gradient first; the masked partial then
            # takes a Replicate gradient, as it does under RowwiseParallel.
            out = DTensor.from_local(reduced.to_local(), self.mesh, reduced.placements,
                                     run_check=False, shape=reduced.shape,
                                     stride=reduced.stride(),
                                     grad_placements=reduced.placements)
        if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out.dim() > 0:
            out = DTensor.from_local(out, self.mesh, [Replicate()] * self.mesh.ndim,
                                     run_check=False)
        return out

    def note_output(self, n: fx.Node, plan: OpPlacement | None, out) -> None:
        """Record an output whose placements differ from the plan's (DTensor chose others)."""
        if plan is not None and isinstance(out, DTensor) and plan.output and \
                placement_texts(out.placements) != tuple(plan.output):
            self.stats.output_deviations[n.name] = (tuple(plan.output),
                                                    placement_texts(out.placements))

    def observe(self, n: fx.Node, args: dict, out) -> None:
        """Record the placements ``n`` ran with (``record=True``)."""
        def texts(v):
            return placement_texts(v.placements) if isinstance(v, DTensor) else ()
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        self.stats.observed[n.name] = OpPlacement(
            inputs=tuple(texts(args[a]) for a in n.all_input_nodes), output=texts(first))


def written_buffers(n: fx.Node, env: dict, moved: dict) -> dict:
    """Buffers ``n`` updates in place (BatchNorm's running statistics) -> their local
    tensors. The update must land in the stored buffer, so a plan that redistributes one
    first (its copy would be updated and dropped) is refused."""
    if n.op != "call_function" or not writes_in_place(n.target):
        return {}
    out = {}
    for a in n.all_input_nodes:
        value = env.get(a)
        if a.op != "get_attr" or not isinstance(value, DTensor) or value.requires_grad:
            continue
        if moved[a] is not value:
            raise NotSupportedError(
                f"operator {n.name} ({n.target}) updates buffer {a.target} in place, but "
                f"the plan moves it from {list(placement_texts(value.placements))} to "
                f"{list(placement_texts(moved[a].placements))}, which would update a copy; "
                "plan this input in its stored placement (R)")
        out[a] = value._local_tensor
    return out
