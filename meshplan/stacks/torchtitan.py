"""A plan as a torchtitan job: the TOML file ``torchtitan.train`` reads, and back.

plan -> ``layout_of`` -> **to_torchtitan** -> job.toml -> ``torchrun -m torchtitan.train``;
job.toml -> **from_torchtitan** -> ``StackLayout`` -> ``manual_plan`` -> estimate.

Written for torchtitan 0.2.2, the last release whose jobs are TOML files read by
``torchtitan.config.ConfigManager`` (0.3.0 moved to Python config registries with CLI
overrides). ``problems`` states what torchtitan 0.2.2 runs, read from its own code (paths
relative to its package):

- data parallel: FSDP2 over ``dp_shard x cp`` (``distributed/parallel_dims.py``: "we always
  assume that when cp is used, FSDP is also applied") is ZeRO-3, or ZeRO-2 with
  ``fsdp_reshard_after_forward = "never"`` (``apply_fsdp``; its "default" reshards without a
  pipeline and keeps the gathered weights with one); DDP (``data_parallel_replicate_degree``)
  is ZeRO-0 and only alone (``apply_ddp``: "DDP has not supported > 1D parallelism"); no
  ZeRO-1. Mixed precision goes through ``fully_shard`` (bf16 parameters, fp32 reduce), or
  autocast under DDP / one device; with TP or PP but no FSDP it is off
  (``distributed/utils.py maybe_enable_amp``).
- tensor parallel: ``apply_tp`` always shards the norms over the sequence (SequenceParallel)
  and splits wq/wk/wv by heads; ``seq_len`` must divide by ``tp x 2 x cp``
  (``ParallelDims.seq_len_divisor``, asserted in ``parallelize_llama``).
- context parallel: SDPA with the head-tail load balancer (the default flavors; FlexAttention
  flavors take "ptrr"), sharding over ``cp`` ranks.
- pipeline: ``get_schedule_class`` names (GPipe, 1F1B single-stage; Interleaved1F1B with
  >= 2 stages per rank, looped: stage j on rank j % pp); the split as
  ``module_fqns_per_model_part`` (exact; without it ``generate_llm_fqn_per_model_part``
  splits ``n_layers + first/last_stage_less_layers`` evenly); qwen3 has no pipelining.
- fp8: the ``quantize.linear.float8`` converter, tensorwise, weights all-gathered in fp8,
  output head left in bf16 (as ``costmodel/fp8.py`` and the torchtitan engine profile price
  it); activation checkpointing none / selective per op / full; ``[compile]``.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from dataclasses import replace

from meshplan.errors import MeshplanError, NotSupportedError, SpecError
from meshplan.stacks.arch import ModelArch
from meshplan.stacks.layout import StackLayout
from meshplan.stacks.torchtitan_flavors import (DEFAULTS, FLAVORS, PIPELINED, _flavor_names,
                                                 flavor_of)
from meshplan.schedules import Schedule
from meshplan.vocabulary import RECOMPUTE, ComputeDtype, Recompute

TORCHTITAN_VERSION = "0.2.2"
FLOAT8 = "quantize.linear.float8"  # registered name (components/quantization/float8.py)
SCHEDULE_NAMES = {Schedule.GPIPE: "GPipe", Schedule.ONE_F_ONE_B: "1F1B", Schedule.INTERLEAVED: "Interleaved1F1B"}


def problems(layout: StackLayout, arch: ModelArch) -> tuple[str, ...]:
    """What torchtitan 0.2.2 cannot run of ``layout`` for ``arch``, one line each.

    The model's own dimensions are not checked here (``plan --for torchtitan`` prices any
    Llama / Qwen3): ``to_torchtitan`` refuses a model that matches none of torchtitan's
    flavors (``flavor_problem``)."""
    out = []
    L, dpcp = layout, layout.dp * layout.cp
    if L.zero == 1:
        out.append("zero=1 (optimizer state only): torchtitan shards with FSDP2 (ZeRO-3, or "
                   "ZeRO-2 with fsdp_reshard_after_forward='never') or replicates with DDP; "
                   "re-plan with zero=2 or 3 (meshplan plan --for torchtitan)")
    if L.zero == 0 and L.cp > 1:
        out.append(f"zero=0 with cp={L.cp}: torchtitan always applies FSDP over dp_shard x cp "
                   "when cp > 1; re-plan with zero=3 (or 2)")
    elif L.zero == 0 and L.dp > 1 and L.tp * L.pp > 1:
        out.append(f"zero=0 (DDP) over dp={L.dp} with tp={L.tp}, pp={L.pp}: torchtitan's "
                   "apply_ddp refuses DDP beside other parallelisms ('DDP has not supported > "
                   "1D parallelism'); re-plan with zero=3 (or 2)")
    if L.zero in (2, 3) and dpcp == 1:
        out.append(f"zero={L.zero} over dp x cp = 1: torchtitan applies FSDP only when "
                   "dp_shard x cp > 1, so nothing is sharded; set zero=0 (the same run)")
    if L.dtype != ComputeDtype.FP32 and dpcp == 1 and L.tp * L.pp > 1:
        out.append(f"dtype {L.dtype} with dp x cp = 1 and tp={L.tp}, pp={L.pp}: torchtitan "
                   "applies mixed precision through fully_shard, and disables it under TP/PP "
                   "without FSDP (maybe_enable_amp); use dp or cp > 1 with zero=3, or fp32")
    if L.tp > 1 and not L.sequence_parallel:
        out.append(f"tp={L.tp} without sequence parallelism: torchtitan's apply_tp always "
                   "shards the norms over the sequence; set sequence_parallel=True")
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
    return tuple(out)


def flavor_problem(arch: ModelArch) -> str | None:
    """One line when ``arch`` matches none of torchtitan 0.2.2's flavors, else None."""
    if flavor_of(arch) is not None:
        return None
    return (f"model {arch.words()}: matches no torchtitan {TORCHTITAN_VERSION} flavor "
            f"({_flavor_names()}); torchtitan builds models from its flavor tables only: "
            "plan a model with one of these dimensions, or add a flavor to torchtitan")


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


def _fqns(counts: tuple[int, ...]) -> list[list[str]]:
    parts, start = [], 0
    for j, n in enumerate(counts):
        part = ["tok_embeddings"] if j == 0 else []
        part += [f"layers.{i}" for i in range(start, start + n)]
        part += ["norm", "output"] if j == len(counts) - 1 else []
        parts.append(part)
        start += n
    return parts


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if value and isinstance(value[0], list):  # the split: one chunk a line
        return "[\n" + "".join(f"  {_toml(v)},\n" for v in value) + "]"
    return "[" + ", ".join(_toml(v) for v in value) + "]"


def to_torchtitan(layout: StackLayout, arch: ModelArch) -> str:
    """torchtitan 0.2.2 TOML job config of ``layout``; NotSupportedError with the first of
    ``problems`` when torchtitan cannot run it."""
    found = (flavor_problem(arch),) + problems(layout, arch)
    if any(found):
        raise NotSupportedError(next(p for p in found if p))
    L, flavor = layout, flavor_of(arch)
    fsdp = L.zero in (2, 3)
    pipelined = L.pp > 1
    if L.zero == 3:
        reshard = "always" if pipelined else "default"
    else:
        reshard = "never" if fsdp else "default"
    local = L.global_batch // L.dp if pipelined else L.microbatch_size
    sections = {
        "job": {"description": f"meshplan plan {L.words()}, written for torchtitan "
                               f"{TORCHTITAN_VERSION}"},
        "model": {"name": flavor.name, "flavor": flavor.flavor}
        | ({"converters": [FLOAT8]} if L.dtype == ComputeDtype.FP8 else {}),
        "training": {"local_batch_size": local, "global_batch_size": L.global_batch,
                     "seq_len": L.seq_len, "dtype": "float32",
                     "mixed_precision_param": "float32" if L.dtype == ComputeDtype.FP32 else "bfloat16",
                     "mixed_precision_reduce": "float32"},
        "parallelism": {"data_parallel_replicate_degree": 1 if fsdp else L.dp,
                        "data_parallel_shard_degree": L.dp if fsdp else 1,
                        "fsdp_reshard_after_forward": reshard,
                        "tensor_parallel_degree": L.tp, "context_parallel_degree": L.cp}
        | ({"context_parallel_load_balancer": "headtail"} if L.cp > 1 else {})
        | {"pipeline_parallel_degree": L.pp}
        | ({"pipeline_parallel_schedule": SCHEDULE_NAMES[L.schedule],
            "pipeline_parallel_microbatch_size": L.microbatch_size,
            "module_fqns_per_model_part": _fqns(L.layers_per_chunk(arch.layers))}
           if pipelined else {}),
        "activation_checkpoint": {"mode": L.recompute}
        | ({"selective_ac_option": "op"} if L.recompute == Recompute.SELECTIVE else {}),
        "compile": {"enable": L.compiled, "components": ["model", "loss"]},
    }
    if L.dtype == ComputeDtype.FP8:  # the plan's recipe (costmodel/fp8.py TORCHAO_RECIPES)
        gather = L.fp8_recipe in ("", "tensorwise-fp8-all-gather")
        sections["quantize.linear.float8"] = (
            {"recipe_name": "rowwise"} if L.fp8_recipe == "rowwise" else {}) | {
            "enable_fsdp_float8_all_gather": gather,
            "precompute_float8_dynamic_scale_for_fsdp": gather, "filter_fqns": ["output"]}
    lines = [f"# torchtitan {TORCHTITAN_VERSION} job config written by meshplan "
             f"({L.devices} devices: torchrun --nproc_per_node ... -m torchtitan.train "
             "--job.config_file THIS_FILE).",
             "# torchtitan >= 0.3 reads Python config registries, not TOML: port the keys "
             "below by hand."]
    for name, keys in sections.items():
        lines += ["", f"[{name}]"] + [f"{k} = {_toml(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


# every key of the sections meshplan reads, as torchtitan 0.2.2's JobConfig dataclasses
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
                            f"{TORCHTITAN_VERSION} key" +
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


def _split_of_fqns(parts: list) -> tuple[int, ...]:
    counts, expect = [], 0
    for j, part in enumerate(parts):
        layers = [p for p in part if p.startswith("layers.")]
        want = ["tok_embeddings"] * (j == 0) + [f"layers.{i}" for i in
                                                range(expect, expect + len(layers))]
        want += ["norm", "output"] * (j == len(parts) - 1)
        if list(part) != want:
            raise NotSupportedError(f"module_fqns_per_model_part chunk {j} "
                                    f"({', '.join(part[:3])}{', ...' * (len(part) > 3)}): meshplan "
                                    "reads contiguous layers, the embedding first and norm + "
                                    "output last; write the split in that form")
        counts.append(len(layers))
        expect += len(layers)
    return tuple(counts)


def from_torchtitan(text: str, *, devices: int | None = None) -> tuple[StackLayout, ModelArch]:
    """The layout and model of a torchtitan 0.2.2 TOML job config; keys it lacks take
    torchtitan's JobConfig defaults. ``devices`` resolves ``data_parallel_shard_degree = -1``."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"torchtitan job config: not TOML ({exc})") from None
    g = lambda section, key: _get(doc, section, key)  # noqa: E731
    name, flavor = g("model", "name"), g("model", "flavor")
    arch = FLAVORS.get((name, flavor))
    if arch is None:
        raise SpecError(f"torchtitan model {name!r} flavor {flavor!r}: not one of torchtitan "
                        f"{TORCHTITAN_VERSION}'s dense flavors ({_flavor_names()}); give one of "
                        "these or plan the model from its transformers spec")
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
        (g(P, "expert_parallel_degree") > 1, "expert parallelism: the export covers dense models"),
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
        schedule, v, mb, stage_layers = _pipeline_of(g, pp, arch, local, global_batch // dp)
    layout = StackLayout(dp=dp, tp=tp, cp=cp, pp=pp, schedule=schedule, virtual_stages=v,
                         microbatch_size=mb, global_batch=global_batch, seq_len=seq_len,
                         recompute=_recompute_of(g), sequence_parallel=tp > 1, zero=zero,
                         dtype=_dtype_of(g), compiled=bool(g("compile", "enable") and
                                                           "model" in g("compile", "components")),
                         stage_layers=stage_layers)
    if stage_layers and replace(layout, stage_layers=()).layers_per_chunk(arch.layers) == \
            stage_layers:
        layout = replace(layout, stage_layers=())
    return layout, arch


def _pipeline_of(g, pp: int, arch: ModelArch, local: int, per_rank: int):
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
        counts = _split_of_fqns(fqns)
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
        raise NotSupportedError("model.converters 'float8': torchtitan 0.2.2 registers the "
                                f"float8 converter as {FLOAT8!r} (building 'float8' fails with "
                                f"a KeyError); write {FLOAT8!r}")
    if FLOAT8 not in converters:
        return ComputeDtype.FP32 if g("training", "mixed_precision_param") == "float32" else ComputeDtype.BF16
    section = "quantize.linear.float8"
    if g(section, "recipe_name") not in (None, "tensorwise") or \
            not g(section, "enable_fsdp_float8_all_gather"):
        raise NotSupportedError("float8 other than tensorwise with fp8 all-gather: meshplan "
                                "prices torchtitan's float8 as tensorwise with "
                                "enable_fsdp_float8_all_gather; set those")
    return ComputeDtype.FP8
