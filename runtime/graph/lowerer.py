"""Building the lowered program: each operator of the reference run tried on local shards.

trace -> cost -> solve -> plan -> **run**. On its first call the SPMD executor
(runtime/graph/spmd.py) runs the DTensor reference once, without gradients; for every operator a
``Lowerer`` records the redistributions it made and tries the local forms of
runtime/graph/lowering.py (``aten`` on local shards, the whole ``call``, or the ``recorded``
decomposition DTensor dispatched) against the reference's local output. What reproduces it
on every rank becomes that operator's ``Step``; the rest stay on DTensor (``kind ==
"dtensor"``, with ``why``).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshplan.runtime.graph import lowering
from meshplan.runtime.graph.placing import written_buffers


class Lowerer:
    """The steps (node -> lowering.Step) and value specs (node -> DTensorSpec structure)
    of one reference run, filled as it goes."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.steps: dict = {}
        self.specs: dict = {}

    def note(self, n: fx.Node, out) -> None:
        """A node that is no operator (placeholder, get_attr): only its spec is kept."""
        self.specs[n] = lowering.spec_tree(out)

    def call(self, n: fx.Node, env: dict, moved: dict, call):
        """``call()`` (the operator on DTensor) with what lowering needs recorded: the
        decomposition DTensor dispatched, and the buffers it updated in place.
        Returns (output, trial) for ``lower``."""
        recorder = lowering.Recorder()
        written = written_buffers(n, env, moved)
        before = {a: t.clone() for a, t in written.items()}
        with recorder:
            out = call()
        updates = {a: (written[a], before[a], t.clone()) for a, t in written.items()}
        return out, (recorder.calls, updates)

    def lower(self, n: fx.Node, env: dict, moved: dict, args, kwargs, settled, out,
              trial) -> None:
        """Make ``n``'s step: the first local form that reproduces ``settled`` (the
        reference's output as its consumers take it) on every rank, else DTensor."""
        calls, updates = trial
        calls = calls if settled is out else None
        moves = {a: (env[a]._spec, v._spec) for a, v in moved.items()
                 if isinstance(v, DTensor) and v is not env[a]}
        step = lowering.Step(n, moves, lowering.spec_tree(settled))
        self.specs[n] = step.out_spec
        self.steps[n] = step
        target = n.target
        mutable = isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable
        specs = pytree.tree_leaves(step.out_spec, is_leaf=lambda x: x is None)
        ok = not mutable and target not in lowering.KEEP_ON_DTENSOR and all(
            lowering.plain(p) for spec in specs if spec is not None for p in spec.placements)
        # Every attempt's verdict is agreed by the mesh before the next: all ranks then try
        # the same attempts and issue the same collectives (a lookup outside a rank's vocab
        # shard fails on some ranks only).
        if ok:
            kind = "aten" if lowering.aten_step(step, n, args, kwargs) else "call"
            # a composite run whole on local shards cannot partition or reduce inside
            # itself; where DTensor's decomposition does, only the recorded one is exact
            if kind == "call" and calls and lowering.partitions_or_reduces(calls):
                ok, step.why = False, "call: DTensor partitions or reduces inside it"
            else:
                ok = self._try(step, moved, settled, kind, updates)
            if not ok and calls:
                recorded = lowering.record_steps(calls, moved, settled)
                if recorded is not None:
                    step.subs, step.result = recorded
                    step.kind = "recorded"
                    ok = lowering.agree_across(self.mesh, [same_updates(
                        updates, lambda: lowering.check_recorded(step, calls))])[0]
                    step.why = "" if ok else "its recorded decomposition differs from DTensor's"
        if not ok:
            step.kind = "dtensor"

    def _try(self, step, moved: dict, out, kind: str, updates: dict) -> bool:
        """Run ``step`` as ``kind`` on the reference's local inputs; True if it reproduces
        the reference's local output and its in-place buffer updates (``updates``)."""
        step.kind = kind
        if kind == "call":
            step.extra = lowering.broadcast_moves(step.node, moved, out)
        run = {"aten": lowering.run_aten, "call": lowering.run_call,
               "recorded": lowering.run_recorded}[kind]
        local = {a: lowering.local_tree(v) for a, v in moved.items()}
        try:  # moves come first in run(), so a local failure skips no collective
            ok = same_updates(updates, lambda: lowering.agrees(run(step, local.__getitem__), out))
            step.why = "" if ok else f"its local result ({kind}) differs from DTensor's"
        except Exception as exc:  # noqa: BLE001 - the local call does not reproduce DTensor
            ok = False
            step.why = f"{kind}: {type(exc).__name__}: {exc}"
        return lowering.agree_across(self.mesh, [ok])[0]


def same_updates(updates: dict, attempt) -> bool:
    """``attempt()`` (a lowering trial that may update buffers in place) run from the
    buffers as the reference found them; True if it also left them as the reference did.
    The buffers end as the reference left them. ``updates``: node -> (local tensor,
    before, after)."""
    with torch.no_grad():
        for t, before, _ in updates.values():
            t.copy_(before)
        try:
            ok = attempt()
            return ok and all(lowering.agrees(t, after) for t, _, after in updates.values())
        finally:
            for t, _, after in updates.values():
                t.copy_(after)
