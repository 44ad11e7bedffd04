"""Megatron-LM / NeMo: a ``StackLayout`` as ``pretrain_gpt.py`` arguments and NeMo 2 recipe
overrides, and back.

plan -> ``layout_of`` -> **to_megatron** (one ``--flag value`` a line) / **nemo_overrides**;
an argument list -> **from_megatron** -> (StackLayout, ModelArch) -> ``manual_plan`` -> estimate.
``problems`` is Megatron-LM's contract, one line per breach (the value, the rule, the fix);
export refuses a layout with any. Flag names are Megatron-LM main's (``MEGATRON_LM_MAIN``:
every flag written is in ``megatron_flags.txt``, the parser's flags at that commit, written by
tools/megatron_flags.py); defaults and rules are those of megatron-core 0.16.1 (tag
``core_v0.16.1``: ``megatron/training/arguments.py``, ``megatron/core/transformer/
transformer_config.py``, ``transformer_block.get_num_layers_to_build``,
``pipeline_parallel/schedules.py``), the installable release (0.17 and later need Python
>= 3.12), whose defaults main keeps for every flag read here. Import also reads the older
spellings ``OLD_SPELLINGS`` names.

What is written is what meshplan's ``megatron`` engine profile prices
(``costmodel/runtime_profiles.py`` ``megatron_runtime``): the distributed optimizer for ZeRO-1
(sharded over dp x cp), overlapped gradient reduce and parameter all-gather, cuDNN fused
attention (Transformer Engine's FusedAttention: ``--attention-backend fused``), context
parallelism in a ring of send/recv (``--cp-comm-type p2p``), TP communication overlap
(Megatron takes it only with sequence parallelism), fp8 as Transformer Engine's current
scaling (``--fp8-format hybrid --fp8-recipe tensorwise``; costmodel/fp8.py ``te-current``).
Mixtures of experts: grouped GEMM experts, the all-to-all token dispatcher, expert
parallelism over ``ep`` ranks of dp x cp x tp with each expert whole
(``--expert-tensor-parallel-size 1``: Megatron-Core's MoE parallel folding), and the router
the model's transformers config describes (score function, top-k renormalization, scaling,
group-limited routing).
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import replace

from meshplan.errors import MeshplanError, NotSupportedError, SpecError
from meshplan.stacks.arch import ModelArch
from meshplan.stacks.layout import StackLayout
from meshplan.schedules import Schedule
from meshplan.vocabulary import ComputeDtype, Recompute

MEGATRON_VERSION = "0.16.1"  # megatron-core on PyPI = Megatron-LM tag core_v0.16.1
MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"  # tag core_v0.16.1
# Megatron-LM main at the commit megatron_flags.txt lists the flags of (its header says so)
MEGATRON_LM_MAIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # 2026-08-22
FLAGS_FILE = "megatron_flags.txt"
# Older spellings import reads as today's (commit and date of the Megatron-LM change):
# --layernorm-epsilon became --norm-epsilon (4dc0715204, 2023-09-08); --fp8-e4m3 and
# --fp8-hybrid became --fp8-format e4m3 | hybrid (1b7a3836bc, 2023-08-24);
# --num-layers-per-virtual-pipeline-stage (layers per chunk; still taken) is read beside
# --num-virtual-stages-per-pipeline-rank, and --use-rotary-position-embeddings (deprecated,
# still taken) beside --position-embedding-type rope.
OLD_SPELLINGS = {"--layernorm-epsilon": ("--norm-epsilon", None),
                 "--fp8-e4m3": ("--fp8-format", "e4m3"), "--fp8-hybrid": ("--fp8-format", "hybrid")}
# flags older releases took that mean a layout meshplan does not price: refused by name
OLD_REFUSED = {"--moe-extended-tp": "--moe-extended-tp (core_v0.16.1, gone from main) splits "
               "each expert over tp x ep; meshplan keeps experts whole: write "
               "--expert-tensor-parallel-size 1 and --expert-model-parallel-size N"}
# the router settings each MoE family implies beyond its top-k (mixtral / qwen3_moe:
# transformers' router_aux_loss_coef default 0.001 with the standard auxiliary loss;
# deepseek_v3: the report's sequence-wise auxiliary loss alpha = 0.0001 and bias update speed
# gamma = 0.001, arXiv 2412.19437 sections 2.1.2 and 4.2)
ROUTER_LOSS = {"mixtral": [("--moe-router-load-balancing-type", "aux_loss"),
                           ("--moe-aux-loss-coeff", 0.001)],
               "qwen3_moe": [("--moe-router-load-balancing-type", "aux_loss"),
                             ("--moe-aux-loss-coeff", 0.001)],
               "deepseek_v3": [("--moe-router-load-balancing-type", "seq_aux_loss"),
                               ("--moe-aux-loss-coeff", 0.0001),
                               ("--moe-router-bias-update-rate", 0.001)]}


def megatron_flags() -> frozenset[str]:
    """Every flag Megatron-LM main takes at ``MEGATRON_LM_MAIN`` (megatron_flags.txt)."""
    from pathlib import Path

    text = (Path(__file__).with_name(FLAGS_FILE)).read_text(encoding="utf-8")
    return frozenset(ln.strip() for ln in text.splitlines() if ln.startswith("--"))


def problems(layout: StackLayout, arch: ModelArch) -> tuple[str, ...]:
    """Why Megatron-LM cannot run ``layout`` of ``arch`` as meshplan prices it; () when it can."""
    L, out = layout, []
    if L.compiled:
        out.append("compiled=True: Megatron-LM does not torch.compile its model (Transformer "
                   "Engine fuses its kernels instead); plan with compiled=False")
    if L.pp > 1 and L.schedule not in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED):
        out.append(f"schedule {L.schedule!r}: Megatron-LM pipelines with 1F1B or interleaved "
                   "1F1B only; plan with schedule='1f1b' or 'interleaved-1f1b'")
    if L.pp == 1 and L.schedule != Schedule.ONE_F_ONE_B:
        out.append(f"schedule {L.schedule!r} with pp=1: there is no pipeline to schedule; "
                   "use schedule='1f1b'")
    if L.pp > 1 and L.schedule == Schedule.INTERLEAVED:
        m = L.microbatches
        if L.virtual_stages < 2:
            out.append("interleaved-1f1b with virtual_stages=1 is Megatron's plain 1F1B; use "
                       "schedule='1f1b' or virtual_stages >= 2")
        elif m < L.pp or m % L.pp:  # schedules.py: microbatch groups of pp (the default)
            out.append(f"{m} microbatches per step with pp={L.pp}: Megatron's interleaved "
                       "schedule runs microbatches in groups of pp and needs a multiple of pp "
                       f"(at least {L.pp}); choose global batch / (dp x microbatch size) a "
                       f"multiple of {L.pp}")
    if L.zero > 1:
        out.append(f"zero={L.zero}: Megatron-LM shards optimizer state (--use-distributed-"
                   "optimizer, ZeRO-1); its FSDP paths are not what meshplan's megatron "
                   "profile prices; plan with zero=0 or 1, or export to torchtitan")
    if L.sequence_parallel and L.tp == 1:
        out.append("sequence_parallel with tp=1: Megatron-LM turns --sequence-parallel off "
                   "without tensor parallelism; plan with sequence_parallel=False or tp > 1")
    for what, n in (("num_attention_heads", arch.heads), ("num_query_groups", arch.kv_heads),
                    ("ffn_hidden_size", arch.ffn_hidden)):
        if n % L.tp:
            out.append(f"tp={L.tp} must divide {what}={n} (Megatron splits it over the tensor-"
                       "parallel ranks); choose tp in {" + ", ".join(
                           str(d) for d in range(1, n + 1) if n % d == 0 and d <= 64) + "}")
    if L.cp > 1 and L.seq_len % (2 * L.cp):
        out.append(f"seq_len={L.seq_len} with cp={L.cp}: Megatron splits the sequence into "
                   f"2 x cp chunks, seq_len must be a multiple of {2 * L.cp}")
    if L.sequence_parallel and (L.seq_len // L.cp) % L.tp:
        out.append(f"seq_len/cp={L.seq_len // L.cp} with tp={L.tp}: sequence parallelism "
                   "splits each rank's sequence over tp; make it a multiple of tp")
    if L.seq_len > arch.max_positions:
        out.append(f"seq_len={L.seq_len} > max_position_embeddings={arch.max_positions}: "
                   "Megatron-LM refuses it; train at most max_position_embeddings tokens")
    if not float(arch.rope_theta).is_integer():
        out.append(f"rope_theta={arch.rope_theta}: Megatron's --rotary-base takes an integer")
    try:
        _split_fields(L, arch.layers)
    except MeshplanError as exc:  # NotSupportedError, or manual.py's PlanningError
        out.append(str(exc))
    out += _moe_problems(L, arch)
    return tuple(out)


def _moe_problems(L: StackLayout, arch: ModelArch) -> list[str]:
    if not arch.experts:
        return [f"ep={L.ep} for a dense model: there are no experts to split; use ep=1"] \
            if L.ep > 1 else []
    out = []
    if L.ep > 1 and L.tp > 1 and not L.sequence_parallel:  # model_parallel_config.py
        out.append(f"ep={L.ep} with tp={L.tp} without sequence parallelism: Megatron-Core says "
                   "'When using expert parallelism and tensor parallelism for training, "
                   "sequence parallelism must be used'; plan with sequence_parallel=True")
    if arch.experts % L.ep:  # arguments.py validate_args
        out.append(f"ep={L.ep} must divide the {arch.experts} experts (Megatron-LM: 'Number of "
                   "experts should be a multiple of expert model parallel_size')")
    if arch.family == "deepseek_v3" and not arch.norm_topk and arch.top_k > 1:
        out.append("norm_topk_prob=False with DeepSeek-V3's sigmoid router: Megatron-Core "
                   "always renormalizes sigmoid top-k scores (moe_utils.py); set "
                   "norm_topk_prob=True")
    if arch.family == "mixtral" and (arch.router_scale != 1 or arch.router_groups > 1):
        out.append("a scaled or group-limited router on Mixtral: transformers' Mixtral has "
                   "neither")
    if arch.router_groups > 1 and (arch.experts % arch.router_groups or
                                   not 1 <= arch.router_group_topk <= arch.router_groups):
        out.append(f"{arch.router_groups} expert groups (top {arch.router_group_topk}) for "
                   f"{arch.experts} experts: the groups must split the experts evenly")
    return out


def _check(layout: StackLayout, arch: ModelArch) -> None:
    found = problems(layout, arch)
    if found:
        raise NotSupportedError(found[0])


# --- the layer split -------------------------------------------------------------------------

def chunks_of(num_layers: int, pp: int, vp: int | None, *, first: int | None = None,
              last: int | None = None, embedding: bool = False, loss: bool = False,
              pp_layout: str | None = None) -> tuple[int, ...]:
    """Blocks per model chunk (chunk j = virtual stage j // pp on rank j % pp) as Megatron-Core
    splits them (``transformer_block.get_num_layers_to_build``, ``pipeline_parallel_layer_layout``
    and ``TransformerConfig.__post_init__``); SpecError where Megatron refuses the arguments."""
    if pp_layout is not None:
        if first or last or embedding or loss:
            raise SpecError("--pipeline-model-parallel-layout cannot be set with the other "
                            "pipeline split arguments (Megatron-Core refuses it)")
        stages = _unroll(pp_layout).split("|")
        flat = "".join(stages)
        if len(stages) % pp or not flat.startswith("E") or not flat.endswith("L") or \
                flat.count("E") != 1 or flat.count("L") != 1 or set(flat) - set("EtL") or \
                flat.count("t") != num_layers:
            raise SpecError(f"--pipeline-model-parallel-layout {pp_layout!r}: needs a multiple "
                            f"of pp={pp} stages, E first, L last and {num_layers} t (no MTP)")
        return tuple(s.count("t") for s in stages)
    v = vp or 1
    if first is not None or last is not None:
        if embedding or loss:
            raise SpecError("--decoder-first/last-pipeline-num-layers cannot be set with "
                            "--account-for-embedding/loss-in-pipeline-split")
        ends = [n for n in (first, last) if n is not None]
        if any(n <= 0 or n % v for n in ends):
            raise SpecError(f"first/last stage layers {ends} must be positive multiples of the "
                            f"virtual stages {v}")
        rest, middle = num_layers - sum(ends), pp - len(ends)
        if bool(rest) != bool(middle) or (middle and (rest % middle or rest // middle % v)):
            raise SpecError(f"{rest} layers left for {middle} middle stages x {v} virtual "
                            "stages: Megatron needs an even split of them")
        per_rank = [rest // middle if middle else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return tuple(per_rank[j % pp] // v for j in range(pp * v))
    total = num_layers + embedding + loss
    if total % pp or total // pp % v:
        raise SpecError(f"{num_layers} layers{' + embedding' * embedding}{' + loss' * loss} "
                        f"do not split evenly over pp={pp} x {v} virtual stages")
    chunks = [total // pp // v] * (pp * v)
    chunks[0] -= embedding
    chunks[-1] -= loss
    if min(chunks) < 0:
        raise SpecError("not enough layers for the embedding/loss stage")
    return tuple(chunks)


def _unroll(text: str) -> str:
    """Expand ``(...)*n`` then ``x*n`` in a pipeline layout string, commas dropped."""
    text = text.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return text


def _split_fields(layout: StackLayout, num_layers: int) -> dict:
    """The Megatron split arguments that give ``layout.layers_per_chunk``: the even split, the
    embedding/loss accounting, first/last stage sizes, else an explicit layout string."""
    want = tuple(layout.layers_per_chunk(num_layers))
    pp = layout.pp
    v = layout.virtual_stages if layout.schedule == Schedule.INTERLEAVED and pp > 1 else None
    if len(want) != pp * (v or 1) or sum(want) != num_layers or min(want) < 0:
        raise NotSupportedError(f"stage_layers {want}: need {pp * (v or 1)} chunks of "
                                f"{num_layers} blocks in all; re-plan the split")
    if pp == 1:
        return {}
    per_rank = [sum(want[j] for j in range(r, len(want), pp)) for r in range(pp)]
    cands = [{}, {"embedding": True}, {"loss": True}, {"embedding": True, "loss": True}]
    middle = per_rank[1] if pp > 2 else None
    ends = {"first": per_rank[0] if per_rank[0] != middle else None,
            "last": per_rank[-1] if per_rank[-1] != middle or pp == 2 else None}
    cands.append({k: n for k, n in ends.items() if n is not None})
    for kw in cands:
        try:
            if chunks_of(num_layers, pp, v, **kw) == want:
                return {"vp": v, **kw}
        except SpecError:
            continue
    stages = [("E" if j == 0 else "") + (f"t*{n}" if n else "") + ("L" if j == len(want) - 1
                                                                  else "")
              for j, n in enumerate(want)]
    return {"vp": v, "pp_layout": "|".join(stages)}


# --- export ----------------------------------------------------------------------------------

def _vocab_divisor(vocab: int, tp: int) -> int:
    """--make-vocab-size-divisible-by that keeps ``vocab`` unpadded (Megatron pads the
    vocabulary to a multiple of it x tp; default 128): the largest power of two <= 128."""
    d = 128
    while d > 1 and vocab % (d * tp):
        d //= 2
    return d if vocab % (d * tp) == 0 else 128


def _header(layout: StackLayout, arch: ModelArch, what: str) -> list[str]:
    return [f"# meshplan -> {what}, Megatron-LM main ({MEGATRON_LM_MAIN[:10]}; Megatron-Core "
            f"{MEGATRON_VERSION}'s config classes accept it): {layout.words()}",
            f"# devices: {layout.devices}", f"# model: {arch.words()}"]


def to_megatron(layout: StackLayout, arch: ModelArch) -> str:
    """Megatron-LM ``pretrain_gpt.py`` arguments, one ``--flag [value]`` a line; the
    ``# devices: N`` header line is the launcher's world size (torchrun --nnodes x
    --nproc-per-node). NotSupportedError (one line) for a layout Megatron cannot run."""
    _check(layout, arch)
    L, a = layout, arch
    args: list[tuple[str, object]] = [
        ("--num-layers", a.layers), ("--hidden-size", a.hidden),
        ("--ffn-hidden-size", a.ffn_hidden), ("--num-attention-heads", a.heads)]
    if a.kv_heads != a.heads:
        args += [("--group-query-attention", None), ("--num-query-groups", a.kv_heads)]
    if a.family == "deepseek_v3":
        args += [("--multi-latent-attention", None), ("--q-lora-rank", a.q_lora_rank),
                 ("--kv-lora-rank", a.kv_lora_rank), ("--qk-head-dim", a.head_dim),
                 ("--qk-pos-emb-head-dim", a.qk_rope_dim), ("--v-head-dim", a.v_head_dim)]
    elif a.head_dim != a.hidden // a.heads:
        args.append(("--kv-channels", a.head_dim))
    args += [("--seq-length", L.seq_len), ("--max-position-embeddings", a.max_positions),
             ("--position-embedding-type", "rope"), ("--rotary-base", int(a.rope_theta)),
             ("--normalization", "RMSNorm"), ("--norm-epsilon", a.norm_eps),
             ("--swiglu", None), ("--disable-bias-linear", None)]
    if not a.tied_embeddings:
        args.append(("--untie-embeddings-and-output-weights", None))
    if a.family in ("qwen3", "qwen3_moe", "deepseek_v3"):  # DeepSeek-V3: MLA's q / kv norms
        args.append(("--qk-layernorm", None))
    args += _moe_args(L, a)
    args += [("--attention-dropout", 0.0), ("--hidden-dropout", 0.0),
             # the null tokenizer adds an end-of-document token: vocab - 1 gives vocab
             ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", a.vocab - 1),
             ("--make-vocab-size-divisible-by", _vocab_divisor(a.vocab, L.tp)),
             ("--attention-backend", "fused"),
             ("--tensor-model-parallel-size", L.tp), ("--pipeline-model-parallel-size", L.pp),
             ("--context-parallel-size", L.cp)]
    if L.cp > 1:
        args.append(("--cp-comm-type", "p2p"))
    if L.sequence_parallel:
        args.append(("--sequence-parallel", None))
    split = _split_fields(L, a.layers)
    if split.get("pp_layout"):
        args.append(("--pipeline-model-parallel-layout", split["pp_layout"]))
    elif split.get("vp"):
        args.append(("--num-virtual-stages-per-pipeline-rank", split["vp"]))
    for key, flag in (("first", "--decoder-first-pipeline-num-layers"),
                      ("last", "--decoder-last-pipeline-num-layers")):
        if split.get(key) is not None:
            args.append((flag, split[key]))
    for key, flag in (("embedding", "--account-for-embedding-in-pipeline-split"),
                      ("loss", "--account-for-loss-in-pipeline-split")):
        if split.get(key):
            args.append((flag, None))
    args += [("--micro-batch-size", L.microbatch_size), ("--global-batch-size", L.global_batch)]
    if L.dtype in (ComputeDtype.BF16, ComputeDtype.FP8):
        args.append(("--bf16", None))
    if L.dtype == ComputeDtype.FP8:
        args += [("--fp8-format", "hybrid"), ("--fp8-recipe", "tensorwise")]
    if L.recompute == Recompute.SELECTIVE:
        args.append(("--recompute-granularity", Recompute.SELECTIVE))
    elif L.recompute == Recompute.FULL:
        args += [("--recompute-granularity", Recompute.FULL), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", 1)]
    if L.zero == 1:
        args.append(("--use-distributed-optimizer", None))
    args.append(("--overlap-grad-reduce", None))
    if L.zero == 1:
        args.append(("--overlap-param-gather", None))
    if L.sequence_parallel:  # Megatron overlaps TP communication only with SP
        args.append(("--tp-comm-overlap", None))
    lines = _header(L, a, "Megatron-LM pretrain_gpt.py")
    lines += [flag if value is None else f"{flag} {value}" for flag, value in args]
    return "\n".join(lines) + "\n"


def _moe_args(L: StackLayout, a: ModelArch) -> list[tuple[str, object]]:
    """The experts, their layout and the router, as Megatron-LM main spells them."""
    if not a.experts:
        return []
    out: list[tuple[str, object]] = [
        ("--num-experts", a.experts), ("--moe-router-topk", a.top_k),
        ("--moe-ffn-hidden-size", a.moe_ffn_hidden)]
    if a.dense_layers:
        n = len(a.dense_layers)
        out.append(("--moe-layer-freq", f"([0]*{n}+[1]*{a.layers - n})"))
    if a.shared_ffn_hidden:
        out.append(("--moe-shared-expert-intermediate-size", a.shared_ffn_hidden))
    out += [("--moe-grouped-gemm", None), ("--moe-token-dispatcher-type", "alltoall"),
            ("--expert-model-parallel-size", L.ep), ("--expert-tensor-parallel-size", 1)]
    if a.family == "deepseek_v3":
        out += [("--moe-router-score-function", "sigmoid"),
                ("--moe-router-enable-expert-bias", None)]
    elif not a.norm_topk:  # softmax over every expert, then top-k (no renormalization)
        out.append(("--moe-router-pre-softmax", None))
    if a.router_scale != 1:
        out.append(("--moe-router-topk-scaling-factor", a.router_scale))
    if a.router_groups > 1:
        out += [("--moe-router-num-groups", a.router_groups),
                ("--moe-router-group-topk", a.router_group_topk)]
    # the router in fp32 (Megatron-LM's choice spelled as meshplan's dtype name)
    out += ROUTER_LOSS[a.family] + [("--moe-router-dtype", ComputeDtype.FP32)]
    return out


def nemo_overrides(layout: StackLayout, arch: ModelArch, *, devices_per_node: int = 8) -> str:
    """The same layout as NeMo 2 recipe overrides (``recipe = llm.<model>.pretrain_recipe(...)``
    then these assignments): ``MegatronStrategy`` fields, the DDP and optimizer configs, the
    data module, the model config's recompute / cp fields, the precision plugin and the
    ``MegatronCommOverlapCallback`` (names from NeMo's nemo/collections/llm/recipes)."""
    _check(layout, arch)
    L = layout
    if L.devices % devices_per_node and L.devices > devices_per_node:
        raise SpecError(f"{L.devices} devices are not whole nodes of {devices_per_node}")
    split = _split_fields(L, arch.layers)
    s, m = "recipe.trainer.strategy", "recipe.model.config"
    out = _header(L, arch, "NeMo 2 recipe overrides")
    out += ["# recipe = llm.<model>.pretrain_recipe(...) first, e.g. llm.llama3_70b",
            "import nemo_run as run", "from nemo import lightning as nl",
            "from nemo.collections.llm.recipes.precision.mixed_precision import bf16_mixed, "
            "bf16_with_fp8_current_scaling_mixed",
            "from nemo.lightning.pytorch.callbacks.megatron_comm_overlap import "
            "MegatronCommOverlapCallback"]
    out += [f"recipe.trainer.num_nodes = {max(1, L.devices // devices_per_node)}",
            f"recipe.trainer.devices = {min(L.devices, devices_per_node)}",
            f"{s}.tensor_model_parallel_size = {L.tp}",
            f"{s}.pipeline_model_parallel_size = {L.pp}",
            f"{s}.virtual_pipeline_model_parallel_size = {split.get('vp')}",
            f"{s}.context_parallel_size = {L.cp}",
            f"{s}.sequence_parallel = {L.sequence_parallel}"]
    for key, field in (("first", "num_layers_in_first_pipeline_stage"),
                       ("last", "num_layers_in_last_pipeline_stage"),
                       ("embedding", "account_for_embedding_in_pipeline_split"),
                       ("loss", "account_for_loss_in_pipeline_split"),
                       ("pp_layout", "pipeline_model_parallel_layout")):
        if split.get(key) is not None:
            out.append(f"{s}.{field} = {split[key]!r}")
    out += [f"{s}.ddp.overlap_grad_reduce = True",
            f"{s}.ddp.overlap_param_gather = {L.zero == 1}",
            f"recipe.optim.config.use_distributed_optimizer = {L.zero == 1}",
            f"recipe.data.micro_batch_size = {L.microbatch_size}",
            f"recipe.data.global_batch_size = {L.global_batch}",
            f"recipe.data.seq_length = {L.seq_len}", f"{m}.seq_length = {L.seq_len}"]
    if L.cp > 1:
        out.append(f'{m}.cp_comm_type = "p2p"')
    rec = {"none": (None, None, None), Recompute.SELECTIVE: (Recompute.SELECTIVE, None, None),
           Recompute.FULL: (Recompute.FULL, "uniform", 1)}[L.recompute]
    out += [f"{m}.recompute_{k} = {v!r}" for k, v in
            zip(("granularity", "method", "num_layers"), rec)]
    out.append("recipe.trainer.plugins = " + {
        ComputeDtype.BF16: "bf16_mixed()", ComputeDtype.FP8: "bf16_with_fp8_current_scaling_mixed()",
        ComputeDtype.FP32: 'run.Config(nl.MegatronMixedPrecision, precision="32")'}[L.dtype])
    if L.sequence_parallel:
        out.append("recipe.trainer.callbacks.append(run.Config(MegatronCommOverlapCallback, "
                   "tp_comm_overlap=True))")
    return "\n".join(out) + "\n"


# --- import ----------------------------------------------------------------------------------

# flags read, with Megatron-LM core_v0.16.1's defaults (megatron/training/arguments.py and the
# TransformerConfig fields it exposes); "bool": store_true (or store_false: listed as False)
_VALUE_FLAGS = {
    "--num-layers": (int, None), "--hidden-size": (int, None), "--ffn-hidden-size": (int, None),
    "--num-attention-heads": (int, None), "--num-query-groups": (int, 1),
    "--kv-channels": (int, None), "--seq-length": (int, None),
    "--max-position-embeddings": (int, None), "--position-embedding-type":
    (str, "learned_absolute"), "--rotary-base": (int, 10000), "--normalization":
    (str, "LayerNorm"), "--norm-epsilon": (float, 1e-5), "--vocab-size": (int, None),
    "--tokenizer-type": (str, None), "--make-vocab-size-divisible-by": (int, 128),
    "--tensor-model-parallel-size": (int, 1), "--pipeline-model-parallel-size": (int, 1),
    "--context-parallel-size": (int, 1), "--num-layers-per-virtual-pipeline-stage": (int, None),
    "--num-virtual-stages-per-pipeline-rank": (int, None),
    "--decoder-first-pipeline-num-layers": (int, None),
    "--decoder-last-pipeline-num-layers": (int, None),
    "--pipeline-model-parallel-layout": (str, None), "--micro-batch-size": (int, None),
    "--global-batch-size": (int, None), "--recompute-granularity": (str, None),
    "--recompute-method": (str, None), "--recompute-num-layers": (int, None),
    "--fp8-format": (str, None), "--fp8-recipe": (str, "delayed"), "--num-experts": (int, None),
    "--num-distributed-optimizer-instances": (int, 1),
    # mixture of experts (TransformerConfig / ModelParallelConfig fields, and --num-experts
    # --moe-layer-freq of arguments.py _add_moe_args) and multi-latent attention
    # (arguments.py _add_mla_args), with core_v0.16.1's defaults
    "--moe-router-topk": (int, 2), "--moe-ffn-hidden-size": (int, None),
    "--moe-shared-expert-intermediate-size": (int, None), "--moe-layer-freq": (str, "1"),
    "--moe-token-dispatcher-type": (str, "allgather"), "--expert-model-parallel-size": (int, 1),
    "--expert-tensor-parallel-size": (int, None), "--q-lora-rank": (int, None),
    "--kv-lora-rank": (int, 32), "--qk-head-dim": (int, 128), "--qk-pos-emb-head-dim": (int, 64),
    "--v-head-dim": (int, 128),
    # the router (TransformerConfig fields, the same defaults on main)
    "--moe-router-score-function": (str, "softmax"),
    "--moe-router-topk-scaling-factor": (float, None), "--moe-router-num-groups": (int, None),
    "--moe-router-group-topk": (int, None),
}
_LIST_FLAGS = {"--cp-comm-type": ["p2p"], "--recompute-modules": None}
_BOOL_FLAGS = ("--group-query-attention", "--use-rotary-position-embeddings", "--swiglu",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias",
               "--qk-layernorm", "--sequence-parallel", "--use-distributed-optimizer",
               "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
               "--recompute-activations", "--bf16", "--fp16", "--use-torch-fsdp2",
               "--use-megatron-fsdp", "--multi-latent-attention", "--moe-grouped-gemm",
               "--moe-router-pre-softmax", "--moe-router-enable-expert-bias")
_REFUSED = {"--fp16": "fp16 needs loss scaling, which meshplan does not price; train with --bf16",
            "--use-torch-fsdp2": "torch FSDP2 (ZeRO-3) is not what meshplan's megatron "
            "profile prices; use --use-distributed-optimizer or import it as torchtitan",
            "--use-megatron-fsdp": "Megatron FSDP is not what meshplan's megatron profile "
            "prices; use --use-distributed-optimizer"}
# Megatron-LM's choices (TransformerConfig.moe_token_dispatcher_type); with one expert-parallel
# rank each keeps every token on its rank, so the three price alike
_DISPATCHERS = ("allgather", "alltoall", "flex")


def _read_args(text: str) -> tuple[dict, int | None]:
    """Flags -> values (Megatron's defaults for missing ones) and the ``# devices: N`` header."""
    devices = None
    words = []
    for line in text.splitlines():
        code, _, comment = line.partition("#")
        hit = re.match(r"\s*devices:\s*(\d+)", comment)
        if hit:
            devices = int(hit.group(1))
        words += shlex.split(code.replace("\\", " "))
    given: dict[str, list[str]] = {}
    flag = None
    for w in words:
        if w.startswith("--"):
            flag, eq, value = w.partition("=")
            if flag in OLD_REFUSED:
                raise NotSupportedError(OLD_REFUSED[flag])
            if flag in OLD_SPELLINGS:  # today's flag, with the value the old switch meant
                flag, implied = OLD_SPELLINGS[flag]
                if implied is not None:
                    given[flag] = [implied]
                    flag = None
                    continue
            given[flag] = [value] if eq else []
        elif flag is not None:
            given[flag].append(w)
    known = set(_VALUE_FLAGS) | set(_LIST_FLAGS) | set(_BOOL_FLAGS)
    theirs = megatron_flags()
    for name in given:
        # a flag meshplan does not read may be any of Megatron's hundreds (--lr, --data-path):
        # only one that Megatron-LM main does not take, spelled like a flag meshplan reads, is
        # refused (a typo would price the default)
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if name not in known and name not in theirs and close:
            raise SpecError(f"{name}: not a Megatron-LM flag; did you mean {close[0]}?")
    args: dict = {}
    for name, (kind, default) in _VALUE_FLAGS.items():
        vals = given.get(name)
        if vals is not None and len(vals) != 1:
            raise SpecError(f"{name} takes one value, got {len(vals)}: {' '.join(vals)!r}")
        try:
            args[name] = kind(vals[0]) if vals else default
        except ValueError:
            raise SpecError(f"{name} {vals[0]!r}: not a {kind.__name__}") from None
    for name, default in _LIST_FLAGS.items():
        args[name] = given.get(name) or default
    for name in _BOOL_FLAGS:
        if given.get(name):
            raise SpecError(f"{name} is a switch and takes no value, got {given[name]!r}")
        args[name] = name in given
    return args, devices


def from_megatron(text: str, *, devices: int | None = None,
                  vocab: int | None = None) -> tuple[StackLayout, ModelArch]:
    """(StackLayout, ModelArch) of a ``pretrain_gpt.py`` argument list (one flag a line or one
    shell line; comments and backslashes ignored), with Megatron-LM's defaults for missing
    flags. The data-parallel size needs the world size: ``devices=`` or a ``# devices: N``
    line. ``vocab``: the tokenizer's vocabulary where it is not a NullTokenizer."""
    a, header = _read_args(text)
    if devices is not None and header is not None and devices != header:
        raise SpecError(f"devices={devices} but the argument list says '# devices: {header}'")
    devices = devices if devices is not None else header
    if devices is None:
        raise SpecError("the world size is unknown (Megatron takes it from the launcher): pass "
                        "devices=N or add a '# devices: N' line")
    for flag, why in _REFUSED.items():
        if a[flag]:
            raise NotSupportedError(f"{flag}: {why}")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads",
                 "--max-position-embeddings", "--seq-length", "--micro-batch-size"):
        if a[flag] is None:
            raise SpecError(f"{flag} is missing: Megatron-LM requires it")
    ep = a["--expert-model-parallel-size"]
    if ep != 1 and not a["--num-experts"]:
        raise SpecError(f"--expert-model-parallel-size {ep} without --num-experts: Megatron-LM "
                        "asserts 'num_experts must be non None to use expert model "
                        "parallelism'")
    rope = a["--position-embedding-type"] == "rope" or a["--use-rotary-position-embeddings"]
    if not (rope and a["--normalization"] == "RMSNorm" and a["--swiglu"] and
            a["--disable-bias-linear"] and not a["--add-qkv-bias"]):
        raise NotSupportedError("not a Llama/Qwen3-style decoder (needs --position-embedding-"
                                "type rope, --normalization RMSNorm, --swiglu, --disable-bias-"
                                "linear, no biases): import covers those families, their "
                                "mixtures of experts and multi-latent attention")
    tp, pp, cp = (a[f"--{k}-parallel-size"] for k in ("tensor-model", "pipeline-model",
                                                       "context"))
    if devices % (tp * pp * cp):
        raise SpecError(f"{devices} devices are not a multiple of tp {tp} x pp {pp} x cp {cp}")
    dp = devices // (tp * pp * cp)
    if ep != 1 and (ep < 1 or (dp * cp * tp) % ep or a["--num-experts"] % ep):
        raise SpecError(f"--expert-model-parallel-size {ep}: must divide the experts "
                        f"({a['--num-experts']}) and dp x cp x tp = {dp * cp * tp} (Megatron "
                        "folds the expert layout over the attention ranks of a pipeline stage)")
    h, heads, layers = a["--hidden-size"], a["--num-attention-heads"], a["--num-layers"]
    if a["--tokenizer-type"] == "NullTokenizer" and a["--vocab-size"] is not None:
        vocab = a["--vocab-size"] + 1  # the null tokenizer's end-of-document token
    if vocab is None:
        raise SpecError(f"--tokenizer-type {a['--tokenizer-type']}: the vocabulary comes from "
                        "the tokenizer's files; pass vocab=N")
    step = a["--make-vocab-size-divisible-by"] * tp  # Megatron pads it (_vocab_size_with_padding)
    ffn = a["--ffn-hidden-size"] or int(4 * h * 2 / 3 / 64) * 64
    arch = ModelArch(
        family="qwen3" if a["--qk-layernorm"] else "llama", hidden=h,
        ffn_hidden=ffn, layers=layers,
        heads=heads, kv_heads=a["--num-query-groups"] if a["--group-query-attention"] else heads,
        head_dim=a["--kv-channels"] or h // heads, vocab=-(-vocab // step) * step,
        max_positions=a["--max-position-embeddings"], rope_theta=float(a["--rotary-base"]),
        norm_eps=a["--norm-epsilon"],
        tied_embeddings=not a["--untie-embeddings-and-output-weights"])
    if a["--num-experts"] or a["--multi-latent-attention"]:
        arch = _moe_arch(a, arch, tp)
    bad_cp = sorted(set(a["--cp-comm-type"]) - {"p2p", "allgather"})
    if cp > 1 and bad_cp:
        raise NotSupportedError(f"--cp-comm-type {' '.join(bad_cp)}: meshplan prices context "
                                "parallelism as a K/V ring or all-gather (p2p, allgather)")
    vp = a["--num-virtual-stages-per-pipeline-rank"]
    embedding = a["--account-for-embedding-in-pipeline-split"]
    loss = a["--account-for-loss-in-pipeline-split"]
    if a["--num-layers-per-virtual-pipeline-stage"]:
        per_rank = (layers + embedding + loss) // pp
        vp = per_rank // a["--num-layers-per-virtual-pipeline-stage"]
    chunks = chunks_of(layers, pp, vp, first=a["--decoder-first-pipeline-num-layers"],
                       last=a["--decoder-last-pipeline-num-layers"], embedding=embedding,
                       loss=loss, pp_layout=a["--pipeline-model-parallel-layout"])
    vp = len(chunks) // pp
    layout = StackLayout(
        dp=dp, tp=tp, cp=cp, pp=pp, schedule=Schedule.INTERLEAVED if vp > 1 else Schedule.ONE_F_ONE_B,
        virtual_stages=vp, microbatch_size=a["--micro-batch-size"],
        global_batch=a["--global-batch-size"] or a["--micro-batch-size"] * dp,
        seq_len=a["--seq-length"], recompute=_recompute(a, max(chunks)),
        sequence_parallel=a["--sequence-parallel"] and tp > 1,
        zero=1 if a["--use-distributed-optimizer"] else 0, dtype=_dtype(a), ep=ep)
    if chunks != layout.layers_per_chunk(layers):
        layout = replace(layout, stage_layers=chunks)
    if a["--num-distributed-optimizer-instances"] != 1:
        raise NotSupportedError("--num-distributed-optimizer-instances > 1 shards over part of "
                                "dp x cp; meshplan prices the distributed optimizer over all of it")
    return layout, arch


def _moe_arch(a: dict, arch: ModelArch, tp: int) -> ModelArch:
    """``arch`` with the experts and multi-latent attention the flags describe: DeepSeek-V3
    (MLA, shared experts, dense first blocks), Qwen3-MoE (--qk-layernorm) or Mixtral, the
    families transformers builds them as; one line for what none of them is."""
    experts, k = a["--num-experts"], a["--moe-router-topk"]
    if not experts:
        raise NotSupportedError("--multi-latent-attention without --num-experts: import builds "
                                "MLA as DeepSeek-V3 does, with experts")
    if not 1 <= k <= experts:
        raise SpecError(f"--moe-router-topk {k} with --num-experts {experts}: each token picks "
                        f"between 1 and {experts} experts")
    if a["--moe-token-dispatcher-type"] not in _DISPATCHERS:
        raise SpecError(f"--moe-token-dispatcher-type {a['--moe-token-dispatcher-type']!r}: "
                        f"Megatron-LM's are {', '.join(_DISPATCHERS)}")
    etp = a["--expert-tensor-parallel-size"] or tp  # arguments.py: None means tp
    if etp != 1:
        # the plan's tp splits attention and dense feed-forwards; each expert stays whole
        # (split over ep, sharded by ZeRO over the rest): Megatron's layout with
        # --expert-tensor-parallel-size 1 (MoE parallel folding)
        given = "" if a["--expert-tensor-parallel-size"] else \
            f" (unset: Megatron takes --tensor-model-parallel-size {tp})"
        raise NotSupportedError(f"--expert-tensor-parallel-size {etp}{given}: each expert split "
                                "over tensor-parallel ranks is not a plan axis; meshplan keeps "
                                "experts whole, split over --expert-model-parallel-size: write "
                                "--expert-tensor-parallel-size 1")
    score = a["--moe-router-score-function"]
    if score not in ("softmax", "sigmoid"):
        raise NotSupportedError(f"--moe-router-score-function {score}: transformers' MoE "
                                "families route by softmax (Mixtral, Qwen3-MoE) or sigmoid "
                                "(DeepSeek-V3)")
    if (score == "sigmoid") != bool(a["--multi-latent-attention"]):
        raise NotSupportedError(f"--moe-router-score-function {score} "
                                f"{'with' if a['--multi-latent-attention'] else 'without'} "
                                "--multi-latent-attention: import builds DeepSeek-V3 (MLA, "
                                "sigmoid router) or Mixtral / Qwen3-MoE (softmax)")
    groups, group_topk = a["--moe-router-num-groups"] or 1, a["--moe-router-group-topk"] or 1
    if groups > 1 and (experts % groups or not 1 <= group_topk <= groups):
        raise SpecError(f"--moe-router-num-groups {groups} --moe-router-group-topk "
                        f"{group_topk}: the groups must split the {experts} experts evenly "
                        "and each token pick between 1 and all of them")
    router = dict(norm_topk=score == "sigmoid" or not a["--moe-router-pre-softmax"],
                  router_scale=a["--moe-router-topk-scaling-factor"] or 1.0,
                  router_groups=groups, router_group_topk=group_topk)
    pattern = _moe_pattern(a["--moe-layer-freq"], arch.layers)
    dense = tuple(i for i, moe in enumerate(pattern) if not moe)
    moe_ffn = a["--moe-ffn-hidden-size"] or arch.ffn_hidden  # Megatron's default
    shared = a["--moe-shared-expert-intermediate-size"] or 0
    fields = dict(experts=experts, top_k=k, moe_ffn_hidden=moe_ffn, shared_ffn_hidden=shared,
                  dense_layers=dense, **router)
    if a["--multi-latent-attention"]:
        if a["--q-lora-rank"] is None:
            raise NotSupportedError("--multi-latent-attention without --q-lora-rank (a full-"
                                    "rank query, as DeepSeek-V2-Lite): import builds "
                                    "DeepSeek-V3's low-rank query; give --q-lora-rank")
        if shared % moe_ffn:
            raise NotSupportedError(f"--moe-shared-expert-intermediate-size {shared} is not a "
                                    f"multiple of --moe-ffn-hidden-size {moe_ffn}: DeepSeek-V3's "
                                    "shared experts are whole experts")
        if dense != tuple(range(len(dense))):
            raise NotSupportedError(f"--moe-layer-freq {a['--moe-layer-freq']}: DeepSeek-V3 "
                                    "(transformers) keeps its dense blocks first; write the "
                                    "pattern as ([0]*K+[1]*N)")
        return replace(arch, family="deepseek_v3", kv_heads=arch.heads,
                       head_dim=a["--qk-head-dim"], q_lora_rank=a["--q-lora-rank"],
                       kv_lora_rank=a["--kv-lora-rank"], qk_rope_dim=a["--qk-pos-emb-head-dim"],
                       v_head_dim=a["--v-head-dim"], **fields)
    if shared or dense:
        what = "shared experts" if shared else f"dense blocks {list(dense)}"
        raise NotSupportedError(f"{what} without --multi-latent-attention: import builds "
                                "Mixtral and Qwen3-MoE, whose every block routes to experts "
                                "and none is shared")
    family = "qwen3_moe" if a["--qk-layernorm"] else "mixtral"
    if family == "mixtral" and (not router["norm_topk"] or router["router_scale"] != 1 or
                                groups > 1):
        raise NotSupportedError("--moe-router-pre-softmax, --moe-router-topk-scaling-factor or "
                                "--moe-router-num-groups without --qk-layernorm: transformers' "
                                "Mixtral renormalizes its top-k softmax and has no scaling or "
                                "groups (Qwen3-MoE: add --qk-layernorm)")
    if family == "qwen3_moe" and (router["router_scale"] != 1 or groups > 1):
        raise NotSupportedError("--moe-router-topk-scaling-factor or --moe-router-num-groups "
                                "with Qwen3-MoE: transformers' Qwen3-MoE router has neither")
    return replace(arch, family=family, **fields)


def _moe_pattern(text: str, layers: int) -> list[int]:
    """--moe-layer-freq as Megatron reads it (arguments.py ``moe_freq_type``): N, one MoE
    block in every N (blocks 0, N, 2N, ...: megatron-core's ``get_gpt_decoder_block_spec``),
    or a list expression of 0 (dense) and 1 (MoE) per block, e.g. ([0]*3+[1]*58)."""
    import ast
    import operator

    if text.strip().isdigit():
        n = int(text)
        if n < 1:
            raise SpecError(f"--moe-layer-freq {text}: must be at least 1")
        return [int(i % n == 0) for i in range(layers)]
    ops = {ast.Add: operator.add, ast.Mult: operator.mul}

    def value(node):
        if isinstance(node, ast.List):
            return [value(x) for x in node.elts]
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(node)

    try:
        pattern = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        pattern = None
    if not isinstance(pattern, list) or any(x not in (0, 1) for x in pattern):
        raise SpecError(f"--moe-layer-freq {text!r}: not N or a list of 0 and 1 such as "
                        "([0]*3+[1]*58)")
    if len(pattern) != layers:
        raise SpecError(f"--moe-layer-freq {text!r} gives {len(pattern)} blocks but --num-layers "
                        f"is {layers}; one 0 or 1 per block")
    return pattern


def _recompute(a: dict, most_layers: int) -> str:
    granularity = Recompute.SELECTIVE if a["--recompute-activations"] else a["--recompute-granularity"]
    modules = a["--recompute-modules"]
    if granularity == Recompute.SELECTIVE and modules not in (None, ["core_attn"]):
        raise NotSupportedError(f"--recompute-modules {' '.join(modules)}: meshplan prices "
                                "selective recompute of the attention core (core_attn)")
    if granularity != Recompute.FULL:
        return granularity or "none"
    method, n = a["--recompute-method"], a["--recompute-num-layers"]
    if (method, n) == ("uniform", 1) or (method == "block" and (n or 0) >= most_layers):
        return Recompute.FULL
    raise NotSupportedError(f"--recompute-method {method} --recompute-num-layers {n}: meshplan "
                            "prices full recompute of every layer (uniform 1, or block >= the "
                            "layers per chunk)")


def _dtype(a: dict) -> str:
    if a["--fp8-format"] is None:
        return ComputeDtype.BF16 if a["--bf16"] else ComputeDtype.FP32
    if a["--fp8-recipe"] != "tensorwise" or not a["--bf16"]:
        raise NotSupportedError(f"--fp8-recipe {a['--fp8-recipe']}: meshplan prices fp8 as "
                                "Transformer Engine's current scaling with bf16 "
                                "(--bf16 --fp8-recipe tensorwise)")
    return ComputeDtype.FP8
