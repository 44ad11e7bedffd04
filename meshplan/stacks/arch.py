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

FAMILIES = ("llama", "qwen3")  # dense transformers model_type values the exports cover
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")  # and their mixtures of experts


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
    # the router (mixtures of experts): norm_topk renormalizes the top-k weights (Mixtral
    # always; Qwen3-MoE's norm_topk_prob; DeepSeek-V3's), router_scale multiplies them
    # (DeepSeek-V3's routed_scaling_factor), router_groups / router_group_topk restrict each
    # token to its best groups of experts (DeepSeek-V3's n_group / topk_group; 1: off).
    # The score function is the family's: sigmoid with a load-balancing bias for DeepSeek-V3
    # (arXiv 2412.19437 section 2.1.2), softmax for the others.
    norm_topk: bool = True
    router_scale: float = 1.0
    router_groups: int = 1
    router_group_topk: int = 1

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
                         moe_intermediate_size=self.moe_ffn_hidden, num_experts=self.experts,
                         norm_topk_prob=self.norm_topk)
        else:
            keys |= dict(intermediate_size=self.ffn_hidden,
                         moe_intermediate_size=self.moe_ffn_hidden, n_routed_experts=self.experts,
                         n_shared_experts=self.shared_ffn_hidden // self.moe_ffn_hidden,
                         first_k_dense_replace=len(self.dense_layers),
                         n_group=self.router_groups, topk_group=self.router_group_topk,
                         routed_scaling_factor=_num(self.router_scale),
                         norm_topk_prob=self.norm_topk,
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
    """``ModelArch`` of a transformers config (a Llama or Qwen3 decoder, or the mixtures of
    experts Mixtral, Qwen3-MoE and DeepSeek-V3)."""
    family = getattr(config, "model_type", "")
    if family not in FAMILIES + MOE_FAMILIES:
        raise NotSupportedError(f"model type {family or type(config).__name__!r}: export to "
                                f"torchtitan / Megatron-LM covers {', '.join(FAMILIES)} decoders "
                                f"and the mixtures of experts {', '.join(MOE_FAMILIES)}; plan it "
                                "and run it with meshplan")
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    heads = config.num_attention_heads
    if family in MOE_FAMILIES:
        return _moe_arch_of_config(config, family, float(theta))
    return ModelArch(family=family, hidden=config.hidden_size,
                     ffn_hidden=config.intermediate_size, layers=config.num_hidden_layers,
                     heads=heads, kv_heads=config.num_key_value_heads or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     vocab=config.vocab_size, max_positions=config.max_position_embeddings,
                     rope_theta=float(theta), norm_eps=float(config.rms_norm_eps),
                     tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


def _moe_arch_of_config(config, family: str, theta: float) -> ModelArch:
    """Mixtral (every block routed, no qk-norm), Qwen3-MoE (qk-norm; every block routed) and
    DeepSeek-V3 (multi-latent attention, shared experts, dense first blocks)."""
    c, heads = config, config.num_attention_heads
    common = dict(family=family, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                  vocab=c.vocab_size, max_positions=c.max_position_embeddings,
                  rope_theta=theta, norm_eps=float(c.rms_norm_eps),
                  tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                  top_k=c.num_experts_per_tok)
    if family == "mixtral":
        return ModelArch(**common, ffn_hidden=c.intermediate_size,
                         kv_heads=c.num_key_value_heads or heads,
                         head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                         experts=c.num_local_experts, moe_ffn_hidden=c.intermediate_size)
    if family == "qwen3_moe":
        if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
            raise NotSupportedError("Qwen3-MoE with dense blocks (mlp_only_layers, "
                                    "decoder_sparse_step != 1): the exports write every block "
                                    "routed, as the published Qwen3-MoE models are")
        return ModelArch(**common, ffn_hidden=c.intermediate_size,
                         kv_heads=c.num_key_value_heads or heads,
                         head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                         experts=c.num_experts, moe_ffn_hidden=c.moe_intermediate_size,
                         norm_topk=bool(c.norm_topk_prob))
    dense = int(c.first_k_dense_replace)
    return ModelArch(**common, ffn_hidden=c.intermediate_size, kv_heads=heads,
                     head_dim=c.qk_nope_head_dim, experts=c.n_routed_experts,
                     moe_ffn_hidden=c.moe_intermediate_size,
                     shared_ffn_hidden=(c.n_shared_experts or 0) * c.moe_intermediate_size,
                     dense_layers=tuple(range(dense)), q_lora_rank=c.q_lora_rank or 0,
                     kv_lora_rank=c.kv_lora_rank, qk_rope_dim=c.qk_rope_head_dim,
                     v_head_dim=c.v_head_dim, norm_topk=bool(c.norm_topk_prob),
                     router_scale=float(c.routed_scaling_factor),
                     router_groups=c.n_group or 1, router_group_topk=c.topk_group or 1)


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
