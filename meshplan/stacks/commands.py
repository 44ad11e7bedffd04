"""The stacks on the command line and in Python: ``plan --for``, ``export``, ``estimate --from``.

- ``meshplan plan ... --for torchtitan|megatron``: ``plan_for`` (meshplan/stacks/search.py);
- ``meshplan export plan.json --to torchtitan|megatron -o FILE``: ``export_plan``;
- ``meshplan estimate --from torchtitan|megatron FILE --mesh M``: ``import_plan``, priced
  as that stack runs it, beside what ``plan --for`` would pick (``--compare``).
"""

from __future__ import annotations

import os

from meshplan.errors import NotExpressibleError, SpecError
from meshplan.plan import Plan
from meshplan.stacks.arch import ModelArch, arch_of_spec
from meshplan.stacks.layout import StackLayout, check_expressible, layout_of, manual_with_ep
from meshplan.stacks.search import TARGETS, target_module
from meshplan.vocabulary import EXPORT_TARGET, ComputeDtype

SUFFIX = {"torchtitan": "_torchtitan", "megatron": ".txt"}  # torchtitan: a package folder


def plan_for(model, mesh, to: str, example_inputs=(), *, graph=None,
             dtype: str = ComputeDtype.BF16, compiled: bool = False, model_name: str = "",
             time_limit_s: float | None = None) -> Plan:
    """The best plan the stack ``to`` ("torchtitan" or "megatron") runs for ``model`` on
    ``mesh``, searched over the layouts it accepts and priced as it runs them
    (meshplan/stacks/search.py); ``plan.engine`` names the stack. Export it with
    ``export_plan``. ``compiled``: torchtitan's torch.compile, priced and exported.
    ``time_limit_s``: keep the best found when the search runs longer (the plan's
    ``solver.status`` says how many layouts were left unpriced)."""
    from meshplan.api import as_mesh
    from meshplan.stacks.search import search_layouts
    from meshplan.tracing import trace

    mesh = as_mesh(mesh)
    if graph is None:
        graph = trace(model, example_inputs, model_name=model_name or type(model).__name__)
    return search_layouts(model, mesh, to, graph=graph, dtype=dtype, compiled=compiled,
                          time_limit_s=time_limit_s)[0]


def export_plan(plan: Plan, to: str, *, model_spec: str = "", graph=None,
                package: str = "meshplan_job") -> str:
    """``plan`` as ``to``'s configuration text: torchtitan 0.3's ``config_registry.py`` (its
    package named ``package``; ``torchtitan_command`` gives the command-line form), Megatron-LM
    arguments.

    NotExpressibleError (one line, naming what is missing) for a plan the target cannot
    express. A plan made for another engine than ``to`` is checked operator by operator
    against the uniform layout it follows (``check_expressible``), which needs the model:
    ``graph`` or ``model_spec`` (default: the spec the plan records)."""
    mod = target_module(to)
    spec = model_spec or plan.model.spec
    if not spec:
        raise SpecError("export reads the model's architecture from its spec: pass --model "
                        "SPEC (a plan made from a Python object records none)")
    arch = arch_of_spec(spec)
    layout = layout_of(plan, compiled=plan.training.compiled)
    problems = mod.problems(layout, arch)
    if problems:
        raise NotExpressibleError(f"{to} cannot run this plan: {problems[0]}")
    if plan.engine != to:
        if graph is None:
            from meshplan.explain import retrace

            graph = retrace(plan, spec)
        check_expressible(plan, layout, graph)
    if to == "torchtitan":
        return mod.to_torchtitan(layout, arch, package=package)
    return getattr(mod, f"to_{to}")(layout, arch)


def read_config(path: str, target: str, *, devices: int | None = None) \
        -> tuple[StackLayout, ModelArch]:
    """The layout and model of a torchtitan configuration (a 0.3 package folder or its
    ``config_registry.py``, a file holding a 0.3 ``--module ... --config ...`` line, a 0.2
    TOML job) or a Megatron-LM argument file."""
    mod = target_module(target)
    if target == "torchtitan" and os.path.isdir(path):
        path = os.path.join(path, "config_registry.py")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise SpecError(f"--from {target} {path}: {exc.strerror}") from None
    return getattr(mod, f"from_{target}")(text, devices=devices)


def import_plan(path: str, target: str, mesh, *, model_spec: str = "") -> Plan:
    """The configuration in ``path`` as a meshplan plan priced as ``target`` runs it
    (``manual_plan(engine=target)``); ``model_spec`` overrides the architecture the file
    names (e.g. a flavor torchtitan ships under another name)."""
    from meshplan import api
    from meshplan.specs import parse_model_spec

    layout, arch = read_config(path, target, devices=mesh.num_devices)
    if layout.devices != mesh.num_devices:
        raise SpecError(f"{path} lays out {layout.devices} devices (dp {layout.dp} x cp "
                        f"{layout.cp} x tp {layout.tp} x pp {layout.pp}) but the mesh has "
                        f"{mesh.num_devices}; pass a --mesh of {layout.devices} devices")
    spec = model_spec or arch.spec()
    loaded = parse_model_spec(spec).load(layout.global_batch, layout.seq_len, device="meta")
    graph = loaded.trace(spec)
    plan = manual_with_ep(api.manual_plan, loaded.model, mesh, graph=graph,
                          engine=target, model_name=spec, ep=layout.ep,
                          **layout.manual_kwargs())
    if layout.compiled:
        from dataclasses import replace

        plan = replace(plan, training=replace(plan.training, compiled=True))
        plan = plan.with_prediction(api.estimate(plan))
    return plan.with_spec(spec)


def default_output(plan_path: str, target: str) -> str:
    stem = os.path.splitext(plan_path)[0]
    if target == "torchtitan":  # a package: its name must be a Python identifier
        folder, name = os.path.split(stem)
        name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
        return os.path.join(folder, ("p_" if name[:1].isdigit() else "") + name + SUFFIX[target])
    return stem + f".{target}" + SUFFIX[target]


# -- the command line ---------------------------------------------------------------------------

def add_export_command(sub) -> None:
    p = sub.add_parser("export", help="write a plan as a torchtitan 0.3 config package or "
                       "Megatron-LM arguments", description="`meshplan export plan.json --to "
                       "torchtitan -o my_job` (a package: my_job/config_registry.py, run with "
                       "--module my_job --config meshplan_<model>) / `--to megatron -o "
                       "args.txt`: the plan in the stack's own "
                       "configuration; a plan the stack cannot express is refused in one line "
                       "naming what is missing (docs/torchtitan.md, docs/megatron.md)")
    p.add_argument("plan", help="a plan JSON file (best made with meshplan plan --for TARGET)")
    p.add_argument("--to", required=True, choices=TARGETS)
    p.add_argument("--model", default="", help="model spec (default: the one the plan records)")
    p.add_argument("-o", "--output", default="", help="where to write (default: beside the "
                   "plan, PLAN_torchtitan/ (a package folder) / PLAN.megatron.txt; '-' prints "
                   "it, or with --json puts it in the document)")
    from meshplan.cli_json import add_json_flag

    add_json_flag(p)
    p.set_defaults(func=cmd_export)


def add_from_arguments(p) -> None:
    """``meshplan estimate --from TARGET FILE``."""
    p.add_argument("--from", dest="from_", nargs=2, metavar=("TARGET", "FILE"), default=None,
                   help="price an existing torchtitan config (0.3 package or config_registry.py, "
                   "a file with its --module/--config line, a 0.2 TOML) or Megatron-LM "
                   "argument file as "
                   "that stack runs it (with --mesh)")
    p.add_argument("--compare", action="store_true", help="with --from: also search what "
                   "meshplan plan --for TARGET picks and print the difference")


def cmd_export(args) -> int:
    from meshplan.checks import check_writable

    plan = Plan.from_json(args.plan)
    out = args.output or default_output(args.plan, args.to)
    if args.to == "torchtitan" and out != "-":
        return _export_torchtitan(plan, args, out)
    if out != "-":
        check_writable(out)
    text = export_plan(plan, args.to, model_spec=args.model)
    if out != "-":
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    if args.json:
        from meshplan.cli_json import answer

        return answer(args, {"target": args.to, "plan": args.plan,
                             "output": None if out == "-" else out,
                             "text": text if out == "-" else None,
                             "layout": layout_of(plan).words()})
    if out == "-":
        print(text, end="")
        return 0
    print(f"wrote {out} ({args.to}: {layout_of(plan).words()})")
    return 0


def _export_torchtitan(plan: Plan, args, folder: str) -> int:
    """``folder``/config_registry.py (+ an empty __init__.py): a package torchrun imports with
    ``--module NAME`` when its parent folder is on PYTHONPATH."""
    from meshplan.checks import check_writable
    from meshplan.stacks.arch import arch_of_spec
    from meshplan.stacks.torchtitan import check_package_name, function_name, \
        torchtitan_command

    folder = folder.rstrip("/\\") or folder
    parent, package = os.path.split(os.path.abspath(folder))
    if folder.endswith(".py") or folder.endswith(".toml"):
        raise SpecError(f"-o {folder}: torchtitan 0.3 reads a config package (a folder holding "
                        "config_registry.py); give a folder name, e.g. -o my_job")
    check_package_name(package)
    text = export_plan(plan, "torchtitan", model_spec=args.model, package=package)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config_registry.py")
    check_writable(path)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    init = os.path.join(folder, "__init__.py")
    if not os.path.exists(init):
        open(init, "w").close()
    layout = layout_of(plan, compiled=plan.training.compiled)
    if args.json:
        from meshplan.cli_json import answer

        return answer(args, {"target": args.to, "plan": args.plan, "output": folder,
                             "text": None, "layout": layout.words()})
    arch = arch_of_spec(args.model or plan.model.spec)
    print(f"wrote {path} (torchtitan {layout.words()})")
    per_node = min(plan.mesh.devices_per_node, layout.devices)
    print(f"run:  PYTHONPATH={parent} torchrun --nproc_per_node {per_node} --nnodes "
          f"{layout.devices // per_node} -m torchtitan.train --module {package} "
          f"--config {function_name(arch)}")
    line = torchtitan_command(layout, arch, package=package)
    print(f"or:   torchrun ... -m torchtitan.train {line}" if line.startswith("--") else
          f"or:   {line}")
    return 0


def check_plan_for_args(args, model) -> None:
    """``plan --for TARGET``'s options that the stack search does not take, and a model an
    export could not name, refused in one line before the search."""
    from meshplan.stacks.layout import STACK_DTYPES

    if args.memory_limit_gib is not None:
        raise SpecError("--memory-limit-gib with --for: the stack search keeps each device's "
                        "own memory (the mesh's); drop it, or plan with a mesh of that memory")
    if args.engine not in ("auto", args.for_):
        raise SpecError(f"--engine {args.engine} with --for {args.for_}: the plan is priced as "
                        f"{args.for_} runs it; drop --engine")
    if args.dtype and args.dtype not in STACK_DTYPES:
        raise SpecError(f"--dtype {args.dtype} with --for {args.for_}: the stacks are planned "
                        f"in {', '.join(STACK_DTYPES)} (fp16 needs loss scaling); use bf16")
    if args.for_ == "torchtitan":
        from meshplan.stacks.arch import arch_of_model
        from meshplan.stacks.torchtitan import FP8_PROBLEM, flavor_problem

        if args.dtype == ComputeDtype.FP8:
            raise SpecError(f"--dtype fp8 with --for torchtitan: {FP8_PROBLEM}")

        why = flavor_problem(arch_of_model(model))
        if why:
            raise SpecError(f"--for torchtitan: {why}")


def check_stack_engine(args) -> None:
    """plan / estimate ``--engine STACK`` prices a hand-written layout; the search (no
    --manual) covers meshplan's engines, or a stack's own layouts with ``plan --for``: refused
    in one line before tracing."""
    if args.engine in EXPORT_TARGET and not args.manual and not getattr(args, "for_", None):
        target = EXPORT_TARGET[args.engine]
        raise SpecError(f"--engine {args.engine} prices a --manual layout as {args.engine} runs "
                        f"it: add --manual dp=..,tp=..,pp=.., or search the layouts "
                        f"{target} runs with meshplan plan --for {target}")


def cmd_estimate_from(args, print_estimate) -> int:
    """``meshplan estimate --from TARGET FILE --mesh M [--model SPEC] [--compare] [-o]``."""
    from meshplan.specs import parse_mesh_spec

    target, path = args.from_
    for flag, value in (("--batch", args.batch), ("--seq", args.seq),
                        ("--manual", args.manual), ("plan", args.plan)):
        if value:
            raise SpecError(f"{flag} with --from {target}: the file sets the layout, batch and "
                            f"sequence; drop {flag}")
    if target not in TARGETS:
        raise SpecError(f"--from {target}: the stacks read are {', '.join(TARGETS)}")
    if not args.mesh:
        raise SpecError(f"--from {target} {path} needs --mesh (the hardware it runs on, e.g. "
                        "dgx-h100:nodes=8)")
    mesh = parse_mesh_spec(args.mesh)
    plan = import_plan(path, target, mesh, model_spec=args.model)
    words = layout_of(plan, compiled=plan.training.compiled).words()
    if args.output:
        plan.to_json(args.output)
    result = {"estimate": plan.predicted, "source": "from", "plan": None,
              "output": args.output or None, "from": {"target": target, "file": path,
                                                      "layout": words}}
    if not args.json:
        print(f"{path}: {words}, priced as {target} runs it")
        print_estimate(plan.predicted)
        if args.output:
            print(f"wrote {args.output}")
    if args.compare:
        from meshplan.diff import diff_plans, diff_text
        from meshplan.stacks.search import search_layouts

        graph = plan.graph
        model = _meta_model(plan.model.spec)
        ours, _ = search_layouts(model, mesh, target, graph=graph, dtype=plan.training.dtype,
                           compiled=plan.training.compiled)
        ours = ours.with_spec(plan.model.spec)
        a, b = plan.predicted, ours.predicted
        d = diff_plans(plan, ours)
        result["compare"] = {"layout": layout_of(ours).words(), "estimate": b,
                             "differences": d.differences}
        if not args.json:
            print(f"meshplan plan --for {target}: {layout_of(ours).words()}: step "
                  f"{b.step_time_s:.3f} s vs {a.step_time_s:.3f} s ({a.step_time_s / b.step_time_s - 1:+.1%} "
                  f"time for the file's layout), MFU {b.mfu:.1%} vs {a.mfu:.1%}, peak "
                  f"{b.peak_memory_gib:.1f} vs {a.peak_memory_gib:.1f} GiB")
            print(diff_text(d, plan, ours))
    if args.json:
        from meshplan.cli_json import answer

        return answer(args, result)
    return 0


def _meta_model(spec: str):
    from meshplan.specs import parse_model_spec

    return parse_model_spec(spec).build(device="meta")


__all__ = ["TARGETS", "export_plan", "import_plan", "plan_for", "read_config"]
