"""Strategy rules: candidates per operator family, DTensor agreement, followers, resharding."""

import json
import subprocess
import sys
import textwrap

import pytest

from meshplan.costmodel.hardware import load_preset
from meshplan.graph import OpGraph, OpKind, OpNode, ParamInfo, TensorMeta
from meshplan.planner.reshard import refused
from meshplan.placements import P, R, placement_str
from meshplan.planner.strategies import enumerate_strategies, follow, op_spec

F32 = "float32"


def _graph(nodes, params=(), inputs=(("x", (8, 16)),)):
    return OpGraph(nodes=tuple(nodes), params=tuple(ParamInfo(n, s, F32) for n, s in params),
                   inputs=tuple((n, TensorMeta(s, F32)) for n, s in inputs),
                   output=nodes[-1].name, layer_fingerprints=())


def _node(name, target, kind, inputs, shape, args="(['%', '%'], {})", params=(), flops=0):
    return OpNode(name=name, target=target, kind=kind, inputs=tuple(inputs),
                  outputs=(TensorMeta(tuple(shape), F32),), flops=flops, params=tuple(params),
                  args_repr=args)


def _cands(graph, node, mesh):
    spec = op_spec(graph, node)
    assert spec is not None, node.target
    return {(tuple(placement_str(p) for p in s.inputs), placement_str(s.output))
            for s in enumerate_strategies(spec, mesh)}


def test_mm_candidates_are_one_einsum_dim_per_axis():
    g = _graph([_node("mm", "aten.mm.default", OpKind.MATMUL, ("x", "w"), (8, 4))],
               params=(("w", (16, 4)),))
    c = _cands(g, g.nodes[0], (2,))
    assert c == {((("R",), ("R",)), ("R",)), ((("S(0)",), ("R",)), ("S(0)",)),
                 ((("R",), ("S(1)",)), ("S(1)",)), ((("S(1)",), ("S(0)",)), ("P",))}
    assert len(_cands(g, g.nodes[0], (2, 2))) == 16


def test_uneven_dims_are_not_split():
    g = _graph([_node("mm", "aten.mm.default", OpKind.MATMUL, ("x", "w"), (8, 3))],
               params=(("w", (16, 3)),))
    outs = {o for _, o in _cands(g, g.nodes[0], (2,))}
    assert ("S(1)",) not in outs  # n = 3 does not divide by 2


def test_linear_bias_joins_a_partial_sum_as_partial():
    g = _graph([_node("lin", "aten.linear.default", OpKind.MATMUL, ("x", "w", "b"), (8, 4),
                      args="(['%', '%', '%'], {})")], params=(("w", (4, 16)), ("b", (4,))))
    c = _cands(g, g.nodes[0], (2,))
    assert ((("S(1)",), ("S(1)",), ("P",)), ("P",)) in c  # row-parallel: bias added once
    assert ((("R",), ("S(0)",), ("S(0)",)), ("S(1)",)) in c  # column-parallel


def test_layer_norm_never_splits_the_normalised_dim():
    g = _graph([_node("ln", "aten.layer_norm.default", OpKind.NORM, ("x", "w"), (8, 16),
                      args="(['%', [16], '%'], {})")], params=(("w", (16,)),))
    outs = {o for _, o in _cands(g, g.nodes[0], (2, 2))}
    assert all("S(1)" not in o for o in outs)
    assert ("S(0)", "S(0)") in outs  # batch split over both axes (sequence-parallel style)


def test_attention_splits_batch_and_heads_only():
    shape = (4, 8, 16, 8)
    g = _graph([_node("attn", "aten.scaled_dot_product_attention.default", OpKind.ATTENTION,
                      ("q", "k", "v"), shape, args="(['%', '%', '%'], {})")],
               inputs=(("q", shape), ("k", shape), ("v", shape)))
    outs = {o for _, o in _cands(g, g.nodes[0], (2,))}
    assert outs == {("R",), ("S(0)",), ("S(1)",)}


def test_embedding_row_split_is_partial_and_loss_splits_batch():
    g = _graph([_node("emb", "aten.embedding.default", OpKind.EMBEDDING, ("w", "ids"), (4, 8, 16))],
               params=(("w", (32, 16)),), inputs=(("ids", (4, 8)),))
    c = _cands(g, g.nodes[0], (2,))
    assert ((("S(0)",), ("R",)), ("P",)) in c and ((("S(1)",), ("R",)), ("S(2)",)) in c
    g2 = _graph([_node("ce", "aten.cross_entropy_loss.default", OpKind.LOSS, ("x", "t"), ())],
                inputs=(("x", (8, 32)), ("t", (8,))))
    assert _cands(g2, g2.nodes[0], (2,)) == {((("R",), ("R",)), ("R",)),
                                             ((("S(0)",), ("S(0)",)), ("P",))}


def test_softmax_reduction_elementwise_and_cat():
    sm = _node("sm", "aten._softmax.default", OpKind.SOFTMAX, ("x",), (8, 16),
               args="(['%', -1, False], {})")
    assert {o for _, o in _cands(_graph([sm]), sm, (2,))} == {("R",), ("S(0)",)}
    red = _node("s", "aten.sum.dim_IntList", OpKind.REDUCTION, ("x",), (8,),
                args="(['%', [1]], {})")
    assert {o for _, o in _cands(_graph([red]), red, (2,))} == {("R",), ("S(0)",), ("P",)}
    add = _node("a", "aten.add.Tensor", OpKind.ELEMENTWISE, ("x", "y"), (8, 16))
    c = _cands(_graph([add], inputs=(("x", (8, 16)), ("y", (16,)))), add, (2,))
    assert ((("S(0)",), ("R",)), ("S(0)",)) in c and ((("S(1)",), ("S(0)",)), ("S(1)",)) in c
    cat = _node("c", "aten.cat.default", OpKind.VIEW, ("x", "y"), (8, 32),
                args="([['%', '%'], 1], {})")
    outs = {o for _, o in _cands(_graph([cat], inputs=(("x", (8, 16)), ("y", (8, 16)))), cat, (2,))}
    assert outs == {("R",), ("S(0)",)}


def test_unknown_elementwise_op_has_no_rule():
    flip = _node("f", "aten.flip.default", OpKind.ELEMENTWISE, ("x",), (8, 16),
                 args="(['%', [0]], {})")
    assert op_spec(_graph([flip]), flip) is None


def test_followers_map_dims_or_gather():
    view = _node("v", "aten.view.default", OpKind.VIEW, ("x",), (2, 4, 16),
                 args="(['%', [2, 4, 16]], {})")
    assert follow(view, (8, 16), (0,), (2,)) == ((0,), (0,))
    assert follow(view, (8, 16), (1,), (2,)) == ((1,), (2,))
    flat = _node("f", "aten.view.default", OpKind.VIEW, ("x",), (64, 16),
                 args="(['%', [-1, 16]], {})")
    assert follow(flat, (4, 16, 16), (1,), (2,)) == ((R,), (R,))  # not the leading dim: gather
    tr = _node("t", "aten.transpose.int", OpKind.VIEW, ("x",), (4, 8, 16), args="(['%', 0, 1], {})")
    assert follow(tr, (8, 4, 16), (0, 2), (2, 2)) == ((0, 2), (1, 2))
    gelu = _node("g", "aten.gelu.default", OpKind.ELEMENTWISE, ("x",), (8, 16), args="(['%'], {})")
    assert follow(gelu, (8, 16), (P,), (2,)) == ((R,), (R,))  # not linear: reduce first
    scale = _node("m", "aten.mul.Tensor", OpKind.ELEMENTWISE, ("x",), (8, 16), args="(['%', 0.5], {})")
    assert follow(scale, (8, 16), (P,), (2,)) == ((P,), (P,))


def test_resharding_costs_follow_the_collectives():
    """The ILP prices an edge with the estimate's own function (one pricer); DTensor's
    refusals stay the planner's."""
    from meshplan.costmodel.comm import Collective, collective_time_s
    from meshplan.costmodel.comm import CollectivePrices
    from meshplan.costmodel.operators import input_collectives
    from meshplan.plan import Stage

    hw = load_preset("dgx-a100-80gb")
    coll = CollectivePrices(Stage(0, tuple(range(8)), (8,), ("d0",), (0, 0), ("", "")), hw,
                            backend="nccl")
    nb = 1 << 20

    def fwd_bwd(src, dst, out=("R",)):
        return sum(f for _, f, _ in input_collectives(coll, (8,), nb, src, dst, out, grad=True)), \
            sum(b for _, _, b in input_collectives(coll, (8,), nb, src, dst, out, grad=True))

    ag = collective_time_s(hw, Collective.ALL_GATHER, nb, 8)
    ar = min(collective_time_s(hw, Collective.ALL_REDUCE, nb, 8),
             collective_time_s(hw, Collective.ALL_REDUCE, nb, 8, tree=True))
    rs = collective_time_s(hw, Collective.REDUCE_SCATTER, nb, 8)
    assert fwd_bwd(("S(0)",), ("R",)) == (ag, rs)
    assert fwd_bwd(("P",), ("R",)) == (ar, 0.0)
    assert fwd_bwd(("P",), ("S(1)",)) == (rs, ag)
    assert fwd_bwd(("R",), ("S(0)",)) == (0.0, ag)
    # Megatron's f: identity forward, all-reduce of the partial input grad backward
    assert fwd_bwd(("R",), ("R",), out=("S(1)",)) == (0.0, ar)
    assert refused((0,), (P,)) and refused((R,), (P,))  # DTensor cannot / refuses
    assert not refused((P,), (R,)) and not refused((0,), (R,))


_DTENSOR_SCRIPT = textwrap.dedent("""
    import json, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, OpSpec
    mesh = init_device_mesh("cpu", (2, 2))
    funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    aten = torch.ops.aten
    def arg(shape):
        t = torch.empty(shape)
        return OpStrategy([OpSpec(DTensorSpec(mesh, (Replicate(), Replicate()),
                                              TensorMeta(t.shape, t.stride(), t.dtype)))])
    def name(p):
        return "R" if p.is_replicate() else "P" if p.is_partial() else f"S({p.dim})"
    out = {}
    for op, shapes in (("mm", [(8, 8), (8, 8)]), ("bmm", [(4, 8, 8), (4, 8, 8)]),
                       ("addmm", [(8,), (8, 8), (8, 8)])):
        o = getattr(aten, op).default
        res = funcs[o](OpSchema(o, tuple(arg(s) for s in shapes), {}))
        out[op] = sorted([[list(map(name, s.output_spec.placements))] +
                          [list(map(name, i.placements)) for i in s.input_specs]
                          for s in res.strategies])
    print(json.dumps(out))
""")


def test_matmul_candidates_equal_dtensors_registered_strategies():
    """DTensor's own rules (fake process group, in a child process so no global state leaks)."""
    proc = subprocess.run([sys.executable, "-c", _DTENSOR_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(proc.stderr[-2000:])
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    shapes = {"mm": [(8, 8), (8, 8)], "bmm": [(4, 8, 8), (4, 8, 8)],
              "addmm": [(8,), (8, 8), (8, 8)]}
    for op, ins in shapes.items():
        names = [f"i{k}" for k in range(len(ins))]
        out = (4, 8, 8) if op == "bmm" else (8, 8)
        node = _node(op, f"aten.{op}.default", OpKind.MATMUL, names, out,
                     args=repr((["%"] * len(ins), {})))
        g = _graph([node], inputs=tuple(zip(names, ins)))
        ours = sorted([[list(o)] + [list(i) for i in inp]
                       for inp, o in _cands(g, node, (2, 2))])
        assert ours == theirs[op], op
