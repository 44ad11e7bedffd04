"""Context parallelism at run time: moving values on and off the cp axis's layout.

trace -> cost -> solve -> plan -> **run**. The graph engine (runtime/graph/spmd.py) calls
``move_cp`` for every operator input whose planned placement on the mesh axis "cp" differs
from the one it has. On that axis "S(d)" is the load-balanced layout of dim d
(meshplan/context.py: rank r holds sequence chunks r and 2cp-1-r): the dim is permuted into
``layout_order`` and then sharded contiguously by DTensor, so

- R -> S(d) (a rank takes its chunks: token ids, positions, RoPE tables, masks) is a local
  ``index_select`` and a local slice, no communication;
- S(d) -> R (K and V before attention; logits before the shifted loss) is DTensor's
  all-gather over cp followed by the inverse permutation: Llama 3's all-gather K/V exchange
  (Grattafiori et al. 2024, Sec. 3.3.2).

Both are differentiable: DTensor gives the adjoint collectives, and a replicated value read
by sequence-split consumers (K, V) receives its gradient Partial over cp, which DTensor
reduces when it is converted back (the weights' gradients are reduced over cp with dp by
the gradient sync). Why not ``torch.distributed.tensor.experimental.context_parallel``:
see docs/DECISIONS.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshplan.context import layout_order
from meshplan.placements import PARTIAL, REPLICATE, shard_dim


def cp_axis_of(mesh: DeviceMesh) -> int | None:
    names = tuple(mesh.mesh_dim_names or ())
    if "cp" in names and mesh.size(names.index("cp")) > 1:
        return names.index("cp")
    return None


def natural_order(local: torch.Tensor, placements, mesh: DeviceMesh) -> torch.Tensor:
    """``local``, a value that was ``placements`` (DTensor placements) and has been gathered
    over the cp axis by DTensor (contiguous chunks), back in sequence order: an "S(d)" on cp
    is the load-balanced layout (eval outputs: run(x) on one stage or a pipeline)."""
    axis = cp_axis_of(mesh)
    if axis is None or not isinstance(placements[axis], Shard):
        return local
    d = placements[axis].dim
    order = layout_order(local.shape[d], mesh.size(axis))
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return local.index_select(d, inverse.to(local.device))


def _reorder(value: DTensor, dim: int, index: Sequence[int]) -> DTensor:
    """Permute ``dim`` of a value that is whole along it on every rank (local op)."""
    local = value.to_local()
    idx = torch.tensor(index, dtype=torch.long, device=local.device)
    out = local.index_select(dim, idx)
    return DTensor.from_local(out, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def move_cp(value: DTensor, current: tuple[str, ...], target: tuple[str, ...], axis: int,
            to_placements) -> DTensor:
    """``value`` (placed ``current``) to ``target``, reading "S(d)" on mesh axis ``axis`` as
    the load-balanced layout. ``to_placements`` turns plan strings into DTensor placements."""
    mesh = value.device_mesh
    cp = mesh.size(axis)
    mid = list(target)
    mid[axis] = REPLICATE if current[axis] == PARTIAL else current[axis]
    if tuple(mid) != tuple(current):  # the other axes first (and P -> R on cp)
        value = value.redistribute(mesh, to_placements(mid, mesh))
    if mid[axis].startswith("S"):  # off the layout: all-gather, then back to sequence order
        d = shard_dim(mid[axis])
        placements = list(value.placements)
        placements[axis] = Replicate()
        value = value.redistribute(mesh, placements)
        order = layout_order(value.shape[d], cp)
        inverse = [0] * len(order)
        for i, pos in enumerate(order):
            inverse[pos] = i
        value = _reorder(value, d, inverse)
    if target[axis].startswith("S"):  # onto the layout: permute, then take this rank's part
        d = shard_dim(target[axis])
        value = _reorder(value, d, layout_order(value.shape[d], cp))
        placements = list(value.placements)
        placements[axis] = Shard(d)
        value = value.redistribute(mesh, placements)
    elif target[axis] == PARTIAL:
        raise AssertionError("the cp axis never plans a Partial input")
    return value
