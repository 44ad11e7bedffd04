"""torchtitan's rotary embedding under torch.compile (issue 26: torchtitan's compiled H100 rows
predicted 17-19% too fast). torchtitan multiplies the query and key by a complex table; inductor
generates no code for complex values and runs that multiply as its eager ATen kernel, with the
fp32 upcast it reads materialized by a kernel of its own (costmodel/fusion.py ``runs_eager``).
Checked by compiling the rotary embedding with inductor on this CPU, then closed forms."""

import os
import sys

import pytest
import torch

from meshplan.costmodel.eager import eager_kernels, element_bytes
from meshplan.costmodel.fusion import fusion_groups, runs_eager
from meshplan.costmodel.memory import saved_inputs
import meshplan
from meshplan.tracing import trace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import torchtitan_llama  # noqa: E402

sys.path.pop(0)

B, S, DIM, HEADS, KV = 2, 16, 64, 4, 2


@pytest.fixture(scope="module")
def tt():
    model = torchtitan_llama.build(dim=DIM, layers=2, heads=HEADS, kv_heads=KV, hidden=128,
                                   vocab=256, max_seq=S)
    ids = torch.zeros((B, S), dtype=torch.long, device="meta")
    return trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)


def test_inductor_runs_the_complex_multiply_as_an_aten_kernel():
    """What the rule stands on, measured here: the code inductor generates for torchtitan's
    rotary embedding calls ATen's complex ``mul`` (a fallback kernel), once for the query
    and once for the key, after a generated kernel that writes the fp32 upcast."""
    from torch._inductor.utils import run_and_get_code

    def rope(q, k, table):
        return torchtitan_llama.rotate(q, k, table)

    q = torch.randn(B, S, HEADS, DIM // HEADS, dtype=torch.bfloat16)
    k = torch.randn(B, S, KV, DIM // HEADS, dtype=torch.bfloat16)
    table = torchtitan_llama.freqs_table(DIM // HEADS, S, 500000.0)
    torch._dynamo.reset()
    out, codes = run_and_get_code(torch.compile(rope), q, k, table)
    code = "\n".join(codes)
    assert code.count("torch.ops.aten.mul.Tensor(") == 2
    assert "view_as_complex" in code
    want = rope(q, k, table)
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_complex_operators_stay_out_of_the_fused_kernels(tt):
    """No fused group holds an operator that reads or writes a complex value; the complex
    multiplies and the upcasts they read run eagerly; the cast back to bf16 after them is
    fused, reading the fp32 result at its width (before: the multiply was fused with the
    casts around it, and priced nothing under compile)."""
    names = [n.name for n in tt.nodes]
    complex_ops = [n.name for n in tt.nodes if n.layer == 0 and n.target == "aten.mul.Tensor"
                   and n.out.dtype == "complex64"]
    assert len(complex_ops) == 2  # query and key
    groups = fusion_groups(tt, names)
    members = {m for g in groups for m in g.members}
    assert not members & set(complex_ops)
    upcasts = [n.name for n in tt.nodes if n.layer == 0 and n.target.startswith("aten.to.")
               and runs_eager(tt, n.name)]
    assert len(upcasts) == 2  # xq.float(), xk.float()
    assert not any(runs_eager(tt, n.name) for n in tt.nodes if n.layer == 0 and
                   n.target.startswith("aten.type_as"))
    back = [g for g in groups if tt.node(g.lead).layer == 0 and any(
        tt.node(m).target.startswith("aten.type_as")
        for m in g.members) and g.fp32_read_bytes]
    q_numel = B * S * DIM
    assert sorted(g.fp32_read_bytes for g in back) == [B * S * KV * DIM // HEADS * 4,
                                                       q_numel * 4]


def test_the_eager_kernels_of_the_rotary_embedding_closed_form(tt):
    """bf16 run (FSDP2's parameters): the query's upcast reads 2 and writes 4 bytes per
    element; the complex multiply reads the fp32 pairs and the table and writes fp32 pairs;
    the cast back reads 4 and writes 2 (it reads the query's dtype, not its data: no
    gradient sum for it); its backward multiplies by the table's conjugate, which autograd
    clones first (``mul`` reads no conjugate view: the dispatch test below counts it).
    Compiled, the upcast and the multiply keep their kernels."""
    size = element_bytes(tt, dtype="bf16", precision="fsdp")
    n = B * S * DIM  # query elements
    mul = next(x for x in tt.nodes if x.layer == 0 and x.target == "aten.mul.Tensor"
               and x.out.dtype == "complex64" and x.out.numel == n // 2)
    table = mul.inputs[1]
    table_bytes = tt.node(table).out.numel * 8
    for compiled in (False, True):
        kernels = eager_kernels(tt, [x.name for x in tt.nodes], dtype="bf16",
                                precision="fsdp", compiled=compiled)
        (k,) = kernels[mul.name].forward
        assert (k.read_bytes, k.written_bytes) == (n * 4 + table_bytes, n * 4)
        clone, kb = kernels[mul.name].backward  # table.conj() cloned, then grad * it
        assert (clone.read_bytes, clone.written_bytes) == (table_bytes, table_bytes)
        assert (kb.read_bytes, kb.written_bytes) == (n * 4 + table_bytes, n * 4)
        upcast = tt.node(mul.inputs[0])
        while not upcast.target.startswith("aten.to."):
            upcast = tt.node(upcast.inputs[0])
        (u,) = kernels[upcast.name].forward
        assert (u.read_bytes, u.written_bytes) == (n * 2, n * 4)
    cast_back = next(x for x in tt.nodes if x.layer == 0 and x.target.startswith("aten.type_as")
                     and x.out.numel == n)
    assert size[cast_back.name] == 2
    eager = eager_kernels(tt, [x.name for x in tt.nodes], dtype="bf16", precision="fsdp")
    (c,) = eager[cast_back.name].forward
    assert (c.read_bytes, c.written_bytes) == (n * 4, n * 2)
    assert len(eager[cast_back.name].backward) == 1  # the gradient's upcast, no sum
    assert saved_inputs(cast_back, tt) == ()  # a cast keeps nothing for its backward


def test_torchtitan_model_compiled_pays_for_its_rotary_embedding(monkeypatch):
    """The rule's effect on a whole estimate: compiled, torchtitan's Llama prices its
    complex multiplies and upcasts (more than the same trace with them fused)."""
    import meshplan
    from meshplan.costmodel import fusion, operators

    model = torchtitan_llama.build(dim=DIM, layers=2, heads=HEADS, kv_heads=KV, hidden=128,
                                   vocab=256, max_seq=S)
    ids = torch.zeros((8, S), dtype=torch.long, device="meta")
    graph = trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=8, zero=3, microbatch_size=1,
                                dtype="bf16", engine="torchtitan")
    operators._EAGER_WALKS.clear()
    with_rule = meshplan.estimate(plan, compiled=True).step_time_s
    monkeypatch.setattr(fusion, "_complex", lambda graph, name: False)
    operators._EAGER_WALKS.clear()
    without = meshplan.estimate(plan, compiled=True).step_time_s
    operators._EAGER_WALKS.clear()
    assert with_rule > without


def test_repeat_kv_copies_the_repeated_keys_and_values(tt):
    """``x[:, :, :, None].expand(...).reshape(...)`` cannot view a stride-0 tensor: PyTorch
    dispatches a ``clone`` that writes every repeated key and value (checked here), so
    eager prices one broadcast-read copy per reshape, and a compiled block's kernel writes
    the repeated tensor SDPA reads (before: the reshape cost nothing, and the fused kernel
    wrote the unrepeated keys; the values' copy was not priced at all)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshplan.costmodel.kernel_paths import BROADCAST, materializes

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.kernels.append(func._opname)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        torchtitan_llama.repeat_heads(torch.randn(B, S, KV, DIM // HEADS), HEADS // KV)
    assert "clone" in ops.kernels
    copies = [n for n in tt.nodes if n.layer == 0 and materializes(tt, n.name)]
    assert len(copies) == 2  # keys and values
    full = B * S * DIM  # repeated to every query head
    kernels = eager_kernels(tt, [x.name for x in tt.nodes], dtype="bf16", precision="fsdp")
    for node in copies:
        (k,) = kernels[node.name].forward
        assert (k.read_bytes, k.written_bytes, k.path) == (full // (HEADS // KV) * 2, full * 2,
                                                           BROADCAST)
    groups = fusion_groups(tt, [n.name for n in tt.nodes])
    for node in copies:
        (group,) = [g for g in groups if node.name in g.members]
        assert node.name in group.writes
        assert group.written_bytes == full * 4  # traced fp32: the repeated tensor


def test_a_torchtitan_block_prices_the_kernels_autograd_dispatches():
    """Every forward and backward kernel of torchtitan's block in bf16, bytes and path, as
    eager.py counts them and as autograd dispatches them on this CPU (SDPA and the matmuls
    are priced by their FLOPs): the complex rotary multiply and its conjugate clone, the
    upcasts and ``type_as`` casts, repeat_kv's copies, RMSNorm, SwiGLU, the gradient sums
    (the review of DECISIONS 105 found the conjugate clone and the copies missing)."""
    from collections import Counter

    from tests.test_eager_kernels import _Kernels

    sdpa = ("_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            "scaled_dot_product_attention")

    class Captured(_Kernels):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._opname in sdpa:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    torch.manual_seed(0)
    block = torchtitan_llama.TransformerBlock(DIM, HEADS, KV, 128, 1e-5).to(torch.bfloat16)
    table = torchtitan_llama.freqs_table(DIM // HEADS, S, 500000.0)
    x = torch.randn(B, S, DIM, dtype=torch.bfloat16, requires_grad=True)
    with Captured() as fwd:
        y = block(x, table)
    grad = torch.randn_like(y)
    with Captured() as bwd:
        y.backward(grad)
    model = torchtitan_llama.build(dim=DIM, layers=3, heads=HEADS, kv_heads=KV, hidden=128,
                                   vocab=256, max_seq=S)
    ids = torch.zeros((B, S), dtype=torch.long, device="meta")
    graph = trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)
    kernels = eager_kernels(graph, [n.name for n in graph.nodes], dtype="bf16",
                            precision="fsdp")
    mf, mb = Counter(), Counter()
    for name, op in kernels.items():
        if graph.node(name).layer == 1:  # a middle block: its input's gradient sum included
            mf.update((round(k.read_bytes), round(k.written_bytes), k.path)
                      for k in op.forward + op.weight_forward)
            mb.update((round(k.read_bytes), round(k.written_bytes), k.path)
                      for k in op.backward + op.weight_backward)
    assert mf == Counter(fwd.kernels)
    assert mb == Counter(bwd.kernels)


def test_the_planner_keeps_the_rotary_embedding_sharded():
    """``view_as_complex`` and ``view_as_real`` keep every dimension but the (real, imaginary)
    pair: the intra-op solver shards the complex multiply like its neighbours instead of
    replicating it (the review of DECISIONS 105: with the views unmapped, every shard
    became Replicate there, 11% more for two Llama-8B blocks on 8-way tensor parallelism)."""
    from meshplan.planner.intra import StageOptions, solve_stage
    from meshplan.planner.strategies import _dim_map

    model = torchtitan_llama.build(dim=256, layers=2, heads=8, kv_heads=4, hidden=512,
                                   vocab=512, max_seq=128)
    ids = torch.zeros((8, 128), dtype=torch.long, device="meta")
    graph = trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)
    to_complex = next(n for n in graph.nodes if n.target.startswith("aten.view_as_complex"))
    to_real = next(n for n in graph.nodes if n.target.startswith("aten.view_as_real"))
    assert _dim_map(to_complex, (8, 128, 8, 16, 2), (8, 128, 8, 16)) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert _dim_map(to_real, (8, 128, 8, 16), (8, 128, 8, 16, 2)) == {0: 0, 1: 1, 2: 2, 3: 3}
    hw = meshplan.Mesh.preset("dgx-h100", nodes=1).hardware
    names = tuple(n.name for n in graph.nodes)
    sol = solve_stage(graph, names, (2,), ("tp",), hw, StageOptions(dtype="bf16"))
    rotary = [n.name for n in graph.nodes if n.layer == 0 and n.out is not None
              and n.out.dtype == "complex64" and n.target.startswith("aten.mul")]
    assert rotary and all(sol.ops[n].output != ("R",) for n in rotary)


@pytest.mark.parametrize("kv_heads,copies", [(1, 0), (2, 4)])
def test_a_single_key_head_is_repeated_by_a_view(kv_heads, copies):
    """With one key/value head (multi-query attention) the repeat's reshape merges the
    expanded dimension with a dimension of one: PyTorch views it, no clone (the second
    review of DECISIONS 107); with two it copies. ``materializes`` asks PyTorch."""
    from meshplan.costmodel.kernel_paths import materializes

    model = torchtitan_llama.build(dim=DIM, layers=2, heads=HEADS, kv_heads=kv_heads,
                                   hidden=128, vocab=256, max_seq=S)
    ids = torch.zeros((B, S), dtype=torch.long, device="meta")
    graph = trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)
    assert sum(materializes(graph, n.name) for n in graph.nodes) == copies
    x = torch.randn(B, S, kv_heads, DIM // HEADS)
    repeated = torchtitan_llama.repeat_heads(x, HEADS // kv_heads)
    assert (repeated.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()) == \
        (copies == 0)


def test_fused_rmsnorm_keeps_only_its_input():
    """torchtitan's ``fused_rmsnorm`` (its 2024 A100 runs' ``norm_type``) is one operator
    (``aten.rms_norm``, as ``F.rms_norm`` runs on CUDA: one kernel each way) that keeps its
    bf16 input, where the unfused RMSNorm keeps its fp32 copy (DECISIONS 108): the blocks'
    kept bytes drop by the fp32 chain, and a norm type torchtitan has not is refused."""
    from meshplan.costmodel.stage_layout import stage_activation_profile
    from meshplan.costmodel.hardware import HardwareProfile

    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    kept = {}
    for norm in ("rmsnorm", "fused_rmsnorm"):
        model = torchtitan_llama.build(dim=DIM, layers=2, heads=HEADS, kv_heads=KV, hidden=128,
                                       vocab=256, max_seq=S, norm=norm)
        graph = trace(model, (ids,), example_targets=(ids,), loss_fn=torchtitan_llama.loss)
        norms = [n for n in graph.nodes if n.target.startswith("aten.rms_norm")]
        assert len(norms) == (5 if norm == "fused_rmsnorm" else 0)  # 2 per block + final
        mesh = meshplan.Mesh.from_dict({"shape": [1], "hardware": "dgx-a100-80gb"})
        plan = meshplan.manual_plan(model, mesh, graph=graph, dp=1, dtype="bf16",
                                    engine="torchtitan")
        prof = stage_activation_profile(plan.stages[0], graph,
                                        HardwareProfile.from_dict(plan.mesh.hardware),
                                        dtype="bf16", microbatches=1, seq_len=S,
                                        precision="fsdp")
        kept[norm] = prof.kept[0]
    # per norm, the unfused chain keeps x.float() (4 bytes an element), the cast back that
    # the weight scales (2) and per-row fp32 values (the rsqrt); the fused norm keeps x (2)
    extra = kept["rmsnorm"] - kept["fused_rmsnorm"]
    assert 2 * 4 * B * S * DIM < extra < 2 * (4 * B * S * DIM + 4 * 4 * B * S)
    with pytest.raises(ValueError, match="norm_type"):
        torchtitan_llama.build(dim=DIM, layers=1, heads=HEADS, kv_heads=KV, hidden=128,
                               vocab=256, max_seq=S, norm="layernorm")
