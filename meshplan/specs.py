"""Model and mesh specs as users write them on the command line.

Model specs:
- ``transformers:gpt2?n_layer=2&n_embd=64`` — a transformers architecture built from its
  config with random weights (nothing is downloaded); any ``model_type`` transformers knows,
  with the head its users train (``HEADS``): conditional generation for encoder-decoders
  (T5, BART), a masked-LM head for BERT-like encoders, a causal LM for decoders, an image
  classifier for vision models; ``head=causal-lm`` (etc.) in the query picks another;
  dropout is off unless a ``*dropout*`` / ``*pdrop`` key is given (losses compare across plans);
- ``gpt3-175b``, ``llama2-7b``, ... — named configs of published models (MODEL_PRESETS);
- ``path/to/config.json`` or a checkpoint folder holding one — a Hugging Face config file,
  built on meta with its ``model_type``'s config class and the head its ``architectures``
  name (``CONFIG_HEADS``); only the config is read, never weights or code; the plan records
  the file's sha256 (``config_sha256``) and ``meshplan run`` refuses a file that changed;
- ``path/to/file.py:factory`` or ``package.module:factory`` — a function (called without
  arguments, or with ``batch=`` when it has that keyword) returning either an ``nn.Module``
  (a causal LM on token ids, batch x seq; its synthetic data needs ``vocab_size``, attribute
  or ``config.vocab_size``) or a ``ModelBundle`` (the model with its example inputs, targets
  and loss: images, float features, several tensors; docs/models.md).
Mesh specs: ``dgx-a100-80gb:nodes=8``, ``local:4``, ``cluster.json``.

What each head is called with and trained on (``training_call``): a ``TrainingCall`` of
``inputs`` (a tuple of positional arguments or a dict of keyword arguments), ``targets`` and
``loss_fn`` (None: meshplan's default, cross entropy of the logits against the targets, or
the next-token loss when there are no targets), for ``trace``/``autoparallel``/``manual_plan``
(``example_inputs=call.inputs, example_targets=call.targets, loss_fn=call.loss_fn``) and
``ParallelRun.train_step(call.inputs, targets=call.targets)``:

============================  =====================================  ==========================
head                          inputs                                 targets
============================  =====================================  ==========================
causal-lm                     (ids,) batch x seq                     () next-token loss on ids
masked-lm                     (ids with 15% set to the mask id,)     (ids there, -100 elsewhere,)
seq2seq                       {input_ids, decoder_input_ids}         (labels,): decoder ids
                                                                      shifted left one token
image-classification          (pixels,) batch x C x H x W float      (class ids,) batch
sequence-classification       (ids,) batch x seq                     (class ids,) batch
============================  =====================================  ==========================
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

import torch
import torch.nn as nn

from meshplan.axes import AXES
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
    # Llama 3.1 (Llama Team 2024, arXiv 2407.21783, Table 3; rope theta 500,000; 128K context)
    "llama3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=131072, rope_theta=500000.0,
                                  rms_norm_eps=1e-5)),
    "llama3.1-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8,
                                   vocab_size=128256, max_position_embeddings=131072,
                                   rope_theta=500000.0, rms_norm_eps=1e-5)),
    "llama3.1-405b": ("llama", dict(hidden_size=16384, intermediate_size=53248,
                                    num_hidden_layers=126, num_attention_heads=128,
                                    num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=131072, rope_theta=500000.0,
                                    rms_norm_eps=1e-5)),
    "bert-large": ("bert", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, vocab_size=30522)),
    # Mixtures of experts: each model's config.json on the Hugging Face Hub (the values its
    # authors published with the weights). Total / active parameters the authors state:
    # Mixtral 46.7B / 12.9B (Jiang et al. 2024, arXiv 2401.04088), Qwen3 30.5B / 3.3B and
    # 235B / 22B (Qwen3 technical report, arXiv 2505.09388, Table 2 and the model cards),
    # DeepSeek-V3 671B / 37B (arXiv 2412.19437, section 1; the multi-token-prediction module
    # of the released checkpoint is not part of the 671B, nor built by transformers), gpt-oss
    # 117B / 5.1B (OpenAI's gpt-oss model card, Table 1). Rope scaling (YaRN) is left out
    # where a config has it: it changes no shape, parameter or FLOP.
    "mixtral-8x7b": ("mixtral", dict(  # mistralai/Mixtral-8x7B-v0.1
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-5)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(  # Qwen/Qwen3-30B-A3B
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen3-235b-a22b": ("qwen3_moe", dict(  # Qwen/Qwen3-235B-A22B
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6)),
    "deepseek-v3": ("deepseek_v3", dict(  # deepseek-ai/DeepSeek-V3
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
        norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, max_position_embeddings=163840,
        rope_theta=10000, rms_norm_eps=1e-6)),
    "gpt-oss-120b": ("gpt_oss", dict(  # openai/gpt-oss-120b
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4,
        sliding_window=128, vocab_size=201088, max_position_embeddings=131072,
        rms_norm_eps=1e-5, swiglu_limit=7.0)),
}

# The demo's model: a scaled-down GPT-2 (2 blocks, width 64) that trains in seconds on a CPU.
DEMO_MODEL = "transformers:gpt2?n_layer=2&n_embd=64&n_head=4&vocab_size=256&n_positions=64"

HEADS = ("causal-lm", "masked-lm", "seq2seq", "image-classification",
         "sequence-classification")

# A Hugging Face checkpoint keeps its configuration in this file (transformers' CONFIG_NAME).
CONFIG_FILE = "config.json"

# The head a config's ``architectures`` entry names, by its class-name suffix (transformers'
# naming: LlamaForCausalLM, T5ForConditionalGeneration, BertForSequenceClassification, ...).
CONFIG_HEADS = (("ForCausalLM", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                ("ForConditionalGeneration", "seq2seq"), ("ForSeq2SeqLM", "seq2seq"),
                ("ForImageClassification", "image-classification"),
                ("ForSequenceClassification", "sequence-classification"))


@dataclass(frozen=True)
class ModelSpec:
    text: str
    kind: str  # "transformers" | "config" | "file" | "module"
    target: str  # model_type, the config.json, "path.py:factory" or "package.module:factory"
    overrides: tuple[tuple[str, object], ...] = ()

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        """Build the model on ``device`` (meta: no weights allocated)."""
        if self.kind == "transformers":
            return _build_transformers(self.target, dict(self.overrides), device)
        if self.kind == "config":
            return model_from_config(self.target, device)
        made = _call_factory(self, device, batch=None)
        return made.model if isinstance(made, ModelBundle) else made

    def load_for_plan(self, plan, device: str | torch.device = "meta") -> "LoadedModel":
        """``load`` at a plan's global batch (and sequence length, for token models)."""
        return self.load(plan.training.global_batch, plan.training.seq_len, device,
                         bundle_seq=False)

    def load(self, batch: int, seq: int | None, device: str | torch.device = "meta", *,
             bundle_seq: bool = True) -> "LoadedModel":
        """The model and its example call at global batch ``batch`` on ``device``: a
        transformers head's call (``training_call``), token ids for a bare module, or a
        ``ModelBundle``'s examples resized to ``batch`` (``seq`` must then be None, the
        examples fix every other dim; ``bundle_seq=False`` ignores it instead)."""
        if self.kind in ("transformers", "config"):
            model, seq = self.build(device), _need_seq(self, seq)
            return LoadedModel(model, training_call(model, batch, seq, device=device),
                               spec_text=self.text, batch=batch, seq=seq, kind=self.kind)
        made = _call_factory(self, device, batch=batch)
        if isinstance(made, ModelBundle):
            if seq is not None and bundle_seq:
                raise SpecError(f"--seq {seq}: {self.text} returns a ModelBundle, whose example "
                                "inputs fix every dim but the batch; drop --seq")
            return _loaded_bundle(self, made, batch)
        seq = _need_seq(self, seq)
        return LoadedModel(made, training_call(made, batch, seq, device=device),
                           spec_text=self.text, batch=batch, seq=seq, kind=self.kind)

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
    if text.endswith(".json") or os.path.isdir(text):
        return ModelSpec(text, "config", config_file(text))
    path, sep, factory = text.rpartition(":")
    if sep and path.endswith(".py"):
        if not os.path.exists(path):
            raise SpecError(f"model file {path} does not exist")
        return ModelSpec(text, "file", text)
    if sep and factory.isidentifier() and all(p.isidentifier() for p in path.split(".")):
        try:
            found = importlib.util.find_spec(path)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise SpecError(f"model spec {text!r}: no module named {path!r} on the Python path; "
                            "install it, or name a file: path/to/file.py:factory")
        return ModelSpec(text, "module", text)
    raise SpecError(f"cannot read model spec {text!r}; use transformers:NAME?key=value&..., "
                    "path/to/config.json (or a checkpoint folder), path/file.py:factory, or a "
                    f"preset: {', '.join(MODEL_PRESETS)}")


def config_file(path: str) -> str:
    """The Hugging Face config file a spec names: ``path`` itself, or ``path/config.json``
    for a checkpoint folder."""
    if os.path.isdir(path):
        inside = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(inside):
            raise SpecError(f"model folder {path} holds no {CONFIG_FILE}; name a Hugging Face "
                            f"checkpoint folder (it has one) or the config file itself")
        return inside
    if not os.path.isfile(path):
        raise SpecError(f"model config file {path} does not exist")
    return path


def config_sha256(spec: "ModelSpec") -> str:
    """The sha256 (hex) of the config file a ``config`` spec reads; "" for other specs. A plan
    records it, and ``meshplan run`` refuses the plan when the file has changed since."""
    if spec.kind != "config":
        return ""
    with open(spec.target, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_config(path: str):
    """The transformers config of a Hugging Face ``config.json`` (a file, or a checkpoint
    folder holding one): built by its ``model_type``'s own config class, as
    ``AutoConfig.from_pretrained`` builds it, without the Hub and without the checkpoint's own
    code (``auto_map`` is never run)."""
    transformers = _transformers()
    path = config_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                        f"{exc.colno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} holds a JSON {type(data).__name__}, not an object; a Hugging "
                        "Face config.json is one object with a model_type")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise SpecError(f"{path} has no model_type; a Hugging Face config.json names its "
                        'architecture, e.g. "model_type": "llama"')
    if model_type not in transformers.CONFIG_MAPPING:
        raise SpecError(f"{path}: model_type {model_type!r} is not one transformers "
                        f"{transformers.__version__} knows (meshplan never runs a checkpoint's "
                        "own code); write a path/file.py:factory that builds the model")
    try:
        config = transformers.CONFIG_MAPPING[model_type].from_dict(data)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation, in one line
        raise SpecError(f"{path}: transformers refused the config: {_first_line(exc)}") from None
    config.use_cache = False
    return config


def model_from_config(path: str, device: str | torch.device = "meta") -> nn.Module:
    """The model a Hugging Face ``config.json`` (or a checkpoint folder holding one)
    describes, with random weights on ``device`` (meta: nothing allocated; weights are never
    read): the head its ``architectures`` names (causal LM, seq2seq, masked LM, sequence or
    image classification), else the head its kind of model is trained with."""
    transformers = _transformers()
    config = read_config(path)
    names = [a for a in (getattr(config, "architectures", None) or []) if isinstance(a, str)]
    head = next((h for a in names for suffix, h in CONFIG_HEADS if a.endswith(suffix)
                 and (h != "seq2seq" or getattr(config, "is_encoder_decoder", False))), None)
    if head == "sequence-classification" and \
            getattr(config.get_text_config(), "pad_token_id", None) is None:
        raise SpecError(f"{config_file(path)}: a sequence classifier finds each row's last "
                        "token by pad_token_id, which the config does not set; add "
                        '"pad_token_id" to it')
    model_cls = _auto_class(transformers, config, head)
    with torch.device(device):
        return model_cls.from_config(config)


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SpecError("transformers model specs and config files need the transformers "
                        "package: pip install transformers") from None
    return transformers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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
    overrides = dict(overrides)
    head = overrides.pop("head", None)
    if head is not None and head not in HEADS:
        raise SpecError(f"head={head!r} is not one of {', '.join(HEADS)}; e.g. "
                        f"transformers:{model_type}?head=causal-lm")
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except ValueError as exc:
        raise SpecError(f"transformers does not know model type {model_type!r}: {exc}") from None
    overrides = {k: _checked_config_value(model_type, default, k, v) for k, v in overrides.items()}
    try:
        config = transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"transformers:{model_type} refused the config {overrides}: {first}") \
            from None
    for key, value in config.to_dict().items():  # synthetic runs compare losses across plans
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) \
                and key not in overrides:
            setattr(config, key, 0.0)
    config.use_cache = False
    model_cls = _auto_class(transformers, config, head)
    with torch.device(device):
        return model_cls.from_config(config)


def _checked_config_value(model_type: str, default, key: str, value):
    """``value`` for config key ``key``, checked against the default config: an unknown key
    (a typo would silently build the default model) or a value of the wrong type is a
    SpecError naming the key, the expected type and close spellings."""
    # keys transformers folds into a dict attribute (Llama's rope_theta -> rope_parameters)
    nested = {k: v for d in vars(default).values() if isinstance(d, dict)
              for k, v in d.items() if isinstance(k, str)}
    if not hasattr(default, key) and key not in nested:
        if key in _modeling_config_reads(model_type):
            return value  # read by the modeling code with a fallback: Qwen3-MoE's head_dim
        known = sorted(k for k in default.to_dict() if not k.startswith("_"))
        close = difflib.get_close_matches(key, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else \
            f"known keys include {', '.join(known[:12])}, ..."
        raise SpecError(f"transformers:{model_type} has no config key {key!r}; {hint}")
    want = getattr(default, key) if hasattr(default, key) else nested[key]
    if want is None or isinstance(want, str) and not isinstance(value, bool):
        return value
    if isinstance(want, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(want, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(want, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    else:
        return value  # lists, dicts: transformers checks them
    raise SpecError(f"transformers:{model_type} config {key}={value!r}: expected "
                    f"{type(want).__name__} (default {want!r})")


def _modeling_config_reads(model_type: str) -> frozenset[str]:
    """Config keys the model's modeling code reads as ``getattr(config, "KEY", fallback)``:
    keys a config class does not declare yet a published checkpoint sets, e.g.
    ``head_dim`` of Qwen3-MoE (128 in Qwen/Qwen3-30B-A3B's config.json, while
    hidden_size / num_attention_heads is 64), which Qwen3MoeConfig has no field for."""
    import re

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        source = inspect.getsource(importlib.import_module(
            f"transformers.models.{name}.modeling_{name}"))
    except (ImportError, OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']",
                                source))


def _auto_class(transformers, config, head: str | None = None):
    """The auto class of ``head``, or of the head this kind of model is trained with."""
    autos = {"seq2seq": transformers.AutoModelForSeq2SeqLM,
             "masked-lm": transformers.AutoModelForMaskedLM,
             "causal-lm": transformers.AutoModelForCausalLM,
             "image-classification": transformers.AutoModelForImageClassification,
             "sequence-classification": transformers.AutoModelForSequenceClassification}
    if head is None:
        order = ["masked-lm", "causal-lm", "image-classification"]
        if getattr(config, "is_encoder_decoder", False):
            order.insert(0, "seq2seq")
        head = next((h for h in order if type(config) in autos[h]._model_mapping), None)
    if head is None or type(config) not in autos[head]._model_mapping:
        has = [h for h in HEADS if type(config) in autos[h]._model_mapping]
        raise SpecError(f"model type {config.model_type!r} has no {head or 'trainable'} head in "
                        f"transformers (it has: {', '.join(has) or 'none'}); pick one with "
                        "?head=NAME or use a path/file.py:factory spec")
    return autos[head]


def _call_factory(spec: ModelSpec, device, *, batch: int | None):
    """Import the factory of a file or module spec and call it under ``device`` (with
    ``batch=`` when it takes that keyword and ``batch`` is given): an nn.Module or a
    ModelBundle, else a SpecError."""
    text = spec.text
    path, _, factory = text.rpartition(":")
    if spec.kind == "module":
        try:
            module = importlib.import_module(path)
        except Exception as exc:  # noqa: BLE001
            raise SpecError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    else:
        # the factory's folder on the import path, as `python path/file.py` would put it: a
        # factory file that imports a module beside it works without PYTHONPATH
        folder = os.path.dirname(os.path.abspath(path))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        loader = importlib.util.spec_from_file_location(f"meshplan_user_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(loader)
        try:
            loader.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001
            raise SpecError(f"importing {path} failed: {type(exc).__name__}: {exc}") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise SpecError(f"{path} has no callable {factory!r}")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    kwargs = {"batch": batch} if batch is not None and "batch" in params else {}
    with torch.device(device):
        try:
            made = fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's factory, in one line
            needs = [n for n, p in params.items()
                     if p.default is p.empty and n not in kwargs
                     and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if needs and isinstance(exc, TypeError):
                raise SpecError(f"{text}: the factory takes arguments ({', '.join(needs)}), "
                                "but meshplan calls it with none (or batch=N only); give them "
                                "defaults or wrap it in a function without arguments") from None
            raise SpecError(f"{text}: the factory raised {type(exc).__name__}: {exc}") from None
    if isinstance(made, ModelBundle):
        if not isinstance(made.model, nn.Module):
            raise SpecError(f"{text} returned a ModelBundle whose model is a "
                            f"{type(made.model).__name__}, not an nn.Module")
        return made
    if not isinstance(made, nn.Module):
        raise SpecError(f"{text} returned {type(made).__name__}; a factory returns an "
                        "nn.Module (a causal LM on token ids) or meshplan.ModelBundle(model, "
                        "example_inputs, example_targets, loss_fn)")
    return made


POSITION_KEYS = ("n_positions", "max_position_embeddings", "max_seq_len", "n_ctx")


def check_positions(model: nn.Module, seq: int, *, what: str = "--seq") -> None:
    """A sequence of ``seq`` tokens fits the model's learned positions (its config's
    n_positions, max_position_embeddings, max_seq_len or n_ctx, where it has one): a longer
    one would fail inside the position embedding at the first step."""
    config = getattr(model, "config", None)
    limit = next((getattr(config, k) for k in POSITION_KEYS
                  if isinstance(getattr(config, k, None), int)), None)
    if limit is None or seq <= limit:
        return
    if what == "--seq":
        raise SpecError(f"--seq {seq} is longer than the model's {limit} positions; use "
                        f"--seq {limit} or less, or a model with more positions")
    raise SpecError(f"{what} hold sequences of {seq} tokens, longer than the model's {limit} "
                    f"positions; use {limit} tokens or fewer, or a model with more positions")


def _need_seq(spec: ModelSpec, seq: int | None) -> int:
    if seq is None:
        raise SpecError(f"--seq is required for {spec.text}: it is called with token ids "
                        "(batch x seq); give the sequence length, e.g. --seq 512")
    return seq


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


@dataclass(frozen=True)
class TrainingCall:
    """One global batch as a model's head is trained on it (the table in the module
    docstring): ``model(*inputs)`` or ``model(**inputs)``, then
    ``loss_fn(outputs, *targets)`` (meshplan's default loss when ``loss_fn`` is None)."""

    head: str
    inputs: tuple[torch.Tensor, ...] | Mapping[str, torch.Tensor]
    targets: tuple[torch.Tensor, ...] = ()
    loss_fn: Callable | None = field(default=None, compare=False)


MASK_FRACTION = 0.15  # BERT's masking rate (Devlin et al. 2019, section 3.1)


def model_head(model: nn.Module) -> str:
    """The head a model is trained with, from its class (transformers' naming)."""
    name = type(model).__name__
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False) \
            or name.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")):
        return "seq2seq"
    if name.endswith("ForMaskedLM"):
        return "masked-lm"
    if name.endswith("ForImageClassification"):
        return "image-classification"
    if name.endswith("ForSequenceClassification"):
        return "sequence-classification"
    return "causal-lm"


def training_call(model: nn.Module, batch: int, seq: int, *, device="meta",
                  seed: int | None = None, step: int = 0) -> TrainingCall:
    """The inputs, targets and loss of one global batch for ``model``'s head: on ``device``
    with unspecified values (tracing), or drawn from ``seed`` and ``step`` (the same for every
    plan and every rank, like ``synthetic_batch``). ``seq`` is the token count; an image
    model reads its image size and channels from its config instead."""
    head = model_head(model)
    g = torch.Generator().manual_seed(seed * 1_000_003 + step) if seed is not None else None

    def ints(high, *shape):
        if g is None:
            return torch.zeros(shape, dtype=torch.long, device=device)
        return torch.randint(0, high, shape, generator=g).to(device)

    if head == "image-classification":
        cfg = model.config
        shape = (batch, cfg.num_channels, cfg.image_size, cfg.image_size)
        pixels = torch.zeros(shape, device=device) if g is None else \
            torch.randn(shape, generator=g).to(device)
        return TrainingCall(head, (pixels,), (ints(cfg.num_labels, batch),))
    vocab = vocab_size(model) if g is not None else 2  # tracing reads no values
    ids = ints(vocab, batch, seq)
    if head == "causal-lm":
        return TrainingCall(head, (ids,))
    if head == "sequence-classification":
        return TrainingCall(head, (ids,), (ints(model.config.num_labels, batch),))
    if head == "masked-lm":
        cfg = getattr(model, "config", None)
        mask_id = getattr(cfg, "mask_token_id", None) or vocab - 1
        chosen = torch.zeros(batch, seq, dtype=torch.bool, device=device) if g is None else \
            (torch.rand(batch, seq, generator=g) < MASK_FRACTION).to(device)
        return TrainingCall(head, (torch.where(chosen, mask_id, ids),),
                            (torch.where(chosen, ids, -100),))
    start = getattr(model.config, "decoder_start_token_id", None) or 0
    labels = ints(vocab, batch, seq)
    decoder_ids = torch.cat([torch.full((batch, 1), start, dtype=torch.long, device=device),
                             labels[:, :-1]], dim=1)
    return TrainingCall(head, {"input_ids": ids, "decoder_input_ids": decoder_ids}, (labels,))


def _blocks_per_chunk(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split("/"))


_blocks_per_chunk.__name__ = "blocks per pipeline chunk, e.g. 8/9/8/7"


def parse_manual_spec(text: str) -> dict:
    """dp=2,tp=2,pp=1,cp=1,ep=1,mb=1,schedule=1f1b,recompute=none,sp=0,zero=0,split=3/2,
    bn=microbatch -> manual_plan kwargs (split: ``stage_layers``, blocks per chunk; bn:
    ``batch_norm``, BatchNorm's statistics per step's batch or per microbatch)."""
    keys = {"dp": ("dp", int), "tp": ("tp", int), "pp": ("pp", int), "cp": ("cp", int),
            **{name: (name, int) for name in AXES},  # the axis table's (meshplan/axes.py)
            "mb": ("microbatch_size", int),
            "schedule": ("schedule", str), "recompute": ("recompute", str),
            "sp": ("sequence_parallel", lambda v: v.lower() in ("1", "true", "yes")),
            "zero": ("zero", int), "vs": ("virtual_stages", int), "dtype": ("dtype", str),
            "split": ("stage_layers", _blocks_per_chunk), "bn": ("batch_norm", str)}
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in keys:
            raise SpecError(f"--manual item {item!r} is not KEY=VALUE with KEY in "
                            f"{', '.join(keys)}")
        name, cast = keys[key.strip()]
        try:
            out[name] = cast(value.strip())
        except ValueError:
            raise SpecError(f"--manual {key}={value!r}: expected {cast.__name__}") from None
    return out


@dataclass(frozen=True)
class ModelBundle:
    """What a ``file.py:factory`` (or ``module:factory``) returns for a model that is not a
    causal LM on token ids: the model with one example batch, its targets and its loss.

    ``example_inputs`` is a tensor, a tuple of tensors (positional arguments of ``forward``)
    or a dict of tensors (keyword arguments); ``example_targets`` a tensor or a tuple of
    tensors passed only to the loss; ``loss_fn(outputs, *targets)`` returns a scalar (None:
    cross entropy of the outputs against the one target, or the next-token loss on the first
    input when there are no targets). The first dim of every example tensor is the batch.
    ``meshplan plan --batch N`` calls the factory with ``batch=N`` when it has that keyword,
    and otherwise repeats (or cuts) the examples along the batch dim to N rows. ``meshplan
    run`` trains on synthetic batches of the examples' shapes and dtypes: normal floats,
    integers uniform in each integer example's [min, max] (so make the examples span the
    range, e.g. class ids 0 and classes - 1), random bools; seeded by ``--seed`` and the
    step, the same whatever the plan."""

    model: nn.Module
    example_inputs: object
    example_targets: object = None
    loss_fn: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class LoadedModel:
    """A model spec loaded at one global batch (``ModelSpec.load``): the model, its example
    call (on the device it was built on) and, for a ModelBundle, the examples that the
    synthetic batches of ``meshplan run`` copy shapes, dtypes and integer ranges from."""

    model: nn.Module
    call: TrainingCall
    bundle: bool = False
    spec_text: str = ""
    batch: int = 0
    seq: int = 0  # token models: the sequence length; 0 for a bundle
    kind: str = ""  # the spec's kind: "transformers", "file", "module"

    def trace(self, model_name: str = ""):
        """The OpGraph of the model's training step on the example call. A bare module
        from a factory that cannot take token ids fails with the calling convention named,
        not as a tracing problem."""
        from meshplan.errors import TraceError
        from meshplan.tracing import trace

        c = self.call
        try:
            return trace(self.model, c.inputs, example_targets=c.targets, loss_fn=c.loss_fn,
                         model_name=model_name or self.spec_text)
        except TraceError:
            if self.bundle or self.kind in ("transformers", "config") or \
                    any(isinstance(m, nn.Embedding) for m in self.model.modules()):
                raise
            raise SpecError(
                f"{self.spec_text} returned a {type(self.model).__name__} without a token "
                "embedding, and meshplan calls a bare nn.Module from a factory as a causal LM "
                "on token ids (batch x seq), which it cannot take; for images, float "
                "features or several tensors return meshplan.ModelBundle(model, "
                "example_inputs, example_targets, loss_fn) (docs/models.md)") from None

    @property
    def takes_token_ids(self) -> bool:
        """Whether a token file (``meshplan run --data``) can feed it: a causal LM called with
        token ids alone and meshplan's next-token loss."""
        if not self.bundle:
            return self.call.head == "causal-lm"
        flat = _flat_examples(self.call)
        return len(flat) == 1 and isinstance(self.call.inputs, tuple) and \
            self.call.loss_fn is None and flat[0][1].ndim == 2 and \
            not flat[0][1].dtype.is_floating_point and flat[0][1].dtype != torch.bool

    def synthetic(self, *, seed: int, step: int) -> TrainingCall:
        """The global batch of step ``step`` on the CPU: the same for every plan and rank."""
        if not self.bundle:
            return training_call(self.model, self.batch, self.seq, device="cpu", seed=seed,
                                 step=step)
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        drawn = [_draw_like(label, x, g, self.spec_text) for label, x in _flat_examples(self.call)]
        return _rebuilt(self.call, drawn)


def _flat_examples(call: TrainingCall) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of every example input, then every target, in the flat order that
    ``flatten_call`` gives the trace."""
    if isinstance(call.inputs, Mapping):
        out = [(f"example_inputs[{k!r}]", v) for k, v in call.inputs.items()]
    else:
        out = [(f"example_inputs[{i}]", v) for i, v in enumerate(call.inputs)]
    return out + [(f"example_targets[{i}]", v) for i, v in enumerate(call.targets)]


def _rebuilt(call: TrainingCall, flat: list[torch.Tensor]) -> TrainingCall:
    """``call`` with its tensors replaced by ``flat`` (the order of ``_flat_examples``)."""
    n = len(call.inputs)
    inputs = dict(zip(call.inputs, flat[:n])) if isinstance(call.inputs, Mapping) \
        else tuple(flat[:n])
    return TrainingCall(call.head, inputs, tuple(flat[n:]), call.loss_fn)


def _draw_like(label: str, x: torch.Tensor, g: torch.Generator, text: str) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return torch.randn(x.shape, generator=g).to(x.dtype)
    if x.dtype == torch.bool:
        return torch.randint(0, 2, x.shape, generator=g).bool()
    if x.dtype.is_complex:
        raise SpecError(f"{text}: {label} is {x.dtype}; synthetic data covers float, integer "
                        "and bool tensors")
    if x.is_meta:
        raise SpecError(f"{text}: {label} is an integer tensor on the meta device; meshplan run "
                        "draws integers in the example's value range: build it on the CPU "
                        "(the factory runs under torch.device('cpu') there)")
    low, high = (int(x.min()), int(x.max())) if x.numel() else (0, 0)
    return torch.randint(low, high + 1, x.shape, generator=g, dtype=x.dtype)


def _resized(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``x`` with ``batch`` rows: its own rows repeated, then cut."""
    if x.shape[0] == batch:
        return x
    reps = -(-batch // x.shape[0])
    return x.repeat(reps, *([1] * (x.ndim - 1)))[:batch]


def _loaded_bundle(spec: ModelSpec, bundle: ModelBundle, batch: int) -> LoadedModel:
    from meshplan.errors import TraceError
    from meshplan.tracing import flatten_call

    text = spec.text
    try:
        flatten_call(bundle.example_inputs, bundle.example_targets)
    except TraceError as exc:
        raise SpecError(f"{text}: ModelBundle examples: {exc}") from None
    inputs = bundle.example_inputs
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else \
        dict(inputs) if isinstance(inputs, Mapping) else tuple(inputs)
    targets = bundle.example_targets
    targets = (targets,) if isinstance(targets, torch.Tensor) else tuple(targets or ())
    if bundle.loss_fn is not None and not callable(bundle.loss_fn):
        raise SpecError(f"{text}: ModelBundle loss_fn is a {type(bundle.loss_fn).__name__}, "
                        "not a callable loss_fn(outputs, *targets)")
    call = TrainingCall("bundle", inputs, targets, bundle.loss_fn)
    flat = _flat_examples(call)
    if not flat:
        raise SpecError(f"{text}: the ModelBundle has no example inputs; give at least one "
                        "tensor whose first dim is the batch")
    rows = flat[0][1].shape[0] if flat[0][1].ndim else None
    for label, x in flat:
        if x.ndim == 0 or x.shape[0] != rows:
            raise SpecError(f"{text}: {label} has shape {list(x.shape)}, but meshplan reads the "
                            f"batch from the first dim of every example input and target "
                            f"({flat[0][0]} has {list(flat[0][1].shape)}); give every example "
                            "tensor the batch as its first dim (bind batch-free tensors in "
                            "the model)")
    return LoadedModel(bundle.model, _rebuilt(call, [_resized(x, batch) for _, x in flat]),
                       bundle=True, spec_text=text, batch=batch, kind=spec.kind)
