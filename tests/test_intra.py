"""The intra-op planner end to end: closed forms (data parallel, Megatron, ZeRO-3, 2-D and
3-D sharding), memory errors, fallbacks, layer sharing, the stage cache, alternatives, and
single-stage plans (autoparallel's ILP candidate)."""

import warnings

import pytest
import torch
import torch.nn as nn

import meshplan
from meshplan.costmodel.comm import Collective, collective_time_s
from meshplan.costmodel.hardware import load_preset
from meshplan.errors import MemoryLimitError
from meshplan.plan import Plan
from meshplan.planner.intra import StageCache, StageOptions, build_problem, solve_stage
from meshplan.planner.singlestage import alternatives, plan_single_stage
from meshplan.tracing import trace

HW = load_preset("dgx-a100-80gb")
MIB = 2.0 ** -10  # GiB per MiB


def _square_mean(out, *inputs):
    return out.square().mean()


class MLP(nn.Module):
    def __init__(self, width, hidden, act=True):
        super().__init__()
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.act = act

    def forward(self, x):
        h = self.up(x)
        return self.down(torch.nn.functional.gelu(h) if self.act else h)


def _graph(model, tokens, width):
    with torch.device("meta"):
        x = torch.zeros(tokens, width)
    return trace(model, (x,), loss_fn=_square_mean)


def _solve(graph, mesh, limit_gib=None, **kw):
    names = tuple(n.name for n in graph.nodes)
    return solve_stage(graph, names, mesh, tuple(f"d{i}" for i in range(len(mesh))), HW,
                       StageOptions(memory_limit_gib=limit_gib, dtype="fp32", **kw),
                       devices_per_node=8)


def _linears(graph):
    return [n for n in graph.nodes if n.target == "aten.linear.default"]


@pytest.fixture(scope="module")
def dp_graph():
    with torch.device("meta"):
        model = MLP(1024, 1024)
    return _graph(model, 65536, 1024)


def test_ample_memory_gives_data_parallel_with_one_flat_all_reduce(dp_graph):
    """The graph engine all-reduces every gradient in one flat buffer (estimate's
    ``RuntimeModel.flat_grad_sync``): one latency, not one per parameter."""
    sol = _solve(dp_graph, (8,))
    assert all(pl == ("R",) for pl in sol.params.values())
    for n in _linears(dp_graph):
        assert sol.ops[n.name].output == ("S(0)",)
    expected = collective_time_s(HW, Collective.ALL_REDUCE,
                                 sum(p.numel * 4 for p in dp_graph.params), 8)
    assert sol.comm_s == pytest.approx(expected, rel=1e-9)


def test_wide_mlp_with_tight_memory_gets_megatron_column_then_row():
    with torch.device("meta"):
        model = MLP(1024, 16384)
    g = _graph(model, 64, 1024)
    sol = _solve(g, (8,), limit_gib=0.15)  # replicated weights need 0.5 GiB
    up, down = _linears(g)
    assert sol.params["up.weight"] == ("S(0)",)  # column-parallel (Linear weight is out x in)
    assert sol.params["down.weight"] == ("S(1)",)  # row-parallel
    assert sol.ops[up.name].output == ("S(1)",)
    assert sol.ops[down.name].inputs[0] == ("S(1)",) and sol.ops[down.name].output == ("P",)


def test_parameters_larger_than_memory_get_zero3():
    with torch.device("meta"):
        model = MLP(4096, 4096, act=False)
    g = _graph(model, 65536, 4096)
    ample = _solve(g, (8,), zero=0)  # replicated weights: what a limit below must shard
    weights = ample.memory.params_gib + ample.memory.grads_gib + ample.memory.optimizer_gib
    sol = _solve(g, (8,), limit_gib=ample.memory.total_gib - 0.6 * weights)
    for n in _linears(g):
        w = n.params[0]
        consumed = sol.ops[n.name].inputs[n.inputs.index(w)]
        assert consumed == ("R",) and sol.params[w] != ("R",), (w, consumed, sol.params[w])
        assert sol.ops[n.name].output == ("S(0)",)  # the batch stays split: ZeRO-3 data parallel


def test_tight_memory_on_a_2x2_mesh_shards_weights_on_both_axes():
    with torch.device("meta"):
        model = MLP(1024, 16384)
    g = _graph(model, 64, 1024)
    sol = _solve(g, (2, 2), limit_gib=0.15)
    for name, pl in sol.params.items():
        assert "R" not in pl, (name, pl)


def test_impossible_memory_raises_with_the_smallest_need(dp_graph):
    with pytest.raises(MemoryLimitError) as err:
        _solve(dp_graph, (8,), limit_gib=1e-3)
    need = err.value.min_memory_gib
    assert f"{need:.4g} GiB" in str(err.value)
    sol = _solve(dp_graph, (8,), limit_gib=need * 1.0001)  # the bound is tight
    assert sol.memory.total_gib <= need * 1.0001


def test_operator_without_rule_is_replicated_with_a_warning():
    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64)

        def forward(self, x):
            return self.lin(torch.flip(x, dims=(1,)))
    with torch.device("meta"):
        g = _graph(Flip(), 64, 64)
    flip = next(n for n in g.nodes if n.target.startswith("aten.flip"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sol = _solve(g, (2,))
    assert any(flip.name in str(w.message) for w in caught)
    assert any(flip.name in note for note in sol.solver.notes)
    assert sol.ops[flip.name].output == ("R",)


GPT = "transformers:gpt2?n_layer={}&n_embd=64&n_head=4&vocab_size=256&n_positions=64"


def _gpt(layers, batch=8, seq=64):
    from meshplan.specs import example_inputs, parse_model_spec
    model = parse_model_spec(GPT.format(layers)).build("meta")
    return model, example_inputs(model, batch, seq)


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = _gpt(2)
    mesh = meshplan.Mesh.preset("dgx-a100-80gb", nodes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_single_stage(trace(model, inputs), mesh, time_limit_s=20)


def test_identical_layers_share_one_set_of_variables():
    sizes = []
    for layers in (2, 6):
        model, inputs = _gpt(layers)
        g = trace(model, inputs)
        names = tuple(n.name for n in g.nodes)
        p = build_problem(g, names, (2, 4), HW, StageOptions(), devices_per_node=8)
        sizes.append((len(p.groups), len(p.edges)))
        sol = _solve(g, (4,))
        layer0 = [n.name for n in g.nodes if n.layer == 0]
        last = [n.name for n in g.nodes if n.layer == layers - 1]
        assert [sol.ops[a] for a in layer0] == [sol.ops[b] for b in last]
    assert sizes[0] == sizes[1]


def test_single_stage_plan_lists_every_parameter_and_operator(gpt_plan):
    plan = gpt_plan
    stage = plan.stages[0]
    assert set(stage.params) == {p.name for p in plan.graph.params}
    assert set(stage.ops) == {n.name for n in plan.graph.nodes}
    assert plan.solver.status == "optimal" and plan.solver.gap == 0.0
    again = Plan.from_json_text(plan.to_json_text())
    assert again.to_json_text() == plan.to_json_text()


def test_autoparallel_is_byte_identical_and_honours_the_memory_limit(gpt_plan):
    model, inputs = _gpt(2)
    mesh = meshplan.Mesh.preset("dgx-a100-80gb", nodes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_single_stage(trace(model, inputs), mesh, time_limit_s=20)
        assert plan.to_json_text() == gpt_plan.to_json_text()
        with pytest.raises(MemoryLimitError):
            meshplan.autoparallel(model, mesh, inputs, memory_limit_gib=1e-5)


def test_stage_cache_answers_equal_stages_once():
    model, inputs = _gpt(4)
    g = trace(model, inputs)
    cache = StageCache()
    opts = StageOptions(batch_fraction=0.5, microbatches=2)
    first = [n.name for n in g.nodes if n.layer == 1]
    second = [n.name for n in g.nodes if n.layer == 2]
    a = solve_stage(g, first, (4,), ("tp",), HW, opts, cache=cache)
    b = solve_stage(g, second, (4,), ("tp",), HW, opts, cache=cache)
    assert len(cache) == 1
    assert a.time_s == b.time_s and set(b.ops) == set(second)
    assert [a.ops[x] for x in first] == [b.ops[y] for y in second]
    assert a.time_s == pytest.approx(2 * a.microbatch_s + a.step_s)


def test_alternatives_explain_why_each_candidate_lost(gpt_plan):
    node = next(n.name for n in gpt_plan.graph.nodes if n.target == "aten.addmm.default")
    alts = alternatives(gpt_plan, node)
    assert sum(a.chosen for a in alts) == 1 and alts[0].chosen and alts[0].delta_s == 0.0
    assert len(alts) > 1
    for a in alts[1:]:
        assert a.reason
        # the plan is optimal: no single swap that stays within memory is faster
        if a.memory_gib <= gpt_plan.predicted.memory_capacity_gib and a.delta_s != float("inf"):
            assert a.delta_s >= -1e-9


def test_three_dimensional_mesh():
    with torch.device("meta"):
        model = MLP(1024, 16384)
    g = _graph(model, 64, 1024)
    sol = _solve(g, (2, 2, 2), limit_gib=0.1)
    assert sol.solver.status == "optimal"
    assert all(len(pl) == 3 for pl in sol.params.values())
    assert sol.memory.total_gib <= 0.1
    assert any(sum(p != "R" for p in pl) >= 2 for pl in sol.params.values())


def test_space_contains_sequence_parallel_and_zero3_candidates():
    model, inputs = _gpt(2)
    g = trace(model, inputs)
    names = tuple(n.name for n in g.nodes)
    p = build_problem(g, names, (4,), HW, StageOptions(), devices_per_node=8)
    by_target = {}
    for grp in p.groups:
        if grp.anchor in g:
            by_target.setdefault(g.node(grp.anchor).target, []).append(grp)
    seq = (1,)  # Shard(1): the sequence dim of (batch, seq, hidden) activations
    assert any(c.member_outputs[0] == seq for grp in by_target["aten.layer_norm.default"]
               for c in grp.candidates)
    assert any(c.member_outputs[0] == seq for grp in by_target["aten.dropout.default"]
               for c in grp.candidates)
    assert any(c.zero3 for grp in by_target["aten.addmm.default"] for c in grp.candidates)


def test_zero_levels_trade_memory_for_communication(dp_graph):
    sols = [_solve(dp_graph, (8,), zero=z) for z in (0, 1, 2)]
    opt = [s.memory.optimizer_gib for s in sols]
    grads = [s.memory.grads_gib for s in sols]
    assert opt[1] == pytest.approx(opt[0] / 8) and grads[1] == pytest.approx(grads[0])
    # the graph engine accumulates ZeRO-2 gradients full-size, reduce-scattered once a step
    assert grads[2] == pytest.approx(grads[0])
    assert sols[1].comm_s > sols[0].comm_s  # the stepped weights are gathered again
    assert sols[2].comm_s < sols[1].comm_s  # a reduce-scatter instead of an all-reduce
    assert all(pl == ("R",) for s in sols for pl in s.params.values())
