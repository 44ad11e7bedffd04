"""ZeRO-3 in the lowered program: parameter gathers hoisted, bucketed per block, and
gathered again in the backward instead of saved.

trace -> cost -> solve -> plan -> **run**. After the lowered program is built
(runtime/graph/lowerer.py), ``ParamGathers.plan`` finds the parameters every consumer gathers the
same way and gathers each once per call; the parameters first used by one transformer block
share one collective (and, through autograd, one reduce-scatter of their gradients), as
FSDP's per-block units do. ``_Regather``'s saved-tensor hooks keep the gathered parameters
out of what autograd saves.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from meshplan.runtime.graph import lowering
from meshplan.runtime.graph.recompute import block_index
from meshplan.vocabulary import Recompute


class ParamGathers:
    """Which parameters are gathered once per call (``hoisted``: node -> (src, dst) spec)
    and together (``bucket_of``: node -> (mesh axis, the nodes gathered with it, their
    shard dims)), and the gathered values of the call in flight. ``local_param(node)``
    gives a parameter node's local shard as the program reads it."""

    def __init__(self, mesh: DeviceMesh, local_param):
        self.mesh = mesh
        self.local_param = local_param
        self.hoisted: dict = {}
        self.bucket_of: dict = {}  # node -> (mesh axis, bucket's nodes, their shard dims)
        self._gathered: dict = {}
        self._regather = None  # the saved-tensor hooks of the current replay (_Regather)

    def plan(self, graph: fx.Graph, steps: dict, specs: dict, *, block_prefix: str,
             recompute: str) -> None:
        """Hoist the gathers of ``steps`` (their moves of parameters are removed, ``specs``
        of the hoisted parameters become the gathered ones) and bucket them per block.
        Not under recompute, which re-gathers inside each block instead."""
        self.hoisted, self.bucket_of = {}, {}
        if recompute != Recompute.NONE:
            return
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        in_block = [order[n] for n in nodes if n.op == "call_function" and
                    block_index(n, block_prefix) >= 0]
        first_block = min(in_block) if in_block else len(nodes)
        groups: dict = {}
        for g in nodes:
            spec = specs.get(g)
            if g.op != "get_attr" or not isinstance(spec, DTensorSpec) or not g.users:
                continue
            users = list(g.users)
            moves = {steps[u].moves.get(g) if u in steps else None for u in users}
            if len(moves) != 1 or None in moves:
                continue
            (src, dst), = moves
            self.hoisted[g] = (src, dst)
            for u in users:
                del steps[u].moves[g]
            specs[g] = dst
            bucket = lowering.bucket_axis(src, dst)
            if bucket is not None:
                first = min(users, key=order.get)
                layer = block_index(first, block_prefix)
                where = layer if layer >= 0 else ("pre" if order[first] < first_block else "post")
                # one collective per (block, mesh axis): tensor-parallel weights sharded on
                # other dims share it (each member is cut back along its own dim)
                groups.setdefault((where, bucket[0], src.tensor_meta.dtype), []).append(
                    (g, bucket[1]))
        for (_, axis, _), members in groups.items():
            if len(members) > 1:
                nodes, dims = [m for m, _ in members], tuple(d for _, d in members)
                for m in nodes:
                    self.bucket_of[m] = (axis, nodes, dims)

    # -- one call ---------------------------------------------------------------------------
    def hooks(self):
        """Start a call: the saved-tensor hooks to run it under (a no-op context unless
        gradients are recorded and something is hoisted)."""
        self._gathered = {}
        regather = self.hoisted and torch.is_grad_enabled()
        self._regather = _Regather(self) if regather else None
        return torch.autograd.graph.saved_tensors_hooks(self._regather.pack,
                                                        self._regather.unpack) \
            if regather else nullcontext()

    def end(self) -> None:
        """The call's forward is over: drop what it gathered."""
        self._gathered = {}
        if self._regather is not None:
            self._regather.forward_done()
        self._regather = None

    def value(self, a: fx.Node, env: dict):
        """A node's local value as its consumers take it (hoisted gathers done once)."""
        if a not in self.hoisted:
            return env[a]
        if a not in self._gathered:
            shards = self._shards(a, env)
            gathered = self.gather(a, shards)
            self._gathered.update(gathered)
            if self._regather is not None:
                self._regather.register(gathered, shards)
        return self._gathered[a]

    def release(self, a: fx.Node) -> None:
        """Nothing reads ``a`` again in this call."""
        if self._gathered.pop(a, None) is not None and self._regather is not None:
            self._regather.release(a)

    def _shards(self, a: fx.Node, env: dict) -> list:
        """The local shards ``gather`` reads for ``a``'s bucket (the regather hooks keep
        them, to gather the bucket again in the backward)."""
        if a in self.bucket_of:
            return [self.local_param(m) for m in self.bucket_of[a][1]]
        return [env[a]]

    def gather(self, a: fx.Node, shards: list) -> dict:
        """ZeRO-3: the full parameter(s) of ``a``'s bucket (one collective per bucket)."""
        if a in self.bucket_of:
            axis, members, dims = self.bucket_of[a]
            return dict(zip(members, lowering.gather_bucket(self.mesh, axis, dims, shards)))
        return {a: lowering.move(shards[0], *self.hoisted[a])}


class _Regather:
    """Saved-tensor hooks that keep ZeRO-3's gathered parameters out of what autograd saves:
    a saved tensor living in a gathered parameter's storage is packed as a ticket (which
    parameter, and the view's size, stride and offset) and gathered again when the backward
    unpacks it, one bucket at a time. So a block's full parameters live only while the block
    runs, forward or backward, as with FSDP's reshard-after-forward (Rajbhandari et al.
    2020, ZeRO stage 3); the backward pays a second all-gather per bucket, which the cost
    model prices (costmodel/estimate.py, ZeRO-3 gathers). Storages are matched by address
    only while the gathered tensor is alive (``release`` forgets it when it is dropped)."""

    def __init__(self, gathers: ParamGathers):
        self.gathers = gathers
        self.by_storage: dict[int, tuple[fx.Node, int]] = {}  # storage address -> (node, -)
        self.live: dict[fx.Node, int] = {}
        self.shards: dict[fx.Node, list] = {}  # node -> the local shards its bucket gathers
        self.cache: tuple = (None, {})  # the last bucket gathered again in backward

    def register(self, gathered: dict, shards: list) -> None:
        for node, tensor in gathered.items():
            ptr = tensor.untyped_storage().data_ptr()
            if ptr:  # empty tensors have no storage to recognise
                self.by_storage[ptr] = (node, 0)
                self.live[node] = ptr
            self.shards[node] = shards

    def release(self, node: fx.Node) -> None:
        ptr = self.live.pop(node, None)
        if ptr is not None and self.by_storage.get(ptr, (None,))[0] is node:
            del self.by_storage[ptr]

    def forward_done(self) -> None:
        self.by_storage, self.live = {}, {}

    def pack(self, t: torch.Tensor):
        if type(t) is not torch.Tensor or not self.by_storage:
            return t
        hit = self.by_storage.get(t.untyped_storage().data_ptr())
        if hit is None:
            return t
        return _Ticket(hit[0], tuple(t.size()), tuple(t.stride()), t.storage_offset(),
                       t.requires_grad)

    def unpack(self, packed):
        if not isinstance(packed, _Ticket):
            return packed
        key = self.gathers.bucket_of.get(packed.node, (None, (packed.node,)))[1]
        if self.cache[0] != key:
            with torch.no_grad():
                self.cache = (key, self.gathers.gather(packed.node, self.shards[packed.node]))
        base = self.cache[1][packed.node]
        return base.as_strided(packed.size, packed.stride, packed.offset)


@dataclass(frozen=True, slots=True)
class _Ticket:
    node: fx.Node
    size: tuple
    stride: tuple
    offset: int
    requires_grad: bool
