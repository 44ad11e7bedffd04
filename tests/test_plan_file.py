"""The plan file: round trip, determinism, validation on load, atomic writes, mesh presets."""

import json
import os

import pytest

import meshplan
from meshplan.errors import MeshError, PlanFileError, PlanningError
from meshplan.plan import Plan, plan_schema, validate_schema
from meshplan.specs import DEMO_MODEL, example_inputs, parse_model_spec


@pytest.fixture(scope="module")
def traced():
    spec = parse_model_spec(DEMO_MODEL)
    model = spec.build()
    graph = meshplan.trace(model, example_inputs(model, 8, 32), model_name=spec.name)
    return model, graph


@pytest.fixture(scope="module")
def plan(traced):
    model, graph = traced
    return meshplan.autoparallel(model, meshplan.Mesh.local(4), graph=graph)


def test_round_trip_is_byte_identical(plan, tmp_path):
    a = tmp_path / "a.json"
    plan.to_json(a)
    again = Plan.from_json(a)
    b = tmp_path / "b.json"
    again.to_json(b)
    assert a.read_bytes() == b.read_bytes()
    assert again == plan  # dataclass equality ignores the in-memory graph


def test_same_inputs_give_the_same_bytes(traced):
    model, graph = traced
    texts = {meshplan.autoparallel(model, meshplan.Mesh.local(4), graph=graph).to_json_text()
             for _ in range(2)}
    assert len(texts) == 1


def test_plan_lists_every_parameter_and_operator(plan, traced):
    _, graph = traced
    assert set().union(*(st.params for st in plan.stages)) == {p.name for p in graph.params}
    assert [name for st in plan.stages for name in st.ops] == [n.name for n in graph.nodes]
    assert plan.model.param_count == graph.param_count
    assert plan.model.train_flops_per_step == 3 * graph.forward_flops
    assert validate_schema(plan.to_dict(), plan_schema()) == []


def test_truncated_file_is_refused(plan, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(plan.to_json_text()[:500])
    with pytest.raises(PlanFileError, match="truncated or corrupt"):
        Plan.from_json(path)


def test_other_schema_version_is_refused(plan, tmp_path):
    data = plan.to_dict()
    data["schema"] = "meshplan.plan/v0"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=r"schema 'meshplan.plan/v0'.*reads 'meshplan.plan/v1'"):
        Plan.from_json(path)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["stages"][0]["params"].update({"transformer.wte.weight": ["Q"]}), "does not match"),
    (lambda d: d["stages"][0]["params"].update({"transformer.wte.weight": ["R"] * 5}), "5 placements"),
    (lambda d: d["model"].pop("fingerprint"), "missing required field 'fingerprint'"),
    (lambda d: d["stages"][0]["devices"].__setitem__(-1, 99), "device ids must lie in"),
    (lambda d: d["training"].update(global_batch="8"), "should be integer"),
    # draft 2020-12 counts 8.0 as an integer; meshplan's plan files never did (a float mesh
    # shape or microbatch count would reach the runtime as a float)
    (lambda d: d["training"].update(global_batch=8.0), r"\$\.training\.global_batch should be integer, got 8\.0$"),
    (lambda d: d["training"].update(microbatches=2.0), r"\$\.training\.microbatches should be integer, got 2\.0$"),
    (lambda d: d["mesh"]["shape"].__setitem__(0, 8.0), r"\$\.mesh\.shape\[0\] should be integer, got 8\.0$"),
])
def test_invalid_content_is_refused_with_the_reason(plan, tmp_path, mutate, message):
    data = json.loads(plan.to_json_text())
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=message):
        Plan.from_json(path)


def test_plan_for_another_model_is_refused(plan):
    other = parse_model_spec("transformers:gpt2?n_layer=1&n_embd=64&n_head=4&vocab_size=256")
    graph = meshplan.trace(other.build(), example_inputs(None, 8, 32))
    with pytest.raises(PlanFileError, match="fingerprint .* make a new plan"):
        plan.check_model(graph.fingerprint)


def test_missing_file_and_atomic_write(plan, tmp_path):
    with pytest.raises(PlanFileError, match="does not exist"):
        Plan.from_json(tmp_path / "nope.json")
    path = tmp_path / "p.json"
    path.write_text("old")
    plan.to_json(path)
    assert path.read_text() == plan.to_json_text()
    assert os.listdir(tmp_path) == ["p.json"]  # no temporary file left behind
    with pytest.raises(PlanFileError, match="does not exist"):
        plan.to_json(tmp_path / "missing-dir" / "p.json")


def test_mesh_presets_and_errors(tmp_path):
    m = meshplan.Mesh.preset("dgx-a100-80gb", nodes=8)
    assert m.shape == (8, 8) and m.num_devices == 64 and m.devices_per_node == 8
    assert m.axis_crosses_nodes(0) and not m.axis_crosses_nodes(1)
    assert m.hardware.device.peak_tflops["bfloat16"] == 312.0
    assert meshplan.Mesh.preset("dgx-h100").shape == (8,)
    with pytest.raises(MeshError, match="valid presets: dgx-a100-80gb, dgx-h100, dgx-h200"):
        meshplan.Mesh.preset("dgx-b300")  # no such preset (dgx-b200 is one)
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"shape": [2, 8], "hardware": "dgx-h100"}))
    assert meshplan.Mesh.from_json(cluster).num_devices == 16
    cluster.write_text("{")
    with pytest.raises(MeshError, match="not valid JSON"):
        meshplan.Mesh.from_json(cluster)


def test_batch_not_divisible_names_working_degrees(traced):
    model, graph = traced
    with pytest.raises(PlanningError, match=r"global batch 8 is not divisible .* 3; degrees that "
                                            r"divide it: \[1, 2, 4, 8\]"):
        meshplan.manual_plan(model, meshplan.Mesh.local(3), graph=graph, dp=3)


def test_impossible_memory_limit_names_a_finite_smallest_memory(traced):
    model, graph = traced
    with pytest.raises(meshplan.MemoryLimitError) as err:
        meshplan.autoparallel(model, meshplan.Mesh.local(2), graph=graph, memory_limit_gib=1e-6)
    need = err.value.min_memory_gib
    assert 1e-6 < need < 1.0 and f"{need:.2f}" in str(err.value) and "GiB per device" in str(err.value)


def test_each_problem_is_reported_once(plan):
    data = json.loads(plan.to_json_text())
    del data["training"]["dtype"], data["training"]["schedule"]
    data["training"].update(zz=1, yy=2)
    problems = validate_schema(data, plan_schema())
    assert sorted(problems) == sorted([
        "$.training is missing required field 'dtype'",
        "$.training is missing required field 'schedule'",
        "$.training has unknown field 'zz'", "$.training has unknown field 'yy'"])


def test_problems_come_in_index_order():
    """The first problem is the one a plan file's error names: item 2 before item 10."""
    value = [0, 0, "a"] + [0] * 7 + ["b"]
    assert validate_schema(value, {"type": "array", "items": {"type": "integer"}}) == [
        '$[2] should be integer, got "a"', '$[10] should be integer, got "b"']
