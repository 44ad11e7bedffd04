"""Issue 41: ``--model path/to/config.json`` (or a checkpoint folder holding one). A Hugging
Face config file builds the model on meta (no weights read) and works wherever a model spec
does: ``plan``, ``show``, ``estimate``, ``run``, ``meshplan.model_from_config``; the plan
records the file's sha256 and ``run`` refuses a file that changed since."""

from __future__ import annotations

import json

import pytest

import meshplan
from meshplan.cli import main
from meshplan.errors import SpecError
from meshplan.specs import config_sha256, parse_model_spec

# Small configs in the published files' own keys (written as a checkpoint's config.json is).
SMALL = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
              "max_position_embeddings": 64, "rope_theta": 1000000.0,
              "tie_word_embeddings": True},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                "max_position_embeddings": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "rope_theta": 1000000.0},
}

# Published config.json values (the Hugging Face checkpoints meta-llama/Llama-3.1-8B,
# Qwen/Qwen3-8B, mistralai/Mixtral-8x7B-v0.1), typed here as dicts, with the parameter counts
# their model cards state: 8.03B (Llama 3.1 8B), 6.95B non-embedding (Qwen3-8B card),
# 46.7B (Mixtral 8x7B, Mistral AI's announcement "Mixtral of experts", 2023).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}


def _write(folder, config, name="config.json"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps(config, indent=2))
    return path


def _params(model, *, embeddings=True) -> int:
    return sum(p.numel() for n, p in model.named_parameters()
               if embeddings or ("embed_tokens" not in n and "lm_head" not in n))


@pytest.mark.parametrize("config, published, embeddings", [
    (LLAMA31_8B, 8.03e9, True), (QWEN3_8B, 6.95e9, False), (MIXTRAL_8X7B, 46.7e9, True)])
def test_published_configs_build_the_published_models_on_meta(config, published, embeddings,
                                                               tmp_path):
    path = _write(tmp_path / "ckpt", config)
    model = meshplan.model_from_config(str(path))
    assert all(p.is_meta for p in model.parameters())  # nothing allocated, no weights read
    assert round(_params(model, embeddings=embeddings) / published, 2) == 1.0
    folder = parse_model_spec(str(tmp_path / "ckpt")).build()  # the checkpoint folder
    assert type(folder) is type(model) and _params(folder) == _params(model)


def test_llama31_8b_config_plans_on_8_h100_without_a_query_string(tmp_path, capsys):
    path = _write(tmp_path / "Llama-3.1-8B", LLAMA31_8B)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(path.parent), "--mesh", "dgx-h100", "--batch", "8",
                 "--seq", "8192", "--time-limit-s", "10", "-o", str(out)]) == 0
    model = json.loads(out.read_text())["model"]
    assert model["param_count"] == 8_030_261_248  # Llama 3.1 8B, tied nothing
    assert model["spec"] == "Llama-3.1-8B/config.json"  # relative to the plan file
    assert model["spec_sha256"] == config_sha256(parse_model_spec(str(path)))


@pytest.fixture(scope="module")
def small_plans(tmp_path_factory):
    """Each small config planned on local:2 from the command line, beside its config."""
    root = tmp_path_factory.mktemp("configs")
    plans = {}
    for name, config in SMALL.items():
        path = _write(root / name, config)
        plans[name] = root / f"{name}.plan.json"
        assert main(["plan", "--model", str(path), "--mesh", "local:2", "--batch", "4",
                     "--seq", "16", "--time-limit-s", "10", "-o", str(plans[name])]) == 0
    return root, plans


@pytest.mark.parametrize("name", list(SMALL))
def test_small_configs_plan_show_estimate_and_pass_runs_checks(name, small_plans, monkeypatch,
                                                                capsys):
    root, plans = small_plans
    recorded = json.loads(plans[name].read_text())["model"]
    assert recorded["spec"] == f"{name}/config.json"
    assert len(recorded["spec_sha256"]) == 64
    monkeypatch.chdir(root / name)  # the plan finds its config from any folder
    capsys.readouterr()
    assert main(["show", str(plans[name]), "--model", "config.json"]) == 0
    assert main(["estimate", str(plans[name])]) == 0
    assert "step time" in capsys.readouterr().out
    assert main(["run", str(plans[name]), "--steps", "1", "--print-torchrun"]) == 0
    assert str(root / name / "config.json") in capsys.readouterr().out


def test_run_refuses_a_config_that_changed_since_the_plan(small_plans, tmp_path, capsys):
    root, plans = small_plans
    config = root / "llama" / "config.json"
    original = config.read_text()
    try:  # rope_theta traces to the same graph: only the file's hash tells
        config.write_text(original.replace("500000.0", "10000.0"))
        capsys.readouterr()
        assert main(["run", str(plans["llama"]), "--steps", "1", "--print-torchrun"]) == 2
        err = capsys.readouterr().err
        assert "config.json has changed since the plan was made" in err, err
        assert len(err.strip().splitlines()) == 1
    finally:
        config.write_text(original)


def test_config_heads_follow_architectures(tmp_path):
    t5 = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 32,
          "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 64,
          "decoder_start_token_id": 0, "pad_token_id": 0}
    bert = {"architectures": ["BertForSequenceClassification"], "model_type": "bert",
            "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "vocab_size": 64, "num_labels": 3}
    seq2seq = parse_model_spec(str(_write(tmp_path / "t5", t5))).load(4, 8)
    assert seq2seq.call.head == "seq2seq" and set(seq2seq.call.inputs) == \
        {"input_ids", "decoder_input_ids"}
    classifier = parse_model_spec(str(_write(tmp_path / "bert", bert))).load(4, 8)
    assert type(classifier.model).__name__ == "BertForSequenceClassification"
    assert classifier.call.head == "sequence-classification"
    assert classifier.call.targets[0].shape == (4,)
    graph = classifier.trace()  # logits (batch x 3) against the class ids
    assert [tuple(m.shape) for _, m in graph.inputs] == [(4, 8), (4,)]


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON (Expecting property name enclosed in double quotes at "
     "line 1, column 2)"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"hidden_size": 8}', "has no model_type"),
    ('{"model_type": "my_own_arch"}', "model_type 'my_own_arch' is not one transformers"),
    ('{"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}',
     "add \"pad_token_id\""),
])
def test_bad_config_files_are_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(path), "--mesh", "local:2", "--batch", "4", "--seq",
                 "8", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_missing_config_file_and_folder_without_one(tmp_path):
    with pytest.raises(SpecError, match="model config file .*nope.json does not exist"):
        parse_model_spec(str(tmp_path / "nope.json"))
    with pytest.raises(SpecError, match="holds no config.json"):
        parse_model_spec(str(tmp_path))
