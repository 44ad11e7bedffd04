"""Models that are not causal LMs on token ids, from the command line: a ``file.py:factory``
returning ``meshplan.ModelBundle`` plans and runs (``meshplan plan`` + ``meshplan run``) with
the losses of one process on the same synthetic data; transformers specs are called as
their heads are trained; bad factories and --data with a float-input model are one line."""

import json
import os
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.specs import parse_model_spec

FACTORIES = Path(__file__).resolve().parents[1] / "examples" / "factories.py"

BAD_FACTORIES = '''
import torch, torch.nn as nn
import meshplan

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
    def forward(self, x):
        return self.lin(x)

def bare():
    return Tiny()

def a_dict():
    return {"model": Tiny()}

def scalar_input():
    return meshplan.ModelBundle(Tiny(), (torch.randn(8, 4), torch.tensor(3.0)))

def ragged_batch():
    return meshplan.ModelBundle(Tiny(), torch.randn(8, 4), torch.zeros(6, dtype=torch.long))

def wrong_keyword():
    return meshplan.ModelBundle(Tiny(), {"features": torch.randn(8, 4)},
                                torch.zeros(8, dtype=torch.long))
'''


def _reference_losses(spec_text: str, batch: int, steps: int, seed: int = 0,
                      lr: float = 1e-3, seq: int | None = None,
                      norms: list[float] | None = None) -> list[float]:
    """The steps of ``meshplan run`` in one process: the same seeded weights and synthetic
    batches (specs.LoadedModel.synthetic), Adam (the plan's optimizer) on the whole batch."""
    torch.manual_seed(seed)
    loaded = parse_model_spec(spec_text).load(batch, seq, device="cpu")
    model, loss_fn = loaded.model, loaded.call.loss_fn
    opt = torch.optim.Adam(model.parameters(), lr=lr, foreach=False)
    losses = []
    for step in range(steps):
        call = loaded.synthetic(seed=seed, step=step)
        out = model(**call.inputs) if isinstance(call.inputs, dict) else model(*call.inputs)
        if loss_fn is None:  # a transformers spec: the default loss on the logits
            from meshplan.tracing import target_loss
            loss = target_loss(out.logits, *call.targets)
        else:
            loss = loss_fn(out, *call.targets)
        loss.backward()
        if norms is not None:  # the global norm `meshplan run --clip` records (never binds)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("factory, extra, engine", [
    # BatchNorm statistics over the global batch, positional images + label targets
    ("convnet", ["--engine", "graph"], "graph"),
    # keyword inputs (float features + decoder ids) + label targets
    ("encoder_decoder", ["--manual", "dp=2"], "modules"),
])
def test_factory_plans_and_runs_with_the_losses_of_one_process(factory, extra, engine, tmp_path,
                                                               capsys):
    spec = f"{FACTORIES}:{factory}"
    plan = tmp_path / "plan.json"
    args = ["plan", "--model", spec, "--mesh", "local:2", "--batch", "8", "-o", str(plan)]
    assert main(args + extra) == 0
    recorded = json.loads(plan.read_text())
    assert recorded["engine"] == engine, recorded["engine_note"]
    # stored relative to the plan file, read back as the factory's absolute path
    assert recorded["model"]["spec"] == os.path.relpath(FACTORIES, tmp_path) + f":{factory}"
    assert Plan.from_json(plan).model.spec == spec
    assert any(r["role"] == "target" for r in recorded["model"]["inputs"])
    metrics = tmp_path / "metrics.json"
    assert main(["run", str(plan), "--steps", "2", "--metrics-out", str(metrics),
                 "--clip", "1e9"]) == 0, capsys.readouterr().err[-3000:]
    got = json.loads(metrics.read_text())
    ref_norms: list[float] = []
    ref = _reference_losses(spec, 8, 2, norms=ref_norms)
    assert got["losses"] == pytest.approx(ref, rel=1e-4, abs=1e-5), (got["losses"], ref)
    # Adam hides a gradient's scale from the losses; its norm does not
    assert got["grad_norm"] == pytest.approx(ref_norms, rel=1e-4, abs=1e-6), \
        (got["grad_norm"], ref_norms)


@pytest.mark.slow
def test_cli_masked_lm_loss_is_the_global_labelled_mean(tmp_path, capsys):
    """BERT's masked LM on the graph engine at dp=2 with 4 microbatches per rank: each piece
    holds its own count of masked tokens (-100 elsewhere); ``meshplan run``'s losses are one
    process's on the whole batch (before: the mean of the pieces' means, off by ~1e-2)."""
    spec = ("transformers:bert?hidden_size=32&num_hidden_layers=2&num_attention_heads=2&"
            "intermediate_size=64&vocab_size=128")
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", spec, "--mesh", "local:2", "--batch", "8", "--seq", "16",
                 "--manual", "dp=2", "--engine", "graph", "-o", str(plan)]) == 0
    assert json.loads(plan.read_text())["training"]["microbatches"] == 4
    metrics = tmp_path / "metrics.json"
    assert main(["run", str(plan), "--steps", "2", "--metrics-out", str(metrics)]) == 0, \
        capsys.readouterr().err[-3000:]
    losses = json.loads(metrics.read_text())["losses"]
    ref = _reference_losses(spec, 8, 2, seq=16)
    assert losses == pytest.approx(ref, rel=1e-5, abs=1e-5), (losses, ref)


def test_factory_with_a_batch_keyword_is_called_at_the_global_batch():
    loaded = parse_model_spec(f"{FACTORIES}:convnet").load(12, None)
    assert [tuple(x.shape) for x in loaded.call.inputs] == [(12, 3, 16, 16)]
    assert tuple(loaded.call.targets[0].shape) == (12,)


def test_examples_without_a_batch_keyword_are_repeated_to_the_batch():
    loaded = parse_model_spec(f"{FACTORIES}:encoder_decoder").load(10, None, device="cpu")
    feats = loaded.call.inputs["features"]
    assert feats.shape == (10, 12, 20) and torch.equal(feats[4:8], feats[:4])
    a = loaded.synthetic(seed=3, step=1)
    b = loaded.synthetic(seed=3, step=1)
    c = loaded.synthetic(seed=3, step=2)
    ids = a.inputs["decoder_ids"]
    assert torch.equal(ids, b.inputs["decoder_ids"]) and not torch.equal(ids, c.inputs["decoder_ids"])
    assert ids.dtype == torch.long and int(ids.min()) >= 0 and int(ids.max()) <= 63
    assert a.inputs["features"].dtype == torch.float32 and a.targets[0].shape == (10, 8)


def test_transformers_specs_are_called_as_their_heads_are_trained():
    bert = parse_model_spec("transformers:bert?hidden_size=32&num_hidden_layers=2&"
                            "num_attention_heads=2&intermediate_size=64&vocab_size=128").load(4, 16)
    assert type(bert.model).__name__ == "BertForMaskedLM" and len(bert.call.targets) == 1
    masked = bert.synthetic(seed=0, step=0)
    labels = masked.targets[0]
    assert (labels == -100).any() and (labels != -100).any()  # loss only where masked
    for name in ("t5", "bart"):
        small = ("d_model=32&d_kv=8&d_ff=64&num_layers=2&num_heads=4" if name == "t5" else
                 "d_model=32&encoder_layers=2&decoder_layers=2&encoder_attention_heads=4&"
                 "decoder_attention_heads=4&encoder_ffn_dim=64&decoder_ffn_dim=64")
        loaded = parse_model_spec(f"transformers:{name}?{small}&vocab_size=128").load(4, 16)
        assert type(loaded.model).__name__.endswith("ForConditionalGeneration")
        assert set(loaded.call.inputs) == {"input_ids", "decoder_input_ids"}
        assert len(loaded.call.targets) == 1


def test_cli_plans_bert_with_masked_lm_targets(tmp_path):
    out = tmp_path / "bert.json"
    spec = ("transformers:bert?hidden_size=32&num_hidden_layers=2&num_attention_heads=2&"
            "intermediate_size=64&vocab_size=128")
    assert main(["plan", "--model", spec, "--mesh", "local:2", "--batch", "4", "--seq", "16",
                 "-o", str(out)]) == 0
    roles = [r["role"] for r in json.loads(out.read_text())["model"]["inputs"]]
    assert roles == ["arg", "target"]


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("factories") / "bad.py"
    path.write_text(BAD_FACTORIES)
    return str(path)


@pytest.mark.parametrize("factory, extra, message", [
    ("a_dict", [], "bad.py:a_dict returned dict; a factory returns an nn.Module (a causal LM on "
                   "token ids) or meshplan.ModelBundle"),
    ("scalar_input", [], "example_inputs[1] has shape [], but meshplan reads the batch from "
                         "the first dim of every example input and target"),
    ("ragged_batch", [], "example_targets[0] has shape [6]"),
    ("bare", ["--seq", "8"], "returned a Tiny without a token embedding, and meshplan calls a "
                             "bare nn.Module from a factory as a causal LM on token ids"),
    ("bare", [], "--seq is required for"),
    ("scalar_input", ["--seq", "8"], "--seq 8:"),
    ("wrong_keyword", [], "Tiny.forward does not take the example inputs"),
])
def test_bad_factories_are_one_line_and_exit_2(bad_file, factory, extra, message, capsys):
    args = ["plan", "--model", f"{bad_file}:{factory}", "--mesh", "local:2", "--batch", "8"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_data_with_a_float_input_bundle_is_one_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", f"{FACTORIES}:convnet", "--mesh", "local:2", "--batch", "8",
                 "--manual", "dp=2", "-o", str(plan)]) == 0
    tokens = tmp_path / "train.bin"
    tokens.write_bytes(bytes(4096))
    capsys.readouterr()
    assert main(["run", str(plan), "--data", str(tokens), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "--data feeds token ids to causal LMs" in err and "ModelBundle" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_module_factory_spec(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(FACTORIES.read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_model_spec("mymodels:convnet")
    assert spec.kind == "module" and type(spec.build()).__name__ == "ConvNet"
    with pytest.raises(meshplan.SpecError, match="no module named 'nosuchmodule'"):
        parse_model_spec("nosuchmodule:make")


def test_manual_plan_refuses_1f1b_with_fewer_microbatches_than_stages():
    model = parse_model_spec("transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&"
                             "n_positions=64").build("meta")
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with pytest.raises(meshplan.PlanningError, match="schedule '1f1b' needs at least as many "
                       "microbatches as pipeline rank groups: 1 < pp=2"):
        meshplan.manual_plan(model, meshplan.Mesh.local(2), (ids,), pp=2, microbatch_size=2)
    plan = meshplan.manual_plan(model, meshplan.Mesh.local(2), (ids,), pp=2, microbatch_size=2,
                                schedule="gpipe")
    assert meshplan.Plan.from_json_text(plan.to_json_text()).num_stages == 2
