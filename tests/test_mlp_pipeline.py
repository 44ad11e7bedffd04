"""Issue 42: a user's ``nn.Sequential`` MLP classifier (activation modules between the
layers, float features, ``F.cross_entropy`` as ``loss_fn``, AdamW, clipping at 0.5) trained
through the public API in the user's own loop on 4 gloo processes equals one plain-PyTorch
process: the loss at every step, every gradient at every step, the gradient norms, the eval
outputs and the final weights (tests/harness/equivalence.py's rule). The worker is
tests/_mlp_pipeline_worker.py; one launch runs every case."""

import pytest

from _launch import forked_run
from _mlp_pipeline_worker import (BATCH, CASES, CLIP, LR, STEPS, batch, build, initial_state)
from tests.harness.equivalence import assert_equivalent, expected

_GOT: dict = {}


@pytest.fixture(scope="module")
def got(tmp_path_factory):
    if not _GOT:
        import torch
        root = tmp_path_factory.mktemp("mlp-pipeline")
        out = root / "cells.pt"
        forked_run("tests/_mlp_pipeline_worker.py", [str(out), ",".join(CASES)], 4, 600,
                   root / "logs")
        _GOT.update(torch.load(out))
    return _GOT


@pytest.fixture(scope="module")
def reference():
    import torch.nn.functional as F

    def start():
        model = build()
        model.load_state_dict(initial_state())
        return model
    return expected(start, [batch(s) for s in range(STEPS)], lambda m, b: m(b[0]),
                    lambda out, b: F.cross_entropy(out, b[1]),
                    optimizer=lambda params: __import__("torch").optim.AdamW(params, lr=LR),
                    clip=CLIP, eval_batch=batch(STEPS))


@pytest.mark.parametrize("case", list(CASES))
def test_sequential_mlp_classifier_equals_one_process(got, reference, case):
    """Each layout: losses, norms, gradients (every step), eval outputs and weights equal;
    the pipeline layouts run on the module engine (the stages cut from the Sequential keep
    their activation modules)."""
    cell = got[case]
    assert BATCH % 2 == 0
    assert_equivalent(cell, reference, f"{case} [{cell.get('layout', '')}]",
                      fields=("losses", "norms", "grads", "eval", "weights"),
                      same_weight_keys=True)
    if case.startswith("dp2xpp2"):
        assert cell["layout"].startswith("modules engine, 2 stage(s)"), cell["layout"]


# -- the structural self-check at plan time (no process group) --------------------------------

def _pipeline_plan(**options):
    import torch
    import torch.nn.functional as F
    import meshplan

    with torch.device("meta"):
        model = build()
    x, y = batch(0)
    plan = meshplan.manual_plan(model, "local:4", (x.to("meta"),), example_targets=(
        y.to("meta"),), loss_fn=F.cross_entropy, **{**CASES["dp2xpp2-mb8"], **options})
    return model, plan


def _blocks_only(holder, keys, ranges):
    """The stage cut before the fix: each stage keeps its blocks, not the activations
    between them."""
    return [tuple(keys[a:b]) for a, b in ranges]


def test_self_check_refuses_a_stage_cut_that_drops_activations(monkeypatch):
    """With the fix reverted (stages keep only their nn.Linear blocks: the GELUs dropped, the
    shapes unchanged, so only the operators tell), the plan is refused for the module
    engine when it is made, in one line naming the dropped module, and goes to the graph
    engine; engine='modules' is refused with that line. With the fix the stages' operators
    equal the model's and the module engine runs the plan."""
    import meshplan
    from meshplan.runtime import module_pipeline
    from meshplan.runtime.module_engine import module_engine_refusal

    model, plan = _pipeline_plan()
    assert plan.engine == "modules" and module_engine_refusal(plan, model) is None
    monkeypatch.setattr(module_pipeline, "_members", _blocks_only)
    why = module_engine_refusal(plan, model)
    assert why is not None and "\n" not in why
    assert "aten.gelu in module '1' (GELU) 0 time(s), the model's forward 1" in why, why
    assert "drops it" in why and why.endswith("the graph engine runs this plan")
    _, reverted = _pipeline_plan()
    assert reverted.engine == "graph" and "aten.gelu" in reverted.engine_note
    with pytest.raises(meshplan.NotSupportedError, match="aten.gelu in module '1'"):
        _pipeline_plan(engine="modules")


def test_self_check_refuses_a_stage_cut_that_repeats_a_module(monkeypatch):
    """A cut that gives the GELU between the stages to both stages (same shapes again)."""
    from meshplan.runtime import module_pipeline
    from meshplan.runtime.module_engine import module_engine_refusal

    model, plan = _pipeline_plan()
    monkeypatch.setattr(module_pipeline, "_members",
                        lambda holder, keys, ranges: [("0", "1", "2", "3"), ("3", "4")])
    why = module_engine_refusal(plan, model)
    assert why is not None and "aten.gelu in module '3' (GELU) 2 time(s)" in why, why
    assert "repeats it" in why
