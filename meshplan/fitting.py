"""``meshplan fit``: will this model train on that GPU, on how many nodes, and how fast.

trace -> **fit** -> read. One trace of the model at the global batch, then two answers, both
from the stack layout search (meshplan/stacks/search.py: the uniform layouts torchtitan or
Megatron-LM runs, built by planner/manual.py and priced by ``costmodel.estimate`` as that
stack runs them):

- **the fewest nodes** of the GPU's preset (its node size: 8 GPUs on a DGX) on which some
  layout fits. Node counts are tried upward in powers of two, then the gap between the last
  that does not fit and the first that does is bisected. At each count only the layouts
  that hold the least memory are priced (``_frugal``): the largest tensor-parallel degree,
  the largest ZeRO level the stack runs, full recompute, microbatch 1 and the 1F1B
  schedule (the reasons are in ``_frugal``'s docstring), every context and pipeline degree,
  in order of their parameter-and-optimizer lower bound (``search.state_floor_gib``); a
  count whose lower bound already exceeds the device is decided without pricing.
  Bisection assumes that more nodes never need more memory per device; node counts that
  divide the batch badly can break that, so the answer is the fewest *found*, and every
  count tried is listed in ``FitAnswer.tried``.
- **the fastest layouts on the user's mesh** (``mesh``): ``search_layouts`` with
  ``keep=top``, whose compute bound then prunes against the ``top``-th fastest so far, each
  with its peak memory per device broken down (parameters, gradients, optimizer state,
  activations, buffers).

Speed (measured, docs/cli-json.md "fit"): the trace dominates a small model; for Llama 3.1
405B the first pricing of a placement group walks its 7,500 operators.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshplan.api import as_mesh
from meshplan.costmodel.estimate import default_runtime, estimate_plan
from meshplan.errors import MeshError, PlanningError, SpecError, gib
from meshplan.mesh import GPU_PRESETS, Mesh
from meshplan.plan import MemoryBreakdown
from meshplan.planner.manual import build_manual_plan
from meshplan.schedules import Schedule
from meshplan.stacks.arch import arch_of_model
from meshplan.stacks.layout import STACK_DTYPES
from meshplan.stacks.search import (TARGETS, ZEROS, Priced, expert_param_count, layouts,
                                    search_layouts, state_floor_gib)
from meshplan.sweep import variant
from meshplan.tracing import trace
from meshplan.vocabulary import ComputeDtype, Recompute

# --gpu's short names: the GPU -> the preset of its 8-GPU node (costmodel/presets/*.json)
GPU_NAMES = {"a100": "dgx-a100-80gb", "a100-80gb": "dgx-a100-80gb", "h100": "dgx-h100",
             "h100-80gb": "dgx-h100", "h200": "dgx-h200", "h100-96gb": "h100-96gb-hbm2e"}
MAX_NODES = 4096  # 32,768 GPUs of 8 per node: beyond the largest published runs (Llama 3
# 405B trained on 16,384 H100, arXiv 2407.21783 section 3.3)
DEFAULT_TOP = 5
DEFAULT_TIME_LIMIT_S = 60.0  # the fastest-layouts search keeps the best found after this


@dataclass(frozen=True, slots=True)
class FitLayout:
    """One layout that fits (or, for ``FitAnswer.closest``, the one that comes closest),
    priced as the stack runs it; memory per device of the peak device, in GiB."""

    layout: str  # StackLayout.words(): "dp16 tp8 pp4 1f1b mb1 recompute full SP ZeRO-3 bf16"
    manual: str  # the same layout as meshplan plan/estimate --manual takes it
    devices: int
    dp: int
    tp: int
    cp: int
    pp: int
    schedule: str
    virtual_stages: int
    microbatch_size: int
    recompute: str
    zero: int
    step_time_s: float
    mfu: float
    tokens_per_s: float
    fits: bool
    peak_memory_gib: float
    memory: MemoryBreakdown
    ep: int = 1  # routed experts split over ep ranks of dp x cp x tp (1: none, or dense)

    def line(self) -> str:
        """One line: the layout, its speed and its memory broken down."""
        m = self.memory
        return (f"{self.layout}: step {self.step_time_s:.3g} s, MFU {self.mfu:.1%}, peak "
                f"{gib(self.peak_memory_gib)} GiB (params {gib(m.params_gib)}, grads "
                f"{gib(m.grads_gib)}, optimizer {gib(m.optimizer_gib)}, activations "
                f"{gib(m.activations_gib)}, buffers {gib(m.buffers_gib)})")


@dataclass(frozen=True, slots=True)
class NodeTry:
    """One node count the smallest-mesh search tried."""

    nodes: int
    fits: bool
    priced: int  # layouts priced at this count (0: decided by the lower bound alone)
    least_gib: float  # the least peak memory found (priced), or the lower bound (unpriced)


@dataclass(frozen=True, slots=True)
class FitAnswer:
    """``meshplan.fit``'s answer. ``smallest_nodes`` is None when no count up to
    ``max_nodes`` fits (``closest`` then holds the layout that came closest); ``fastest`` is
    empty without a mesh, or when nothing fits on it."""

    model: str
    gpu: str  # the node preset, e.g. dgx-h100
    memory_gib: float  # per GPU, what the layouts must fit in
    devices_per_node: int
    global_batch: int
    seq_len: int
    dtype: str
    target: str  # the stack the layouts are priced as: torchtitan or megatron
    smallest_nodes: int | None
    smallest: FitLayout | None  # a layout that fits on smallest_nodes
    closest: FitLayout | None  # when nothing fits: the least memory found
    tried: tuple[NodeTry, ...]
    mesh: str = ""
    mesh_devices: int = 0
    mesh_fits: bool | None = None  # None: no mesh given
    fastest: tuple[FitLayout, ...] = ()
    search_status: str = ""  # the fastest-layouts search: what it priced, where it stopped
    wall_time_s: float = 0.0
    timings_s: dict = field(default_factory=dict)  # trace, smallest, fastest

    def text(self) -> str:
        """One line per answer, then one line per layout."""
        head = f"{self.model} at batch {self.global_batch} x seq {self.seq_len} ({self.dtype}, " \
               f"priced as {self.target} runs it) on {self.gpu} ({self.memory_gib:.1f} GiB " \
               f"per GPU, {self.devices_per_node} per node)"
        out = [head]
        if self.smallest_nodes is not None:
            n = self.smallest_nodes
            out.append(f"smallest mesh: {n} node{'s' if n > 1 else ''} "
                       f"({n * self.devices_per_node} GPUs): {self.smallest.line()}")
        else:
            near = f"; the closest: {self.closest.line()}" if self.closest else ""
            out.append(f"smallest mesh: none up to {self.tried[-1].nodes} nodes fits{near}")
        out.append("  tried: " + ", ".join(
            f"{t.nodes} {'fits' if t.fits else 'no'}" for t in self.tried))
        if self.mesh:
            if self.fastest:
                out.append(f"fastest on {self.mesh} ({self.mesh_devices} GPUs), "
                           f"{self.search_status}:")
                out += [f"  {i + 1}. {lay.line()}" for i, lay in enumerate(self.fastest)]
            else:
                out.append(f"on {self.mesh}: nothing fits ({self.search_status})")
        out.append(f"answered in {self.wall_time_s:.1f} s")
        return "\n".join(out)


def gpu_preset(gpu: str) -> str:
    """``--gpu``'s value as the node preset: a short name (h100, a100, h200, h100-96gb) or a
    preset's own name."""
    name = gpu.strip().lower()
    if name in GPU_PRESETS:
        return name
    if name in GPU_NAMES:
        return GPU_NAMES[name]
    raise MeshError(f"--gpu {gpu!r} is not a GPU meshplan has a preset for; use one of "
                    f"{', '.join(sorted(GPU_NAMES))} (or a preset: {', '.join(GPU_PRESETS)})")


def check_mesh_gpu(mesh, gpu: str) -> None:
    """A ``--mesh`` of another GPU than ``--gpu`` (its device name or its memory differ),
    refused in one line: the two answers would be about different machines."""
    if mesh is None:
        return
    preset = gpu_preset(gpu)
    want, got = Mesh.preset(preset, nodes=1).hardware.device, mesh.hardware.device
    if (want.name, want.memory_gib) != (got.name, got.memory_gib):
        raise SpecError(f"--mesh {mesh.name} is not of --gpu {gpu} ({preset}); give a mesh "
                        f"of that GPU, e.g. {preset}:nodes=16")


def fit(model, *, gpu: str, batch: int, seq: int, mesh=None, graph=None, model_name: str = "",
        target: str = "torchtitan", dtype: str = ComputeDtype.BF16, top: int = DEFAULT_TOP,
        max_nodes: int = MAX_NODES, time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
        example_inputs=()) -> FitAnswer:
    """Will ``model`` train at ``batch`` sequences of ``seq`` tokens on ``gpu``: the fewest
    nodes on which some layout ``target`` runs fits, and with ``mesh`` (a Mesh or a spec such
    as "dgx-h100:nodes=128") the ``top`` fastest layouts that fit on it (module docstring).
    ``graph``: the model's traced graph at that batch, if the caller has it."""

    start = time.perf_counter()
    if target not in TARGETS:
        raise SpecError(f"--for {target!r}: fit prices the layouts of {', '.join(TARGETS)}")
    if dtype not in STACK_DTYPES:
        raise SpecError(f"--dtype {dtype}: the stacks train in {', '.join(STACK_DTYPES)}")
    for name, value in (("--batch", batch), ("--seq", seq), ("--top", top),
                        ("--max-nodes", max_nodes)):
        if not isinstance(value, int) or value < 1:
            raise SpecError(f"{name} {value!r}: must be a positive integer")
    preset = gpu_preset(gpu)
    user_mesh = as_mesh(mesh) if mesh is not None else None
    check_mesh_gpu(user_mesh, gpu)
    arch = arch_of_model(model)
    if graph is None:
        import torch

        example_inputs = example_inputs or (torch.zeros((batch, seq), dtype=torch.long,
                                                        device="meta"),)
        graph = trace(model, example_inputs, model_name=model_name or type(model).__name__)
    shape = graph.inputs[0][1].shape
    if (shape[0], shape[1]) != (batch, seq):
        raise SpecError(f"the traced graph is of batch {shape[0]} x seq {shape[1]}, not "
                        f"{batch} x {seq}; trace at the batch and sequence fit asks about")
    t_traced = time.perf_counter()
    one = Mesh.preset(preset, nodes=1)
    per_node, cap = one.hardware.devices_per_node, one.hardware.device.memory_gib
    ctx = _Search(model, graph, arch, preset, target, dtype)
    tried, smallest, closest = _smallest(ctx, max_nodes)
    t_small = time.perf_counter()
    answer = dict(model=model_name or graph.model_name, gpu=preset, memory_gib=cap,
                  devices_per_node=per_node, global_batch=batch, seq_len=seq, dtype=dtype,
                  target=target, smallest_nodes=smallest[0] if smallest else None,
                  smallest=_layout(smallest[1]) if smallest else None,
                  closest=_layout(closest) if closest else None, tried=tuple(tried))
    if user_mesh is not None:
        answer.update(mesh=user_mesh.name, mesh_devices=user_mesh.num_devices)
        try:
            plan, priced = search_layouts(model, user_mesh, target, graph=graph, dtype=dtype,
                                          arch=arch, time_limit_s=time_limit_s, keep=top)
            fits = sorted((p for p in priced if p.fits), key=lambda p: p.step_time_s)
            answer.update(mesh_fits=True, fastest=tuple(_layout(p) for p in fits[:top]),
                          search_status=plan.solver.status)
        except PlanningError as exc:  # nothing fits, or no layout of the stack at all
            answer.update(mesh_fits=False, search_status=str(exc))
    end = time.perf_counter()
    return FitAnswer(**answer, wall_time_s=end - start,
                     timings_s={"trace": t_traced - start, "smallest": t_small - t_traced,
                                "fastest": end - t_small})


class _Search:
    """What pricing a layout at a node count needs, with the cost model's cache shared
    across the counts (the eager-kernel walk of the graph is done once)."""

    def __init__(self, model, graph, arch, preset: str, target: str, dtype: str):
        self.model, self.graph, self.arch = model, graph, arch
        self.preset, self.target, self.dtype = preset, target, dtype
        self.cache: dict = {}


def _frugal(ctx: _Search, nodes: int):
    """The least-memory layouts ``ctx.target`` runs on ``nodes`` nodes, lightest lower bound
    first, with that bound. Least memory because: tensor parallelism with sequence
    parallelism divides parameters, gradients, optimizer state and activations alike (the
    largest degree the node and the heads allow); the stack's highest ZeRO level shards the
    rest of the state over dp x cp; full recompute keeps only each block's input; one
    sequence per microbatch; 1F1B keeps at most pp microbatches in flight where GPipe keeps
    them all and interleaving adds a partial round. Context and pipeline degrees trade
    activations against state, so every one is kept, and so is every expert-parallel
    degree of a mixture of experts (it splits the experts' state, and adds dispatch buffers)."""
    mesh = Mesh.preset(ctx.preset, nodes=nodes)
    batch, seq = ctx.graph.inputs[0][1].shape[0], ctx.graph.inputs[0][1].shape[1]
    space = layouts(ctx.target, ctx.arch, devices=mesh.num_devices,
                    devices_per_node=mesh.devices_per_node, global_batch=batch, seq_len=seq,
                    dtype=ctx.dtype, recompute=(Recompute.FULL,))
    space = [lay for lay in space if lay.microbatch_size == 1
             and lay.schedule in (Schedule.ONE_F_ONE_B,)
             and lay.zero == (max(ZEROS[ctx.target]) if lay.dp * lay.cp > 1 else 0)]
    if space:
        top_tp = max(lay.tp for lay in space)
        space = [lay for lay in space if lay.tp == top_tp]
    experts = expert_param_count(ctx.graph) if ctx.arch.experts else 0
    floors = sorted(((state_floor_gib(lay, ctx.graph.param_count, ctx.dtype, experts), lay)
                     for lay in space), key=lambda fl: (fl[0], -fl[1].cp, fl[1].pp))
    return mesh, floors


def _price(ctx: _Search, mesh, lay):
    base = build_manual_plan(ctx.graph, mesh, **{**lay.manual_kwargs(), "recompute": "none"},
                             vocab_parallel_cp=True, optimizer="adam", priced=False, ep=lay.ep)
    runtime = default_runtime(mesh.hardware, engine=ctx.target, pipeline=lay.pp > 1)
    est = estimate_plan(variant(base, lay), ctx.graph, hw=mesh.hardware, runtime=runtime,
                        cache=ctx.cache)
    return Priced(lay, est.step_time_s, est.fits, est.peak_memory_gib, est.mfu, est.memory,
                  est.tokens_per_s)


def _fits_on(ctx: _Search, nodes: int):
    """(fits, the first fitting layout priced or the least-memory one, how many priced, the
    least memory: priced, or the lower bound when nothing was priced)."""
    mesh, floors = _frugal(ctx, nodes)
    cap = mesh.hardware.device.memory_gib
    least: Priced | None = None
    priced = 0
    for floor, lay in floors:
        if floor > cap:
            break  # ascending: no later layout can fit
        p = _price(ctx, mesh, lay)
        priced += 1
        if p.fits:
            return True, p, priced, p.peak_gib
        if least is None or p.peak_gib < least.peak_gib:
            least = p
    bound = least.peak_gib if least else (floors[0][0] if floors else float("nan"))
    return False, least, priced, bound


def _smallest(ctx: _Search, max_nodes: int):
    """Doubling, then bisection (module docstring): the node counts tried in order, (the
    fewest nodes, the layout priced there) or None, and when none fits the closest priced."""
    tried: list[NodeTry] = []
    closest = None
    seen: dict[int, tuple] = {}

    def probe(n: int):
        nonlocal closest
        if n not in seen:
            ok, p, priced, least = _fits_on(ctx, n)
            seen[n] = (ok, p)
            tried.append(NodeTry(n, ok, priced, least))
            if not ok and p is not None and (closest is None or p.peak_gib < closest.peak_gib):
                closest = p
        return seen[n]

    n, below = 1, 0
    while n <= max_nodes:
        ok, _ = probe(n)
        if ok:
            break
        below, n = n, n * 2
    else:
        return tried, None, closest
    lo, hi = below, n  # lo does not fit (0: nothing below 1), hi fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid)[0]:
            hi = mid
        else:
            lo = mid
    tried.sort(key=lambda t: t.nodes)
    return tried, (hi, seen[hi][1]), None


def _layout(p) -> FitLayout:
    lay = p.layout
    manual = (f"dp={lay.dp},tp={lay.tp},cp={lay.cp},pp={lay.pp},mb={lay.microbatch_size},"
              f"schedule={lay.schedule},vs={lay.virtual_stages},recompute={lay.recompute},"
              f"sp={int(lay.sequence_parallel)},zero={lay.zero}")
    if lay.stage_layers:
        manual += ",split=" + "/".join(map(str, lay.stage_layers))
    if lay.ep > 1:
        manual += f",ep={lay.ep}"
    return FitLayout(layout=lay.words(), manual=manual, devices=lay.devices, dp=lay.dp,
                     tp=lay.tp, cp=lay.cp, pp=lay.pp, schedule=lay.schedule,
                     virtual_stages=lay.virtual_stages, microbatch_size=lay.microbatch_size,
                     recompute=lay.recompute, zero=lay.zero, step_time_s=p.step_time_s,
                     mfu=p.mfu, tokens_per_s=p.tokens_per_s, fits=p.fits,
                     peak_memory_gib=p.peak_gib, memory=p.memory or MemoryBreakdown(),
                     ep=lay.ep)
