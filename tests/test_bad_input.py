"""Issue 13's bad-input list: each case is one line naming the value, the rule and the fix;
the command exits 2 and writes nothing; the API raises a MeshplanError (no traceback from
deep inside torch, nothing silently accepted). Ctrl-C during `meshplan run` is covered in
tests/test_launch_multinode.py, `run --steps 0` and `--timeout-s 0` in tests/test_cli.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import meshplan
from meshplan.cli import main
from meshplan.errors import MeshplanError

GPT = "transformers:gpt2?n_layer=2&n_embd=32&n_head=2&vocab_size=64&n_positions=32"
PLAN = ["plan", "--mesh", "local:2", "--batch", "4", "--seq", "8"]

FACTORIES = '''
import torch.nn as nn

def boom():
    raise RuntimeError("factory exploded")

def needs(width):
    return nn.Linear(width, width)
'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    path = tmp_path_factory.mktemp("facs") / "facs.py"
    path.write_text(FACTORIES)
    return str(path)


def _one_line_exit_2(argv, out, capsys, message):
    assert main(argv + ["-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("model, extra, message", [
    ("transformers:gpt2?n_layer=two", [], "config n_layer='two': expected int (default 12)"),
    ("transformers:gpt2?n_layer=2.5", [], "config n_layer=2.5: expected int"),
    ("transformers:gpt2?n_layr=2", [], "has no config key 'n_layr'; did you mean n_layer?"),
    ("{factories}:boom", [], "the factory raised RuntimeError: factory exploded"),
    ("{factories}:needs", [], "the factory takes arguments (width)"),
    (GPT, ["--seq", "0"], "argument --seq: 0 must be positive"),
    (GPT, ["--batch", "0"], "argument --batch: 0 must be positive"),
    (GPT, ["--batch", "-8"], "argument --batch: -8 must be positive"),
    (GPT, ["--seq", "64"], "--seq 64 is longer than the model's 32 positions; use --seq 32"),
    (GPT, ["--batch", "1000000000"], "tokens per step, over 2^31 - 1"),
    (GPT, ["--time-limit-s", "-1"], "argument --time-limit-s: -1 must be positive"),
    (GPT, ["--memory-limit-gib", "0"], "argument --memory-limit-gib: 0 must be positive"),
])
def test_plan_command_bad_input(model, extra, message, factories, tmp_path, capsys):
    argv = PLAN + ["--model", model.format(factories=factories)] + extra
    _one_line_exit_2(argv, tmp_path / "plan.json", capsys, message)


@pytest.mark.parametrize("extra, message", [
    (["--batch", "-3"], "argument --batch: -3 must be positive"),
    (["--batch", "8", "--seq", "0"], "argument --seq: 0 must be positive"),
])
def test_estimate_command_refuses_non_positive_sizes(extra, message, capsys):
    argv = ["estimate", "--model", GPT, "--mesh", "local:2", "--manual", "dp=2"] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_hand_edited_placement_is_refused_before_any_process_starts(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(PLAN + ["--model", GPT, "--manual", "dp=2", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert data["model"]["spec"] == GPT  # the plan knows its model: run needs no --model
    params = data["stages"][0]["params"]
    name = next(n for n in params if n.endswith("c_attn.weight"))
    params[name] = ["S(7)"] + params[name][1:]
    plan.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"parameter {name} is placed S(7) on mesh axis 0, but it has 2 dims" in err
    assert len(err.strip().splitlines()) == 1


def test_a_plan_from_a_python_model_asks_for_its_spec(tmp_path, capsys):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), (torch.randn(4, 8),), dp=2,
                                example_targets=(torch.randint(0, 4, (4,)),),
                                loss_fn=nn.functional.cross_entropy)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "records no model spec; pass --model SPEC" in err


# -- the Python API --------------------------------------------------------------------------

MODEL = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
X, Y = torch.randn(4, 8), torch.randint(0, 4, (4,))


def _auto(**kw):
    args = dict(example_inputs=(X,), example_targets=(Y,), loss_fn=nn.functional.cross_entropy)
    args.update(kw)
    mesh = args.pop("mesh", meshplan.Mesh.local(2))
    return meshplan.autoparallel(MODEL, mesh, **args)


@pytest.mark.parametrize("kw, message", [
    (dict(microbatches=[0]), "microbatches=[0]: give microbatch counts as positive integers"),
    (dict(time_limit_s=-1), "time_limit_s=-1: the solver's time limit must be positive"),
    (dict(memory_limit_gib=-1), "memory_limit_gib=-1: must be positive"),
    (dict(max_stages=0), "max_stages=0: at least 1 pipeline stage"),
    (dict(mesh=4), "mesh=4 is a int; pass a meshplan.Mesh"),
    (dict(loss_fn=lambda o, t: nn.functional.cross_entropy(o, t, reduction="none")),
     "loss_fn returned a tensor of shape (4,), not a scalar tensor"),
    # significant digits, however small the limit: not "0.00 GiB ... at least 0.00 GiB"
    (dict(memory_limit_gib=1e-7), "no plan fits 1e-07 GiB per device"),
])
def test_api_bad_input(kw, message):
    with pytest.raises(MeshplanError) as info:
        _auto(**kw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_api_takes_a_mesh_spec_string():
    plan = _auto(mesh="local:2")
    assert plan.num_devices == 2


def test_memory_error_shows_significant_digits():
    with pytest.raises(MeshplanError) as info:
        _auto(memory_limit_gib=1e-7)
    assert "at least 0.00 GiB" not in str(info.value)
