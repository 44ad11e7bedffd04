"""Export to and import from torchtitan configs (meshplan/stacks/torchtitan.py): 0.3.0's
config registry module and command line, 0.2.2's TOML job files (read only).

Pure tests: the round trip as a property over generated layouts, the refusals in one line.
With torchtitan 0.3.0 installed (the ``stacks`` extra): every export is read by torchtitan's
own ConfigManager (``--module PACKAGE --config meshplan_<model>`` and the override line),
ParallelDims and device-mesh construction on a fake process group
(tests/_torchtitan_check.py), for Llama 3.1 8B / 70B / 405B; torchtitan's Trainer builds and
trains an exported dp x tp plan of its debugmodel on the fake communication backend.
"""

import dataclasses
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

from meshplan.errors import MeshplanError, NotSupportedError, SpecError
from meshplan.stacks import StackLayout, arch_of_spec
from meshplan.stacks.torchtitan import (_base_values, default_split, flavor_problem,
                                        from_torchtitan, function_name, problems, to_torchtitan,
                                        torchtitan_command)
from meshplan.stacks.torchtitan_flavors import BASES_03, FLAVORS, flavor_of

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
    dtype = draw(st.sampled_from(["bf16", "bf16", "fp8", "fp32"]))  # fp8: refused
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
                         sequence_parallel=tp > 1 and draw(st.booleans()), zero=zero,
                         dtype=dtype,
                         compiled=draw(st.booleans()), stage_layers=stage_layers)
    if stage_layers and not problems(replace(layout, stage_layers=()), arch) and \
            stage_layers == replace(layout, stage_layers=()).layers_per_chunk(arch.layers):
        layout = replace(layout, stage_layers=())  # the even split is written (), as layout_of
    return layout, arch


def test_round_trip_over_generated_layouts():
    """from_torchtitan(to_torchtitan(L)) == L and the same from the command-line form, for
    every generated layout torchtitan 0.3.0 runs (of a flavor with a config function)."""
    seen, drawn = [], []

    @settings(max_examples=ROUND_TRIP_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=layouts())
    def check(case):
        layout, arch = case
        drawn.append(layout)
        assume(not problems(layout, arch) and not flavor_problem(arch))
        back, back_arch = from_torchtitan(to_torchtitan(layout, arch), devices=layout.devices)
        assert back == layout
        assert back_arch == arch
        line = torchtitan_command(layout, arch)
        if line.startswith("--module"):
            assert from_torchtitan(line, devices=layout.devices) == (layout, arch)
        seen.append(layout)

    check()
    kinds = {"pp": sum(L.pp > 1 for L in seen), "cp": sum(L.cp > 1 for L in seen),
             "split": sum(bool(L.stage_layers) for L in seen),
             "interleaved": sum(L.schedule == "interleaved-1f1b" and L.pp > 1 for L in seen),
             "no-sp": sum(L.tp > 1 and not L.sequence_parallel for L in seen),
             "replicate+tp/pp": sum(L.zero == 0 and L.dp > 1 and L.tp * L.pp > 1 for L in seen)}
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
    (dict(dtype="fp8"), "rowwise recipes only"),
    (dict(cp=2, zero=0), "zero=0 with cp=2"),
    (dict(tp=3, sequence_parallel=True), "choose tp in {1, 2, 4, 8}"),
    (dict(seq_len=8200), "tp x 2 x cp = 16"),
    (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=1, global_batch=16),
     "virtual_stages=1"),
    (dict(dp=1, tp=8, zero=3, global_batch=8), "zero=3 over dp x cp = 1"),
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


def test_what_0_3_runs_that_0_2_did_not():
    """torchtitan 0.3.0 pipelines qwen3 (pipeline_llm), replicates beside TP / PP (fully_shard
    on the dp_replicate mesh: 0.2's DDP-only-alone rule is gone), turns sequence parallelism
    off (enable_sequence_parallel) and keeps mixed precision without FSDP."""
    arch = FLAVORS[("qwen3", "debugmodel")]
    assert problems(StackLayout(dp=2, pp=2, global_batch=8, seq_len=64, zero=3), arch) == ()
    llama = arch_of_spec("llama3.1-70b")
    for layout in (StackLayout(dp=8, tp=8, global_batch=64, seq_len=8192, zero=0),
                   StackLayout(dp=1, tp=8, pp=8, global_batch=8, seq_len=8192, zero=0,
                               sequence_parallel=True)):
        assert problems(layout, llama) == ()
        assert from_torchtitan(to_torchtitan(layout, llama), devices=layout.devices)[0] == layout


def test_unknown_flavor_refused_in_one_line():
    """A model torchtitan has no flavor for is priced (``problems`` checks the layout only,
    as ``plan --for torchtitan`` searches any Llama) but not exported; the refusal names
    the nearest flavor and the field that differs."""
    arch = replace(arch_of_spec("llama3.1-8b"), layers=30)
    layout = StackLayout(dp=8, global_batch=8, seq_len=4096, zero=3)
    assert problems(layout, arch) == ()
    with pytest.raises(NotSupportedError) as exc:
        to_torchtitan(layout, arch)
    assert "matches no torchtitan 0.3.0 flavor; the nearest, llama3 8B, differs in 1 field: " \
           "num_hidden_layers 30 here, 32 in 8B" in _one_line(exc)
    with pytest.raises(SpecError) as exc:
        from_torchtitan("[model]\nname = \"llama3\"\nflavor = \"7B\"\n", devices=8)
    assert "'7B'" in _one_line(exc)


def test_rope_theta_left_at_the_transformers_default_is_named():
    """Llama 3 8B's dimensions with transformers' LlamaConfig default rope_theta (10000): the
    refusal names rope_theta, both values and the flavor, and says what to set."""
    from meshplan.stacks.arch import arch_of_spec as arch_of

    spec = ("transformers:llama?hidden_size=4096&intermediate_size=14336&num_hidden_layers=32"
            "&num_attention_heads=32&num_key_value_heads=8&vocab_size=128256"
            "&max_position_embeddings=8192&rms_norm_eps=1e-05")
    arch = arch_of(spec)
    assert arch.rope_theta == 10000.0  # transformers' default, left unset in the spec
    why = flavor_problem(arch)
    assert "\n" not in why
    assert "nearest, llama3 8B, differs in 1 field: rope_theta 10000.0 here, 500000.0 in 8B; " \
           "set rope_theta=500000" in why


def test_flavor_without_a_config_function_refused():
    """qwen3 8B is a 0.3.0 flavor without a config function: refused, naming those with one."""
    arch = FLAVORS[("qwen3", "8B")]
    with pytest.raises(NotSupportedError) as exc:
        to_torchtitan(StackLayout(dp=8, global_batch=8, seq_len=4096, zero=3), arch)
    assert "no config function in torchtitan 0.3.0" in _one_line(exc)


@pytest.mark.parametrize("text, words", [
    ("--module llama3 --config llama3_405b --parallelism.data_parallel_shard_degree 8",
     "float8 rowwise"),
    ("--module llama3 --config llama3_70b --compile.enable "
     "--compile.enable_async_tensor_parallel", "async TP"),
    ("--module llama3 --config llama3_8b activation-checkpoint:memory-budget", "memory-budget"),
    ("--module llama3 --config llama3_8b --parallelism.data_parallel_replicate_degree 2 "
     "--parallelism.data_parallel_shard_degree 4", "HSDP"),
    ("--module llama3 --config llama3_8b --parallelism.tensor_paralel_degree 2",
     "did you mean tensor_parallel_degree"),
    ("from torchtitan.models.llama3.config_registry import llama3_8b\n\n\n"
     "def meshplan_x():\n    config = llama3_8b()\n    for i in range(2):\n        pass\n"
     "    return config\n", "not an assignment"),
    ("def meshplan_x():\n    config = llama3_8b()\n"
     "    config.activation_checkpoint = MemoryBudgetAC.Config()\n    return config\n",
     "MemoryBudgetAC"),
])
def test_0_3_import_refusals_in_one_line(text, words):
    with pytest.raises(MeshplanError) as exc:
        from_torchtitan(text, devices=8)
    assert words in _one_line(exc)


def test_command_line_reads_against_the_functions_own_settings():
    """An override line sets only what differs from torchtitan's function: the rest is the
    function's (llama3_70b: tp 8, local batch 8, seq 8192, full AC)."""
    layout, arch = from_torchtitan("torchrun --nproc_per_node 8 -m torchtitan.train --module "
                                   "llama3 --config llama3_70b", devices=64)
    assert arch == FLAVORS[("llama3", "70B")]
    assert layout == StackLayout(dp=8, tp=8, global_batch=64, seq_len=8192, microbatch_size=8,
                                 recompute="full", sequence_parallel=True, zero=3)


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
    "8B-8-compiled": ("llama3.1-8b", StackLayout(dp=8, global_batch=32, seq_len=8192,
                                                 microbatch_size=4, recompute="selective",
                                                 zero=3, compiled=True)),
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

def _ds_v3():
    """DeepSeek-V3 as torchtitan 0.3.0 builds it: the preset with its RMSNorm eps 1e-5."""
    return dataclasses.replace(arch_of_spec("deepseek-v3"), norm_eps=1e-5)


MOE_CASES = {  # name: (arch, layout): torchtitan's MoE flavors with expert parallelism
    "qwen3-30B-A3B-16": (arch_of_spec("qwen3-30b-a3b"), StackLayout(
        dp=16, ep=8, global_batch=64, seq_len=4096, microbatch_size=4, recompute="full",
        zero=3)),
    "qwen3-30B-A3B-32-tp": (arch_of_spec("qwen3-30b-a3b"), StackLayout(
        dp=8, tp=4, ep=32, global_batch=64, seq_len=4096, microbatch_size=8, recompute="full",
        sequence_parallel=True, zero=3)),
    "deepseek-v3-671B-1024": (_ds_v3(), StackLayout(
        dp=64, pp=16, ep=64, global_batch=1024, seq_len=4096, schedule="interleaved-1f1b",
        virtual_stages=2, recompute="selective", zero=3)),
}
# torchtitan's own functions, read by its ConfigManager to check BASES_03 (llama3_405b
# converts to float8 while building: torchao and an SM89+ GPU, not here)
OWN = [f for f in BASES_03 if f != "llama3_405b"]


def _run_worker(tmp_path, mode: str, jobs: list[dict]) -> list[dict]:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(jobs))
    env = dict(os.environ, OMP_NUM_THREADS="1", TT_DUMP=str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(path)], env=env,
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(jobs), proc.stderr[-3000:]
    return [json.loads(ln[len("RESULT "):]) for ln in lines]


def _job(tmp_path, name: str, layout: StackLayout, arch) -> dict:
    """The export written as torchtitan reads it: tmp_path/NAME/config_registry.py."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "config_registry.py").write_text(to_torchtitan(layout, arch,
                                                                      package=name))
    return {"package": name, "function": function_name(arch), "world": layout.devices,
            "command": torchtitan_command(layout, arch, package=name)}


def _registry_of(got: dict, function: str) -> str:
    """torchtitan's parsed config (the fields meshplan reads) back as a config function."""
    lines = [f"def {function}():", f"    config = {function.removeprefix('meshplan_')}()"]
    flavor = got["flavor"][1]
    lines.append(f"    config.model_spec = model_registry({flavor!r})")
    for section in ("training", "parallelism", "compile"):
        lines += [f"    config.{section}.{k} = {v!r}" for k, v in got[section].items()]
    ac = got["activation_checkpoint"]
    lines.append("    config.activation_checkpoint = " + (f"{ac}()" if ac else "None"))
    return "\n".join(lines + ["    return config", ""])


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
    """torchtitan's published runs (benchmarks/stack_configs/torchtitan/, 0.2 TOML) read as
    layouts; without module_fqns_per_model_part the split is torchtitan's default (embedding
    and head counted as a layer each: 405B interleaved on 8 ranks -> 7, 8 x 14, 7)."""
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


needs_torchtitan = pytest.mark.skipif(not (HAS_TORCHTITAN and HAS_TRITON),
                                      reason="torchtitan 0.3 and triton not installed (pip "
                                      "install -e .[stacks]); its model registries import "
                                      "triton to build a config")


@pytest.fixture(scope="module")
def torchtitan_reads(tmp_path_factory):
    """torchtitan's reading of each exported case, of the published 0.2 TOMLs carried over to
    0.3 (the bf16 ones: 0.3 cannot run their tensorwise fp8), and of torchtitan's own config
    functions, in one worker process."""
    tmp = tmp_path_factory.mktemp("torchtitan")
    jobs = [_job(tmp, f"case{i}", layout, arch_of_spec(preset))
            for i, (preset, layout) in enumerate(CASES.values())]
    published = [s for s in PUBLISHED if "fp8" not in PUBLISHED[s][1]]
    for i, stem in enumerate(published):
        layout, arch = from_torchtitan((PUBLISHED_DIR / f"{stem}.toml").read_text(),
                                       devices=PUBLISHED[stem][0])
        jobs.append(_job(tmp, f"published{i}", layout, arch))
    jobs += [{"package": BASES_03[fn]["flavor"][0], "function": fn, "world": 8} for fn in OWN]
    jobs += [_job(tmp, f"moe{i}", layout, arch) for i, (arch, layout) in
             enumerate(MOE_CASES.values())]
    results = _run_worker(tmp, "mesh", jobs)
    return dict(zip([*CASES, *published, *OWN, *MOE_CASES], results))


@needs_torchtitan
@pytest.mark.parametrize("case", list(CASES))
def test_exported_config_accepted_by_torchtitan(case, torchtitan_reads):
    """torchtitan 0.3.0 builds the exported config (ConfigManager with --module PACKAGE
    --config meshplan_<model>), parses the override line to the same sections, validates the
    degrees (ParallelDims) and builds its device meshes on a fake process group of as many
    ranks; its parsed config reads back as the same layout."""
    preset, layout = CASES[case]
    got = torchtitan_reads[case]
    p, t = got["parallelism"], got["training"]
    assert got["flavor"] == ["llama3", preset.split("-")[1].upper()]
    assert got.get("command_differs", {}) == {}
    assert got["dp_shard"] * p["data_parallel_replicate_degree"] == layout.dp
    assert (p["tensor_parallel_degree"], p["context_parallel_degree"],
            p["pipeline_parallel_degree"]) == (layout.tp, layout.cp, layout.pp)
    assert t["seq_len"] % got["seq_len_divisor"] == 0
    assert t["global_batch_size"] % (t["local_batch_size"] * layout.dp) == 0  # Trainer's
    assert got["meshes"].get("tp", 1) == layout.tp and got["meshes"].get("pp", 1) == layout.pp
    assert got["meshes"].get("dp_shard", 1) == layout.dp
    assert got["compile"]["enable"] == layout.compiled
    fn = function_name(arch_of_spec(preset))
    back, _ = from_torchtitan(_registry_of(got, fn), devices=layout.devices)
    assert back == layout


@needs_torchtitan
def test_published_configs_carried_to_0_3(torchtitan_reads):
    """The published bf16 0.2 TOMLs, re-exported for 0.3, are valid 0.3 configs that read back
    as the layout meshplan read from the TOML."""
    for stem, (devices, _) in PUBLISHED.items():
        if stem not in torchtitan_reads:
            continue
        layout, arch = from_torchtitan((PUBLISHED_DIR / f"{stem}.toml").read_text(),
                                       devices=devices)
        got = torchtitan_reads[stem]
        assert got["dp_shard"] == layout.dp
        back, _ = from_torchtitan(_registry_of(got, function_name(arch)), devices=devices)
        assert back == layout


@needs_torchtitan
@pytest.mark.parametrize("function", OWN)
def test_bases_are_torchtitans(function, torchtitan_reads):
    """BASES_03 + DEFAULTS_03 (what a config function sets when the file or line does not)
    equals what torchtitan 0.3.0's own function returns."""
    got = torchtitan_reads[function]
    ours = _base_values(function)
    for section in ("training", "parallelism", "compile"):
        theirs = {k: got[section][k] for k in ours[section]}
        if section == "training":
            theirs["disable_cuda_graphs"] = ours[section]["disable_cuda_graphs"]  # see below
        if section == "parallelism" and ours[section]["data_parallel_shard_degree"] == -1:
            theirs["data_parallel_shard_degree"] = -1  # resolved by ParallelDims, not the config
        assert theirs == ours[section], (function, section)
    ac = {"SelectiveAC.Config": "selective", "FullAC.Config": "full", None: "none"}
    assert ac[got["activation_checkpoint"]] == ours["ac"]
    assert tuple(got["flavor"]) == ours["flavor"]


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


def _dry_layouts():
    """The two dry runs' layouts: the llama3 debugmodel at dp 4 x tp 2 (a meshplan plan) and
    qwen3's debugmodel_moe at dp 4 x tp 2 with ep 4."""
    dense, dense_arch = _debug_plan(dp=4, tp=2, zero=3, sequence_parallel=True,
                                    recompute="selective", dtype="bf16", microbatch_size=2)
    moe_arch = FLAVORS[("qwen3", "debugmodel_moe")]
    moe = StackLayout(dp=4, tp=2, ep=4, global_batch=16, seq_len=256, microbatch_size=2,
                      zero=3, sequence_parallel=True, recompute="selective")
    return {"dry": (dense, dense_arch), "drymoe": (moe, moe_arch)}


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Both Trainer dry runs in one worker process (torchtitan's imports paid once): name ->
    (torchtitan's answer, layout, arch)."""
    tmp = tmp_path_factory.mktemp("dry")
    layouts = _dry_layouts()
    jobs = []
    for name, (layout, arch) in layouts.items():
        job = _job(tmp, name, layout, arch)
        job.update(extra=["--parallelism.spmd_backend", "partial_dtensor"], steps=0)
        jobs.append(job)
    got = _run_worker(tmp, "steps", jobs)
    return {name: (g, *layouts[name]) for name, g in zip(layouts, got)}


@pytest.mark.slow
@needs_torchtitan
def test_torchtitan_trainer_dry_run(dry_runs):
    """plan -> layout -> config_registry.py -> torchtitan 0.3.0's Trainer on its fake
    communication backend (comm.mode = "fake_backend", rank 0 of dp 4 x tp 2 on the CPU): it
    builds the model, applies TP / AC / FSDP, initializes the weights and builds the
    optimizer. No training step: 0.3.0 builds language models with FlexAttention only
    (``get_attention_config``: "sdpa is no longer supported for language models"), and
    torch's FlexAttention has no CPU backward ("FlexAttention does not support backward on
    CPU"); the step needs a GPU. With ``parallelism.spmd_backend = "partial_dtensor"``: under
    0.3.0's default, "spmd_types", ``fully_shard`` refuses the CPU model's parameters ("When
    dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh ... Got
    plain tensor for parameter 'weight'"); the export leaves the backend to torchtitan."""
    got, layout, arch = dry_runs["dry"]
    assert got["model_parts"] == 1 and got["steps"] == 0
    assert got["grad_accumulation"] == layout.microbatches
    a = arch  # the debugmodel's weights (DTensor numel counts the global tensor)
    block = a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * \
        a.hidden + 3 * a.hidden * a.ffn_hidden + 2 * a.hidden
    assert got["params"] == 2 * a.vocab * a.hidden + a.layers * block + a.hidden


@needs_torchtitan
def test_flavor_table_and_split_rule_are_torchtitans(tmp_path):
    """FLAVORS holds torchtitan 0.3.0's dense llama3 / qwen3 flavors (dimensions read off its
    own models built on meta) and its Qwen3-MoE / DeepSeek-V3 flavors (read off their configs:
    experts, router, MLA ranks, dense blocks); default_split is its
    _generate_llm_fqn_per_model_part."""
    proc = subprocess.run([sys.executable, str(WORKER), "flavors"], capture_output=True,
                          text=True, timeout=1200, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    ours = {f"{name}/{flavor}": arch for (name, flavor), arch in FLAVORS.items()
            if not arch.experts}
    for key, arch in ((k, a) for (n, f), a in FLAVORS.items() if a.experts
                      for k in [f"{n}/{f}"]):  # the mixtures of experts, field by field
        dims = got["moe"][key]
        assert dims.pop("score") == ("sigmoid" if arch.family == "deepseek_v3" else "softmax")
        if dims["ffn_hidden"] is None:  # no dense block: the width is never built
            dims["ffn_hidden"] = arch.ffn_hidden
        assert {k: getattr(arch, k) for k in dims} == {
            k: tuple(v) if k == "dense_layers" else v for k, v in dims.items()}, key
    for key, arch in ours.items():
        dims = got["flavors"][key]
        assert dims["wq_rows"] in (arch.heads * arch.head_dim,
                                   (arch.heads + 2 * arch.kv_heads) * arch.head_dim), key
        for k in ("hidden", "vocab", "layers", "ffn_hidden", "head_dim", "heads", "kv_heads",
                  "rope_theta", "tied_embeddings"):
            assert dims[k] == getattr(arch, k), (key, k)
    assert got["splits"]
    for key, counts in got["splits"].items():
        stages, layers, first, last = map(int, key.split(","))
        assert list(default_split(stages, layers, first, last)) == counts, key


BENCH_EXPORTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "stack_exports"


def test_benchmark_exports_read():
    """The config registries benchmarks/stack_exports.py wrote for `plan --for torchtitan` and
    for the MoE layouts (the files the results table cites) read as layouts that export to the
    same file again."""
    files = sorted(BENCH_EXPORTS.glob("*.meshplan_config_registry.py"))
    if not files:
        pytest.skip("run benchmarks/stack_exports.py first")
    for f in files:
        layout, arch = from_torchtitan(f.read_text())  # an export names every degree
        assert to_torchtitan(layout, arch) == f.read_text(), f.name


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


@needs_torchtitan
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_exports_accepted_by_torchtitan(case, torchtitan_reads):
    """The MoE exports (Qwen3-30B-A3B, DeepSeek-V3 671B with expert parallelism): torchtitan
    0.3.0's ConfigManager builds them (flavor, expert_parallel_degree), the override line
    parses to the same sections, ParallelDims validates the degrees (dp_shard x cp x tp =
    efsdp x ep) and builds the meshes, the ep mesh among them; read back: the same layout."""
    arch, layout = MOE_CASES[case]
    got = torchtitan_reads[case]
    p = got["parallelism"]
    assert got["flavor"] == [flavor_of(arch).name, flavor_of(arch).flavor]
    assert got.get("command_differs", {}) == {}
    assert p["expert_parallel_degree"] == layout.ep
    assert got["meshes"].get("ep", 1) == layout.ep
    assert got["meshes"].get("efsdp", 1) * layout.ep == got["dp_shard"] * layout.cp * layout.tp
    back, back_arch = from_torchtitan(_registry_of(got, function_name(arch)),
                                      devices=layout.devices)
    assert back == layout and dataclasses.replace(back_arch, max_positions=arch.max_positions,
                                                  ffn_hidden=arch.ffn_hidden) == arch


def test_moe_round_trip_and_refusals():
    """MoE layouts come back from the registry and the command line with their ep; what
    torchtitan 0.3.0 cannot run is one line."""
    for arch, layout in MOE_CASES.values():
        text = to_torchtitan(layout, arch)
        assert f"config.parallelism.expert_parallel_degree = {layout.ep}" in text
        assert from_torchtitan(text, devices=layout.devices)[0] == layout
        assert from_torchtitan(torchtitan_command(layout, arch),
                               devices=layout.devices)[0] == layout
    arch, layout = MOE_CASES["qwen3-30B-A3B-16"]
    assert problems(dataclasses.replace(layout, zero=0), arch) == (
        "ep=8 must divide dp_shard x cp x tp = 1: torchtitan borrows the expert-parallel ranks "
        "from FSDP and TP (efsdp = dp_shard x cp x tp / ep), never from "
        "data_parallel_replicate; shard the weights (zero=2 or 3) or choose a divisor",)
    assert "for a dense model" in problems(dataclasses.replace(layout, ep=2),
                                           FLAVORS[("llama3", "8B")])[0]
    for preset, words in (("mixtral-8x7b", "ships no mixtral model"),
                          ("deepseek-v3", "rms_norm_eps 1e-06 here, 1e-05 in 671B"),
                          ("qwen3-235b-a22b", "rope_theta 1000000.0 here, 5000000.0 in "
                                              "235B-A22B")):
        why = flavor_problem(arch_of_spec(preset))
        assert words in why and "\n" not in why, why


@pytest.mark.slow
@needs_torchtitan
def test_torchtitan_trainer_dry_run_moe(dry_runs):
    """An MoE export through torchtitan 0.3.0's Trainer on the fake backend (rank 0 of dp 4 x
    tp 2 with ep 4 over dp_shard x tp, CPU, as test_torchtitan_trainer_dry_run): qwen3's
    debugmodel_moe builds with TP, expert parallelism, selective AC and FSDP, its weights
    initialized and its optimizer built; the parameter count is the flavor's (64 experts of
    width 768 in each of 8 blocks). Run in the same worker process as the dense dry run."""
    got, layout, arch = dry_runs["drymoe"]
    assert got["model_parts"] == 1 and got["grad_accumulation"] == layout.microbatches
    a = arch
    attention = a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim + \
        a.heads * a.head_dim * a.hidden
    block = attention + 3 * a.experts * a.hidden * a.moe_ffn_hidden + a.hidden * a.experts + \
        2 * a.hidden + 2 * a.head_dim  # router gate, the two norms, q/k norms
    assert got["params"] == 2 * a.vocab * a.hidden + a.layers * block + a.hidden
