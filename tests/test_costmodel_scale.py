"""The cost model at scale (issue 14): closed-form memory of pipeline stages, the shared
attention mask and ZeRO-3 buffers on a small GPT-2 on a fake DGX A100 mesh."""

import pytest

import meshplan
from meshplan.costmodel.estimate import stage_cost
from meshplan.costmodel.memory import GIB
from meshplan.planner.trace import trace
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
    """The activation profile ``stage_cost`` computed for one stage (kept in its cache)."""
    t = plan.training
    cache: dict = {}
    stage_cost(plan.stages[stage], graph, plan_hw(plan), dtype=t.dtype, optimizer=t.optimizer,
               microbatches=t.microbatches, num_stages=plan.num_stages, seq_len=t.seq_len,
               cache=cache)
    return next(v.activations for v in cache.values() if getattr(v, "activations", None))


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


def test_zero3_buffer_is_one_gathered_block(gpt2):
    """ZeRO-3 keeps two gathered blocks (computing + prefetched), each the block's weights
    split by tp only, in bf16; the dp shards are gathered once, not multiplied by dp again."""
    model, graph, mesh = gpt2
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, tp=2, pp=1, microbatch_size=2,
                                dtype="bf16", zero=3)
    st = plan.stages[0]
    block = 0.0
    for name, pl in st.params.items():
        if name.startswith("transformer.h.0."):
            block += graph.param_map[name].numel / (2 if pl[1] != "R" else 1)
    mem = st.predicted.memory
    grad_bucket = mem.grads_gib * GIB  # smaller than one 25 MiB DDP bucket
    assert mem.buffers_gib * GIB - grad_bucket == pytest.approx(2 * block * BF16)
