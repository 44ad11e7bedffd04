"""runtime/loss_weights.py without processes: the weighted per-rank, per-microbatch means
are the global batch's mean over labelled targets, for every way an engine averages."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from meshplan.errors import NotSupportedError
from meshplan.runtime.loss_weights import IGNORE_INDEX, count, guard_empty, weight


def _batch(dp=2, n=3, rows=2, seq=5, vocab=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(dp * n * rows, seq, vocab, generator=g)
    labels = torch.randint(0, vocab, (dp * n * rows, seq), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.6] = IGNORE_INDEX
    return logits, labels


def _ce(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _pieces(x, dp, n):
    """rank r's microbatch j: rank r holds rows [r*B/dp, (r+1)*B/dp), cut into n chunks."""
    return [list(shard.chunk(n)) for shard in x.chunk(dp)]


def test_each_rank_weighing_its_own_mean_gives_the_global_mean():
    dp, n = 2, 3
    logits, labels = _batch(dp, n)
    table = torch.tensor([[count(c) for c in row] for row in _pieces(labels, dp, n)],
                         dtype=torch.float64)
    lg, lb = _pieces(logits, dp, n), _pieces(labels, dp, n)
    # module engines: mean over n microbatches, FSDP's mean over dp ranks
    engine = sum(weight(table, j, dp_rank=r) * _ce(lg[r][j], lb[r][j])
                 for r in range(dp) for j in range(n)) / (n * dp)
    torch.testing.assert_close(engine, _ce(logits, labels), rtol=1e-6, atol=1e-7)
    plain = sum(_ce(lg[r][j], lb[r][j]) for r in range(dp) for j in range(n)) / (n * dp)
    assert abs(float(plain - _ce(logits, labels))) > 1e-3  # what was returned before


def test_graph_engine_placements_partial_average_and_replicated():
    dp, n = 2, 3
    logits, labels = _batch(dp, n, seed=1)
    table = torch.tensor([[count(c) for c in row] for row in _pieces(labels, dp, n)],
                         dtype=torch.float64)
    lg, lb = _pieces(logits, dp, n), _pieces(labels, dp, n)
    mesh = (dp, 2)  # (dp, tp): the loss replicated over tp
    avg = [Partial("avg"), Replicate()]
    partial = sum(weight(table, j, dp_rank=r, placements=avg, dp_axes=(0,), mesh_shape=mesh)
                  * _ce(lg[r][j], lb[r][j]) for r in range(dp) for j in range(n)) / (n * dp)
    torch.testing.assert_close(partial, _ce(logits, labels), rtol=1e-6, atol=1e-7)
    # a loss replicated over dp is already microbatch j's mean over all ranks' rows
    whole = [torch.cat([lg[r][j] for r in range(dp)]) for j in range(n)]
    whole_labels = [torch.cat([lb[r][j] for r in range(dp)]) for j in range(n)]
    rep = [Replicate(), Replicate()]
    replicated = sum(weight(table, j, dp_rank=0, placements=rep, dp_axes=(0,), mesh_shape=mesh)
                     * _ce(whole[j], whole_labels[j]) for j in range(n)) / n
    torch.testing.assert_close(replicated, _ce(logits, labels), rtol=1e-6, atol=1e-7)
    with pytest.raises(NotSupportedError, match="not a data-parallel axis"):
        weight(table, 0, dp_rank=0, placements=[Partial("avg"), Shard(0)], dp_axes=(0,),
               mesh_shape=mesh)


def test_a_dtensor_backward_is_weighed_as_the_whole_microbatchs_mean():
    """The graph engine's cp stages run on DTensor: the loss's forward value is this rank's
    own rows' mean (Partial(avg)), but torch's nll_loss_backward strategy all-reduces
    total_weight, so rank r's tokens get gradient / (microbatch j's labelled targets on every
    rank), summed over ranks. Weighed as the forward (T5 at dp2 x cp2 before the fix) the
    gradient is off; with ``dtensor_backward`` it is the global mean's."""
    dp, n = 2, 3
    logits, labels = _batch(dp, n, seed=2)
    table = torch.tensor([[count(c) for c in row] for row in _pieces(labels, dp, n)],
                         dtype=torch.float64)
    ref = logits.clone().requires_grad_()
    _ce(ref, labels).backward()
    grads = []
    for dtensor_backward in (True, False):
        leaf = logits.clone().requires_grad_()
        lg, lb = _pieces(leaf, dp, n), _pieces(labels, dp, n)
        total = 0
        for r in range(dp):
            for j in range(n):
                seen = F.cross_entropy(lg[r][j].reshape(-1, lg[r][j].shape[-1]),
                                       lb[r][j].reshape(-1), reduction="sum") / table[:, j].sum()
                g = weight(table, j, dp_rank=r, placements=[Partial("avg")], dp_axes=(0,),
                           mesh_shape=(dp,), dtensor_backward=dtensor_backward)
                total = total + seen * (g / n)
        total.backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], ref.grad, rtol=1e-5, atol=1e-7)
    assert float((grads[1] - ref.grad).abs().max()) > 1e-4  # the forward's weight


def test_a_microbatch_without_labels_weighs_zero_and_is_finite():
    labels = torch.full((4, 3), IGNORE_INDEX)
    labels[2:, 1] = 5  # microbatch 1 of 2 has labels, microbatch 0 none
    table = torch.tensor([[0.0, 2.0]], dtype=torch.float64)
    assert weight(table, 0, dp_rank=0) == 0.0 and weight(table, 1, dp_rank=0) == 2.0
    guarded = guard_empty(labels, table, 0)
    assert count(guarded[:2]) == 1 and torch.equal(guarded[2:], labels[2:])
    assert torch.isfinite(_ce(torch.randn(2, 3, 7), guarded[:2]))
    assert count(labels[:2]) == 0  # the caller's tensor is not changed


def test_the_whole_batch_table_is_every_ranks_table():
    """The CLI worker holds the whole global batch: its table (no collective) is the one the
    ranks' shards give (rank r's rows, microbatch j its j-th chunk, as run.py lays them)."""
    from meshplan.runtime.loss_weights import global_label_counts, guard_empty_global

    dp, n = 2, 2
    _, labels = _batch(dp, n, seed=3)
    table = global_label_counts(labels, n, dp)
    for r in range(dp):  # the graph engine's microbatch j: chunk j, then rank r's chunk of it
        for j in range(n):
            assert table[r, j] == count(labels.chunk(n)[j].chunk(dp)[r])
    labels.chunk(n)[1].chunk(dp)[0].fill_(IGNORE_INDEX)
    table = global_label_counts(labels, n, dp)
    guarded = guard_empty_global(labels, table)
    assert table[0, 1] == 0 and count(guarded.chunk(n)[1].chunk(dp)[0]) == 1
    assert count(guarded) == count(labels) + 1
