"""The model's architecture in the words the stacks use, read from a transformers config.

torchtitan names a model by family and flavor (``llama3`` / ``8B``); Megatron-LM by its
dimensions (``--num-layers --hidden-size --ffn-hidden-size --num-attention-heads
--num-query-groups ...``). Both need more than a plan holds (a plan records placements, not
widths), so export and import go through ``ModelArch``: read from a transformers model's
config, written back as a meshplan model spec (``transformers:llama?hidden_size=...``) that
re-traces the same model. Llama (and Llama 3.x) and Qwen3 decoders are read; other families
are refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import NotSupportedError, SpecError

FAMILIES = ("llama", "qwen3")  # transformers model_type values the stacks' exports cover


@dataclass(frozen=True, slots=True)
class ModelArch:
    family: str  # transformers model_type: "llama" | "qwen3"
    hidden: int
    ffn_hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool = False

    def spec(self) -> str:
        """A meshplan model spec that builds this architecture (random weights)."""
        keys = dict(hidden_size=self.hidden, intermediate_size=self.ffn_hidden,
                    num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                    max_position_embeddings=self.max_positions, rope_theta=_num(self.rope_theta),
                    rms_norm_eps=_num(self.norm_eps))
        if self.head_dim != self.hidden // self.heads:
            keys["head_dim"] = self.head_dim
        if self.tied_embeddings:
            keys["tie_word_embeddings"] = True
        return f"transformers:{self.family}?" + "&".join(f"{k}={v}" for k, v in keys.items())

    def words(self) -> str:
        return (f"{self.family} {self.layers} layers, hidden {self.hidden}, ffn {self.ffn_hidden}, "
                f"{self.heads} heads ({self.kv_heads} kv), vocab {self.vocab}")


def _num(x: float):
    return int(x) if float(x).is_integer() else x


def arch_of_config(config) -> ModelArch:
    """``ModelArch`` of a transformers config (Llama or Qwen3 decoder)."""
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        raise NotSupportedError(f"model type {family or type(config).__name__!r}: export to "
                                f"torchtitan / Megatron-LM covers {', '.join(FAMILIES)} decoders "
                                "(the families both ship); plan it and run it with meshplan")
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    heads = config.num_attention_heads
    return ModelArch(family=family, hidden=config.hidden_size,
                     ffn_hidden=config.intermediate_size, layers=config.num_hidden_layers,
                     heads=heads, kv_heads=config.num_key_value_heads or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     vocab=config.vocab_size, max_positions=config.max_position_embeddings,
                     rope_theta=float(theta), norm_eps=float(config.rms_norm_eps),
                     tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def arch_of_model(model) -> ModelArch:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise NotSupportedError(f"{type(model).__name__} has no transformers config: export to "
                                "torchtitan / Megatron-LM reads the architecture from one; build "
                                "the model with a transformers:llama|qwen3 spec")
    return arch_of_config(config)


def arch_of_spec(spec: str) -> ModelArch:
    from meshplan.specs import parse_model_spec

    parsed = parse_model_spec(spec)
    if parsed.kind != "transformers":
        raise SpecError(f"model spec {spec!r}: export reads the architecture from a "
                        "transformers:llama|qwen3 spec (or a preset such as llama3.1-8b)")
    import transformers

    overrides = {k: v for k, v in parsed.overrides if k != "head"}
    try:
        config = transformers.AutoConfig.for_model(parsed.target, **overrides)
    except ValueError as exc:
        raise SpecError(f"model spec {spec!r}: transformers refused it: {exc}") from None
    return arch_of_config(config)
