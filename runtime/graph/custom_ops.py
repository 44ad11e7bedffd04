"""Custom operators on DTensors: a replicated sharding rule where DTensor has none.

Runtime helper (trace -> cost -> solve -> **run**). Models bring their own operators
(transformers' MoE experts run ``transformers.grouped_mm_fallback`` and, in the backward,
``transformers.grouped_mm_fallback_backward``); DTensor refuses an operator with no sharding
strategy ("does not have a sharding strategy registered"), so a plan that reaches one with a
sharded input stopped with a traceback. Each such operator, and every operator of its
namespace (its backward is not in the forward graph), gets one rule: all inputs and outputs
replicated, which DTensor reaches by gathering its inputs. That is always right, and the
planner prices unknown operators as replicated already. A model's own sharding rule, or
DTensor's, is never replaced.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.experimental import register_sharding

BUILTIN_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional",
                                "c10d", "_dtensor", "higher_order"})


def _has_strategy(op: torch._ops.OpOverload) -> bool:
    # private: DTensor's sharding propagator tables (no public query exists in torch 2.13)
    prop = DTensor._op_dispatcher.sharding_propagator
    return op in prop.op_strategy_funcs or op in prop.op_to_rules


def _replicated(op: torch._ops.OpOverload) -> None:
    args = op._schema.arguments
    returns = op._schema.returns

    def rule(*a, **k):
        outs = [Replicate() for _ in returns]
        ins = [Replicate() if _is_tensor_arg(x.type) else None for x in args]
        return [(outs, ins)]

    register_sharding(op)(rule)


def _is_tensor_arg(t) -> bool:
    return isinstance(t, torch.TensorType) or (
        isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.TensorType))


def replicate_unsharded_custom_ops(graph: fx.Graph) -> list[str]:
    """Register the replicated rule for the custom operators ``graph`` calls (and the rest of
    their namespaces) that DTensor has no strategy for; returns their names."""
    namespaces = {n.target.namespace for n in graph.nodes
                  if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                  and n.target.namespace not in BUILTIN_NAMESPACES}
    done = []
    for ns in sorted(namespaces):
        space = getattr(torch.ops, ns)
        for name in list(dir(space)):
            packet = getattr(space, name, None)
            if not isinstance(packet, torch._ops.OpOverloadPacket):
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                if _has_strategy(op):
                    continue
                if any(not (_is_tensor_arg(r.type)) for r in op._schema.returns):
                    continue  # not a tensor-to-tensor operator: leave it to DTensor's error
                _replicated(op)
                done.append(str(op))
    return done
