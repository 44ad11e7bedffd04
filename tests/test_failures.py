"""Failures never hang: when one rank dies or stops responding, every rank exits within
60 s and ``meshplan run`` prints one line naming the failed rank and exits non-zero.

Each case is one 2-process launch through the launcher behind ``meshplan run`` in a
subprocess (so its stderr can be read), with fault injection in the worker.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from meshplan.api import manual_plan
from meshplan.mesh import Mesh
from meshplan.specs import example_inputs, parse_model_spec

MODEL = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"
LIMIT_S = 60  # the bound on how long the other ranks may take to exit


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    meta = parse_model_spec(MODEL).build(device="meta")
    plan = manual_plan(meta, Mesh.local(2), example_inputs(meta, 8, 16), dp=2)
    path = tmp_path_factory.mktemp("fail") / "plan.json"
    plan.to_json(path)
    return str(path)


def launch_failing(plan_path: str, mode: str) -> tuple[int, str, float]:
    """Exit code, stderr, and seconds from the injected failure to the launcher's exit."""
    code = ("import sys\nfrom meshplan.runtime.launch import run_plan\n"
            f"sys.exit(run_plan({plan_path!r}, model={MODEL!r}, steps=3, extra=("
            f"'--fail-at-step', '1', '--fail-rank', '1', '--fail-mode', {mode!r}, "
            "'--timeout-s', '10')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    end = time.time()
    injected = re.search(r"injected failure .* at unix time ([\d.]+)", proc.stderr)
    assert injected, proc.stderr[-2000:]
    return proc.returncode, proc.stderr, end - float(injected.group(1))


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_failed_rank_is_named_and_nothing_hangs(plan_path, mode):
    code, stderr, elapsed_s = launch_failing(plan_path, mode)
    assert code != 0
    lines = [line for line in stderr.splitlines() if line.startswith("meshplan run: error:")]
    assert len(lines) == 1, stderr[-2000:]
    # a dead rank is named by itself; a hung one is found by its peer's collective timeout
    assert "rank 1 failed" in lines[0] or (mode == "hang" and "rank 0 failed" in lines[0])
    # the agent notices a dead worker within 0.1 s; a hung one fails its peer's collective
    # after the 10 s timeout; then every remaining worker is stopped
    assert elapsed_s < LIMIT_S


def test_failure_line_names_first_rank():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from meshplan.runtime.launch import failure_line

    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file=""),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="")}
    failures[0].timestamp, failures[1].timestamp = 20, 10  # rank 1 failed first
    line = failure_line(ChildFailedError("worker", failures))
    assert line.startswith("rank 1 failed (exit code 3); ranks [0] also failed")
