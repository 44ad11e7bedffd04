"""`meshplan demo` end to end on 2 processes: plan, train, compare with one process."""

from meshplan.demo import run_demo


def test_demo_multi_process_losses_equal_one_process(tmp_path, capsys):
    assert run_demo(procs=2, steps=2, workdir=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "equal within 1e-5 / 1e-4" in out and "predicted" in out and "measured" in out
    assert "plain PyTorch" in out
    assert (tmp_path / "plan-2.json").exists() and (tmp_path / "metrics-1.json").exists()
