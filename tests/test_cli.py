"""The meshplan command: plan end to end, and one clear line with exit code 2 on bad input."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from meshplan.cli import main
from meshplan.specs import DEMO_MODEL

PLAN_ARGS = ["plan", "--model", DEMO_MODEL, "--batch", "8", "--seq", "32"]

UNTRACEABLE = '''
import torch.nn as nn

class Branchy(nn.Module):
    vocab_size = 16
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
    def forward(self, ids):
        x = self.emb(ids)
        if x.mean() > 0:
            return x
        return -x

def make():
    return Branchy()
'''


def test_plan_writes_a_valid_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(PLAN_ARGS + ["--mesh", "local:4", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted step time" in printed and f"wrote {out}" in printed
    # the command to run it names this Python, so it works outside an activated venv
    assert f"run it with: {sys.executable} -m meshplan.cli run {out}" in printed
    data = json.loads(out.read_text())
    assert data["schema"] == "meshplan.plan/v1" and data["mesh"]["shape"] == [4]
    assert main(["show", str(out)]) == 0


@pytest.mark.parametrize("args, message", [
    (PLAN_ARGS + ["--mesh", "dgx-b300:nodes=2"], "unknown mesh 'dgx-b300:nodes=2'; use one of dgx-a100-80gb"),
    (PLAN_ARGS[:2] + ["transformers:"] + PLAN_ARGS[3:] + ["--mesh", "local:2"], "names no architecture"),
    (["plan", "--model", "nosuch.py:make", "--mesh", "local:2", "--batch", "8", "--seq", "8"],
     "model file nosuch.py does not exist"),
    (PLAN_ARGS + ["--mesh", "local:3", "--manual", "dp=3"],
     "global batch 8 is not divisible by the dp x microbatch_size 3; degrees that divide it: [1, 2, 4, 8]"),
    (PLAN_ARGS + ["--mesh", "local:4", "--manual", "dp=2,tp=3"], "dp*tp*pp = 2*3*1 = 6 devices, but mesh local:4 has 4"),
    (PLAN_ARGS + ["--mesh", "local:2", "-o", "/nonexistent/dir/p.json"], "cannot write /nonexistent/dir/p.json"),
    (["show", "/nonexistent/plan.json"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_untraceable_model_from_a_file_names_its_line(tmp_path, capsys):
    path = tmp_path / "branchy.py"
    path.write_text(UNTRACEABLE)
    args = ["plan", "--model", f"{path}:make", "--mesh", "local:2", "--batch", "4", "--seq", "8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{path}:11" in err and "if x.mean() > 0" in err and "Traceback" not in err


def test_console_script_prints_a_run_command_that_works_without_the_venv(tmp_path):
    """A bare ``meshplan`` outside the virtual environment is the shell's "command not
    found" (exit 127); the command ``meshplan plan`` prints is the script's absolute path."""
    script = shutil.which("meshplan", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("no meshplan console script beside this Python (not pip-installed)")
    out = tmp_path / "plan.json"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # no venv on PATH
    done = subprocess.run([script] + PLAN_ARGS + ["--mesh", "local:2", "-o", str(out)],
                          capture_output=True, text=True, timeout=300, env=bare)
    assert done.returncode == 0, done.stderr
    line = next(x for x in done.stdout.splitlines() if "run it with:" in x)
    command = shlex.split(line.split("run it with:", 1)[1])
    assert command == [os.path.abspath(script), "run", str(out)]
    shown = subprocess.run(command[:1] + ["show", str(out)], capture_output=True, text=True,
                           timeout=300, env=bare, cwd=tmp_path)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr


def test_console_script_prints_no_traceback_on_a_corrupt_plan(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"schema": "meshplan.plan/v1", "model": ')
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "show", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "truncated or corrupt" in out.stderr and "Traceback" not in out.stderr


# -- meshplan run: checks before anything starts, many nodes ------------------------------------

@pytest.fixture(scope="module")
def plan4(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "plan.json"
    assert main(PLAN_ARGS + ["--mesh", "local:4", "--manual", "dp=4,mb=2", "-o", str(path)]) == 0
    return str(path)


def _token_file(path, nbytes: int) -> str:
    path.write_bytes(bytes(nbytes))
    return str(path)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps 0: train at least 1 step"),
    (["--steps", "-3"], "--steps -3: train at least 1 step"),
    (["--timeout-s", "0"], "--timeout-s 0.0: the collective timeout must be positive"),
    (["--data", "{tmp}/missing.bin"], "missing.bin does not exist or is not a file"),
    (["--data", "{odd}"], "has 3 bytes, not a positive multiple of 2 (uint16)"),
    (["--data", "{odd}", "--data-dtype", "uint32"], "not a positive multiple of 4 (uint32)"),
    (["--data", "{small}"], "holds 255 tokens, fewer than one global batch of 8 x 32 = 256"),
    (["--nnodes", "3"], "--nnodes 3 does not divide the plan's 4 devices; use --nnodes in [1, 2, 4]"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400"],
     "--node-rank 2 is out of range for --nnodes 2; use 0..1"),
    (["--nnodes", "2", "--node-rank", "-1", "--rdzv-endpoint", "h:29400"], "out of range"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0:70000"], "is not HOST:PORT with PORT in 1..65535"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--nproc-per-node", "3", "--rdzv-endpoint", "h:1"],
     "2 x --nproc-per-node 3 = 6 processes, but the plan has 4 devices"),
])
def test_run_refuses_bad_input_in_one_line(plan4, tmp_path, capsys, args, message):
    files = {"tmp": str(tmp_path), "odd": _token_file(tmp_path / "odd.bin", 3),
             "small": _token_file(tmp_path / "small.bin", 255 * 2)}
    args = [a.format(**files) for a in args]
    assert main(["run", plan4, "--model", DEMO_MODEL, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_print_torchrun_is_a_valid_torchrun_command(plan4, capsys):
    import shlex

    from torch.distributed.run import get_args_parser

    assert main(["run", plan4, "--model", DEMO_MODEL, "--nnodes", "2", "--node-rank", "1",
                 "--rdzv-endpoint", "10.1.2.3:29400", "--steps", "7", "--clip", "1",
                 "--print-torchrun"]) == 0
    line = capsys.readouterr().out.strip()
    argv = shlex.split(line)
    # this interpreter's torchrun by absolute path: runs without the venv on PATH
    assert "\n" not in line and argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    bare = subprocess.run([*argv[:3], "--help"], env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0, bare.stderr  # not 127 ("command not found")
    parsed = get_args_parser().parse_args(argv[3:])  # torchrun's own parser
    assert (parsed.nnodes, parsed.nproc_per_node, parsed.node_rank) == ("2", "2", 1)
    assert parsed.rdzv_endpoint == "10.1.2.3:29400" and parsed.rdzv_backend == "c10d"
    assert parsed.module and parsed.training_script == "meshplan.worker"
    worker = parsed.training_script_args
    assert worker[worker.index("--plan") + 1] == plan4 and "--clip" in worker
    assert worker[worker.index("--steps") + 1] == "7"


def test_slurm_script_runs_torchrun_once_per_node(plan4, tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    assert main(["run", plan4, "--model", DEMO_MODEL, "--nnodes", "2", "--slurm",
                 "-o", str(script)]) == 0
    assert str(script) in capsys.readouterr().out
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=1" in text
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # Run it with stand-ins for the two SLURM commands it calls: scontrol lists the nodes,
    # srun prints the command each node would run.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", 'printf "nodeA\\nnodeB\\n"'), ("srun", 'printf "%s\\n" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node[A-B]",
           "SLURM_JOB_ID": "42"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    argv = out.stdout.splitlines()
    # the srun line names this interpreter by absolute path (the stand-in PATH above holds
    # no torchrun and no venv: a bare `torchrun` would be "command not found" on the nodes)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in argv
    assert "--rdzv-endpoint=nodeA:29500" in argv and "--rdzv-id=42" in argv
    assert argv[argv.index("--plan") + 1] == plan4


def test_manual_split_places_the_blocks(tmp_path, capsys):
    """``--manual ...,split=1/1`` gives each pipeline stage the blocks asked for (manual_plan's
    ``stage_layers``); a split that is not whole numbers is one line, exit 2."""
    from meshplan.plan import Plan

    path = tmp_path / "p.json"
    assert main(PLAN_ARGS + ["--mesh", "local:2", "--manual", "pp=2,split=2/0",
                             "-o", str(path)]) == 0
    plan = Plan.from_json(str(path))
    assert [s.layers for s in plan.stages] == [(0, 2), (2, 2)]
    capsys.readouterr()
    assert main(PLAN_ARGS + ["--mesh", "local:2", "--manual", "pp=2,split=1/x"]) == 2
    err = capsys.readouterr().err
    assert "split" in err and "blocks per pipeline chunk" in err and "Traceback" not in err
