"""Pricing profiles that are not runtimes (``costmodel/runtime_profiles.STACKS``: megatron,
megatron-2021, nemo, torchtitan) end to end: ``plan --manual --engine`` and ``estimate
--engine`` price every one as the Python API does; a plan priced for one is written, read back
and exported; ``meshplan run`` and ``meshplan.parallelize`` refuse it in one line naming the
stack, the rule and the export, before any process starts."""

import pytest

import meshplan
from meshplan.cli import main
from meshplan.costmodel.runtime_profiles import PROFILES, STACKS
from meshplan.vocabulary import EXPORT_TARGET
from meshplan.errors import NotSupportedError
from meshplan.inspect import fmt_time
from meshplan.plan import Plan, plan_schema
from meshplan.specs import parse_model_spec

# a llama small enough to trace in about a second (export reads llama / qwen3 decoders)
M = ("transformers:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=2"
     "&num_attention_heads=4&num_key_value_heads=4&vocab_size=256"
     "&max_position_embeddings=128")
SHAPE = ["--model", M, "--mesh", "local:4", "--batch", "8", "--seq", "32"]
LAYOUT = dict(dp=2, tp=2)
MANUAL = "dp=2,tp=2"


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    """One plan file per stack, made with the Python API (which always priced them all)."""
    d = tmp_path_factory.mktemp("stacks")
    spec = parse_model_spec(M)
    loaded = spec.load(8, 32, device="meta")
    graph = loaded.trace(spec.name)
    files = {}
    for stack in STACKS:
        plan = meshplan.manual_plan(loaded.model, "local:4", graph=graph, engine=stack,
                                    model_name=spec.name, **LAYOUT).with_spec(M)
        files[stack] = str(d / f"{stack}.json")
        plan.to_json(files[stack])
    auto = meshplan.manual_plan(loaded.model, "local:4", graph=graph, model_name=spec.name,
                                **LAYOUT).with_spec(M)
    files["auto"] = str(d / "auto.json")
    auto.to_json(files["auto"])
    return loaded.model, files


def one_error_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_the_plan_file_names_every_profile():
    assert plan_schema()["properties"]["engine"]["enum"] == list(PROFILES)
    assert set(EXPORT_TARGET) == set(STACKS)


@pytest.mark.parametrize("stack", list(STACKS))
def test_plan_and_estimate_price_every_stack(stack, priced, tmp_path, capsys):
    _, files = priced
    want = Plan.from_json(files[stack]).predicted.step_time_s
    out = tmp_path / "p.json"
    assert main(["plan", *SHAPE, "--manual", MANUAL, "--engine", stack, "-o", str(out)]) == 0
    said = capsys.readouterr().out
    plan = Plan.from_json(out)
    assert plan.engine == stack and plan.predicted.step_time_s == want
    # the plan is exported, not run: the command says so
    assert f"export {out} --to {EXPORT_TARGET[stack]}" in said.replace("'", "")
    assert " run " not in said.splitlines()[-1]
    assert main(["estimate", *SHAPE, "--manual", MANUAL, "--engine", stack]) == 0
    assert f"step time        {fmt_time(want)}\n" in capsys.readouterr().out
    # a plan file made for meshplan's engine, re-priced as the stack runs it
    assert main(["estimate", files["auto"], "--model", M, "--engine", stack]) == 0
    assert f"step time        {fmt_time(want)}\n" in capsys.readouterr().out


def test_estimate_engine_bad_combinations_are_one_line(priced, tmp_path, capsys):
    _, files = priced
    # the file names its engine; writing it with another engine's prediction would mix them
    code = main(["estimate", files["auto"], "--model", M, "--engine", "nemo",
                 "-o", str(tmp_path / "x.json")])
    err = one_error_line(capsys, code)
    assert "--engine nemo" in err and "-o" in err
    assert not (tmp_path / "x.json").exists()
    # re-pricing needs the model's operators, which a plan file does not hold: a plan made
    # from a Python model records no spec to re-trace
    bare = tmp_path / "bare.json"
    Plan.from_json(files["auto"]).with_spec("").to_json(bare)
    err = one_error_line(capsys, main(["estimate", str(bare), "--engine", "nemo"]))
    assert "--engine nemo" in err and "--model" in err
    # a stack's own file is priced as that stack runs it
    err = one_error_line(capsys, main(["estimate", "--from", "megatron", "args.txt", "--mesh",
                                       "local:4", "--engine", "nemo"]))
    assert "--engine nemo with --from" in err, err


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_a_stack_engine_without_a_layout_is_one_line(command, capsys):
    """The search covers meshplan's engines (a stack's own layouts: plan --for): --engine
    STACK without --manual is refused before tracing, naming both ways on."""
    err = one_error_line(capsys, main([command, *SHAPE, "--engine", "nemo"]))
    assert "--engine nemo" in err and "--manual" in err and "--for megatron" in err, err


@pytest.mark.parametrize("stack", list(STACKS))
def test_run_refuses_a_plan_for_a_stack_in_one_line(stack, priced, monkeypatch, capsys):
    _, files = priced
    from meshplan.runtime import launch

    def started(*args, **kwargs):
        raise AssertionError("a worker process was about to start")
    for name in ("run_plan", "torchrun_command", "slurm_script"):
        monkeypatch.setattr(launch, name, started)
    path = files[stack]
    err = one_error_line(capsys, main(["run", path, "--steps", "1"]))
    target = EXPORT_TARGET[stack]
    assert f"{path} was made for {stack}, a stack meshplan does not run" in err, err
    assert f"`meshplan export {path} --to {target}`" in err, err
    assert "--engine auto" in err, err


@pytest.mark.parametrize("stack", list(STACKS))
def test_parallelize_refuses_a_plan_for_a_stack(stack, priced):
    model, files = priced
    plan = Plan.from_json(files[stack])
    target = EXPORT_TARGET[stack]
    with pytest.raises(NotSupportedError) as info:
        meshplan.parallelize(model, plan)  # outside torchrun: the stack is the first word
    text = str(info.value)
    assert "\n" not in text
    assert f"this plan was made for {stack}, a stack meshplan does not run" in text, text
    assert f"meshplan export plan.json --to {target}" in text, text


@pytest.mark.parametrize("stack", [s for s in STACKS if EXPORT_TARGET[s] != s])
def test_a_plan_priced_for_a_stack_without_an_exporter_exports_as_its_target(stack, priced,
                                                                             tmp_path, capsys):
    """nemo and megatron-2021 name Megatron's layout: the export writes the same arguments as
    for the plan priced for megatron (the layout, not the price, is exported)."""
    _, files = priced
    target = EXPORT_TARGET[stack]
    got, want = tmp_path / "got.txt", tmp_path / "want.txt"
    assert main(["export", files[stack], "--to", target, "-o", str(got)]) == 0
    assert main(["export", files[target], "--to", target, "-o", str(want)]) == 0
    assert got.read_text() == want.read_text()


@pytest.mark.parametrize("stack", ["nemo", "torchtitan"])
def test_show_says_where_a_stack_plan_runs(stack, priced, capsys):
    _, files = priced
    assert main(["show", files[stack]]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"meshplan export PLAN --to {EXPORT_TARGET[stack]}" in out, out
    assert "graph engine" not in out
