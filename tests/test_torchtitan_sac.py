"""torchtitan's op-level selective activation checkpointing, priced as torchtitan runs it.

torchtitan's ``selective_ac_option = "op"`` (``_apply_op_sac``) counts ``aten.mm`` calls
per checkpointed block and saves the output of every call but the 2nd, 4th, ..., with SDPA's
outputs; everything else is recomputed in the backward. meshplan's own module engine saves
every parameter matmul and recomputes attention (runtime/modules.py). The ``torchtitan``
profile prices torchtitan's rule (``RuntimeModel.selective_alternate_matmuls``,
``memory.alternate_matmuls``); these tests measure both rules on this CPU.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import meshplan
from meshplan.costmodel.estimate import default_runtime, stage_cost
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.memory import alternate_matmuls
from meshplan.costmodel.stage_layout import stage_activation_profile
from meshplan.runtime.memory_probe import StepMemoryProbe
from meshplan.specs import parse_model_spec
from meshplan.tracing import next_token_loss, trace

BATCH, SEQ = 2, 256
_SHAPE = ("hidden_size=512&intermediate_size=1376&num_hidden_layers=4&num_attention_heads=8&"
          f"num_key_value_heads=4&vocab_size=1024&max_position_embeddings={SEQ}")
SPEC = f"transformers:llama?{_SHAPE}"
# Qwen2: the same block with biased q, k and v projections (aten.addmm, not aten.mm)
BIASED = f"transformers:qwen2?{_SHAPE}"
# torchtitan 9dec370's save list (parallelize_llama.py ``_save_list``), with torch's CPU
# flash kernel beside the two SDPA kernels it names
_SAVE = {torch.ops.aten.mm.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
         torch.ops._c10d_functional.reduce_scatter_tensor.default,
         torch.ops.aten.max.default}
_MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _torchtitan_policy(count, ctx, func, *args, **kwargs):
    """torchtitan's rule, written here from its description: count ``aten.mm`` calls per
    block (separately in the forward and the recompute), save what its save list names but
    every 2nd mm; ``aten.addmm`` (a biased linear) is neither counted nor saved."""
    key = "recompute" if ctx.is_recompute else "forward"
    if func == torch.ops.aten.mm.default:
        count[key] += 1
    keep = func in _SAVE and not (func == torch.ops.aten.mm.default and count[key] % 2 == 0)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _modules_policy(ctx, func, *args, **kwargs):
    """meshplan's module engine (runtime/modules.py): every parameter matmul saved."""
    return CheckpointPolicy.MUST_SAVE if func in _MM else CheckpointPolicy.PREFER_RECOMPUTE


def _kept_after_forward(policy: str, spec: str = SPEC) -> int:
    """Live tensor bytes the forward leaves for the backward (parameters excluded): a bf16
    HF Llama (or ``spec``) with every block checkpointed under ``policy``."""
    torch.manual_seed(0)
    model = parse_model_spec(spec).build("cpu").to(torch.bfloat16)
    layers = model.model.layers
    for i, block in enumerate(list(layers)):
        if policy == "torchtitan":
            fn = lambda: create_selective_checkpoint_contexts(  # noqa: E731
                partial(_torchtitan_policy, defaultdict(int)))
        else:
            fn = partial(create_selective_checkpoint_contexts, _modules_policy)
        layers[i] = checkpoint_wrapper(block, context_fn=fn)
    ids = torch.randint(0, 1024, (BATCH, SEQ))
    with StepMemoryProbe(list(model.parameters())) as probe:
        loss = next_token_loss(model(ids).logits, ids)
        kept = probe.current_bytes - probe.start_bytes
    loss.backward()  # the rule runs its recompute without error
    return kept


def _priced(spec: str):
    meta = parse_model_spec(spec).build("meta")
    graph = trace(meta, (torch.zeros(BATCH * 8, SEQ, dtype=torch.long, device="meta"),))
    plan = meshplan.manual_plan(meta, meshplan.Mesh.preset("dgx-h100", nodes=1), graph=graph,
                                dp=8, microbatch_size=BATCH, dtype="bf16",
                                recompute="selective", engine="modules")
    return plan, graph


@pytest.fixture(scope="module")
def priced():
    return _priced(SPEC)


def _kept(plan, graph, engine: str) -> float:
    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    rt = default_runtime(hw, engine=engine)
    t = plan.training
    prof = stage_activation_profile(plan.stages[0], graph, hw, dtype=t.dtype,
                                    microbatches=t.microbatches, seq_len=SEQ)
    return prof.stage_bytes("selective", keep_matmuls_only=rt.selective_keeps_matmuls,
                            without_masks=rt.causal_mask_skipped,
                            alternate=rt.selective_alternate_matmuls)[0]


def test_alternate_matmuls_are_k_o_and_up_in_a_llama_block(priced):
    _, graph = priced
    names = alternate_matmuls(graph)
    per_layer = defaultdict(list)
    for n in graph.nodes:
        if n.name in names:
            per_layer[n.layer].append(n.name)
    assert sorted(per_layer) == [0, 1, 2, 3]
    for layer, got in per_layer.items():
        assert len(got) == 3
        for proj, name in zip(("k_proj", "o_proj", "up_proj"), got):
            assert any(proj in p for p in graph.node(name).params), (proj, name)


def test_kept_activations_match_torchtitans_rule_measured_on_cpu(priced):
    """Measured on this CPU (torch 2.13, transformers 5.x): the bytes each rule leaves alive
    after the forward, against the kept activations each profile predicts for one GPU of the
    same microbatch; and the difference between the rules (torchtitan keeps SDPA's output
    and logsumexp but drops the k, o and up projections' outputs)."""
    plan, graph = priced
    measured = {p: _kept_after_forward(p) for p in ("modules", "torchtitan")}
    predicted = {"modules": _kept(plan, graph, "modules"),
                 "torchtitan": _kept(plan, graph, "torchtitan")}
    for p in measured:
        assert 0.9 < predicted[p] / measured[p] < 1.1, (p, predicted[p] / 2**20,
                                                          measured[p] / 2**20)
    drop_m = measured["modules"] - measured["torchtitan"]
    drop_p = predicted["modules"] - predicted["torchtitan"]
    assert drop_m > 0 and 0.9 < drop_p / drop_m < 1.1, (drop_p / 2**20, drop_m / 2**20)


def test_torchtitan_profile_recomputes_its_rule():
    """Recompute time, operator by operator: the module engine reruns every block operator
    but the parameter matmuls; torchtitan reruns every block operator but the attention
    kernel and the q, v, gate and down projections (named here from the weights they read,
    not from ``alternate_matmuls``). Each profile's recompute equals the sum of those
    operators' forward times as the estimate prices them."""
    from meshplan.costmodel.estimate import operator_pricer
    from meshplan.costmodel.memory import mask_builders
    from meshplan.costmodel.operators import operator_time
    from meshplan.graph import OpKind

    meta = parse_model_spec(SPEC).build("meta")
    graph = trace(meta, (torch.zeros(BATCH * 8, SEQ, dtype=torch.long, device="meta"),))
    kept_by_torchtitan = ("q_proj", "v_proj", "gate_proj", "down_proj")
    for engine in ("modules", "torchtitan"):
        plan = meshplan.manual_plan(meta, meshplan.Mesh.preset("dgx-h100", nodes=1),
                                    graph=graph, dp=8, microbatch_size=BATCH, dtype="bf16",
                                    recompute="selective", engine=engine)
        pr = operator_pricer(plan, graph, 0)
        # transformers' key / value repeats go with the mask the eager model never builds
        unbuilt = mask_builders(graph)  # (DECISIONS 106)
        expected = 0.0
        for name, op in pr.stage.ops.items():
            node = graph.node(name)
            if node.layer < 0:
                continue
            param_mm = node.kind == OpKind.MATMUL and bool(node.params)
            if engine == "modules":
                rerun = not param_mm
            else:
                rerun = node.kind != OpKind.ATTENTION and not (
                    param_mm and any(k in p for p in node.params for k in kept_by_torchtitan))
            if rerun and name not in unbuilt:
                expected += operator_time(
                    node, op, graph, pr.hw, pr.dtype, pr.stage.mesh_shape, pr.m, pr.contention,
                    group=pr.fused.get(name), kernels=pr.kernels,
                    attention=pr.runtime.attention, fp8=pr.fp8,
                    causal=node.kind == OpKind.ATTENTION).forward_s
        t = plan.training
        got = stage_cost(plan.stages[0], graph, pr.hw, dtype=t.dtype, optimizer=t.optimizer,
                         microbatches=t.microbatches, seq_len=t.seq_len,
                         runtime=pr.runtime).recompute_s
        assert got == pytest.approx(expected, rel=1e-6), engine


def test_biased_matmuls_are_neither_counted_nor_kept():
    """A biased linear dispatches ``aten.addmm``, which torchtitan's policy neither counts
    nor saves: in a Qwen2 block (q, k, v biased) q, k and v are recomputed, and the count
    starts at o (o and up kept, gate and down recomputed); measured on this CPU against
    the kept activations the torchtitan profile predicts. Counting q, k and v as mm calls
    (what meshplan did) predicted q, v and down kept instead of o and up: 17.01 MiB against
    14.51 measured (+17%); the rule as torchtitan runs it predicts 14.01 (-3.5%)."""
    plan, graph = _priced(BIASED)
    names = alternate_matmuls(graph)
    for n in graph.nodes:
        if n.layer == 0 and n.kind == "matmul" and n.params:
            proj = n.params[0].split(".")[-2]
            assert (n.name in names) == (proj in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                  "down_proj")), proj
    measured = _kept_after_forward("torchtitan", BIASED)
    predicted = _kept(plan, graph, "torchtitan")
    assert 0.9 < predicted / measured < 1.1, (predicted / 2**20, measured / 2**20)


if __name__ == "__main__":  # the table of DECISIONS 98: python -m tests.test_torchtitan_sac
    for label, spec, rule in (("Llama, module-engine rule", SPEC, "modules"),
                              ("Llama, torchtitan's rule", SPEC, "torchtitan"),
                              ("Qwen2 (biased q, k, v), torchtitan's rule", BIASED, "torchtitan")):
        plan, graph = _priced(spec)
        print(f"{label}: measured {_kept_after_forward(rule, spec) / 2**20:.2f} MiB, "
              f"predicted {_kept(plan, graph, rule) / 2**20:.2f} MiB")
