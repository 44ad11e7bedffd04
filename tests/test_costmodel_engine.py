"""The engine that runs a plan picks the cost model's runtime assumptions (issue 14), not the
device name: FSDP2's prefetch and per-block gradient reduction (module engine; on NCCL, while
on gloo its collectives block and hide nothing) against the graph engine's exposed gathers
and flat post-backward sync, on a small GPT-2 on a DGX A100."""

import dataclasses

import pytest

import meshplan
from meshplan.costmodel.comm import Collective, collective_time_s
from meshplan.costmodel.estimate import default_runtime, estimate_plan, stage_cost
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import GIB
from meshplan.errors import PlanningError
from meshplan.tracing import trace
from meshplan.specs import example_inputs, parse_model_spec

WIDE = "transformers:gpt2?n_layer=4&n_embd=512&n_head=8&vocab_size=256&n_positions=1024"
BF16 = 2


@pytest.fixture(scope="module")
def wide():
    model = parse_model_spec(WIDE).build("meta")
    graph = trace(model, example_inputs(model, 64, 1024))
    return model, graph, meshplan.Mesh.preset("dgx-a100-80gb", nodes=1)


def _hw(plan):
    return HardwareProfile.from_dict(plan.mesh.hardware)


def _cost(plan, graph, runtime):
    t = plan.training
    return stage_cost(plan.stages[0], graph, _hw(plan), dtype=t.dtype, optimizer=t.optimizer,
                      microbatches=t.microbatches, seq_len=t.seq_len, runtime=runtime)


def test_runtime_is_named_by_engine_and_backend():
    """The same GPU profile priced for gloo (a CPU test of a GPU plan) or NCCL, and for
    either engine: the factors follow the arguments, not ``hw.device.name``."""
    hw = meshplan.Mesh.preset("dgx-h100", nodes=1).hardware
    graph_nccl = default_runtime(hw, engine="graph")
    assert (graph_nccl.backend, graph_nccl.reduce_scatter_as_all_reduce) == ("nccl", False)
    assert default_runtime(hw, engine="graph", backend="gloo").reduce_scatter_as_all_reduce
    mods = default_runtime(hw, engine="modules")
    assert mods.param_gather_overlap == 1.0 and mods.sync_overlaps_backward
    assert not mods.zero3_per_use and not graph_nccl.sync_overlaps_backward
    with pytest.raises(PlanningError, match="engine='fsdp'"):
        default_runtime(hw, engine="fsdp")


def test_plan_is_priced_for_its_engine(wide):
    """manual_plan's predictions are those of the engine recorded in the plan: ZeRO-3 on
    the module engine hides its gathers behind compute (FSDP2 prefetch); on the graph engine
    every microbatch pays two all-gathers of the stage's weights."""
    model, graph, mesh = wide
    plans = {e: meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=2,
                                     dtype="bf16", zero=3, engine=e) for e in ("modules", "graph")}
    assert plans["modules"].engine == "modules"
    for engine, plan in plans.items():
        expected = estimate_plan(plan, graph, runtime=default_runtime(_hw(plan), engine=engine))
        assert plan.predicted.step_time_s == pytest.approx(expected.step_time_s, rel=1e-9)
    mods, graph_ = (_cost(plans[e], graph, default_runtime(_hw(plans[e]), engine=e))
                    for e in ("modules", "graph"))
    weights = sum(p.numel for p in graph.params if p.tied_to is None) * BF16
    gather = collective_time_s(_hw(plans["graph"]), Collective.ALL_GATHER, weights, 8)
    assert graph_.comm_s - mods.comm_s >= 1.5 * gather
    assert plans["modules"].predicted.step_time_s < plans["graph"].predicted.step_time_s


def test_module_engine_overlaps_the_gradient_sync(wide):
    """FSDP2's replicate reduces each block's gradients while the backward of the blocks
    before it runs: only the last block's share (or what exceeds the backward) is exposed,
    where the graph engine pays the whole flat all-reduce after the backward."""
    model, graph, mesh = wide
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=8,
                                dtype="bf16", engine="modules")
    graph_rt = default_runtime(_hw(plan), engine="graph")
    flat = _cost(plan, graph, graph_rt).grad_sync_s
    mods = _cost(plan, graph, default_runtime(_hw(plan), engine="modules"))
    latency = collective_time_s(_hw(plan), Collective.ALL_REDUCE, 1e-30, 8)
    blocks = 4 + 1  # four blocks and the root's parameters: one collective each
    assert mods.backward_s > flat  # the backward is long enough to hide all but one block
    total = flat - latency + blocks * latency  # one collective per block
    slow = _hw(plan).device.overlap_slowdown  # the hidden part slows the backward beside it
    assert slow > 0
    hidden = total * (1 - 1 / blocks)  # all but the last block's, far less than the backward
    assert mods.grad_sync_s == pytest.approx(total / blocks + slow * hidden / (1 + slow),
                                             rel=1e-6)


def test_compute_beside_a_collective_is_priced_slower(wide):
    """``device.overlap_slowdown`` (Lee et al. 2025, arXiv 2507.03114: compute slows 18.9%
    on average while a collective runs beside it): every second of communication the module
    engine hides behind compute (FSDP2's prefetched all-gathers and per-block
    reduce-scatters) adds that fraction of a second; a device without it prices overlap as
    free, and an engine that hides nothing (the graph engine) is unchanged."""
    model, graph, mesh = wide
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=8,
                                dtype="bf16", zero=3, engine="modules")
    hw = _hw(plan)
    free = dataclasses.replace(hw, device=dataclasses.replace(hw.device, overlap_slowdown=0.0))
    t = plan.training
    kw = dict(dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
              seq_len=t.seq_len)
    for engine in ("modules", "graph"):
        rt = default_runtime(hw, engine=engine)
        slowed = stage_cost(plan.stages[0], graph, hw, runtime=rt, **kw)
        ideal = stage_cost(plan.stages[0], graph, free, runtime=rt, **kw)
        extra = (slowed.comm_s + slowed.grad_sync_s) - (ideal.comm_s + ideal.grad_sync_s)
        if engine == "graph":
            assert extra == pytest.approx(0.0, abs=1e-12)
            continue
        # the hidden communication: all of FSDP2's per-block traffic but what stays exposed
        exposed = ideal.comm_s + ideal.grad_sync_s
        flat = stage_cost(plan.stages[0], graph, hw, runtime=dataclasses.replace(
            rt, overlap_efficiency=0.0), **kw)
        hidden = flat.comm_s + flat.grad_sync_s - exposed
        assert hidden > 0
        # the collectives run beside hidden / (1 + s) seconds of compute, each s slower
        slow = hw.device.overlap_slowdown
        assert extra == pytest.approx(slow * hidden / (1 + slow), rel=1e-6)


def test_module_engine_on_gloo_hides_no_collective(wide):
    """FSDP2 issues its reductions and all-gathers with ``async_op=False``; on gloo that
    blocks the CPU thread, so the module engine priced for gloo pays every block's gradient
    sync and every ZeRO-3 gather in full, against NCCL's overlap."""
    model, graph, mesh = wide
    hw = mesh.hardware
    gloo, nccl = (default_runtime(hw, engine="modules", backend=b) for b in ("gloo", "nccl"))
    assert (gloo.overlap_efficiency, nccl.overlap_efficiency) == (0.0, 1.0)
    for zero in (0, 3):
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=8,
                                    dtype="bf16", zero=zero, engine="modules")
        blocking, overlapped = (_cost(plan, graph, r) for r in (gloo, nccl))
        # the same collectives, none hidden: more exposed than under NCCL
        assert blocking.comm_s + blocking.grad_sync_s > \
            overlapped.comm_s + overlapped.grad_sync_s
        if zero == 0:
            flat = _cost(plan, graph, default_runtime(hw, engine="graph")).grad_sync_s
            latency = collective_time_s(hw, Collective.ALL_REDUCE, 1e-30, 8)
            assert blocking.grad_sync_s == pytest.approx(flat + 4 * latency, rel=1e-6)
    half = dataclasses.replace(nccl, overlap_efficiency=0.5)
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=8,
                                dtype="bf16", engine="modules")
    costs = [_cost(plan, graph, r).grad_sync_s for r in (gloo, half, nccl)]
    assert costs[1] == pytest.approx((costs[0] + costs[2]) / 2, rel=1e-9)
    with pytest.raises(PlanningError, match="overlap_efficiency=1.5"):
        dataclasses.replace(nccl, overlap_efficiency=1.5)


def test_fp32_keeps_the_optimizers_shard_beside_the_full_weights(wide):
    """In fp32 the parameter the optimizer steps is a copy of its own beside the weights the
    forward reads: FSDP2's shard (the whole tensor under replicate, ZeRO-0) beside its
    gathered copy, and the graph engine's ZeRO-1/2 master shard beside the full weights.
    ZeRO-3's gathered blocks are buffers; under bf16 the shard is the fp32 master the
    model-state table counts in the optimizer column."""
    model, graph, mesh = wide

    def weights(dtype, zero, engine):
        return meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=8,
                                    dtype=dtype, zero=zero, engine=engine
                                    ).stages[0].predicted.memory.params_gib
    full = weights("fp32", 0, "graph")  # the plain replicated weights, once
    for zero, extra in ((1, 1 / 8), (2, 1 / 8)):
        for engine in ("graph", "modules"):
            assert weights("fp32", zero, engine) == pytest.approx(full * (1 + extra), rel=1e-9)
    assert weights("fp32", 0, "modules") == pytest.approx(2 * full, rel=1e-9)
    assert weights("fp32", 3, "modules") == pytest.approx(full / 8, rel=1e-9)
    for zero in (0, 1):
        assert weights("bf16", zero, "modules") == pytest.approx(
            weights("bf16", zero, "graph"), rel=1e-9)


def test_module_engine_zero2_shards_gradients_every_microbatch(wide):
    """The module engine runs ZeRO-2 as fully_shard without deferring the sync: gradients
    are reduce-scattered in every microbatch's backward, so they are 1/dp at the peak (the
    graph engine accumulates full fp32 gradients)."""
    model, graph, mesh = wide
    mems = {e: meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=2,
                                    dtype="bf16", zero=2, engine=e).stages[0].predicted.memory
            for e in ("modules", "graph")}
    assert mems["modules"].grads_gib == pytest.approx(mems["graph"].grads_gib / 8, rel=0.01)
    assert mems["graph"].grads_gib * GIB > 0


def test_module_engine_pipelines_sync_zero2_gradients_once_per_step(wide):
    """Under torch.distributed.pipelining an FSDP stage accumulates full gradients over the
    microbatches (``set_requires_gradient_sync(False)``) and reduce-scatters them once after
    the last backward (``perform_reduce_grad``): full fp32 gradients at the peak, no
    per-microbatch sync, one exposed sync per step. A single-stage plan keeps FSDP2's
    reduce-scatter per microbatch."""
    _, _, mesh = wide
    model = parse_model_spec("transformers:llama?hidden_size=512&intermediate_size=1024&"
                             "num_hidden_layers=4&num_attention_heads=8&vocab_size=256&"
                             "max_position_embeddings=1024").build("meta")
    graph = trace(model, example_inputs(model, 64, 1024))
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=4, pp=2, microbatch_size=2,
                                dtype="bf16", zero=2, engine="modules")
    hw = _hw(plan)
    t = plan.training
    kw = dict(dtype=t.dtype, optimizer=t.optimizer, microbatches=t.microbatches,
              num_stages=2, seq_len=t.seq_len)
    piped = default_runtime(hw, engine="modules", pipeline=True)
    assert piped.full_grad_accumulation and not piped.reduce_scatter_per_microbatch
    assert not piped.sync_overlaps_backward
    once = stage_cost(plan.stages[0], graph, hw, runtime=piped, **kw)
    every = stage_cost(plan.stages[0], graph, hw, runtime=default_runtime(hw, engine="modules"),
                       **kw)
    assert once.memory.grads_gib == pytest.approx(4 * every.memory.grads_gib, rel=0.01)
    assert once.comm_s < every.comm_s and once.grad_sync_s > every.grad_sync_s
    # the plan's own prediction is the pipeline runtime's
    expected = estimate_plan(plan, graph, runtime=piped)
    assert plan.predicted.step_time_s == pytest.approx(expected.step_time_s, rel=1e-9)


def test_module_engine_selective_keeps_only_matmul_outputs(wide):
    """The module engine's selective recompute (runtime/modules.py ``_SAVED_IN_SELECTIVE``)
    keeps a block's input and its parameter matmuls' outputs and recomputes the rest (norms,
    GELU, attention), so it keeps less than the graph engine's selective (which drops only
    seq x seq tensors) and recomputes more."""
    from meshplan.costmodel.memory import activation_profile

    model, graph, mesh = wide
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, microbatch_size=2,
                                dtype="bf16", recompute="selective", engine="modules")
    rt = {e: default_runtime(_hw(plan), engine=e) for e in ("modules", "graph")}
    costs = {e: _cost(plan, graph, r) for e, r in rt.items()}
    assert costs["modules"].memory.activations_gib < 0.7 * costs["graph"].memory.activations_gib
    assert costs["modules"].recompute_s > costs["graph"].recompute_s
    # closed form on block 0: the kept bytes are the outputs of its four weight matmuls
    # (c_attn, attn c_proj, c_fc, mlp c_proj), microbatch rows x seq x their widths, in bf16
    t = plan.training
    rows = 64 // 8 // t.microbatches
    prof = activation_profile(graph, list(plan.stages[0].ops), split_of=lambda n: 8,
                              dtype_bytes=BF16, seq_len=1024, micro_fraction=1 / 8 / t.microbatches * 8)
    width = 3 * 512 + 512 + 4 * 512 + 512
    assert prof.kept_matmuls[0] == pytest.approx(rows * 1024 * width * BF16, rel=1e-6)


ACT_LLAMA = ("transformers:llama?hidden_size=512&intermediate_size=1376&num_hidden_layers=4&"
             "num_attention_heads=8&num_key_value_heads={kv}&vocab_size=1024&"
             "max_position_embeddings=256")


def _torchtitan_llama(device):
    import os
    import sys

    from tests.harness.benchmarks import ROOT
    sys.path.insert(0, os.path.join(str(ROOT), "benchmarks"))
    import torchtitan_llama
    return torchtitan_llama, torchtitan_llama.build(
        dim=512, layers=4, heads=8, kv_heads=2, hidden=1376, vocab=1024, max_seq=256,
        device=device)


ACT_GPT2 = ("transformers:gpt2?n_layer=4&n_embd=512&n_head=8&vocab_size=1024&n_positions=256&"
            "resid_pdrop=0&embd_pdrop=0&attn_pdrop=0")


@pytest.mark.parametrize("case", ["hf-mha-fsdp", "hf-gqa-autocast", "torchtitan-gqa-fsdp",
                                  "gpt2-fsdp"])
def test_activation_bytes_match_what_eager_autograd_saves(case):
    """The module engine's kept activations are what eager autograd saves, tensor by tensor
    at the dtypes eager PyTorch holds them in (DECISIONS 108), on this CPU with saved-tensor
    hooks counting each saved storage once (parameters excluded), the logits upcast to fp32
    as the engine's loss does (runtime/modules.py ``_loss``), against the kept bytes of one
    microbatch (2 x 256) the plan's activation profile prices:
    - a Hugging Face Llama held in bf16 (FSDP2's mixed precision, a dp=8 plan): the fp32
      chain inside its RMSNorms is kept in fp32 (49.6 MiB measured, 49.6 priced; every
      float at bf16 priced 44.1 before);
    - the same with grouped-query attention in fp32 weights under torch.autocast (a
      one-GPU plan): the fp32 residual stream, and each matmul's own bf16 copy of its fp32
      input (autocast casts at every use);
    - torchtitan's Llama (benchmarks/torchtitan_llama.py) with grouped-query attention:
      ``repeat_kv`` writes the repeated keys and values, which SDPA keeps (before, they were
      priced as views of the unrepeated ones);
    - GPT-2 in bf16 (LayerNorm, GELU, tied head, dropout 0): ``position_embeds.to(device)``
      moves the table and keeps its dtype (a review found it priced as an fp32 upcast that
      carried fp32 through the residual stream, +22%), and a dropout of probability 0 keeps
      no mask."""
    import torch

    from meshplan.costmodel.stage_layout import stage_activation_profile
    from meshplan.tracing import next_token_loss

    batch, seq = 2, 256
    torch.manual_seed(0)
    if case.startswith("torchtitan"):
        tt, model = _torchtitan_llama("cpu")
        for p in model.parameters():  # bf16 weights, the complex rotary table kept
            p.data = p.data.to(torch.bfloat16)
        meta = _torchtitan_llama("meta")[1]
        ids_meta = torch.zeros(batch * 8, seq, dtype=torch.long, device="meta")
        graph = trace(meta, (ids_meta,), example_targets=(ids_meta,), loss_fn=tt.loss)

        def forward(ids):
            return tt.loss(model(ids).float(), ids)
    else:
        spec = parse_model_spec(ACT_GPT2 if case.startswith("gpt2") else
                                ACT_LLAMA.format(kv=2 if "gqa" in case else 8))
        model = spec.build("cpu")
        if "autocast" not in case:
            model = model.to(torch.bfloat16)
        meta = spec.build("meta")
        graph = trace(meta, (torch.zeros(batch * 8, seq, dtype=torch.long, device="meta"),))

        def forward(ids):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in case):
                logits = model(ids).logits
            return next_token_loss(logits.float(), ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    autocast = "autocast" in case
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    ids = torch.randint(0, 1024, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(ids)
    if autocast:  # autocast's bf16 weight copies: the model state's bf16 weights column
        saved_weights = sum(p.numel() * 2 for p in model.parameters() if p.dim() == 2
                            and p is not model.get_input_embeddings().weight)
    measured = sum(saved.values()) - (saved_weights if autocast else 0)

    dp = 1 if autocast else 8
    graph_used = graph if dp == 8 else trace(meta, (torch.zeros(batch, seq, dtype=torch.long,
                                                                 device="meta"),))
    mesh = meshplan.Mesh.from_dict({"shape": [dp], "hardware": "dgx-a100-80gb"})
    plan = meshplan.manual_plan(meta, mesh, graph=graph_used, dp=dp, microbatch_size=batch,
                                dtype="bf16", engine="modules")
    prof = stage_activation_profile(plan.stages[0], graph_used, _hw(plan), dtype="bf16",
                                    microbatches=1, seq_len=seq,
                                    precision="autocast" if autocast else "fsdp")
    predicted, _ = prof.stage_bytes("none", without_masks=True)  # the engine builds no mask
    assert 0.97 < predicted / measured < 1.03, (predicted / 2**20, measured / 2**20)


def _step_peak_bytes(model, ids, loss_fn) -> int:
    """Peak live tensor bytes of one eager training step with Adam (runtime/memory_probe.py,
    what ``meshplan run`` reports), after a first step has made the optimizer state."""
    import torch

    from meshplan.runtime.memory_probe import StepMemoryProbe

    opt = torch.optim.Adam(model.parameters())

    def step():
        loss_fn(model(ids).logits, ids).backward()
        opt.step()
    step()
    state = [t for p in model.parameters() for t in (p, p.grad)] + \
        [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    with StepMemoryProbe(state) as probe:
        step()
    return probe.peak_bytes


@pytest.mark.parametrize("spec,dropout", [
    ("transformers:llama?hidden_size=128&intermediate_size=256&num_hidden_layers=2&"
     "num_attention_heads=4&num_key_value_heads=2&vocab_size=512&max_position_embeddings=1024",
     False),
    ("transformers:gpt2?n_layer=2&n_embd=128&n_head=4&vocab_size=512&n_positions=1024&"
     "attn_pdrop=0.1", True),
])
def test_cpu_peak_memory_follows_torch_cpu_attention_kernel(spec, dropout):
    """Issue 25: a CPU plan's predicted peak (module engine, fp32, batch 1 x 1024) against
    the measured peak live tensor bytes of one eager step on this CPU. torch's CPU SDPA runs
    flash attention for CPU (no s x s tensor kept) unless ``dropout_p`` > 0, where its math
    path keeps three s x s tensors per layer (``compute.attention_saved_bytes``): the Llama
    without dropout, GPT-2 with attention dropout 0.1. The peak is at the start of the
    backward, every activation kept plus the cross entropy's two logits-size gradients
    (``memory.loss_grad_bytes``). The cost model used to add every layer's probabilities to
    every layer on CPU (4-6x the measured peak of issue 25's Llama at cp 1/2/4) and kept
    both operands of a product where one needs no gradient (the rotary x * cos keeps cos
    alone). With cp=2 each rank keeps half of the sequence's activations."""
    import torch

    from meshplan.costmodel.compute import attention_dropout
    from meshplan.tracing import next_token_loss

    seq = 1024
    parsed = parse_model_spec(spec)
    torch.manual_seed(0)
    model = parsed.build("cpu").train()
    ids = torch.randint(0, 512, (1, seq))
    measured = _step_peak_bytes(model, ids, next_token_loss)

    meta = parsed.build("meta")
    graph = trace(meta, (torch.zeros(1, seq, dtype=torch.long, device="meta"),))
    attn = [n for n in graph.nodes if n.kind.name == "ATTENTION"]
    assert attn and all(attention_dropout(n) == dropout for n in attn)
    plans = {cp: meshplan.manual_plan(meta, meshplan.Mesh.local(cp), graph=graph, cp=cp,
                                      dtype="fp32", engine="modules")
             for cp in ((1,) if dropout else (1, 2))}  # cp runs no attention dropout
    predicted = plans[1].predicted.peak_memory_gib * GIB
    assert 0.9 < predicted / measured < 1.1, (predicted / 2**20, measured / 2**20)
    if 2 in plans:
        acts = {cp: p.predicted.memory.activations_gib for cp, p in plans.items()}
        assert acts[2] == pytest.approx(acts[1] / 2, rel=0.05)


def test_overlap_cost_never_exceeds_the_compute_it_slows():
    """Collectives hidden behind the same compute slow it once: what they add is capped at
    ``slow`` x the compute, however much communication hides (the review's dp128 ZeRO-3
    case hid 1.6x its compute and was charged 30% of it)."""
    from meshplan.costmodel.estimate import overlap_cost_s

    assert overlap_cost_s(1.0, 10.0, 0.189) == pytest.approx(0.189 / 1.189)
    assert overlap_cost_s(16.0, 7.5, 0.189) == pytest.approx(0.189 * 7.5)
    assert overlap_cost_s(5.0, 10.0, 0.0) == 0.0 and overlap_cost_s(0.0, 10.0, 0.2) == 0.0


@pytest.fixture(scope="module")
def step_peaks(tmp_path_factory):
    from pathlib import Path

    from _launch import forked_results

    worker = str(Path(__file__).with_name("_memory_peak_worker.py"))
    root = tmp_path_factory.mktemp("peaks")
    return {**forked_results(worker, root / "one.pt", nproc=1, timeout=900),
            **forked_results(worker, root / "two.pt", nproc=2, timeout=900)}


@pytest.mark.parametrize("run", ["1x2", "1x4", "2x2", "2x4"])
def test_module_engine_step_peak_follows_the_measurement(step_peaks, run):
    """A bf16 step of a small Llama (plain PyTorch, 4 rows x 512 per rank) through
    ``meshplan.parallelize``, one rank under autocast or two under FSDP2 ZeRO-3, microbatches
    of 2 or 4 rows (tests/_memory_peak_worker.py): the plan's predicted peak against the peak
    of live tensors runtime/memory_probe.py measured. With two microbatches the gradients
    exist when the second one's backward starts, and the prediction is within 5%. With one,
    the step allocates its gradients during the backward, after the activation peak
    (DECISIONS 108's residual): the prediction exceeds the measurement by no more than the
    gradients. Measured: 0.980 / 0.997 of the measurement with two microbatches (one rank /
    two), 1.036 / 1.039 with one (the gradients are 6.8% / 4.1% of it); before DECISIONS
    108 (every kept activation at bf16) 0.81-0.83, all four failing. Two ranks' peaks move
    with timing: FSDP2 over gloo frees each gathered block when its collectives complete, so
    how many gathered blocks are alive at the activation peak depends on the machine's load:
    over the runs of 2026-11-29 the 2-rank peaks were 124.7-131.9 MB (2 microbatches;
    prediction 124.7) and 182.6-198.8 MB (1; prediction 205.1), measured on a second or
    third step. The bounds hold that spread (8%) on two ranks, 5% on one."""
    r = step_peaks[run]
    spread = 0.08 if run.startswith("2x") else 0.0
    if r["microbatches"] > 1:
        assert 0.95 - spread < r["predicted"] / r["measured"] < 1.05 + spread, r
    else:
        assert r["measured"] * 0.98 < r["predicted"] < \
            r["measured"] * (1 + spread) + r["grads"] * 1.1, r


def test_each_microbatch_in_flight_keeps_its_own_autocast_weight_copies(monkeypatch):
    """A pipelined stage under autocast (fp32 weights, bf16 compute) runs each microbatch's
    forward in its own autocast region, and autocast's cache of a weight's cast lives only
    for its region: three forwards in flight keep three bf16 copies of the weight for their
    backwards (measured here with saved-tensor hooks). The model state's bf16 weights
    column is one of them; the estimate adds the others, (in flight - 1) x the stage's bf16
    weights (DECISIONS 108; before, one copy whatever the schedule)."""
    import torch

    import meshplan.costmodel.estimate as est
    from meshplan.costmodel.memory import inflight_microbatches

    layer = torch.nn.Linear(256, 256, bias=False)
    copies = set()

    def pack(t):
        if t.dtype == torch.bfloat16 and t.shape == layer.weight.shape:
            copies.add(t.untyped_storage().data_ptr())
        return t
    outs = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(layer(torch.randn(4, 256, requires_grad=True)))
    assert len(copies) == 3

    spec = parse_model_spec("transformers:llama?hidden_size=128&intermediate_size=256&"
                            "num_hidden_layers=4&num_attention_heads=4&num_key_value_heads=4&"
                            "vocab_size=256&max_position_embeddings=64")
    meta = spec.build("meta")
    graph = trace(meta, example_inputs(meta, 8, 64))
    mesh = meshplan.Mesh.from_dict({"shape": [2], "hardware": "dgx-a100-80gb"})
    plan = meshplan.manual_plan(meta, mesh, graph=graph, pp=2, microbatch_size=2,
                                dtype="bf16", engine="graph")
    t = plan.training
    assert t.microbatches == 4
    kw = dict(dtype="bf16", optimizer=t.optimizer, microbatches=4, num_stages=2,
              schedule=t.schedule, seq_len=t.seq_len)
    stage = plan.stages[0]
    with_copies = stage_cost(stage, graph, _hw(plan), **kw)
    monkeypatch.setattr(est, "inflight_microbatches", lambda *a, **k: 1)
    one_copy = stage_cost(stage, graph, _hw(plan), **kw)
    inflight = inflight_microbatches(t.schedule, 0, 2, 4)
    assert inflight > 1
    extra = (with_copies.memory.activations_gib - one_copy.memory.activations_gib) * GIB
    assert extra == pytest.approx((inflight - 1) * with_copies.memory.params_gib * GIB)


def test_a_dropout_keeps_its_bool_mask_beside_what_its_reader_keeps():
    """Eager dropout (p > 0) keeps a bool mask, one byte an element; the matmul after it
    keeps the dropped-out bf16 output as well (a review found the mask counted in the
    output's place: 8192 bytes short here); at p = 0 eager keeps no mask."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from meshplan.costmodel.eager import element_bytes
    from meshplan.costmodel.memory import activation_profile

    d, rows = 64, 4 * 16

    class Net(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p
            self.emb, self.h = nn.Embedding(40, d), nn.Linear(d, 40, bias=False)
            self.a, self.b = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

        def forward(self, ids):
            return self.h(self.b(F.dropout(self.a(self.emb(ids)), self.p, True)))
    kept = {}
    for p in (0.1, 0.0):
        with torch.device("meta"):
            net = Net(p)
        graph = trace(net, (torch.zeros(4, 16, dtype=torch.long, device="meta"),))
        prof = activation_profile(graph, [n.name for n in graph.nodes], split_of=lambda n: 1,
                                  dtype_bytes=2, seq_len=16, micro_fraction=1.0,
                                  sizes=element_bytes(graph, dtype="bf16", precision="fsdp"))
        kept[p] = sum(prof.kept.values())
    assert kept[0.1] - kept[0.0] == rows * d  # the mask, one byte an element


def test_the_pipeline_search_keeps_activations_apart_for_zero3():
    """The pipeline search probes a range's kept and working activations once for every ZeRO
    level below 3 and once for ZeRO-3 (an autocast stage below ZeRO-3 keeps a weight copy per
    microbatch in flight, DECISIONS 108): the order of the probes does not change them (a
    review found the first level probed fixing them for all)."""
    from meshplan.planner.clusters import layer_units
    from meshplan.planner.inter import StageOption
    from meshplan.planner.stagecost import MegatronStageCost

    spec = ("transformers:llama?hidden_size=256&intermediate_size=1024&num_hidden_layers=4"
            "&num_attention_heads=4&num_key_value_heads=2&vocab_size=1024&"
            "max_position_embeddings=256")
    model = parse_model_spec(spec).build("meta")
    graph = trace(model, example_inputs(model, 16, 256), model_name=spec)
    mesh = meshplan.Mesh.preset("dgx-a100-80gb")
    options = [StageOption(mesh_shape=(2, 1), recompute="none", zero=z) for z in (0, 3)]
    probes = []
    for order in (options, options[::-1]):
        cost = MegatronStageCost(graph, layer_units(graph), mesh.hardware, num_devices=8,
                                 dtype="bf16", optimizer="adam", engine="graph")
        probes.append({o.zero: cost.probe(1, 3, o, 1)[3:5] for o in order})
    assert probes[0] == probes[1]
    assert probes[0][0] != probes[0][3]  # ZeRO 0 keeps the weight copies, ZeRO-3 not


def test_the_intra_op_ilp_keeps_the_estimates_activations(monkeypatch):
    """The single-stage ILP prices a group's kept activations with the estimate's parts
    (memory.keeps_autocast_copy, is_dropout): on a bf16 GPT-2 with dropout under the graph
    engine its activation memory equals the estimate's within 1% (a dropout's bool mask
    priced at the output's bf16 size put it 1.8% over)."""
    import torch

    from meshplan.planner import singlestage

    spec = parse_model_spec("transformers:gpt2?n_layer=2&n_embd=256&n_head=4&vocab_size=512&"
                            "n_positions=128&resid_pdrop=0.1&embd_pdrop=0.1&attn_pdrop=0")
    meta = spec.build("meta")
    graph = trace(meta, (torch.zeros(16, 128, dtype=torch.long, device="meta"),))
    solved = {}
    solve = singlestage.solve_stage

    def spy(*args, **kwargs):
        solved["sol"] = solve(*args, **kwargs)
        return solved["sol"]
    monkeypatch.setattr(singlestage, "solve_stage", spy)
    plan = singlestage.plan_single_stage(graph, meshplan.Mesh.preset("dgx-a100-80gb"),
                                         dtype="bf16", time_limit_s=20)
    ilp = solved["sol"].memory.activations_gib
    assert ilp == pytest.approx(plan.predicted.memory.activations_gib, rel=0.01)
