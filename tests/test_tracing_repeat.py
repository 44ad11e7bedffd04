"""meshplan/repeat_trace.py: the OpGraph written from an export of three blocks equals the
whole model's export (every operator's name, inputs, shapes, FLOPs, parameters, module
path; the parameter table, inputs, output and layer fingerprints), and blocks that differ
fall back to the whole export."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from meshplan.repeat_trace import repeated_graph
from meshplan.specs import example_inputs, parse_model_spec
from meshplan.tracing import flatten_call, trace

GPT2 = "transformers:gpt2?n_layer=5&n_embd=32&n_head=4&vocab_size=64&n_positions=32"
LLAMA = ("transformers:llama?hidden_size=32&intermediate_size=64&num_hidden_layers=5"
         "&num_attention_heads=4&num_key_value_heads=2&vocab_size=64&max_position_embeddings=32")


def _both(model, inputs):
    flat, sig = flatten_call(inputs)
    fast = repeated_graph(model, flat, None, sig, model_name="m", min_blocks=4)
    full = trace(model, inputs, model_name="m", repeat=False)
    return fast, full


def _same(fast, full):
    assert fast is not None, "the three-block path was not taken"
    assert [n.name for n in fast.nodes] == [n.name for n in full.nodes]
    for a, b in zip(fast.nodes, full.nodes):
        assert a == b, (a, b)
    assert fast.params == full.params and fast.inputs == full.inputs
    assert fast.output == full.output and fast.block_module == full.block_module
    assert fast.layer_fingerprints == full.layer_fingerprints
    assert fast == dataclasses.replace(full, signature=None, loss="")  # trace() labels the loss


def test_gpt2_from_three_blocks_equals_the_whole_export():
    model = parse_model_spec(GPT2).build("meta")
    fast, full = _both(model, example_inputs(model, 2, 16))
    _same(fast, full)
    assert full.num_layers == 5 and sum(n.layer == 4 for n in fast.nodes) > 10


def test_llama_from_three_blocks_equals_the_whole_export():
    model = parse_model_spec(LLAMA).build("meta")
    fast, full = _both(model, example_inputs(model, 2, 16))
    _same(fast, full)
    assert any(p.startswith("model.layers.4.") for n in fast.nodes for p in n.params)


def test_trace_takes_the_fast_path_at_many_blocks():
    spec = GPT2.replace("n_layer=5", "n_layer=8")
    model = parse_model_spec(spec).build("meta")
    inputs = example_inputs(model, 2, 8)
    import meshplan.repeat_trace as rt

    calls = []
    original = rt._replicated
    rt._replicated = lambda *a: calls.append(1) or original(*a)
    try:
        fast = trace(model, inputs, model_name="m")
    finally:
        rt._replicated = original
    assert calls and fast == trace(model, inputs, model_name="m", repeat=False)


class Block(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(8, 8, device="meta")
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


class Stack(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.blocks = nn.ModuleList(Block(s) for s in scales)
        self.head = nn.Linear(8, 4, device="meta")

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_blocks_with_other_settings_export_whole():
    """Blocks 1 and 2 agree but block 4 scales otherwise: not one repeated subgraph."""
    x = torch.zeros(2, 8, device="meta")
    target = torch.zeros(2, dtype=torch.long, device="meta")
    odd = Stack([1.0, 1.0, 1.0, 1.0, 2.0])
    flat, sig = flatten_call((x,), target)
    assert repeated_graph(odd, flat, None, sig, min_blocks=4) is None
    same = Stack([1.0] * 5)
    fast = repeated_graph(same, flat, None, sig, model_name="m", min_blocks=4)
    full = trace(same, (x,), example_targets=target, model_name="m", repeat=False)
    _same(fast, full)


class NeedsAll(Stack):
    """A forward that reads its last block by the count it was built with."""

    def __init__(self, n):
        super().__init__([1.0] * n)
        self.n = n

    def forward(self, x):
        x = self.blocks[self.n - 1](x)
        return super().forward(x)


def test_a_model_that_needs_all_its_blocks_exports_whole():
    x = torch.zeros(2, 8, device="meta")
    target = torch.zeros(2, dtype=torch.long, device="meta")
    model = NeedsAll(5)
    flat, sig = flatten_call((x,), target)
    assert repeated_graph(model, flat, None, sig, min_blocks=4) is None
    graph = trace(model, (x,), example_targets=target, model_name="m")
    assert graph == trace(model, (x,), example_targets=target, model_name="m", repeat=False)
