"""torch.optim.Adam and SGD that step DTensor parameters on their local shards.

trace -> cost -> solve -> **run**: ``make_optimizer`` (runtime/graph/parallelize.py) builds these
for the training step. Stock Adam over DTensor parameters sends every elementwise operator
of the update through DTensor's dispatch (sharding propagation per operator per parameter),
which made ``optimizer.step()`` 2-3x slower than the same Adam on plain tensors. The update
is elementwise, so where a parameter, its gradient and its state tensors are DTensors on the
same mesh with the same placements, running torch's own functional update
(``torch.optim.adam.adam`` / ``torch.optim.sgd.sgd``) on their local tensors gives exactly
the shards stock Adam would. Everything else (plain tensors, a gradient or state in other
placements, a ``Partial`` parameter, whose summands a non-linear update cannot step apart)
takes the stock path: the same functional on the DTensors themselves.

The classes keep torch's ``_init_group``, so the state is what torch creates (``step`` a
tensor; moments and momentum DTensors in the parameter's placements), and the checkpoint
(runtime/checkpoint.py) saves and loads it unchanged.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam
from torch.optim.optimizer import _use_grad_for_differentiable
from torch.optim.sgd import sgd

from meshplan.errors import NotSupportedError

# Options whose code paths (one kernel over many tensors, CUDA graphs, autograd through the
# step) these classes do not split between local shards and DTensors.
_UNSUPPORTED = {"foreach": True, "fused": True, "capturable": True, "differentiable": True}


def _check_options(name: str, group: dict) -> None:
    for key, bad in _UNSUPPORTED.items():
        if group.get(key) == bad:
            raise NotSupportedError(f"{name} with {key}={bad} is not supported: it steps "
                                    "local shards one tensor at a time; leave "
                                    f"{key} unset, or use torch.optim directly")


def _matches(param: torch.Tensor, tensor: torch.Tensor | None) -> bool:
    """``tensor`` is absent or a DTensor laid out like the DTensor ``param``."""
    if tensor is None:
        return True
    if not isinstance(tensor, DTensor):
        return False
    a, b = param._spec, tensor._spec
    return (a.placements == b.placements and a.shape == b.shape
            and (a.mesh is b.mesh or a.mesh == b.mesh))


def _local_update(param: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether an elementwise update of ``param`` with ``others`` can run on local shards."""
    return (isinstance(param, DTensor)
            and not any(p.is_partial() for p in param._spec.placements)
            and all(_matches(param, t) for t in others))


def _take(tensors: list, idx: list[int], on_local: bool) -> list:
    """``tensors`` at ``idx``: their local shards, or the tensors themselves."""
    if not on_local:
        return [tensors[i] for i in idx]
    return [None if tensors[i] is None else tensors[i]._local_tensor for i in idx]


def _split(params, *columns) -> tuple[list[int], list[int]]:
    """Indices of the parameters updated on local shards, and of the rest."""
    local, stock = [], []
    for i, p in enumerate(params):
        (local if _local_update(p, *(c[i] for c in columns)) else stock).append(i)
    return local, stock


class LocalShardAdam(torch.optim.Adam):
    """torch.optim.Adam whose step runs on local shards where the layouts match."""

    def add_param_group(self, param_group: dict) -> None:
        _check_options(type(self).__name__, {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @_use_grad_for_differentiable
    def step(self, closure=None):
        self._accelerator_graph_capture_health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs,
                                           max_exp_avg_sqs, steps)
            amsgrad = group["amsgrad"]
            columns = (grads, exp_avgs, exp_avg_sqs) + ((max_exp_avg_sqs,) if amsgrad else ())
            local, stock = _split(params, *columns)
            beta1, beta2 = group["betas"]
            for idx, on_local in ((local, True), (stock, False)):
                if not idx:
                    continue
                adam(_take(params, idx, on_local), _take(grads, idx, on_local),
                     _take(exp_avgs, idx, on_local), _take(exp_avg_sqs, idx, on_local),
                     _take(max_exp_avg_sqs, idx, on_local) if amsgrad else [],
                     [steps[i] for i in idx],
                     amsgrad=amsgrad, has_complex=has_complex, beta1=beta1, beta2=beta2,
                     lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                     maximize=group["maximize"],
                     # DTensors are never foreach candidates, so stock Adam runs them one
                     # tensor at a time; their local shards do the same.
                     foreach=False if on_local else group["foreach"],
                     capturable=False, differentiable=False, fused=False,
                     decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss


class LocalShardSGD(torch.optim.SGD):
    """torch.optim.SGD whose step runs on local shards where the layouts match."""

    def add_param_group(self, param_group: dict) -> None:
        _check_options(type(self).__name__, {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @_use_grad_for_differentiable
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            has_sparse_grad = self._init_group(group, params, grads, buffers)
            momentum = group["momentum"]
            local, stock = _split(params, grads, *((buffers,) if momentum != 0 else ()))
            for idx, on_local in ((local, True), (stock, False)):
                if not idx:
                    continue
                bufs = _take(buffers, idx, on_local) if momentum != 0 else []
                sgd(_take(params, idx, on_local), _take(grads, idx, on_local), bufs,
                    weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"],
                    dampening=group["dampening"], nesterov=group["nesterov"],
                    maximize=group["maximize"], has_sparse_grad=has_sparse_grad,
                    foreach=False if on_local else group["foreach"], fused=False)
                if momentum == 0:
                    continue
                for i, buf in zip(idx, bufs, strict=True):
                    if on_local and buffers[i] is None:  # new: torch's grad.detach().clone()
                        g = grads[i]
                        buf = DTensor.from_local(buf, g.device_mesh, g.placements,
                                                 run_check=False, shape=g.shape,
                                                 stride=g.stride())
                    elif on_local:
                        buf = buffers[i]  # updated in place through its local tensor
                    self.state[params[i]]["momentum_buffer"] = buf
        return loss
