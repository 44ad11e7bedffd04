"""Issue 42: ``meshplan run`` of T5's automatic plan on local:4 (CLI, synthetic data) failed
"keyword input decoder_input_ids has shape [2, 32]; this rank (data-parallel rank 0 of 4)
expects its shard of shape [8, 32]". The synthetic data was right (every rank takes its rows
of every input, as the module engine runs them); the plan's input placements left the decoder
ids and labels replicated over the data-parallel axis (the search's per-operator choice,
which the module engine does not follow), and the runtime's shape check followed them. Now
the module engine splits every input wherever the first one is split, and the run trains
as one plain PyTorch process does: losses and gradient norms, step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.runtime.engine import split_over_dp
from meshplan.specs import parse_model_spec

T5 = "transformers:t5?d_model=64&d_ff=128&num_layers=2&num_heads=4&vocab_size=256&d_kv=16"
BATCH, SEQ, STEPS, LR, CLIP = 8, 32, 3, 1e-3, 1.0


@pytest.fixture(scope="module")
def t5_plan(tmp_path_factory):
    """T5's automatic plan on local:4, as the user made it; its input placements as the search
    left them at the time of the issue (decoder ids and labels replicated over the
    data-parallel axis), written so whatever the search picks later, this case is held."""
    path = tmp_path_factory.mktemp("t5") / "plan.json"
    assert main(["plan", "--model", T5, "--mesh", "local:4", "--batch", str(BATCH), "--seq",
                 str(SEQ), "-o", str(path)]) == 0
    data = json.loads(path.read_text())
    stage = data["stages"][0]
    dims = len(stage["mesh_shape"])  # [4] (dp) or [4, 1] (dp, tp): data parallelism either way
    assert data["engine"] == "modules" and stage["mesh_shape"][0] == 4 and \
        stage["axis_names"][0] == "dp" and all(d == 1 for d in stage["mesh_shape"][1:])
    rest = ["R"] * (dims - 1)
    stage["inputs"] = {"inputs_0": ["S(0)", *rest], "inputs_1": ["R", *rest],
                       "inputs_2": ["R", *rest]}
    path.write_text(json.dumps(data))
    return path


def test_module_engine_splits_every_input_where_the_first_is_split(t5_plan):
    plan = Plan.from_json(t5_plan)
    assert [split_over_dp(plan, r) for r in plan.model.inputs] == [True, True, True]


def _one_process(plan: Plan, seed: int):
    """Plain PyTorch on one process: the worker's model (same seed), synthetic batches and
    optimizer (torch.optim.Adam at --lr, the global norm clipped to --clip)."""
    torch.manual_seed(seed)
    loaded = parse_model_spec(T5).load_for_plan(plan, device="cpu")
    model = loaded.model
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False)
    losses, norms = [], []
    for step in range(STEPS):
        call = loaded.synthetic(seed=seed, step=step)
        logits = model(**call.inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 call.targets[0].reshape(-1))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.slow
def test_t5_automatic_plan_runs_on_local4_as_one_process(t5_plan, tmp_path):
    metrics = tmp_path / "metrics.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-m", "meshplan.cli", "run", str(t5_plan),
                           "--steps", str(STEPS), "--lr", str(LR), "--clip", str(CLIP),
                           "--metrics-out", str(metrics)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(metrics.read_text())
    losses, norms = _one_process(Plan.from_json(t5_plan), seed=0)
    # the harness's floors (tests/harness/equivalence.py): 1e-5 on losses and gradient norms
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(norms),
                               rtol=1e-5, atol=1e-5)
    assert len(set(got["losses"])) == STEPS  # it trained: every step's loss differs
