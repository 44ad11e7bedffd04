"""Worker for tests/test_moe_ep.py: expert parallelism through the public API in a user's
own loop (issue 39), one launch of 4 gloo processes for every case.

Each case is a mixture-of-experts model and a layout with ``ep``: the model built on meta,
``meshplan.manual_plan(..., ep=N)`` on rank 0 (the others read its plan), ``parallelize``,
the seeded state loaded with ``broadcast_from_rank0``, a stock AdamW with an LR warmup, each
rank passing only its own rows, ``clip_grad_norm_`` below every step's norm, eval outputs and
``full_state_dict`` (tests/_user_loss_worker.py's loop). The test compares them with one
plain PyTorch process (``reference``); a layout the plan refuses is recorded as refused.

    python -m torch.distributed.run --nproc_per_node 4 tests/_moe_ep_worker.py OUT CASES

CASES: ``model:layout`` joined by commas; a layout is axes joined by "x", e.g. dp4xep2.
"""

from __future__ import annotations

import pathlib
import re
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests.harness
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import _user_loss_worker as loop  # noqa: E402 - the user's loop, data and loss
import moe_grouped  # noqa: E402

VOCAB = 64
# The transformers models are planned and run with their default experts ("grouped_mm",
# torch's grouped GEMM in fp32 on CPU; the loop over hit experts does not trace on meta) and
# the one-process reference runs the loop ("eager"): grouped_mm takes no float64, which the
# harness's fp64 reference needs. Same weights, same math, one module class.
GROUPED_MM = "grouped_mm"


def mixtral(experts: str = "eager"):
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, attn_implementation="sdpa",
        experts_implementation=experts))


def qwen3_moe(experts: str = "eager"):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=32, attn_implementation="sdpa",
        experts_implementation=experts))


def deepseek_style(grouped: bool = False):
    """examples/moe_grouped.py: a dense first block, then MoE blocks with a shared expert and
    sigmoid top-k routing. Planned as written (the grouped GEMM traces on meta); run with
    its eager expert loop (``use_grouped_mm=False``: ``torch._grouped_mm`` takes bf16 only,
    and the exact comparison runs fp32 on CPU)."""
    return moe_grouped.MoEDecoder(vocab_size=VOCAB, dim=32, layers=3, heads=4, num_experts=4,
                                  top_k=2, expert_hidden=32, dense_hidden=64, dense_layers=1,
                                  shared_hidden=32, score="sigmoid", max_seq=loop.SEQ,
                                  use_grouped_mm=grouped)


# name: (the reference's build, the run's build, the plan's build on meta)
MODELS = {"mixtral": (mixtral, lambda: mixtral(GROUPED_MM), lambda: mixtral(GROUPED_MM)),
          "qwen3_moe": (qwen3_moe, lambda: qwen3_moe(GROUPED_MM), lambda: qwen3_moe(GROUPED_MM)),
          "deepseek": (deepseek_style, deepseek_style, lambda: deepseek_style(grouped=True))}


def parse(layout: str) -> dict:
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"(dp|tp|pp|cp|ep)([1-9][0-9]*)", layout)}


def initial_state(name: str) -> dict:
    torch.manual_seed(loop.SEED)
    model = MODELS[name][0]()
    return {k: v.clone() for k, v in [*model.state_dict().items(), *model.named_buffers()]}


def reference(name: str):
    """One plain process on the whole global batch (fp32 and fp64: the harness's rule)."""
    from tests.harness.equivalence import expected

    def start():
        model = MODELS[name][0]()
        model.load_state_dict(initial_state(name), strict=False)
        return model
    return expected(start, [loop.tokens(s) for s in range(loop.STEPS)],
                    lambda model, b: loop._logits(model(*b[0])),
                    lambda out, b: loop.token_ce(out, *b[1]),
                    optimizer=lambda params: torch.optim.AdamW(params, lr=loop.LR),
                    schedule=loop._schedule, clip=loop.CLIP, eval_batch=loop.tokens(loop.STEPS))


def run_case(name: str, layout: str) -> dict:
    import meshplan

    _, build, plan_build = MODELS[name]
    answer = [None]
    if dist.get_rank() == 0:
        with torch.device("meta"):
            meta = plan_build()
        inputs, targets = loop.tokens(0)
        try:
            plan = meshplan.manual_plan(
                meta, meshplan.Mesh.local(dist.get_world_size()),
                example_inputs=tuple(x.to("meta") for x in inputs),
                example_targets=tuple(t.to("meta") for t in targets), loss_fn=loop.token_ce,
                **parse(layout))
            answer = [("plan", plan.to_json_text())]
        except meshplan.MeshplanError as exc:
            answer = [("refused", f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(answer, src=0)
    kind, text = answer[0]
    if kind == "refused":
        return {"refused": text}
    plan = meshplan.Plan.from_json_text(text)
    with torch.device("meta"):
        model = build()
    run = meshplan.parallelize(model, plan, loss_fn=loop.token_ce)
    run.load_full_state_dict(initial_state(name) if dist.get_rank() == 0 else None,
                             broadcast_from_rank0=True)
    opt = torch.optim.AdamW(run.parameters(), lr=loop.LR)
    sched = loop._schedule(opt)
    losses, norms = [], []
    for step in range(loop.STEPS):
        inputs, targets = loop.tokens(step)
        losses.append(run.train_step(tuple(loop._rows(x, run) for x in inputs),
                                     targets=tuple(loop._rows(t, run) for t in targets)))
        norms.append(float(run.clip_grad_norm_(loop.CLIP)))
        opt.step(), sched.step(), opt.zero_grad()
    run.eval()
    inputs, _ = loop.tokens(loop.STEPS)
    mine = loop._logits(run(tuple(loop._rows(x, run) for x in inputs)))
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (run.dp_rank, mine.detach().double().cpu()))
    have = dict(shards)
    out = torch.cat([have[r] for r in range(run.dp_size)])
    run.train()
    st = plan.stages[0]
    return {"losses": losses, "norms": norms, "eval": out, "final": run.full_state_dict(),
            "engine": run.engine_name, "summary": plan.summary(),
            "layout": f"{run.engine_name} engine, {plan.num_stages} stage(s), mesh "
                      f"{list(st.mesh_shape)} {list(st.axis_names)}, ep={st.ep}"}


def main(out: str, cases: str) -> int:
    import logging
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    results = {}
    for case in cases.split(","):
        name, layout = case.split(":")
        try:
            results[case] = run_case(name, layout)
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
            results[case] = {"error": f"{type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0] if str(exc) else ''}",
                             "traceback": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
