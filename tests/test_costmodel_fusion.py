"""Eager vs compiled execution (issue 26, "torch.compile is not modelled"): eager prices every
pointwise operator as its own kernel over its own bytes plus a launch; compiled fuses the
chain between two matmuls into one kernel over the chain's external bytes
(costmodel/fusion.py). Closed forms on a hand-built graph, then the public API on a small
GPT-2."""

from dataclasses import replace

import pytest
import torch

import meshplan
from meshplan.costmodel.compute import op_time, roofline_s
from meshplan.costmodel.eager import eager_kernels, eager_time
from meshplan.costmodel.fusion import fusion_groups, fused_time
from meshplan.costmodel.hardware import load_preset
from meshplan.graph import OpGraph, OpKind, OpNode, ParamInfo, TensorMeta
from meshplan.specs import example_inputs, parse_model_spec
from meshplan.tracing import trace

N = 1 << 22  # elements of every activation
T = TensorMeta((N,), "float32")
W = ParamInfo("w", (N,), "float32")


def _op(name, kind, inputs, layer=0, flops=0):
    nbytes = 0 if kind == OpKind.VIEW else T.bytes
    return OpNode(name=name, target=f"aten.{name}", kind=kind, inputs=inputs, outputs=(T,),
                  flops=flops, bytes_read=nbytes * len(inputs), bytes_written=nbytes,
                  layer=layer)


def _graph(*nodes):
    return OpGraph(nodes=tuple(nodes), params=(W,), inputs=(("x", T),),
                   output=nodes[-1].name, layer_fingerprints=("a",))


E = OpKind.ELEMENTWISE


def _chain(layer=0):
    """x -> mm1 -> neg -> exp -> add(exp, mm1) -> view -> mm2: three pointwise operators
    between two matmuls, reading mm1's output twice."""
    return _graph(_op("mm1", OpKind.MATMUL, ("x", "w"), layer, flops=2 * N),
                  _op("neg", E, ("mm1",), layer), _op("exp", E, ("neg",), layer),
                  _op("add", E, ("exp", "mm1"), layer), _op("view", OpKind.VIEW, ("add",), layer),
                  _op("mm2", OpKind.MATMUL, ("view", "w"), layer, flops=2 * N))


def test_chain_is_one_kernel_over_its_external_bytes():
    g = _chain()
    (group,) = fusion_groups(g, [n.name for n in g.nodes])
    assert set(group.members) == {"neg", "exp", "add", "view"} and group.lead == "neg"
    assert dict(group.reads) == {"mm1": "neg"} and group.writes == ("add",)
    assert (group.read_bytes, group.written_bytes) == (T.bytes, T.bytes)


def test_eager_is_the_sum_of_kernels_compiled_one_pass():
    """Eager: 3 kernels, 7 tensor-passes (1 + 1 + 1 + 1 + 2 + 1) plus 3 launches forward;
    compiled: 1 kernel, 2 passes (mm1 in, add out), 1 launch; backward twice the bytes."""
    hw = load_preset("dgx-h200")
    fixed = hw.device.kernel_latency_s + hw.device.framework_overhead_s
    g = _chain()
    b = T.bytes / 2  # bf16: the traced fp32 bytes halved, as compute.op_time scales them
    eager = [op_time(g.node(n), hw, "bf16") for n in ("neg", "exp", "add")]
    assert sum(t.forward_s for t in eager) == pytest.approx(
        2 * (roofline_s(hw, 0, 2 * b, "bf16") + fixed) + roofline_s(hw, 0, 3 * b, "bf16") + fixed)
    (group,) = fusion_groups(g, [n.name for n in g.nodes])
    fused = fused_time(group, hw, "bf16", 1)
    assert fused.forward_s == pytest.approx(roofline_s(hw, 0, 2 * b, "bf16") + fixed)
    assert fused.backward_s == pytest.approx(roofline_s(hw, 0, 4 * b, "bf16") + fixed)
    assert fused.total_s < 0.4 * sum(t.total_s for t in eager)
    # split over 4 devices (or microbatches): a quarter of the bytes, the same launch
    assert fused_time(group, hw, "bf16", 4).forward_s == pytest.approx(
        roofline_s(hw, 0, b / 2, "bf16") + fixed)


def test_a_matmul_between_two_pointwise_ops_keeps_them_apart():
    """Residual pattern: neg feeds mm2, whose output is added to neg again. One kernel for
    neg and add would wait on mm2, which waits on it: two groups (depths 1 and 2)."""
    g = _graph(_op("mm1", OpKind.MATMUL, ("x", "w"), flops=2 * N), _op("neg", E, ("mm1",)),
               _op("mm2", OpKind.MATMUL, ("neg", "w"), flops=2 * N),
               _op("add", E, ("neg", "mm2")))
    groups = fusion_groups(g, [n.name for n in g.nodes])
    assert [gr.members for gr in groups] == [("neg",), ("add",)]
    assert groups[0].writes == ("neg",)  # read by mm2 and by add: written once


def test_operators_outside_the_blocks_stay_eager():
    """Only the repeated blocks compile (compile_blocks, torchtitan's apply_compile)."""
    g = _chain(layer=-1)
    assert fusion_groups(g, [n.name for n in g.nodes]) == ()


SPEC = "transformers:gpt2?n_layer=2&n_embd=256&n_head=4&vocab_size=256&n_positions=512"


def test_estimate_compiled_prices_fewer_bytes_than_eager():
    """The public API: ``meshplan.estimate(plan, compiled=True)`` (before: no such argument,
    eager and compiled priced alike). Only forward and backward change, and by exactly the
    eager kernels of the blocks (costmodel/eager.py: one GPU, no FSDP, so autocast) less
    what the compiled blocks still launch (autocast's weight casts) and the fused kernels."""
    model = parse_model_spec(SPEC).build("meta")
    graph = trace(model, example_inputs(model, 8, 512))
    mesh = meshplan.Mesh.from_dict({"shape": [1], "hardware": "dgx-h100", "name": "h100:1"})
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=1, dtype="bf16", engine="modules")
    eager = meshplan.estimate(plan)
    compiled = meshplan.estimate(plan, compiled=True)
    assert eager.step_time_s == pytest.approx(plan.predicted.step_time_s)
    hw = load_preset("dgx-h100")
    groups = fusion_groups(graph, [n.name for n in graph.nodes])
    assert groups  # GPT-2's blocks: layer norms, GELU chains, residual adds
    m = plan.training.microbatches  # each microbatch runs every kernel on 1/m of the batch
    names = [n.name for n in graph.nodes]
    kernels = {c: eager_kernels(graph, names, dtype="bf16", precision="autocast",
                                microbatches=m, compiled=c) for c in (False, True)}
    launched = {c: sum(eager_time(op, hw, m).total_s for op in k.values())
                for c, k in kernels.items()}
    saved = m * (launched[False] - launched[True]
                 - sum(fused_time(gr, hw, "bf16", m).total_s for gr in groups))
    assert saved > 0
    got = (eager.breakdown["forward"] + eager.breakdown["backward"]
           - compiled.breakdown["forward"] - compiled.breakdown["backward"])
    assert got == pytest.approx(saved, rel=1e-6)
    for k in ("recompute", "comm", "bubble", "optimizer"):
        assert compiled.breakdown[k] == pytest.approx(eager.breakdown[k])


def test_compiled_prices_tensor_and_pipeline_parallel_plans():
    """Fused groups are priced at their lead operator's split: a tp=2 x pp=2 plan compiled
    costs less compute than eager and the same communication (GPT-2's Conv1D tensor
    parallelism runs on the graph engine, which does not compile: a what-if price)."""
    model = parse_model_spec(SPEC).build("meta")
    graph = trace(model, example_inputs(model, 8, 512))
    mesh = meshplan.Mesh.from_dict({"shape": [4], "hardware": "dgx-h100", "name": "h100:4"})
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=1, tp=2, pp=2, dtype="bf16",
                                microbatch_size=2, engine="graph")
    eager, compiled = meshplan.estimate(plan), meshplan.estimate(plan, compiled=True)
    assert compiled.breakdown["forward"] < eager.breakdown["forward"]
    assert compiled.breakdown["backward"] < eager.breakdown["backward"]
    assert compiled.breakdown["comm"] == pytest.approx(eager.breakdown["comm"])


class _Attn(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.qkv = torch.nn.Linear(256, 3 * 256, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 64).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return y.transpose(1, 2).reshape(b, s, 256)


class _Net(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Attn(causal) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_is_causal_attention_is_priced_on_half_its_flops():
    """An SDPA the model calls with ``is_causal=True`` and no mask (benchmarks/gpu/model.py)
    is causal on every engine: flash attention does half the FLOPs (before: priced on all of
    them, as only a traced causal mask marked attention causal)."""
    from meshplan.costmodel.compute import op_time as price
    x = torch.zeros(2, 4096, 256, device="meta")
    hw = load_preset("dgx-h100")
    mesh = meshplan.Mesh.from_dict({"shape": [1], "hardware": "dgx-h100", "name": "h100:1"})
    fwd = {}
    for causal in (False, True):
        with torch.device("meta"):
            net = _Net(causal)
        graph = trace(net, (x,), loss_fn=lambda out, *rest: out.pow(2).mean())
        plan = meshplan.manual_plan(net, mesh, graph=graph, dp=1, dtype="bf16", engine="modules")
        fwd[causal] = plan.predicted.breakdown["forward"]
        attn = [n for n in graph.nodes if n.kind == OpKind.ATTENTION]
    m = plan.training.microbatches
    full = sum(price(n, hw, "bf16", m).forward_s for n in attn) * m
    half = sum(price(n, hw, "bf16", m, causal=True).forward_s for n in attn) * m
    halved = sum(price(replace(n, flops=n.flops // 2), hw, "bf16", m).forward_s
                 for n in attn) * m
    assert half == pytest.approx(halved, rel=1e-9) and half < full  # priced on half its FLOPs
    assert fwd[False] - fwd[True] == pytest.approx(full - half, rel=1e-6)
