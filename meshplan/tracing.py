"""Tracing: nn.Module + example inputs -> OpGraph.

trace -> cost -> solve -> run. We trace with ``torch.export`` (non-strict), which is
torch.fx underneath and yields an aten-level ``fx.Graph`` with shapes in ``node.meta``.
``torch.fx.symbolic_trace`` is tried first only to name the offending module and line
when export fails: its module-level graph has no shapes and no aten operators, which the
sharding rules need, so it cannot replace export (see docs/DECISIONS.md).

The training step is traced as one graph: model forward plus the loss, so the loss is an
operator the planner can shard like any other. A model built on the meta device is traced
as fake tensors on the device the plan runs on (``on_device``; CPU): no weight is allocated,
and the model takes that device's branches. Repeated blocks (the pipeline's cut points)
are found in any container and in several stacks (``find_block_paths``); FLOPs come from
meshplan/opcount.py. The export is meshplan/export_program.py, the OpGraph built from it
meshplan/export_graph.py, a long stack of blocks meshplan/repeat_trace.py; this module's
``trace`` drives them, and the names of those modules are importable from here.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from meshplan.errors import TraceError
from meshplan.graph import OpGraph
from meshplan.export_graph import (  # noqa: F401 (re-exported: meshplan.tracing's names)
    STACK_SHARE, find_block_paths, find_repeated_blocks, graph_from_export)
from meshplan.export_program import (  # noqa: F401 (re-exported: meshplan.tracing's names)
    TRACE_DEVICE, WRAPPER_PREFIX, Inputs, LossError, LossFn, TrainingModule, _TRACES, _distinct,
    export_training_graph, flatten_call, model_output, next_token_loss, on_device,
    target_loss, unflatten_call)
from meshplan.opcount import UncountedOperatorsWarning  # noqa: F401 (re-exported)
from meshplan.repeat_trace import repeated_graph


def trace(model: nn.Module, example_inputs: Inputs, *, loss_fn: LossFn | None = None,
          example_targets=(), model_name: str = "", repeat: bool = True) -> OpGraph:
    """Trace ``model`` (+ loss) on ``example_inputs`` (and ``example_targets``) into an
    OpGraph; the convention of the inputs is ``export_training_graph``'s. With ``repeat``, a
    model of many identical blocks is exported with three of them and its graph written
    from that (meshplan/repeat_trace.py: the same OpGraph, 10x faster at 96 blocks);
    ``repeat=False`` always exports the whole model."""
    flat, signature = flatten_call(example_inputs, example_targets)
    name = model_name or type(model).__name__
    graph = None
    if repeat:
        flat = _distinct(flat)
        graph = repeated_graph(model, flat, loss_fn, signature, model_name=name)
    if graph is None:
        ep = export_training_graph(model, flat, loss_fn, signature=signature)
        graph = graph_from_export(ep, model, model_name=name)
    check_position_tables(graph)
    return dataclasses.replace(graph, signature=signature,
                               loss=loss_label(loss_fn, targets=signature.num_targets > 0))


def loss_label(loss_fn: LossFn | None, *, targets: bool) -> str:
    """How a plan names the loss it was traced with: ``module.function`` for a function
    of an importable module (``torch.nn.functional.cross_entropy``), the function's name
    for one from a factory file or a script, a loss module's repr
    (``CrossEntropyLoss()``), or meshplan's default."""
    if loss_fn is None:
        return "meshplan's default (cross entropy against the targets)" if targets else \
            "meshplan's default (next-token cross entropy)"
    if isinstance(loss_fn, nn.Module):
        return repr(loss_fn)
    fn = getattr(loss_fn, "func", loss_fn)  # functools.partial
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", "") or ""
    label = name if not module or module == "__main__" or module.startswith("meshplan_user_") \
        else f"{module}.{name}"
    return f"partial({label})" if fn is not loss_fn else label


_VIEWS = ("aten.unsqueeze.", "aten.expand.", "aten.view.", "aten.reshape.", "aten.to.",
          "aten._to_copy.", "aten.repeat.", "aten.clone.", "aten.contiguous.")


def check_position_tables(graph: OpGraph) -> None:
    """A table indexed by ``torch.arange`` over the sequence (learned positions in the
    user's own model) has a row for every position: on meta nothing is indexed, so a
    sequence longer than the table would first fail at the run's first step (an IndexError
    inside torch.nn.functional.embedding)."""
    by_name = {n.name: n for n in graph.nodes}
    rows = {p.name: p.shape[0] for p in graph.params if p.shape}
    for node in graph.nodes:
        if not node.target.startswith("aten.embedding.") or not node.params \
                or len(node.inputs) < 2:
            continue
        src = by_name.get(node.inputs[1])
        while src is not None and src.target.startswith(_VIEWS) and src.inputs:
            src = by_name.get(src.inputs[0])
        if src is None or not src.target.startswith("aten.arange.") or not src.out:
            continue
        args, _ = src.parsed_args()
        nums = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        count = src.out.shape[0] if src.out.shape else 0
        start, step = (nums[0] if len(nums) >= 2 else 0), (nums[2] if len(nums) >= 3 else 1)
        last = int(start + step * (count - 1)) if count else -1
        table = node.params[0]
        have = rows.get(table)
        if have is not None and last >= have:
            raise TraceError(
                f"{table} has {have} rows, but its positions come from torch.arange over "
                f"{count} tokens and reach row {last}: a sequence of {count} (--seq {count}) "
                f"would fail at the first step; use --seq {have - int(start)} or less (a "
                f"shorter sequence), or give the table at least {last + 1} rows")
