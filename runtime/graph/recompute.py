"""Recompute for the graph engine: the graph cut into blocks, each block run under checkpoint.

trace -> cost -> solve -> plan -> **run**. The SPMD executor (runtime/graph/spmd.py) runs a stage's
graph segment by segment; with recompute, each transformer block's node range is one
segment wrapped in ``torch.utils.checkpoint`` (non-reentrant): ``full`` recomputes the whole
block, ``selective`` saves the outputs of the parameter matmuls and recomputes the rest
(attention scores, softmax, pointwise ops), the split of Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", Sec. 5).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.fx as fx
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from meshplan.errors import NotSupportedError
from meshplan.runtime.graph.pipeline_split import writes_in_place, written_attrs
from meshplan.vocabulary import RECOMPUTE, Recompute


# Operators whose outputs `selective` recompute keeps: the matmuls of parameter layers
# (linear/Conv1D lower to mm/addmm). Attention's bmm, softmax and pointwise ops are
# recomputed (Korthikanti et al. 2022, Sec. 5).
SAVED_IN_SELECTIVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


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


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise NotSupportedError(f"recompute={recompute!r}; the runtime knows none, "
                                "selective and full")


def segments_for(gm: fx.GraphModule, recompute: str, block_prefix: str) -> list[Segment]:
    """The segments the executor runs: one per block under recompute, else the whole graph.
    Refuses a block that updates buffers in place (it would update them twice)."""
    check_recompute(recompute)
    if recompute == Recompute.NONE:
        return [Segment(tuple(gm.graph.nodes))]
    segments = split_segments(gm, block_prefix)
    written = set(written_attrs(gm.graph, gm))
    for seg in segments:
        writer = next((n for n in seg.nodes if seg.layer >= 0 and n.op == "call_function"
                       and writes_in_place(n.target)
                       and any(a in written for a in n.all_input_nodes)), None)
        if writer is not None:
            raise NotSupportedError(
                f"recompute={recompute!r} re-runs operator {writer.name} ({writer.target}), "
                "which updates buffers in place (BatchNorm's running statistics would be "
                "updated twice); plan this model with recompute='none'")
    return segments


def selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in SAVED_IN_SELECTIVE \
        else CheckpointPolicy.PREFER_RECOMPUTE


def run_checkpointed(interpreter: fx.Interpreter, seg: Segment, run_node, recompute: str) -> None:
    """Run ``seg``'s nodes with ``run_node`` under checkpoint; its outputs land in
    ``interpreter.env``. ``run_node`` reads ``interpreter.env``, which holds the segment's
    inputs while the block runs (and again while the backward recomputes it)."""
    def block(*values):
        saved, interpreter.env = interpreter.env, dict(zip(seg.inputs, values))
        try:
            for node in seg.nodes:
                interpreter.env[node] = run_node(node)
            return tuple(interpreter.env[o] for o in seg.outputs)
        finally:
            interpreter.env = saved
    context_fn = partial(create_selective_checkpoint_contexts, selective_policy) \
        if recompute == Recompute.SELECTIVE else None
    kwargs = {"context_fn": context_fn} if context_fn else {}
    outs = checkpoint(block, *(interpreter.env[i] for i in seg.inputs), use_reentrant=False,
                      **kwargs)
    interpreter.env.update(zip(seg.outputs, outs))
