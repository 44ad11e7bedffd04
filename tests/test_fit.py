"""``meshplan fit`` / ``meshplan.fit``: the fewest nodes on which some layout fits, and the
fastest layouts on a mesh, each checked against the plan ``manual_plan`` builds for the same
layout (what ``plan --manual ... --engine torchtitan`` prices) and against every layout of
the node counts below the answer."""

from __future__ import annotations

import pytest

import meshplan
from meshplan import fitting
from meshplan.cli import main
from meshplan.specs import parse_manual_spec, parse_model_spec

# a Llama of 16 wide blocks: ~57 B parameters, ~850 GiB of bf16 weights, fp32 gradients and
# Adam state, more than one 8 x 80 GB node holds, so the answer is above one node
WIDE = ("transformers:llama?hidden_size=16384&intermediate_size=53248&num_hidden_layers=16"
        "&num_attention_heads=128&num_key_value_heads=8&vocab_size=32000"
        "&max_position_embeddings=8192")
SMALL = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=4"
         "&num_attention_heads=16&num_key_value_heads=16&vocab_size=2048"
         "&max_position_embeddings=4096")


def _loaded(spec, batch, seq):
    parsed = parse_model_spec(spec)
    loaded = parsed.load(batch, seq, device="meta")
    return loaded.model, loaded.trace(spec)


def test_doubling_then_bisection_finds_the_threshold(monkeypatch):
    """The node search on a predicate that fits from 5 nodes up: 1, 2, 4 do not, 8 does,
    then the gap is bisected (6, 5) down to 5."""
    monkeypatch.setattr(fitting, "_fits_on", lambda ctx, n: (n >= 5, None, 0, 100.0 / n))
    tried, smallest, closest = fitting._smallest(None, max_nodes=64)
    assert [t.nodes for t in tried] == [1, 2, 4, 5, 6, 8]
    assert smallest[0] == 5 and closest is None
    monkeypatch.setattr(fitting, "_fits_on", lambda ctx, n: (False, None, 0, 1.0))
    tried, smallest, _ = fitting._smallest(None, max_nodes=8)
    assert smallest is None and [t.nodes for t in tried] == [1, 2, 4, 8]


def test_the_smallest_mesh_fits_and_the_one_below_does_not():
    model, graph = _loaded(WIDE, 16, 4096)
    ans = meshplan.fit(model, gpu="h100", batch=16, seq=4096, graph=graph, model_name="wide")
    assert isinstance(ans, meshplan.FitAnswer)
    n = ans.smallest_nodes
    assert n is not None and n > 1, ans.text()
    # the layout reported is the one manual_plan builds and prices, as torchtitan runs it
    lay = ans.smallest
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=n)
    plan = meshplan.manual_plan(model, mesh, graph=graph, engine="torchtitan",
                                **parse_manual_spec(lay.manual))
    assert plan.predicted.fits and plan.num_devices == n * 8
    assert plan.predicted.peak_memory_gib == pytest.approx(lay.peak_memory_gib, rel=1e-9)
    m = lay.memory
    assert m.params_gib + m.grads_gib + m.optimizer_gib + m.activations_gib + m.buffers_gib \
        == pytest.approx(lay.peak_memory_gib, rel=1e-9)
    # one node fewer: no layout torchtitan runs fits, its least-memory one included (the
    # whole space with full recompute, priced by the stack search)
    from meshplan.errors import MemoryLimitError
    from meshplan.stacks.search import search_layouts

    with pytest.raises(MemoryLimitError) as err:
        search_layouts(model, meshplan.Mesh.preset("dgx-h100", nodes=n - 1), "torchtitan",
                       graph=graph)
    assert err.value.min_memory_gib > 79
    assert err.value.code == "MEMORY_OVER_BUDGET"
    assert "smallest mesh" in ans.text() and f"{n} nodes ({n * 8} GPUs)" in ans.text()


def test_the_fastest_layouts_on_a_mesh_are_ordered_and_fit():
    model, graph = _loaded(SMALL, 16, 2048)
    ans = meshplan.fit(model, gpu="h100", batch=16, seq=2048, graph=graph, model_name="small",
                       mesh="dgx-h100:nodes=1", top=3, time_limit_s=None)
    assert ans.smallest_nodes == 1 and ans.mesh_fits is True
    assert 1 <= len(ans.fastest) <= 3
    times = [lay.step_time_s for lay in ans.fastest]
    assert times == sorted(times) and all(lay.fits for lay in ans.fastest)
    # the first is what plan --for torchtitan finds fastest on that mesh
    best, _ = meshplan.stacks.search.search_layouts(
        model, meshplan.Mesh.preset("dgx-h100", nodes=1), "torchtitan", graph=graph)
    assert times[0] <= best.predicted.step_time_s * (1 + 1e-9)
    assert len(ans.text().splitlines()) == 4 + 1 + len(ans.fastest)


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "b300"], "--gpu 'b300' is not a GPU meshplan has a preset for"),
    (["--gpu", "h100", "--mesh", "dgx-a100-80gb:nodes=2"], "is not of --gpu h100"),
])
def test_bad_input_is_one_line(argv, words, capsys):
    assert main(["fit", "--model", SMALL, "--batch", "8", "--seq", "512"] + argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
