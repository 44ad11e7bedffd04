"""Kill and resume: a run killed after a checkpoint and resumed continues with exactly the
losses of an uninterrupted run (parameters, optimizer state and step counter restored).

The plan is ZeRO-3 on 2 processes, so parameters and Adam moments are sharded DTensors in
the checkpoint. Three launches through ``meshplan run``'s launcher, once for the module: an
uninterrupted run, a run whose rank 1 dies before step 3 (after the step-2 checkpoint), and
its resumption. The killed run is also the rank-failure check (tests/test_failures.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from meshplan.mesh import Mesh
from meshplan.planner.assemble import propagate_batch_sharding
from meshplan.tracing import trace
from tests.harness.variants import unpriced_plan, with_param_placements
from meshplan.specs import example_inputs, parse_model_spec

MODEL = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
STEPS = 4


def zero3_plan(path) -> None:
    meta = parse_model_spec(MODEL).build(device="meta")
    graph = trace(meta, example_inputs(meta, 8, 16))
    plan = with_param_placements(unpriced_plan(graph, Mesh((2,), Mesh.local(2).hardware, ("dp",))),
                                 tp_axis=None, dp_axis=0, zero=3)
    ops = propagate_batch_sharding(graph, ("S(0)",))  # weights all-gathered before use
    plan = replace(plan, stages=(replace(plan.stages[0], ops=ops),))
    plan.to_json(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from meshplan.runtime.launch import run_plan

    tmp = tmp_path_factory.mktemp("ckpt")
    plan = str(tmp / "plan.json")
    zero3_plan(plan)
    out = {}
    out["full_code"] = run_plan(plan, model=MODEL, steps=STEPS, metrics_out=str(tmp / "full.json"))
    ckpt = ("--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "2")
    start = time.perf_counter()
    out["killed_code"] = run_plan(plan, model=MODEL, steps=STEPS,
                                  extra=ckpt + ("--fail-at-step", "3", "--fail-rank", "1"))
    out["killed_s"] = time.perf_counter() - start
    out["resumed_code"] = run_plan(plan, model=MODEL, steps=STEPS,
                                   metrics_out=str(tmp / "resumed.json"), extra=ckpt)
    for name in ("full", "resumed"):
        with open(tmp / f"{name}.json") as f:
            out[name] = json.load(f)
    out["checkpoints"] = sorted(p.name for p in (tmp / "ckpt").iterdir())
    return out


def test_killed_run_fails_and_leaves_last_checkpoint(runs):
    assert runs["full_code"] == 0
    assert runs["killed_code"] != 0
    assert runs["checkpoints"][0] == "step_000002"


def test_resumed_run_continues_with_the_uninterrupted_losses(runs):
    assert runs["resumed_code"] == 0
    # the kill came before step 3, after the step-2 checkpoint: resume runs steps 2 and 3
    assert runs["resumed"]["first_step"] == 2
    assert runs["resumed"]["losses"] == runs["full"]["losses"][2:]  # bit-identical
