"""Runtime overhead: a meshplan-executed plan against the same parallelism written by hand.

trace -> cost -> solve -> plan -> **run**. On 4 local CPU processes (gloo) the same Llama
model trains with (a) 1-D tensor parallelism, (b) ZeRO-3, (c) dp=2 x tp=2 with ZeRO-3 and
(d) dp=2 x pp=2 pipelining (1F1B), once executed by meshplan and once written by hand with
torch.distributed's own APIs as torchtitan writes them (``parallelize_module`` with a
vocab-parallel embedding, ColwiseParallel / RowwiseParallel; ``fully_shard`` per block and
at the root; ``PipelineStage`` + ``Schedule1F1B`` on stage modules cut from the HF Llama,
with a flat gradient all-reduce over the dp group). Both engines are measured: the graph
engine (runtime/graph/spmd.py, its lowered program and the same plan on DTensor; pipelines by
runtime/graph/pipeline.py) and the module engine (runtime/modules.py, runtime/module_pipeline.py).
The implementations of a row step in turn in one launch, so machine load hits them alike;
the tables give median step times with quartiles and the per-step ratios (meshplan /
hand-written).

    python benchmarks/runtime_overhead.py [--configs tp,zero3,dpxtp,pipeline]
        [--module-configs tp,zero3,dpxtp,dpxpp,pp_tp] [--hidden 256 --layers 2 ...]

The script relaunches itself under torchrun; results go to
benchmarks/results/runtime_overhead_graph.{json,md} (graph engine rows, ``--configs``) and
benchmarks/results/runtime_overhead.{json,md} (module engine rows, ``--module-configs``);
an empty list skips that engine and leaves its files alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

WORLD = 4
RESULTS = Path(__file__).resolve().parent / "results"


def model_spec(args) -> str:
    return (f"transformers:llama?hidden_size={args.hidden}&intermediate_size={4 * args.hidden}"
            f"&num_hidden_layers={args.layers}&num_attention_heads={args.heads}"
            f"&num_key_value_heads={args.heads}&vocab_size={args.vocab}"
            f"&max_position_embeddings={max(args.seq, 128)}")


MANUAL = {"tp": "dp=1,tp=4,mb=8", "zero3": "dp=4,zero=3,mb=2",  # as `meshplan plan --manual`
          "dpxtp": "dp=2,tp=2,zero=3,mb=4", "pipeline": "dp=2,pp=2,mb=2"}
# The pipeline row, as the manual plan lays it out (checked against the plan below):
# ranks row-major over (pp, dp), blocks split evenly in order, embedding and rotary cos/sin
# in stage 0, final norm, lm_head and loss in the last stage; 1F1B over batch / (dp x mb)
# microbatches.
PP, PIPE_DP, PIPE_MB = 2, 2, 2


def meshplan_step(args, variant: str, lowered: bool):
    """The graph engine's train step on the plan ``MANUAL[variant]`` (``lowered=False``: every
    operator on DTensor, the reference executor): (step(i), the losses it appends)."""
    from meshplan.specs import parse_manual_spec
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    spec = parse_model_spec(model_spec(args))
    meta = spec.build(device="meta")
    graph = trace(meta, example_inputs(meta, args.batch, args.seq))
    plan = build_manual_plan(graph, Mesh.local(WORLD), **parse_manual_spec(MANUAL[variant]))
    if variant == "pipeline":  # the hand-written version below hard-codes this layout
        t = plan.training
        assert [tuple(st.layers) for st in plan.stages] == layer_ranges(args.layers), plan.stages
        assert [tuple(st.mesh_shape) for st in plan.stages] == [(PIPE_DP, 1)] * PP
        assert (t.schedule, t.microbatches) == ("1f1b", args.batch // (PIPE_DP * PIPE_MB)), t
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.steps + args.warmup)]
    pm = parallelize_graph(model, plan, (batches[0],), lowered=lowered)
    opt = make_optimizer(pm.optimizer_params(), pm.plan)
    losses = []

    def step(i):
        losses.append(pm.train_step(batches[i], opt))
    step.engine, step.optimizer, step.batches = pm, opt, batches  # for pipeline_phases.py
    return step, losses


def layer_ranges(layers: int) -> list[tuple[int, int]]:
    """Blocks of each pipeline stage: contiguous and equal (planner/manual.py's split)."""
    assert layers % PP == 0, f"--layers {layers} must be a multiple of pp={PP}"
    return [(s * layers // PP, (s + 1) * layers // PP) for s in range(PP)]


class LlamaStage(nn.Module):
    """Blocks [first, last) of an HF ``LlamaForCausalLM``, as torchtitan cuts one: stage 0
    also embeds the tokens and makes the rotary cos/sin (sent on with the hidden states),
    the last stage also applies the final norm and lm_head. The mask is made as
    ``LlamaModel.forward`` makes it (None for SDPA without padding: causal attention).
    ``send_ids``: stage 0 also sends the token ids on, as meshplan's stages do for the loss
    in the last stage's graph (the last stage ignores them: its loss reads the schedule's
    target); for timing that send alone (benchmarks/pipeline_phases.py)."""

    def __init__(self, model: nn.Module, first: int, last: int, *, is_first: bool,
                 is_last: bool, send_ids: bool = False):
        super().__init__()
        self.send_ids = send_ids
        assert not model.config.tie_word_embeddings, "a tied lm_head spans two stages"
        self.config = model.config
        self.embed_tokens = model.model.embed_tokens if is_first else None
        self.rotary_emb = model.model.rotary_emb if is_first else None
        self.layers = nn.ModuleList(model.model.layers[first:last])
        self.norm = model.model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x, cos=None, sin=None, ids=None):
        from transformers.masking_utils import create_causal_mask

        if self.embed_tokens is not None:
            ids = x
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(h, position_ids=positions)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=(cos, sin),
                      position_ids=positions)
        if self.lm_head is not None:
            return self.lm_head(self.norm(h))
        return (h, cos, sin, ids) if self.send_ids else (h, cos, sin)


def handwritten_pipeline_step(args, send_ids: bool = False):
    """dp=2 x pp=2 with torch.distributed.pipelining: one ``PipelineStage`` per rank on its
    pp lane, ``Schedule1F1B``, then one flat all-reduce of the stage's gradients over its dp
    group, then Adam. Returns (step(i), the global-batch mean loss of each step).
    ``send_ids``: stage 0 also sends the token ids (``LlamaStage``)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from meshplan.tracing import next_token_loss
    from meshplan.specs import parse_model_spec, synthetic_batch

    torch.manual_seed(0)
    model = parse_model_spec(model_spec(args)).build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.steps + args.warmup)]
    mesh = init_device_mesh("cpu", (PP, PIPE_DP), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = stage_index == 0, stage_index == PP - 1
    module = LlamaStage(model, *layer_ranges(args.layers)[stage_index], is_first=first,
                        is_last=last, send_ids=send_ids)
    microbatches = args.batch // (PIPE_DP * PIPE_MB)
    # Static shapes, as meshplan gives them: cos/sin carry no gradient back.
    head_dim = args.hidden // args.heads
    sent = (torch.empty(PIPE_MB, args.seq, args.hidden, requires_grad=True),
            torch.empty(1, args.seq, head_dim), torch.empty(1, args.seq, head_dim)) + \
        ((torch.zeros(PIPE_MB, args.seq, dtype=torch.long),) if send_ids else ())
    stage = PipelineStage(
        module, stage_index, PP, torch.device("cpu"),
        input_args=(torch.zeros(PIPE_MB, args.seq, dtype=torch.long),) if first else sent,
        output_args=(torch.empty(PIPE_MB, args.seq, args.vocab),) if last else sent,
        group=mesh["pp"].get_group())

    def loss_fn(logits, ids):  # the sum over microbatches and dp ranks is the global mean
        return next_token_loss(logits, ids) / (microbatches * PIPE_DP)
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn,
                            scale_grads=False)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3, foreach=False)
    dp_group = mesh["dp"].get_group()

    def local(b):  # microbatch j of dp rank d = rows [j*dp*mb + d*mb, ... + mb), as meshplan
        return b.view(microbatches, PIPE_DP, PIPE_MB, args.seq)[:, dp_rank].reshape(-1, args.seq)
    step_losses = []

    def step(i):
        ids = local(batches[i])
        losses: list = []
        schedule.step(ids, target=ids, losses=losses, return_outputs=False)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=dp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # every rank learns the global mean loss each step, as meshplan's train_step returns it
        total = torch.zeros((), dtype=torch.float64)  # zero off the last stage
        for loss in losses:
            total += loss.detach().to(torch.float64)
        dist.all_reduce(total)
        step_losses.append(float(total.item()))
    return step, step_losses


# Module engine rows (runtime/modules.py): the plan applied to the HF model itself with
# parallelize_module / fully_shard, against the same composables written by hand as
# torchtitan writes them (vocab-parallel embedding, Colwise q/k/v/gate/up, Rowwise o/down,
# lm_head Colwise gathering its logits; fully_shard per block then the root). The two run
# alternately, step by step, in the same launch, so machine load hits both alike.
MODULE_MANUAL = {"tp": "dp=1,tp=4,mb=8", "zero3": "dp=4,zero=3,mb=2",
                 "dpxtp": "dp=2,tp=2,zero=3,mb=4",
                 # pipelines (runtime/module_pipeline.py): 8 processes (dp x tp x pp) are
                 # too many for this machine, so dp2 x pp2 and pp2 x tp2 on 4
                 "dpxpp": "dp=2,pp=2,zero=2,mb=2", "pp_tp": "dp=1,tp=2,pp=2,mb=2"}
# (dp, tp, pp) of each module row
MODULE_MESH = {"tp": (1, WORLD, 1), "zero3": (WORLD, 1, 1), "dpxtp": (2, 2, 1),
               "dpxpp": (2, 1, 2), "pp_tp": (1, 2, 2)}


def module_engine_step(args, variant: str):
    from meshplan.specs import parse_manual_spec
    from meshplan.planner.manual import build_manual_plan
    from meshplan.mesh import Mesh
    from meshplan.tracing import trace
    from meshplan.runtime.module_pipeline import PipelineModuleEngine
    from meshplan.runtime.modules import ModuleEngine
    from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch

    spec = parse_model_spec(model_spec(args))
    meta = spec.build(device="meta")
    graph = trace(meta, example_inputs(meta, args.batch, args.seq))
    plan = build_manual_plan(graph, Mesh.local(WORLD), **parse_manual_spec(MODULE_MANUAL[variant]))
    torch.manual_seed(0)
    model = spec.build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.module_steps + args.warmup)]
    engine = (PipelineModuleEngine if plan.num_stages > 1 else ModuleEngine)(model, plan)
    opt = torch.optim.Adam(engine.parameters(), lr=1e-3, foreach=False)
    per = args.batch // engine.dp_size
    losses = []

    def step(i):
        ids = batches[i][engine.dp_rank * per:(engine.dp_rank + 1) * per]
        losses.append(engine.train_step((ids,), {}, ()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, losses


def handwritten_module_step(args, variant: str):
    """torchtitan's parallelize_llama for this HF Llama, by hand, on the plan's (dp, tp) mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from meshplan.tracing import TrainingModule
    from meshplan.specs import parse_model_spec, synthetic_batch

    torch.manual_seed(0)
    model = parse_model_spec(model_spec(args)).build(device="cpu")
    batches = [synthetic_batch(model, args.batch, args.seq, seed=0, step=s)
               for s in range(args.module_steps + args.warmup)]
    dp, tp, pp = MODULE_MESH[variant]
    if pp > 1:
        return handwritten_module_pipeline(args, model, batches, dp, tp, pp)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(model, mesh["tp"], {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())})
        for layer in model.model.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    if dp > 1:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    rank, per = mesh["dp"].get_local_rank(), args.batch // dp
    step_fn = TrainingModule(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    losses = []

    def step(i):
        loss = step_fn(batches[i][rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()  # the global mean, as train_step returns it
        if dp > 1:
            dist.all_reduce(total, group=mesh["dp"].get_group())
        losses.append(float(total.item()) / dp)
    return step, losses


def handwritten_module_pipeline(args, model, batches, dp: int, tp: int, pp: int):
    """torchtitan's pipeline_llama + parallelize_llama by hand: ranks (pp, dp, tp) row-major,
    one ``LlamaStage`` per rank (cos/sin sent on), ``parallelize_module`` on its tp mesh,
    ``fully_shard`` per block and the stage with reshard_after_forward=False (torchtitan's
    choice under pp), ``PipelineStage`` + ``Schedule1F1B`` (mean over microbatches)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from meshplan.tracing import next_token_loss

    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    first, last = index == 0, index == pp - 1
    lo, hi = index * args.layers // pp, (index + 1) * args.layers // pp
    module = LlamaStage(model, lo, hi, is_first=first, is_last=last)
    if tp > 1:
        outer = {"embed_tokens": RowwiseParallel(input_layouts=Replicate())} if first else {}
        if last:
            outer["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(module, mesh["tp"], outer)
        for layer in module.layers:
            parallelize_module(layer, mesh["tp"], {
                "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()})
    if dp > 1:
        for layer in module.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    per = args.batch // dp
    microbatches = per // int(MODULE_MANUAL_MB)
    schedule = Schedule1F1B(PipelineStage(module, index, pp, torch.device("cpu"),
                                          group=mesh["pp"].get_group()),
                            n_microbatches=microbatches, loss_fn=next_token_loss)
    opt = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-3,
                           foreach=False)
    losses = []

    def step(i):
        ids = batches[i][dp_rank * per:(dp_rank + 1) * per]
        got: list = []
        schedule.step(*((ids,) if first else ()), target=ids if last else None,
                      losses=got if last else None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)  # the global mean on every rank
        if last:
            total += torch.stack([x.detach().double() for x in got]).mean() / dp
        dist.all_reduce(total)
        losses.append(float(total.item()) / tp)  # every tp peer added the same value
    return step, losses


MODULE_MANUAL_MB = 2  # mb of the pipeline rows above


def alternating_times(steps: dict, n: int, warmup: int) -> dict[str, list[float]]:
    """Step times of two step functions run in pairs, the order flipped every pair (a b, b a,
    a b, ...): a slow spell of the machine lands on both alike, and neither always runs
    first after the barrier (or second, with the other's memory traffic in its caches)."""
    import torch.distributed as dist

    times = {name: [] for name in steps}
    names = list(steps)
    for i in range(warmup + n):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            start = time.perf_counter()
            steps[name](i)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median: the order statistics
    n/2 -+ 1.96 sqrt(n)/2 (the normal approximation of the binomial sign test)."""
    ys = sorted(xs)
    half = 1.96 * len(ys) ** 0.5 / 2
    lo = max(0, int(len(ys) / 2 - half))
    hi = min(len(ys) - 1, int(len(ys) / 2 + half + 0.999))
    return ys[lo], ys[hi]


def module_engine_row(args, variant: str) -> dict:
    ours, our_losses = module_engine_step(args, variant)
    theirs, their_losses = handwritten_module_step(args, variant)
    t = alternating_times({"engine": ours, "hand": theirs}, args.module_steps, args.warmup)
    ratios = [a / b for a, b in zip(t["engine"], t["hand"])]
    return {"config": variant, "plan": MODULE_MANUAL[variant],
            "engine_ms": [x * 1e3 for x in quartiles(t["engine"])],
            "handwritten_ms": [x * 1e3 for x in quartiles(t["hand"])],
            "ratio": statistics.median(ratios),  # the median of the per-pair ratios
            "ratio_of_medians": statistics.median(t["engine"]) / statistics.median(t["hand"]),
            "pair_ratio_quartiles": list(quartiles(ratios)),
            "ratio_ci95": list(median_interval(ratios)), "pairs": len(ratios),
            "engine_first_loss": our_losses[0], "handwritten_first_loss": their_losses[0]}


def graph_engine_row(args, variant: str) -> dict:
    """The graph engine (lowered program), the same plan on DTensor, and the hand-written
    code, stepping in turn; the pipeline row's hand-written code is ``handwritten_pipeline_step``,
    the others torchtitan's composables by hand (``handwritten_module_step``)."""
    ours, our_losses = meshplan_step(args, variant, lowered=True)
    reference, ref_losses = meshplan_step(args, variant, lowered=False)
    theirs, their_losses = (handwritten_pipeline_step(args) if variant == "pipeline"
                            else handwritten_module_step(args, variant))
    t = alternating_times({"lowered": ours, "hand": theirs, "dtensor": reference}, args.steps,
                          args.warmup)
    ratios = [a / b for a, b in zip(t["lowered"], t["hand"])]
    dt_ratios = [a / b for a, b in zip(t["dtensor"], t["hand"])]
    return {"config": variant, "plan": MANUAL[variant],
            "meshplan_ms": [x * 1e3 for x in quartiles(t["lowered"])],
            "handwritten_ms": [x * 1e3 for x in quartiles(t["hand"])],
            "dtensor_executor_ms": [x * 1e3 for x in quartiles(t["dtensor"])],
            "ratio": statistics.median(t["lowered"]) / statistics.median(t["hand"]),
            "pair_ratio_quartiles": list(quartiles(ratios)),
            "dtensor_ratio": statistics.median(t["dtensor"]) / statistics.median(t["hand"]),
            "dtensor_pair_ratio_quartiles": list(quartiles(dt_ratios)),
            "meshplan_first_loss": our_losses[0], "dtensor_first_loss": ref_losses[0],
            "handwritten_first_loss": their_losses[0]}


def worker(args) -> None:
    import logging

    import torch.distributed as dist

    for name in ("torch.distributed.tensor._redistribute", "torch._logging._internal"):
        logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    module_rows = [module_engine_row(args, v) for v in filter(None, args.module_configs.split(","))]
    rows = [graph_engine_row(args, v) for v in filter(None, args.configs.split(","))]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"rows": rows, "module_rows": module_rows}))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--configs", default="tp,zero3,dpxtp,pipeline",
                    help="graph engine rows (runtime/graph/spmd.py): tp, zero3, dpxtp, pipeline "
                         "(dp2 x pp2, runtime/graph/pipeline.py)")
    ap.add_argument("--module-configs", default="tp,zero3,dpxtp,dpxpp,pp_tp",
                    help="module engine rows (runtime/modules.py): tp, zero3, dpxtp, dpxpp, "
                         "pp_tp (pipelines: runtime/module_pipeline.py)")
    ap.add_argument("--module-steps", type=int, default=60,
                    help="step pairs per module engine row (after --warmup)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if "LOCAL_RANK" in os.environ:
        worker(args)
        return 0
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "rows.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}",
               "--nnodes=1", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
               "--max_restarts=0", __file__, *sys.argv[1:], "--out", str(raw)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
               "LOGLEVEL": "WARNING"}
        subprocess.run(cmd, env=env, check=True)
        got = json.loads(raw.read_text())
    rows, module_rows = got["rows"], got["module_rows"]
    setup = (f"Llama hidden={args.hidden} layers={args.layers} heads={args.heads} "
             f"vocab={args.vocab}, batch {args.batch} x seq {args.seq}, fp32, Adam, "
             f"{WORLD} CPU processes (gloo), {args.steps} steps after {args.warmup}")
    if rows:
        write_results("runtime_overhead_graph", setup, rows, graph_table(rows))
    if module_rows:
        write_results("runtime_overhead", setup, module_rows, module_table(module_rows))
    return 0


def graph_table(rows: list[dict]) -> list[str]:
    lines = ["# Runtime overhead: the graph engine vs hand-written torch.distributed", "",
             "meshplan runs the plan `meshplan plan --manual ...` writes with the lowered "
             "program (runtime/graph/lowering.py); the DTensor columns run the same plan with every "
             "operator on DTensor (the reference executor, `parallelize_graph(..., lowered=False)`). "
             "Hand-written: tp, zero3, dpxtp = torchtitan's composables by hand on the plan's "
             "(dp, tp) mesh (vocab-parallel embedding, Colwise q/k/v/gate/up, Rowwise o/down, "
             "lm_head Colwise gathering logits; fully_shard per block then the root); pipeline "
             "= ranks (pp, dp) row-major as meshplan places them, `PipelineStage` per rank, "
             "`Schedule1F1B` with the plan's microbatches, then one flat all-reduce of the "
             "stage's gradients over its dp group. Adam (lr 1e-3, foreach=False) everywhere. "
             "The three step in turn (lowered, hand-written, DTensor) in one launch. Times: "
             "median [quartiles] ms; pair ratios: median [quartiles] of meshplan/hand per "
             "step.", "",
             "| config | plan | meshplan ms | hand-written ms | ratio | pair ratios "
             "| DTensor executor ms | its pair ratios | first loss (meshplan / DTensor / hand) |",
             "|---|---|---|---|---:|---|---|---|---|"]
    for r in rows:
        e, h, d = r["meshplan_ms"], r["handwritten_ms"], r["dtensor_executor_ms"]
        q, dq = r["pair_ratio_quartiles"], r["dtensor_pair_ratio_quartiles"]
        lines.append(f"| {r['config']} | `{r['plan']}` | {e[1]:.1f} [{e[0]:.1f}, {e[2]:.1f}] "
                     f"| {h[1]:.1f} [{h[0]:.1f}, {h[2]:.1f}] | {r['ratio']:.3f} | "
                     f"{q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}] | "
                     f"{d[1]:.1f} [{d[0]:.1f}, {d[2]:.1f}] | {dq[1]:.2f} [{dq[0]:.2f}, {dq[2]:.2f}] | "
                     f"{r['meshplan_first_loss']:.5f} / {r['dtensor_first_loss']:.5f} / "
                     f"{r['handwritten_first_loss']:.5f} |")
    return lines


def module_table(module_rows: list[dict]) -> list[str]:
    lines = ["# Runtime overhead: the module engine vs hand-written torch.distributed", "",
             "The plan applied to the HF model with parallelize_module / fully_shard "
             "(`ModuleEngine.train_step`), against torchtitan-style code on the same "
             "(dp, tp) mesh (vocab-parallel embedding, Colwise q/k/v/gate/up, Rowwise "
             "o/down, lm_head Colwise gathering logits; fully_shard per block then the "
             "root). Pipeline rows (dpxpp, pp_tp; runtime/module_pipeline.py): the "
             "engine cuts stage modules from the model and runs PipelineStage + "
             "Schedule1F1B; by hand, a LlamaStage per rank with the same tp styles and "
             "fully_shard(reshard_after_forward=False) per block and stage, "
             "Schedule1F1B. The two step in pairs in one launch, the order flipped "
             "every pair (engine, hand; hand, engine; ...), so a slow spell of the shared "
             "machine hits both alike. ratio: the median over pairs of engine/hand; "
             "95% CI: a distribution-free interval of that median (order statistics, "
             "sign test); pair ratios: their quartiles. Times: median [quartiles] ms. "
             "A config is reliably over the 1.05 target only when the CI's lower end is. "
             "The graph engine's rows: runtime_overhead_graph.md.",
             "",
             "| config | plan | engine ms | hand-written ms | ratio (median of pairs) "
             "| 95% CI | pair ratio quartiles | pairs | first loss (engine / hand) |",
             "|---|---|---|---|---:|---|---|---:|---|"]
    for r in module_rows:
        e, h, q = r["engine_ms"], r["handwritten_ms"], r["pair_ratio_quartiles"]
        lo, hi = r["ratio_ci95"]
        lines.append(f"| {r['config']} | `{r['plan']}` | {e[1]:.1f} [{e[0]:.1f}, {e[2]:.1f}] "
                     f"| {h[1]:.1f} [{h[0]:.1f}, {h[2]:.1f}] | {r['ratio']:.3f} | "
                     f"[{lo:.3f}, {hi:.3f}] | [{q[0]:.3f}, {q[2]:.3f}] | {r['pairs']} | "
                     f"{r['engine_first_loss']:.5f} / {r['handwritten_first_loss']:.5f} |")
    return lines


def write_results(name: str, setup: str, rows: list[dict], lines: list[str]) -> None:
    """results/<name>.md (the table) and results/<name>.json (the rows)."""
    lines = lines[:2] + [setup, ""] + lines[2:]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / f"{name}.md").write_text(text)
    (RESULTS / f"{name}.json").write_text(json.dumps({"setup": setup, "rows": rows},
                                                      indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
