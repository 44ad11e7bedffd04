"""Model and mesh specs as users write them on the command line.

Model specs:
- ``transformers:gpt2?n_layer=2&n_embd=64`` — a transformers architecture built from its
  config with random weights (nothing is downloaded); any ``model_type`` transformers knows;
- ``gpt3-175b``, ``llama2-7b``, ... — named configs of published models (MODEL_PRESETS);
- ``path/to/file.py:factory`` — a function returning an ``nn.Module`` (optionally taking
  no arguments); the module needs ``vocab_size`` (attribute or ``config.vocab_size``).
Mesh specs: ``dgx-a100-80gb:nodes=8``, ``local:4``, ``cluster.json``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from urllib.parse import parse_qsl

import torch
import torch.nn as nn

from meshplan.errors import SpecError
from meshplan.mesh import GPU_PRESETS, Mesh

# Published configurations. Sources: GPT-3 — Brown et al. 2020, Table 2.1; Llama 2 — Touvron
# et al. 2023, Table 1 / the released configs; BERT-large — Devlin et al. 2019; the Megatron
# rows — Narayanan et al. 2021, Table 1 (vocab 51,200, seq 2048).
MODEL_PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2-small": ("gpt2", dict(n_layer=12, n_embd=768, n_head=12)),
    "gpt3-1.3b": ("gpt2", dict(n_layer=24, n_embd=2048, n_head=16, vocab_size=51200, n_positions=2048)),
    "gpt3-2.7b": ("gpt2", dict(n_layer=32, n_embd=2560, n_head=32, vocab_size=51200, n_positions=2048)),
    "gpt3-6.7b": ("gpt2", dict(n_layer=32, n_embd=4096, n_head=32, vocab_size=51200, n_positions=2048)),
    "gpt3-13b": ("gpt2", dict(n_layer=40, n_embd=5120, n_head=40, vocab_size=51200, n_positions=2048)),
    "gpt3-175b": ("gpt2", dict(n_layer=96, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048)),
    "megatron-1.7b": ("gpt2", dict(n_layer=24, n_embd=2304, n_head=24, vocab_size=51200, n_positions=2048)),
    "megatron-18.4b": ("gpt2", dict(n_layer=40, n_embd=6144, n_head=48, vocab_size=51200, n_positions=2048)),
    "megatron-145.6b": ("gpt2", dict(n_layer=80, n_embd=12288, n_head=96, vocab_size=51200, n_positions=2048)),
    "megatron-529.6b": ("gpt2", dict(n_layer=105, n_embd=20480, n_head=128, vocab_size=51200, n_positions=2048)),
    "megatron-1t": ("gpt2", dict(n_layer=128, n_embd=25600, n_head=160, vocab_size=51200, n_positions=2048)),
    "llama2-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                max_position_embeddings=4096)),
    "llama2-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                 num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                                 max_position_embeddings=4096)),
    "llama2-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                 num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                                 max_position_embeddings=4096)),
    "bert-large": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, vocab_size=30522)),
}

# The demo's model: a scaled-down GPT-2 (2 blocks, width 64) that trains in seconds on a CPU.
DEMO_MODEL = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"

_NO_DROPOUT = {  # synthetic runs compare losses across plans: dropout would make them differ
    "gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "llama": dict(attention_dropout=0.0),
    "opt": dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0),
    "gpt_neox": dict(hidden_dropout=0.0, attention_dropout=0.0),
}


@dataclass(frozen=True)
class ModelSpec:
    text: str
    kind: str  # "transformers" | "file"
    target: str  # model_type or "path.py:factory"
    overrides: tuple[tuple[str, object], ...] = ()

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        """Build the model on ``device`` (meta: no weights allocated)."""
        if self.kind == "transformers":
            return _build_transformers(self.target, dict(self.overrides), device)
        return _build_from_file(self.target, device)

    @property
    def name(self) -> str:
        return self.text


def parse_model_spec(text: str) -> ModelSpec:
    if text in MODEL_PRESETS:
        model_type, cfg = MODEL_PRESETS[text]
        return ModelSpec(text, "transformers", model_type, tuple(sorted(cfg.items())))
    if text.startswith("transformers:"):
        body = text.removeprefix("transformers:")
        name, _, query = body.partition("?")
        if not name:
            raise SpecError(f"model spec {text!r} names no architecture; e.g. transformers:gpt2")
        overrides = tuple((k, _parse_value(v)) for k, v in parse_qsl(query, keep_blank_values=True))
        return ModelSpec(text, "transformers", name, overrides)
    path, sep, factory = text.rpartition(":")
    if sep and path.endswith(".py"):
        if not os.path.exists(path):
            raise SpecError(f"model file {path} does not exist")
        return ModelSpec(text, "file", text)
    raise SpecError(f"cannot read model spec {text!r}; use transformers:NAME?key=value&..., "
                    f"path/file.py:factory, or a preset: {', '.join(MODEL_PRESETS)}")


def _parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def _build_transformers(model_type: str, overrides: dict, device) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise SpecError("transformers model specs need the transformers package: "
                        "pip install transformers") from None
    overrides = {**_NO_DROPOUT.get(model_type, {}), **overrides}
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError as exc:
        raise SpecError(f"transformers does not know model type {model_type!r}: {exc}") from None
    config.use_cache = False
    model_cls = _auto_class(transformers, config)
    with torch.device(device):
        return model_cls.from_config(config)


def _auto_class(transformers, config):
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM,
                 transformers.AutoModelForSeq2SeqLM):
        if type(config) in auto._model_mapping:
            return auto
    raise SpecError(f"model type {config.model_type!r} has no causal-LM, masked-LM or seq2seq "
                    "head in transformers; use a path/file.py:factory spec")


def _build_from_file(text: str, device) -> nn.Module:
    path, _, factory = text.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"meshplan_user_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        raise SpecError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise SpecError(f"{path} has no callable {factory!r}")
    with torch.device(device):
        model = fn()
    if not isinstance(model, nn.Module):
        raise SpecError(f"{text} returned {type(model).__name__}, not an nn.Module")
    return model


def vocab_size(model: nn.Module) -> int:
    v = getattr(model, "vocab_size", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not v:
        raise SpecError(f"{type(model).__name__} has no vocab_size (attribute or config.vocab_size);"
                        " meshplan's synthetic data needs it")
    return int(v)


def example_inputs(model: nn.Module, batch: int, seq: int, device="meta") -> tuple[torch.Tensor]:
    """Token ids of one global batch, as example inputs for tracing (values do not matter)."""
    return (torch.zeros(batch, seq, dtype=torch.long, device=device),)


def synthetic_batch(model: nn.Module, batch: int, seq: int, *, seed: int, step: int) -> torch.Tensor:
    """The global batch of step ``step``: the same for every plan and every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab_size(model), (batch, seq), generator=g)


def parse_mesh_spec(text: str) -> Mesh:
    if text.startswith("local:"):
        n = text.removeprefix("local:")
        if not n.isdigit():
            raise SpecError(f"mesh spec {text!r}: use local:N with N processes, e.g. local:4")
        return Mesh.local(int(n))
    name, _, opts = text.partition(":")
    if name in GPU_PRESETS or name == "cpu-local":
        nodes = 1
        for key, value in parse_qsl(opts.replace(",", "&")):
            if key != "nodes" or not value.isdigit():
                raise SpecError(f"mesh spec {text!r}: the only option is nodes=N")
            nodes = int(value)
        return Mesh.preset(name, nodes=nodes)
    if text.endswith(".json"):
        return Mesh.from_json(text)
    raise SpecError(f"unknown mesh {text!r}; use one of {', '.join(GPU_PRESETS)} (with :nodes=N), "
                    "local:N, or a cluster .json file")
