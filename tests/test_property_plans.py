"""Property: whatever plan ``meshplan.autoparallel`` picks for a generated model, running it
gives one process's numbers.

Hypothesis draws small models (a stack of biased nn.Linear layers of some depth and width,
optionally an embedding whose weight the head shares, optionally BatchNorm1d between
layers, GELU or tanh), global batch sizes (4, 8, 12) and a plan (autoparallel's, or a
manual dp / tp / dp x tp / dp x pp / ZeRO-1,2,3 layout), derandomized so every run draws
the same examples; they are dealt round-robin to meshes of 1, 2 and 4 local processes. One
torchrun launch per world size runs all of its examples (tests/_property_plans_worker.py):
plan -> parallelize -> two SGD steps; losses, every gradient (full tensors), the final full
state dict (BatchNorm buffers included) and the eval outputs of every rank must equal one
process (rtol 1e-5).
"""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from _launch import forked_results

WORKER = str(Path(__file__).with_name("_property_plans_worker.py"))
WORLDS = (1, 2, 4)
PER_WORLD = 12

MODELS = st.fixed_dictionaries({
    "depth": st.integers(1, 3),
    "width": st.sampled_from([8, 16, 32]),
    "tied": st.booleans(),
    "bn": st.booleans(),
    "act": st.sampled_from(["gelu", "tanh"]),
    "in_dim": st.sampled_from([4, 8]),
    "classes": st.sampled_from([8, 12]),
    "batch": st.sampled_from([4, 8, 12]),
    "seed": st.integers(0, 2**16),
    # autoparallel's choice, or a manual layout (tests/_property_plans_worker.manual_layout)
    "plan": st.sampled_from(["auto", "auto", "auto", "dp", "tp", "dp_tp", "pp", "zero1",
                             "zero2", "zero3"]),
})


def draw_examples(n: int) -> list[dict]:
    """``n`` distinct examples, the same on every run (derandomize)."""
    drawn: list[dict] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(MODELS)
    def collect(ex):
        if ex not in drawn:
            drawn.append(ex)
    collect()
    return drawn


@pytest.fixture(scope="module")
def examples() -> dict[int, list[dict]]:
    drawn = draw_examples(PER_WORLD * len(WORLDS))
    return {w: drawn[i::len(WORLDS)] for i, w in enumerate(WORLDS)}


def test_examples_cover_the_space(examples):
    flat = [ex for exs in examples.values() for ex in exs]
    assert len(flat) >= 2 * len(WORLDS)
    for key in ("tied", "bn"):
        assert {ex[key] for ex in flat} == {True, False}, key
    assert {ex["batch"] for ex in flat} == {4, 8, 12}


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
def test_auto_plans_equal_one_process(world, examples, tmp_path):
    (tmp_path / "examples.json").write_text(json.dumps(examples[world]))
    results = forked_results(WORKER, tmp_path / "out.pt", nproc=world, timeout=900)
    assert len(results) == len(examples[world])
    failed = [r for r in results if r["problems"]]
    skipped = [r for r in results if r["skipped"]]
    print(f"\nworld {world}: {len(results)} examples, {len(results) - len(skipped)} run, "
          f"{len(results) - len(skipped) - len(failed)} passed, {len(skipped)} skipped "
          "(layout refused by manual_plan)")
    for r in results:
        state = "FAIL" if r["problems"] else "skip" if r["skipped"] else "ok  "
        print(f"  {state} {r['layout'] or r['skipped']}  {r['example']}")
    assert len(skipped) <= len(results) // 2, "most manual layouts were refused"
    assert not failed, "\n".join(
        f"{r['example']} [{r['layout']}]: " + " | ".join(r["problems"][:4]) for r in failed)


def test_one_dimensional_input_plans():
    """Found by the property run: a model whose first input is 1-D (one token id per row)
    made the pipeline search's stage cost unpack (batch, seq) from its shape and raise."""
    import torch
    import torch.nn as nn
    import meshplan

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(8, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))
    ids = torch.zeros(8, dtype=torch.long, device="meta")
    plan = meshplan.autoparallel(model, meshplan.Mesh.local(2), example_inputs=(ids,),
                                 example_targets=(ids,),
                                 loss_fn=lambda out, y: nn.functional.cross_entropy(out, y))
    assert plan.training.global_batch == 8 and plan.training.seq_len == 1
