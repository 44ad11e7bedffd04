"""The loss of a step as the mean over the labelled targets of the GLOBAL batch.

trace -> cost -> solve -> plan -> **run**. A loss such as ``F.cross_entropy`` averages over
the targets it is given that are not ``IGNORE_INDEX`` (masked-LM masks, padding). A plan cuts
the global batch into data-parallel shards and microbatches, and each piece's mean is over
its own count of labelled targets: averaging those means (what gradient accumulation and
data-parallel gradient averaging do) weighs a token in a sparsely labelled piece more than
one in a densely labelled piece, so the loss and the gradients differ from one process's
(the gradient-accumulation loss bug many trainers had). Every engine therefore weighs the
loss of data-parallel rank r's microbatch j by ``K[r, j] / sum(K)``, ``K`` the labelled
targets per rank and microbatch (one all-reduce of a dp x n table per step): the weighted
sum is the global mean, whatever the layout.

Which targets count: the first target tensor when it holds integers (class labels, token
labels); entries equal to ``IGNORE_INDEX`` are not labelled. Float targets and calls
without targets weigh every microbatch alike (they all have the same size), as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate

from meshplan.errors import NotSupportedError

# torch.nn.functional.cross_entropy's default ignore_index, and Hugging Face's label for
# "no loss at this position" (DataCollatorForLanguageModeling, padding in seq2seq collators)
IGNORE_INDEX = -100


def is_label_tensor(target) -> bool:
    return isinstance(target, torch.Tensor) and not target.is_floating_point() \
        and not target.is_complex() and target.dtype != torch.bool and target.dim() > 0


def count(target: torch.Tensor) -> int:
    """Labelled entries of one target tensor."""
    return int((target != IGNORE_INDEX).sum())


def label_counts(target: torch.Tensor | None, n: int, *, dp_rank: int, dp_size: int,
                 device) -> torch.Tensor | None:
    """``K``: labelled targets per data-parallel rank (rows) and microbatch (columns) of
    the global batch, on every rank; ``target`` is this rank's shard (microbatch j: its
    j-th chunk). None where the microbatches weigh alike (no integer target, or the same
    count in every piece: the engines' plain means are then exact). A collective
    over the whole world: ranks that share a data-parallel coordinate hold the same data."""
    if not is_label_tensor(target):
        return None
    table = torch.zeros(dp_size, n, dtype=torch.float64, device=device)
    table[dp_rank] = torch.tensor([count(c) for c in target.chunk(n)], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(table)
        table /= dist.get_world_size() // dp_size
    # every piece equally labelled (no -100, or as many everywhere): the plain means are exact
    return None if bool((table == table.flatten()[0]).all()) else table


def global_label_counts(target: torch.Tensor | None, n: int,
                        dp_size: int) -> torch.Tensor | None:
    """``label_counts`` from the whole global batch, which every rank holds (the CLI
    worker's synthetic batches): microbatch j is its j-th chunk, data-parallel rank r holds
    the r-th chunk of that (the graph engine's batch split). No collective."""
    if not is_label_tensor(target):
        return None
    table = torch.tensor([[count(piece) for piece in mb.chunk(dp_size)]
                          for mb in target.chunk(n)], dtype=torch.float64).T.contiguous()
    return None if bool((table == table.flatten()[0]).all()) else table


def guard_empty_global(target: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``guard_empty`` for every rank's pieces of a whole global batch."""
    dp_size, n = table.shape
    if bool((table > 0).all()):
        return target
    target = target.clone()
    for j, mb in enumerate(target.chunk(n)):
        for r, piece in enumerate(mb.chunk(dp_size)):
            if table[r, j] == 0:
                piece.reshape(-1)[0] = 0  # a contiguous row range: reshape is a view
    return target


def guard_empty(target: torch.Tensor, table: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """``target`` with one entry labelled (class 0) in each of this rank's microbatches that
    has none: a mean over no targets is 0/0, NaN in the forward and in every gradient. Such
    a microbatch weighs 0 (``table`` was counted before), so the label changes nothing."""
    n = table.shape[1]
    empty = [j for j in range(n) if table[dp_rank, j] == 0]
    if not empty:
        return target
    target = target.clone()
    rows = target.shape[0] // n
    for j in empty:
        target[j * rows:(j + 1) * rows].view(-1)[0] = 0
    return target


def weight(table: torch.Tensor, j: int, *, dp_rank: int, placements: Sequence | None = None,
           dp_axes: Sequence[int] = (), mesh_shape: Sequence[int] = (),
           dtensor_backward: bool = False) -> float:
    """What microbatch ``j``'s loss on this rank is multiplied by before its backward, so
    that the engine's averages (over the n microbatches, over the data-parallel ranks) give
    the global labelled mean.

    ``placements`` (graph engine: the loss DTensor's, over a mesh of ``mesh_shape`` whose
    data-parallel axes are ``dp_axes``) says what this rank's loss value is a mean over: a
    partial average on the data-parallel axes is its own rows' mean (``K[r, j]`` targets,
    averaged with dp-1 others), a replicated one the whole microbatch's. None: this rank's
    rows' mean, averaged over the data-parallel ranks (the module engines).

    ``dtensor_backward``: the weight of the backward when it runs through DTensor's operators
    (the graph engine's unlowered executor: cp stages). A partial average there is its own
    rows' mean in the forward, but DTensor's backward is that of the whole microbatch's mean:
    torch's ``nll_loss_backward`` strategy all-reduces ``total_weight``, so each token's
    gradient is divided by the microbatch's labelled targets over every data-parallel rank
    (with the forward's weight, rank r's tokens weighed ``dp x K[r, j] / sum_r K[r, j]``
    times too much: T5 at dp2 x cp2, tests/test_own_loop_matrix.py). It is weighed as a
    whole loss."""
    dp_size, n = table.shape
    total = float(table.sum())
    if placements is None:
        return n * dp_size * float(table[dp_rank, j]) / total
    kinds = set()
    for axis, p in enumerate(placements):
        if mesh_shape[axis] == 1:
            continue
        if axis in dp_axes:
            kinds.add("avg" if isinstance(p, Partial) and p.reduce_op == "avg" else
                      "whole" if isinstance(p, Replicate) else str(p))
        elif not isinstance(p, Replicate):
            raise NotSupportedError(
                f"the loss is {p} on mesh axis {axis}, which is not a data-parallel axis: its "
                "rows are split where the labelled-target weighting cannot count them; plan "
                "without splitting the loss over tensor parallelism (or targets without "
                f"{IGNORE_INDEX})")
    if kinds == {"whole"} or (dtensor_backward and kinds == {"avg"}):
        return n * float(table[:, j].sum()) / total
    if kinds <= {"avg"}:
        return n * dp_size * float(table[dp_rank, j]) / total
    raise NotSupportedError(f"the loss has placements {list(placements)} over the data-parallel "
                            f"axes {list(dp_axes)}; the labelled-target weighting reads a "
                            "partial average or a replicated loss there")
