"""Every sharding strategy the planner can emit is executable: one operator at a time.

trace -> cost -> solve -> plan -> **run**. For each rule of planner/strategies.py (the
einsum-style rules of ``op_spec``, and the follower rule of views) this takes the first
operator of the traced graph that uses it and, for every strategy the rule enumerates on
the mesh, builds a one-operator plan (the strategy's input placements as
``OpPlacement.inputs``) and runs it through the SPMD executor: inputs are made in the
placements the strategy's producers would give them (Partial ones as local shares), the
executor redistributes what the plan asks, and the output and input gradients are compared
with the same operator on full tensors. Runs inside a process group (called from
tests/harness/graph_variants.py ``--check-strategies``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from meshplan.errors import NotSupportedError
from meshplan.graph import OpGraph, OpKind
from meshplan.placements import P, R, placement_str
from meshplan.planner.strategies import (enumerate_strategies, follow, input_shapes, op_spec,
                                         tensor_placements)
from meshplan.plan import OpPlacement
from meshplan.runtime.graph.spmd import SPMDExecutor, placement_texts, to_placements

_FLOAT = ("float32", "float16", "bfloat16", "float64")


def rule_cases(graph: OpGraph, mesh_shape: tuple[int, ...],
               seen: set | None = None) -> list[tuple[str, str, tuple]]:
    """(rule, node name, strategies) for the first node of every rule in ``graph`` not in
    ``seen`` (which is updated, so a second model adds only its new rules)."""
    seen = set() if seen is None else seen
    cases = []
    for node in graph.nodes:
        if node.kind == OpKind.VIEW and len(node.inputs) == 1 and node.out is not None:
            rule = f"follower {node.target}"
            if rule in seen:
                continue
            shape = input_shapes(graph, node)[0]
            if shape is None:
                continue
            strategies = set()
            for pl in tensor_placements(shape, mesh_shape) + ((P,) * len(mesh_shape),):
                fixed, out = follow(node, shape, pl, mesh_shape)
                strategies.add(((fixed,), out))
            seen.add(rule)
            cases.append((rule, node.name, tuple(sorted(strategies))))
            continue
        spec = op_spec(graph, node)
        if spec is None or spec.rule in seen:
            continue
        seen.add(spec.rule)
        cases.append((spec.rule, node.name, tuple((s.inputs, s.output) for s in
                                                  enumerate_strategies(spec, mesh_shape))))
    return cases


def one_node_module(gm: fx.GraphModule, name: str) -> tuple[fx.GraphModule, list[fx.Node]]:
    """A graph holding only node ``name`` of ``gm``; its inputs become placeholders."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    g = fx.Graph()
    env = {a: g.placeholder(f"in_{i}") for i, a in enumerate(node.all_input_nodes)}
    new = g.node_copy(node, lambda a: env[a])
    new.name = name
    g.output(new)
    return fx.GraphModule(torch.nn.Module(), g), list(node.all_input_nodes)


def _make_input(shape, dtype: str, gen: torch.Generator) -> torch.Tensor:
    if dtype in _FLOAT:
        return torch.randn(shape, generator=gen, dtype=getattr(torch, dtype))
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 2, shape, generator=gen, dtype=getattr(torch, dtype))


def _placed(full: torch.Tensor, mesh, placements: tuple[int, ...]) -> DTensor:
    """``full`` as a DTensor in ``placements``; Partial axes hold equal local shares."""
    base = [Replicate() if p == P else pl for p, pl in
            zip(placements, to_placements(placement_str(tuple(R if p == P else p
                                                                for p in placements))))]
    dt = distribute_tensor(full, mesh, base)
    if P not in placements:
        return dt
    share = 1
    for axis, p in enumerate(placements):
        if p == P:
            share *= mesh.size(axis)
    final = [Partial() if p == P else b for p, b in zip(placements, base)]
    return DTensor.from_local(dt.to_local() / share, mesh, final, run_check=False)


def check_case(graph: OpGraph, gm: fx.GraphModule, mesh, name: str, strategy) -> tuple[str, str]:
    """('' when the strategy runs and matches full tensors, else what went wrong; the output
    placement DTensor produced)."""
    node = graph.node(name)
    shapes = input_shapes(graph, node)
    dtypes = [graph.param_map[i].dtype if i in graph.param_map else
              dict(graph.inputs)[i].dtype if i in dict(graph.inputs) else
              graph.node(i).outputs[0].dtype for i in node.inputs]
    small, arg_nodes = one_node_module(gm, name)
    gen = torch.Generator().manual_seed(0)
    fulls = [_make_input(s, d, gen) for s, d in zip(shapes, dtypes)]
    if node.target.startswith("aten.cross_entropy_loss") and len(fulls) > 1:
        fulls[1] = fulls[1].clamp_max(shapes[0][-1] - 1)
    ins_pl, out_pl = strategy
    ref_inputs = [f.clone().requires_grad_(f.is_floating_point()) for f in fulls]
    expected = small(*ref_inputs)
    dt_inputs = [_placed(f, mesh, pl)
                 for f, pl in zip(fulls, _inputs_as_produced(ins_pl, len(fulls), mesh.ndim))]
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in dt_inputs]
    plan = {name: OpPlacement(inputs=tuple(placement_str(p) for p in ins_pl),
                              output=placement_str(out_pl))}
    try:
        got = SPMDExecutor(small, mesh, plan).run(*leaves)
        if isinstance(got, (list, tuple)):  # split: every piece, flattened into one
            produced = "".join(placement_texts(got[0].placements))
            got_full = torch.cat([g.full_tensor().reshape(-1) for g in got])
            expected = torch.cat([e.reshape(-1) for e in expected])
        else:
            produced = "".join(placement_texts(got.placements))
            got_full = got.full_tensor()
    except NotSupportedError as exc:  # refused up front, with the node named
        return f"NotSupportedError: {str(exc)[:300]}", ""
    except Exception as exc:  # noqa: BLE001 - reported per strategy
        return f"{type(exc).__name__}: {str(exc)[:300]}", ""
    if not _close(got_full, expected):
        return f"output differs by {(got_full.float() - expected.float()).abs().max():.2e}", produced
    if expected.is_floating_point() and expected.requires_grad:
        weight = torch.randn(expected.shape, generator=gen)
        (expected * weight).sum().backward()
        try:
            (got_full * weight).sum().backward()
        except Exception as exc:  # noqa: BLE001 - reported per strategy
            return f"backward: {type(exc).__name__}: {str(exc)[:300]}", produced
        for k, (ref, leaf) in enumerate(zip(ref_inputs, leaves)):
            if ref.grad is not None and leaf.grad is not None and not _close(
                    leaf.grad.full_tensor(), ref.grad):
                return f"gradient of input {k} differs", produced
    return "", produced


def _close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal up to fp32 summation order: the absolute tolerance scales with the tensor's
    largest entry (a sharded contraction sums in another order, and an entry near zero in a
    tensor of entries near 10 then differs by ~1e-5 of 10, not of itself)."""
    got, ref = got.float(), ref.float()
    scale = max(1.0, float(ref.abs().nan_to_num(posinf=0.0, neginf=0.0).max())) if ref.numel() else 1.0
    return torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)


def _inputs_as_produced(ins_pl, n: int, ndim: int) -> list[tuple[int, ...]]:
    """The strategy's input placements (what the producers hand over), R for the rest."""
    out = [tuple(p) for p in ins_pl][:n]
    return out + [(R,) * ndim] * (n - len(out))


def check_all(graph: OpGraph, gm: fx.GraphModule, mesh, *, log=None,
              seen: set | None = None) -> list[dict]:
    results = []
    for rule, name, strategies in rule_cases(graph, tuple(mesh.shape), seen):
        if log:
            log(f"{rule} ({name}): {len(strategies)} strategies")
        for strategy in strategies:
            if log:
                log(f"  {[placement_str(p) for p in strategy[0]]} -> {placement_str(strategy[1])}")
            error, produced = check_case(graph, gm, mesh, name, strategy)
            results.append({"rule": rule, "node": name,
                            "inputs": [placement_str(p) for p in strategy[0]],
                            "output": placement_str(strategy[1]), "produced": produced,
                            "error": error})
    return results
