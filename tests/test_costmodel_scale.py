"""The cost model at scale (issue 14): closed-form memory of pipeline stages, the shared
attention mask and ZeRO-3 buffers on a small GPT-2 on a fake DGX A100 mesh."""

import pytest

import meshplan
from meshplan.costmodel.estimate import stage_activation_profile, stage_cost
from meshplan.costmodel.memory import GIB
from meshplan.tracing import trace
from meshplan.specs import example_inputs, parse_model_spec

GPT2 = "transformers:gpt2?n_layer=4&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
BATCH, SEQ, HIDDEN = 16, 32, 64
DP, TP, PP, MB = 2, 2, 2, 2  # 8 GPUs; microbatches = 16 / (2 x 2) = 4
BF16 = 2


@pytest.fixture(scope="module")
def gpt2():
    model = parse_model_spec(GPT2).build("meta")
    graph = trace(model, example_inputs(model, BATCH, SEQ))
    mesh = meshplan.Mesh.preset("dgx-a100-80gb", nodes=1)
    return model, graph, mesh


def _profile(plan, graph, stage):
    """The activation profile ``stage_cost`` prices one stage's memory with."""
    t = plan.training
    return stage_activation_profile(plan.stages[stage], graph, plan_hw(plan), dtype=t.dtype,
                                    microbatches=t.microbatches, seq_len=t.seq_len)


def plan_hw(plan):
    from meshplan.costmodel.hardware import HardwareProfile
    return HardwareProfile.from_dict(plan.mesh.hardware)


def _pp_plan(model, graph, mesh, **kw):
    return meshplan.manual_plan(model, mesh, graph=graph, dp=DP, tp=TP, pp=PP,
                                microbatch_size=MB, dtype="bf16", **kw)


# one microbatch's hidden state on one device: MB rows x SEQ x HIDDEN in bf16
HIDDEN_BYTES = MB * SEQ * HIDDEN * BF16


def test_received_stage_input_is_split_like_the_rest(gpt2):
    """The last stage's first block reads the hidden state sent by stage 0: it is S(0) over
    dp like every other block's input, not the whole dp x tp microbatch."""
    model, graph, mesh = gpt2
    plan = _pp_plan(model, graph, mesh, recompute="full")
    prof = _profile(plan, graph, 1)
    assert plan.stages[1].layers == (2, 4)
    assert prof.boundary[2] == prof.boundary[3] == HIDDEN_BYTES
    assert prof.kept[2] == pytest.approx(prof.kept[3])  # identical blocks keep the same


def test_shared_mask_counted_once_per_stage(gpt2):
    """Full recompute keeps each block's input and, once, the causal mask every block reads
    (bool, one microbatch: dp x mb rows x seq x seq, replicated as the runtime makes it)."""
    model, graph, mesh = gpt2
    plan = _pp_plan(model, graph, mesh, recompute="full")
    mask = DP * MB * SEQ * SEQ * 1
    for stage, first in ((0, 0), (1, 2)):
        prof = _profile(plan, graph, stage)
        assert prof.boundary[first] == prof.boundary[first + 1] == HIDDEN_BYTES
        assert prof.boundary[-1] == mask
        kept, _ = prof.stage_bytes("full")
        assert kept == 2 * HIDDEN_BYTES + mask + prof.kept.get(-1, 0.0)


def _tp_local_numel(graph, stage, prefix=""):
    return sum(graph.param_map[name].numel / (2 if pl[1] != "R" else 1)
               for name, pl in stage.params.items()
               if name.startswith(prefix) and graph.param_map[name].tied_to is None)


def _zero3_buffer(model, graph, mesh, recompute):
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, tp=2, pp=1, microbatch_size=2,
                                dtype="bf16", zero=3, recompute=recompute)
    st = plan.stages[0]
    # the engine's flat gradient buffer exists after the backward freed the activations
    return st, st.predicted.memory.buffers_gib * GIB


def test_zero3_buffer_is_one_gathered_block(gpt2):
    """Under recompute the engine gathers a block's weights inside the block: two gathered
    blocks at once, each the block's weights split by tp only, in bf16; the dp shards are
    gathered once, not multiplied by dp again."""
    model, graph, mesh = gpt2
    st, buffer = _zero3_buffer(model, graph, mesh, "full")
    block = _tp_local_numel(graph, st, "transformer.h.0.")
    assert buffer == pytest.approx(2 * block * BF16)


def test_zero3_without_recompute_gathers_one_block_at_a_time(gpt2):
    """Without recompute the engine still holds one gathered block at a time: it frees a
    block's gathered weights after their last reader and gathers them again when the
    backward unpacks what autograd saved (runtime/graph/gathers.py _Regather), so the buffer is the
    same as under recompute, not the whole stage."""
    model, graph, mesh = gpt2
    st, buffer = _zero3_buffer(model, graph, mesh, "none")
    block = _tp_local_numel(graph, st, "transformer.h.0.")
    assert buffer == pytest.approx(2 * block * BF16)
    assert buffer < 0.5 * _tp_local_numel(graph, st) * BF16


def test_zero2_accumulates_full_gradients(gpt2):
    """ZeRO-2 over 4 microbatches: the engine's gradients are full-size fp32 until the one
    reduce-scatter per step, as under ZeRO-1; the optimizer state is split over dp."""
    model, graph, mesh = gpt2
    mems = {}
    for zero in (1, 2):
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, tp=2, microbatch_size=1,
                                    dtype="bf16", zero=zero)
        assert plan.training.microbatches == 4
        mems[zero] = plan.stages[0].predicted.memory
    full = _tp_local_numel(graph, plan.stages[0]) * 4  # fp32 gradients
    assert mems[2].grads_gib * GIB == pytest.approx(full) == mems[1].grads_gib * GIB


def test_zero3_gathers_are_exposed(gpt2):
    """Nothing prefetches the engine's ZeRO-3 gathers: every microbatch pays at least two
    all-gathers of the stage's weights over dp (forward, and again in the backward) on top
    of the plain data-parallel plan."""
    from meshplan.costmodel.comm import Collective, collective_time_s
    _, _, mesh = gpt2
    # wider and longer: a microbatch computes for longer than it gathers, so a prefetching
    # engine (FSDP) would hide the gathers completely
    model = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=512&n_head=8&vocab_size=256"
                             "&n_positions=1024").build("meta")
    graph = trace(model, example_inputs(model, 64, 1024))
    per_mb = {}
    for zero in (0, 3):
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, tp=2, microbatch_size=4,
                                    dtype="bf16", zero=zero)
        t = plan.training
        per_mb[zero] = stage_cost(plan.stages[0], graph, plan_hw(plan), dtype=t.dtype,
                                  optimizer=t.optimizer, microbatches=t.microbatches,
                                  seq_len=t.seq_len).comm_s
    gather = collective_time_s(plan_hw(plan), Collective.ALL_GATHER,
                               _tp_local_numel(graph, plan.stages[0]) * BF16, 4)
    assert per_mb[3] - per_mb[0] >= 2 * gather  # forward and backward (_Regather)


def test_gradient_sync_is_one_flat_all_reduce(gpt2):
    """The engine all-reduces every gradient in one flat fp32 buffer after the backward
    (lowering.reduce_partial_grads): one collective's latency, not one per 25 MiB bucket
    (here 8 buckets' worth)."""
    from meshplan.costmodel.comm import Collective, collective_time_s
    _, _, mesh = gpt2
    model = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=1024&n_head=8&vocab_size=256"
                             "&n_positions=64").build("meta")
    graph = trace(model, example_inputs(model, BATCH, SEQ))
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=2,
                                dtype="bf16")
    t = plan.training
    cost = stage_cost(plan.stages[0], graph, plan_hw(plan), dtype=t.dtype,
                      optimizer=t.optimizer, microbatches=t.microbatches, seq_len=t.seq_len)
    grads = sum(p.numel for p in graph.params if p.trainable and p.tied_to is None) * 4
    assert grads > 7 * 25 * 2 ** 20
    latency = collective_time_s(plan_hw(plan), Collective.ALL_REDUCE, 1e-30, 8)
    # within half a latency of one all-reduce of all the gradients (the position
    # embedding's gradient is reduced as an activation instead: its lookup is not split)
    assert abs(cost.grad_sync_s - collective_time_s(plan_hw(plan), Collective.ALL_REDUCE,
                                                    grads, 8)) < latency / 2


def test_flat_zero2_sync_copies_raise_the_peak(gpt2):
    """ZeRO-2's reduce-scatter copies the full gradients twice (padded blocks, their
    concatenation) after the backward freed the activations: the peak rises by what the
    copies exceed the activations."""
    _, _, mesh = gpt2
    model = parse_model_spec("transformers:gpt2?n_layer=4&n_embd=1024&n_head=8&vocab_size=256"
                             "&n_positions=64").build("meta")
    graph = trace(model, example_inputs(model, BATCH, SEQ))
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=2,
                                dtype="bf16", zero=2, engine="graph")
    mem = plan.stages[0].predicted.memory
    grads = mem.grads_gib * GIB  # full-size, the engine's accumulation buffers
    assert mem.buffers_gib * GIB == pytest.approx(2 * grads - mem.activations_gib * GIB,
                                                  rel=0.01)


def test_cached_activation_profile_follows_device_and_seq_len(gpt2):
    """The activation profile kept in a shared cache is keyed by everything it depends on:
    pricing the same stage on another device (on a CPU host, torch's SDPA with attention
    dropout takes its math path and keeps three b x heads x s x s tensors; a GPU's fused
    kernel none) or sequence length does not reuse the first one, and a cache gives the
    results of no cache."""
    from meshplan.costmodel.hardware import load_preset

    model = parse_model_spec(GPT2 + "&attn_pdrop=0.1").build("meta")
    graph = trace(model, example_inputs(model, BATCH, SEQ))
    plan = _pp_plan(model, graph, gpt2[2], recompute="none")
    st, t, cpu = plan.stages[0], plan.training, load_preset("cpu-local")
    kw = dict(dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
              num_stages=plan.num_stages)
    cache: dict = {}
    gpu = stage_cost(st, graph, plan_hw(plan), seq_len=SEQ, cache=cache, **kw)
    stage_cost(st, graph, cpu, seq_len=0, cache=cache, **kw)
    cached = stage_cost(st, graph, cpu, seq_len=SEQ, cache=cache, **kw)
    fresh = stage_cost(st, graph, cpu, seq_len=SEQ, **kw)
    assert cached == fresh
    # per attention core: batch / dp / microbatches x heads / tp x s x s, 3 tensors in bf16
    probs = BATCH // DP // (BATCH // DP // MB) * 4 // TP * SEQ * SEQ * 3 * BF16 / GIB
    layers, inflight = 2, 2  # stage 0 of 2: two of the four blocks, 1F1B's 2 microbatches
    assert fresh.memory.activations_gib - gpu.memory.activations_gib == \
        pytest.approx(inflight * layers * probs, rel=1e-6)
