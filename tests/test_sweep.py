"""The sweep: the configuration space, the shortcut it takes (one plan per placement key),
the data set and its Pareto front, the plot, and the CLI."""

import itertools

import pandas as pd
import pytest

import meshplan
from meshplan.cli import main
from meshplan.mesh import Mesh
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec
from meshplan.sweep import Config, configurations, pareto_mask, run_sweep, variant


@pytest.fixture(scope="module")
def demo():
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build("meta")
    graph = meshplan.trace(model, example_inputs(model, 8, 32), model_name=spec.name)
    return model, graph


def test_configurations_cover_the_space_and_only_it():
    cs = configurations(devices=8, devices_per_node=4, batch=8, layers=4, heads=4)
    assert len(set(cs)) == len(cs)
    for c in cs:
        assert c.dp * c.tp * c.pp == 8 and c.tp <= 4 and 4 % c.tp == 0 and c.pp <= 4
        assert (8 // c.dp) % c.microbatch_size == 0
        assert c.sequence_parallel is False or c.tp > 1
        assert c.zero == 0 or c.dp > 1
        assert (c.schedule == "interleaved-1f1b") == (c.virtual_stages > 1)
        if c.schedule == "interleaved-1f1b":
            assert 4 % (c.pp * c.virtual_stages) == 0
    # (dp, tp, pp) = (8, 1, 1): one sequence per replica -> microbatch size 1, one schedule,
    # 3 recompute choices, no sequence parallelism, 4 ZeRO stages
    assert sum(1 for c in cs if (c.dp, c.tp, c.pp) == (8, 1, 1)) == 1 * 1 * 3 * 1 * 4
    # (dp, tp, pp) = (1, 4, 2): micro sizes {1,2,4,8}, gpipe + 1f1b + interleaved v=2, less
    # 1f1b and interleaved at size 8 (one microbatch < pp: the runtime refuses them,
    # meshplan/support.py), 3 recompute, sp on/off, ZeRO 0 only
    assert sum(1 for c in cs if (c.dp, c.tp, c.pp) == (1, 4, 2)) == (4 * 3 - 2) * 3 * 2 * 1
    assert all(c.schedule == "gpipe" or 8 // (c.dp * c.microbatch_size) >= c.pp for c in cs)
    assert not any(c.tp == 8 for c in cs)  # tensor parallel stays inside a node


@pytest.mark.parametrize("c", [
    Config(2, 2, 1, 2, "1f1b", 1, "selective", True, 1),
    Config(2, 1, 2, 1, "gpipe", 1, "full", False, 2),
    Config(1, 2, 2, 2, "interleaved-1f1b", 1, "none", False, 0),
    # one microbatch over 2 stages: gpipe (manual_plan refuses 1F1B with fewer microbatches
    # than stages, as Plan.from_json does)
    Config(2, 1, 2, 4, "gpipe", 1, "none", False, 3),
])
def test_variant_prices_like_manual_plan(demo, c):
    """The shortcut (one manual_plan per placement key, fields replaced, then estimate) gives
    the numbers manual_plan gives for the configuration itself."""
    model, graph = demo
    mesh = Mesh.local(4)
    kw = dict(graph=graph, dp=c.dp, tp=c.tp, pp=c.pp, sequence_parallel=c.sequence_parallel)
    base = meshplan.manual_plan(model, mesh, microbatch_size=1, zero=3 if c.zero == 3 else 0, **kw)
    direct = meshplan.manual_plan(model, mesh, microbatch_size=c.microbatch_size,
                                  schedule=c.schedule, virtual_stages=c.virtual_stages,
                                  recompute=c.recompute, zero=c.zero, **kw)
    assert meshplan.estimate(variant(base, c), graph) == direct.predicted


def test_pareto_mask_matches_brute_force():
    pts = [(3, 1), (1, 3), (2, 2), (2, 3), (3, 3), (1, 4), (4, 0.5), (2, 2)]
    times, mems = [p[0] for p in pts], [p[1] for p in pts]
    mask = pareto_mask(times, mems)
    for i, (t, m) in enumerate(pts):
        dominated = any((t2 <= t and m2 <= m) and (t2, m2) != (t, m) for t2, m2 in pts)
        first_duplicate = pts.index((t, m)) == i
        assert mask[i] == (not dominated and first_duplicate), (i, pts[i])


def test_sweep_data_set(demo, tmp_path):
    model, graph = demo
    out, png = tmp_path / "space.parquet", tmp_path / "pareto.png"
    frame = run_sweep(model, Mesh.local(4), graph=graph, output=str(out), plot=str(png),
                      time_limit_s=5, workers=1)
    back = pd.read_parquet(out)
    pd.testing.assert_frame_equal(back, frame, check_dtype=False)
    uniform = back[back["kind"] == "uniform"]
    assert len(uniform) == len(configurations(devices=4, devices_per_node=1024, batch=8,
                                              layers=2, heads=4))
    assert (uniform["error"] == "").all() and uniform["step_time_s"].gt(0).all()
    assert uniform["fits"].all()  # a 120k-parameter model fits 4 GiB in every configuration
    auto = back[back["kind"] == "auto"]
    assert len(auto) == 1 and bool(auto["is_auto"].iloc[0]) and auto["step_time_s"].iloc[0] > 0
    front = back[back["pareto"]]
    for _, r in front.iterrows():  # nothing that fits is both faster and smaller
        better = back[back["fits"] & (back["step_time_s"] < r["step_time_s"])
                      & (back["peak_memory_gib"] < r["peak_memory_gib"])]
        assert better.empty
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for c in itertools.islice(uniform.itertuples(), 0, None, 97):  # spot-check the columns
        assert c.microbatches == 8 // (c.dp * c.microbatch_size)


def test_sweep_cli(tmp_path, capsys):
    out = tmp_path / "s.parquet"
    assert main(["sweep", "--model", DEMO_MODEL, "--mesh", "local:2", "--batch", "4", "--seq",
                 "16", "-o", str(out), "--no-auto"]) == 0
    printed = capsys.readouterr().out
    frame = pd.read_parquet(out)
    assert f"{len(frame)} configurations" in printed and not frame["is_auto"].any()
