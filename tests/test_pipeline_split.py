"""runtime/graph/pipeline_split.py: which values cross a stage boundary and which a stage rebuilds.

Pure and fast: exported graphs of a tiny hand-written module (one value of each kind: built
from shapes alone, from an unwritten buffer, from a written buffer, from a random op, from the
input) and of a tiny Llama, split in two and run stage after stage on one process against the
whole graph.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from meshplan.tracing import export_training_graph
from meshplan.runtime.graph.programs import global_dropout, runnable_graph_module
from meshplan.runtime.graph.pipeline_split import shape_only_nodes, split_stages

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")


class Tiny(nn.Module):
    """Stage 0 ends at ``h``; stage 1 reads one value of every kind made before it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 4))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):  # x: [2, 4]
        pos = torch.arange(4)
        mask = pos[None, :] <= pos[:, None]  # shapes only: recomputed
        angle = pos * self.freq  # an unwritten buffer: recomputed
        self.count.add_(1)
        seen = self.count * pos  # a written buffer: sent
        noise = torch.rand(4) + F.dropout(torch.ones(4), 0.5, training=True)  # random: sent
        shifted = x + pos  # the input: sent
        h = x * self.w  # the parameter: sent; the last operator of stage 0
        out = (h.unsqueeze(-1) * mask).sum(-1) + angle.cos() + noise + seen + shifted
        return out.sum()


def _split_in_two(gm: torch.fx.GraphModule, last_of_first: str):
    ops = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    cut = ops.index(last_of_first) + 1
    return split_stages(gm.graph, [(ops[0], ops[cut - 1]), (ops[cut], ops[-1])])


def _run_stages(gm: torch.fx.GraphModule, stages, inputs):
    """Run the stage graphs one after the other, each on the attributes it lists."""
    values = tuple(inputs)
    for st in stages:
        root = {t: operator.attrgetter(t)(gm) for t in st.param_targets + st.subgraph_targets}
        values = torch.fx.GraphModule(root, st.graph)(*values)
    return values


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = Tiny()
    ep = export_training_graph(model, (torch.randn(2, 4),), loss_fn=lambda out: out)
    gm = runnable_graph_module(ep, device_type="cpu")
    last = next(n.name for n in gm.graph.nodes if n.op == "call_function"
                and any(a.op == "get_attr" and a.target.endswith(".w") for a in n.args
                        if isinstance(a, torch.fx.Node)))
    return gm, _split_in_two(gm, last)


def test_shape_only_values_are_recomputed_not_sent(tiny):
    gm, (first, second) = tiny
    rebuilt = {n.name for n in shape_only_nodes(gm.graph)}
    assert first.outputs == second.inputs
    assert not rebuilt & set(first.outputs)
    assert second.recomputed and set(second.recomputed) <= rebuilt
    # the stage that reads the mask and the angle builds them itself, reading the buffer
    copied = {n.name: n for n in second.graph.nodes}
    assert all(copied[name].op == "call_function" for name in second.recomputed)
    assert "model.freq" in second.param_targets
    # what is sent: one value each made from the input, the parameter, the written buffer
    # and the random ops
    by_name = {n.name: n for n in gm.graph.nodes}
    sent = [by_name[name] for name in first.outputs]

    def made_from(pred) -> bool:
        return any(pred(a) for n in sent for a in n.all_input_nodes)
    assert len(sent) == 4
    assert made_from(lambda a: a.op == "placeholder")
    assert made_from(lambda a: a.op == "get_attr" and a.target == "model.w")
    assert made_from(lambda a: a.target is torch.ops.aten.add_.Tensor)  # count, written
    assert made_from(lambda a: a.target is torch.ops.aten.rand.default)
    # dropout runs as global_dropout (one process's mask, DECISIONS 48): a Python function,
    # never recomputed
    assert made_from(lambda a: a.target is global_dropout)
    assert "model.count" not in second.param_targets


def test_random_and_written_values_are_never_copied(tiny):
    gm, (_, second) = tiny
    excluded = {torch.ops.aten.rand.default, global_dropout, torch.ops.aten.add_.Tensor}
    rebuilt = shape_only_nodes(gm.graph)
    assert {n.target for n in gm.graph.nodes} >= excluded
    assert not {n.target for n in rebuilt} & excluded
    # a shape-only value reads only shape-only values and unwritten buffers
    for n in rebuilt:
        for a in n.all_input_nodes:
            assert a in rebuilt or (a.op == "get_attr" and a.target == "model.freq"), (n, a)
    assert not {n.target for n in second.graph.nodes if n.name in second.recomputed} & excluded


def test_split_tiny_matches_the_whole_graph(tiny):
    gm, stages = tiny
    x = torch.randn(2, 4)
    torch.manual_seed(1)
    gm.get_buffer("model.count").zero_()
    whole = gm(x)
    torch.manual_seed(1)
    gm.get_buffer("model.count").zero_()
    split = _run_stages(gm, stages, (x,))
    torch.testing.assert_close(split[0], whole if isinstance(whole, torch.Tensor) else whole[0])


@pytest.fixture(scope="module")
def llama():
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import graph_from_export
    from meshplan.specs import parse_model_spec

    torch.manual_seed(0)
    model = parse_model_spec(LLAMA).build(device="cpu")
    batch = torch.randint(0, 256, (8, 16))
    graph = graph_from_export(export_training_graph(model, (batch,)), model)
    plan = build_manual_plan(graph, Mesh.local(4), dp=2, pp=2, microbatch_size=2)
    ep = export_training_graph(model, (batch[:4],))
    gm = runnable_graph_module(ep, device_type="cpu")
    stages = split_stages(gm.graph, [st.nodes for st in plan.stages])
    return gm, stages, batch[:4]


def test_llama_sends_two_tensors_and_rebuilds_mask_and_rotary(llama):
    gm, (first, second), _ = llama
    # the token ids (for the loss) and the hidden states; not the mask or rotary cos/sin
    assert len(first.outputs) == 2 and first.outputs[0] == "inputs_0"
    names = {n.name: n for n in gm.graph.nodes}
    assert names[first.outputs[1]].meta["val"].dtype == torch.float32
    copied = {n.name: n for n in second.graph.nodes}
    # the rotary cos/sin: inside one higher-order operator where transformers computes them
    # under no_grad (up to 5.23), else the cos and sin operators themselves (5.24 on)
    rotary = [n for n in copied.values() if "wrap_with_set_grad_enabled" in str(n.target)] or \
        [n for n in copied.values()
         if n.target in (torch.ops.aten.cos.default, torch.ops.aten.sin.default)]
    assert rotary and all(r.name in second.recomputed for r in rotary)
    assert second.subgraph_targets == first.subgraph_targets
    assert "model.model.rotary_emb.inv_freq" in second.param_targets
    masks = [n for n in copied.values() if isinstance(n.meta.get("val"), torch.Tensor)
             and n.meta["val"].dtype == torch.bool and n.meta["val"].dim() == 4]
    assert masks and all(m.name in second.recomputed for m in masks)
    # every attention of stage 1 reads a mask built in stage 1
    attention = [n for n in copied.values() if "scaled_dot_product" in str(n.target)
                 or "sdpa" in str(n.target)]
    assert attention and all(a.args[3].op == "call_function" for a in attention)


def test_llama_split_matches_the_whole_graph(llama):
    gm, stages, batch = llama
    with torch.no_grad():
        whole = gm(batch)
        split = _run_stages(gm, stages, (batch,))
    torch.testing.assert_close(split[0], whole if isinstance(whole, torch.Tensor) else whole[0])


class WrittenLater(nn.Module):
    """A mask made from shapes alone, then written in place from the input: not a constant
    (folding or rebuilding it would drop the write)."""

    def forward(self, x):  # x: [4, 4]
        mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -1.0)
        kept = torch.arange(4) * 2  # shapes only and never written: still a constant
        mask.masked_fill_(x > 0, -100.0)
        return (x * mask).sum() + kept.sum()


def test_a_value_written_in_place_later_is_not_shape_only():
    model = WrittenLater()
    ep = export_training_graph(model, (torch.randn(4, 4),), loss_fn=lambda out: out)
    gm = runnable_graph_module(ep, device_type="cpu")
    only = shape_only_nodes(gm.graph)
    writes = [n for n in gm.graph.nodes if n.op == "call_function"
              and str(n.target).startswith("aten.masked_fill_")]
    assert writes, "the export kept the in-place write"
    written = writes[0].args[0]
    assert written not in only and writes[0] not in only
    assert any(str(n.target).startswith("aten.arange") for n in only)  # `kept` still is
