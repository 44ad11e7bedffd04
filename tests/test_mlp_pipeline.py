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
