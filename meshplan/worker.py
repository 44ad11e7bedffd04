"""The torchrun worker behind ``meshplan run``: load a plan, build the model, train N steps.

trace -> cost -> solve -> plan -> **run**. Every rank builds the same initial weights from
``--seed`` (whatever the plan) and draws the same synthetic global batch per step, so the
losses of two plans are comparable. Rank 0 prints loss and time per step and writes the
metrics file. With ``--checkpoint-dir`` the run saves a sharded checkpoint every
``--checkpoint-every`` steps and, when the directory already holds one, resumes from the
newest. Collectives time out after ``--timeout-s`` so that a hung peer fails the run.
``--fail-at-step K --fail-rank R [--fail-mode exit|hang]`` makes rank R exit abruptly (or
stop responding) before step K: fault injection for the failure and resume tests.

``--data FILE`` trains on a nanoGPT token file instead (runtime/data.py; each rank reads only
its rows of the global batch). ``--warmup N`` warms the learning rate up linearly over N
steps (LambdaLR), ``--clip MAX_NORM`` clips the global gradient norm (runtime/grad_clip.py,
as an optimizer step pre-hook, after the runtime's gradient sync). SIGINT and SIGTERM end a
worker at once and silently (the default action): ``meshplan run`` prints the one line.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":  # before the slow imports: Ctrl-C never shows a worker traceback
    signal.signal(signal.SIGINT, signal.SIG_DFL)

import argparse
import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.nn as nn
import torch.distributed as dist

from meshplan.errors import MeshplanError, SpecError
from meshplan.plan import Plan, atomic_write
from meshplan.runtime import checkpoint
from meshplan.runtime.data import TokenFile, rows_read_by
from meshplan.runtime.grad_clip import clip_grad_norm_
from meshplan.runtime.memory_probe import StepMemoryProbe, training_state_tensors
from meshplan.runtime.graph.parallelize import make_optimizer, parallelize_graph
from meshplan.specs import parse_model_spec
from meshplan.tracing import flatten_call, unflatten_call
from meshplan.vocabulary import Engine


def _rss_gib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="meshplan-worker")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=0, help="linear warmup steps")
    ap.add_argument("--clip", type=float, default=0.0, help="max global gradient norm (0: off)")
    ap.add_argument("--data", default="", help="flat binary of token ids (nanoGPT's train.bin)")
    ap.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    ap.add_argument("--metrics-out", default="")
    ap.add_argument("--checkpoint-dir", default="")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=30.0,
                    help="process-group timeout: a collective waiting longer fails the run")
    ap.add_argument("--fail-at-step", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--fail-mode", choices=("exit", "hang"), default="exit", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    import logging
    for name in ("torch.distributed.tensor._redistribute", "torch._logging._internal"):
        logging.getLogger(name).setLevel(logging.ERROR)  # per-op DTensor advice, not errors
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        plan = Plan.from_json(args.plan)
        spec = parse_model_spec(args.model)
        torch.manual_seed(args.seed)
        loaded = spec.load_for_plan(plan, device="cpu")
        model, loss_fn = loaded.model, loaded.call.loss_fn
        flat0, signature = flatten_call(loaded.call.inputs, loaded.call.targets)
        check_call(plan, signature, args.model)
        rss_before = _rss_gib()
        pm = ModuleWorkerModel(model, plan, loss_fn, signature) if plan.engine == Engine.MODULES \
            else parallelize_graph(model, plan, flat0, loss_fn=loss_fn, signature=signature)
        optimizer = make_optimizer(pm.optimizer_params(), plan, lr=args.lr)
        first = 0
        if checkpoint.latest_step(args.checkpoint_dir) is not None:
            first = checkpoint.load(args.checkpoint_dir, pm, optimizer)
            if first >= args.steps:  # meshplan run checks before launch; torchrun users here
                raise SpecError(f"--steps {args.steps}: the checkpoint in "
                                f"{args.checkpoint_dir} has trained {first} steps already; "
                                f"pass --steps {first + 1} or more")
            if rank == 0:
                print(f"resumed from {checkpoint.checkpoint_path(args.checkpoint_dir, first)} "
                      f"after {first} steps", flush=True)
        schedule = warmup_schedule(optimizer, args.warmup, first)
        norms: list[float] = []
        if args.clip > 0:  # after the runtime's gradient sync, before the update
            engine = pm.run.engine if isinstance(pm, ModuleWorkerModel) else pm
            optimizer.register_step_pre_hook(
                lambda *_: norms.append(clip_grad_norm_(engine, args.clip)))
        batches = batch_source(args, plan, loaded, rank)
        losses, times, lrs = [], [], []
        tensor_peak = 0.0
        for step in range(first, args.steps):
            if step == args.fail_at_step and rank == args.fail_rank:
                print(f"rank {rank}: injected failure ({args.fail_mode}) before step {step} "
                      f"at unix time {time.time():.3f}", file=sys.stderr, flush=True)
                if args.fail_mode == "hang":
                    time.sleep(3600)
                os._exit(3)
            batch = batches(step)
            lrs.append(optimizer.param_groups[0]["lr"])
            dist.barrier()
            start = time.perf_counter()
            probe = StepMemoryProbe(training_state_tensors(pm, optimizer)) \
                if step == min(first + 1, args.steps - 1) else nullcontext()
            with probe:  # peak live tensor bytes of one steady step (runtime/memory_probe.py)
                loss = pm.train_step(batch, optimizer) if isinstance(pm, ModuleWorkerModel) \
                    else _weighted_step(pm, plan, signature, batch, optimizer, rank)
            if isinstance(probe, StepMemoryProbe):
                tensor_peak = probe.peak_bytes / 2**30
            schedule.step()
            dist.barrier()
            elapsed = time.perf_counter() - start
            losses.append(loss)
            times.append(elapsed)
            if rank == 0:
                print(f"step {step}: loss {loss:.6f}  time {elapsed * 1e3:.1f} ms", flush=True)
            every = args.checkpoint_every and (step + 1) % args.checkpoint_every == 0
            if args.checkpoint_dir and (every or step + 1 == args.steps):
                checkpoint.save(args.checkpoint_dir, pm, optimizer, step + 1)
        peak = torch.tensor([_rss_gib() - rss_before, tensor_peak], dtype=torch.float64)
        gathered = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, peak)
        if rank == 0:
            timed = times[1:] or times or [0.0]
            measured = sorted(timed)[len(timed) // 2]
            metrics = {
                "model": args.model, "plan_fingerprint": plan.model.fingerprint,
                "world_size": dist.get_world_size(), "seed": args.seed, "first_step": first,
                "losses": losses, "lr": lrs, "data": args.data or "synthetic",
                **({"grad_norm": norms} if args.clip > 0 else {}),
                "step_time_s": times, "measured_step_time_s": measured,
                "predicted_step_time_s": plan.predicted.step_time_s,
                "predicted_peak_memory_gib": plan.predicted.peak_memory_gib,
                "peak_memory_gib_per_rank": [float(g[0]) for g in gathered],
                "peak_tensor_memory_gib_per_rank": [float(g[1]) for g in gathered],
                "memory_measure": "peak RSS growth from model build to the end of training",
            }
            print(f"predicted step time {plan.predicted.step_time_s * 1e3:.1f} ms, measured "
                  f"{measured * 1e3:.1f} ms (median of steps after the first)", flush=True)
            print("peak memory per rank (GiB, RSS growth): predicted "
                  f"{plan.predicted.peak_memory_gib:.3f}, measured "
                  + " ".join(f"{float(g[0]):.3f}" for g in gathered), flush=True)
            print("peak live tensor memory per rank (GiB): "
                  + " ".join(f"{float(g[1]):.3f}" for g in gathered), flush=True)
            if args.metrics_out:
                atomic_write(args.metrics_out, json.dumps(metrics, indent=1) + "\n")
    except MeshplanError as exc:
        report_user_error(exc, rank)
        dist.destroy_process_group()
        return EXIT_USER_ERROR
    dist.barrier()  # nobody tears gloo down while a peer is still writing its results
    dist.destroy_process_group()
    return 0


EXIT_USER_ERROR = 2  # what meshplan/cli.py answers bad input with


def report_user_error(exc: MeshplanError, rank: int) -> None:
    """Under torchrun's agent (``meshplan run``), into the agent's error file
    (TORCHELASTIC_ERROR_FILE): the launcher prints one line for all ranks and exits 2
    (runtime/launch.py ``user_error``). Elsewhere, on stderr with the rank."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": str(exc), "timestamp": int(time.time()),
                           "meshplan": True}, f)
            return
        except OSError:
            pass
    print(f"meshplan run (rank {rank}): {exc}", file=sys.stderr, flush=True)


def warmup_schedule(optimizer, warmup: int, first: int):
    """Linear warmup over ``warmup`` steps, then constant; positioned at step ``first``."""
    for group in optimizer.param_groups:  # a resumed run: LambdaLR starts from initial_lr
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0,
        last_epoch=first - 1)


def _weighted_step(pm, plan: Plan, signature, batch, optimizer, rank: int) -> float:
    """The graph engine's step on a whole global batch, each microbatch's loss weighed by
    its labelled targets (runtime/loss_weights.py; the public API's train_step does it for
    the module engine)."""
    from meshplan.runtime import loss_weights
    from meshplan.runtime.run import data_parallel_coordinate

    flat = batch if isinstance(batch, tuple) else (batch,)
    first = signature.num_args + len(signature.kwarg_names) if signature is not None else None
    if first is None or signature.num_targets == 0:
        return pm.train_step(batch, optimizer)
    dp_rank, dp_size = data_parallel_coordinate(plan, rank)
    labels = loss_weights.global_label_counts(flat[first], plan.training.microbatches, dp_size)
    if labels is None:
        return pm.train_step(batch, optimizer)
    flat = list(flat)
    flat[first] = loss_weights.guard_empty_global(flat[first], labels)
    return pm.train_step(tuple(flat), optimizer, labels=labels, dp_rank=dp_rank)


class ModuleWorkerModel:
    """A plan whose engine is "modules" (PyTorch's composables) behind the interface this
    worker drives the graph engine with: ``train_step(global batch, optimizer)``,
    ``optimizer_params()``, ``named_buffers()``, ``unique_params()`` (runtime/checkpoint.py
    and memory_probe.py read those; clipping takes ``run.engine``). Each rank takes its data-parallel rows."""

    def __init__(self, model, plan: Plan, loss_fn=None, signature=None):
        from meshplan.runtime.run import parallelize as public_parallelize

        self.plan = plan
        self.signature = signature
        self.run = public_parallelize(model, plan, loss_fn=loss_fn)
        self.tie_groups = ()

    @staticmethod
    def rows(plan: Plan, rank: int) -> range:
        from meshplan.runtime.run import data_parallel_coordinate

        dp_rank, dp_size = data_parallel_coordinate(plan, rank)
        n = plan.training.global_batch // dp_size
        return range(dp_rank * n, (dp_rank + 1) * n)

    def train_step(self, batch, optimizer) -> float:
        """``batch``: the flat global batch (inputs, then targets); this rank takes its rows
        of every tensor (the first dim is the batch)."""
        flat = batch if isinstance(batch, tuple) else (batch,)
        n = flat[0].shape[0] // self.run.dp_size
        mine = tuple(x[self.run.dp_rank * n:(self.run.dp_rank + 1) * n] for x in flat)
        args, kwargs, targets = unflatten_call(mine, self.signature) if self.signature \
            else (mine, {}, ())
        loss = self.run.train_step(kwargs if kwargs else args, targets=targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def optimizer_params(self) -> dict:
        return self.run.named_parameters()

    def unique_params(self) -> list:
        return self.run.parameters()

    def named_buffers(self) -> dict:
        params = set(self.run.named_parameters())
        return {n: t for n, t in self.run.engine.state_tensors().items()
                if n not in params and not isinstance(t, nn.Parameter)}


def check_call(plan: Plan, signature, spec_text: str) -> None:
    """The spec's call (positional, keyword, target tensors) must be the one the plan was
    traced with; a plan made before a spec's calling convention changed says so here."""
    from meshplan.runtime.run import plan_call

    want, _ = plan_call(plan)
    if want != signature:
        raise SpecError(f"the plan was made for a call of {want.num_args} positional, "
                        f"{len(want.kwarg_names)} keyword and {want.num_targets} target tensors; "
                        f"{spec_text} now gives {signature.num_args}, "
                        f"{len(signature.kwarg_names)} and {signature.num_targets}: re-plan it "
                        "(meshplan plan)")


def batch_source(args, plan: Plan, loaded, rank: int):
    """step -> the flat global batch (inputs, then targets; for a token file, this rank's
    rows filled in). Synthetic batches come from ``--seed`` and the step alone, the same for
    every plan and rank (specs.LoadedModel.synthetic)."""
    b, seq = plan.training.global_batch, plan.training.seq_len
    model = loaded.model
    if not args.data:
        def synthetic(step: int):
            call = loaded.synthetic(seed=args.seed, step=step)
            return flatten_call(call.inputs, call.targets)[0]
        return synthetic
    if not loaded.takes_token_ids:
        raise SpecError(f"--data feeds token ids to causal LMs; {args.model} is called "
                        "otherwise; drop --data")
    tokens = TokenFile(args.data, args.data_dtype)
    tokens.check_batch(b, seq)
    rows = rows_read_by(plan, rank) if plan.engine != Engine.MODULES else \
        ModuleWorkerModel.rows(plan, rank)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)

    def read(step: int) -> tuple[torch.Tensor]:
        batch = tokens.batch(b, seq, seed=args.seed, step=step, rows=rows)
        if vocab:  # every rank agrees, so a bad id fails all ranks at once, not by timeout
            largest = torch.tensor([int(batch.max())])
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
            tokens.check_vocab(int(largest), vocab, step)
        return (batch,)
    return read


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (metrics atomically, checkpoints by DCP). Skip interpreter
    # teardown: gloo's transport threads can abort the process during static destruction
    # ("terminate called without an active exception", seen once in 2-process CI runs),
    # which would turn a finished run into a failed one.
    os._exit(code)
