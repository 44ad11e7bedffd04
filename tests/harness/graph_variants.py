"""Run several plan variants of one model in one torchrun launch and record their numerics.

trace -> cost -> solve -> plan -> **run**. The runtime's equivalence check: every variant
(data parallel, 1-D tensor parallel, hybrid DP x TP, sequence parallel, 2-D weight sharding,
ZeRO-1/2/3, recompute, gradient accumulation, mixed precision) trains the same model from
the same seed on the same batches; rank 0 saves each (model, variant)'s per-step losses and its last
step's gradients (full tensors, by parameter name) with ``torch.save``. Tests and benchmarks
compare them with a single-process run. One launch serves many variants, because starting
the processes costs more than the three steps each variant trains.

    torchrun --nproc_per_node 4 -m tests.harness.graph_variants --model SPEC \\
        --variants dp,tp,hybrid,sp,2d,zero3 --out results.pt
"""

from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from meshplan.mesh import Mesh
from meshplan.tracing import export_training_graph, graph_from_export
from meshplan.runtime.graph.parallelize import TracedProgram, make_optimizer, parallelize_graph
from meshplan.runtime.shared import meta_copy
from meshplan.specs import example_inputs, parse_model_spec, synthetic_batch
from tests.harness.variants import unpriced_plan, with_observed_ops, with_param_placements

# variant -> (mesh shape as a function of the world size W, dp axis, tp axis, options)
VARIANTS = {
    "dp": (lambda w: (w,), 0, None, {}),
    "tp": (lambda w: (w,), None, 0, {}),
    "hybrid": (lambda w: (2, w // 2), 0, 1, {}),
    "sp": (lambda w: (2, w // 2), 0, 1, {"sequence_parallel": True}),
    "2d": (lambda w: (2, w // 2), 0, 1, {"shard_2d": True}),
    "zero1": (lambda w: (w,), 0, None, {"zero": 1}),
    "zero2": (lambda w: (w,), 0, None, {"zero": 2}),
    "zero3": (lambda w: (w,), 0, None, {"zero": 3}),
    "hybrid-zero3": (lambda w: (2, w // 2), 0, 1, {"zero": 3}),
    "hybrid-zero2": (lambda w: (2, w // 2), 0, 1, {"zero": 2}),
    "recompute-full": (lambda w: (2, w // 2), 0, 1, {"recompute": "full"}),
    "recompute-selective": (lambda w: (2, w // 2), 0, 1, {"recompute": "selective"}),
    "microbatches": (lambda w: (w,), 0, None, {"microbatches": 2}),
    "bf16": (lambda w: (w,), 0, None, {"dtype": "bf16"}),
}


def variant_plan(name: str, graph, world: int, *, hw):
    """The plan of variant ``name`` with parameter placements set and ops still empty."""
    shape_of, dp_axis, tp_axis, opts = VARIANTS[name]
    shape = shape_of(world)
    names = ("dp", "tp") if len(shape) == 2 else (("tp",) if tp_axis == 0 else ("dp",))
    base = unpriced_plan(graph, Mesh(shape, hw, names))
    plan = with_param_placements(base, tp_axis=tp_axis, dp_axis=dp_axis,
                                 zero=opts.get("zero", 0), shard_2d=opts.get("shard_2d", False),
                                 sequence_parallel=opts.get("sequence_parallel", False))
    training = replace(plan.training, microbatches=opts.get("microbatches", 1),
                       dtype=opts.get("dtype", "fp32"))
    stage = replace(plan.stages[0], recompute=opts.get("recompute", "none"))
    return replace(plan, training=training, stages=(stage,)), tp_axis


def hidden_size(model) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "hidden_size", 0) or getattr(cfg, "n_embd", 0))


def manual_variant(name: str, graph, world: int, *, hw):
    """``manual:dp=2+tp=2+...`` (``--manual`` keys joined by +): the plan
    meshplan.manual_plan builds, run with its own operator placements."""
    from meshplan.specs import parse_manual_spec
    from meshplan.planner.manual import build_manual_plan

    return build_manual_plan(graph, Mesh((world,), hw, ("proc",)),
                             **parse_manual_spec(name.removeprefix("manual:").replace("+", ",")))


def sp_only(plan, before: dict, observed: dict):
    """The plan keeping only the ops the SP / ZeRO-3 rewrites changed."""
    ops = {k: v for k, v in plan.stages[0].ops.items() if observed.get(k) != v}
    return replace(plan, stages=(replace(plan.stages[0], ops=ops),))


def run_variant(name: str, spec, graph, program, *, batch: int, seq: int, steps: int,
                seed: int, hw) -> dict:
    manual = name.startswith("manual:")
    if manual:
        plan, tp_axis = manual_variant(name, graph, dist.get_world_size(), hw=hw), None
    else:
        plan, tp_axis = variant_plan(name, graph, dist.get_world_size(), hw=hw)
    torch.manual_seed(seed)
    model = spec.build(device="cpu")
    batches = [synthetic_batch(model, batch, seq, seed=seed, step=s) for s in range(steps)]
    pm = parallelize_graph(model, plan, (batches[0],), program=program)
    if not manual:
        with torch.no_grad():  # let DTensor choose every operator's placements once
            pm.loss(batches[0][: batch // plan.training.microbatches], record=True)
        pm.plan = with_observed_ops(plan, pm.last_stats.observed, graph, tp_axis=tp_axis,
                                    hidden=hidden_size(model))
        if plan.training.sequence_parallel or plan.stages[0].zero >= 3:
            # placements downstream of the SP / ZeRO-3 rewrites change:
            pm.plan = sp_only(pm.plan, plan.stages[0].ops, pm.last_stats.observed)
            with torch.no_grad():  # observe again with only the SP ops planned
                pm.loss(batches[0][: batch // plan.training.microbatches], record=True)
            pm.plan = replace(pm.plan, stages=(replace(pm.plan.stages[0],
                                                       ops=pm.last_stats.observed),))
    optimizer = make_optimizer(pm.optimizer_params(), pm.plan)
    losses, grads = [], {}
    for step, b in enumerate(batches):
        losses.append(pm.train_step(b, optimizer, grads_out=grads if step == steps - 1 else None))
    return {"losses": losses, "grads": grads, "plan": pm.plan.to_json_text(),
            "redistributions": pm.last_stats.redistributions,
            "deviations": len(pm.last_stats.output_deviations),
            # ZeRO-3's bucketed gathers: (mesh axis, each member's sharded dim) per bucket
            "buckets": sorted({(b[0], b[2]) for b in pm._executor.gathers.bucket_of.values()})
            if pm._executor else [],
            "on_dtensor": [(s.node.name, s.why) for s in pm._executor.steps.values()
                           if s.kind == "dtensor"] if pm._executor else []}


def check_strategies(ep, graph, seen: set) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.runtime.graph.programs import runnable_graph_module
    from tests.harness.strategy_check import check_all

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2) if world >= 4 else (world,))
    return check_all(graph, runnable_graph_module(ep, device_type="cpu"), mesh, seen=seen)


def quiet_dtensor_logs() -> None:
    """DTensor warns on every 2-D Partial reduction and every gloo all-to-all fallback."""
    import logging
    for name in ("torch.distributed.tensor._redistribute", "torch._logging._internal"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="meshplan-equivalence")
    ap.add_argument("--model", required=True, action="append",
                    help="a model spec; repeat for several models in one launch")
    ap.add_argument("--variants", default=[], action="append",
                    help="comma-separated: " + ",".join(VARIANTS) + "; once for all models, "
                    "or once per --model in the same order")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="process-group timeout")
    ap.add_argument("--check-strategies", action="store_true",
                    help="also run every strategy of every planner rule, one operator at a "
                    "time, on a 2 x W/2 mesh (tests/harness/strategy_check.py)")
    args = ap.parse_args(argv)

    quiet_dtensor_logs()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    hw = Mesh.local(dist.get_world_size()).hardware
    results, seen_rules = {}, set()
    if len(args.variants) not in (0, 1, len(args.model)):
        ap.error("give --variants once, or once per --model")
    per_model = args.variants if len(args.variants) == len(args.model) else \
        [args.variants[0] if args.variants else ""] * len(args.model)
    for model_text, variants in zip(args.model, per_model):
        spec = parse_model_spec(model_text)
        meta = spec.build(device="meta")
        ep = export_training_graph(meta_copy(meta), example_inputs(meta, args.batch, args.seq))
        graph = graph_from_export(ep, meta, model_name=spec.name)
        program = TracedProgram(ep, graph, 1)
        if args.check_strategies:
            results[f"{model_text}|strategies"] = check_strategies(ep, graph, seen_rules)
        for name in filter(None, variants.split(",")):
            key = f"{model_text}|{name}"
            try:
                results[key] = run_variant(name, spec, graph, program, batch=args.batch,
                                           seq=args.seq, steps=args.steps, seed=args.seed, hw=hw)
            except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the rest
                results[key] = {"error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()}
    if dist.get_rank() == 0:
        torch.save(results, args.out)
    dist.barrier()  # no rank tears gloo down while a peer still works (aborts)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
