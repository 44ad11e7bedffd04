"""``meshplan plan --for torchtitan|megatron``: the search over what that stack runs, priced
as it runs it.

trace -> **search** -> plan -> export. The stacks take one tensor / context / pipeline /
data degree for the whole model, one recompute mode, one ZeRO level and an even (or
first/last-lighter) layer split, so the space is the uniform layouts (``StackLayout``) the
target accepts (its ``problems``, meshplan/stacks/torchtitan.py and megatron.py); each is
built by planner/manual.py with the stacks' vocab-parallel embedding and priced with that
stack's engine profile (``costmodel.estimate.default_runtime(engine=target)``), the same
function ``manual_plan(engine=target)`` and ``estimate(plan, engine=target)`` use.

The space, per devices = dp x cp x tp x pp:
- tp divides the devices of a node (tensor parallelism across nodes is never competitive,
  Narayanan et al. 2021 section 3.3);
- cp a power of two with at least ``MIN_CP_TOKENS`` tokens per rank;
- pp up to the number of blocks; microbatch sizes up to ``MAX_MICROBATCH`` dividing the
  per-replica batch; the target's schedules, interleaved with 2-8 chunks per rank
  (``VIRTUAL_STAGES``) where the chunks hold equal blocks, or equal blocks once the
  embedding and the loss count as one each (``_even_chunks``: Megatron's
  account-for-embedding/loss split, Llama 3's cut of 126 layers); recompute none, selective,
  full; the target's ZeRO levels;
  sequence parallelism with every tp > 1 (both stacks run TP that way);
- for a model with routed experts, every expert-parallel degree meshplan/axes.py's
  ``EP_AXIS`` offers (divisors of dp x cp x tp that divide the experts) and its model rules
  accept (``_ep_degrees``), where the target expresses it (torchtitan 0.3's
  expert_parallel_degree, borrowed from dp_shard x cp x tp; Megatron-LM's
  --expert-model-parallel-size with --expert-tensor-parallel-size 1); a dense model's
  space is what it was (ep 1 only).

Exact over that space, with three prunings that cannot drop the best plan: a layout whose
parameters, gradients and optimizer state alone exceed the device (``state_floor_gib``, a
lower bound of what the estimate counts) is skipped unpriced; for each layout the recompute
modes are priced none -> selective -> full, stopping at the first that fits (recompute only
adds work, so a later mode is never faster); microbatch sizes are priced in increasing order
and a layout that overflows at one size is not priced at larger ones (the activations in
flight, min(pp x mb, per-rank batch) sequences for the 1F1B schedules and the whole per-rank
batch for GPipe, never shrink as the microbatch grows); and once a layout of a placement group is priced
at a microbatch size, the forward + backward compute of its slowest rank group (m
microbatches; the same under every schedule, ZeRO level and recompute mode of that group
and size, which add bubble, communication and recompute on top) bounds the step time of
the others from below: they are skipped when that bound is beyond the best so far plus
the error margin (a slower layout within the margin may still be the simplest). Among fitting layouts the
fastest wins, then the simplest within the cost model's error band (planner/simplest.py's
margin and order: fewer stages, less ZeRO, no recompute, no cp).
"""

from __future__ import annotations

import bisect
import importlib
import time
from dataclasses import dataclass, replace

from meshplan.axes import EP, EP_AXIS, AxisContext
from meshplan.errors import MemoryLimitError, NotSupportedError, PlanningError
from meshplan.plan import RECOMPUTE, MemoryBreakdown, Plan
from meshplan.stacks.layout import StackLayout
from meshplan.schedules import Schedule
from meshplan.vocabulary import ComputeDtype

TARGETS = ("torchtitan", "megatron")
MIN_CP_TOKENS = 4096  # Llama 3 at 131K ran cp16: 8K tokens per rank (arXiv 2407.21783 3.3.2)
MAX_MICROBATCH = 8
VIRTUAL_STAGES = (2, 3, 4, 5, 6, 8)
STACK_SCHEDULES = {"torchtitan": (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED),
             "megatron": (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED)}
ZEROS = {"torchtitan": (0, 3), "megatron": (0, 1)}  # DDP or FSDP2; DDP or distributed optimizer


def target_module(target: str):
    """meshplan.stacks.torchtitan or .megatron (``problems``, ``to_*``, ``from_*``)."""
    if target not in TARGETS:
        raise NotSupportedError(f"target {target!r} is not one of {', '.join(TARGETS)}")
    return importlib.import_module(f"meshplan.stacks.{target}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(target: str, arch, *, devices: int, devices_per_node: int, global_batch: int,
            seq_len: int, dtype: str = ComputeDtype.BF16, compiled: bool = False,
            recompute=RECOMPUTE) -> list[StackLayout]:
    """Every layout of the module docstring's space that ``target`` runs (recompute modes
    in the order the search prices them)."""
    problems = target_module(target).problems
    out = []
    for tp in _divisors(min(devices, devices_per_node)):
        if devices % tp or devices_per_node % tp:
            continue
        cp = 1
        while devices % (tp * cp) == 0 and (cp == 1 or seq_len // cp >= MIN_CP_TOKENS) \
                and seq_len % (2 * cp) == 0:
            for pp in _divisors(devices // (tp * cp)):
                if pp > arch.layers:
                    continue
                dp = devices // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for ep in _ep_degrees(arch, dp=dp, cp=cp, tp=tp, pp=pp):
                    out += _variants(target, arch, problems, dict(
                        dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, global_batch=global_batch,
                        seq_len=seq_len, sequence_parallel=tp > 1, dtype=dtype,
                        compiled=compiled), recompute)
            cp *= 2
    return out


def _ep_degrees(arch, *, dp: int, cp: int, tp: int, pp: int) -> tuple[int, ...]:
    """The expert-parallel degrees searched at (dp, cp, tp, pp): those ``EP_AXIS`` offers for
    the model's routed experts that its rules accept, less the rule of meshplan's own
    runtime (the stack runs the plan); (1,) for a dense model. The target's own limits
    (torchtitan borrows from dp_shard only under FSDP) are its ``problems``."""
    if not arch.experts:
        return (1,)
    out = []
    for ep in EP_AXIS.degrees(dp * cp * tp, arch.experts):
        ctx = AxisContext(degrees=dict(dp=dp, cp=cp, tp=tp, pp=pp, **{EP: ep}),
                          experts=arch.experts)
        if not EP_AXIS.problems(ctx, runtime=False):
            out.append(ep)
    return tuple(out)


def _variants(target, arch, problems, base: dict, recompute) -> list[StackLayout]:
    dp, pp = base["dp"], base["pp"]
    local = base["global_batch"] // dp
    scheds = [(Schedule.ONE_F_ONE_B, 1)] if pp == 1 else \
        [(s, 1) for s in STACK_SCHEDULES[target] if s != Schedule.INTERLEAVED] + \
        [(Schedule.INTERLEAVED, v) for v in VIRTUAL_STAGES
         if Schedule.INTERLEAVED in STACK_SCHEDULES[target] and _even_chunks(arch.layers, pp * v)]
    zeros = ZEROS[target] if dp * base["cp"] > 1 else (0,)
    out = []
    for mb in (m for m in _divisors(local) if m <= MAX_MICROBATCH):
        for sched, v in scheds:
            for z in zeros:
                for rc in recompute:
                    try:
                        lay = StackLayout(microbatch_size=mb, schedule=sched, virtual_stages=v,
                                          recompute=rc, zero=z, **base)
                    except Exception:  # noqa: BLE001 - a shape StackLayout refuses
                        continue
                    if not problems(lay, arch):
                        out.append(lay)
    return out


def _even_chunks(layers: int, chunks: int) -> bool:
    """Chunks of equal blocks, or equal once the embedding and the loss count as a block each
    (Megatron's account-for-embedding/loss split; Llama 3 405B's 126 layers on 128 chunks)."""
    return chunks <= layers and (layers % chunks == 0 or (layers + 2) % chunks == 0)


def state_floor_gib(layout: StackLayout, param_count: int, dtype: str,
                    expert_params: int = 0) -> float:
    """A lower bound of the parameters, gradients and optimizer state one device holds:
    ``param_count / (tp x pp)`` parameters (a stage holds at least its share; replicated
    norms only add), each with its working copy (2 bytes in bf16/fp8, 4 in fp32) and 12
    bytes of fp32 master weights and Adam moments sharded over dp x cp from ZeRO-1, the
    gradient (4 bytes, fp32 reduction) sharded from ZeRO-2, the working copy from ZeRO-3.
    Under ep > 1 the ``expert_params`` (routed experts, of ``param_count``) count
    ``expert_params / (ep x pp)`` whole experts per device instead, sharded over the
    dp x cp x tp / ep ranks that hold the same experts (costmodel/moe.py ``ep_cost_terms``)."""
    work = 4 if dtype == ComputeDtype.FP32 else 2
    state = 12 if dtype != ComputeDtype.FP32 else 8  # fp32 trains without a separate master copy
    z = layout.zero

    def per_param(shard: int) -> float:
        return (work / shard if z >= 3 else work) + (4 / shard if z >= 2 else 4) + \
            (state / shard if z >= 1 else state)

    dense, experts = (param_count - expert_params, expert_params) if layout.ep > 1 else \
        (param_count, 0)
    efsdp = layout.dp * layout.cp * layout.tp // layout.ep
    return (dense / (layout.tp * layout.pp) * per_param(layout.dp * layout.cp)
            + experts / (layout.ep * layout.pp) * per_param(efsdp)) / 2 ** 30


def expert_param_count(graph) -> int:
    """The routed experts' parameters of ``graph`` (costmodel/moe.py); 0 for a dense model."""
    from meshplan.costmodel.moe import moe_layers

    return sum(ml.numel for ml in moe_layers(graph).values())


@dataclass(frozen=True, slots=True)
class Priced:
    layout: StackLayout
    step_time_s: float
    fits: bool
    peak_gib: float
    mfu: float
    memory: MemoryBreakdown | None = None  # of the peak device (meshplan fit shows it)
    tokens_per_s: float = 0.0


def search_layouts(model, mesh, target: str, *, graph, dtype: str = ComputeDtype.BF16,
                   compiled: bool = False, arch=None, progress=None,
                   exhaustive: bool = False, time_limit_s: float | None = None,
                   keep: int = 1) -> tuple[Plan, list[Priced]]:
    """The best plan ``target`` runs for ``model`` on ``mesh`` (module docstring), and the
    priced layouts; PlanningError (one line) when none fits. ``exhaustive`` prices every
    layout, without the prunings (the test that they drop nothing compares the two).
    ``time_limit_s``: stop pricing new placement groups after this long and keep the best
    found so far; the plan's solver status then says how many layouts were left unpriced
    (the plan is the best found, not proven the best). ``keep``: the compute bound prunes
    against the ``keep``-th fastest fitting layout so far, not the fastest, so that the
    ``keep`` fastest layouts are all priced (``meshplan fit`` lists them)."""
    from meshplan.costmodel.estimate import default_runtime, estimate_plan
    from meshplan.costmodel.runtime_profiles import with_compile
    from meshplan.planner.manual import build_manual_plan
    from meshplan.planner.simplest import error_margin
    from meshplan.sweep import variant  # a group's base plan with a layout's fields
    from meshplan.stacks.arch import arch_of_model

    start = time.perf_counter()
    arch = arch or arch_of_model(model)
    hw = mesh.hardware
    batch, seq = graph.inputs[0][1].shape[0], graph.inputs[0][1].shape[1]
    space = layouts(target, arch, devices=mesh.num_devices,
                    devices_per_node=mesh.devices_per_node, global_batch=batch, seq_len=seq,
                    dtype=dtype, compiled=compiled)
    if not space and compiled and target == "megatron":
        raise PlanningError("--compile with --for megatron: Megatron-LM does not run "
                            "torch.compile (its fused kernels are priced without it); drop "
                            "--compile")
    if not space and target == "torchtitan" and dtype == ComputeDtype.FP8:
        from meshplan.stacks.torchtitan import FP8_PROBLEM
        raise PlanningError(f"--dtype fp8 with --for torchtitan: {FP8_PROBLEM}")
    if not space:
        raise PlanningError(f"no layout of {arch.words()} on {mesh.num_devices} devices "
                            f"(batch {batch}, seq {seq}) is one {target} runs; change the "
                            "batch or the number of devices")
    cap = hw.device.memory_gib
    experts = expert_param_count(graph) if arch.experts else 0
    groups: dict[tuple, list[StackLayout]] = {}
    for lay in space:
        if not exhaustive and state_floor_gib(lay, graph.param_count, dtype, experts) > cap:
            continue
        uneven = lay.schedule == Schedule.INTERLEAVED and arch.layers % lay.chunks
        key = (lay.dp, lay.tp, lay.cp, lay.pp, lay.zero == 3,
               (lay.virtual_stages if uneven else 0))
        groups.setdefault(key, []).append(lay)
    priced: list[Priced] = []
    # priced as meshplan.estimate prices the plan it returns (fp8 casts fused when compiled)
    runtimes = {pp: with_compile(default_runtime(hw, engine=target, pipeline=pp > 1), compiled)
                for pp in {k[3] for k in groups}}
    best: float | None = None  # the fastest fitting step so far
    fitting: list[float] = []  # the fitting steps so far, ascending
    bounded = 0
    margin = error_margin(hw)
    ordered = sorted(groups.items(), key=lambda kv: _promise(kv[0]))
    unpriced = 0
    for i, (key, lays) in enumerate(ordered):
        if time_limit_s is not None and best is not None and \
                time.perf_counter() - start > time_limit_s:
            unpriced = sum(len(g) for _, g in ordered[i:])
            break
        first = lays[0]
        # the expert-parallel degrees of a group share its placements (ep splits the routed
        # experts' state and adds their all-to-alls, costmodel/moe.py): one base, whose
        # operator walk the cost model's cache keeps for every degree
        base = build_manual_plan(graph, mesh, **{**first.manual_kwargs(), "recompute": "none"},
                                 vocab_parallel_cp=True, optimizer="adam", priced=False)
        cache: dict = {}
        skip: set = set()  # (mb, schedule, v, zero, ep) that already fit at a lighter recompute
        floor: dict[tuple, float] = {}  # (microbatch size, ep) -> forward + backward (module doc)
        overflows: set = set()  # (schedule, v, zero, ep, recompute) that overflowed at a smaller mb
        for lay in lays:
            shape = (lay.microbatch_size, lay.schedule, lay.virtual_stages, lay.zero, lay.ep)
            if not exhaustive and (shape in skip or (shape[1:], lay.recompute) in overflows):
                continue
            bound = fitting[keep - 1] if len(fitting) >= keep else None
            if not exhaustive and bound is not None and \
                    floor.get((lay.microbatch_size, lay.ep), 0.0) >= bound * (1 + margin):
                bounded += 1
                continue
            est = estimate_plan(_ep_variant(variant(base, lay), lay.ep), graph, hw=hw,
                                runtime=runtimes[lay.pp], cache=cache)
            priced.append(Priced(lay, est.step_time_s, est.fits, est.peak_memory_gib, est.mfu,
                                 est.memory, est.tokens_per_s))
            if lay.recompute == "none":
                b = est.breakdown
                at = (lay.microbatch_size, lay.ep)
                floor[at] = max(floor.get(at, 0.0), b["forward"] + b["backward"])
            if not est.fits:
                overflows.add((shape[1:], lay.recompute))
            if est.fits:
                skip.add(shape)
                best = est.step_time_s if best is None else min(best, est.step_time_s)
                bisect.insort(fitting, est.step_time_s)
        if progress:
            progress(i + 1, len(groups))
    if best is None:
        low = min(priced, key=lambda p: p.peak_gib) if priced else None
        more = f"; the smallest needs {low.peak_gib:.1f} GiB ({low.layout.words()})" if low else \
            "; every layout's parameters and optimizer state alone exceed it"
        raise MemoryLimitError(f"no layout {target} runs fits {cap:.0f} GiB per device{more}: "
                               "add devices, lower the batch or the sequence",
                               min_memory_gib=low.peak_gib if low else min(
                                   state_floor_gib(lay, graph.param_count, dtype, experts)
                                   for lay in space))
    chosen = _simplest([p for p in priced if p.fits], best, margin)
    plan = _built(model, mesh, graph, target, chosen.layout, compiled)
    fastest = min((p for p in priced if p.fits), key=lambda p: p.step_time_s)
    runner = "" if fastest.layout == chosen.layout else \
        (f"{fastest.layout.words()} ({1 - fastest.step_time_s / chosen.step_time_s:.1%} "
         f"faster, within the {margin:.1%} margin)")
    stopped = (f"; stopped at the {time_limit_s:g} s time limit with {unpriced} layouts "
               "unpriced: the best found, not proven the best") if unpriced else ""
    solver = replace(plan.solver, name=f"meshplan.stacks.search ({target})",
                     objective_s=plan.predicted.step_time_s,
                     status=f"best of the {len(space)} layouts {target} runs: {len(priced)} "
                            f"priced, {bounded} bounded by their compute, "
                            f"{len(space) - len(priced) - bounded - unpriced} by memory or "
                            f"recompute{stopped}",
                     margin=margin, runner_up=runner)
    return replace(plan, solver=solver, wall_time_s=time.perf_counter() - start), priced


def _ep_variant(plan: Plan, ep: int) -> Plan:
    """``plan`` (unpriced) with its stages' routed experts split over ``ep`` ranks; the
    stages keep their operator dicts, so the cost model's memo of them still hits."""
    if ep == 1:
        return plan
    return replace(plan, stages=tuple(replace(st, ep=ep) for st in plan.stages))


def _promise(key: tuple) -> tuple:
    """The order groups are priced in: likely fast ones first (fewer pipeline stages, less
    tensor and context parallelism), so that the compute bound prunes more."""
    dp, tp, cp, pp, zero3, _ = key
    return (pp, tp * cp, zero3)


def _complexity(lay: StackLayout) -> tuple:
    return (lay.pp, lay.zero, RECOMPUTE.index(lay.recompute), lay.cp > 1, lay.ep > 1)


def _simplest(fits: list[Priced], best_s: float, margin: float) -> Priced:
    """planner/simplest.py's rule on the priced layouts: within ``margin`` of the fastest,
    fewest stages, then least ZeRO, then least recompute, then no cp, then no expert
    parallelism (no all-to-all); then the fastest."""
    near = [p for p in fits if p.step_time_s <= best_s * (1 + margin)]
    return min(near, key=lambda p: (_complexity(p.layout), p.step_time_s))


def _built(model, mesh, graph, target: str, lay: StackLayout, compiled: bool) -> Plan:
    """The chosen layout as ``manual_plan(engine=target)`` builds and prices it."""
    from meshplan import api

    plan = api.manual_plan(model, mesh, graph=graph, engine=target,
                           model_name=graph.model_name, ep=lay.ep, **lay.manual_kwargs())
    if compiled:
        plan = replace(plan, training=replace(plan.training, compiled=True))
        plan = plan.with_prediction(api.estimate(plan))
    return plan
