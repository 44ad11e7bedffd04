"""Peak live tensor bytes of one training step on this rank: what the cost model predicts.

trace -> cost -> solve -> plan -> **run** (measurement). The cost model predicts a rank's
peak memory as parameters + gradients + optimizer state + activations + buffers, all
counted as tensor bytes (costmodel/memory.py). Process RSS growth measures something else
(allocator caches, the full-size model the worker builds before sharding it, library
buffers), so ``meshplan run`` reports this probe beside RSS.

``StepMemoryProbe`` counts every distinct tensor storage that is alive during the step:
- at entry, the storages of the tensors it is given (the rank's parameter shards, master
  weights, gradients and optimizer state: ``training_state_tensors``);
- during the step, every storage an operator returns, seen by a ``TorchDispatchMode``
  (a DTensor output counts its local shard; collectives' buffers are plain tensors and are
  seen directly). A storage stops counting when it is freed (a weak reference to it dies).
``peak_bytes`` is the largest total reached. Temporaries that an operator allocates and
frees inside one kernel (never returned) are not seen, as the cost model does not price them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding the bytes: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


class StepMemoryProbe(TorchDispatchMode):
    """Context manager: ``with StepMemoryProbe(state) as probe: step()``; then
    ``probe.peak_bytes`` (and ``probe.start_bytes``, the state it was given)."""

    def __init__(self, state: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, int] = {}  # storage key -> bytes
        self._refs: dict[int, object] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        for t in state:
            self._track(t)
        self.start_bytes = self.current_bytes

    # -- bookkeeping --------------------------------------------------------------------
    def _track(self, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        t = _local(t)
        if t.device.type == "meta" or type(t) is not torch.Tensor and \
                not isinstance(t, torch.nn.Parameter):
            return  # wrapper subclasses own no storage of their own
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        nbytes = storage.nbytes()
        if nbytes == 0 or storage.data_ptr() == 0:
            return
        key = storage.data_ptr()
        if key in self._live:
            return
        try:
            ref = weakref.ref(storage, lambda _r, key=key: self._free(key))
        except TypeError:  # storage wrappers without weak references: hold the tensor's
            ref = weakref.ref(t, lambda _r, key=key: self._free(key))
        self._live[key] = nbytes
        self._refs[key] = ref
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self._refs.pop(key, None)
        self.current_bytes -= nbytes

    # -- the dispatch hook ----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            self._track(leaf)
        return out


def training_state_tensors(pm, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a rank keeps between steps: parameters (model and optimizer copies, as
    local shards), their gradients and the optimizer state."""
    out: list[torch.Tensor] = []
    params = list(pm.unique_params()) + [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        out.append(p)
        if p.grad is not None:
            out.append(p.grad)
    for state in optimizer.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return out
