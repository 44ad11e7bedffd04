"""The examples/ scripts run as a user runs them: ``torchrun --nproc-per-node 4
examples/X.py --check --steps 2`` (gloo, 4 local processes), each asserting on rank 0 that
its losses (and eval loss, where the plan allows a forward-only call) equal plain PyTorch
in one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.runtime.launch import free_port

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["causal_lm_tokens.py", "image_classifier_bn.py",
                                    "encoder_decoder.py", "config_file.py"])
def test_example_matches_one_process(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING",
           "TRANSFORMERS_VERBOSITY": "error"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=1",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_backend=c10d", "--max_restarts=0",
           str(EXAMPLES / script), "--check", "--steps", "2", "--plan-dir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "losses equal one process" in proc.stdout
    # gradient norms or weights (BatchNorm's buffers included) too, not losses alone
    assert "weights equal one process" in proc.stdout, proc.stdout[-3000:]
    assert (tmp_path / "plan.json").exists()  # rank 0 planned, the others read its file
    assert proc.stdout.count("\nstep ") == 2
    if script == "config_file.py":  # the model came from the config.json it wrote
        assert "weights equal one process" in proc.stdout
        assert (tmp_path / "config.json").exists()


@pytest.mark.slow
def test_factories_example_plans_every_factory(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "factories.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "convnet: meshplan plan" in proc.stdout
    assert "encoder_decoder: meshplan plan" in proc.stdout


def test_stacks_export_example_reads_back_what_it_wrote(tmp_path):
    """examples/stacks_export.py: plan --for torchtitan and megatron, export, import: the same
    layouts and predictions come back (its --check asserts them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "stacks_export.py"), "--check",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "read back: same layouts, same predictions" in proc.stdout
    assert (tmp_path / "torchtitan_config_registry.py").exists() and \
        (tmp_path / "megatron.txt").exists()


def test_will_it_fit_example_checks_its_answer(tmp_path):
    """examples/will_it_fit.py: meshplan.fit's smallest mesh and fastest layouts, rebuilt
    with manual_plan and checked (its --check asserts them)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / "will_it_fit.py"), "--check"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "smallest mesh: 2 nodes (16 GPUs)" in proc.stdout, proc.stdout
    assert "checked: " in proc.stdout
