"""meshplan.tracing's cache of exports (DECISIONS 64): the same meta model at the same shapes
is exported once per process; anything that changes the trace exports again."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshplan.specs import parse_model_spec
from meshplan.tracing import export_training_graph

GPT2 = "transformers:gpt2?n_layer=1&n_embd=32&n_head=4&vocab_size=64&n_positions=32"


def ids(batch=2, seq=8):
    return (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def build(spec=GPT2):
    return parse_model_spec(spec).build(device="meta")


class Scaled(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.lin = nn.Linear(4, 4, device="meta")
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


def _mse(out, target):
    return ((out - target) ** 2).mean()


def test_the_same_model_and_shapes_export_once():
    first = export_training_graph(build(), ids())
    assert export_training_graph(build(), ids()) is first  # another instance, same build


def test_the_runtimes_meta_copy_of_a_cpu_model_reuses_the_planners_export():
    """The planner exports the model built on meta; the runtime exports a meta copy of the
    user's model built on CPU, where Hugging Face marked its modules initialized."""
    from meshplan.runtime.shared import meta_copy

    planned = export_training_graph(build(), ids())
    cpu = parse_model_spec(GPT2).build(device="cpu")
    assert any(getattr(m, "_is_hf_initialized", False) for m in cpu.modules())
    assert export_training_graph(meta_copy(cpu), ids()) is planned


def test_what_changes_the_trace_exports_again():
    base = export_training_graph(build(), ids())
    assert export_training_graph(build(), ids(batch=4)) is not base  # shapes
    assert export_training_graph(build(GPT2.replace("n_layer=1", "n_layer=2")), ids()) \
        is not base  # the config
    assert export_training_graph(build().eval(), ids()) is not base  # training flags
    hooked = build()
    hooked.transformer.h[0].register_forward_hook(lambda m, a, out: out)
    assert export_training_graph(hooked, ids()) is not export_training_graph(hooked, ids())


def test_plain_attributes_and_the_loss_are_part_of_the_key():
    x, y = torch.empty(3, 4, device="meta"), torch.empty(3, 4, device="meta")

    def mul_of(ep):
        return [n.args[1] for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    two = export_training_graph(Scaled(2.0), (x,), _mse, example_targets=(y,))
    three = export_training_graph(Scaled(3.0), (x,), _mse, example_targets=(y,))
    assert two is not three and mul_of(two) == [2.0] and mul_of(three) == [3.0]
    other = export_training_graph(Scaled(2.0), (x,), lambda o, t: (o - t).abs().mean(),
                                  example_targets=(y,))
    assert other is not two


def test_models_with_real_weights_are_not_cached():
    model = parse_model_spec(GPT2).build(device="cpu")
    x = (torch.zeros(2, 8, dtype=torch.long),)
    assert export_training_graph(model, x) is not export_training_graph(model, x)


def test_tuple_attributes_tensor_attributes_and_attention_are_keyed():
    x = (torch.empty(1, 3, 8, 8, device="meta"),)

    def conv(stride):
        return nn.Sequential(nn.Conv2d(3, 4, 3, stride=stride, device="meta"), nn.Flatten())
    one, two = (export_training_graph(conv(s), x, lambda o: o.mean()) for s in (1, 2))
    assert one is not two

    class Masked(nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.lin = nn.Linear(4, 4, device="meta")
            self.mask = mask

        def forward(self, v):
            return self.lin(v) * self.mask
    v = (torch.empty(2, 4, device="meta"),)
    real = Masked(torch.ones(4))
    assert export_training_graph(real, v, lambda o: o.mean()) is not \
        export_training_graph(real, v, lambda o: o.mean())  # real values: never cached
    eager = build()
    eager.config._attn_implementation = "eager"
    assert export_training_graph(eager, ids()) is not export_training_graph(build(), ids())
