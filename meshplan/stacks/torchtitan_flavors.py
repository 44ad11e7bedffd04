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


def flavor_of(arch: ModelArch) -> Flavor | None:
    """torchtitan's flavor with ``arch``'s dimensions (max_positions aside), or None."""
    for (name, flavor), known in FLAVORS.items():
        if replace(known, max_positions=arch.max_positions) == arch:
            return Flavor(name, flavor)
    return None


def _flavor_names() -> str:
    return "; ".join(f"{n}: " + ", ".join(f for m, f in FLAVORS if m == n)
                     for n in ("llama3", "qwen3"))


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
