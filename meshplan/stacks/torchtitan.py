"""A plan as a torchtitan 0.3 job: a config registry function and its command line, and back.

plan -> ``layout_of`` -> **to_torchtitan** -> ``PACKAGE/config_registry.py`` with
``meshplan_<model>()`` returning torchtitan's ``Trainer.Config`` -> ``torchrun -m
torchtitan.train --module PACKAGE --config meshplan_<model>``; the same job as torchtitan's
own function plus overrides (``torchtitan_command``: ``--module llama3 --config llama3_70b
--parallelism.* ...``). Back: **from_torchtitan** reads either form, and torchtitan 0.2's
TOML job files, into a ``StackLayout`` -> ``manual_plan`` -> estimate.

``problems`` states what torchtitan 0.3.0 runs, read from its own code (paths relative to
its package):

- data parallel: ``apply_fsdp_to_decoder`` always applies ``fully_shard`` (with
  ``shard_degree = 1`` it only installs the mixed-precision policy,
  ``models/llama3/parallelize.py``), over ``dp_shard x cp`` (ZeRO-3; ZeRO-2 with
  ``fsdp_reshard_after_forward = "never"``; "default" reshards without a pipeline and
  keeps the gathered weights with one, ``distributed/fsdp.py``), replicated over
  ``data_parallel_replicate_degree`` (ZeRO-0, beside TP / PP too: 0.2's DDP-only-alone rule
  is gone); no ZeRO-1. Mixed precision always comes from ``fully_shard``.
- tensor parallel: ``enable_sequence_parallel`` (default on) shards the norms over the
  sequence; wq/wk/wv split by heads; ``seq_len`` divides by ``tp x 2 x cp``
  (``ParallelDims.seq_len_divisor``).
- context parallel: the config functions build FlexAttention models (``model_registry``'s
  ``attn_backend="flex"``), which the default ``spmd_types`` backend needs for CP
  (``distributed/full_dtensor.py validate_config``); the head-tail load balancer.
- pipeline: ``get_schedule_class`` names (GPipe, 1F1B; Interleaved1F1B with >= 2 stages per
  rank); the split as ``module_fqns_per_model_part`` (the head is ``lm_head`` in 0.3); llama3
  and qwen3 both pipeline (``pipeline_llm``); CUDA graphs refuse a pipeline
  (``Trainer.Config._validate_cuda_graphs``), so a pipelined export disables them.
- fp8: ``Float8LinearConverter`` has the rowwise recipes only (``rowwise``,
  ``rowwise_with_gw_hp``, ``components/quantization/float8.py``); meshplan prices torchao's
  tensorwise with fp8 all-gather, which 0.3 cannot run: an fp8 plan is refused.
- activation checkpointing: ``activation-checkpoint:none|selective|full`` (per-op SAC);
  ``torch.compile`` per block (``[compile] enable``, components model and loss); async TP
  (``compile.enable_async_tensor_parallel``) is not priced and is written off.
"""

from __future__ import annotations

import ast
import difflib
import keyword
import math
import shlex
import tomllib
from dataclasses import fields, replace

from meshplan.errors import MeshplanError, NotSupportedError, SpecError
from meshplan.stacks.arch import ModelArch
from meshplan.stacks.layout import StackLayout
from meshplan.stacks.torchtitan_flavors import (BASES_03, DEFAULTS, DEFAULTS_03, FLAVORS,
                                                 MODEL_NAMES, Flavor, _flavor_names,
                                                 base_function, flavor_of, ignored_fields)
from meshplan.schedules import Schedule
from meshplan.vocabulary import RECOMPUTE, ComputeDtype, Recompute

TORCHTITAN_VERSION = "0.3.0"
TOML_VERSION = "0.2.2"  # the last release with TOML job files, still read
FLOAT8 = "quantize.linear.float8"  # 0.2.2's registered converter name (quantization/float8.py)
SCHEDULE_NAMES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED: "Interleaved1F1B"}
# 0.3.0: the llama3, qwen3 (Qwen3-MoE too) and deepseek_v3 model registries set
# pipelining_fn=pipeline_llm
PIPELINED = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")
# a config function that converts its model to float8 while building, and how meshplan
# writes its other settings from another function (models/llama3/config_registry.py
# llama3_405b: 405B, its HF assets, AdamW lr 8e-5, 600 warmup steps, 3000 steps; the rest is
# llama3_70b()'s: c4, tp 8, full AC, checkpoints every 500, validation)
WITHOUT_FLOAT8 = {"llama3_405b": ("llama3_70b", [
    "config.hf_assets_path = './assets/hf/Llama-3.1-405B'",
    "config.optimizer = default_adamw(lr=8e-5)",
    "config.lr_scheduler.warmup_steps = 600", "config.training.steps = 3000"],
    ["from torchtitan.components.optimizer import default_adamw"])}
FP8_PROBLEM = ("fp8: torchtitan "
               f"{TORCHTITAN_VERSION}'s Float8LinearConverter has the rowwise recipes only "
               "(components/quantization/float8.py), and meshplan writes no 0.3 float8 "
               "converter yet (a rowwise plan, --fp8-recipe rowwise, is priced but not "
               "exported); plan in bf16 (--dtype bf16)")
# torchtitan's activation-checkpoint subcommands (none | selective | full) are meshplan's
# recompute names; the config classes behind them:
AC_CLASSES = {Recompute.NONE: None, Recompute.SELECTIVE: "SelectiveAC", Recompute.FULL: "FullAC"}


def problems(layout: StackLayout, arch: ModelArch) -> tuple[str, ...]:
    """What torchtitan 0.3.0 cannot run of ``layout`` for ``arch``, one line each.

    The model's own dimensions are not checked here (``plan --for torchtitan`` prices any
    Llama / Qwen3): ``to_torchtitan`` refuses a model that matches none of torchtitan's
    flavors (``flavor_problem``)."""
    out = []
    L, dpcp = layout, layout.dp * layout.cp
    if L.zero == 1:
        out.append("zero=1 (optimizer state only): torchtitan shards with FSDP2 (ZeRO-3, or "
                   "ZeRO-2 with fsdp_reshard_after_forward='never') or replicates; re-plan "
                   "with zero=0, 2 or 3 (meshplan plan --for torchtitan)")
    if L.zero == 0 and L.cp > 1:
        out.append(f"zero=0 with cp={L.cp}: torchtitan always shards the weights over "
                   "dp_shard x cp when cp > 1; re-plan with zero=3 (or 2)")
    if L.zero in (2, 3) and dpcp == 1:
        out.append(f"zero={L.zero} over dp x cp = 1: torchtitan's FSDP over dp_shard x cp = 1 "
                   "shards nothing; set zero=0 (the same run)")
    if L.dtype == ComputeDtype.FP8:
        out.append(FP8_PROBLEM)
    if L.tp == 1 and L.sequence_parallel:
        out.append("sequence_parallel with tp=1: there is no tensor-parallel group to shard "
                   "the sequence over; set sequence_parallel=False")
    if arch.heads % L.tp or arch.kv_heads % L.tp:
        ok = [t for t in range(1, arch.kv_heads + 1)
              if arch.heads % t == 0 and arch.kv_heads % t == 0]
        out.append(f"tp={L.tp} must divide the attention heads ({arch.heads}) and kv heads "
                   f"({arch.kv_heads}): torchtitan splits wq/wk/wv by heads; choose tp in "
                   f"{{{', '.join(map(str, ok))}}}")
    divisor = L.tp * 2 * L.cp
    if L.seq_len % divisor:
        out.append(f"seq_len {L.seq_len} is not a multiple of tp x 2 x cp = {divisor} "
                   "(torchtitan's seq_len_divisor for sequence and context parallelism); "
                   f"use a multiple of {divisor}")
    out += _pipeline_problems(L, arch)
    if L.ep > 1:
        shard = (L.dp if L.zero in (2, 3) else 1) * L.cp * L.tp
        if not arch.experts:
            out.append(f"ep={L.ep} for a dense model: torchtitan's expert_parallel_degree has "
                       "no effect without experts; use ep=1")
        elif arch.experts % L.ep:
            out.append(f"ep={L.ep} must divide the {arch.experts} experts (each expert-parallel "
                       "rank holds experts / ep of them)")
        elif shard % L.ep:  # ParallelismConfig.expert_parallel_degree's mesh constraint
            out.append(f"ep={L.ep} must divide dp_shard x cp x tp = {shard}: torchtitan borrows "
                       "the expert-parallel ranks from FSDP and TP (efsdp = dp_shard x cp x tp / "
                       "ep), never from data_parallel_replicate; shard the weights (zero=2 or "
                       "3) or choose a divisor")
    return tuple(out)


# the fields a flavor fixes, in the words a transformers config uses
_FIELDS = {"hidden": "hidden_size", "ffn_hidden": "intermediate_size",
           "layers": "num_hidden_layers", "heads": "num_attention_heads",
           "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
           "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
           "tied_embeddings": "tie_word_embeddings", "family": "model_type",
           "experts": "num_experts", "top_k": "num_experts_per_tok",
           "moe_ffn_hidden": "moe_intermediate_size",
           "shared_ffn_hidden": "shared experts' width", "dense_layers": "dense blocks",
           "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
           "qk_rope_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
           "norm_topk": "norm_topk_prob", "router_scale": "routed_scaling_factor",
           "router_groups": "n_group", "router_group_topk": "topk_group"}


def nearest_flavor(arch: ModelArch) -> tuple[Flavor, list[tuple[str, object, object]]]:
    """torchtitan's flavor with the fewest fields unlike ``arch``'s, and those fields as
    (transformers name, this model's value, the flavor's value); max_positions aside."""
    best = None
    for (name, flavor), known in FLAVORS.items():
        diff = [(_FIELDS[f.name], getattr(arch, f.name), getattr(known, f.name))
                for f in fields(ModelArch) if f.name not in ignored_fields(arch)
                and getattr(arch, f.name) != getattr(known, f.name)]
        if best is None or len(diff) < len(best[1]):
            best = (Flavor(name, flavor), diff)
    return best


def flavor_problem(arch: ModelArch) -> str | None:
    """One line when ``arch`` matches none of torchtitan's flavors (or one without a 0.3.0
    config function), naming the nearest flavor and each field that differs, else None."""
    found = flavor_of(arch)
    if found is not None:
        if base_function(found) is None:
            return (f"model {arch.words()} is torchtitan's {found.name} {found.flavor}, which "
                    f"has no config function in torchtitan {TORCHTITAN_VERSION} (ones with: "
                    f"{', '.join(BASES_03)}); plan one of these")
        return None
    if arch.family not in MODEL_NAMES:
        return (f"model {arch.words()}: torchtitan {TORCHTITAN_VERSION} ships no "
                f"{arch.family} model (its mixtures of experts: qwen3 "
                + ", ".join(f for (m, f), a in FLAVORS.items() if m == "qwen3" and a.experts)
                + ", deepseek_v3 671B); export it to Megatron-LM (--to megatron)")
    near, diff = nearest_flavor(arch)
    shown = "; ".join(f"{k} {a} here, {b} in {near.flavor}" for k, a, b in diff[:4])
    more = f" (and {len(diff) - 4} more)" if len(diff) > 4 else ""
    return (f"model {arch.words()}: matches no torchtitan {TORCHTITAN_VERSION} flavor; the "
            f"nearest, {near.name} {near.flavor}, differs in {len(diff)} field"
            f"{'s' * (len(diff) > 1)}: {shown}{more}; set "
            + ", ".join(f"{k}={_lit(b)}" for k, _, b in diff[:4]) +
            " in the model's config to train that flavor (torchtitan builds models from its "
            "flavor tables only)")


def _lit(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _pipeline_problems(L: StackLayout, arch: ModelArch) -> list[str]:
    out = []
    if L.pp == 1:
        if L.schedule != Schedule.ONE_F_ONE_B or L.virtual_stages != 1 or L.stage_layers:
            out.append(f"schedule {L.schedule} x{L.virtual_stages} or a stage split with pp=1: "
                       "nothing is pipelined; use schedule='1f1b', virtual_stages=1, no split")
        return out
    if arch.family not in PIPELINED:
        out.append(f"pp={L.pp} for {arch.family}: torchtitan {TORCHTITAN_VERSION}'s "
                   f"{arch.family} train spec has no pipelining_fn; use pp=1 (or a Llama)")
    if L.schedule == Schedule.INTERLEAVED and L.virtual_stages < 2:
        out.append(f"interleaved-1f1b with virtual_stages={L.virtual_stages}: torchtitan's "
                   "multi-stage schedules need >= 2 stages per rank; use 1f1b or "
                   "virtual_stages >= 2")
    if L.schedule != Schedule.INTERLEAVED and L.virtual_stages != 1:
        out.append(f"virtual_stages={L.virtual_stages} with {L.schedule}: torchtitan's "
                   "single-stage schedules run one stage per rank; set virtual_stages=1")
    if not out:
        try:
            counts = L.layers_per_chunk(arch.layers)
        except MeshplanError as exc:  # more chunks than the even split can fill
            return [f"stage split of {arch.layers} layers into {L.chunks} chunks: {exc}"]
        if len(counts) != L.chunks or sum(counts) != arch.layers or \
                any(c == 0 for c in counts[1:-1]) or min(counts) < 0:
            out.append(f"stage split {list(counts)}: torchtitan needs {L.chunks} chunks of "
                       f"{arch.layers} layers in all, none but the first or last empty; "
                       "re-plan the split")
    return out


def _fqns(counts: tuple[int, ...], head: str = "lm_head") -> list[list[str]]:
    parts, start = [], 0
    for j, n in enumerate(counts):
        part = ["tok_embeddings"] if j == 0 else []
        part += [f"layers.{i}" for i in range(start, start + n)]
        part += ["norm", head] if j == len(counts) - 1 else []
        parts.append(part)
        start += n
    return parts


def _settings(layout: StackLayout, arch: ModelArch) -> dict:
    """What the plan decides, as torchtitan 0.3.0's config fields: {section: {field: value}},
    "ac" (the activation-checkpoint subcommand). NotSupportedError with the first problem."""
    found = (flavor_problem(arch),) + problems(layout, arch)
    if any(found):
        raise NotSupportedError(next(p for p in found if p))
    L = layout
    fsdp = L.zero in (2, 3)
    pipelined = L.pp > 1
    if L.zero == 3:
        reshard = "always" if pipelined else "default"
    else:
        reshard = "never" if fsdp else "default"
    par = {"data_parallel_replicate_degree": 1 if fsdp else L.dp,
           "data_parallel_shard_degree": L.dp if fsdp else 1,
           "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": L.tp,
           "enable_sequence_parallel": L.sequence_parallel or L.tp == 1,
           "context_parallel_degree": L.cp, "context_parallel_load_balancer": "headtail",
           "expert_parallel_degree": L.ep,
           "pipeline_parallel_degree": L.pp,
           "pipeline_parallel_schedule": SCHEDULE_NAMES[L.schedule] if pipelined else "1F1B",
           "pipeline_parallel_microbatch_size": L.microbatch_size if pipelined else 1,
           "module_fqns_per_model_part": _fqns(L.layers_per_chunk(arch.layers))
           if pipelined else None}
    training = {"local_batch_size": L.global_batch // L.dp if pipelined else L.microbatch_size,
                "global_batch_size": L.global_batch, "seq_len": L.seq_len,
                "dtype": "float32",
                "mixed_precision_param": "float32" if L.dtype == ComputeDtype.FP32 else "bfloat16",
                "mixed_precision_reduce": "float32"}
    # Trainer.Config._validate_cuda_graphs: "CUDA graphs do not support pipeline
    # parallelism", nor expert parallelism over the all-to-all token dispatcher the model
    # registries build ("CUDA graphs support only expert parallel token dispatcher
    # configurations without CPU synchronization")
    if pipelined or L.ep > 1:
        training["disable_cuda_graphs"] = True
    return {"training": training, "parallelism": par,
            "compile": {"enable": L.compiled, "enable_async_tensor_parallel": False,
                        "components": ["model", "loss"]},
            "ac": Recompute(L.recompute)}


def function_name(arch: ModelArch) -> str:
    """The config function meshplan writes for ``arch``: ``meshplan_`` + torchtitan's own."""
    return "meshplan_" + base_function(flavor_of(arch))


def check_package_name(package: str) -> None:
    if not all(p.isidentifier() and not keyword.iskeyword(p) for p in package.split(".")):
        raise SpecError(f"torchtitan package {package!r}: torchrun imports it as a Python "
                        "module (--module PACKAGE); name it with letters, digits and _")


def to_torchtitan(layout: StackLayout, arch: ModelArch, *, package: str = "meshplan_job") -> str:
    """``PACKAGE/config_registry.py`` for torchtitan 0.3.0: a function ``meshplan_<model>()``
    that returns torchtitan's own ``<model>()`` Trainer.Config with what the plan decides set
    on it. NotSupportedError (one line) for a plan torchtitan 0.3.0 cannot express."""
    check_package_name(package)
    cfg = _settings(layout, arch)
    flavor = flavor_of(arch)
    base = base_function(flavor)
    module = f"torchtitan.models.{flavor.name}.config_registry"
    fn = function_name(arch)
    acs = AC_CLASSES
    imports = [f"from {module} import {base}", "from torchtitan.trainer import Trainer"]
    if acs[cfg["ac"]]:
        imports.insert(0, f"from torchtitan.distributed.activation_checkpoint import "
                          f"{acs[cfg['ac']]}")
    body = [f"config = {base}()"]
    if base in WITHOUT_FLOAT8:
        # torchtitan's function converts its model to float8 rowwise while building the
        # config (torchao and an SM89+ GPU needed); the plan is not fp8: build from the
        # nearest function without a converter and set the rest of its settings
        twin, lines, extra = WITHOUT_FLOAT8[base]
        imports = [f"from {module} import {twin}", *extra, imports[-1]] + imports[:-2]
        imports.append(f"from torchtitan.models.{flavor.name} import model_registry")
        body = [f"config = {twin}()  # {base}() but its float8 rowwise converter (the plan "
                "is not fp8)", f"config.model_spec = model_registry({flavor.flavor!r})", *lines]
    for section in ("training", "parallelism", "compile"):
        body += [f"config.{section}.{k} = {v!r}" for k, v in cfg[section].items()]
    body.append("config.activation_checkpoint = " +
                (f"{acs[cfg['ac']]}.Config()" if acs[cfg["ac"]] else "None"))
    cli = torchtitan_command(layout, arch, package=package)
    lines = [f'"""torchtitan {TORCHTITAN_VERSION} config written by meshplan: {layout.words()} '
             f"on {layout.devices} devices.",
             "",
             f"    torchrun --nproc_per_node ... -m torchtitan.train --module {package} "
             f"--config {fn}",
             "",
             "The same job from torchtitan's own config and command-line overrides:" if
             cli.startswith("--") else "No override line for torchtitan's own config:",
             "",
             f"    {cli}",
             "",
             "Everything else (data set, tokenizer, optimizer, steps, checkpoints) is "
             f"{base}()'s; set",
             'it here or on the command line."""',
             "", *sorted(imports), "", "",
             f"def {fn}() -> Trainer.Config:",
             *[f"    {b}" for b in body],
             "    return config", ""]
    return "\n".join(lines)


def _flag(section: str, key: str, value) -> list[str]:
    name = f"--{section}.{key}"
    if isinstance(value, bool):
        return [name if value else f"--{section}.no_{key}"]
    if key == "module_fqns_per_model_part":  # list[list[str]]: chunks by spaces, names by commas
        return [name, *(",".join(part) for part in value)]
    if isinstance(value, list):
        return [name, ",".join(value)]
    return [name, str(value)]


def torchtitan_command(layout: StackLayout, arch: ModelArch, *,
                       package: str = "meshplan_job") -> str:
    """The plan as torchtitan's own config function plus tyro overrides (``--module llama3
    --config llama3_70b --parallelism.* ... activation-checkpoint:full``), or, where the
    command line cannot express it, one sentence saying why."""
    cfg = _settings(layout, arch)
    flavor = flavor_of(arch)
    base = base_function(flavor)
    if BASES_03[base].get("float8"):
        return (f"(none: {base}() converts the model to float8 rowwise in its model spec, which "
                f"torchtitan's command line cannot change; use --module {package} --config "
                f"{function_name(arch)})")
    words = ["--module", flavor.name, "--config", base]
    given = _base_values(base)  # only what differs from torchtitan's own function
    for section in ("training", "parallelism", "compile"):
        for k, v in cfg[section].items():
            if v != given[section][k]:
                words += _flag(section, k, v)
    if cfg["ac"] != given["ac"]:
        words.append(f"activation-checkpoint:{cfg['ac']}")
    return shlex.join(words)


# every key of the sections meshplan reads in a TOML job, as torchtitan 0.2.2's JobConfig dataclasses
# (torchtitan/config/job_config.py) declare them: a key outside is one torchtitan refuses
JOB_KEYS = {
    "model": ("converters", "flavor", "hf_assets_path", "name", "print_after_conversion",
              "tokenizer_path"),
    "training": ("dataloader", "dataset", "dataset_path", "dtype", "enable_cpu_offload",
                 "gc_debug", "gc_freq", "global_batch_size", "local_batch_size", "max_norm",
                 "mixed_precision_param", "mixed_precision_reduce", "seq_len", "steps"),
    "parallelism": ("context_parallel_degree", "context_parallel_load_balancer",
                    "context_parallel_rotate_method", "data_parallel_replicate_degree",
                    "data_parallel_shard_degree", "disable_loss_parallel",
                    "enable_async_tensor_parallel", "expert_parallel_comm_backend",
                    "expert_parallel_degree", "expert_tensor_parallel_degree",
                    "fsdp_reshard_after_forward", "module_fqns_per_model_part",
                    "pipeline_parallel_degree", "pipeline_parallel_expert_parallel_overlap",
                    "pipeline_parallel_first_stage_less_layers",
                    "pipeline_parallel_last_stage_less_layers",
                    "pipeline_parallel_layers_per_stage", "pipeline_parallel_microbatch_size",
                    "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
                    "tensor_parallel_degree"),
    "activation_checkpoint": ("debug", "determinism_check", "early_stop", "memory_budget",
                              "mode", "per_op_sac_force_recompute_mm_shapes_by_fqns",
                              "preserve_rng_state", "selective_ac_option",
                              "visualize_memory_budget_pareto"),
    "compile": ("backend", "components", "enable"),
    "float8": ("emulate", "enable_fsdp_float8_all_gather", "filter_fqns",
               "precompute_float8_dynamic_scale_for_fsdp", "recipe_name"),
}


def _get(doc: dict, section: str, key: str):
    table = doc
    for part in section.split("."):
        table = table.get(part, {}) if isinstance(table, dict) else {}
    defaults = DEFAULTS["float8" if section == "quantize.linear.float8" else section]
    if not isinstance(table, dict):
        return defaults[key]
    # a misspelt key would price torchtitan's default without a word (torchtitan refuses it)
    keys = JOB_KEYS["float8" if section == "quantize.linear.float8" else section]
    for given in table:
        if given not in keys and not isinstance(table[given], dict):
            close = difflib.get_close_matches(given, keys, n=1, cutoff=0.6)
            raise SpecError(f"torchtitan job config [{section}] {given}: not a torchtitan "
                            f"{TOML_VERSION} key" +
                            (f"; did you mean {close[0]}?" if close else ""))
    value, default = table.get(key, defaults[key]), defaults[key]
    want = next((t for t in (bool, str, int, float, list) if isinstance(default, t)), None)
    if key in table and want is not None and not isinstance(value, want) \
            and not (want is float and isinstance(value, int)):
        raise SpecError(f"torchtitan job config [{section}] {key} = {value!r}: expected "
                        f"{want.__name__} (torchtitan's default {default!r})")
    return value


def default_split(num_stages: int, num_layers: int, first_less: int, last_less: int):
    """Layers per stage as torchtitan 0.2.2 splits them without module_fqns_per_model_part
    (pipeline_parallel.py generate_llm_fqn_per_model_part): the embedding counts as
    ``first_less`` layers, norm + output as ``last_less``, and ``n_layers`` plus both are
    dealt out evenly, the remainder to the first stages."""
    if num_stages == 1:
        return (num_layers,)
    effective = num_layers + first_less + last_less
    per, extra = divmod(effective, num_stages)
    if per == 0 or first_less > per or last_less > per:
        raise SpecError(f"pipeline split of {num_layers} layers (+{first_less} +{last_less}) "
                        f"into {num_stages} stages: torchtitan refuses it (an empty stage, or "
                        "a first/last weight above the layers per stage); set "
                        "module_fqns_per_model_part")
    counts, left = [], num_layers
    for j in range(num_stages):
        n = per + (j < extra) - (first_less if j == 0 else 0) - \
            (last_less if j == num_stages - 1 else 0)
        n = max(0, min(n, left))
        counts.append(n)
        left -= n
    return tuple(counts)


def _split_of_fqns(parts: list, head: str) -> tuple[int, ...]:
    counts, expect = [], 0
    for j, part in enumerate(parts):
        layers = [p for p in part if p.startswith("layers.")]
        want = ["tok_embeddings"] * (j == 0) + [f"layers.{i}" for i in
                                                range(expect, expect + len(layers))]
        want += ["norm", head] * (j == len(parts) - 1)
        if list(part) != want:
            raise NotSupportedError(f"module_fqns_per_model_part chunk {j} "
                                    f"({', '.join(part[:3])}{', ...' * (len(part) > 3)}): meshplan "
                                    f"reads contiguous layers, the embedding first and norm + "
                                    f"{head} last; write the split in that form")
        counts.append(len(layers))
        expect += len(layers)
    return tuple(counts)


def config_form(text: str) -> str:
    """Which torchtitan configuration ``text`` is: "registry" (a 0.3 Python config module),
    "command" (0.3 ``--module M --config F`` overrides) or "toml" (a 0.2 job file)."""
    if "--module" in text and "--config" in text and "def " not in text:
        return "command"
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return "toml"
    return "registry" if any(isinstance(n, ast.FunctionDef) for n in tree.body) else "toml"


def from_torchtitan(text: str, *, devices: int | None = None,
                    function: str | None = None) -> tuple[StackLayout, ModelArch]:
    """The layout and model of a torchtitan configuration: a 0.3.0 config registry module
    (its ``meshplan_*`` function, or ``function``), a 0.3.0 command line (``--module llama3
    --config llama3_70b --parallelism.* ...``) or a 0.2.2 TOML job file. What it does not set
    takes the config function's value, then torchtitan's defaults; ``devices`` resolves
    ``data_parallel_shard_degree = -1``."""
    form = config_form(text)
    if form == "toml":
        return _from_toml(text, devices=devices)
    values = _read_registry(text, function) if form == "registry" else _read_command(text)
    return _from_values(values, devices)


# -- torchtitan 0.3.0: the Python form and the command line ------------------------------------

def _base_values(fn: str) -> dict:
    if fn not in BASES_03:
        raise NotSupportedError(f"torchtitan config function {fn!r}: meshplan reads the dense "
                                f"flavors' functions ({', '.join(BASES_03)}); build on one")
    base = BASES_03[fn]
    values = {s: dict(DEFAULTS_03[s], **base.get(s, {})) for s in DEFAULTS_03}
    values.update(flavor=base["flavor"], ac=base["ac"], float8=bool(base.get("float8")))
    return values


def _set(values: dict, section: str, key: str, value, where: str) -> None:
    if section not in DEFAULTS_03:
        return  # optimizer, data, checkpoints...: not the layout
    if key not in DEFAULTS_03[section]:
        known = [k for k in DEFAULTS_03[section]]
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:  # a near miss of a field meshplan reads would price the default silently
            raise SpecError(f"{where}: {section}.{key} is not a torchtitan "
                            f"{TORCHTITAN_VERSION} field; did you mean {close[0]}?")
        return
    default = DEFAULTS_03[section][key]
    if isinstance(default, bool) and not isinstance(value, bool) or \
            isinstance(default, int) and not isinstance(default, bool) and \
            not isinstance(value, int):
        raise SpecError(f"{where}: {section}.{key} = {value!r}: expected "
                        f"{type(default).__name__} (torchtitan's default {default!r})")
    values[section][key] = value


_AC_CLASSES = {"SelectiveAC": Recompute.SELECTIVE, "FullAC": Recompute.FULL}
_SECTION_CLASSES = {"TrainingConfig": "training", "ParallelismConfig": "parallelism",
                    "CompileConfig": "compile"}


def _read_registry(text: str, function: str | None) -> dict:
    """The settings of a config registry function: ``config = <torchtitan function>()``
    followed by assignments of literals to ``config.<section>.<field>`` (what meshplan
    writes, and what a person writes by hand)."""
    tree = ast.parse(text)
    fns = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if function is None:
        mine = [n for n in fns if n.startswith("meshplan_")]
        if len(mine) != 1:
            raise SpecError(f"torchtitan config module with functions {', '.join(fns) or 'none'}: "
                            "name the one to read (function=...)" if len(mine) != 1 else "")
        function = mine[0]
    if function not in fns:
        raise SpecError(f"torchtitan config function {function!r} is not in the module "
                        f"({', '.join(fns)})")
    where = f"torchtitan config {function}()"
    values = None
    for node in fns[function].body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # docstring
        if isinstance(node, ast.Return):
            break
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            raise NotSupportedError(f"{where}: line {node.lineno} is not an assignment; "
                                    "meshplan reads config = <torchtitan function>() and "
                                    "config.<section>.<field> = <value> lines")
        target, value = node.targets[0], node.value
        path = _attr_path(target)
        if path == ["config"]:
            if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
                raise NotSupportedError(f"{where}: line {node.lineno}: config must come from "
                                        "one of torchtitan's config functions")
            values = _base_values(value.func.id)
            continue
        if values is None or not path or path[0] != "config":
            raise NotSupportedError(f"{where}: line {node.lineno} comes before config = "
                                    "<torchtitan function>() or sets something else")
        _assign(values, path[1:], value, f"{where} line {node.lineno}")
    if values is None:
        raise NotSupportedError(f"{where}: no config = <torchtitan function>() line")
    return values


def _attr_path(node) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.insert(0, node.attr)
        node = node.value
    return [node.id, *out] if isinstance(node, ast.Name) else []


def _assign(values: dict, path: list[str], node, where: str) -> None:
    if path == ["activation_checkpoint"]:
        if isinstance(node, ast.Constant) and node.value is None:
            values["ac"] = Recompute.NONE
            return
        cls = _attr_path(node.func) if isinstance(node, ast.Call) else []
        if cls[-1:] != ["Config"] or cls[-2] not in _AC_CLASSES or node.args or node.keywords:
            raise NotSupportedError(f"{where}: activation_checkpoint {ast.unparse(node)}: "
                                    "meshplan prices None, SelectiveAC.Config() and "
                                    "FullAC.Config()")
        values["ac"] = _AC_CLASSES[cls[-2]]
        return
    if path == ["model_spec"]:
        call = node if isinstance(node, ast.Call) else None
        if call is None or _attr_path(call.func)[-1:] != ["model_registry"] or \
                len(call.args) != 1 or call.keywords:
            raise NotSupportedError(f"{where}: model_spec {ast.unparse(node)}: meshplan reads "
                                    "model_registry(FLAVOR) of a dense flavor, no converters or "
                                    "attention backend")
        values["flavor"] = (values["flavor"][0], ast.literal_eval(call.args[0]))
        values["float8"] = False
        return
    if len(path) == 1 and path[0] in DEFAULTS_03:
        call = node if isinstance(node, ast.Call) else None
        if call is None or _attr_path(call.func)[-1:] != [_cls_of(path[0])] or call.args:
            raise NotSupportedError(f"{where}: {path[0]} = {ast.unparse(node)}: write "
                                    f"{_cls_of(path[0])}(field=value, ...)")
        values[path[0]] = dict(DEFAULTS_03[path[0]])
        for kw in call.keywords:
            _set(values, path[0], kw.arg, _literal(kw.value, where), where)
        return
    if len(path) == 2:
        _set(values, path[0], path[1], _literal(node, where), where)


def _cls_of(section: str) -> str:
    return next(c for c, s in _SECTION_CLASSES.items() if s == section)


def _literal(node, where: str):
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise NotSupportedError(f"{where}: {ast.unparse(node)} is not a literal; meshplan reads "
                                "numbers, strings, booleans and lists") from None


def _read_command(text: str) -> dict:
    """The settings of ``--module M --config F [--section.field VALUE ...]
    [activation-checkpoint:NAME]`` (the first line holding --module; torchrun's own words
    before it are skipped)."""
    line = next(ln for ln in text.splitlines() if "--module" in ln)
    words = shlex.split(line, comments=True)
    words = words[words.index("--module"):]
    module = fn = None
    values, i = None, 0
    pending = []
    while i < len(words):
        w = words[i]
        if w in ("--module", "--config") or w.startswith(("--module=", "--config=")):
            val = w.split("=", 1)[1] if "=" in w else words[i + 1]
            i += 1 if "=" in w else 2
            module, fn = (val, fn) if w.startswith("--module") else (module, val)
            continue
        pending.append(w)
        i += 1
    if module is None or fn is None:
        raise SpecError("torchtitan command line: needs --module and --config")
    if module.split(".")[-1] not in ("llama3", "qwen3", "deepseek_v3") and module not in (
            "torchtitan.models.llama3", "torchtitan.models.qwen3",
            "torchtitan.models.deepseek_v3"):
        raise NotSupportedError(f"torchtitan --module {module}: meshplan reads torchtitan's "
                                "llama3 and qwen3 config registries (a module of your own: read "
                                "its config_registry.py instead)")
    values = _base_values(fn)
    i = 0
    while i < len(pending):
        w = pending[i]
        if w.startswith("activation-checkpoint:") or w.startswith("activation_checkpoint:"):
            name = w.split(":", 1)[1]
            if name not in AC_CLASSES:
                raise NotSupportedError(f"torchtitan {w}: meshplan prices none, selective and "
                                        "full")
            values["ac"] = Recompute(name)
            i += 1
            continue
        if not w.startswith("--") or "." not in w:
            raise SpecError(f"torchtitan command line: {w!r} is not --section.field")
        name, eq, given = w[2:].partition("=")
        section, key = name.replace("-", "_").split(".", 1)
        default = DEFAULTS_03.get(section, {}).get(key.removeprefix("no_"))
        if isinstance(default, bool) and not eq:  # a flag: --x.f / --x.no_f
            _set(values, section, key.removeprefix("no_"), not key.startswith("no_"), w)
            i += 1
            continue
        args = [given] if eq else []
        i += 1
        while not eq and i < len(pending) and not pending[i].startswith("--") and \
                ":" not in pending[i]:
            args.append(pending[i])
            i += 1
        _set(values, section, key, _cli_value(default, args, w), w)
    return values


def _cli_value(default, args: list[str], where: str):
    if key_is_split := (default is None and args and "," in "".join(args) or len(args) > 1):
        return [a.split(",") for a in args] if key_is_split else args
    if not args:
        raise SpecError(f"torchtitan {where}: needs a value")
    a = args[0]
    if isinstance(default, bool):
        return {"true": True, "false": False}.get(a.lower(), a)
    if isinstance(default, int) or default is None and a.lstrip("-").isdigit():
        try:
            return int(a)
        except ValueError:
            raise SpecError(f"torchtitan {where} {a}: expected an integer") from None
    if isinstance(default, list):
        return a.split(",")
    return None if a == "None" else a


def _from_values(values: dict, devices: int | None) -> tuple[StackLayout, ModelArch]:
    arch = FLAVORS.get(values["flavor"])
    if arch is None:
        raise SpecError(f"torchtitan flavor {values['flavor'][0]} {values['flavor'][1]!r}: not "
                        f"one of the dense flavors meshplan reads ({_flavor_names()})")
    if values["float8"]:
        raise NotSupportedError("float8 rowwise (the config function's Float8LinearConverter): "
                                "meshplan prices tensorwise fp8 with fp8 all-gather, which "
                                f"torchtitan {TORCHTITAN_VERSION} does not run; set "
                                f"config.model_spec = model_registry({values['flavor'][1]!r})")
    if values["compile"]["enable_async_tensor_parallel"]:
        raise NotSupportedError("compile.enable_async_tensor_parallel: meshplan does not price "
                                "async TP's overlap; set it False to price the run")

    def g(section, key):
        if section == "activation_checkpoint":
            return {"mode": values["ac"], "selective_ac_option": "op"}[key]
        if section == "model":
            return []  # converters: float8 refused above
        return values[section][key]

    return _layout(g, arch, devices, head="lm_head",
                   sp=values["parallelism"]["enable_sequence_parallel"])


# -- torchtitan 0.2.2: TOML job files -----------------------------------------------------------

def _from_toml(text: str, *, devices: int | None = None) -> tuple[StackLayout, ModelArch]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"torchtitan job config: not TOML, nor a 0.3 config module or "
                        f"command line ({exc})") from None
    g = lambda section, key: _get(doc, section, key)  # noqa: E731
    name, flavor = g("model", "name"), g("model", "flavor")
    arch = FLAVORS.get((name, flavor))
    if arch is None:
        raise SpecError(f"torchtitan model {name!r} flavor {flavor!r}: not one of torchtitan "
                        f"{TOML_VERSION}'s dense flavors ({_flavor_names()}); give one of "
                        "these or plan the model from its transformers spec")
    return _layout(g, arch, devices, head="output", sp=True)


def _layout(g, arch: ModelArch, devices: int | None, *, head: str,
            sp: bool) -> tuple[StackLayout, ModelArch]:
    P = "parallelism"
    rep, shard = g(P, "data_parallel_replicate_degree"), g(P, "data_parallel_shard_degree")
    tp, cp, pp = g(P, "tensor_parallel_degree"), g(P, "context_parallel_degree"), \
        g(P, "pipeline_parallel_degree")
    if shard == -1:
        if devices is None:
            raise SpecError("data_parallel_shard_degree = -1 takes the devices left over: pass "
                            "the device count (--devices / the mesh)")
        shard = devices // (rep * tp * cp * pp)
    if devices is not None and rep * shard * tp * cp * pp != devices:
        raise SpecError(f"replicate {rep} x shard {shard} x tp {tp} x cp {cp} x pp {pp} != "
                        f"{devices} devices (torchtitan's ParallelDims check); fix the degrees")
    unsupported = [
        (rep > 1 and shard > 1, f"HSDP (replicate {rep} x shard {shard}): meshplan's layouts "
                                "shard over all of dp; use one of the two"),
        (g(P, "expert_parallel_degree") > 1 and not arch.experts,
         "expert_parallel_degree > 1 for a dense model (it has no effect there); set 1"),
        (bool(g(P, "pipeline_parallel_schedule_csv")), "a pipeline schedule from a csv file"),
        (g("training", "enable_cpu_offload"), "FSDP CPU offload"),
        (g("training", "dtype") != "float32", "training.dtype bfloat16 (no fp32 master "
                                              "weights); meshplan prices mixed precision"),
        (cp > 1 and g(P, "context_parallel_load_balancer") != "headtail",
         "context parallelism without the head-tail load balancer (meshplan prices it)"),
    ]
    for bad, what in unsupported:
        if bad:
            raise NotSupportedError(f"torchtitan config: {what}; not expressible as a meshplan "
                                    "layout")
    fsdp = shard * cp > 1
    if fsdp:
        reshard = g(P, "fsdp_reshard_after_forward")
        zero = {"always": 3, "never": 2}.get(reshard, 2 if pp > 1 else 3)
    else:
        zero = 0
    dp = rep * shard
    local = g("training", "local_batch_size")
    global_batch = g("training", "global_batch_size")
    global_batch = local * dp if global_batch < 0 else global_batch
    seq_len = g("training", "seq_len")
    schedule, v, mb, stage_layers = Schedule.ONE_F_ONE_B, 1, local, ()
    if pp > 1:
        schedule, v, mb, stage_layers = _pipeline_of(g, pp, arch, local, global_batch // dp,
                                                     head)
    layout = StackLayout(dp=dp, tp=tp, cp=cp, pp=pp, schedule=schedule, virtual_stages=v,
                         microbatch_size=mb, global_batch=global_batch, seq_len=seq_len,
                         recompute=_recompute_of(g), sequence_parallel=tp > 1 and sp,
                         zero=zero, dtype=_dtype_of(g),
                         compiled=bool(g("compile", "enable") and
                                       "model" in g("compile", "components")),
                         stage_layers=stage_layers, ep=_ep_of(g, arch, shard * cp * tp))
    if stage_layers and replace(layout, stage_layers=()).layers_per_chunk(arch.layers) == \
            stage_layers:
        layout = replace(layout, stage_layers=())
    return layout, arch


def _ep_of(g, arch: ModelArch, borrowed: int) -> int:
    """parallelism.expert_parallel_degree, checked as torchtitan checks it."""
    ep = g("parallelism", "expert_parallel_degree")
    if ep < 1 or (ep > 1 and (borrowed % ep or arch.experts % ep)):
        raise SpecError(f"expert_parallel_degree {ep}: must divide the {arch.experts} experts "
                        f"and dp_shard x cp x tp = {borrowed} (torchtitan borrows the "
                        "expert-parallel ranks from FSDP and TP)")
    return ep


def _pipeline_of(g, pp: int, arch: ModelArch, local: int, per_rank: int, head: str):
    P = "parallelism"
    names = {k.lower(): k for k in SCHEDULE_NAMES.values()}
    given = g(P, "pipeline_parallel_schedule")
    if given.lower() not in names:
        raise NotSupportedError(f"pipeline schedule {given!r}: meshplan prices "
                                f"{', '.join(SCHEDULE_NAMES.values())}; choose one of these")
    schedule = {v: k for k, v in SCHEDULE_NAMES.items()}[names[given.lower()]]
    if local != per_rank:
        raise NotSupportedError(f"local_batch_size {local} with pp={pp} and "
                                f"{per_rank // local} gradient accumulation steps: meshplan's "
                                "layout runs the whole per-rank batch through one pipeline "
                                f"flush; set local_batch_size = {per_rank}")
    fqns = g(P, "module_fqns_per_model_part")
    multi = schedule == Schedule.INTERLEAVED
    if fqns is not None:
        counts = _split_of_fqns(fqns, head)
        if sum(counts) != arch.layers:
            raise NotSupportedError(f"module_fqns_per_model_part places {sum(counts)} of the "
                                    f"{arch.layers} layers (torchtitan drops the others); "
                                    "list every layer once")
    else:
        first, last = g(P, "pipeline_parallel_first_stage_less_layers"), \
            g(P, "pipeline_parallel_last_stage_less_layers")
        per = g(P, "pipeline_parallel_layers_per_stage")
        stages = math.ceil((arch.layers + first + last) / per) if per else pp * (2 if multi else 1)
        counts = default_split(stages, arch.layers, first, last)
    if len(counts) % pp or (len(counts) // pp != 1) != multi or (multi and len(counts) < 2 * pp):
        raise NotSupportedError(f"{len(counts)} pipeline chunks on pp={pp} with {given}: "
                                "torchtitan runs one per rank for GPipe/1F1B, >= 2 per rank for "
                                "Interleaved1F1B; fix the split")
    return schedule, len(counts) // pp, g(P, "pipeline_parallel_microbatch_size"), counts


def _recompute_of(g) -> str:
    mode = g("activation_checkpoint", "mode")
    option = str(g("activation_checkpoint", "selective_ac_option"))
    if mode == Recompute.SELECTIVE and option == "1":
        return Recompute.FULL  # every block checkpointed whole (_apply_layer_sac, ac_freq 1)
    if mode == Recompute.SELECTIVE and option != "op":
        raise NotSupportedError(f"activation_checkpoint selective_ac_option {option!r} (every "
                                f"{option}th block): meshplan's layouts recompute every block "
                                "alike; use 'op', mode 'full' or 'none'")
    if mode not in RECOMPUTE:  # torchtitan's mode names are meshplan's
        raise NotSupportedError(f"activation_checkpoint mode {mode!r}: meshplan prices none, "
                                "selective (op) and full; use one of these")
    return mode


def _dtype_of(g) -> str:
    converters = g("model", "converters")
    converters = converters.split(",") if isinstance(converters, str) else list(converters)
    if "float8" in converters:
        raise NotSupportedError(f"model.converters 'float8': torchtitan {TOML_VERSION} "
                                f"registers the float8 converter as {FLOAT8!r} (building "
                                f"'float8' fails with a KeyError); write {FLOAT8!r}")
    if FLOAT8 not in converters:
        return ComputeDtype.FP32 if g("training", "mixed_precision_param") == "float32" else ComputeDtype.BF16
    section = "quantize.linear.float8"
    if g(section, "recipe_name") not in (None, "tensorwise") or \
            not g(section, "enable_fsdp_float8_all_gather"):
        raise NotSupportedError("float8 other than tensorwise with fp8 all-gather: meshplan "
                                "prices torchtitan's float8 as tensorwise with "
                                "enable_fsdp_float8_all_gather; set those")
    return ComputeDtype.FP8
