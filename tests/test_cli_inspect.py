"""meshplan show / explain / diff / report / sweep on the command line, and their bad input:
one line on stderr and exit code 2."""

import json

import pytest

from meshplan.cli import main
from meshplan.specs import DEMO_MODEL

PLAN = ["plan", "--model", DEMO_MODEL, "--batch", "8", "--seq", "32", "--mesh", "local:4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    a, b = d / "dp.json", d / "tp.json"
    assert main(PLAN + ["--manual", "dp=4,tp=1,pp=1,mb=2", "-o", str(a)]) == 0
    assert main(PLAN + ["--manual", "dp=2,tp=2,pp=1,mb=2", "-o", str(b)]) == 0
    corrupt = d / "corrupt.json"
    corrupt.write_text(a.read_text()[:500])
    other = d / "v0.json"
    data = json.loads(a.read_text())
    data["schema"] = "meshplan.plan/v0"
    other.write_text(json.dumps(data))
    return {"a": str(a), "b": str(b), "corrupt": str(corrupt), "other": str(other),
            "missing": str(d / "nope.json"), "dir": d}


def one_error_line(capsys, code, *needles):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


def test_show(files, capsys):
    assert main(["show", files["b"]]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and "placements by layer" in out
    assert "weight split on dim 1 over axis 1 (tp)" in out  # from the file alone
    assert main(["show", files["b"], "--model", DEMO_MODEL]) == 0
    out = capsys.readouterr().out
    assert "attention qkv: column-parallel over axis 1 (tp)" in out  # re-traced


def test_explain(files, capsys):
    assert main(["explain", files["b"], "--model", DEMO_MODEL, "--node", "addmm"]) == 0
    out = capsys.readouterr().out
    assert "chosen" in out and "addmm (aten.addmm.default" in out
    assert main(["explain", files["b"], "--model", DEMO_MODEL, "--layer", "0"]) == 0
    out = capsys.readouterr().out
    assert "layer 0" in out and "more (explain --node" in out


def test_diff(files, capsys):
    assert main(["diff", files["a"], files["a"]]) == 0
    assert "place everything the same way" in capsys.readouterr().out
    assert main(["diff", files["a"], files["b"]]) == 0
    out = capsys.readouterr().out
    assert "mesh shape" in out and "step time" in out and "column-parallel" not in out


def test_report(files, capsys):
    out = files["dir"] / "r.html"
    assert main(["report", files["b"], "-o", str(out)]) == 0
    html = out.read_text()
    assert html.count("<svg class=\"figure\"") == 4 and "http" not in html.split("<body")[1] \
        .replace("http://www.w3.org/2000/svg", "")


@pytest.mark.parametrize("cmd", [["show", "{f}"], ["explain", "{f}", "--model", DEMO_MODEL,
                                                     "--node", "addmm"],
                                 ["diff", "{f}", "{a}"], ["report", "{f}", "-o", "{out}"]])
@pytest.mark.parametrize("bad,needle", [("missing", "does not exist"),
                                        ("corrupt", "not valid JSON"),
                                        ("other", "meshplan.plan/v0")])
def test_bad_plan_files(files, capsys, cmd, bad, needle):
    argv = [x.format(f=files[bad], a=files["a"], out=files["dir"] / "x.html") for x in cmd]
    one_error_line(capsys, main(argv), needle)


def test_bad_layer_node_and_model(files, capsys):
    one_error_line(capsys, main(["explain", files["a"], "--model", DEMO_MODEL, "--layer", "9"]),
                   "layer 9 does not exist", "valid layers are 0-1")
    one_error_line(capsys, main(["explain", files["a"], "--node", "no_such_op"]),
                   "not in this plan", "e.g. view, embedding")
    # a plan made on the command line records its model spec: explain needs no --model
    assert main(["explain", files["a"], "--layer", "0"]) == 0
    capsys.readouterr()
    one_error_line(capsys, main(["explain", files["a"], "--model", DEMO_MODEL]), "exactly one")
    other_model = DEMO_MODEL.replace("n_layer=2", "n_layer=3")
    one_error_line(capsys, main(["explain", files["a"], "--model", other_model, "--layer", "0"]),
                   "fingerprint")


def test_unwritable_outputs(files, capsys):
    one_error_line(capsys, main(["report", files["a"], "-o", "/nonexistent/dir/r.html"]),
                   "cannot write")
    one_error_line(capsys, main(["sweep", "--model", DEMO_MODEL, "--mesh", "local:4", "--batch",
                                 "8", "--seq", "32", "-o", "/nonexistent/s.parquet"]),
                   "cannot write")
    one_error_line(capsys, main(["sweep", "--model", DEMO_MODEL, "--mesh", "local:4", "--batch",
                                 "8", "--seq", "32", "-o", str(files["dir"] / "s.parquet"),
                                 "--plot", "/nonexistent/p.png"]), "cannot write")
    one_error_line(capsys, main(["sweep", "--model", DEMO_MODEL, "--mesh", "local:4", "--batch",
                                 "8", "--seq", "32", "-o", str(files["dir"] / "s.parquet"),
                                 "--plot", str(files["dir"] / "p.txt")]), ".png")
