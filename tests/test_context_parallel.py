"""Context parallelism (cp): the load-balanced layout, its refusals, and runs on 4 gloo
processes against one process.

One torchrun launch of 4 processes (this file is the worker) trains each case two Adam
steps and saves its losses and the second step's gradients (full tensors); the tests
compare them with the plain model in this process (tests/harness/equivalence.py's rule):
a tiny transformers Llama
(RoPE, grouped-query attention) under cp=4, cp2 x dp2, cp2 x tp2, cp2 x pp2 and cp2 x dp2
with full recompute and ZeRO-1, a tiny GPT-2 (learned positions) under cp=4, cp2 x dp2 and
cp2 x tp2, and a tiny Mistral (sliding-window mask) under cp2 x dp2.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.harness.equivalence import layout

LLAMA = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
         "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&max_position_embeddings=64")
GPT2 = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
# a sliding-window mask (window 6 < chunk boundaries at 4, 8, 12): built from positions too
MISTRAL = ("transformers:mistral?hidden_size=64&intermediate_size=128&num_hidden_layers=2&"
           "num_attention_heads=4&num_key_value_heads=2&vocab_size=256&"
           "max_position_embeddings=64&sliding_window=6")
BATCH, SEQ, STEPS, LR, SEED = 4, 16, 2, 1e-3, 0

CASES = {  # case -> (model, manual_plan options: a layout of tests/harness/equivalence.py)
    "llama-cp4": (LLAMA, layout("cp4")),
    "llama-cp2xdp2": (LLAMA, layout("cp2xdp2")),
    "llama-cp2xtp2": (LLAMA, layout("cp2xtp2")),
    "llama-cp2xpp2": (LLAMA, layout("cp2xpp2+mb2")),
    "gpt2-cp4": (GPT2, layout("cp4")),
    "gpt2-cp2xdp2": (GPT2, layout("cp2xdp2")),
    # recompute re-runs the exchange inside each block; ZeRO-1 shards over dp, not cp
    "llama-cp2xdp2-full-zero1": (LLAMA, layout("cp2xdp2+full+zero1")),
    "gpt2-cp2xtp2": (GPT2, layout("cp2xtp2")),
    "mistral-cp2xdp2": (MISTRAL, layout("cp2xdp2")),
}


def build(spec: str, device: str = "cpu"):
    from meshplan.specs import parse_model_spec

    torch.manual_seed(SEED)
    return parse_model_spec(spec).build(device=device)


def batches(model) -> list[torch.Tensor]:
    from meshplan.specs import synthetic_batch

    return [synthetic_batch(model, BATCH, SEQ, seed=SEED, step=s) for s in range(STEPS)]


def run_case(case: str) -> dict:
    import torch.distributed as dist

    import meshplan
    from meshplan.mesh import Mesh
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph

    spec, degrees = CASES[case]
    meta = build(spec, "meta")
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    plan = meshplan.manual_plan(meta, Mesh.local(dist.get_world_size()), (ids,), dtype="fp32",
                                **degrees)
    model = build(spec)
    data = batches(model)
    pm = parallelize_graph(model, plan, (data[0],))
    opt = make_optimizer(pm.optimizer_params(), plan, lr=LR)
    losses, grads = [], {}
    for step, b in enumerate(data):
        last = step == STEPS - 1
        if plan.num_stages > 1:
            losses.append(pm.forward_backward(b))
            grads = pm.full_grads() if last else grads
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            losses.append(pm.train_step(b, opt, grads_out=grads if last else None))
    return {"losses": losses, "grads": grads, "engine": plan.engine,
            "axes": dict(zip(plan.stages[0].axis_names, plan.stages[0].mesh_shape))}


def expected(case: str):
    """The plain model in one process (tests/harness/equivalence.py): fp32, and fp64 for
    the tolerance."""
    from meshplan.tracing import TrainingModule
    from tests.harness.equivalence import expected as reference

    spec, _ = CASES[case]
    return reference(lambda: build(spec), batches(build(spec)),
                     lambda model, b: TrainingModule(model)(b),
                     optimizer=lambda params: torch.optim.Adam(params, lr=LR, foreach=False))


def worker(out: str, cases) -> None:
    import logging
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for case in cases:
        try:
            results[case] = run_case(case)
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the rest
            results[case] = {"error": f"{type(exc).__name__}: {exc}"[-2000:],
                             "traceback": traceback.format_exc()[-4000:]}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


# -- pure: the layout and the refusals ---------------------------------------------------------

def test_layout_gives_each_rank_a_head_and_a_tail_chunk():
    from meshplan.context import causal_work, layout_order, rank_chunks

    assert rank_chunks(16, 4, 0) == ((0, 2), (14, 16))
    assert rank_chunks(16, 4, 3) == ((6, 8), (8, 10))
    assert sorted(layout_order(16, 4)) == list(range(16))
    assert layout_order(8, 2) == [0, 1, 6, 7, 2, 3, 4, 5]
    # causal work per rank is equal under the layout (contiguous chunks would give 1:3:5:7)
    work = causal_work(1024, 4)
    assert len(set(work)) == 1 and sum(work) == 1024 * 1025 // 2


class _NoAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32)

    def forward(self, ids):
        return self.out(torch.relu(self.emb(ids)))


class _CausalFlag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = (torch.nn.Embedding(32, 8), torch.nn.Linear(8, 24),
                                        torch.nn.Linear(8, 32))

    def forward(self, ids):
        q, k, v = self.qkv(self.emb(ids)).unsqueeze(1).chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.squeeze(1))


def _plan(model, seq, **kw):
    import meshplan
    from meshplan.mesh import Mesh

    with torch.device("meta"):
        m = model() if isinstance(model, type) else build(model, "meta")
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return meshplan.manual_plan(m, Mesh.local(4), (ids,), dtype="fp32", **kw)


def test_bad_input_gets_one_line_each():
    from meshplan.errors import MeshplanError, NotSupportedError, PlanningError

    with pytest.raises(PlanningError, match=r"sequence length 12 is not divisible by 2 x cp = 8"):
        _plan(LLAMA, 12, cp=4)
    with pytest.raises(PlanningError, match=r"cp=4 .* has no attention operator"):
        _plan(_NoAttention, 16, cp=4)
    with pytest.raises(PlanningError, match=r"recompute 'selective' with cp=4"):
        _plan(LLAMA, 16, cp=4, recompute="selective")
    # sequence parallelism inside tp and is_causal=True run on the module engine (torch's
    # context_parallel, tests/test_cp_modules.py); the graph engine refuses them
    assert _plan(LLAMA, 16, cp=2, tp=2, sequence_parallel=True).engine == "modules"
    assert _plan(_CausalFlag, 16, cp=4).engine == "modules"
    with pytest.raises(NotSupportedError, match=r"operator scaled_dot_product_attention at .*"
                       r"test_context_parallel.py:\d+ uses is_causal=True"):
        _plan(_CausalFlag, 16, cp=4, engine="graph")
    for exc in (PlanningError, NotSupportedError):
        assert issubclass(exc, MeshplanError)


def test_plan_records_the_cp_axis_and_round_trips():
    from meshplan.plan import Plan

    plan = _plan(LLAMA, 16, cp=2, dp=2)
    st = plan.stages[0]
    assert st.axis_names == ("dp", "cp") and st.mesh_shape == (2, 2) and plan.engine == "modules"
    attn = st.ops["scaled_dot_product_attention"]
    assert attn.inputs[0] == ("S(0)", "S(2)") and attn.inputs[1][1] == "R"  # Q split, K gathered
    assert attn.inputs[3][1] == "S(2)"  # the mask's query rows follow the layout
    assert all(p[1] == "R" for p in st.params.values())  # weights replicated over cp
    again = Plan.from_json_text(plan.to_json_text())
    assert again.stages[0].ops == st.ops
    from meshplan.inspect import summary_text

    text = summary_text(again, width=400)  # what meshplan show prints, unwrapped
    assert "rank 0: [0, 4) + [12, 16); rank 1: [4, 8) + [8, 12)" in text and "(dp,cp)" in text


def test_support_rules_refuse_a_cp_plan_they_cannot_run():
    from dataclasses import replace

    from meshplan.support import Candidate, candidate_problems, plan_problems

    assert candidate_problems(Candidate(cp=4, seq_len=20, global_batch=1))[0].startswith(
        "sequence length 20 is not divisible by 2 x cp = 8")
    assert not candidate_problems(Candidate(cp=4, seq_len=32, global_batch=1))
    plan = _plan(LLAMA, 16, cp=4)
    assert not plan_problems(plan)
    assert not plan_problems(replace(plan, engine="modules"))  # single stage: either engine
    piped = _plan(LLAMA, 16, cp=2, pp=2, microbatch_size=1)
    assert piped.engine == "modules" and not plan_problems(piped)


def test_cost_of_the_exchange_and_the_split_work_closed_form():
    """cp=8 on one DGX H100 node (cp only): the exposed communication of a microbatch is an
    all-gather forward for every value gathered over cp (K and V of each layer, the logits
    before the shifted loss), and one all-reduce backward of the partial gradient of those
    that split operators read (K and V; the loss reads the logits whole, so every rank has
    their whole gradient and keeps its chunk); split operators cost 1/8 of their work."""
    from meshplan.costmodel.comm import Collective, collective_time_s
    from meshplan.costmodel.compute import op_time
    from meshplan.costmodel.estimate import stage_cost
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace

    graph = trace(build(LLAMA, "meta"), (torch.zeros(1, 64, dtype=torch.long, device="meta"),))
    mesh = Mesh.preset("dgx-h100", nodes=1)
    plan = _plan_on(graph, mesh, cp=8)
    st, hw = plan.stages[0], mesh.hardware
    assert st.axis_names == ("cp",)
    gathered = []
    for name, op in st.ops.items():
        for src, want in zip(graph.node(name).inputs, op.inputs):
            if src in st.ops and st.ops[src].output[0].startswith("S") and want[0] == "R":
                gathered.append(src)
    assert len(gathered) == 2 * 2 + 1  # K, V of 2 layers, and the logits
    expect = 0.0
    for src in gathered:
        out = graph.node(src).out
        nbytes = out.numel * 2  # bf16
        expect += collective_time_s(hw, Collective.ALL_GATHER, nbytes, 8)
        if out.shape[-1] != 256:  # K or V, not the logits (vocabulary 256)
            expect += collective_time_s(hw, Collective.ALL_REDUCE, nbytes, 8)
    # one kernel per operator (compute.op_time), the closed form below; the eager kernels
    # (costmodel/eager.py) split the same way (tests/test_eager_kernels.py)
    from dataclasses import replace

    from meshplan.costmodel.estimate import default_runtime

    runtime = replace(default_runtime(hw), eager_kernels=False)
    cost = stage_cost(st, graph, hw, dtype="bf16", optimizer="adam", seq_len=64,
                      processes_on_host=8, runtime=runtime)
    assert cost.comm_s == pytest.approx(expect, rel=1e-9)
    # compute: every operator split on cp is charged 1/8 of its work (the layout makes the
    # causal attention work of the ranks equal, test_layout_...), the others whole
    from meshplan.costmodel.compute import contention_factor

    c = contention_factor(hw, 8)
    expect_fwd = sum(op_time(graph.node(n), hw, "bf16", 8 if op.output and op.output[0] != "R"
                             else 1, contention=c).forward_s for n, op in st.ops.items())
    assert cost.forward_s == pytest.approx(expect_fwd, rel=1e-9)
    attention = graph.node("scaled_dot_product_attention")
    assert st.ops[attention.name].output == ("S(2)",)
    assert op_time(attention, hw, "bf16", 8).forward_s < op_time(attention, hw, "bf16", 1).forward_s


def _plan_on(graph, mesh, **kw):
    from meshplan.planner.manual import build_manual_plan

    return build_manual_plan(graph, mesh, dtype="bf16", **kw)


def test_search_considers_cp_and_beats_every_uniform_manual_plan():
    """The exact pipeline search (eps=0) over dp x cp x tp x pp against brute force over the
    uniform manual plans of the same space: at 2 sequences of 8,192 tokens on 8 GPUs the
    batch feeds only 2 data-parallel ranks, and the best layout splits the sequence."""
    import itertools

    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.planner.hybrid import search_space
    from meshplan.planner.stagecost import plan_hybrid
    from meshplan.tracing import trace
    from meshplan.support import plan_problems

    spec = ("transformers:llama?hidden_size=128&intermediate_size=256&num_hidden_layers=2&"
            "num_attention_heads=8&num_key_value_heads=4&vocab_size=512&"
            "max_position_embeddings=8192")
    graph = trace(build(spec, "meta"), (torch.zeros(2, 8192, dtype=torch.long, device="meta"),))
    mesh = Mesh.preset("dgx-h100", nodes=1)
    space = search_space(schedules=("1f1b",), recompute=("none",), zero=(0,), eps=0.0,
                         context_parallel=(1, 2, 4, 8))
    auto = plan_hybrid(graph, mesh, dtype="bf16", space=space)
    best = None
    for dp, cp, tp, pp in itertools.product((1, 2), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2)):
        if dp * cp * tp * pp != 8:
            continue
        manual = build_manual_plan(graph, mesh, dp=dp, cp=cp, tp=tp, pp=pp, dtype="bf16",
                                   microbatch_size=1, schedule="1f1b")
        if plan_problems(manual):
            continue  # one microbatch cannot feed two 1F1B rank groups: the search skips it
        assert auto.predicted.step_time_s <= manual.predicted.step_time_s * 1.01, (dp, cp, tp, pp)
        if best is None or manual.predicted.step_time_s < best[0]:
            best = (manual.predicted.step_time_s, (dp, cp, tp, pp))
    assert best[1][1] > 1  # splitting the sequence wins here...
    assert "cp" in auto.stages[0].axis_names  # ...and the search finds it
    assert auto.predicted.step_time_s == pytest.approx(best[0], rel=0.02)
    without = plan_hybrid(graph, mesh, dtype="bf16", space=search_space(
        schedules=("1f1b",), recompute=("none",), zero=(0,), eps=0.0))
    assert "cp" not in without.stages[0].axis_names
    assert without.predicted.step_time_s > auto.predicted.step_time_s


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import forked_results

    return forked_results(__file__, tmp_path_factory.mktemp("cp") / "results.pt", nproc=4)


@pytest.mark.parametrize("case", list(CASES))
def test_cp_matches_single_process(results, case):
    got = results[case]
    assert "error" not in got, got.get("traceback")
    # run on the graph engine (runtime/graph/parallelize.parallelize_graph), whichever engine
    # the plan names
    assert got["axes"]["cp"] == CASES[case][1]["cp"]
    # each step's loss, the last step's gradients (tied names once or under each name)
    from tests.harness.equivalence import assert_equivalent
    assert_equivalent({"losses": got["losses"], "grads": {STEPS - 1: got["grads"]}},
                      expected(case), case, fields=("losses", "grads"), grad_names="either")


if __name__ == "__main__":
    import os
    worker(sys.argv[1], os.environ.get("CP_CASES", ",".join(CASES)).split(","))
