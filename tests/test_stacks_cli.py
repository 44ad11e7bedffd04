"""The stacks on the command line: ``plan --for``, ``export``, ``estimate --from [--compare]``,
and their bad inputs answered in one line with exit code 2."""

import pytest

from meshplan.cli import main

# torchtitan's llama3 "debugmodel" flavor (an export names a flavor torchtitan ships)
M = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=6"
     "&num_attention_heads=16&num_key_value_heads=16&vocab_size=2048"
     "&max_position_embeddings=131072&rope_theta=500000&rms_norm_eps=1e-05")
PLAN = ["plan", "--model", M, "--mesh", "dgx-h100:nodes=1", "--batch", "16", "--seq", "8192"]


@pytest.mark.parametrize("target,suffix", [("torchtitan", "_pkg"), ("megatron", ".txt")])
def test_plan_for_export_and_read_back(target, suffix, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(PLAN + ["--for", target, "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"export {plan} --to {target}" in out.replace("'", "")
    cfg = tmp_path / f"job{suffix}"
    assert main(["export", str(plan), "--to", target, "-o", str(cfg)]) == 0
    printed = capsys.readouterr().out
    assert cfg.exists() and "wrote " + str(cfg) in printed
    if target == "torchtitan":  # a package: run by --module, and the same as overrides
        assert f"--module job_pkg --config meshplan_llama3_debugmodel" in printed
        assert "--module llama3 --config llama3_debugmodel" in printed
    assert main(["estimate", "--from", target, str(cfg), "--mesh", "dgx-h100:nodes=1",
                 "--model", M, "--compare", "-o", str(tmp_path / "back.json")]) == 0
    printed = capsys.readouterr().out
    assert "priced as" in printed and "step time" in printed
    assert f"meshplan plan --for {target}:" in printed and "+0.0% time" in printed


def test_export_refuses_what_the_stack_cannot_express(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    # a hand-written GPipe pipeline with ZeRO-3: Megatron-LM runs neither
    assert main(PLAN + ["--manual", "dp=4,pp=2,mb=1,schedule=gpipe,zero=3", "--dtype", "bf16",
                        "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "megatron cannot run this plan" in err[0]


@pytest.mark.parametrize("argv,words", [
    (["export", "nope.json", "--to", "megatron"], "nope.json"),
    (["estimate", "--from", "megatron", "missing.txt"], "--mesh"),
    (["estimate", "--from", "deepspeed", "x.txt", "--mesh", "dgx-h100"], "deepspeed"),
    (PLAN + ["--for", "megatron", "--manual", "dp=8"], "--manual"),
    (PLAN + ["--for", "megatron", "--memory-limit-gib", "40"], "--memory-limit-gib"),
    (PLAN + ["--for", "megatron", "--engine", "torchtitan"], "--engine torchtitan"),
    (PLAN + ["--for", "torchtitan", "--dtype", "fp16"], "fp16 needs loss scaling"),
    (PLAN + ["--for", "torchtitan", "--dtype", "fp8"], "rowwise recipes only"),
    (PLAN + ["--for", "megatron", "--compile"], "does not run torch.compile"),
])
def test_bad_input_is_one_line(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_typo_in_an_imported_file_is_one_line(tmp_path, capsys):
    """A misspelt key or flag would price the stack's default without a word: refused, with
    the spelling meant; a value of the wrong type too."""
    plan = tmp_path / "plan.json"
    assert main(PLAN + ["--for", "megatron", "-o", str(plan)]) == 0
    assert main(PLAN + ["--for", "torchtitan", "-o", str(tmp_path / "t.json")]) == 0
    assert main(["export", str(plan), "--to", "megatron", "-o", str(tmp_path / "a.txt")]) == 0
    assert main(["export", str(tmp_path / "t.json"), "--to", "torchtitan",
                 "-o", str(tmp_path / "j")]) == 0
    capsys.readouterr()
    args = (tmp_path / "a.txt").read_text().replace("--global-batch-size", "--global-batch-sise")
    (tmp_path / "b.txt").write_text(args)
    py = (tmp_path / "j" / "config_registry.py").read_text()
    (tmp_path / "k.py").write_text(py.replace("seq_len =", "seq_lenn ="))
    (tmp_path / "l.py").write_text(py.replace("seq_len = 8192", "seq_len = '8192'"))
    for target, f, words in (("megatron", "b.txt", "did you mean --global-batch-size"),
                             ("torchtitan", "k.py", "did you mean seq_len"),
                             ("torchtitan", "l.py", "seq_len = '8192': expected int")):
        assert main(["estimate", "--from", target, str(tmp_path / f), "--mesh",
                     "dgx-h100:nodes=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
