"""``--json`` on plan, estimate, fit, show, explain, diff and export: exactly one JSON document
on stdout, answer or error, each validated against docs/cli-json.schema.json with jsonschema,
its numbers compared with the plan files and the Python API; error codes stable per class."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jsonschema
import pytest

import meshplan
from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.specs import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "docs" / "cli-json.schema.json").read_text())
PLAN_SCHEMA = json.loads((ROOT / "meshplan" / "plan.schema.json").read_text())
DEMO = ["plan", "--model", DEMO_MODEL, "--batch", "8", "--seq", "32", "--mesh", "local:4"]
# torchtitan's llama3 "debugmodel" flavor (an export names a flavor torchtitan ships)
LLAMA = ("transformers:llama?hidden_size=256&intermediate_size=768&num_hidden_layers=6"
         "&num_attention_heads=16&num_key_value_heads=16&vocab_size=2048"
         "&max_position_embeddings=131072&rope_theta=500000&rms_norm_eps=1e-05")
STACK = ["plan", "--model", LLAMA, "--mesh", "dgx-h100:nodes=1", "--batch", "16", "--seq",
         "8192", "--dtype", "bf16"]


def one_document(capsys, rc_expected: int, command: str, ok: bool) -> dict:
    """stdout holds exactly one JSON document, valid against the schema."""
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 1, out[:2000]
    doc = json.loads(lines[0])
    jsonschema.validate(doc, SCHEMA)
    assert doc["schema"] == "meshplan.cli/v1" and doc["command"] == command
    assert doc["ok"] is ok, doc
    return doc


def run(capsys, argv, command, rc=0) -> dict:
    got = main(argv + ["--json"])
    doc = one_document(capsys, rc, command, ok=rc == 0)
    assert got == rc, doc
    return doc["result"] if rc == 0 else doc["error"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("json")
    a, b, tt = d / "dp.json", d / "tp.json", d / "tt.json"
    assert main(DEMO + ["--manual", "dp=4,mb=2", "-o", str(a)]) == 0
    assert main(DEMO + ["--manual", "dp=2,tp=2,mb=2", "-o", str(b)]) == 0
    # a layout torchtitan runs (FSDP2 over 8) and Megatron-LM does not (ZeRO-3)
    assert main(STACK + ["--manual", "dp=8,zero=3", "--engine", "torchtitan", "-o",
                         str(tt)]) == 0
    return {"a": str(a), "b": str(b), "tt": str(tt), "dir": d}


def test_plan(files, capsys, tmp_path):
    out = tmp_path / "p.json"
    res = run(capsys, DEMO + ["--manual", "dp=2,tp=2,mb=2", "-o", str(out)], "plan")
    jsonschema.validate(res["plan"], PLAN_SCHEMA)
    assert res["plan"] == json.loads(out.read_text())  # the document holds the file written
    assert res["output"] == str(out) and " run " in res["next"]
    assert res["summary"]["layout"] is None or "dp2" in res["summary"]["layout"]
    assert res["summary"]["predicted"]["step_time_s"] == \
        Plan.from_json(out).predicted.step_time_s


def test_show_and_diff(files, capsys):
    res = run(capsys, ["show", files["b"]], "show")
    plan = Plan.from_json(files["b"])
    assert res["plan"] == plan.to_dict()
    s = res["summary"]
    assert s["mesh"]["devices"] == 4 and s["stages"][0]["mesh_shape"] == list(plan.stages[0].mesh_shape)
    res = run(capsys, ["diff", files["a"], files["b"]], "diff")
    a, b = Plan.from_json(files["a"]), Plan.from_json(files["b"])
    assert res["identical"] is False
    assert res["step_time_s"] == [a.predicted.step_time_s, b.predicted.step_time_s]
    assert any(d["where"] == "total" and d["what"] == "step time" for d in res["differences"])
    assert run(capsys, ["diff", files["a"], files["a"]], "diff")["identical"] is True


def test_explain(files, capsys):
    res = run(capsys, ["explain", files["b"], "--model", DEMO_MODEL, "--layer", "0"], "explain")
    assert res["layer"] == 0 and res["operators"]
    for op in res["operators"]:
        assert sum(a["chosen"] for a in op["alternatives"]) <= 1


def test_estimate_each_source(files, capsys, tmp_path):
    recorded = Plan.from_json(files["a"]).predicted
    res = run(capsys, ["estimate", files["a"]], "estimate")  # the plan records its spec
    assert res["source"] == "repriced"
    assert res["estimate"]["step_time_s"] == pytest.approx(recorded.step_time_s, rel=1e-9)
    res = run(capsys, ["estimate", "--model", DEMO_MODEL, "--mesh", "local:4", "--batch", "8",
                       "--seq", "32", "--manual", "dp=4,mb=2"], "estimate")
    assert res["source"] == "manual"
    assert res["estimate"]["peak_memory_gib"] == pytest.approx(recorded.peak_memory_gib,
                                                               rel=1e-9)
    m = res["estimate"]["memory"]
    assert sum(m.values()) == pytest.approx(res["estimate"]["peak_memory_gib"], rel=1e-9)


def test_export_and_estimate_from(files, capsys, tmp_path):
    res = run(capsys, ["export", files["tt"], "--to", "torchtitan", "-o", "-"], "export")
    assert res["text"] == meshplan.export_plan(Plan.from_json(files["tt"]), "torchtitan")
    assert res["output"] is None and res["layout"].startswith("dp8")
    job = tmp_path / "job"  # torchtitan 0.3 reads a config package (a folder)
    res = run(capsys, ["export", files["tt"], "--to", "torchtitan", "-o", str(job)], "export")
    assert res["output"] == str(job) and res["text"] is None
    assert (job / "config_registry.py").exists()
    res = run(capsys, ["estimate", "--from", "torchtitan", str(job), "--mesh",
                       "dgx-h100:nodes=1", "--model", LLAMA], "estimate")
    assert res["source"] == "from" and res["from"]["layout"].startswith("dp8")
    assert res["estimate"]["step_time_s"] == pytest.approx(
        Plan.from_json(files["tt"]).predicted.step_time_s, rel=1e-9)


def test_fit(capsys):
    res = run(capsys, ["fit", "--model", LLAMA, "--gpu", "h100", "--batch", "16", "--seq",
                       "2048", "--mesh", "dgx-h100:nodes=1", "--top", "2",
                       "--time-limit-s", "600"], "fit")
    assert res["smallest_nodes"] == 1 and res["mesh_fits"] is True
    assert 1 <= len(res["fastest"]) <= 2 and res["smallest"]["fits"]
    assert res["tried"] == [{"nodes": 1, "fits": True, "priced": 1,
                             "least_gib": res["smallest"]["peak_memory_gib"]}]


@pytest.mark.parametrize("argv, command, code", [
    (["show", "/nonexistent/plan.json"], "show", "BAD_PLAN_FILE"),
    (DEMO[:-1] + ["dgx-b300:nodes=2"], "plan", "BAD_INPUT"),
    (["estimate", "--from", "deepspeed", "x.txt", "--mesh", "dgx-h100"], "estimate",
     "BAD_INPUT"),
    (["fit", "--model", DEMO_MODEL, "--gpu", "b300", "--batch", "8", "--seq", "32"], "fit",
     "BAD_MESH"),
    (["diff", "a.json", "--bogus"], "diff", "BAD_USAGE"),
    (["explain", "/nonexistent/plan.json", "--layer", "0"], "explain", "BAD_PLAN_FILE"),
])
def test_errors_are_one_document_with_a_code(argv, command, code, capsys):
    err = run(capsys, argv, command, rc=2)
    assert err["code"] == code and err["message"]


def test_memory_over_budget_and_not_expressible(files, capsys):
    err = run(capsys, DEMO + ["--memory-limit-gib", "0.000001"], "plan", rc=2)
    assert err["code"] == "MEMORY_OVER_BUDGET" and err["min_memory_gib"] > 0.000001
    err = run(capsys, ["export", files["tt"], "--to", "megatron", "-o", "-"], "export", rc=2)
    assert err["code"] == "NOT_EXPRESSIBLE" and "megatron cannot run this plan" in err["message"]


def _error_classes():
    import meshplan.runtime.engine  # noqa: F401 - DataError
    import meshplan.tracing  # noqa: F401 - LossError

    out, todo = [], [meshplan.MeshplanError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return out


def test_every_error_class_has_a_code_the_schema_lists():
    codes = set(SCHEMA["$defs"]["error"]["properties"]["error"]["properties"]["code"]["enum"])
    own = {}
    for cls in _error_classes():
        assert cls.code in codes, (cls, cls.code)
        if "code" in vars(cls):  # a class naming its own code names a new one
            assert cls.code not in own, (cls, own.get(cls.code))
            own[cls.code] = cls
    from meshplan import cli_json

    others = {name for _, name in cli_json.OS_ERROR_CODES} | {cli_json.BAD_USAGE,
                                                              cli_json.INTERRUPTED}
    assert codes == set(own) | others  # and the schema lists no code nothing raises
    assert inspect.getdoc(meshplan.NotExpressibleError)
