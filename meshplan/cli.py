"""The ``meshplan`` command: one entry point, one subcommand per job.

User errors (any MeshplanError, a missing file) print one line and exit 2; ``--debug``
shows the traceback. Subcommands: demo, plan, show, explain, diff, estimate, calibrate,
sweep, run, report (estimate and calibrate in meshplan/cli_cost.py; what they share in
meshplan/cli_args.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys

from meshplan.checks import (check_checkpoint_dir, check_model_for_run, check_run_numbers,
                             check_writable, plan_and_graph, recorded_spec)
from meshplan.cli_args import (ENGINE_CHOICES, EXIT_USER_ERROR, POSITIVE_FLOAT, POSITIVE_INT,
                               OneLineParser, load_model_and_graph)
from meshplan.cli_cost import (FP8_RECIPE_HELP, FP8_RECIPES, _refuse_fp8_recipe_without_manual,
                               add_cost_commands)
from meshplan.cli_json import (BAD_USAGE, INTERRUPTED, add_json_flag, answer, command_of,
                               document, emit, error_document, json_mode, plan_facts)
from meshplan.errors import MeshplanError, SpecError
from meshplan.support import stack_refusal
from meshplan.vocabulary import EXPORT_TARGET, ComputeDtype, DTYPES, ENGINES, STACK_TARGETS


# -- subcommands --------------------------------------------------------------------------------

def cmd_plan(args) -> int:
    import meshplan
    from meshplan.specs import parse_manual_spec, parse_mesh_spec
    from meshplan.stacks.commands import check_stack_engine

    if args.output:
        check_writable(args.output)
    mesh = parse_mesh_spec(args.mesh)
    check_stack_engine(args)
    spec, loaded, graph = load_model_and_graph(args)
    if args.for_ and args.manual:
        raise SpecError("--for TARGET searches the layouts the stack runs; --manual gives one: "
                        "drop one (price a hand-written layout with --manual --engine TARGET)")
    if args.for_:
        from meshplan.stacks.commands import check_plan_for_args
        from meshplan.stacks.search import search_layouts

        check_plan_for_args(args, loaded.model)
        _refuse_fp8_recipe_without_manual(args)
        plan, _ = search_layouts(loaded.model, mesh, args.for_, graph=graph,
                                 dtype=args.dtype or ComputeDtype.BF16, compiled=args.compile,
                                 time_limit_s=args.time_limit_s)
    elif args.manual:
        plan = meshplan.manual_plan(loaded.model, mesh, graph=graph, model_name=spec.name,
                                    dtype=args.dtype, engine=args.engine,
                                    fp8_recipe=args.fp8_recipe,
                                    **parse_manual_spec(args.manual))
    else:
        _refuse_fp8_recipe_without_manual(args)
        plan = meshplan.autoparallel(loaded.model, mesh, graph=graph, model_name=spec.name,
                                     dtype=args.dtype, memory_limit_gib=args.memory_limit_gib,
                                     time_limit_s=args.time_limit_s, engine=args.engine)
    from meshplan.specs import config_sha256

    # Plan.to_json stores a factory or config path relative to the plan file, which finds it
    # from any folder; a config file's hash lets run refuse one that changed
    plan = plan.with_spec(spec.target if spec.kind == "config" else args.model,
                          config_sha256(spec))
    then = ""
    if args.output:
        plan.to_json(args.output)
        if plan.engine in ENGINES:
            then = f"{self_command()} run {shlex.quote(args.output)}"
        else:  # priced for a stack meshplan does not run (support.stack_refusal)
            then = f"{self_command()} export {shlex.quote(args.output)} " \
                f"--to {EXPORT_TARGET[plan.engine]}"
    if args.json:
        return answer(args, {"plan": plan.to_dict(), "summary": plan_facts(plan),
                             "output": args.output or None, "next": then or None})
    print(plan.summary())
    print(f"planned in {plan.wall_time_s:.2f} s")
    if args.output:
        verb = "run" if plan.engine in ENGINES else "export"
        print(f"wrote {args.output}; {verb} it with: {then}")
    return 0


def self_command() -> str:
    """This meshplan as a command that works from any shell: the absolute path of the
    console script that is running (inside its virtual environment, which a shell without
    that environment activated does not find as a bare ``meshplan``: exit 127), or this
    Python with ``-m meshplan.cli``."""
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == "meshplan" and os.path.isfile(script):
        return shlex.quote(os.path.abspath(script))
    return f"{shlex.quote(sys.executable)} -m meshplan.cli"


def cmd_run(args) -> int:
    import shlex

    from meshplan.plan import Plan
    from meshplan.runtime.launch import Nodes, run_plan, slurm_script, torchrun_command

    check_run_numbers(args)
    if args.metrics_out:
        check_writable(args.metrics_out)
    plan = Plan.from_json(args.plan)
    why = stack_refusal(plan.engine, where=args.plan, path=args.plan)
    if why:  # priced for a stack (plan --for, --manual --engine STACK): exported, not run
        raise SpecError(why)
    args.model = recorded_spec(plan, args.plan, args.model)
    loaded = check_model_for_run(plan, args.model, data=bool(args.data))
    nodes = Nodes(nnodes=args.nnodes, node_rank=args.node_rank,
                  nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                  rdzv_id=args.rdzv_id).resolve(plan, need_endpoint=not args.slurm)
    extra = ("--timeout-s", str(args.timeout_s), "--lr", str(args.lr))
    if args.warmup:
        extra += ("--warmup", str(args.warmup))
    if args.clip:
        extra += ("--clip", str(args.clip))
    if args.data:
        from meshplan.runtime.data import TokenFile

        tokens = TokenFile(args.data, args.data_dtype)
        tokens.check_batch(plan.training.global_batch, plan.training.seq_len)
        tokens.check_sample(getattr(getattr(loaded.model, "config", None), "vocab_size", None))
        extra += ("--data", os.path.abspath(args.data), "--data-dtype", args.data_dtype)
    note = ""
    if args.checkpoint_dir:
        note = check_checkpoint_dir(args.checkpoint_dir, args.steps)
        extra += ("--checkpoint-dir", os.path.abspath(args.checkpoint_dir),
                  "--checkpoint-every", str(args.checkpoint_every))
    common = dict(model=args.model, steps=args.steps, seed=args.seed,
                  metrics_out=args.metrics_out, extra=extra, nodes=nodes)
    if args.print_torchrun:
        print(shlex.join(torchrun_command(args.plan, plan, **common)))
        return 0
    if args.slurm:
        check_writable(args.output)
        from meshplan.plan import atomic_write

        atomic_write(args.output, slurm_script(args.plan, plan, **common))
        print(f"wrote {args.output}; submit it with: sbatch {args.output}")
        return 0
    if note:
        print(note)
    return run_plan(args.plan, **common)


def cmd_show(args) -> int:
    from meshplan.inspect import summary_text

    plan, graph = plan_and_graph(args.plan, args.model, recorded=False)  # show stays quick
    if args.json:
        return answer(args, {"plan": plan.to_dict(), "summary": plan_facts(plan)})
    print(summary_text(plan, graph=graph))
    return 0


def cmd_explain(args) -> int:
    from meshplan.explain import choice_text, explain, explain_text

    if (args.node is None) == (args.layer is None):
        raise SpecError("explain needs exactly one of --node NAME or --layer N")
    if args.node is not None:
        from meshplan.explain import find_stage
        from meshplan.plan import Plan

        find_stage(Plan.from_json(args.plan), args.node)  # a bad name fails before tracing
    plan, graph = plan_and_graph(args.plan, args.model)
    if graph is None:
        raise SpecError("explain re-prices the alternatives with the model's operator graph, "
                        "which a plan file does not hold; pass --model SPEC (the spec the "
                        "plan was made from)")
    expls = explain(plan, graph, node=args.node, layer=args.layer)
    if args.json:  # every alternative: --limit shortens the tables only
        return answer(args, {"plan": args.plan, "layer": args.layer, "node": args.node,
                             "choice": choice_text(plan) or None, "operators": expls})
    if choice_text(plan):
        print(choice_text(plan))
    print(explain_text(expls, plan, limit=0 if args.node else args.limit))
    return 0


def cmd_diff(args) -> int:
    from meshplan.diff import diff_plans, diff_text
    from meshplan.plan import Plan

    a, b = Plan.from_json(args.a), Plan.from_json(args.b)
    d = diff_plans(a, b)
    if args.json:
        return answer(args, {"a": args.a, "b": args.b, "identical": d.identical,
                             "step_time_s": d.step_time_s, "peak_memory_gib": d.peak_memory_gib,
                             "differences": d.differences})
    print(diff_text(d, a, b))
    return 0


def cmd_report(args) -> int:
    from meshplan.report import write_report

    check_writable(args.output)
    plan, graph = plan_and_graph(args.plan, args.model)
    write_report(plan, args.output, graph=graph)
    print(f"wrote {args.output}")
    return 0


def cmd_sweep(args) -> int:
    from meshplan.specs import parse_mesh_spec
    from meshplan.sweep import run_sweep

    check_writable(args.output)
    if args.plot:
        check_writable(args.plot)
    mesh = parse_mesh_spec(args.mesh)
    spec, loaded, graph = load_model_and_graph(args)
    frame = run_sweep(loaded.model, mesh, graph=graph, model_name=spec.name, dtype=args.dtype,
                      output=args.output, plot=args.plot, auto=not args.no_auto,
                      time_limit_s=args.time_limit_s, progress=True,
                      model_spec=spec.text if spec.kind == "file" else "")
    fits = int(frame["fits"].sum()) if len(frame) else 0
    print(f"wrote {args.output}: {len(frame)} configurations, {fits} fit"
          + (f"; plot {args.plot}" if args.plot else ""))
    return 0


def cmd_demo(args) -> int:
    from meshplan.demo import run_demo

    return run_demo(procs=args.procs, steps=args.steps, workdir=args.workdir)


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="meshplan", description=__doc__.splitlines()[0])
    ap.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", help="plan a small GPT for 4 CPU processes and train it")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workdir", default="", help="where plan and metrics go (default: a temp dir)")
    p.set_defaults(func=cmd_demo)

    def model_mesh(p, mesh_required=True):
        p.add_argument("--model", required=True, help="transformers:NAME?k=v&..., a preset "
                       "(gpt3-175b, llama2-7b, ...), path/to/config.json (or a checkpoint "
                       "folder) or path/file.py:factory")
        p.add_argument("--mesh", required=mesh_required,
                       help="dgx-a100-80gb:nodes=8, dgx-h100:nodes=N, local:4 or cluster.json")
        p.add_argument("--batch", type=POSITIVE_INT, required=True,
                       help="global batch (sequences, or rows of a ModelBundle's examples)")
        p.add_argument("--seq", type=POSITIVE_INT, default=None, help="sequence length "
                       "(token models; a ModelBundle's examples fix it)")
        p.add_argument("--dtype", choices=DTYPES, default=None,
                       help="fp8: priced and exported only (--for, or --engine STACK)")

    p = sub.add_parser("plan", help="make a plan (automatic, or --manual)")
    model_mesh(p)
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help=FP8_RECIPE_HELP)
    p.add_argument("--manual", default="", help="dp=2,tp=2,pp=1,mb=1,schedule=1f1b,"
                   "recompute=none,sp=0,zero=0 (split=3/2: blocks per pipeline chunk; ep=2: "
                   "routed experts split over 2 data-parallel ranks)")
    p.add_argument("--memory-limit-gib", type=POSITIVE_FLOAT, default=None)
    p.add_argument("--time-limit-s", type=POSITIVE_FLOAT, default=30.0, help="the solver's limit; "
                   "with --for, the layout search keeps the best found after this long")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="auto",
                   help="the runtime the plan names: auto picks the module engine (PyTorch's "
                   "composables) where the plan is expressible in it; megatron, "
                   "megatron-2021, nemo, torchtitan price a --manual layout as that stack "
                   "runs it (exported, not run: meshplan export --to megatron|torchtitan)")
    p.add_argument("--for", dest="for_", choices=STACK_TARGETS, default=None,
                   help="search only the layouts this stack runs, priced as it runs them; "
                   "then meshplan export plan.json --to TARGET")
    p.add_argument("--compile", action="store_true", help="with --for torchtitan: price and "
                   "export torch.compile (compile.enable)")
    p.add_argument("-o", "--output", default="", help="write the plan JSON here")
    add_json_flag(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("run", help="train with a plan under torchrun")
    p.add_argument("plan")
    p.add_argument("--model", default="", help="model spec (default: the one the plan "
                   "records)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", default="")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=0, help="linear warmup over this many steps, "
                   "then constant")
    p.add_argument("--clip", type=float, default=0.0, metavar="MAX_NORM",
                   help="clip the global gradient norm (all ranks and stages) to MAX_NORM")
    p.add_argument("--data", default="", help="flat binary of token ids as nanoGPT writes it "
                   "(train.bin); default: synthetic tokens from --seed")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    p.add_argument("--checkpoint-dir", default="", help="save sharded checkpoints here (at the "
                   "end, and every --checkpoint-every steps); a run whose directory holds one "
                   "resumes from the newest")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every K steps")
    p.add_argument("--timeout-s", type=float, default=30.0, help="collective timeout: a rank "
                   "waiting longer on a dead or hung peer fails the run")
    g = p.add_argument_group("many machines (torchrun's c10d rendezvous)")
    g.add_argument("--nnodes", type=int, default=1)
    g.add_argument("--node-rank", type=int, default=0, help="0..nnodes-1; node 0 hosts the "
                   "rendezvous")
    g.add_argument("--nproc-per-node", type=int, default=0, help="default: the plan's devices "
                   "/ --nnodes")
    g.add_argument("--rdzv-endpoint", default="", metavar="HOST:PORT",
                   help="on node rank 0, reachable from every node (needed with --nnodes > 1)")
    g.add_argument("--rdzv-id", default="meshplan", help="the same on every node of one job")
    g.add_argument("--print-torchrun", action="store_true", help="print the equivalent "
                   "torchrun command for this node and exit")
    g.add_argument("--slurm", action="store_true", help="write an sbatch script (one task per "
                   "node, srun torchrun) to -o and exit")
    g.add_argument("-o", "--output", default="meshplan.sbatch", help="where --slurm writes")
    p.set_defaults(func=cmd_run)

    _add_reading_commands(sub, model_mesh)

    add_cost_commands(sub)
    from meshplan.stacks.commands import add_export_command

    add_export_command(sub)
    return ap


def _add_reading_commands(sub, model_mesh) -> None:
    """show, explain, diff, report, sweep: reading plans and the space around them."""
    retrace = "model spec the plan was made from; re-traces the graph for richer answers"
    p = sub.add_parser("show", help="print a plan as tables")
    p.add_argument("plan")
    p.add_argument("--model", default="", help=retrace)
    add_json_flag(p)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("explain", help="the alternatives the solver had at a layer or operator")
    p.add_argument("plan")
    p.add_argument("--model", default="", help=retrace + " (default: the one the plan "
                   "records; needed for a plan made from a Python model)")
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--node", default=None, help="operator name, as in the plan's ops")
    p.add_argument("--limit", type=int, default=6, help="alternatives shown per operator "
                   "with --layer (0: all)")
    add_json_flag(p)
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("diff", help="compare two plans and price each difference")
    p.add_argument("a")
    p.add_argument("b")
    add_json_flag(p)
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("report", help="self-contained HTML report of a plan, with pictures")
    p.add_argument("plan")
    p.add_argument("-o", "--output", required=True, help="report.html")
    p.add_argument("--model", default="", help=retrace)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("sweep", help="every uniform dp/tp/pp configuration, priced, as parquet")
    model_mesh(p)
    p.add_argument("-o", "--output", required=True, help="space.parquet")
    p.add_argument("--plot", default="", help="time against memory with the Pareto front (.png)")
    p.add_argument("--no-auto", action="store_true", help="do not run autoparallel to mark "
                   "the automatic plan")
    p.add_argument("--time-limit-s", type=POSITIVE_FLOAT, default=30.0,
                   help="for the automatic plan")
    p.set_defaults(func=cmd_sweep)


def main(argv=None) -> int:
    # transformers warns about synthetic configs (token ids outside a tiny vocabulary); the
    # command line shows meshplan's own messages only.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:  # --help, or a malformed command line (one line, exit 2)
        code = exc.code if isinstance(exc.code, int) else EXIT_USER_ERROR
        if code and "--json" in words:
            emit(error_document(command_of(words), code=BAD_USAGE,
                                message=OneLineParser.last_error or "the command line was "
                                "refused; see meshplan --help"))
        return code
    return run_command(args)


def run_command(args) -> int:
    """The parsed command, its user errors as one line (exit 2); with ``--json`` its answer
    or its error as one JSON document on stdout (meshplan/cli_json.py)."""
    as_json = getattr(args, "json", False)
    stdout = sys.stdout
    try:
        with json_mode() if as_json else contextlib.nullcontext():
            rc = args.func(args) or 0
        if as_json:
            result = getattr(args, "json_result", None)
            if result is None:  # a bug: every --json command answers through cli_json.answer
                raise RuntimeError(f"meshplan {args.command} --json returned no document")
            emit(document(args.command, result), stdout)
        return rc
    except (MeshplanError, FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        if args.debug:
            raise
        print(f"meshplan {args.command}: error: {exc}", file=sys.stderr)
        if as_json:
            emit(error_document(args.command, exc), stdout)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"meshplan {args.command}: interrupted", file=sys.stderr)
        if as_json:
            emit(error_document(args.command, code=INTERRUPTED, message="interrupted"), stdout)
        return 130


if __name__ == "__main__":
    sys.exit(main())
