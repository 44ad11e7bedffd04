"""BatchNorm over the rows of every data-parallel rank, on any backend (gloo included).

One process normalises the whole batch with its own mean and variance; under data
parallelism each rank holds only its rows, so the module engine replaces each BatchNorm's
training forward with this one: the per-channel sum and count are all-reduced over the
data-parallel group (the global mean), then the sum of squared deviations from that mean (the
global biased variance: two passes, as one process computes it, with none of the
cancellation of a sum of squares); the running statistics take the global mean and the
global unbiased variance (count / (count - 1)), and ``num_batches_tracked`` counts once per
forward call, as one process's BatchNorm does.

Why not ``torch.nn.SyncBatchNorm``: its forward raises "SyncBatchNorm expected input tensor
to be on GPU or XPU" for a CPU tensor, and the operators its autograd function calls
(``aten::batch_norm_stats``, ``batch_norm_elemt``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_backward_reduce``) have no CPU kernel in torch 2.13 ("Could not run
'aten::batch_norm_stats' with arguments from the 'CPU' backend"). The backward here is
autograd's through ``_AllReduce`` below (a sum over the group whose gradient is the
sum of the gradients; torch.distributed.nn.functional.all_reduce does the same and is
deprecated in torch 2.13): each rank receives the gradient of every rank's loss with
respect to its rows through the shared statistics (SyncBatchNorm's backward all-reduces
the same two sums, ``sum_dy`` and ``sum_dy_xmu``).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn as nn


class _AllReduce(torch.autograd.Function):
    """The sum over ``group``; every rank's output depends on every rank's input, so the
    gradient of an input is the sum over ranks of the outputs' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduce.apply(x, group)


def batch_norms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    """The BatchNorm modules of ``model`` (1d, 2d, 3d, SyncBatchNorm), by name."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def synchronize(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Make every BatchNorm of ``model`` normalise over the rows of all ranks of ``group``
    while training (eval reads the running statistics, as before). Returns how many."""
    found = batch_norms(model)
    for _, m in found:
        m.forward = functools.partial(_forward, m, m.forward, group)
    return len(found)


def _forward(bn: nn.modules.batchnorm._BatchNorm, local_forward, group, x: torch.Tensor):
    batch_stats = bn.training or bn.running_mean is None
    if not batch_stats:
        return local_forward(x)  # eval: the running statistics, nothing to share
    bn._check_input_dim(x)
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = [1, c] + [1] * (x.dim() - 2)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    count = torch.full((1,), x.numel() // c, dtype=acc, device=x.device)
    totals = all_reduce(torch.cat([xf.sum(dims), count]), group=group)
    n = totals[-1].detach()
    if float(n) <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got {int(n)} "
                         "over the data-parallel ranks")
    mean = totals[:c] / n
    centred = xf - mean.view(shape)
    var = all_reduce((centred * centred).sum(dims), group=group) / n  # biased, as F.batch_norm
    y = centred * torch.rsqrt(var + bn.eps).view(shape)
    if bn.affine:
        y = y * bn.weight.to(acc).view(shape) + bn.bias.to(acc).view(shape)
    if bn.training and bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            factor = (1.0 / float(bn.num_batches_tracked) if bn.momentum is None
                      else bn.momentum)
            bn.running_mean.lerp_(mean.detach().to(bn.running_mean.dtype), factor)
            unbiased = var.detach() * (n / (n - 1))
            bn.running_var.lerp_(unbiased.to(bn.running_var.dtype), factor)
    return y.to(x.dtype)

