"""The meshplan command: plan end to end, and one clear line with exit code 2 on bad input."""

import json
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


def test_console_script_prints_no_traceback_on_a_corrupt_plan(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text('{"schema": "meshplan.plan/v1", "model": ')
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "show", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "truncated or corrupt" in out.stderr and "Traceback" not in out.stderr
