"""The HTML report: the schedule timeline against closed forms, a self-contained page, and
the pictures as headless Chromium lays them out (skipped where Chromium is absent)."""

import dataclasses
import shutil
import subprocess

import pytest

import meshplan
from meshplan.mesh import Mesh
from meshplan.report import render_report, stage_order, timeline, write_report
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if shutil.os.path.exists(
    "/usr/bin/chromium") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def pipeline_plan():
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build("meta")
    graph = meshplan.trace(model, example_inputs(model, 8, 32), model_name=spec.name)
    return meshplan.manual_plan(model, Mesh.local(4), graph=graph, dp=1, tp=2, pp=2,
                                microbatch_size=2)


def with_stages(plan, stages, microbatches, schedule):
    stages = tuple(dataclasses.replace(plan.stages[0], index=i) for i in range(stages))
    return dataclasses.replace(plan, stages=stages, training=dataclasses.replace(
        plan.training, microbatches=microbatches, schedule=schedule))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 4), (4, 8), (4, 2)])
def test_timeline_makespan_is_the_closed_form(pipeline_plan, schedule, stages, microbatches):
    """Equal stages of time t: (m + p - 1) t, idle (p - 1) / (m + p - 1) per stage
    (Narayanan et al. 2021, section 2.2), for GPipe and 1F1B alike."""
    t = 0.3
    plan = with_stages(pipeline_plan, stages, microbatches, schedule)
    blocks = timeline(plan, [(0.1, 0.2)] * stages)
    assert len(blocks) == 2 * stages * microbatches
    end = max(b.end_s for b in blocks)
    assert end == pytest.approx((microbatches + stages - 1) * t)
    busy = sum(b.end_s - b.start_s for b in blocks)
    assert 1 - busy / (end * stages) == pytest.approx((stages - 1) / (microbatches + stages - 1))
    for s in range(stages):  # one pass at a time per stage, in the schedule's order
        mine = sorted((b for b in blocks if b.stage == s), key=lambda b: b.start_s)
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(mine, mine[1:]))
        assert [(b.kind, b.microbatch) for b in mine] == stage_order(schedule, s, stages,
                                                                     microbatches)


def test_timeline_passes_are_the_estimates_stage_costs(pipeline_plan):
    """The drawn passes are the estimate's: each stage's forward plus backward is its
    ``microbatch_s``, and each stage is drawn busy m x that (the report's former 1/3-2/3
    split of the recorded compute + comm, which counted the per-step gradient sync in every
    microbatch, is gone)."""
    from meshplan.costmodel.estimate import plan_stage_costs
    from meshplan.costmodel.hardware import HardwareProfile
    from meshplan.report import pass_times

    costs = plan_stage_costs(pipeline_plan, pipeline_plan.graph,
                             HardwareProfile.from_dict(pipeline_plan.mesh.hardware))
    times = pass_times(pipeline_plan, pipeline_plan.graph)
    for (f, b), c in zip(times, costs):
        assert f == pytest.approx(c.forward_s, rel=1e-12)
        assert f + b == pytest.approx(c.microbatch_s, rel=1e-12)
    blocks = timeline(pipeline_plan, times)
    m = pipeline_plan.training.microbatches
    for s, c in enumerate(costs):
        busy = sum(b.end_s - b.start_s for b in blocks if b.stage == s)
        assert busy == pytest.approx(m * c.microbatch_s, rel=1e-12)


def test_1f1b_order_warms_up_then_alternates():
    assert stage_order("1f1b", 0, 4, 6)[:5] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0)]
    assert stage_order("1f1b", 3, 4, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                           ("B", 2)]
    assert stage_order("gpipe", 1, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_report_is_one_self_contained_page(pipeline_plan, tmp_path):
    text = render_report(pipeline_plan)
    assert text.count('<svg class="figure"') == 4
    for label in ("pipeline schedule timeline", "memory per device against capacity",
                  "per-layer placement map", "time breakdown"):
        assert f'aria-label="{label}"' in text
    body = text.replace("http://www.w3.org/2000/svg", "")
    assert "http" not in body and "<link" not in body and " src=" not in body
    assert "column-parallel" in text and "stage 1" in text
    write_report(pipeline_plan, tmp_path / "r.html")
    assert (tmp_path / "r.html").read_text() == text


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (Debian package "
                    "`chromium`, /usr/bin/chromium); the browser check of the report is skipped")
def test_chromium_renders_the_pictures(pipeline_plan, tmp_path):
    page = tmp_path / "report.html"
    write_report(pipeline_plan, page)
    profile = tmp_path / "profile"
    profile.mkdir()
    run = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                          page.as_uri()], capture_output=True, text=True, timeout=120)
    assert 'data-figures-rendered="4"' in run.stdout, run.stderr[-2000:]
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={shot}",
                    "--window-size=1000,1400", page.as_uri()], capture_output=True, timeout=120)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    rgb = (pixels * 255).round().astype(int)

    def count(hex_colour):
        target = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
        return int(((abs(rgb - target)).sum(axis=-1) <= 6).sum())

    assert count("#0072B2") > 500  # forward blocks, column-parallel cells, parameters
    assert count("#009E73") > 500  # backward blocks, activations
    assert count("#E69F00") > 200  # row-parallel cells, optimizer state
