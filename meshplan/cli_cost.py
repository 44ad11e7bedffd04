"""``meshplan estimate`` and ``meshplan calibrate``: the cost model on the command line."""

from __future__ import annotations

from meshplan.checks import check_writable
from meshplan.cli_args import ENGINE_CHOICES, POSITIVE_FLOAT, POSITIVE_INT, load_model_and_graph
from meshplan.cli_json import add_json_flag, answer
from meshplan.costmodel.fp8 import PUBLIC_RECIPES
from meshplan.errors import SpecError
from meshplan.stacks.layout import STACK_DTYPES
from meshplan.vocabulary import DTYPES, STACK_TARGETS, ComputeDtype


def add_cost_commands(sub) -> None:
    """estimate and calibrate: the cost model on the command line."""
    p = sub.add_parser("estimate", help="predict a plan's step time, memory and MFU",
                       description="`meshplan estimate plan.json --model SPEC` re-traces the "
                       "model and re-prices the plan (a plan file holds placements, not the "
                       "operator costs); without --model it prints the prediction recorded in "
                       "the file. `meshplan estimate --model SPEC --mesh MESH --batch B --seq S "
                       "--manual dp=..,tp=..` prices a Megatron-style plan.")
    p.add_argument("plan", nargs="?", default="", help="a plan JSON file")
    p.add_argument("--model", default="", help="model spec (re-trace and re-price)")
    p.add_argument("--mesh", default="", help="mesh spec, for --manual")
    p.add_argument("--batch", type=POSITIVE_INT, default=0, help="global batch, for --manual")
    p.add_argument("--seq", type=POSITIVE_INT, default=0, help="sequence length, for --manual "
                   "(token models)")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help=FP8_RECIPE_HELP)
    p.add_argument("--manual", default="", help="dp=2,tp=2,pp=1,mb=1,schedule=1f1b,"
                   "recompute=none,sp=0,zero=0,vs=1 (split=3/2: blocks per pipeline chunk)")
    p.add_argument("--hardware", default="", help="re-price on this profile JSON (e.g. from "
                   "meshplan calibrate -o)")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="price as this runtime runs the plan: auto is the engine a plan file "
                   "names, or the one meshplan picks; megatron, megatron-2021, nemo, "
                   "torchtitan price it as that stack runs it (as plan --engine)")
    p.add_argument("--compiled", action="store_true", help="price the repeated blocks as "
                   "torch.compile runs them (parallelize(..., compile=True), torchtitan's "
                   "compile): pointwise chains between matmuls fused; default eager")
    p.add_argument("-o", "--output", default="", help="write the (re-priced) plan JSON here")
    from meshplan.stacks.commands import add_from_arguments

    add_from_arguments(p)
    add_json_flag(p)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("fit", help="will it fit: the fewest nodes of a GPU, and the fastest "
                       "layouts on a mesh, with memory per GPU", description="`meshplan fit "
                       "--model SPEC --gpu h100 --batch B --seq S [--mesh dgx-h100:nodes=N]`: "
                       "the fewest nodes of that GPU on which some layout the stack runs fits, "
                       "and on --mesh the fastest layouts that fit, each with its peak memory "
                       "per GPU broken down (docs/cli-json.md)")
    p.add_argument("--model", required=True, help="transformers:llama|qwen3?k=v&..., or a "
                   "preset (llama3.1-8b, llama3.1-70b, llama3.1-405b, ...)")
    p.add_argument("--gpu", required=True, help="h100, a100, h200, h100-96gb, or a node preset "
                   "(dgx-h100, ...): its memory and its node size")
    p.add_argument("--batch", type=POSITIVE_INT, required=True, help="global batch (sequences)")
    p.add_argument("--seq", type=POSITIVE_INT, required=True, help="sequence length")
    p.add_argument("--mesh", default="", help="also list the fastest layouts that fit on this "
                   "mesh of the same GPU, e.g. dgx-h100:nodes=128")
    p.add_argument("--for", dest="for_", choices=STACK_TARGETS, default="torchtitan",
                   help="the stack whose layouts are searched and priced (default torchtitan)")
    p.add_argument("--dtype", choices=STACK_DTYPES, default=ComputeDtype.BF16)
    p.add_argument("--top", type=POSITIVE_INT, default=5, help="layouts listed for --mesh")
    p.add_argument("--max-nodes", type=POSITIVE_INT, default=4096,
                   help="the largest node count the smallest-mesh search tries")
    p.add_argument("--time-limit-s", type=POSITIVE_FLOAT, default=60.0, help="the --mesh "
                   "search keeps the best found after this long")
    add_json_flag(p)
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("calibrate", help="measure this machine and fit a hardware profile")
    p.add_argument("--procs", type=int, default=4, help="collectives over 2..N local processes")
    p.add_argument("-o", "--output", default="", help="also write the profile here")
    p.add_argument("--no-cache", action="store_true", help="do not update the user cache "
                   "(~/.cache/meshplan/calibration.json) that Mesh.local reads")
    p.set_defaults(func=cmd_calibrate)


FP8_RECIPES = PUBLIC_RECIPES  # costmodel/fp8.py
FP8_RECIPE_HELP = ("with --dtype fp8: the scaling recipe to price (torchao: tensorwise, "
                   "tensorwise-fp8-all-gather with FSDP's weights gathered in fp8 too, rowwise; "
                   "Megatron-LM / NeMo: tensorwise, Transformer Engine's current scaling); "
                   "default: the engine's own")


def _refuse_fp8_recipe_without_manual(args) -> None:
    """--fp8-recipe prices a hand-written fp8 layout; the automatic search plans what
    meshplan's runtimes run, which is not fp8."""
    if getattr(args, "fp8_recipe", None):
        raise SpecError(f"--fp8-recipe {args.fp8_recipe} needs --manual ... --engine STACK "
                        "--dtype fp8: fp8 plans are priced for a stack, not searched")


def cmd_estimate(args) -> int:
    import meshplan
    from meshplan.costmodel.hardware import load_profile
    from meshplan.inspect import fmt_time
    from meshplan.plan import Plan

    if args.output:
        check_writable(args.output)
    if args.from_:
        from meshplan.stacks.commands import cmd_estimate_from

        if args.engine != "auto":
            raise SpecError(f"--engine {args.engine} with --from: the file is priced as "
                            f"{args.from_[0]} runs it; drop --engine")

        return cmd_estimate_from(args, lambda est: _print_estimate(est, fmt_time))
    hardware = load_profile(args.hardware) if args.hardware else None
    if args.plan:
        plan = Plan.from_json(args.plan)
        engine = None if args.engine in ("auto", plan.engine) else args.engine
        if engine and args.output:
            raise SpecError(f"--engine {engine} with -o: {args.plan} names engine "
                            f"{plan.engine!r}, and -o would write it with {engine}'s "
                            f"prediction; drop -o, or make the plan with meshplan plan --manual "
                            f"... --engine {engine} -o")
        args.model = args.model or plan.model.spec
        if not args.model:
            if engine:
                raise SpecError(f"--engine {engine} re-prices {args.plan} from the model's "
                                "operators, which a plan file does not hold; pass --model SPEC "
                                "(the spec the plan was made from)")
            if args.json:
                return answer(args, {"estimate": plan.predicted, "source": "recorded",
                                     "plan": args.plan, "output": None})
            print(f"prediction recorded in {args.plan} (pass --model SPEC to re-price):")
            _print_estimate(plan.predicted, fmt_time)
            return 0
        from meshplan.explain import retrace

        est = meshplan.estimate(plan, retrace(plan, args.model), hardware=hardware,
                                compiled=args.compiled, engine=engine,
                                fp8_recipe=args.fp8_recipe)
        source = "repriced"
    else:
        if not (args.model and args.mesh and args.batch):
            raise SpecError("meshplan estimate needs a plan file, or --model, --mesh, --batch "
                            "(and --seq for token models; with --manual dp=..,tp=..,pp=.. for "
                            "a hand-written plan)")
        from meshplan.specs import parse_manual_spec, parse_mesh_spec
        from meshplan.stacks.commands import check_stack_engine

        mesh = parse_mesh_spec(args.mesh)
        check_stack_engine(args)
        args.seq = args.seq or None
        spec, loaded, graph = load_model_and_graph(args)
        if args.manual:
            plan = meshplan.manual_plan(loaded.model, mesh, graph=graph, model_name=spec.name,
                                        dtype=args.dtype, engine=args.engine,
                                        fp8_recipe=args.fp8_recipe,
                                        **parse_manual_spec(args.manual))
        else:
            _refuse_fp8_recipe_without_manual(args)
            plan = meshplan.autoparallel(loaded.model, mesh, graph=graph, model_name=spec.name,
                                         dtype=args.dtype, engine=args.engine)
        est = meshplan.estimate(plan, hardware=hardware, compiled=args.compiled) \
            if hardware or args.compiled else plan.predicted
        source = "manual" if args.manual else "auto"
    if args.output:
        plan.with_prediction(est).to_json(args.output)
    if args.json:
        return answer(args, {"estimate": est, "source": source, "plan": args.plan or None,
                             "output": args.output or None})
    _print_estimate(est, fmt_time)
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _print_estimate(est, fmt_time) -> None:
    print(f"step time        {fmt_time(est.step_time_s)}")
    print("  breakdown      " + ", ".join(f"{k} {fmt_time(v)}" for k, v in est.breakdown.items()))
    print(f"throughput       {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu * 100:.1f}%, "
          f"bubble {est.bubble_fraction * 100:.1f}%")
    m = est.memory
    print(f"peak memory      {est.peak_memory_gib:.2f} GiB of {est.memory_capacity_gib:.1f} GiB per "
          f"device (params {m.params_gib:.2f}, grads {m.grads_gib:.2f}, optimizer "
          f"{m.optimizer_gib:.2f}, activations {m.activations_gib:.2f}, buffers {m.buffers_gib:.2f})")
    print(f"fits             {'yes' if est.fits else 'NO: ' + est.overflow}")


def cmd_fit(args) -> int:
    """``meshplan fit``: meshplan/fitting.py on the command line."""
    from meshplan.fitting import check_mesh_gpu, fit, gpu_preset
    from meshplan.specs import parse_mesh_spec, parse_model_spec

    gpu_preset(args.gpu)  # a bad --gpu or --mesh fails before the model loads
    mesh = parse_mesh_spec(args.mesh) if args.mesh else None
    check_mesh_gpu(mesh, args.gpu)
    spec = parse_model_spec(args.model)
    loaded = spec.load(args.batch, args.seq, device="meta")
    if loaded.bundle:
        raise SpecError(f"--model {args.model}: fit plans causal language models of token ids "
                        "(the stacks' layouts); a ModelBundle is planned with meshplan plan")
    from meshplan.checks import check_batch_and_seq

    check_batch_and_seq(loaded.model, args.batch, args.seq)
    result = fit(loaded.model, gpu=args.gpu, batch=args.batch, seq=args.seq, mesh=mesh,
                 graph=loaded.trace(spec.name), model_name=spec.name, target=args.for_,
                 dtype=args.dtype, top=args.top, max_nodes=args.max_nodes,
                 time_limit_s=args.time_limit_s)
    if args.json:
        return answer(args, result)
    print(result.text())
    return 0


def cmd_calibrate(args) -> int:
    import json

    from rich.progress import Progress

    from meshplan.calibrate import calibrate, progress_steps
    from meshplan.mesh import calibration_cache_path
    from meshplan.plan import atomic_write

    if args.output:
        check_writable(args.output)
    if args.procs < 1:
        raise SpecError(f"--procs {args.procs}: need at least 1 (2 or more to measure collectives)")
    with Progress() as bar:
        task = bar.add_task("calibrating", total=progress_steps(args.procs))
        profile = calibrate(args.procs, progress=lambda: bar.advance(task))
    text = profile.to_json()
    targets = [args.output] if args.output else []
    if not args.no_cache:
        cache = calibration_cache_path()
        cache.parent.mkdir(parents=True, exist_ok=True)
        targets.append(str(cache))
    for path in targets:
        atomic_write(path, text)
        print(f"wrote {path}")
    d = profile.device
    print(f"matmul {d.peak_tflops.get('float32', 0) * 1e3:.1f} GFLOP/s asymptote, memory "
          f"{d.memory_bandwidth_gbps:.1f} GB/s, op latency {d.kernel_latency_s * 1e6:.1f} us + "
          f"framework {d.framework_overhead_s * 1e6:.1f} us; collectives: "
          + ", ".join(f"{k} {v['latency_s'] * 1e6:.0f} us + B/{v['bandwidth_gbps']:.2f} GB/s"
                      for k, v in profile.intra_node.collectives.items()))
    print("fit residuals: " + json.dumps({k: v for k, v in profile.fitted.items()
                                         if "residual" in k}))
    return 0
