"""Checks the command line makes before any work starts: each bad value is one line (a
``SpecError``: the value, the rule, the fix), exit code 2 in ``meshplan.cli``, with nothing
written and no process started.

App layer, beside cli.py: ``meshplan run`` builds and traces the model on the meta device and
compares it with the plan (``check_model_for_run``), tries its output paths
(``check_writable``), reads the checkpoint directory (``check_checkpoint_dir``) and its
numbers (``check_run_numbers``) before it launches a worker; ``plan_and_graph`` loads a plan
for the reading commands with its placements checked against the model.
"""

from __future__ import annotations

import os

from meshplan.errors import SpecError

MAX_TOKENS_PER_STEP = 2**31 - 1  # int32 indexing limits of many kernels; Llama 3 used 16M


def check_batch_and_seq(model, batch: int, seq: int) -> None:
    """A sequence the model has positions for, and a step of at most 2^31 - 1 tokens."""
    from meshplan.specs import check_positions

    check_positions(model, seq)
    if batch * seq > MAX_TOKENS_PER_STEP:
        raise SpecError(f"--batch {batch} x --seq {seq} = {batch * seq:.3g} tokens per step, over "
                        f"2^31 - 1 (int32 indexing in many kernels); use --batch "
                        f"{MAX_TOKENS_PER_STEP // seq} or less")


def check_writable(path: str) -> None:
    """``path`` can be written as atomic_write writes it (a temporary file beside it, then a
    rename), tried now: os.access says yes to root on a read-only file system."""
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise SpecError(f"cannot write {path}: it is a directory; name a file, e.g. "
                        f"{os.path.join(path, 'metrics.json')}")
    if not os.path.isdir(directory):
        raise SpecError(f"cannot write {path}: directory {directory} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".meshplan-check-"):
            pass
    except OSError as exc:
        raise SpecError(f"cannot write {path}: directory {directory} is not writable "
                        f"({exc.strerror})") from None


def check_model_for_run(plan, spec_text: str, *, data: bool):
    """Before any process starts: the model is the one the plan was made for (its traced
    fingerprint, on the meta device: nothing allocated), every placement fits the tensor it
    places, and --data suits the model's calling convention. Returns the loaded model."""
    from meshplan.specs import parse_model_spec

    spec = parse_model_spec(spec_text)
    check_config_unchanged(plan, spec)
    loaded = spec.load_for_plan(plan, device="meta")
    model = loaded.model
    plan.check_param_ranks({n: p.ndim for n, p in model.named_parameters(remove_duplicate=False)})
    if data and not loaded.takes_token_ids:
        what = "a ModelBundle whose example inputs are not token ids alone" if loaded.bundle \
            else f"a {loaded.call.head} model"
        raise SpecError(f"--data feeds token ids to causal LMs; {spec_text} is {what}; drop "
                        "--data to train on synthetic batches of its examples' shapes")
    plan.check_graph(loaded.trace(spec.name))  # the fingerprint, then op placements
    return loaded


def check_config_unchanged(plan, spec) -> None:
    """A plan made from a config file runs only with that file as it was: its sha256 now
    must be the one the plan records (a changed file builds another model, which a
    fingerprint does not always tell: rope_theta, eps and dropout trace alike)."""
    from meshplan.specs import config_sha256

    recorded = plan.model.spec_sha256
    now = config_sha256(spec)
    if recorded and now and now != recorded:
        raise SpecError(f"{spec.target} has changed since the plan was made (sha256 "
                        f"{now[:12]}..., the plan records {recorded[:12]}...); make a new plan "
                        f"(meshplan plan --model {spec.text} ...) or restore the file")


def check_checkpoint_dir(directory: str, steps: int) -> str:
    """--checkpoint-dir: resuming must leave steps to train, and a directory that does not
    exist yet must not be a typo of one that holds checkpoints (it would start at step 0).
    Returns the line ``meshplan run`` prints when the run starts from step 0 ("" when it
    resumes: the worker says from where)."""
    import difflib

    from meshplan.runtime.checkpoint import latest_step

    if os.path.exists(directory) and not os.path.isdir(directory):
        raise SpecError(f"--checkpoint-dir {directory} is a file; name a directory")
    if os.path.isdir(directory):
        done = latest_step(directory)
        if done is not None and steps <= done:
            raise SpecError(f"--steps {steps}: the checkpoint in {directory} has trained "
                            f"{done} steps already; pass --steps {done + 1} or more to train "
                            "on, or another --checkpoint-dir to start afresh")
        check_writable(os.path.join(directory, "step_000000"))
        return "" if done is not None else \
            f"no checkpoint in {directory}: training from step 0, saving there"
    parent = os.path.dirname(os.path.abspath(directory))
    if not os.path.isdir(parent):
        raise SpecError(f"--checkpoint-dir {directory}: its parent {parent} does not exist; "
                        "fix the path or create the parent first")
    check_writable(directory)
    name = os.path.basename(os.path.abspath(directory))
    holding = [d for d in os.listdir(parent)
               if os.path.isdir(os.path.join(parent, d))
               and latest_step(os.path.join(parent, d)) is not None]
    near = difflib.get_close_matches(name, holding, n=1, cutoff=0.75)
    if near:
        found = os.path.join(os.path.dirname(directory), near[0])
        raise SpecError(f"--checkpoint-dir {directory} does not exist, but {found} holds "
                        f"checkpoints (step {latest_step(os.path.join(parent, near[0]))}); "
                        f"pass --checkpoint-dir {found} to resume, or mkdir {directory} "
                        "to start a new run there")
    return f"no checkpoint in {directory} (a new directory): training from step 0, saving there"


def check_run_numbers(args) -> None:
    """One clear line for numbers that cannot work, before anything starts."""
    rules = [(args.steps >= 1, f"--steps {args.steps}: train at least 1 step"),
             (args.timeout_s > 0, f"--timeout-s {args.timeout_s}: the collective timeout must "
              "be positive (seconds), e.g. 30"),
             (args.lr > 0, f"--lr {args.lr}: the learning rate must be positive, e.g. 3e-4"),
             (args.warmup >= 0, f"--warmup {args.warmup}: warmup steps must be 0 or more"),
             (args.clip >= 0, f"--clip {args.clip}: the max gradient norm must be positive "
              "(0: no clipping)"),
             (args.checkpoint_every >= 0, f"--checkpoint-every {args.checkpoint_every}: must "
              "be 0 (only at the end) or a positive step count"),
             (args.nproc_per_node >= 0, f"--nproc-per-node {args.nproc_per_node}: must be "
              "positive")]
    for ok, message in rules:
        if not ok:
            raise SpecError(message)


def plan_and_graph(path: str, model: str = "", *, recorded: bool = True):
    """Load a plan file; with a model spec (given, else with ``recorded`` the one the plan
    records), re-trace its graph (checks the fingerprint)."""
    from meshplan.explain import retrace
    from meshplan.plan import Plan

    plan = Plan.from_json(path)
    model = model or (plan.model.spec if recorded else "")
    graph = retrace(plan, model) if model else None
    if graph is not None:
        plan.check_graph(graph)  # a hand-edited placement, refused before it is described
    elif plan.model.spec:  # the model on meta (nothing traced): placements against its shapes
        from meshplan.specs import parse_model_spec

        try:  # a plan whose factory is not here can still be shown; run checks again
            built = parse_model_spec(plan.model.spec).build(device="meta")
        except SpecError:
            built = None
        if built is not None:
            plan.check_param_ranks({n: p.ndim for n, p in
                                    built.named_parameters(remove_duplicate=False)})
    return plan, graph


def recorded_spec(plan, path: str, given: str) -> str:
    """--model, else the spec the plan records; a plan made from a Python object has none."""
    spec = given or plan.model.spec
    if not spec:
        raise SpecError(f"{path} was made from a Python model ({plan.model.name}) and records "
                        "no model spec; pass --model SPEC (the spec the plan was made for)")
    return spec
