"""Export to and import from Megatron-LM / NeMo (meshplan/stacks/megatron.py, issue 29).

Round trip: ``from_megatron(to_megatron(L)) == L`` over generated layouts that ``problems``
accepts (a hypothesis property, derandomized so its counts are reproducible). Checked by
Megatron's own code: the exported arguments of the Llama 3.1 runs build megatron-core 0.16.1's
``TransformerConfig`` / ``DistributedDataParallelConfig`` / ``OptimizerConfig`` (their
``__post_init__`` checks run) as Megatron-LM's ``core_transformer_config_from_args`` maps the
flags, and Megatron-Core's ``get_num_layers_to_build`` gives every pipeline chunk the blocks
the layout says. Every flag written or read is one of Megatron-LM's (``VERIFIED_FLAGS``).
"""

import contextlib
import dataclasses
import functools
import re
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.errors import NotSupportedError, SpecError
from meshplan.stacks import ModelArch, StackLayout, arch_of_spec
from meshplan.stacks import megatron
from meshplan.specs import parse_model_spec
from meshplan.stacks.megatron import from_megatron, nemo_overrides, problems, to_megatron

# Every flag Megatron-LM main's parser takes (meshplan/stacks/megatron_flags.txt: the option
# strings of megatron/training/arguments.py add_megatron_arguments at the commit its header
# names, written by tools/megatron_flags.py; many are generated from megatron-core's config
# dataclasses by argument_utils.ArgumentGroupFactory, so a text search of arguments.py misses
# them). Read here from the file, not through the module under test.
FLAGS_FILE = Path(megatron.__file__).with_name("megatron_flags.txt")
VERIFIED_FLAGS = frozenset(ln.strip() for ln in FLAGS_FILE.read_text().splitlines()
                           if ln.startswith("--"))


def test_flag_list_is_megatron_lm_main_at_the_pinned_commit():
    header = FLAGS_FILE.read_text().splitlines()[1]
    assert megatron.MEGATRON_LM_MAIN in header and f"{len(VERIFIED_FLAGS)} flags" in header
    # what main took over from core_v0.16.1 and what it added, as the issue names them
    assert {"--num-experts", "--moe-router-topk", "--expert-model-parallel-size",
            "--moe-token-dispatcher-type", "--moe-router-dtype"} <= VERIFIED_FLAGS
    assert "--moe-extended-tp" not in VERIFIED_FLAGS  # in core_v0.16.1, gone from main
    for old, (new, _) in megatron.OLD_SPELLINGS.items():
        assert old not in VERIFIED_FLAGS and new in VERIFIED_FLAGS


QWEN3_06B = ModelArch(family="qwen3", hidden=1024, ffn_hidden=3072, layers=28, heads=16,
                      kv_heads=8, head_dim=128, vocab=151936, max_positions=40960,
                      rope_theta=1e6, norm_eps=1e-6, tied_embeddings=True)  # Qwen3-0.6B config


@pytest.fixture(scope="module")
def llama():
    return {m: arch_of_spec(f"llama3.1-{m}") for m in ("8b", "70b", "405b")}


def runs(llama):
    """The issue's four runs on H100s, in NeMo's published layouts (benchmarks/
    nemo_published.py: 8B TP1 PP1 CP2, 70B TP4 PP4 CP2 VP5; 405B as NeMo's recipe shape
    TP8 PP8 CP2, here VP8 on 1,024 GPUs), and 405B at 131,072 tokens with CP16."""
    common = dict(microbatch_size=1, zero=1, dtype="bf16")
    return {
        "8b-8": (llama["8b"], StackLayout(dp=4, cp=2, global_batch=128, seq_len=8192, **common)),
        "70b-64": (llama["70b"], StackLayout(dp=2, tp=4, cp=2, pp=4, schedule="interleaved-1f1b",
                                             virtual_stages=5, global_batch=128, seq_len=8192,
                                             sequence_parallel=True, **common)),
        "405b-1024": (llama["405b"], StackLayout(
            dp=8, tp=8, cp=2, pp=8, schedule="interleaved-1f1b", virtual_stages=8,
            global_batch=512, seq_len=8192, sequence_parallel=True, **common)),
        "405b-131k": (llama["405b"], StackLayout(
            dp=1, tp=8, cp=16, pp=8, schedule="interleaved-1f1b", virtual_stages=8,
            global_batch=64, seq_len=131072, sequence_parallel=True, recompute="full",
            **common)),
    }


def flags_of(text: str) -> dict:
    """``--flag value`` lines -> {flag: value or True}, comments skipped (not the module's
    own reader: the check must not trust what it checks)."""
    out = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            flag, _, value = line.partition(" ")
            out[flag] = value or True
    return out


def test_issue_runs_round_trip_and_name_only_megatron_flags(llama):
    for name, (arch, layout) in runs(llama).items():
        assert problems(layout, arch) == (), name
        text = to_megatron(layout, arch)
        assert set(flags_of(text)) <= VERIFIED_FLAGS, name
        assert from_megatron(text) == (layout, arch), name
    read = set(megatron._VALUE_FLAGS) | set(megatron._LIST_FLAGS) | set(megatron._BOOL_FLAGS)
    assert read <= VERIFIED_FLAGS


def test_405b_split_is_nemos_embedding_and_loss_accounting(llama):
    """126 blocks over 8 ranks x 8 virtual stages: meshplan's even chunks (one block fewer on
    the first and the last chunk, Llama 3's cut) are what NeMo's 405B recipe asks Megatron
    for with --account-for-embedding/loss-in-pipeline-split."""
    arch, layout = runs(llama)["405b-1024"]
    f = flags_of(to_megatron(layout, arch))
    assert f["--num-virtual-stages-per-pipeline-rank"] == "8"
    assert f["--account-for-embedding-in-pipeline-split"] is True
    assert f["--account-for-loss-in-pipeline-split"] is True
    assert "--pipeline-model-parallel-layout" not in f


def test_uneven_splits_take_first_last_or_a_layout_string(llama):
    arch = dataclasses.replace(llama["8b"], layers=30)
    base = StackLayout(dp=1, pp=4, global_batch=8, seq_len=4096)
    ends = dataclasses.replace(base, stage_layers=(6, 8, 8, 8))
    f = flags_of(to_megatron(ends, arch))
    assert f["--decoder-first-pipeline-num-layers"] == "6"
    assert "--decoder-last-pipeline-num-layers" not in f
    odd = dataclasses.replace(base, stage_layers=(9, 7, 8, 6))
    f = flags_of(to_megatron(odd, arch))
    assert f["--pipeline-model-parallel-layout"] == "Et*9|t*7|t*8|t*6L"
    for layout in (ends, odd):
        assert from_megatron(to_megatron(layout, arch)) == (layout, arch)


def test_refusals_are_one_line(llama):
    arch = llama["8b"]
    base = StackLayout(dp=2, pp=2, global_batch=16, seq_len=4096)
    for layout, word in ((dataclasses.replace(base, schedule="gpipe"), "gpipe"),
                         (dataclasses.replace(base, zero=3), "zero=3"),
                         (dataclasses.replace(base, compiled=True), "compiled")):
        found = problems(layout, arch)
        assert len(found) == 1 and word in found[0] and "\n" not in found[0]
        with pytest.raises(NotSupportedError, match=re.escape(found[0])):
            to_megatron(layout, arch)
    many = StackLayout(dp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                       global_batch=6, seq_len=4096)  # 3 microbatches, pp 2
    assert any("multiple of 2" in p for p in problems(many, arch))


def test_import_defaults_and_world_size(llama):
    text = """# a Megatron-LM launch script (published style): one shell line
    torchrun pretrain_gpt.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
      --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 \\
      --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \\
      --tokenizer-type NullTokenizer --vocab-size 128255 --bf16 --lr 3e-4"""
    with pytest.raises(SpecError, match="devices=N"):
        from_megatron(text)
    layout, arch = from_megatron(text, devices=16)
    assert (layout.dp, layout.tp, layout.global_batch, layout.zero) == (16, 1, 16, 0)
    assert (arch.ffn_hidden, arch.kv_heads, arch.rope_theta) == (10880, 32, 10000.0)
    assert arch.tied_embeddings and arch.vocab == 128256
    layout, arch = from_megatron(text + " --tensor-model-parallel-size 8", devices=16)
    assert arch.vocab == 129024  # padded to a multiple of 128 x tp, as Megatron builds it
    with pytest.raises(NotSupportedError, match="--fp16"):
        from_megatron(text.replace("--bf16", "--fp16"), devices=8)


def test_nemo_overrides_name_the_recipe_fields(llama):
    arch, layout = runs(llama)["405b-1024"]
    text = nemo_overrides(layout, arch)
    assert "recipe.trainer.num_nodes = 128" in text
    assert "recipe.trainer.strategy.virtual_pipeline_model_parallel_size = 8" in text
    assert "recipe.trainer.strategy.account_for_loss_in_pipeline_split = True" in text
    assert "MegatronCommOverlapCallback, tp_comm_overlap=True" in text
    compile(text, "nemo_overrides", "exec")  # a Python snippet to paste after the recipe


@functools.cache
def moe_archs() -> tuple:
    """The MoE presets (transformers configs) and a Qwen3-MoE without top-k renormalization
    (norm_topk_prob False, transformers' Qwen3MoeConfig default)."""
    qwen = arch_of_spec("qwen3-30b-a3b")
    return (arch_of_spec("mixtral-8x7b"), qwen, dataclasses.replace(qwen, norm_topk=False),
            arch_of_spec("deepseek-v3"))


@st.composite
def cases(draw):
    """(arch, layout): degrees, schedule, batch, recompute, precision, and the split: even,
    meshplan's own uneven one, first/last-stage sizes, embedding/loss accounting, arbitrary;
    now and then something Megatron refuses (gpipe, ZeRO 2/3, compiled, SP without TP)."""
    base = draw(st.sampled_from((arch_of_spec("llama3.1-8b"), QWEN3_06B) + moe_archs()))
    tp = draw(st.sampled_from((1, 2, 4, 8)))
    cp, pp = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 3, 4, 8)))
    interleaved = pp > 1 and draw(st.booleans())
    vp = draw(st.integers(2, 3)) if interleaved else 1
    dp, mb = draw(st.integers(1, 4)), draw(st.integers(1, 2))
    micro = draw(st.integers(1, 3)) * (pp if interleaved else 1) + draw(st.sampled_from(
        (0,) * 9 + (1,)))  # now and then a count the interleaved schedule refuses
    n = pp * vp
    kind = draw(st.sampled_from(("even", "meshplan", "ends", "account", "any")))
    c = draw(st.integers(1, 3))
    if kind == "even":
        chunks = [c] * n
    elif kind == "ends":  # per rank: first f, middle c, last l (each per chunk)
        f, l = draw(st.integers(1, 4)), draw(st.integers(1, 4))
        chunks = [f if j % pp == 0 else l if j % pp == pp - 1 else c for j in range(n)]
    elif kind == "account":
        chunks = [c + 1] * n
        chunks[0] -= draw(st.booleans())
        chunks[-1] -= draw(st.booleans())
    else:
        chunks = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    layers = max(1, sum(chunks)) if kind != "meshplan" else draw(st.integers(max(1, n - 2), 40))
    layout = StackLayout(
        dp=dp, tp=tp, cp=cp, pp=pp, schedule="interleaved-1f1b" if interleaved else "1f1b",
        virtual_stages=vp, microbatch_size=mb, global_batch=dp * mb * micro,
        seq_len=draw(st.sampled_from((2048, 4096))),
        recompute=draw(st.sampled_from(("none", "selective", "full"))),
        sequence_parallel=draw(st.booleans()), zero=draw(st.sampled_from((0, 1) * 4 + (2, 3))),
        dtype=draw(st.sampled_from(("bf16", "fp8", "fp32"))),
        compiled=draw(st.sampled_from((False,) * 9 + (True,))),
        # expert parallelism over a divisor of dp x cp x tp (one that splits no expert count,
        # or a dense model's ep > 1, now and then: refused)
        ep=draw(st.sampled_from([e for e in range(1, dp * cp * tp + 1) if dp * cp * tp % e == 0
                                 and (not base.experts or base.experts % e == 0 or e == 3)]
                                if base.experts or draw(st.integers(0, 19)) == 0 else [1])))
    if base.dense_layers:  # DeepSeek-V3: its dense first blocks, fewer where layers are few
        base = dataclasses.replace(base, dense_layers=tuple(range(min(3, layers - 1))))
    if pp > 1 and not interleaved and draw(st.sampled_from((False,) * 9 + (True,))):
        layout = dataclasses.replace(layout, schedule="gpipe")
    if kind != "meshplan" and sum(chunks) == layers and \
            tuple(chunks) != layout.layers_per_chunk(layers):
        layout = dataclasses.replace(layout, stage_layers=tuple(chunks))
    return dataclasses.replace(base, layers=layers), layout


def test_round_trip_property():
    """Every generated layout Megatron can run comes back unchanged, its architecture too;
    every other is refused by to_megatron with problems' first line."""
    seen = {"accepted": 0, "refused": 0, "layout string": 0, "first/last": 0, "accounting": 0,
            "experts ep>1": 0, "experts refused": 0}

    @settings(max_examples=600, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        arch, layout = case
        found = problems(arch=arch, layout=layout)
        if found:
            seen["refused"] += 1
            seen["experts refused"] += bool(arch.experts)
            with pytest.raises(NotSupportedError):
                to_megatron(layout, arch)
            return
        seen["accepted"] += 1
        text = to_megatron(layout, arch)
        seen["layout string"] += "--pipeline-model-parallel-layout" in text
        seen["first/last"] += "pipeline-num-layers" in text
        seen["accounting"] += "in-pipeline-split" in text
        seen["experts ep>1"] += layout.ep > 1
        assert set(flags_of(text)) <= VERIFIED_FLAGS
        assert from_megatron(text, devices=layout.devices) == (layout, arch)

    prop()
    print("round trip:", seen)
    assert seen["accepted"] >= 300 and min(seen.values()) >= 20, seen


# --- checked by megatron-core's own code ------------------------------------------------------

def megatron_configs(text: str):
    """megatron-core 0.16.1's configs from an exported argument list, each flag mapped to its
    field as Megatron-LM's ``core_transformer_config_from_args`` and ``validate_args`` do."""
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, \
        TransformerConfig

    f = flags_of(text)
    num = lambda k, d=None: int(f[k]) if k in f else d  # noqa: E731
    dtype = torch.bfloat16 if "--bf16" in f else torch.float32
    vp = num("--num-virtual-stages-per-pipeline-rank")
    moe = {}
    if "--num-experts" in f:  # arguments.py moe_freq_type: N, or a list expression
        freq = f.get("--moe-layer-freq", "1")
        moe = dict(
            num_moe_experts=num("--num-experts"), moe_router_topk=num("--moe-router-topk"),
            moe_ffn_hidden_size=num("--moe-ffn-hidden-size"),
            moe_shared_expert_intermediate_size=num("--moe-shared-expert-intermediate-size"),
            moe_layer_freq=int(freq) if freq.isdigit() else eval(freq),
            moe_grouped_gemm="--moe-grouped-gemm" in f,
            moe_token_dispatcher_type=f["--moe-token-dispatcher-type"],
            expert_model_parallel_size=num("--expert-model-parallel-size"),
            expert_tensor_parallel_size=num("--expert-tensor-parallel-size"),
            moe_router_score_function=f.get("--moe-router-score-function", "softmax"),
            moe_router_enable_expert_bias="--moe-router-enable-expert-bias" in f,
            moe_router_pre_softmax="--moe-router-pre-softmax" in f,
            moe_router_topk_scaling_factor=float(f["--moe-router-topk-scaling-factor"])
            if "--moe-router-topk-scaling-factor" in f else None,
            moe_router_num_groups=num("--moe-router-num-groups"),
            moe_router_group_topk=num("--moe-router-group-topk"),
            moe_router_load_balancing_type=f["--moe-router-load-balancing-type"],
            moe_aux_loss_coeff=float(f["--moe-aux-loss-coeff"]),
            moe_router_bias_update_rate=float(f.get("--moe-router-bias-update-rate", 1e-3)),
            moe_router_dtype=f["--moe-router-dtype"])
    if "--multi-latent-attention" in f:
        cls = MLATransformerConfig
        moe.update(multi_latent_attention=True, q_lora_rank=num("--q-lora-rank"),
                   kv_lora_rank=num("--kv-lora-rank"), qk_head_dim=num("--qk-head-dim"),
                   qk_pos_emb_head_dim=num("--qk-pos-emb-head-dim"),
                   v_head_dim=num("--v-head-dim"))
    else:
        cls = TransformerConfig
    te = contextlib.nullcontext()
    if moe and "--fp8-format" in f:  # MoE in fp8 asks Transformer Engine's version (not here)
        import megatron.core.transformer.transformer_config as tc

        te = mock.patch.object(tc, "is_te_min_version", lambda *a, **k: True)
    with te:
        cfg = cls(**moe,
            num_layers=num("--num-layers"), hidden_size=num("--hidden-size"),
            ffn_hidden_size=num("--ffn-hidden-size"), num_attention_heads=num("--num-attention-heads"),
            num_query_groups=num("--num-query-groups") if "--group-query-attention" in f else None,
            kv_channels=num("--kv-channels"),
            tensor_model_parallel_size=num("--tensor-model-parallel-size"),
            pipeline_model_parallel_size=num("--pipeline-model-parallel-size"),
            context_parallel_size=num("--context-parallel-size"),
            virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
            sequence_parallel="--sequence-parallel" in f, cp_comm_type=f.get("--cp-comm-type", "p2p"),
            num_layers_in_first_pipeline_stage=num("--decoder-first-pipeline-num-layers"),
            num_layers_in_last_pipeline_stage=num("--decoder-last-pipeline-num-layers"),
            account_for_embedding_in_pipeline_split="--account-for-embedding-in-pipeline-split" in f,
            account_for_loss_in_pipeline_split="--account-for-loss-in-pipeline-split" in f,
            pipeline_model_parallel_layout=f.get("--pipeline-model-parallel-layout"),
            normalization=f["--normalization"], layernorm_epsilon=float(f["--norm-epsilon"]),
            gated_linear_unit="--swiglu" in f, activation_func=F.silu,
            add_bias_linear="--disable-bias-linear" not in f, qk_layernorm="--qk-layernorm" in f,
            hidden_dropout=float(f["--hidden-dropout"]),
            attention_dropout=float(f["--attention-dropout"]),
            bf16="--bf16" in f, params_dtype=dtype, pipeline_dtype=dtype,
            fp8=f.get("--fp8-format"), fp8_recipe=f.get("--fp8-recipe", "delayed"),
            recompute_granularity=f.get("--recompute-granularity"),
            recompute_method=f.get("--recompute-method"),
            recompute_num_layers=num("--recompute-num-layers"),
            tp_comm_overlap="--tp-comm-overlap" in f,
            attention_backend=AttnBackend[f["--attention-backend"]],
            batch_p2p_comm=False, deallocate_pipeline_outputs=True)  # overlap_p2p_comm default
    distributed = "--use-distributed-optimizer" in f
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce="--overlap-grad-reduce" in f,
        overlap_param_gather="--overlap-param-gather" in f,
        use_distributed_optimizer=distributed)
    opt = OptimizerConfig(optimizer="adam", lr=3e-4, bf16="--bf16" in f, params_dtype=dtype,
                          use_distributed_optimizer=distributed,
                          overlap_param_gather="--overlap-param-gather" in f)
    return cfg, ddp, opt


def megatron_chunks(cfg) -> tuple[int, ...]:
    """Blocks per chunk (chunk j = virtual stage j // pp on rank j % pp) by Megatron-Core."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    pp, vp = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    out = []
    try:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
        for j in range(pp * (vp or 1)):
            parallel_state.set_pipeline_model_parallel_rank(j % pp)
            out.append(get_num_layers_to_build(cfg, vp_stage=j // pp if vp else None,
                                               pp_rank=j % pp))
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
        parallel_state.set_pipeline_model_parallel_rank(None)
    return tuple(out)


def test_megatron_core_accepts_the_issue_runs(llama):
    pytest.importorskip("megatron.core")
    for name, (arch, layout) in runs(llama).items():
        cfg, ddp, opt = megatron_configs(to_megatron(layout, arch))
        assert megatron_chunks(cfg) == layout.layers_per_chunk(arch.layers), name
        assert (cfg.tensor_model_parallel_size, cfg.context_parallel_size,
                cfg.pipeline_model_parallel_size) == (layout.tp, layout.cp, layout.pp)
        assert cfg.num_query_groups == arch.kv_heads and cfg.kv_channels == arch.head_dim
        assert ddp.use_distributed_optimizer and opt.use_distributed_optimizer
        assert cfg.tp_comm_overlap == layout.sequence_parallel


def test_megatron_core_splits_generated_layouts_as_exported():
    """Megatron-Core's own split of every generated layout's exported arguments is the
    layout's: first/last sizes, embedding/loss accounting and layout strings alike."""
    pytest.importorskip("megatron.core")
    checked = []

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(cases())
    def prop(case):
        arch, layout = case
        if problems(layout, arch):
            return
        cfg, ddp, _ = megatron_configs(to_megatron(layout, arch))
        assert megatron_chunks(cfg) == layout.layers_per_chunk(arch.layers)
        # Megatron-LM's validate_args: TP overlap only with SP, param gather only with ZeRO-1
        assert cfg.tp_comm_overlap == cfg.sequence_parallel == layout.sequence_parallel
        assert ddp.overlap_param_gather == ddp.use_distributed_optimizer == (layout.zero == 1)
        checked.append(layout)

    prop()
    print("megatron-core split checks:", len(checked))
    assert len(checked) >= 90  # 96 of 200 draws (a quarter of them MoE) Megatron runs


# --- checked by Megatron-LM's own argument code (not in the wheel: a checkout) ----------------

def _needs_six(root: str) -> None:
    """core_v0.16.1's BERT tokenizer imports six (main's does not): skip without it."""
    import os

    bert = os.path.join(root, "megatron/training/tokenizer/bert_tokenization.py")
    if os.path.isfile(bert) and "import six" in open(bert).read():
        pytest.importorskip("six")


LM_CHECK = '''
import os, shlex, sys, typing
if not hasattr(typing, "override"):  # Megatron-LM main names Python 3.12's typing.override
    import typing_extensions
    typing.override = typing_extensions.override
from unittest import mock
# batch_invariant_kernels needs triton (GPU builds only); nothing here calls it
sys.modules["megatron.core.transformer.custom_layers.batch_invariant_kernels"] = mock.MagicMock()
import argparse
from megatron.training import arguments as A
A.get_device_arch_version = lambda: 9  # Hopper, the plans' H100 (no GPU here)
os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron-LM asks for it with tp/cp > 1
for text in sys.stdin.read().split("\\f"):
    devices = int(text.split("# devices:")[1].split()[0])
    argv = shlex.split(" ".join(l for l in text.splitlines() if not l.startswith("#")))
    # fused RoPE needs Transformer Engine; data and schedule are the launcher's additions
    argv += ["--no-rope-fusion", "--mock-data", "--train-iters", "10", "--lr", "3e-4"]
    args = A.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.world_size, args.rank = devices, 0
    A.validate_args(args)
    A.core_transformer_config_from_args(args)
    print("OK", args.data_parallel_size, args.virtual_pipeline_model_parallel_size)
'''


def test_megatron_lm_parses_and_validates_the_exports(llama):
    """Megatron-LM core_v0.16.1's own ``parse_args`` parser, ``validate_args`` and
    ``core_transformer_config_from_args`` on the four runs and four uneven splits. Needs a
    Megatron-LM checkout at that tag (``MEGATRON_LM_DIR``) and its ``six``; skipped without."""
    import os
    import subprocess
    import sys

    root = os.environ.get("MEGATRON_LM_DIR")
    if not root or not os.path.isfile(os.path.join(root, "megatron/training/arguments.py")):
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout (main at "
                    "megatron.MEGATRON_LM_MAIN, or core_v0.16.1)")
    _needs_six(root)
    cases = list(runs(llama).values())
    a30 = dataclasses.replace(llama["8b"], layers=30)
    base = StackLayout(dp=1, pp=4, global_batch=8, seq_len=4096)
    cases += [(a30, dataclasses.replace(base, stage_layers=(6, 8, 8, 8), dtype="fp8",
                                        recompute="selective")),
              (llama["8b"], dataclasses.replace(base, schedule="interleaved-1f1b",
                                                virtual_stages=2, dtype="fp32",
                                                stage_layers=(3, 4, 4, 5, 3, 4, 4, 5))),
              (a30, dataclasses.replace(base, tp=2, zero=1, stage_layers=(9, 7, 8, 6))),
              (a30, dataclasses.replace(base, tp=2, sequence_parallel=True, recompute="full",
                                        schedule="interleaved-1f1b", virtual_stages=2,
                                        stage_layers=(3, 4, 5, 3, 4, 4, 4, 3)))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", LM_CHECK], env=env, cwd=root,
                         input="\f".join(to_megatron(lay, arch) for arch, lay in cases),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = [line.split() for line in out.stdout.splitlines() if line.startswith("OK")]
    assert [(int(d), None if v == "None" else int(v)) for _, d, v in got] == [
        (lay.dp, lay.virtual_stages if lay.virtual_stages > 1 else None) for _, lay in cases]


def test_a_meshplan_plan_exports_and_comes_back(tiny_llama_h100):
    """plan -> layout_of -> to_megatron -> from_megatron: the plan's layout and model."""
    import meshplan
    from meshplan.stacks import arch_of_model, check_expressible, layout_of

    model, graph, mesh = tiny_llama_h100
    plan = meshplan.manual_plan(model, mesh, graph=graph, dp=2, tp=2, pp=2, microbatch_size=1,
                                sequence_parallel=True, zero=1, engine="megatron")
    layout, arch = layout_of(plan), arch_of_model(model)
    check_expressible(plan, layout, graph)
    text = to_megatron(layout, arch)
    assert "--tp-comm-overlap" in text and "--use-distributed-optimizer" in text
    assert from_megatron(text) == (layout, arch)
    assert (layout.dp, layout.tp, layout.pp, layout.microbatches) == (2, 2, 2, 4)


def test_benchmark_exports_accepted_by_megatron_core():
    """The argument files benchmarks/stack_exports.py wrote for `plan --for megatron` (the
    files the results table cites) build megatron-core's own configs, which validate them,
    and split the layers as the file's layout says."""
    pytest.importorskip("megatron.core")
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                    / "stack_exports").glob("*.meshplan.txt"))
    if not files:
        pytest.skip("run benchmarks/stack_exports.py first")
    for f in files:
        layout, arch = from_megatron(f.read_text())
        cfg, ddp, opt = megatron_configs(f.read_text())
        assert megatron_chunks(cfg) == layout.layers_per_chunk(arch.layers), f.name
        assert (cfg.tensor_model_parallel_size, cfg.context_parallel_size,
                cfg.pipeline_model_parallel_size) == (layout.tp, layout.cp, layout.pp), f.name


# --- mixtures of experts and multi-latent attention (issue 39: export, import, ep) ----------

MOE_BASE = """# devices: 8
--num-layers 3 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
--seq-length 64 --max-position-embeddings 128 --position-embedding-type rope
--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
--tokenizer-type NullTokenizer --vocab-size 255 --micro-batch-size 1 --global-batch-size 16
--bf16 --use-distributed-optimizer
--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm
--moe-token-dispatcher-type alltoall --expert-model-parallel-size 1
"""
# DeepSeek-V3's attention and experts in miniature, written as its Megatron recipes write them
MLA = """--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16
--qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm
--moe-shared-expert-intermediate-size 32 --moe-layer-freq '([0]*1+[1]*2)'
--moe-router-score-function sigmoid --moe-router-enable-expert-bias
"""


def test_moe_flags_build_mixtral_qwen3_moe_and_deepseek_v3():
    layout, arch = from_megatron(MOE_BASE)
    assert (arch.family, arch.experts, arch.top_k, arch.moe_ffn_hidden) == ("mixtral", 8, 2, 32)
    assert layout.dp == 8 and arch.dense_layers == () and not arch.shared_ffn_hidden
    _, arch = from_megatron(MOE_BASE + "--qk-layernorm --expert-tensor-parallel-size 1 "
                            "--group-query-attention --num-query-groups 2 --kv-channels 32")
    assert (arch.family, arch.head_dim, arch.kv_heads) == ("qwen3_moe", 32, 2)
    assert "head_dim=32" in arch.spec() and "num_experts=8" in arch.spec()
    _, arch = from_megatron(MOE_BASE + MLA)
    assert arch.family == "deepseek_v3" and arch.dense_layers == (0,)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.head_dim, arch.qk_rope_dim,
            arch.v_head_dim, arch.shared_ffn_hidden) == (32, 16, 16, 8, 16, 32)
    # the spec builds what the flags say: a dense first block, then routed + shared experts
    model = parse_model_spec(arch.spec()).build()
    first, moe = model.model.layers[0], model.model.layers[1]
    assert not hasattr(first.mlp, "experts") and first.mlp.gate_proj.out_features == 128
    assert moe.mlp.experts.gate_up_proj.shape[0] == 8
    assert moe.mlp.shared_experts.gate_proj.out_features == 32
    attn = moe.self_attn
    assert (attn.q_a_proj.out_features, attn.kv_a_proj_with_mqa.out_features,
            attn.o_proj.in_features) == (32, 16 + 8, 4 * 16)
    # megatron-core's own reading of the layer pattern (an int N: blocks 0, N, 2N, ...)
    _, arch = from_megatron(MOE_BASE.replace("--num-layers 3", "--num-layers 4") + MLA.replace(
        "'([0]*1+[1]*2)'", "'([0]*2+[1]*2)'"))
    assert arch.dense_layers == (0, 1)


@pytest.mark.parametrize("extra, error, words", [
    ("--expert-model-parallel-size 3", SpecError,
     "--expert-model-parallel-size 3: must divide the experts (8) and dp x cp x tp = 8"),
    ("--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2", NotSupportedError,
     "--expert-tensor-parallel-size 2: each expert split over tensor-parallel ranks"),
    ("--tensor-model-parallel-size 2", NotSupportedError,
     "(unset: Megatron takes --tensor-model-parallel-size 2)"),
    ("--expert-tensor-parallel-size 2", NotSupportedError,
     "write --expert-tensor-parallel-size 1"),
    ("--moe-extended-tp", NotSupportedError, "gone from main"),
    ("--moe-router-score-function sigmoid", NotSupportedError,
     "sigmoid without --multi-latent-attention"),
    ("--moe-router-topk-scaling-factor 2.5", NotSupportedError, "Mixtral renormalizes"),
    ("--moe-router-num-groups 3 --moe-router-group-topk 1", SpecError,
     "the groups must split the 8 experts evenly"),
    ("--moe-layer-freq 2", NotSupportedError, "dense blocks [1] without --multi-latent"),
    ("--moe-shared-expert-intermediate-size 64", NotSupportedError, "shared experts without"),
    ("--moe-layer-freq '[1,1]'", SpecError, "gives 2 blocks but --num-layers is 3"),
    ("--moe-layer-freq '__import__(1)'", SpecError, "not N or a list of 0 and 1"),
    ("--moe-router-topk 9", SpecError, "--moe-router-topk 9 with --num-experts 8"),
    ("--moe-token-dispatcher-type deepep", SpecError, "allgather, alltoall, flex"),
    ("--moe-ffn-hiden-size 32", SpecError, "did you mean --moe-ffn-hidden-size"),
    ("--multi-latent-attention --moe-layer-freq '([1]*2+[0])'", NotSupportedError,
     "keeps its dense blocks first"),
    ("--multi-latent-attention --moe-shared-expert-intermediate-size 48", NotSupportedError,
     "not a multiple of --moe-ffn-hidden-size 32"),
])
def test_moe_refusals_are_one_line(extra, error, words):
    text = MOE_BASE + extra
    if "--multi-latent-attention" in extra:
        text += " --q-lora-rank 32 --moe-router-score-function sigmoid"
    with pytest.raises(error) as info:
        from_megatron(text)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(NotSupportedError, match="without --q-lora-rank"):
        from_megatron(MOE_BASE + "--multi-latent-attention --moe-router-score-function sigmoid")


def test_moe_argument_files_import_and_price(tmp_path):
    """estimate --from megatron on MoE files: the DeepSeek-style model is traced and priced
    with its routed experts at top-k; an EP=8 file comes in with ep 8 on every stage."""
    from meshplan.cli import main

    path = tmp_path / "ds.txt"
    path.write_text(MOE_BASE + MLA)
    out = tmp_path / "plan.json"
    assert main(["estimate", "--from", "megatron", str(path), "--mesh", "dgx-h100",
                 "-o", str(out)]) == 0
    import meshplan
    plan = meshplan.Plan.from_json(str(out))
    assert plan.model.spec.startswith("transformers:deepseek_v3?")
    assert plan.predicted.fits and plan.predicted.step_time_s > 0
    path.write_text(MOE_BASE.replace("--expert-model-parallel-size 1",
                                     "--expert-model-parallel-size 8"))
    assert main(["estimate", "--from", "megatron", str(path), "--mesh", "dgx-h100",
                 "-o", str(out)]) == 0
    plan = meshplan.Plan.from_json(str(out))
    assert {st.ep for st in plan.stages} == {8} and plan.model.spec.startswith(
        "transformers:mixtral?")
    from meshplan.stacks import layout_of
    assert layout_of(plan).ep == 8 and '"ep": 8' in out.read_text()


def test_megatron_lm_parses_and_validates_the_moe_files():
    """The MoE argument files import reads (Mixtral, Qwen3-MoE at tp 2, DeepSeek-V3 with
    MLA) and the MoE exports (MOE_RUNS) pass Megatron-LM's own parser, ``validate_args`` and
    ``core_transformer_config_from_args``, which give the experts, top-k, expert width,
    shared experts, layer pattern and MLA ranks import reads. Needs MEGATRON_LM_DIR as above;
    validate_args asks the GPU's compute capability for --moe-grouped-gemm: an H100's (9, 0)."""
    import os
    import subprocess
    import sys

    root = os.environ.get("MEGATRON_LM_DIR")
    if not root or not os.path.isfile(os.path.join(root, "megatron/training/arguments.py")):
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout (main at "
                    "megatron.MEGATRON_LM_MAIN, or core_v0.16.1)")
    _needs_six(root)
    check = LM_CHECK.replace(
        "A.get_device_arch_version = lambda: 9",
        "A.get_device_arch_version = lambda: 9\nimport torch\n"
        "torch.cuda.get_device_capability = lambda *a: (9, 0)").replace(
        "    A.core_transformer_config_from_args(args)\n"
        "    print(\"OK\", args.data_parallel_size, args.virtual_pipeline_model_parallel_size)",
        "    c = A.core_transformer_config_from_args(args)\n"
        "    print('OK', args.data_parallel_size, c.num_moe_experts, c.moe_router_topk,"
        " c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size or 0,"
        " sum(c.moe_layer_freq) if isinstance(c.moe_layer_freq, list) else c.num_layers,"
        " c.q_lora_rank if c.multi_latent_attention else 0)")
    assert check != LM_CHECK
    texts = [MOE_BASE, MOE_BASE + "--qk-layernorm --expert-tensor-parallel-size 1 "
             "--group-query-attention --num-query-groups 2 --kv-channels 32", MOE_BASE + MLA]
    # and the MoE exports (ep > 1, the router flags)
    texts += [to_megatron(layout, arch_of_spec(preset)) for preset, layout in MOE_RUNS.values()]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p), OMP_NUM_THREADS="1")
    for text in texts:  # one process each: Megatron's globals are set once per process
        out = subprocess.run([sys.executable, "-W", "ignore", "-c", check], env=env, cwd=root,
                             input=text, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        got = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("OK")]
        layout, arch = from_megatron(text)
        assert [int(x) for x in got[0]] == [
            layout.dp, arch.experts, arch.top_k, arch.moe_ffn_hidden, arch.shared_ffn_hidden,
            arch.layers - len(arch.dense_layers), arch.q_lora_rank]


MOE_RUNS = {  # the MoE presets in layouts of the published runs' shapes (ep over dp x cp x tp)
    "mixtral-8x7b-64": ("mixtral-8x7b", StackLayout(
        dp=8, tp=2, pp=4, ep=8, global_batch=256, seq_len=4096, sequence_parallel=True,
        zero=1, recompute="selective")),
    "qwen3-30b-a3b-16": ("qwen3-30b-a3b", StackLayout(dp=16, ep=8, global_batch=256,
                                                      seq_len=4096, zero=1)),
    "qwen3-235b-a22b-256": ("qwen3-235b-a22b", StackLayout(
        dp=32, tp=2, pp=4, ep=16, global_batch=1024, seq_len=4096, sequence_parallel=True,
        zero=1, recompute="full", stage_layers=(23, 24, 24, 23))),
    "deepseek-v3-1024": ("deepseek-v3", StackLayout(
        dp=64, tp=2, pp=8, ep=64, global_batch=4096, seq_len=4096, sequence_parallel=True,
        zero=1, recompute="full", stage_layers=(7, 8, 8, 8, 8, 8, 8, 6))),
}


def test_moe_exports_write_main_flags_and_come_back():
    """--to megatron of the MoE presets: every flag is one Megatron-LM main takes, the experts,
    their layout and the router are written as the model's config says, and import gives back
    the layout (ep included) and the model."""
    for name, (preset, layout) in MOE_RUNS.items():
        arch = arch_of_spec(preset)
        text = to_megatron(layout, arch)
        f = flags_of(text)
        assert set(f) <= VERIFIED_FLAGS, name
        assert (f["--num-experts"], f["--moe-router-topk"], f["--moe-ffn-hidden-size"],
                f["--expert-model-parallel-size"], f["--expert-tensor-parallel-size"]) == (
            str(arch.experts), str(arch.top_k), str(arch.moe_ffn_hidden), str(layout.ep), "1")
        assert f["--moe-grouped-gemm"] is True and f["--moe-token-dispatcher-type"] == "alltoall"
        assert ("--moe-shared-expert-intermediate-size" in f) == bool(arch.shared_ffn_hidden)
        assert from_megatron(text) == (layout, arch), name
    f = flags_of(to_megatron(MOE_RUNS["deepseek-v3-1024"][1], arch_of_spec("deepseek-v3")))
    assert (f["--moe-router-score-function"], f["--moe-router-topk-scaling-factor"],
            f["--moe-router-num-groups"], f["--moe-router-group-topk"],
            f["--moe-layer-freq"]) == ("sigmoid", "2.5", "8", "4", "([0]*3+[1]*58)")
    assert f["--moe-router-enable-expert-bias"] is True and f["--multi-latent-attention"]
    # Qwen3-MoE with norm_topk_prob False: softmax over every expert, then top-k
    arch = dataclasses.replace(arch_of_spec("qwen3-30b-a3b"), norm_topk=False)
    layout = MOE_RUNS["qwen3-30b-a3b-16"][1]
    assert "--moe-router-pre-softmax" in to_megatron(layout, arch)
    assert from_megatron(to_megatron(layout, arch))[1] == arch
    bad = dataclasses.replace(layout, ep=16)
    assert problems(bad, arch_of_spec("mixtral-8x7b")) == (
        "ep=16 must divide the 8 experts (Megatron-LM: 'Number of experts should be a "
        "multiple of expert model parallel_size')",)
    assert "sequence parallelism must be used" in problems(
        dataclasses.replace(MOE_RUNS["mixtral-8x7b-64"][1], sequence_parallel=False),
        arch_of_spec("mixtral-8x7b"))[0]
    with pytest.raises(NotSupportedError, match="for a dense model"):
        to_megatron(dataclasses.replace(layout, ep=2), arch_of_spec("llama3.1-8b"))


def test_older_spellings_read_as_todays(llama):
    """Older Megatron-LM spellings (megatron.OLD_SPELLINGS) import as today's flags."""
    arch, layout = runs(llama)["8b-8"]
    text = to_megatron(layout, arch)
    old = text.replace("--norm-epsilon", "--layernorm-epsilon")
    assert from_megatron(old) == (layout, arch)
    fp8 = dataclasses.replace(layout, dtype="fp8")
    text = to_megatron(fp8, arch).replace("--fp8-format hybrid", "--fp8-hybrid")
    assert from_megatron(text) == (fp8, arch)


def test_megatron_core_accepts_the_moe_exports():
    """megatron-core 0.16.1's TransformerConfig (MLATransformerConfig for DeepSeek-V3) builds
    each MoE export, its __post_init__ checks run: experts, top-k, expert width, shared
    experts, layer pattern, expert layout and router as the export says."""
    pytest.importorskip("megatron.core")
    for name, (preset, layout) in MOE_RUNS.items():
        arch = arch_of_spec(preset)
        cfg, ddp, _ = megatron_configs(to_megatron(layout, arch))
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size,
                cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (
            arch.experts, arch.top_k, arch.moe_ffn_hidden, layout.ep, 1), name
        assert (cfg.moe_shared_expert_intermediate_size or 0) == arch.shared_ffn_hidden
        freq = cfg.moe_layer_freq
        routed = sum(freq) if isinstance(freq, list) else len(range(0, arch.layers, freq))
        assert routed == arch.layers - len(arch.dense_layers), name
        assert megatron_chunks(cfg) == layout.layers_per_chunk(arch.layers), name
        assert cfg.moe_router_score_function == ("sigmoid" if arch.family == "deepseek_v3"
                                                 else "softmax")
        assert (cfg.moe_router_topk_scaling_factor or 1.0) == arch.router_scale
        assert ddp.use_distributed_optimizer


def test_an_moe_plan_exports_with_its_ep_and_comes_back():
    """plan (a tiny Qwen3-MoE, experts split over ep=4 of dp 8) -> export_plan --to megatron
    -> from_megatron: the layout with its ep; the plan's stages carry ep into the file."""
    import meshplan
    from meshplan.specs import example_inputs
    from meshplan.stacks import layout_of
    from meshplan.stacks.commands import export_plan
    from meshplan.stacks.layout import with_ep

    spec = ("transformers:qwen3_moe?hidden_size=64&num_hidden_layers=2&num_attention_heads=4"
            "&num_key_value_heads=2&head_dim=16&intermediate_size=128&moe_intermediate_size=32"
            "&num_experts=8&num_experts_per_tok=2&vocab_size=256&max_position_embeddings=128")
    model = parse_model_spec(spec).build("meta")
    graph = meshplan.tracing.trace(model, example_inputs(model, 16, 64))
    mesh = meshplan.Mesh.preset("dgx-h100", nodes=1)
    plan = with_ep(meshplan.manual_plan(model, mesh, graph=graph, dp=8, zero=1,
                                        dtype="bf16", engine="megatron"), 4).with_spec(spec)
    assert {st.ep for st in plan.stages} == {4} and layout_of(plan).ep == 4
    text = export_plan(plan, "megatron", graph=graph)
    f = flags_of(text)
    assert f["--expert-model-parallel-size"] == "4" and f["--num-experts"] == "8"
    layout, arch = from_megatron(text)
    assert layout == layout_of(plan) and arch == arch_of_spec(spec)
