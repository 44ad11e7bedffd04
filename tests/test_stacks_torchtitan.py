"""Export to and import from torchtitan 0.2.2 job configs (meshplan/stacks/torchtitan.py).

Pure tests: the round trip as a property over generated layouts, the refusals in one line.
With torchtitan installed (the ``stacks`` extra): the exported files are read by
torchtitan's own ConfigManager, ParallelDims and device-mesh construction on a fake process
group (tests/_torchtitan_check.py), for Llama 3.1 8B / 70B / 405B; with triton too, its
Trainer builds and trains an exported debugmodel plan on the fake communication backend.
"""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from meshplan.errors import NotSupportedError, SpecError
from meshplan.stacks import StackLayout, arch_of_spec
from meshplan.stacks.torchtitan import default_split, from_torchtitan, problems, to_torchtitan
from meshplan.stacks.torchtitan_flavors import DEFAULTS, FLAVORS, flavor_of

HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
WORKER = Path(__file__).with_name("_torchtitan_check.py")
ROUND_TRIP_EXAMPLES = 400


@st.composite
def layouts(draw):
    """A layout meant for torchtitan (most pass ``problems``), and a flavor's arch."""
    arch = draw(st.sampled_from(list(FLAVORS.values())))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if arch.kv_heads % t == 0]))
    cp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2, 3, 4]) if arch.family == "llama" else st.just(1))
    dp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    zero = draw(st.sampled_from([0, 1, 2, 3]))  # some drawn layouts torchtitan refuses
    if pp > 1:
        schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    else:
        schedule = "1f1b"
    v = draw(st.integers(2, 3)) if schedule == "interleaved-1f1b" else 1
    mb = draw(st.integers(1, 4))
    global_batch = dp * mb * draw(st.integers(1, 8))
    dtype = draw(st.sampled_from(["bf16", "fp8", "fp32"]))
    stage_layers = ()
    chunks = pp * v
    if pp > 1 and chunks <= arch.layers and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, arch.layers - 1), min_size=chunks - 1,
                                    max_size=chunks - 1, unique=True)))
        bounds = [0, *cuts, arch.layers]
        stage_layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    layout = StackLayout(dp=dp, tp=tp, cp=cp, pp=pp, schedule=schedule, virtual_stages=v,
                         microbatch_size=mb, global_batch=global_batch,
                         seq_len=2 * tp * cp * draw(st.integers(1, 512)),
                         recompute=draw(st.sampled_from(["none", "selective", "full"])),
                         sequence_parallel=tp > 1, zero=zero, dtype=dtype,
                         compiled=draw(st.booleans()), stage_layers=stage_layers)
    if stage_layers and not problems(replace(layout, stage_layers=()), arch) and \
            stage_layers == replace(layout, stage_layers=()).layers_per_chunk(arch.layers):
        layout = replace(layout, stage_layers=())  # the even split is written (), as layout_of
    return layout, arch


def test_round_trip_over_generated_layouts():
    """from_torchtitan(to_torchtitan(L)) == L for every generated layout torchtitan runs."""
    seen, drawn = [], []

    @settings(max_examples=ROUND_TRIP_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=layouts())
    def check(case):
        layout, arch = case
        drawn.append(layout)
        assume(not problems(layout, arch))
        back, back_arch = from_torchtitan(to_torchtitan(layout, arch), devices=layout.devices)
        assert back == layout
        assert back_arch == arch
        seen.append(layout)

    check()
    kinds = {"pp": sum(L.pp > 1 for L in seen), "cp": sum(L.cp > 1 for L in seen),
             "split": sum(bool(L.stage_layers) for L in seen),
             "interleaved": sum(L.schedule == "interleaved-1f1b" and L.pp > 1 for L in seen),
             "fp8": sum(L.dtype == "fp8" for L in seen), "ddp": sum(L.zero == 0 and L.dp > 1
                                                                     for L in seen)}
    print(f"round trip: {len(seen)} layouts torchtitan runs, of {len(drawn)} drawn; {kinds}")
    assert len(seen) == ROUND_TRIP_EXAMPLES and min(kinds.values()) > 0, kinds


def test_presets_match_torchtitan_flavors():
    assert flavor_of(arch_of_spec("llama3.1-8b")).flavor == "8B"
    assert flavor_of(arch_of_spec("llama3.1-70b")).flavor == "70B"
    assert flavor_of(arch_of_spec("llama3.1-405b")).flavor == "405B"
    assert flavor_of(arch_of_spec("llama2-70b")) is None  # vocab 32000


def test_default_split_is_torchtitans_rule():
    """Without module_fqns_per_model_part torchtitan counts the embedding and the head as
    one layer each: 32 layers on 4 stages -> 34 "layers", 9 + 9 + 8 + 8, less one at either end."""
    assert default_split(4, 32, 1, 1) == (8, 9, 8, 7)
    assert default_split(1, 32, 1, 1) == (32,)
    text = "[model]\nflavor = \"8B\"\n[parallelism]\npipeline_parallel_degree = 4\n" \
           "data_parallel_shard_degree = 1\n[training]\nlocal_batch_size = 8\n" \
           "[activation_checkpoint]\nmode = \"full\"\n"
    layout, _ = from_torchtitan(text)
    assert layout.stage_layers == (8, 9, 8, 7)
    assert (layout.pp, layout.dp, layout.microbatch_size, layout.microbatches) == (4, 1, 1, 8)


def test_missing_keys_take_torchtitans_defaults():
    """An empty file is torchtitan's defaults: llama3 debugmodel, 8 x 2048 tokens per rank,
    FSDP over every device, fp32 master weights with bf16 compute, selective AC every 2nd
    block (refused: meshplan's layouts recompute every block alike)."""
    with pytest.raises(NotSupportedError, match="selective_ac_option '2'"):
        from_torchtitan("", devices=8)
    layout, arch = from_torchtitan("[activation_checkpoint]\nmode = \"none\"\n", devices=8)
    assert arch == FLAVORS[("llama3", "debugmodel")]
    assert layout == StackLayout(dp=8, global_batch=64, seq_len=2048, microbatch_size=8,
                                 zero=3, dtype="bf16")


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("change, words", [
    (dict(zero=1), "zero=1"),
    (dict(sequence_parallel=False), "without sequence parallelism"),
    (dict(zero=0), "DDP"),
    (dict(tp=3, sequence_parallel=True), "choose tp in {1, 2, 4, 8}"),
    (dict(seq_len=8200), "tp x 2 x cp = 16"),
    (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=1, global_batch=16),
     "virtual_stages=1"),
    (dict(dp=1, tp=8, pp=8, dtype="bf16", global_batch=8), "maybe_enable_amp"),
])
def test_refusals_in_one_line(change, words):
    arch = arch_of_spec("llama3.1-70b")
    layout = replace(StackLayout(dp=8, tp=8, global_batch=64, seq_len=8192, zero=3,
                                 sequence_parallel=True), **change)
    assert any(words in p for p in problems(layout, arch)), problems(layout, arch)
    with pytest.raises(NotSupportedError) as exc:
        to_torchtitan(layout, arch)
    assert words in _one_line(exc) or problems(layout, arch)[0] == str(exc.value)


def test_more_chunks_than_layers_is_a_problem_not_a_crash():
    """Found by the round trip: 4 ranks x 3 interleaved chunks of the 6-layer debugmodel
    made ``problems`` raise the even split's PlanningError instead of answering."""
    layout = StackLayout(dp=2, pp=4, schedule="interleaved-1f1b", virtual_stages=3,
                         global_batch=8, seq_len=64, zero=3)
    found = problems(layout, FLAVORS[("llama3", "debugmodel")])
    assert len(found) == 1 and "12 chunks" in found[0] and "\n" not in found[0]


def test_qwen3_has_no_pipeline():
    layout = StackLayout(dp=2, pp=2, global_batch=8, seq_len=64, zero=3)
    found = problems(layout, FLAVORS[("qwen3", "debugmodel")])
    assert found == ("pp=2 for qwen3: torchtitan 0.2.2's qwen3 train spec has no pipelining_fn; "
                     "use pp=1 (or a Llama)",)


def test_unknown_flavor_refused_in_one_line():
    """A model torchtitan has no flavor for is priced (``problems`` checks the layout only,
    as ``plan --for torchtitan`` searches any Llama) but not exported."""
    arch = replace(arch_of_spec("llama3.1-8b"), layers=30)
    layout = StackLayout(dp=8, global_batch=8, seq_len=4096, zero=3)
    assert problems(layout, arch) == ()
    with pytest.raises(NotSupportedError) as exc:
        to_torchtitan(layout, arch)
    assert "matches no torchtitan 0.2.2 flavor" in _one_line(exc)
    with pytest.raises(SpecError) as exc:
        from_torchtitan("[model]\nname = \"llama3\"\nflavor = \"7B\"\n", devices=8)
    assert "'7B'" in _one_line(exc)


@pytest.mark.parametrize("toml, words", [
    ("[parallelism]\ndata_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4\n",
     "HSDP"),
    ("[parallelism]\npipeline_parallel_degree = 2\n"
     "pipeline_parallel_schedule = \"ZBVZeroBubble\"\n",
     "ZBVZeroBubble"),
    ("[activation_checkpoint]\nmode = \"memory_budget\"\n", "memory_budget"),
    ("[training]\ndtype = \"bfloat16\"\n", "bfloat16"),
    ("[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 4\n"
     "module_fqns_per_model_part = [[\"tok_embeddings\", \"layers.0\"], "
     "[\"layers.1\", \"norm\", \"output\"]]\n[training]\nlocal_batch_size = 8\n"
     "global_batch_size = 32\n", "places 2 of the 6 layers"),
    ("[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 4\n"
     "module_fqns_per_model_part = [[\"layers.0\", \"tok_embeddings\"], "
     "[\"layers.1\", \"norm\", \"output\"]]\n", "chunk 0 (layers.0, tok_embeddings)"),
])
def test_import_refusals_in_one_line(toml, words):
    toml += "" if "activation" in toml else "[activation_checkpoint]\nmode = \"none\"\n"
    with pytest.raises(NotSupportedError) as exc:
        from_torchtitan(toml, devices=8)
    assert words in _one_line(exc)


# --- torchtitan's own code -----------------------------------------------------------------

CASES = {  # name: (preset, layout) on H100 nodes; Llama 3 paper Table 4 shapes, scaled down
    "8B-8": ("llama3.1-8b", StackLayout(dp=8, global_batch=32, seq_len=8192, microbatch_size=4,
                                        recompute="selective", zero=3)),
    "8B-8-fp8-compiled": ("llama3.1-8b", StackLayout(dp=8, global_batch=32, seq_len=8192,
                                                     microbatch_size=4, recompute="selective",
                                                     zero=3, dtype="fp8", compiled=True)),
    "70B-64": ("llama3.1-70b", StackLayout(dp=8, tp=8, global_batch=64, seq_len=8192,
                                           microbatch_size=8, recompute="full",
                                           sequence_parallel=True, zero=3)),
    "405B-1024": ("llama3.1-405b", StackLayout(dp=8, tp=8, pp=16, global_batch=256,
                                               seq_len=8192, schedule="interleaved-1f1b",
                                               virtual_stages=2, recompute="full",
                                               sequence_parallel=True, zero=2)),
    "405B-131K-1024": ("llama3.1-405b", StackLayout(dp=1, tp=8, cp=16, pp=8, global_batch=16,
                                                    seq_len=131072, recompute="full",
                                                    sequence_parallel=True, zero=3)),
}


def _run_worker(tmp_path, mode: str, jobs: list[tuple[str, int]]) -> list[dict]:
    args = []
    for i, (text, world) in enumerate(jobs):
        path = tmp_path / f"job{i}.toml"
        path.write_text(text)
        args += [str(path), str(world)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TT_DUMP=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, str(WORKER), mode, *args], env=env,
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(jobs), proc.stderr[-3000:]
    return [json.loads(ln[len("RESULT "):]) for ln in lines]


def _toml_of(config: dict) -> str:
    """torchtitan's parsed JobConfig back as TOML (None values left out, as torchtitan reads
    a missing key as its default)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        return "[" + ", ".join(value(x) for x in v) + "]"

    lines = []

    def section(name, table):
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and v is not None}
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for k, v in table.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)

    for name, table in config.items():
        section(name, table)
    return "\n".join(lines) + "\n"


PUBLISHED_DIR = Path(__file__).parent.parent / "benchmarks" / "stack_configs" / "torchtitan"
PUBLISHED = {  # benchmarks/stack_configs/torchtitan/*.toml: devices, layout as meshplan reads it
    "llama3.1_8b_8gpu": (8, "dp8 mb2 recompute selective ZeRO-3 bf16"),
    "llama3.1_70b_64gpu": (64, "dp8 tp8 mb8 recompute full SP ZeRO-3 bf16"),
    "llama3.1_405b_1024gpu": (1024, "dp16 tp8 pp8 interleaved-1f1b x2 mb1 recompute full SP "
                                    "ZeRO-2 fp8 compiled"),
    "llama3.1_405b_131k_16384gpu": (16384, "dp64 tp8 cp4 pp8 1f1b mb1 recompute full SP ZeRO-2 "
                                           "fp8 compiled"),
}


@pytest.mark.parametrize("stem", list(PUBLISHED))
def test_published_configs_read(stem):
    """torchtitan's published runs (benchmarks/stack_configs/torchtitan/) read as layouts;
    without module_fqns_per_model_part the split is torchtitan's default (embedding and
    head counted as a layer each: 405B interleaved on 8 ranks -> 7, 8 x 14, 7)."""
    devices, words = PUBLISHED[stem]
    layout, arch = from_torchtitan((PUBLISHED_DIR / f"{stem}.toml").read_text(), devices=devices)
    assert layout.words() == words and layout.devices == devices
    if stem == "llama3.1_405b_1024gpu":
        assert layout.layers_per_chunk(arch.layers) == (7,) + (8,) * 14 + (7,)
        assert layout.microbatches == 32


def test_unregistered_float8_name_refused():
    """torchtitan v0.2.2's own llama3_405b.toml names the converter "float8", which 0.2.2's
    registry does not hold."""
    text = (PUBLISHED_DIR / "llama3.1_405b_1024gpu.toml").read_text().replace(
        'converters = ["quantize.linear.float8"]', 'converters = ["float8"]')
    with pytest.raises(NotSupportedError) as exc:
        from_torchtitan(text, devices=1024)
    assert "'quantize.linear.float8'" in _one_line(exc)


needs_torchtitan = pytest.mark.skipif(not HAS_TORCHTITAN,
                                      reason="torchtitan not installed (pip install -e .[stacks])")


@pytest.fixture(scope="module")
def torchtitan_reads(tmp_path_factory):
    """torchtitan's reading of each exported case, and of an empty file (its defaults), in
    one worker process."""
    jobs = [(to_torchtitan(layout, arch_of_spec(preset)), layout.devices)
            for preset, layout in CASES.values()] + [("", 8)]
    jobs += [((PUBLISHED_DIR / f"{stem}.toml").read_text(), devices)
             for stem, (devices, _) in PUBLISHED.items()]
    results = _run_worker(tmp_path_factory.mktemp("torchtitan"), "mesh", jobs)
    return dict(zip([*CASES, "defaults", *PUBLISHED], results))


@needs_torchtitan
@pytest.mark.parametrize("case", list(CASES))
def test_exported_job_accepted_by_torchtitan(case, torchtitan_reads):
    """torchtitan 0.2.2 parses the exported file (ConfigManager), validates its degrees
    (ParallelDims) and builds its device meshes on a fake process group of as many ranks;
    its parsed config, every key filled in, reads back as the same layout."""
    preset, layout = CASES[case]
    got = torchtitan_reads[case]
    cfg = got["config"]
    p, t = cfg["parallelism"], cfg["training"]
    flavor = preset.split("-")[1].upper()
    assert (cfg["model"]["name"], cfg["model"]["flavor"]) == ("llama3", flavor)
    assert got["dp_shard"] * p["data_parallel_replicate_degree"] == layout.dp
    assert (p["tensor_parallel_degree"], p["context_parallel_degree"],
            p["pipeline_parallel_degree"]) == (layout.tp, layout.cp, layout.pp)
    assert t["seq_len"] % got["seq_len_divisor"] == 0  # parallelize_llama's assert
    assert t["global_batch_size"] % (t["local_batch_size"] * layout.dp) == 0  # Trainer's
    assert got["meshes"].get("tp", 1) == layout.tp and got["meshes"].get("pp", 1) == layout.pp
    assert got["meshes"].get("fsdp", 1) == layout.dp * layout.cp  # FSDP over dp_shard x cp
    assert ("quantize.linear.float8" in cfg["model"]["converters"]) == (layout.dtype == "fp8")
    assert cfg["compile"]["enable"] == layout.compiled
    back, _ = from_torchtitan(_toml_of(cfg), devices=layout.devices)
    assert back == layout


@needs_torchtitan
@pytest.mark.parametrize("stem", list(PUBLISHED))
def test_published_configs_accepted_by_torchtitan(stem, torchtitan_reads):
    """The published-run files are valid torchtitan 0.2.2 jobs (ConfigManager, ParallelDims,
    meshes) and torchtitan's parsed config reads back as the layout meshplan read."""
    devices, words = PUBLISHED[stem]
    got = torchtitan_reads[stem]
    layout, _ = from_torchtitan((PUBLISHED_DIR / f"{stem}.toml").read_text(), devices=devices)
    assert got["dp_shard"] == layout.dp
    assert got["meshes"].get("fsdp", 1) == layout.dp * layout.cp
    back, _ = from_torchtitan(_toml_of(got["config"]), devices=devices)
    assert back == layout


@needs_torchtitan
def test_defaults_are_torchtitans(torchtitan_reads):
    """DEFAULTS (what a missing key means) equals torchtitan 0.2.2's JobConfig defaults."""
    got = torchtitan_reads["defaults"]["config"]
    for section, keys in DEFAULTS.items():
        table = got["quantize"]["linear"]["float8"] if section == "float8" else got[section]
        assert {k: table[k] for k in keys} == keys, section


def _debug_plan(**kw):
    """A meshplan manual plan of torchtitan's llama3 debugmodel (traced on meta), priced as
    torchtitan runs it, and its layout."""
    import meshplan
    from meshplan.specs import example_inputs
    from meshplan.stacks import layout_of

    arch = FLAVORS[("llama3", "debugmodel")]
    model = meshplan.specs.parse_model_spec(arch.spec()).build("meta")
    graph = meshplan.tracing.trace(model, example_inputs(model, 8, 64))
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    plan = meshplan.manual_plan(model, mesh, graph=graph, engine="torchtitan", **kw)
    return layout_of(plan), arch


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_TORCHTITAN and HAS_TRITON),
                    reason="torchtitan's Trainer imports triton (torchtitan/__init__ -> float8)")
@pytest.mark.parametrize("kw, mode", [
    (dict(dp=4, tp=2, zero=3, sequence_parallel=True, recompute="selective", dtype="bf16",
          microbatch_size=2), "steps"),
    (dict(dp=2, tp=2, pp=2, zero=3, sequence_parallel=True, schedule="interleaved-1f1b",
          virtual_stages=2, recompute="full", dtype="bf16"), "init"),
    (dict(dp=2, cp=2, tp=2, zero=3, sequence_parallel=True, dtype="bf16"), "init"),
])
def test_torchtitan_trainer_dry_run(kw, mode, tmp_path):
    """plan -> layout -> TOML -> torchtitan's Trainer on its fake communication backend
    (comm.mode = "fake_backend", rank 0 of dp x cp x tp x pp on the CPU): it builds the
    model, splits the pipeline, applies TP / CP / AC / FSDP and the optimizer, and (without
    pp or cp) runs two training steps. A step with pp needs the stages' shape exchange, which
    the fake backend does not answer; with cp, torch's CPU SDPA kernel has no CP sharding rule."""
    layout, arch = _debug_plan(**kw)
    got, = _run_worker(tmp_path, mode, [(to_torchtitan(layout, arch), layout.devices)])
    assert got["model_parts"] == (2 if layout.pp > 1 else 1)
    assert got["steps"] == (2 if mode == "steps" else 0)
    assert got["grad_accumulation"] == (layout.microbatches if layout.pp == 1 else 1)


@pytest.mark.skipif(not (HAS_TORCHTITAN and HAS_TRITON),
                    reason="torchtitan's model modules import triton (MoE kernels)")
def test_flavor_table_and_split_rule_are_torchtitans(tmp_path):
    """FLAVORS is torchtitan 0.2.2's dense SDPA flavors, dimensions read off its own models
    built on meta; default_split is its generate_llm_fqn_per_model_part."""
    proc = subprocess.run([sys.executable, str(WORKER), "flavors"], capture_output=True,
                          text=True, timeout=600, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    ours = {f"{name}/{flavor}": arch for (name, flavor), arch in FLAVORS.items()}
    assert set(got["flavors"]) == set(ours)
    for key, dims in got["flavors"].items():
        arch = ours[key]
        assert {k: getattr(arch, k) for k in dims} == dims, key
    assert got["splits"]
    for key, counts in got["splits"].items():
        stages, layers, first, last = map(int, key.split(","))
        assert list(default_split(stages, layers, first, last)) == counts, key


BENCH_EXPORTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "stack_exports"


@needs_torchtitan
def test_benchmark_exports_accepted_by_torchtitan(tmp_path):
    """The TOMLs benchmarks/stack_exports.py wrote for `plan --for torchtitan` (the files the
    results table cites) pass torchtitan's ConfigManager, ParallelDims and build_mesh, and
    read back as the layout meshplan wrote."""
    files = sorted(BENCH_EXPORTS.glob("*.meshplan.toml"))
    if not files:
        pytest.skip("run benchmarks/stack_exports.py first")
    jobs = []
    for f in files:
        layout, _ = from_torchtitan(f.read_text())  # an export names every degree
        jobs.append((f.read_text(), layout.devices))
    for f, got, (_, devices) in zip(files, _run_worker(tmp_path, "mesh", jobs), jobs):
        back, _ = from_torchtitan(_toml_of(got["config"]), devices=devices)
        assert back == from_torchtitan(f.read_text(), devices=devices)[0], f.name


def test_import_prices_the_configs_own_pipeline_split(tmp_path):
    """A torchtitan job file with pp=4 and no split points is split by torchtitan's rule
    (8, 9, 8, 7 blocks: the embedding and the head count as a layer each); the imported
    plan's stages hold exactly those blocks, not meshplan's even split (8, 8, 8, 8)."""
    import meshplan
    from meshplan.stacks.commands import import_plan

    path = tmp_path / "job.toml"
    path.write_text("[model]\nflavor = \"8B\"\n[parallelism]\npipeline_parallel_degree = 4\n"
                    "data_parallel_shard_degree = 2\n[training]\nlocal_batch_size = 8\n"
                    "seq_len = 512\n[activation_checkpoint]\nmode = \"full\"\n")
    plan = import_plan(str(path), "torchtitan", meshplan.Mesh.preset("dgx-h100", nodes=1))
    assert [s.layers[1] - s.layers[0] for s in plan.stages] == [8, 9, 8, 7]
