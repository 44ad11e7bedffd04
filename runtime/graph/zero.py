"""ZeRO-1/2's collectives on one flat buffer per step: gradients reduce-scattered to the
master shards, updated shards all-gathered back into the parameters.

trace -> cost -> solve -> plan -> **run**. ZeRO-1/2 (runtime/graph/parallelize.py) keep fp32
master weights sharded on dim 0 over the data-parallel mesh axis (``Shard(0)`` where the
parameter is replicated). Done per parameter, each step pays two collectives per parameter
(one gradient reduce, one gather of the updated shard), each a full collective latency: on
gloo about 1 ms, so ZeRO-1 ran at twice the step time of plain data parallelism. Here all
eligible parameters of one (mesh axis, dtype) share one ``reduce_scatter_tensor`` and one
``all_gather_into_tensor``, as DeepSpeed's flat buffers do (Rajbhandari et al. 2020, sec. 7).

Layout: DTensor's ``Shard(0)`` cuts dim 0 into chunks of ``c = ceil(d0 / n)`` rows (the
last ones shorter or empty); padding each parameter to ``n * c`` rows makes row block ``r``
of every parameter rank ``r``'s chunk, so a ``[n, S]`` buffer (S: the padded chunks of all
parameters side by side) is reduce-scattered or gathered in one call.

A parameter is eligible when its master differs from it only on one mesh axis, replicated
-> ``Shard(0)``, and no other axis shards dim 0 (then the master's shard is a row block of
the parameter's local tensor). The others keep the per-parameter DTensor path.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from meshplan.runtime.graph.lowering import _with


def shard_axis(param: DTensor, master: DTensor) -> int | None:
    """The mesh axis a master shards its replicated parameter's dim 0 over, if eligible."""
    if param.device_mesh is not master.device_mesh and param.device_mesh != master.device_mesh:
        return None
    mesh = param.device_mesh
    diff = [i for i, (a, b) in enumerate(zip(param.placements, master.placements))
            if a != b and mesh.size(i) > 1]
    if len(diff) != 1 or param.ndim == 0:
        return None
    axis = diff[0]
    if not (isinstance(param.placements[axis], Replicate) and master.placements[axis] == Shard(0)):
        return None
    if any(isinstance(p, Shard) and p.dim == 0 for p in param.placements):
        return None
    return axis


def _groups(pairs, key):
    groups: dict = {}
    for p, m in pairs:
        axis = shard_axis(p, m)
        k = key(p, m, axis) if axis is not None else None
        if k is not None:
            groups.setdefault((id(p.device_mesh), axis, k), []).append((p, m))
    return groups


def _chunk(rows: int, n: int) -> int:
    return max(1, math.ceil(rows / n))


def reduce_scatter_grads(pairs) -> set[int]:
    """Each eligible (parameter, master) pair whose gradient is a partial sum on the master's
    axis (and matches the parameter elsewhere, or is a partial sum where it is replicated,
    all-reduced first) gets ``master.grad``, the reduced shard, and loses ``param.grad``.
    Returns the ids of the parameters handled."""
    def key(p, m, axis):
        """(dtype, other axes to all-reduce first), or None if not eligible."""
        g = p.grad
        if not isinstance(g, DTensor):
            return None
        mesh, summed = p.device_mesh, []
        for i, (a, b) in enumerate(zip(g.placements, p.placements)):
            if mesh.size(i) == 1 or i == axis and a == Partial("sum"):
                continue  # any placement is the same on a one-rank axis
            if a == Partial("sum") and isinstance(b, Replicate):
                summed.append(i)  # e.g. a norm weight replicated over tensor parallelism
            elif a != b or i == axis:
                return None
        return g.dtype, tuple(summed)

    done: set[int] = set()
    for (_, axis, (_, summed)), members in _groups(pairs, key).items():
        mesh = members[0][0].device_mesh
        n = mesh.size(axis)
        blocks = []
        for p, _ in members:
            g = p.grad._local_tensor
            c = _chunk(g.shape[0], n)
            padded = g.new_zeros((n * c, *g.shape[1:]))
            padded[:g.shape[0]].copy_(g)
            blocks.append(padded.view(n, -1))
        flat = torch.cat(blocks, dim=1)
        for other in summed:
            dist.all_reduce(flat, group=mesh.get_group(other))
        mine = flat.new_empty(flat.shape[1])
        dist.reduce_scatter_tensor(mine, flat.reshape(-1), group=mesh.get_group(axis))
        off = 0
        for (p, m), block in zip(members, blocks):
            size = block.shape[1]
            rows = m._local_tensor.shape[0]
            local = mine[off:off + size].view(-1, *p.grad._local_tensor.shape[1:])[:rows]
            off += size
            m.grad = DTensor(local, _with(m._spec, m._spec.placements, local.dtype),
                             requires_grad=False)
            p.grad = None
            done.add(id(p))
    return done


@torch.no_grad()
def gather_into_params(pairs) -> set[int]:
    """Each eligible parameter's local tensor set from its master shards (one all-gather
    per mesh axis and dtype). Returns the ids of the parameters handled."""
    done: set[int] = set()
    for (_, axis, _), members in _groups(pairs, lambda p, m, axis: m.dtype).items():
        mesh = members[0][0].device_mesh
        n = mesh.size(axis)
        blocks, sizes = [], []
        for p, m in members:
            local = p._local_tensor
            c = _chunk(local.shape[0], n)
            shard = m._local_tensor
            padded = shard.new_zeros((c, *local.shape[1:]))
            padded[:shard.shape[0]].copy_(shard)
            blocks.append(padded.reshape(-1))
            sizes.append(padded.numel())
        flat = torch.cat(blocks)
        whole = flat.new_empty(n * flat.numel())
        dist.all_gather_into_tensor(whole, flat, group=mesh.get_group(axis))
        rows, off = whole.view(n, -1), 0
        for (p, _), size in zip(members, sizes):
            local = p._local_tensor
            full = rows[:, off:off + size].reshape(-1, *local.shape[1:])[:local.shape[0]]
            local.copy_(full)
            off += size
            done.add(id(p))
    return done
