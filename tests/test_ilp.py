"""The ILP is exact: on random problems and on random small graphs x meshes, its objective
equals brute-force enumeration of every strategy combination."""

import math
from dataclasses import replace

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.costmodel.hardware import load_preset
from meshplan.planner import ilp
from meshplan.graph import OpGraph, OpKind, OpNode, ParamInfo, TensorMeta
from meshplan.planner.intra import StageOptions, build_problem, to_ilp

F32 = "float32"
HW = load_preset("dgx-a100-80gb")


# -- random integer programs -------------------------------------------------------------------

@st.composite
def problems(draw):
    n = draw(st.integers(2, 4))
    nodes = []
    for v in range(n):
        k = draw(st.integers(1, 4))
        nodes.append(ilp.IlpNode(f"n{v}", tuple(draw(st.integers(0, 50)) for _ in range(k)),
                                 tuple(draw(st.integers(0, 10)) for _ in range(k))))
    edges = []
    for _ in range(draw(st.integers(0, 4))):
        u = draw(st.integers(0, n - 1))
        v = draw(st.integers(0, n - 1))
        cu = max(1, draw(st.integers(1, 3)))
        cv = max(1, draw(st.integers(1, 3)))
        uc = tuple(draw(st.integers(0, cu - 1)) for _ in nodes[u].cost)
        vc = tuple(draw(st.integers(0, cv - 1)) for _ in nodes[v].cost)
        cost = tuple(tuple(draw(st.one_of(st.none(), st.integers(0, 40))) for _ in range(cv))
                     for _ in range(cu))
        edges.append(ilp.IlpEdge(u, v, uc, vc, cost))
    limit = draw(st.one_of(st.none(), st.integers(0, 30)))
    # fixed charges (paid once if any member is chosen) and switches that exclude each other
    flags = []
    for i in range(draw(st.integers(0, 3))):
        members = tuple(sorted({(v, draw(st.integers(0, len(nodes[v].cost) - 1)))
                                for v in draw(st.lists(st.integers(0, n - 1), min_size=1,
                                                       max_size=3))}))
        flags.append(ilp.IlpFlag(f"f{i}", draw(st.integers(0, 30)), members))
    conflicts = tuple((f, g) for f in range(len(flags)) for g in range(f + 1, len(flags))
                      if draw(st.booleans()))
    return ilp.IlpProblem(tuple(nodes), tuple(edges), limit, tuple(flags), conflicts)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_random_programs_match_brute_force(problem):
    best, _ = ilp.brute_force(problem)
    result = ilp.solve(problem, backend="cbc", time_limit_s=10, hint=ilp.greedy(problem))
    if best is None:
        assert result.status == "infeasible"
    else:
        assert result.status == "optimal"
        assert result.objective == best
        assert ilp.evaluate(problem, result.choice) == best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_cp_sat_and_highs_agree_with_brute_force(problem):
    best, _ = ilp.brute_force(problem)
    for backend in ("cp-sat", "highs"):
        result = ilp.solve(problem, backend=backend, time_limit_s=10,
                           hint=ilp.greedy(problem))
        assert (result.objective if result.status != "infeasible" else None) == best, backend


def test_min_memory_is_the_smallest_feasible_limit():
    nodes = (ilp.IlpNode("a", (5, 1), (1, 4)), ilp.IlpNode("b", (3, 0), (2, 6)))
    p = ilp.IlpProblem(nodes, (), memory_limit=ilp.min_memory(ilp.IlpProblem(nodes, ())))
    assert ilp.min_memory(p) == 3
    assert ilp.solve(p).objective == 8
    assert ilp.solve(replace(p, memory_limit=2)).status == "infeasible"


# -- random small graphs on random meshes -----------------------------------------------------------

def _node(name, target, kind, inputs, shape, args, params=(), flops=0, nbytes=0):
    return OpNode(name=name, target=target, kind=kind, inputs=tuple(inputs),
                  outputs=(TensorMeta(tuple(shape), F32),), flops=flops, params=tuple(params),
                  args_repr=args, bytes_read=nbytes, bytes_written=nbytes)


def random_graph(ops: list[str], m: int, width: int) -> OpGraph:
    """A chain of linear / gelu / layer_norm / residual-add ops ending in a sum (the loss)."""
    nodes, params = [], []
    cur, cur_w, history = "inputs_0", width, []
    for i, op in enumerate(ops):
        name = f"{op}_{i}"
        if op == "linear":
            n = width * 2 if cur_w == width else width
            params.append(ParamInfo(f"w{i}", (n, cur_w), F32))
            nodes.append(_node(name, "aten.linear.default", OpKind.MATMUL, (cur, f"w{i}"),
                               (m, n), "(['%', '%'], {})", (f"w{i}",), flops=2 * m * n * cur_w,
                               nbytes=4 * m * n))
            cur_w = n
        elif op == "gelu":
            nodes.append(_node(name, "aten.gelu.default", OpKind.ELEMENTWISE, (cur,), (m, cur_w),
                               "(['%'], {})", nbytes=4 * m * cur_w))
        elif op == "norm":
            params.append(ParamInfo(f"g{i}", (cur_w,), F32))
            nodes.append(_node(name, "aten.layer_norm.default", OpKind.NORM, (cur, f"g{i}"),
                               (m, cur_w), f"(['%', [{cur_w}], '%'], {{}})", (f"g{i}",),
                               nbytes=4 * m * cur_w))
        else:  # residual add with the latest tensor of the same width
            other = next((h for h, w in reversed(history) if w == cur_w and h != cur), None)
            if other is None:
                continue
            nodes.append(_node(name, "aten.add.Tensor", OpKind.ELEMENTWISE, (cur, other),
                               (m, cur_w), "(['%', '%'], {})", nbytes=4 * m * cur_w))
        history.append((cur, cur_w))
        cur = name
    nodes.append(_node("loss", "aten.sum.default", OpKind.REDUCTION, (cur,), (), "(['%'], {})",
                       nbytes=4 * m * cur_w))
    return OpGraph(nodes=tuple(nodes), params=tuple(params),
                   inputs=(("inputs_0", TensorMeta((m, width), F32)),), output="loss",
                   layer_fingerprints=())


@st.composite
def graphs_and_meshes(draw):
    mesh = draw(st.sampled_from([(2,), (4,), (2, 2)]))
    longest = 3 if len(mesh) == 1 else 2
    ops = draw(st.lists(st.sampled_from(["linear", "gelu", "norm", "residual"]),
                        min_size=1, max_size=longest))
    m = draw(st.sampled_from([4, 8, 1024]))
    width = draw(st.sampled_from([4, 8, 2048]))
    return random_graph(ops, m, width), mesh, draw(st.floats(0.0, 1.0))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs_and_meshes())
def test_random_graphs_match_brute_force(case):
    graph, mesh, tightness = case
    names = tuple(n.name for n in graph.nodes)
    problem = to_ilp(build_problem(graph, names, mesh, HW, StageOptions(dtype="fp32"),
                                   devices_per_node=8))
    # a memory limit between the most frugal choice and the most generous one
    lo = ilp.min_memory(problem)
    hi = sum(max(n.memory) for n in problem.nodes)
    problem = replace(problem, memory_limit=int(lo + tightness * (hi - lo)))
    assume(math.prod(len(n.cost) for n in problem.nodes) <= 20000)
    best, _ = ilp.brute_force(problem)
    result = ilp.solve(problem, time_limit_s=20)
    assert result.status == "optimal"
    assert result.objective == best
