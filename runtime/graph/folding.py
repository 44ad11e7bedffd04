"""Constant folding for the lowered program: values made from shapes and buffers only.

trace -> cost -> solve -> plan -> **run**. A causal mask or the rotary cos/sin depend on no
graph input and no trainable parameter; the lowered program (runtime/graph/spmd.py replaying
runtime/graph/lowering.py's steps) computes them on its first call and serves the folded values
after that, until a buffer they are made from changes.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from meshplan.runtime.graph.pipeline_split import shape_only_nodes

FOLD_LIMIT_BYTES = 256 * 2**20  # folded constants held beyond a call (masks, rotary tables)


def constant_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose values depend on no graph input and no trainable parameter (a causal
    mask, rotary cos/sin): runtime/graph/pipeline_split.py's rule, with frozen parameters (the
    runtime's placed buffers) read as buffers. ``gm``'s attributes must be the parameters
    the program runs with."""
    nodes = shape_only_nodes(gm.graph, frozen_params=True)
    return nodes | {a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}


class ConstantFolder:
    """Which nodes are constant, their folded values, and when those must be computed again.

    A replay asks ``begin()`` whether it computes the constants (``collecting``), takes each
    constant node's value from ``value``, calls ``stop()`` when the call ends and ``done()``
    after a collecting call that succeeded."""

    def __init__(self, gm: fx.GraphModule, fetch_attr):
        self.gm = gm
        self.fetch_attr = fetch_attr  # attribute target -> the value the program runs with
        self.constant: set = set()  # nodes computed from shapes and buffers only
        self.folded: dict = {}  # constant node read by a non-constant one -> its local value
        self._folded_from: list = []  # (weak buffer, version) the folded values come from
        self.collecting = False  # this call computes the constants (and folds them)

    def find(self) -> None:
        self.constant = constant_nodes(self.gm)

    def _sources(self) -> list:
        """(tensor, version, requires_grad) of every buffer the constants read."""
        out = []
        for g in self.gm.graph.find_nodes(op="get_attr"):
            if g in self.constant:
                value = self.fetch_attr(g.target)
                if isinstance(value, torch.Tensor):
                    local = value._local_tensor if isinstance(value, DTensor) else value
                    out.append((local, local._version, value.requires_grad))
        return out

    def begin(self) -> bool:
        """True if this call computes the constant values (first replay, or a buffer they
        are made from was replaced or written in place, e.g. by a checkpoint load); else
        the folded ones serve. A write through ``.data`` bumps no version: call
        ``refold()`` after one. A frozen parameter made trainable makes the constants be
        found again."""
        self.collecting = self._check()
        return self.collecting

    def _check(self) -> bool:
        if not self.constant:
            return False
        now = self._sources()
        if any(grad for _, _, grad in now):
            self.find()
            now = self._sources()
        if self.folded and len(now) == len(self._folded_from) and all(
                ref() is t and v == version for (t, version, _), (ref, v) in
                zip(now, self._folded_from)):
            return False
        self.folded = {}
        return bool(self.constant)

    def refold(self) -> None:
        """Compute the folded constants again on the next call."""
        self.folded = {}

    def value(self, n: fx.Node, compute):
        """The value of constant node ``n``: folded, or ``compute()``d (and kept where a
        non-constant node reads it) on a collecting call."""
        if not self.collecting:
            return self.folded.get(n)  # None for values only other constants read
        value = compute()
        if any(u not in self.constant for u in n.users):
            self.folded[n] = value.detach() if isinstance(value, torch.Tensor) else value
        return value

    def stop(self) -> None:
        """The call is over (or failed): no more collecting."""
        self.collecting = False

    def done(self) -> None:
        """A collecting call succeeded: keep what it folded, if small enough."""
        size = sum(v.numel() * v.element_size() for v in self.folded.values()
                   if isinstance(v, torch.Tensor))
        if size > FOLD_LIMIT_BYTES:  # not worth holding: compute them every call
            self.constant, self.folded = set(), {}
            return
        self._folded_from = [(weakref.ref(t), v) for t, v, _ in self._sources()]
