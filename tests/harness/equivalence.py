"""The runtime tests' one equivalence harness: the layouts they share, the launch, the
single-process reference trainer and the tolerance rule.

trace -> cost -> solve -> plan -> **run**. A runtime test trains a model on gloo processes
(``launch``: the worker file forked from one server process, tests/_launch.py) in one of
the ``LAYOUTS``, and compares what the workers recorded with ``expected(...)``: the same
steps in one plain process, in fp32 and in fp64. The tolerance rule, the house rule of
/work/shared/STYLE.md, is one for every test: each compared quantity may differ from the
fp32 reference by 10x the fp32 reference's own error against fp64 (max |fp32 - fp64| over
the quantity), and at least by a floor: 1e-5 on losses and gradient norms, 1e-6 on
gradients, 1e-4 on weights and outputs. ``check`` lists what differs beyond it (empty:
equal); ``assert_equivalent`` fails with that list.

The recorded quantities (a worker returns those it has, under these names):
``losses`` (a float per step), ``norms`` (the global gradient norm per step, before
clipping), ``grads`` (per step: {parameter name: full gradient}; a dict {step: ...} when only
some steps are kept), ``weights`` (the final full state dict) and ``eval`` (outputs of the
trained model in eval mode).

Run as ``python -m tests.harness.equivalence`` it is the graph engine's variant worker
(tests/harness/graph_variants.py), as before the harness moved here.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_map

from tests._launch import forked_results, forked_run, torchrun_results  # noqa: F401 - re-exported

# the tolerance floors (the house rule, /work/shared/STYLE.md: 1e-5 on losses, 1e-4 on
# weights; gradient norms are losses' scale; gradients get 1e-6, the atol the runtime tests
# held gradients to before this harness, so no gradient check got looser)
LOSS_FLOOR, NORM_FLOOR, GRAD_FLOOR, WEIGHT_FLOOR, EVAL_FLOOR = 1e-5, 1e-5, 1e-6, 1e-4, 1e-4
FACTOR = 10  # x the fp32 reference's own error against fp64

# -- the layouts ------------------------------------------------------------------------------
# A name is mesh axes joined by "x" (dp, tp, pp, cp with their sizes), then "+" options:
# sp (sequence parallel), zero0/1/2/3, full/selective (recompute), bf16, gpipe/1f1b/interleaved
# (the pipeline schedule; interleaved has 2 virtual stages), mbN (microbatch size N).
_AXES = ("dp", "tp", "pp", "cp")
_OPTIONS = {"sp": dict(sequence_parallel=True), "bf16": dict(dtype="bf16"),
            **{f"zero{z}": dict(zero=z) for z in range(4)},
            "full": dict(recompute="full"), "selective": dict(recompute="selective"),
            "gpipe": dict(schedule="gpipe"), "1f1b": dict(schedule="1f1b"),
            "interleaved": dict(schedule="interleaved-1f1b", virtual_stages=2)}


def parse_layout(name: str) -> dict:
    """``manual_plan`` keyword arguments of a layout name: ``parse_layout("cp2xtp2+sp")`` is
    ``dict(cp=2, tp=2, sequence_parallel=True)``."""
    axes, *options = name.split("+")
    out: dict = {}
    for part in axes.split("x"):
        m = re.fullmatch(r"(dp|tp|pp|cp)([1-9][0-9]*)", part)
        if not m or m.group(1) in out:
            raise ValueError(f"layout {name!r}: axis {part!r} is not dpN, tpN, ppN or cpN "
                             "(each once, joined by 'x')")
        out[m.group(1)] = int(m.group(2))
    for opt in options:
        m = re.fullmatch(r"mb([1-9][0-9]*)", opt)
        if m:
            out["microbatch_size"] = int(m.group(1))
        elif opt in _OPTIONS:
            out.update(_OPTIONS[opt])
        else:
            raise ValueError(f"layout {name!r}: option {opt!r} is not one of "
                             f"{', '.join(_OPTIONS)} or mbN")
    return out


# The layouts the runtime tests train, each on 4 gloo processes.
LAYOUTS = {name: parse_layout(name) for name in (
    # data, tensor, sequence parallel and ZeRO on one stage
    "dp4", "dp4+zero0", "dp4+zero2", "dp4+zero3", "dp4+mb1", "tp4", "tp4+full", "dp2xtp2",
    "dp2xtp2+sp", "dp2xtp2+zero1+selective", "dp2xtp2+zero3+bf16",
    # pipelines
    "dp2xpp2", "dp2xpp2+gpipe", "dp2xpp2+1f1b", "dp2xpp2+interleaved", "dp2xpp2+zero1",
    "dp2xpp2+zero3", "dp2xpp2+full", "dp2xpp2+bf16", "tp2xpp2", "tp2xpp2+sp", "tp2xpp2+bf16",
    # context parallel
    "cp4", "cp2xdp2", "cp2xdp2+zero1", "cp2xdp2+zero3", "cp2xdp2+full+zero1",
    "cp2xdp2+full+zero2", "cp2xtp2", "cp2xtp2+sp", "cp2xpp2+mb1", "cp2xpp2+mb2")}


def layout(name: str) -> dict:
    """The ``manual_plan`` options of one of the shared ``LAYOUTS`` (a fresh dict)."""
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r} is not in tests/harness/equivalence.py LAYOUTS: "
                         "add it there, so that the runtime tests share one list")
    return dict(LAYOUTS[name])


def devices(name: str) -> int:
    """The processes a layout spans."""
    return math.prod(v for k, v in parse_layout(name).items() if k in _AXES)


# -- the reference: one plain process ---------------------------------------------------------

def _cast(tree, dtype):
    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and
                    x.is_floating_point() else x, tree)


def train_reference(build: Callable[[], torch.nn.Module], batches, forward: Callable,
                    loss: Callable | None = None, *,
                    optimizer: Callable | None, schedule: Callable | None = None,
                    clip: float | None = None, eval_batch=None, dtype=torch.float32,
                    autocast=None, step_last: bool = True) -> dict:
    """Train ``build()`` (the seeded model, fp32, on the CPU) in one process.

    ``batches``: one batch per step (any tree of tensors; floating ones are cast to
    ``dtype``); ``forward(model, batch)``: the outputs, run under ``autocast`` (a dtype, for
    bf16 plans) if given; ``loss(outputs, batch)``: the scalar loss (None: ``forward``
    returns it); ``optimizer(params)`` (None: the weights stay, gradients are cleared) and
    ``schedule(optimizer)``: as the workers make them; ``clip``: clip_grad_norm_'s max norm
    (None: no clipping); ``eval_batch``: a batch whose ``forward`` outputs after training,
    the model in eval mode, are recorded as ``eval``; ``step_last=False``: the last batch
    only runs forward and backward (its loss and gradients recorded, no optimizer step):
    the pipeline tests' "N steps, then one more forward/backward"."""
    from contextlib import nullcontext

    model = build().to(dtype)
    opt = optimizer(model.parameters()) if optimizer is not None else None
    sched = schedule(opt) if schedule is not None else None
    out = {"losses": [], "norms": [], "grads": []}
    for step, batch in enumerate(batches):
        batch = _cast(batch, dtype)
        with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
            outputs = forward(model, batch)
        value = outputs if loss is None else loss(outputs, batch)
        value.backward()
        out["losses"].append(float(value.detach()))
        out["grads"].append({n: p.grad.detach().clone() for n, p in
                             model.named_parameters(remove_duplicate=False)
                             if p.grad is not None})
        live = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(live, clip) if clip is not None else \
            torch.nn.utils.get_total_norm([p.grad for p in live])
        out["norms"].append(float(norm))
        if not step_last and step == len(batches) - 1:
            break
        if opt is not None:
            opt.step()
        if sched is not None:
            sched.step()
        model.zero_grad()
    out["unique"] = {n for n, _ in model.named_parameters()}
    out["weights"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if eval_batch is not None:
        model.eval()
        with torch.no_grad():
            out["eval"] = forward(model, _cast(eval_batch, dtype))
        model.train()
    return out


# -- the tolerance rule -----------------------------------------------------------------------

def _f64(x) -> torch.Tensor:
    """A tensor, or a list of floats / 0-d tensors (per-step values), as float64."""
    if isinstance(x, (list, tuple)):
        return torch.tensor([float(v) for v in x], dtype=torch.float64)
    return torch.as_tensor(x).detach().to(torch.float64)


def _err(a, b) -> float:
    a, b = _f64(a), _f64(b)
    return float((a - b).abs().max()) if a.numel() else 0.0


def _tol(a, b, floor: float) -> float:
    return max(FACTOR * _err(a, b), floor)


@dataclass(frozen=True)
class Expected:
    """The fp32 reference and, for each quantity, how far a run may be from it."""
    ref: dict
    tol: dict


def tolerances(r32: dict, r64: dict) -> Expected:
    """The rule: 10x the fp32 reference's own error against fp64, with the floors (for the
    quantities the references recorded)."""
    tol = {}
    for field, floor in (("losses", LOSS_FLOOR), ("norms", NORM_FLOOR), ("eval", EVAL_FLOOR)):
        if field in r32:
            tol[field] = _tol(r32[field], r64[field], floor)
    if "grads" in r32:
        tol["grads"] = [{k: _tol(g, g64[k], GRAD_FLOOR) for k, g in gs.items()}
                        for gs, g64 in zip(r32["grads"], r64["grads"])]
    if "weights" in r32:
        tol["weights"] = {k: _tol(v, r64["weights"][k], WEIGHT_FLOOR)
                          for k, v in r32["weights"].items() if v.is_floating_point()}
    return Expected(r32, tol)


def expected(build, batches, forward, loss=None, **options) -> Expected:
    """``train_reference`` in fp32 and fp64, and the tolerance rule between them."""
    return tolerances(train_reference(build, batches, forward, loss, **options),
                      train_reference(build, batches, forward, loss, dtype=torch.float64,
                                      **options))


FIELDS = ("losses", "norms", "grads", "weights", "eval")


def check(got: dict, exp: Expected, *, fields: tuple | None = None,
          eval_rows: slice | None = None, grad_names: str = "unique",
          same_weight_keys: bool = False) -> list[str]:
    """What in ``got`` differs from the reference beyond the rule (empty: equal).

    ``fields``: what to compare (default: all the reference recorded); each must be in
    ``got``.
    Gradients: the parameter names must be the reference's, a tied parameter once
    (``grad_names="unique"``), under each of its names (``"all"``) or either way
    (``"either"``). Weights: every reference entry
    must be there (``same_weight_keys``: and no other), floating ones within the rule, the
    others equal. ``eval_rows``: the reference's rows the run's outputs are (one rank's)."""
    ref, tol, bad = exp.ref, exp.tol, []
    fields = tuple(f for f in FIELDS if f in ref) if fields is None else fields
    if "error" in got:
        return [f"run failed: {got['error']}"]

    def close(what, a, b, atol):
        a, b = _f64(a), _f64(b)
        if a.shape != b.shape:
            bad.append(f"{what}: shape {list(a.shape)} != {list(b.shape)}")
            return
        diff = _err(a, b)
        if not diff <= atol:  # NaN fails too
            bad.append(f"{what}: max |diff| {diff:.3g} > {atol:.3g}")
    for field in fields:
        if field not in got:
            bad.append(f"{field}: not recorded by the run")
            continue
        if field in ("losses", "norms"):
            close(field, got[field], ref[field], tol[field])
        elif field == "eval":
            want = ref["eval"] if eval_rows is None else ref["eval"][eval_rows]
            close("eval outputs", got["eval"], want, tol["eval"])
        elif field == "grads":
            steps = got["grads"].items() if isinstance(got["grads"], dict) else \
                enumerate(got["grads"])
            for step, grads in steps:
                want = ref["grads"][step]
                names = set(grads)
                ok = {"unique": names == ref["unique"], "all": names == set(want),
                      "either": ref["unique"] <= names <= set(want)}[grad_names]
                if not ok:
                    bad.append(f"step {step} gradient names differ: "
                               f"{sorted(names ^ ref['unique'])[:4]}")
                for name in names & set(want):
                    close(f"step {step} grad {name}", grads[name], want[name],
                          tol["grads"][step][name])
        elif field == "weights":
            have, want = got["weights"], ref["weights"]
            if not set(want) <= set(have) or (same_weight_keys and set(want) != set(have)):
                bad.append(f"weight names differ: {sorted(set(want) ^ set(have))[:4]}")
            for k, w in want.items():
                if k not in have:
                    continue
                if w.is_floating_point():
                    close(f"weight {k}", have[k], w, tol["weights"][k])
                elif not torch.equal(have[k].to(w.dtype), w):
                    bad.append(f"{k}: {have[k].tolist()} != {w.tolist()}")
        else:
            raise ValueError(f"unknown field {field!r}")
    return bad


def assert_equivalent(got: dict, exp: Expected, what: str = "", **options) -> None:
    bad = check(got, exp, **options)
    assert not bad, f"{what}: " + "; ".join(bad[:8]) + (
        f" (and {len(bad) - 8} more)" if len(bad) > 8 else "") + \
        ("\n" + got.get("traceback", "")[-3000:] if got.get("traceback") else "")


if __name__ == "__main__":
    from tests.harness.graph_variants import main

    sys.exit(main())
