"""Mechanisms that price today's H100 stacks (issue 26): each a closed-form small case on a
tiny Llama traced on the meta device, priced on the DGX H100 preset."""

import dataclasses

from dataclasses import replace

import pytest

import meshplan
from meshplan.costmodel.estimate import default_runtime, stage_cost
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GIB, GRAD_BYTES
from meshplan.tracing import trace

def _trainable_numel(graph) -> float:
    return sum(i.numel for i in graph.param_map.values() if i.trainable and i.tied_to is None)


def _cost(plan, graph, runtime, stage=0):
    t = plan.training
    return stage_cost(plan.stages[stage], graph, HardwareProfile.from_dict(plan.mesh.hardware),
                      dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
                      num_stages=plan.num_stages, schedule=t.schedule, seq_len=t.seq_len,
                      runtime=runtime)


def test_flat_gradient_buffer_counted_once_per_parameter(tiny_llama_h100):
    """The graph engine reduces one flat gradient buffer over every axis in turn: at dp4 x
    cp2 (the gradient partial on both axes) the buffer is the gradients once, not twice, so
    it raises the peak by what it exceeds the activations."""
    model, graph, mesh = tiny_llama_h100
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype="bf16", zero=1,
                                engine="graph")
    mem = plan.predicted.memory
    grads = _trainable_numel(graph) * GRAD_BYTES / GIB
    assert mem.grads_gib == pytest.approx(grads)
    assert mem.buffers_gib == pytest.approx(max(0.0, grads - mem.activations_gib))


def test_module_pipeline_zero3_keeps_full_fp32_gradients(tiny_llama_h100):
    """DECISIONS 61: a module-engine pipeline stage accumulates the unsharded fp32 gradient
    over the microbatches and reduce-scatters it once after the last: ZeRO-3 holds the
    same gradients as ZeRO-2, the whole stage's, not 1/dp of them."""
    model, graph, mesh = tiny_llama_h100
    grads = {}
    for zero in (2, 3):
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, pp=2, microbatch_size=1,
                                    dtype="bf16", zero=zero, engine="modules")
        grads[zero] = [c.memory.grads_gib for c in
                       (_cost(plan, graph, default_runtime(plan_hw(plan), engine="modules",
                                                           pipeline=True), s)
                        for s in range(2))]
    assert grads[3] == pytest.approx(grads[2])
    stage_numel = _trainable_numel(graph)  # both stages' state adds up to the model's
    assert sum(grads[3]) * GIB == pytest.approx(stage_numel * GRAD_BYTES, rel=1e-6)


def plan_hw(plan):
    return HardwareProfile.from_dict(plan.mesh.hardware)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_over_dp_times_cp_on_the_module_engine(tiny_llama_h100, zero):
    """Megatron's distributed optimizer and torchtitan's FSDP shard over dp x cp: at dp4 x
    cp2 the module engine holds the model state of dp8; the graph engine shards over dp."""
    model, graph, mesh = tiny_llama_h100
    cp_plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype="bf16",
                                   zero=zero, engine="graph")
    dp_plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, dtype="bf16", zero=zero,
                                   engine="graph")
    hw = plan_hw(cp_plan)
    mods, graph_rt = default_runtime(hw, engine="modules"), default_runtime(hw, engine="graph")
    on_cp, on_dp = _cost(cp_plan, graph, mods).memory, _cost(dp_plan, graph, mods).memory
    assert on_cp.optimizer_gib == pytest.approx(on_dp.optimizer_gib)
    assert on_cp.grads_gib == pytest.approx(on_dp.grads_gib)
    assert on_cp.params_gib == pytest.approx(on_dp.params_gib)
    graph_cp = _cost(cp_plan, graph, graph_rt).memory
    assert graph_cp.optimizer_gib == pytest.approx(2 * on_dp.optimizer_gib)


def test_context_parallel_priced_as_torch_context_parallel_runs_it(tiny_llama_h100):
    """PyTorch's context_parallel (torchtitan, Llama 3): causal attention skips the upper
    triangle on head-tail balanced chunks, no mask is held, the loss runs on each rank's
    chunk. So dp4 x cp2 computes and keeps per device what dp8 does (the same tokens per
    device); only the K/V exchange is added. The graph engine's cp (explicit mask, gathered
    logits) computes more."""
    model, graph, mesh = tiny_llama_h100
    cp_plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, cp=2, dtype="bf16",
                                   zero=1, microbatch_size=2, engine="graph")
    dp_plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, dtype="bf16", zero=1,
                                   engine="graph")
    mods = default_runtime(plan_hw(cp_plan), engine="modules")
    on_cp, on_dp = _cost(cp_plan, graph, mods), _cost(dp_plan, graph, mods)
    # within 2%: the position and mask operators differ (split on cp, whole under dp)
    assert on_cp.forward_s == pytest.approx(on_dp.forward_s, rel=0.02)
    assert on_cp.backward_s == pytest.approx(on_dp.backward_s, rel=0.02)
    assert on_cp.memory.activations_gib == pytest.approx(on_dp.memory.activations_gib, rel=0.02)
    assert on_cp.comm_s > on_dp.comm_s  # the K/V all-gathers and reduce-scatters
    as_graph = _cost(cp_plan, graph, dataclasses.replace(mods, cp_composable=False))
    assert as_graph.forward_s > on_cp.forward_s
    assert as_graph.comm_s > on_cp.comm_s  # gathered logits, K/V gradients all-reduced


def test_megatron_fp16_pipeline_is_priced_and_names_the_runtimes(tiny_llama_h100):
    """A what-if estimate prices what Megatron-LM runs (fp16 pipelines with loss scaling)
    instead of refusing it because meshplan's pipeline runtime does not scale losses."""
    model, graph, mesh = tiny_llama_h100
    with pytest.raises(meshplan.PlanningError, match="fp16' with pp > 1"):
        meshplan.manual_plan(model, mesh, graph=graph, dp=4, pp=2, dtype="fp16")
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, pp=2, dtype="fp16",
                                engine="megatron")
    assert plan.predicted.step_time_s > 0 and plan.predicted.fits
    assert "Megatron-LM" in plan.engine_note and "cannot run it" in plan.engine_note
    assert meshplan.estimate(plan, engine="megatron") == plan.predicted


def test_nemo_layout_sequence_parallel_inside_tp_with_cp(tiny_llama_h100):
    """NeMo's layout (TP with sequence parallelism, CP across) is priced for Megatron: SP
    splits the norms' activations over tp on top of cp's split, so it keeps less."""
    model, graph, mesh = tiny_llama_h100
    kw = dict(graph=graph, dp=2, cp=2, tp=2, dtype="bf16", zero=1, engine="megatron")
    with_sp = meshplan.manual_plan(model, mesh, sequence_parallel=True, **kw)
    without = meshplan.manual_plan(model, mesh, sequence_parallel=False, **kw)
    assert with_sp.predicted.memory.activations_gib < without.predicted.memory.activations_gib
    # meshplan's runtimes run NeMo's layout (the module engine: torch's context_parallel with
    # SP inside TP); selective recompute with cp they cannot, and the note says so
    assert "meshplan can run this layout too" in with_sp.engine_note
    selective = meshplan.manual_plan(model, mesh, sequence_parallel=True, recompute="selective",
                                     **kw)
    assert "runtimes cannot run it (recompute 'selective' with cp=2" in selective.engine_note


def test_attention_priced_on_the_stacks_kernel(tiny_llama_h100):
    """Megatron-LM / NeMo run cuDNN fused attention (Transformer Engine); a runtime naming
    SDPA's flash backend (FlashAttention-2) runs the fa2 curve: a compute-bound attention
    kernel's time is in the ratio of the preset's two curves; hardware without a curve for
    the kernel keeps its attention_efficiency."""
    from meshplan.costmodel.compute import roofline_s
    from meshplan.costmodel.runtime_profiles import runtime_hardware
    from meshplan.graph import OpKind

    _, _, mesh = tiny_llama_h100
    hw = HardwareProfile.from_dict(mesh.hardware.to_dict())
    mega = runtime_hardware(hw, default_runtime(hw, engine="megatron"))
    assert runtime_hardware(hw, default_runtime(hw, engine="modules")) is hw
    dev = hw.device
    work, row = 1e13, 4 * 8192 * 128  # one query row of one head sees 8K keys
    fa2 = runtime_hardware(hw, replace(default_runtime(hw, engine="modules"),
                                       attention_kernel="fa2"))
    t_fa2 = roofline_s(fa2, work, 0.0, "bf16", OpKind.ATTENTION, row)
    t_cudnn = roofline_s(mega, work, 0.0, "bf16", OpKind.ATTENTION, row)
    assert t_cudnn / t_fa2 == pytest.approx(dev.attention_kernels["fa2"](row)
                                            / dev.attention_kernels["cudnn"](row))
    assert t_cudnn < 0.7 * t_fa2
    a100 = HardwareProfile.from_dict(meshplan.Mesh.preset("dgx-a100-80gb", nodes=1)
                                     .hardware.to_dict())
    assert runtime_hardware(a100, default_runtime(a100, engine="megatron")) is a100


def test_tp_comm_overlap_hides_at_most_all_but_one_chunk(tiny_llama_h100):
    """Megatron's --tp-comm-overlap decomposes each collective + GEMM into tp chunks: at most
    (tp - 1) / tp of the tensor-parallel communication hides, and never more than the
    matmuls' time; meshplan's runtimes expose it all."""
    from meshplan.costmodel.operators import _tp_overlap_hidden_s

    model, graph, mesh = tiny_llama_h100
    plan = meshplan.manual_plan(model, mesh, graph=graph, tp=4, dp=2, sequence_parallel=True,
                                microbatch_size=4, dtype="bf16", engine="megatron")
    mega = default_runtime(plan_hw(plan), engine="megatron")
    exposed = _cost(plan, graph, dataclasses.replace(mega, tp_comm_overlap=False))
    overlapped = _cost(plan, graph, mega)
    hidden = exposed.comm_s - overlapped.comm_s
    assert hidden > 0
    cache = {}
    stage_cost(plan.stages[0], graph, plan_hw(plan), dtype="bf16", optimizer="adam",
               runtime=mega, seq_len=plan.training.seq_len, cache=cache)
    ops = next(v for v in cache.values() if hasattr(v, "tp_fwd"))
    tp_comm = ops.tp_fwd + ops.tp_bwd
    assert tp_comm > 0 and ops.tp == 4
    # what hides still slows the GEMMs beside it (device.overlap_slowdown)
    slow = plan_hw(plan).device.overlap_slowdown
    assert hidden == pytest.approx(_tp_overlap_hidden_s(ops, "none") * (1 - slow / (1 + slow)))
    assert hidden <= tp_comm * 3 / 4 + 1e-12 and hidden <= ops.mm_fwd + ops.mm_bwd + 1e-12


def test_stack_plans_keep_the_embedding_vocab_parallel_under_cp(tiny_llama_h100):
    """Megatron-LM's VocabParallelEmbedding splits the token embedding over tp with cp too;
    only meshplan's graph engine keeps it replicated under cp (planner/manual.with_cp_axis)."""
    model, graph, mesh = tiny_llama_h100
    kw = dict(graph=graph, dp=2, cp=2, tp=2, dtype="bf16", zero=1)
    ours = meshplan.manual_plan(model, mesh, engine="graph", **kw)
    mega = meshplan.manual_plan(model, mesh, engine="megatron", **kw)
    emb = graph.param_map["model.embed_tokens.weight"].numel
    saved = meshplan.estimate(ours, engine="megatron").memory.params_gib \
        - mega.predicted.memory.params_gib
    assert saved * GIB == pytest.approx(emb * 2 / 2)  # bf16 weights, half of them per tp rank


def test_a_product_keeps_only_the_factors_autograd_saves(tiny_llama_h100):
    """MulBackward saves a factor only where the other factor needs a gradient: RoPE's
    q * cos keeps cos (positions, no gradient), not q; SwiGLU's silu(gate) * up keeps both."""
    from meshplan.costmodel.memory import saved_inputs

    _, graph, _ = tiny_llama_h100
    muls = [n for n in graph.nodes if n.target == "aten.mul.Tensor" and len(n.inputs) == 2
            and not any(i in graph.param_map for i in n.inputs)]
    rope = [n for n in muls if sum(i in graph.grad_nodes for i in n.inputs) == 1]
    both = [n for n in muls if all(i in graph.grad_nodes for i in n.inputs)]
    assert rope and both
    for n in rope:
        const = next(i for i in n.inputs if i not in graph.grad_nodes)
        assert saved_inputs(n, graph) == (const,)
    for n in both:
        assert set(saved_inputs(n, graph)) == set(n.inputs)


def test_a_square_keeps_its_factor():
    """``y * y`` is one input named twice (the graph's inputs are distinct producers):
    MulBackward saves y as both factors, while ``y * 2.0`` saves no activation. Before,
    both priced nothing kept (the rule looked for another input needing a gradient)."""
    import torch
    import torch.nn as nn

    from meshplan.costmodel.memory import saved_inputs

    class Square(nn.Module):
        def __init__(self, scalar: bool):
            super().__init__()
            self.lin, self.scalar = nn.Linear(8, 8), scalar

        def forward(self, x):
            y = self.lin(x)
            return ((y * 2.0) if self.scalar else (y * y)).sum()

    for scalar, kept in ((False, ("linear",)), (True, ())):
        graph = trace(Square(scalar), (torch.randn(2, 8),), loss_fn=lambda out: out)
        mul = graph.node("mul")
        assert mul.inputs == ("linear",)
        assert saved_inputs(mul, graph) == kept


@pytest.mark.parametrize("engine", ["megatron", "modules"])
def test_overlap_slowdown_in_pipelined_stages_is_counted_once(tiny_llama_h100, engine):
    """DECISIONS 99 in a pipeline: Megatron's gradient reduce-scatter and updated-weight
    gather hide once per step (``--overlap-grad-reduce`` / ``--overlap-param-gather``), so
    the slowdown lands in the step's tail, never per microbatch; a module-engine pipeline
    reduces after the flush behind nothing, so its tail gains nothing. Each stage's extra
    time is exactly s / (1 + s) x what hides, s = overlap_slowdown (``estimate.overlap_cost_s``)."""
    model, graph, mesh = tiny_llama_h100
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, pp=2, microbatch_size=1,
                                dtype="bf16", zero=1, engine=engine)
    hw = plan_hw(plan)
    slow = hw.device.overlap_slowdown
    assert slow > 0
    rt = default_runtime(hw, engine=engine, pipeline=True)
    free = dataclasses.replace(hw, device=dataclasses.replace(hw.device, overlap_slowdown=0.0))
    t = plan.training
    for s in range(plan.num_stages):
        kw = dict(dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
                  num_stages=plan.num_stages, schedule=t.schedule, seq_len=t.seq_len)
        st = plan.stages[s]
        slowed = stage_cost(st, graph, hw, runtime=rt, **kw)
        ideal = stage_cost(st, graph, free, runtime=rt, **kw)
        bare = stage_cost(st, graph, hw, runtime=dataclasses.replace(
            rt, overlap_efficiency=0.0, tp_comm_overlap=False), **kw)
        assert slowed.comm_s == pytest.approx(ideal.comm_s, rel=1e-12)  # nothing per microbatch
        hidden = bare.grad_sync_s - ideal.grad_sync_s
        assert slowed.grad_sync_s - ideal.grad_sync_s == pytest.approx(
            slow * hidden / (1 + slow), rel=1e-9, abs=1e-15)
        assert (hidden > 0) == (engine == "megatron"), (engine, s, hidden)
