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
    # mixture of experts (experts=0: dense): routed experts, each token's top_k of them,
    # each expert's hidden size, the shared experts' total hidden size (0: none) and the
    # blocks that keep a dense feed-forward (ffn_hidden) instead
    experts: int = 0
    top_k: int = 0
    moe_ffn_hidden: int = 0
    shared_ffn_hidden: int = 0
    dense_layers: tuple[int, ...] = ()
    # multi-latent attention (family deepseek_v3; head_dim is the query/key head's part
    # without rotary embedding): the query's and key/value's low ranks, the rotary part of
    # each query/key head and the value head's size
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def spec(self) -> str:
        """A meshplan model spec that builds this architecture (random weights)."""
        if self.experts:
            return self._moe_spec()
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

    def _moe_spec(self) -> str:
        """Mixtral (no qk-norm), Qwen3-MoE (qk-norm) or DeepSeek-V3 (multi-latent attention,
        shared experts, dense first blocks; group-limited routing off: n_group 1)."""
        keys = dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads)
        if self.family == "mixtral":
            keys |= dict(intermediate_size=self.moe_ffn_hidden, num_local_experts=self.experts)
        elif self.family == "qwen3_moe":
            keys |= dict(intermediate_size=self.ffn_hidden,
                         moe_intermediate_size=self.moe_ffn_hidden, num_experts=self.experts)
        else:
            keys |= dict(intermediate_size=self.ffn_hidden,
                         moe_intermediate_size=self.moe_ffn_hidden, n_routed_experts=self.experts,
                         n_shared_experts=self.shared_ffn_hidden // self.moe_ffn_hidden,
                         first_k_dense_replace=len(self.dense_layers), n_group=1, topk_group=1,
                         q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
                         qk_nope_head_dim=self.head_dim, qk_rope_head_dim=self.qk_rope_dim,
                         v_head_dim=self.v_head_dim)
        keys |= dict(num_experts_per_tok=self.top_k, vocab_size=self.vocab,
                     max_position_embeddings=self.max_positions, rope_theta=_num(self.rope_theta),
                     rms_norm_eps=_num(self.norm_eps))
        if self.family != "deepseek_v3" and self.head_dim != self.hidden // self.heads:
            keys["head_dim"] = self.head_dim
        if self.tied_embeddings:
            keys["tie_word_embeddings"] = True
        return f"transformers:{self.family}?" + "&".join(f"{k}={v}" for k, v in keys.items())

    def words(self) -> str:
        moe = f", {self.experts} experts (top {self.top_k}, ffn {self.moe_ffn_hidden})" \
            if self.experts else ""
        return (f"{self.family} {self.layers} layers, hidden {self.hidden}, ffn {self.ffn_hidden}, "
                f"{self.heads} heads ({self.kv_heads} kv), vocab {self.vocab}{moe}")


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
