"""torchtitan 0.2.2's model flavors and JobConfig defaults, as meshplan reads them.

Data read from torchtitan's own code (paths relative to its package), kept apart from the
reader and writer in ``meshplan/stacks/torchtitan.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.stacks.arch import ModelArch
from meshplan.vocabulary import Recompute


def _llama3(dim, layers, heads, kv, ffn, vocab=128256) -> ModelArch:
    return ModelArch(family="llama", hidden=dim, ffn_hidden=ffn, layers=layers, heads=heads,
                     kv_heads=kv, head_dim=dim // heads, vocab=vocab, max_positions=131072,
                     rope_theta=500000.0, norm_eps=1e-5)


def _qwen3(dim, layers, heads, ffn, tied, vocab=151936) -> ModelArch:
    return ModelArch(family="qwen3", hidden=dim, ffn_hidden=ffn, layers=layers, heads=heads,
                     kv_heads=8, head_dim=128, vocab=vocab, max_positions=4096,
                     rope_theta=1000000.0, norm_eps=1e-6, tied_embeddings=tied)


# torchtitan 0.2.2's dense flavors (models/llama3/__init__.py llama3_args, models/qwen3/
# __init__.py qwen3_args). llama3's FFN width is its FeedForward rule: int(2/3 * 4 dim),
# times ffn_dim_multiplier, rounded up to multiple_of (8B: 1.3, 1024 -> 14336; 70B: 1.3,
# 4096 -> 28672; 405B: 1.2, 4096 -> 53248; debugmodel: 256 -> 768, n_kv_heads = n_heads).
# max_positions: the flavor's max_seq_len (torchtitan replaces it with training.seq_len).
FLAVORS: dict[tuple[str, str], ModelArch] = {
    ("llama3", "debugmodel"): _llama3(256, 6, 16, 16, 768, vocab=2048),
    ("llama3", "8B"): _llama3(4096, 32, 32, 8, 14336),
    ("llama3", "70B"): _llama3(8192, 80, 64, 8, 28672),
    ("llama3", "405B"): _llama3(16384, 126, 128, 8, 53248),
    ("qwen3", "debugmodel"): _qwen3(256, 8, 16, 3072, True, vocab=2048),
    ("qwen3", "0.6B"): _qwen3(1024, 28, 16, 3072, True),
    ("qwen3", "1.7B"): _qwen3(2048, 28, 16, 6144, True),
    ("qwen3", "4B"): _qwen3(2560, 36, 32, 9728, True),
    ("qwen3", "8B"): _qwen3(4096, 36, 32, 12288, False),
    ("qwen3", "14B"): _qwen3(5120, 40, 40, 17408, False),
    ("qwen3", "32B"): _qwen3(5120, 64, 64, 25600, False),
}

def _qwen3_moe(dim, layers, heads, kv, experts, moe_ffn, theta, ffn, vocab=151936) -> ModelArch:
    """torchtitan 0.3.0's Qwen3-MoE flavors (models/qwen3/__init__.py _build_qwen3_moe_layers:
    every block routed, softmax router with route_norm, head_dim 128, eps 1e-6, untied).
    ``ffn``: the dense width torchtitan never builds (no dense block), here the Hugging Face
    config's intermediate_size; flavor matching ignores it (``ignored_fields``)."""
    return ModelArch(family="qwen3_moe", hidden=dim, ffn_hidden=ffn, layers=layers,
                     heads=heads, kv_heads=kv, head_dim=128, vocab=vocab, max_positions=40960,
                     rope_theta=theta, norm_eps=1e-6, experts=experts, top_k=8,
                     moe_ffn_hidden=moe_ffn)


# torchtitan 0.3.0's mixtures of experts (models/qwen3/__init__.py _debugmodel_moe, _30b_a3b,
# _235b_a22b; models/deepseek_v3/__init__.py _671b), read off the configs its model_registry
# builds (tests/_torchtitan_check.py "flavors" checks them). 235B-A22B's rope theta is
# 5,000,000 (Qwen3-235B-A22B-Instruct-2507's; the first release's config.json says 1,000,000).
# DeepSeek-V3 671B: RMSNorm eps 1e-5 (torchtitan's default; the Hugging Face config says
# 1e-6), yarn rope scaling (no shape changes), sigmoid router with groups 8 / top 4 and scale
# 2.5. deepseek_v3 debugmodel and 16B (DeepSeek-MoE 16B) have a full-rank query and a softmax
# router, which transformers' deepseek_v3 does not build: not listed.
FLAVORS |= {
    ("qwen3", "debugmodel_moe"): replace(_qwen3_moe(256, 8, 16, 8, 64, 768, 1e6, 3072),
                                         vocab=2048, max_positions=4096),
    ("qwen3", "30B-A3B"): _qwen3_moe(2048, 48, 32, 4, 128, 768, 1e6, 6144),
    ("qwen3", "235B-A22B"): _qwen3_moe(4096, 94, 64, 4, 128, 1536, 5e6, 12288),
    ("deepseek_v3", "671B"): ModelArch(
        family="deepseek_v3", hidden=7168, ffn_hidden=18432, layers=61, heads=128,
        kv_heads=128, head_dim=128, vocab=129280, max_positions=16384, rope_theta=10000.0,
        norm_eps=1e-5, experts=256, top_k=8, moe_ffn_hidden=2048, shared_ffn_hidden=2048,
        dense_layers=(0, 1, 2), q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64,
        v_head_dim=128, router_scale=2.5, router_groups=8, router_group_topk=4),
}
# torchtitan model names by meshplan family
MODEL_NAMES = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3",
               "deepseek_v3": "deepseek_v3"}
PIPELINED = ("llama",)  # families whose train spec has a pipelining_fn (qwen3's is None)

# torchtitan 0.2.2's JobConfig defaults (config/job_config.py) for every key read here
DEFAULTS = {
    "model": {"name": "llama3", "flavor": "debugmodel", "converters": []},
    "training": {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048,
                 "dtype": "float32", "mixed_precision_param": "bfloat16",
                 "mixed_precision_reduce": "float32", "enable_cpu_offload": False},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                    "pipeline_parallel_degree": 1, "module_fqns_per_model_part": None,
                    "pipeline_parallel_first_stage_less_layers": 1,
                    "pipeline_parallel_last_stage_less_layers": 1,
                    "pipeline_parallel_layers_per_stage": None,
                    "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_schedule_csv": "",
                    "pipeline_parallel_microbatch_size": 1, "context_parallel_degree": 1,
                    "context_parallel_load_balancer": "headtail", "expert_parallel_degree": 1},
    "activation_checkpoint": {"mode": Recompute.SELECTIVE, "selective_ac_option": "2"},
    "compile": {"enable": False, "components": ["model", "loss"]},
    "float8": {"enable_fsdp_float8_all_gather": False,
               "precompute_float8_dynamic_scale_for_fsdp": False, "recipe_name": None},
}


@dataclass(frozen=True, slots=True)
class Flavor:
    name: str  # torchtitan model.name: "llama3" | "qwen3"
    flavor: str


def ignored_fields(arch: ModelArch) -> tuple[str, ...]:
    """Fields a flavor match leaves aside: max_positions (torchtitan uses training.seq_len),
    and the dense width of a mixture of experts with no dense block (never built)."""
    return ("max_positions",) + (("ffn_hidden",) if arch.experts and not arch.dense_layers
                                 else ())


def flavor_of(arch: ModelArch) -> Flavor | None:
    """torchtitan's flavor with ``arch``'s dimensions (``ignored_fields`` aside), or None."""
    for (name, flavor), known in FLAVORS.items():
        if replace(known, **{f: getattr(arch, f) for f in ignored_fields(arch)}) == arch:
            return Flavor(name, flavor)
    return None


def _flavor_names() -> str:
    return "; ".join(f"{n}: " + ", ".join(f for m, f in FLAVORS if m == n)
                     for n in ("llama3", "qwen3", "deepseek_v3"))


# --- torchtitan 0.3.0: Python config registries -----------------------------------------------

# torchtitan 0.3.0's config functions for the dense flavors (models/llama3/config_registry.py,
# models/qwen3/config_registry.py) and what each sets beyond the 0.3.0 dataclass defaults
# (DEFAULTS_03), read from their bodies. "ac": the activation-checkpoint policy they set;
# "float8": the function converts the model to float8 rowwise in its model spec (llama3_405b,
# filter_fqns ["lm_head"]), which needs torchao and an SM89+ GPU to even build the config.
# llama3 1B / 3B and qwen3 4B / 8B have flavors but no config function in 0.3.0.
BASES_03: dict[str, dict] = {
    "llama3_debugmodel": {"flavor": ("llama3", "debugmodel"), "ac": Recompute.SELECTIVE,
                          "training": {"local_batch_size": 8, "seq_len": 2048},
                          "parallelism": {"pipeline_parallel_schedule": "Interleaved1F1B"}},
    "llama3_8b": {"flavor": ("llama3", "8B"), "ac": Recompute.SELECTIVE,
                  "training": {"local_batch_size": 1, "seq_len": 8192}},
    "llama3_70b": {"flavor": ("llama3", "70B"), "ac": Recompute.FULL,
                   "training": {"local_batch_size": 8, "seq_len": 8192},
                   "parallelism": {"tensor_parallel_degree": 8}},
    "llama3_405b": {"flavor": ("llama3", "405B"), "ac": Recompute.FULL, "float8": True,
                    "training": {"local_batch_size": 2, "seq_len": 8192},
                    "parallelism": {"tensor_parallel_degree": 8},
                    "compile": {"enable": True, "enable_async_tensor_parallel": True}},
    "qwen3_debugmodel": {"flavor": ("qwen3", "debugmodel"), "ac": Recompute.SELECTIVE,
                         "training": {"local_batch_size": 8, "seq_len": 2048}},
    "qwen3_0_6b": {"flavor": ("qwen3", "0.6B"), "ac": Recompute.SELECTIVE,
                   "training": {"local_batch_size": 4, "seq_len": 4096}},
    "qwen3_1_7b": {"flavor": ("qwen3", "1.7B"), "ac": Recompute.SELECTIVE,
                   "training": {"local_batch_size": 4, "seq_len": 4096}},
    "qwen3_14b": {"flavor": ("qwen3", "14B"), "ac": Recompute.FULL,
                  "training": {"local_batch_size": 4, "seq_len": 4096}},
    "qwen3_32b": {"flavor": ("qwen3", "32B"), "ac": Recompute.FULL,
                  "training": {"local_batch_size": 2, "seq_len": 4096}},
    # the mixtures of experts (Qwen3-235B-A22B has a flavor but no function)
    "qwen3_moe_debug": {"flavor": ("qwen3", "debugmodel_moe"), "ac": Recompute.SELECTIVE,
                        "training": {"local_batch_size": 4, "seq_len": 4096}},
    "qwen3_30b_a3b": {"flavor": ("qwen3", "30B-A3B"), "ac": Recompute.FULL,
                      "training": {"local_batch_size": 2, "seq_len": 4096}},
    "deepseek_v3_671b": {"flavor": ("deepseek_v3", "671B"), "ac": Recompute.SELECTIVE,
                         "training": {"local_batch_size": 4, "seq_len": 4096,
                                      "disable_cuda_graphs": True},
                         "parallelism": {"pipeline_parallel_schedule": "Interleaved1F1B",
                                         "expert_parallel_degree": 2},
                         "compile": {"enable": True, "components": ["loss"]}},
}

# torchtitan 0.3.0's dataclass defaults (config/configs.py TrainingConfig, ParallelismConfig,
# CompileConfig) for every field meshplan reads or writes
DEFAULTS_03 = {
    "training": {"local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048,
                 "dtype": "float32", "mixed_precision_param": "bfloat16",
                 "mixed_precision_reduce": "float32", "enable_cpu_offload": False,
                 "disable_cuda_graphs": False},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                    "enable_sequence_parallel": True, "pipeline_parallel_degree": 1,
                    "module_fqns_per_model_part": None,
                    "pipeline_parallel_first_stage_less_layers": 1,
                    "pipeline_parallel_last_stage_less_layers": 1,
                    "pipeline_parallel_layers_per_stage": None,
                    "pipeline_parallel_schedule": "1F1B", "pipeline_parallel_schedule_csv": "",
                    "pipeline_parallel_microbatch_size": 1, "context_parallel_degree": 1,
                    "context_parallel_load_balancer": "headtail", "expert_parallel_degree": 1},
    "compile": {"enable": False, "enable_async_tensor_parallel": False,
                "components": ["model", "loss"]},
}


def base_function(flavor: Flavor) -> str | None:
    """torchtitan 0.3.0's config function for ``flavor``, or None where it has none."""
    return next((f for f, b in BASES_03.items() if b["flavor"] == (flavor.name, flavor.flavor)),
                None)
