"""Issues 13 and 28's bad-input lists: each case is one line naming the value, the rule and
the fix; the command exits 2 before any process starts and writes nothing; the API raises a
MeshplanError (no traceback from deep inside torch, nothing silently accepted). Ctrl-C during
`meshplan run` is covered in tests/test_launch_multinode.py, `run --steps 0` and
`--timeout-s 0` in tests/test_cli.py."""

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


# -- issue 28: checked before launch ---------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory):
    """A dp=2 plan of GPT, made on the command line (it records its model spec)."""
    path = tmp_path_factory.mktemp("plan28") / "plan.json"
    assert main(PLAN + ["--model", GPT, "--manual", "dp=2", "-o", str(path)]) == 0
    return path


@pytest.fixture
def no_launch(monkeypatch):
    """`meshplan run` must answer before any worker starts: starting one fails the test."""
    import torch.distributed.launcher.api as launcher

    def refuse(*a, **k):
        raise AssertionError("a worker was launched")
    monkeypatch.setattr(launcher, "elastic_launch", refuse)


def _run_exit_2(argv, capsys, message):
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _edited(plan_path, tmp_path, edit):
    data = json.loads(plan_path.read_text())
    edit(data)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


def test_a_tampered_fingerprint_is_refused_before_launch(gpt_plan, tmp_path, no_launch, capsys):
    def tamper(d):
        d["model"]["fingerprint"] = "sha256:" + "0" * 32
    bad = _edited(gpt_plan, tmp_path, tamper)
    metrics = tmp_path / "m.json"
    _run_exit_2(["run", str(bad), "--steps", "1", "--metrics-out", str(metrics)], capsys,
                "with fingerprint sha256:000")
    assert not metrics.exists()


def test_a_plan_for_another_model_is_refused_before_launch(gpt_plan, no_launch, capsys):
    other = GPT.replace("n_layer=2", "n_layer=3")
    _run_exit_2(["run", str(gpt_plan), "--model", other, "--steps", "1"], capsys,
                "make a new plan for this model")


def test_show_refuses_a_shard_dim_the_weight_does_not_have(gpt_plan, tmp_path, capsys):
    def s7(d):
        params = d["stages"][0]["params"]
        name = next(n for n in params if n.endswith("c_attn.weight"))
        params[name] = ["S(7)"] + params[name][1:]
    bad = _edited(gpt_plan, tmp_path, s7)
    err = _run_exit_2(["show", str(bad)], capsys, "is placed S(7) on mesh axis 0, but it has "
                      "2 dims")
    assert "split on dim 7" not in err


def _fake_checkpoint(directory, step):
    """What checkpoint.latest_step reads: a complete checkpoint is a step_NNNNNN folder."""
    (directory / f"step_{step:06d}").mkdir(parents=True)


def test_a_checkpoint_dir_typo_is_refused(gpt_plan, tmp_path, no_launch, capsys):
    _fake_checkpoint(tmp_path / "ckpt", 4)
    typo = tmp_path / "ckpy"
    _run_exit_2(["run", str(gpt_plan), "--steps", "8", "--checkpoint-dir", str(typo)], capsys,
                f"--checkpoint-dir {typo} does not exist, but {tmp_path / 'ckpt'} holds "
                "checkpoints (step 4)")
    assert not typo.exists()
    missing = tmp_path / "nowhere" / "ckpt"
    _run_exit_2(["run", str(gpt_plan), "--steps", "8", "--checkpoint-dir", str(missing)],
                capsys, f"its parent {tmp_path / 'nowhere'} does not exist")
    assert not missing.parent.exists()


@pytest.mark.parametrize("steps", ["3", "4"])
def test_steps_at_or_below_the_checkpoint_are_refused(steps, gpt_plan, tmp_path, no_launch,
                                                      capsys):
    _fake_checkpoint(tmp_path / "ckpt", 4)
    _run_exit_2(["run", str(gpt_plan), "--steps", steps, "--checkpoint-dir",
                 str(tmp_path / "ckpt")], capsys,
                f"--steps {steps}: the checkpoint in {tmp_path / 'ckpt'} has trained 4 steps "
                "already; pass --steps 5 or more")


@pytest.mark.parametrize("written, read, message", [
    ("uint32", "uint16", "looks like uint32 token ids read as uint16"),
    ("uint16", "uint32", "but the model's vocabulary has 64 ids"),
])
def test_a_token_file_of_the_other_width_is_refused(written, read, message, gpt_plan, tmp_path,
                                                    no_launch, capsys):
    import numpy as np

    data = tmp_path / "train.bin"
    np.random.default_rng(0).integers(1, 64, 4096).astype(written).tofile(data)
    _run_exit_2(["run", str(gpt_plan), "--steps", "1", "--data", str(data), "--data-dtype",
                 read], capsys, message)


def test_a_metrics_path_that_cannot_be_written_is_refused_before_launch(gpt_plan, tmp_path,
                                                                       no_launch, capsys):
    _run_exit_2(["run", str(gpt_plan), "--steps", "1", "--metrics-out", str(tmp_path)], capsys,
                f"cannot write {tmp_path}: it is a directory")


def test_an_unresolvable_rendezvous_host_is_one_line(gpt_plan, no_launch, capsys):
    _run_exit_2(["run", str(gpt_plan), "--steps", "1", "--rdzv-endpoint",
                 "no-such-host.invalid:29500"], capsys,
                "host 'no-such-host.invalid' does not resolve")


def test_checks_inside_the_workers_are_one_line_and_exit_2(gpt_plan, capfd):
    """A check only a worker makes (here: the module engine's parameter names, reached by
    launching without the command line's checks) ends the run with one line and exit 2."""
    from meshplan.runtime.launch import run_plan

    other = GPT.replace("n_layer=2", "n_layer=3")
    assert run_plan(str(gpt_plan), model=other, steps=1) == 2
    err = capfd.readouterr().err.strip()
    assert "places no parameter transformer.h.2" in err, err
    assert len(err.splitlines()) == 1 and err.startswith("meshplan run: error:"), err


SIBLING = """
import torch.nn as nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab_size = 32
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        return self.out(self.emb(ids))
"""


def test_a_factory_imports_its_sibling_and_a_plan_finds_it_from_another_folder(
        tmp_path, monkeypatch, no_launch, capsys):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "house28_sibling.py").write_text(SIBLING)
    (proj / "fac.py").write_text("from house28_sibling import Tiny\n\n\ndef make():\n"
                                 "    return Tiny()\n")
    (tmp_path / "plans").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert main(["plan", "--model", "proj/fac.py:make", "--mesh", "local:2", "--batch", "4",
                 "--seq", "8", "--manual", "dp=2", "-o", "plans/plan.json"]) == 0
    assert json.loads((tmp_path / "plans/plan.json").read_text())["model"]["spec"] == \
        "../proj/fac.py:make"  # relative to the plan file
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["run", str(tmp_path / "plans/plan.json"), "--steps", "1",
                 "--print-torchrun"]) == 0  # every pre-launch check, the trace included
    assert f"{proj / 'fac.py'}:make" in capsys.readouterr().out


def test_api_refuses_context_parallel_degrees_the_mesh_cannot_take():
    with pytest.raises(MeshplanError) as info:
        _auto(mesh=meshplan.Mesh.local(4), context_parallel=(3,))
    assert "context_parallel=(3,): 3 does not divide the mesh's 4 devices; choose degrees " \
        "from (1, 2, 4)" in str(info.value)


@pytest.mark.parametrize("nodes", ["abc", 2.5])
def test_mesh_preset_refuses_a_node_count_that_is_not_one(nodes):
    with pytest.raises(MeshplanError) as info:
        meshplan.Mesh.preset("dgx-h100", nodes=nodes)
    assert "nodes must be a positive whole number" in str(info.value)


def test_manual_plan_refuses_a_sequence_longer_than_the_positions():
    from meshplan.specs import parse_model_spec

    model = parse_model_spec(GPT).build(device="meta")
    ids = torch.zeros(4, 64, dtype=torch.long, device="meta")
    with pytest.raises(MeshplanError) as info:
        meshplan.manual_plan(model, meshplan.Mesh.local(2), (ids,), dp=2)
    assert "sequences of 64 tokens, longer than the model's 32 positions" in str(info.value)


def test_a_float_model_without_loss_or_targets_is_refused():
    with pytest.raises(MeshplanError) as info:
        meshplan.autoparallel(MODEL, meshplan.Mesh.local(2), (X,))
    assert "neither loss_fn nor example_targets" in str(info.value)


@pytest.mark.parametrize("vocab", [64, 128_256])  # GPT-2-sized and Llama-3-sized vocabularies
def test_token_width_rule_on_the_file_alone(vocab, tmp_path):
    """check_sample's rule 1: uint32 ids read as uint16 (the high halves at odd positions
    stay within (vocab - 1) >> 16) are refused; the same ids written as uint16 pass."""
    import numpy as np

    from meshplan.runtime.data import TokenFile

    rng = np.random.default_rng(1)
    wide, narrow = tmp_path / "wide.bin", tmp_path / "narrow.bin"
    rng.integers(0, vocab, 4096).astype(np.uint32).tofile(wide)  # ids above 65,535 too
    rng.integers(0, min(vocab, 65_536), 4096).astype(np.uint16).tofile(narrow)
    with pytest.raises(MeshplanError, match="looks like uint32 token ids read as uint16"):
        TokenFile(str(wide), "uint16").check_sample(vocab)
    TokenFile(str(narrow), "uint16").check_sample(vocab)
    TokenFile(str(wide), "uint32").check_sample(vocab)


def test_print_torchrun_with_a_new_checkpoint_dir_prints_only_the_command(gpt_plan, tmp_path,
                                                                          capsys):
    capsys.readouterr()
    assert main(["run", str(gpt_plan), "--steps", "2", "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--print-torchrun"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "torch.distributed.run" in out[0], out
    assert not (tmp_path / "ckpt").exists()


# -- issue 42: the bad-input tour's last tracebacks ---------------------------------------------

USER_MODELS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

import meshplan


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))


def wrong_features():  # the MLP takes 32 features; the examples have 16
    return meshplan.ModelBundle(mlp(), torch.randn(8, 16), torch.tensor([0, 9] * 4),
                                F.cross_entropy)


class LearnedPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.vocab_size = 64
        self.tok = nn.Embedding(64, 32)
        self.pos = nn.Embedding(16, 32)  # 16 positions
        self.out = nn.Linear(32, 64)

    def forward(self, ids):
        t = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.out(self.tok(ids) + self.pos(t))


def positions():
    return LearnedPositions()


def smoothed(logits, labels):
    return F.cross_entropy(logits, labels, label_smoothing=0.1)


def plain_loss():
    return meshplan.ModelBundle(mlp(), torch.randn(8, 32), torch.tensor([0, 9] * 4),
                                F.cross_entropy)


def smoothed_loss():
    return meshplan.ModelBundle(mlp(), torch.randn(8, 32), torch.tensor([0, 9] * 4), smoothed)
'''


@pytest.fixture(scope="module")
def user_models(tmp_path_factory):
    path = tmp_path_factory.mktemp("tour42") / "user_models.py"
    path.write_text(USER_MODELS)
    return str(path)


def test_a_wrong_feature_dimension_is_meshplans_line_alone(user_models, tmp_path, capfd):
    """Before: torch's fake-tensor log (a traceback, on stderr) came first, then a line that
    advised making the code traceable."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{user_models}:wrong_features", "--mesh", "local:2",
                 "--batch", "8", "-o", str(out)]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [err.strip()], err  # one line, no torch log before it
    assert "the example tensors ([8, 16] float32, [8] int64) do not fit Sequential: a and b " \
        "must have same reduction dim, but got [8, 16] X [32, 64]" in err, err
    assert "Traceback" not in err and not out.exists()


def test_a_position_table_shorter_than_seq_is_refused_at_plan_time(user_models, tmp_path,
                                                                   capsys):
    """Before: the plan was written, and the run's first step died with an IndexError inside
    torch.nn.functional.embedding."""
    _one_line_exit_2(["plan", "--model", f"{user_models}:positions", "--mesh", "local:2",
                      "--batch", "4", "--seq", "32", "--manual", "dp=2"], tmp_path / "p.json",
                     capsys, "pos.weight has 16 rows, but its positions come from torch.arange "
                     "over 32 tokens and reach row 31: a sequence of 32 (--seq 32) would fail "
                     "at the first step; use --seq 16 or less")
    assert main(["plan", "--model", f"{user_models}:positions", "--mesh", "local:2",
                 "--batch", "4", "--seq", "16", "--manual", "dp=2",
                 "-o", str(tmp_path / "ok.json")]) == 0  # 16 tokens fit 16 rows


def test_a_plan_run_with_another_loss_names_both_losses(user_models, tmp_path, no_launch,
                                                        capsys):
    """Before: 'plan was made for model ... with fingerprint ...', which does not say that
    the loss is what changed."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{user_models}:plain_loss", "--mesh", "local:2",
                 "--batch", "8", "--manual", "dp=2", "--engine", "graph",
                 "-o", str(plan)]) == 0
    assert json.loads(plan.read_text())["model"]["loss"] == "torch.nn.functional.cross_entropy"
    _run_exit_2(["run", str(plan), "--model", f"{user_models}:smoothed_loss", "--steps", "1"],
                capsys, "was made with the loss torch.nn.functional.cross_entropy, but this "
                "run's loss is smoothed")


def test_a_plan_finds_its_factory_in_another_tree_through_links_and_copies(
        user_models, tmp_path, monkeypatch, no_launch, capsys):
    """Before: a plan written into a linked folder resolved the factory's relative path from
    the folder's real location (/.../real/deep/other/...), and a plan copied to another tree
    from the copy's folder: both named a file that is not there."""
    factory = tmp_path / "models" / "fac.py"
    factory.parent.mkdir()
    factory.write_text(USER_MODELS)
    real = tmp_path / "real" / "deep" / "dir"
    real.mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    monkeypatch.chdir(tmp_path / "link")
    assert main(["plan", "--model", f"{factory}:plain_loss", "--mesh", "local:2", "--batch",
                 "8", "--manual", "dp=2", "-o", str(tmp_path / "link" / "plan.json")]) == 0
    capsys.readouterr()
    assert main(["run", "plan.json", "--steps", "1", "--print-torchrun"]) == 0
    assert f"--model {factory}:plain_loss" in capsys.readouterr().out
    elsewhere = tmp_path / "other-tree" / "runs"
    elsewhere.mkdir(parents=True)
    (elsewhere / "plan.json").write_text((real / "plan.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(elsewhere / "plan.json"), "--steps", "1", "--print-torchrun"]) == 0
    assert f"--model {factory}:plain_loss" in capsys.readouterr().out


def test_the_api_names_both_losses_when_a_plan_meets_another_loss():
    """What ``meshplan.parallelize`` (graph engine) and ``meshplan run`` check: the plan
    records its loss (``model.loss``), and a graph traced with another is refused naming both
    (a loss module by its repr, meshplan's default by name)."""
    import torch.nn.functional as F

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.tensor([0, 3, 1, 2])
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), example_inputs=(x,),
                                example_targets=(y,), loss_fn=F.cross_entropy, dp=2)
    assert plan.model.loss == "torch.nn.functional.cross_entropy"
    for other, named in [(nn.CrossEntropyLoss(label_smoothing=0.1), "CrossEntropyLoss()"),
                         (None, "meshplan's default (cross entropy against the targets)")]:
        if other is None:  # the default loss traces the same cross entropy: nothing to refuse
            graph = meshplan.trace(model, (x,), example_targets=(y,))
            assert graph.loss == named
            continue
        graph = meshplan.trace(model, (x,), example_targets=(y,), loss_fn=other)
        with pytest.raises(MeshplanError) as info:
            plan.check_graph(graph)
        assert f"was made with the loss torch.nn.functional.cross_entropy, but this run's " \
            f"loss is {named}" in str(info.value)
