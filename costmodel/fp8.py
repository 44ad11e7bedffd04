"""fp8 training as today's H100 stacks run it: the linear layers' GEMMs in fp8, the rest bf16.

trace -> **cost** -> solve -> run, for estimation and export only (meshplan's runtimes train
bf16/fp32: meshplan/support.py refuses ``dtype 'fp8'`` for them). A plan with
``dtype: "fp8"`` is priced as torchtitan's float8 (torchao.float8) and NeMo's FP8
(Transformer Engine) run it:

- the parameter matmuls inside the blocks (attention projections, MLP) run their three
  products, forward ``y = x w^T``, ``dx = dy w`` and ``dw = dy^T x``, as fp8 GEMMs
  (e4m3 inputs; Transformer Engine's hybrid recipe takes e5m2 for the gradient ``dy``, the
  same GEMM rate) at the device's dense fp8 peak (``peak_tflops.float8``: 1,979 TFLOP/s on
  H100/H200 SXM = 2 x bf16) times the fp8 GEMM curve of the recipe's scaling
  (``DeviceSpec.fp8_gemm_efficiency``: measured fractions, sources in the preset);
- attention, norms, elementwise work, the embedding and the output head, the optimizer
  and the communication stay as under bf16 (but for the fp8 gathers below) (``compute.DTYPE_BYTES["fp8"]`` = 2, fp32
  master weights and gradients: ``memory.state_bytes_per_param``);
- dynamic scaling: every GEMM input the recipe casts takes an amax reduction, then a
  scale-and-cast pass, memory-bound kernels priced at the device's memory bandwidth
  (``CAST_KERNELS``). Which inputs each product casts is the recipe's (``RECIPES``).

Recipes (``RuntimeModel.fp8_recipe``):

- ``torchao-tensorwise`` (torchtitan ``--model.converters float8``, the default recipe; its
  fp8 all-gather needs this one) and ``torchao-rowwise`` (``recipe_name rowwise``,
  per-row scales, e4m3 throughout): torchao saves the linear's bf16 input and weight for the
  backward and casts every operand of every product (torchao docs, "Quantized Training":
  ``to_fp8`` on both operands of all three products): x and w in the forward, dy twice
  (one per backward product, scaled along different axes under rowwise), w and x again in
  the backward. The saved activations stay bf16.
- ``te-current`` (NeMo FP8 "current scaling", per-tensor scales computed in the step,
  Transformer Engine): an amax pass, then a fused cast-transpose that writes the fp8 tensor
  and its transpose; x and w in the forward, dy in the backward; the backward reuses the
  fp8 x^T and w^T the forward made, and the linear's input is saved for the backward in
  fp8 (1 byte instead of 2: ``saved_input_bytes_saved``). The cast weight and its
  transpose are kept over the step's microbatches (Megatron-Core passes TE's
  ``is_first_microbatch``): one weight cast per step, two fp8 copies of every block
  linear's weight in memory (``weight_copy_bytes``).

Cast kernels (``RuntimeModel.fp8_casts``): "eager" is torchao's dynamic cast run op by op
(abs, max, multiply by the scale, clamp, convert: five kernels), "fused" the same as
torch.compile fuses it (an amax reduction, then one scale-and-cast kernel),
"cast-transpose" Transformer Engine's. Measured beside it on this workplace's H200
(benchmarks/results/gpu_check.md, "fp8 e4m3 GEMM", 8192^3 tensorwise): 1,213 TFLOP/s
for the GEMM alone, 621 with the eager cast and amax of both inputs before it; this model
prices that case at 719 (``tests/test_fp8.py`` pins the model's side, not the measurement).

Tensor parallelism (issue 43): casts and amaxes are memory-bound kernels on the bytes each
rank holds when they run (``held_elements``). torchao's tensorwise recipe under TP
(``Float8ColwiseParallel`` / ``Float8RowwiseParallel``, which torchtitan applies to
tensorwise only; torchtitan docs/float8.md: "float8 all-gather ... for TP (by default for
Float8Linear)") casts a block linear's input on its sequence shard and all-gathers it at 1
byte per element, casts a row-parallel output's gradient on its shard before the backward's
fp8 all-gather, and hands the linear its input and dy already cast (``tp_backward_casts``);
each tensorwise amax of a TP-sharded tensor is a scalar all-reduce on NCCL's LL protocol
(``amax_all_reduce_s``). Rowwise runs plain ColwiseParallel / RowwiseParallel: bf16 gathers,
casts after them. Transformer Engine's recipe keeps bf16 TP communication here.

fp8 all-gather (``RuntimeModel.fp8_all_gather``, torchtitan's
``enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``): the
block linears' weights are cast to fp8 on their shard and all-gathered in fp8, half the
bytes (estimate.parameter_walk), and arrive cast: no weight casts per microbatch (the cast
of the 1/dp shard is left out).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodel.comm import Collective
from meshplan.costmodel.compute import OpTime
from meshplan.costmodel.hardware import HardwareProfile
from meshplan.costmodel.stage_layout import split_factor
from meshplan.errors import PlanningError
from meshplan.graph import OpGraph, OpKind, OpNode
from meshplan.placements import PARTIAL, REPLICATE
from meshplan.vocabulary import ComputeDtype

FP8_PEAK = "float8"  # DeviceSpec.peak_tflops key of the dense fp8 tensor-core peak
# bytes moved per element of the cast tensor, one entry per kernel (bf16 in, fp8 out)
CAST_KERNELS = {
    "eager": (4, 2, 4, 4, 3),  # abs (r2 w2), amax (r2), x * scale (r2 w2), clamp (r2 w2), to fp8 (r2 w1)
    "fused": (2, 3),  # amax (r2), scale + cast (r2 w1)
    "cast-transpose": (2, 4),  # amax (r2), cast writing the tensor and its transpose (r2 w1 w1)
}


@dataclass(frozen=True, slots=True)
class Fp8Recipe:
    scaling: str  # the GEMM curve: DeviceSpec.fp8_gemm_efficiency key
    forward_casts: tuple[str, ...]  # GEMM inputs cast per forward: "x", "w", "dy"
    backward_casts: tuple[str, ...]
    saves_fp8_input: bool  # the linear's input kept for the backward in fp8
    weight_cast_per_step: bool = False  # the cast weight kept over the step's microbatches
    # tensor parallelism's gathers in fp8 (torchao's Float8ColwiseParallel /
    # Float8RowwiseParallel, which torchtitan applies under tensorwise only): a block
    # linear's input is cast on the shard the rank holds, then all-gathered at 1 byte per
    # element; a row-parallel linear's output gradient is cast on its sequence shard, then
    # all-gathered in fp8 (the backward of the forward's reduce-scatter). Tensorwise scales
    # of a sharded tensor take one scalar all-reduce of its amax over the axis. The input
    # and the output gradient then reach the linear already in fp8, so its backward casts
    # only what ``tp_backward_casts`` lists (torchao skips a cast of a tensor already fp8:
    # the backward's dy and x, whose tensorwise scale serves the transposed use too).
    tp_fp8_gather: bool = False
    tp_backward_casts: tuple[str, ...] = ()


RECIPES = {
    "torchao-tensorwise": Fp8Recipe("tensorwise", ("x", "w"), ("dy", "w", "x", "dy"), False,
                                    tp_fp8_gather=True, tp_backward_casts=("dy", "w")),
    "torchao-rowwise": Fp8Recipe("rowwise", ("x", "w"), ("dy", "w", "x", "dy"), False),
    "te-current": Fp8Recipe("tensorwise", ("x", "w"), ("dy",), True, True),
}

# The public recipe names (``fp8_recipe=`` of manual_plan / autoparallel / estimate,
# ``--fp8-recipe``, ``Plan.training.fp8_recipe``) -> (RECIPES key, FSDP all-gathers the block
# linears' weights in fp8), by the family of the engine that prices the plan. torchao
# (torchtitan, and meshplan's own engines where a what-if prices fp8 on them):
# "tensorwise" (dynamic per-tensor scales; TP gathers in fp8, FSDP gathers bf16),
# "tensorwise-fp8-all-gather" (the same with ``enable_fsdp_float8_all_gather``: torchtitan's
# published runs), "rowwise" (``recipe_name rowwise``: bf16 gathers throughout). Megatron-LM /
# NeMo (Transformer Engine): "tensorwise" is ``--fp8-recipe tensorwise``, current scaling.
PUBLIC_RECIPES = ("tensorwise", "tensorwise-fp8-all-gather", "rowwise")
TORCHAO_RECIPES = {"tensorwise": ("torchao-tensorwise", False),
                   "tensorwise-fp8-all-gather": ("torchao-tensorwise", True),
                   "rowwise": ("torchao-rowwise", False)}
TE_RECIPES = {"tensorwise": ("te-current", False)}
TE_ENGINES = ("megatron", "nemo", "megatron-2021")


def recipe_for_engine(public: str, engine: str) -> tuple[str, bool]:
    """(RECIPES key, fp8 FSDP all-gather) of the public recipe ``public`` as ``engine``
    runs it; one line naming the choices where that engine has no such recipe."""
    table = TE_RECIPES if engine in TE_ENGINES else TORCHAO_RECIPES
    if public not in table:
        if public in PUBLIC_RECIPES:
            raise PlanningError(
                f"fp8_recipe={public!r} is not one {engine} runs: Transformer Engine's recipe "
                f"meshplan prices is {', '.join(table)} (--fp8-recipe tensorwise, current "
                "scaling); use it, or price the plan for torchtitan")
        raise PlanningError(f"fp8_recipe={public!r} is not one of {', '.join(PUBLIC_RECIPES)}")
    return table[public]


def public_recipe(recipe: str, all_gather: bool) -> str:
    """The public name of a runtime's (recipe, fp8 all-gather): the inverse of
    ``recipe_for_engine``."""
    for table in (TORCHAO_RECIPES, TE_RECIPES):
        for name, value in table.items():
            if value == (recipe, all_gather):
                return name
    return ""


def check_fp8_hardware(hw: HardwareProfile, recipe: str) -> None:
    """One line where ``hw`` has no fp8 tensor cores or no fp8 GEMM curve for ``recipe``'s
    scaling (the A100: Ampere has no fp8)."""
    dev = hw.device
    scaling = RECIPES[recipe].scaling
    if not dev.peak_tflops.get(FP8_PEAK) or scaling not in dev.fp8_gemm_efficiency:
        raise PlanningError(
            f"hardware {dev.name!r} prices no fp8 GEMMs (device.peak_tflops.{FP8_PEAK} and "
            f"device.fp8_gemm_efficiency.{scaling}); fp8 tensor cores are Hopper's (H100, "
            "H200) and later: use a profile that lists them, or dtype 'bf16'")


@dataclass(frozen=True, slots=True)
class Fp8Pricing:
    """How the stack runs fp8 (from RuntimeModel.fp8_recipe / fp8_casts / fp8_all_gather)."""

    recipe: str = "torchao-tensorwise"
    casts: str = "eager"
    all_gather: bool = False

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise PlanningError(f"fp8_recipe={self.recipe!r} is not one of "
                                f"{', '.join(RECIPES)}")
        if self.casts not in CAST_KERNELS:
            raise PlanningError(f"fp8_casts={self.casts!r} is not one of "
                                f"{', '.join(CAST_KERNELS)}")


def fp8_pricing(dtype: str, runtime) -> Fp8Pricing | None:
    """The fp8 terms of ``runtime`` when the plan computes in fp8, else None."""
    if dtype != ComputeDtype.FP8:
        return None
    return Fp8Pricing(runtime.fp8_recipe, runtime.fp8_casts, runtime.fp8_all_gather)


def fp8_weight_input(node: OpNode, graph: OpGraph) -> int | None:
    """Index of the weight input of a block linear (a matmul inside a block reading a 2-D
    parameter), the GEMMs fp8 recipes convert; None for every other operator (the output
    head and the embedding stay bf16, as torchtitan's filter and Megatron's output layer)."""
    if node.kind != OpKind.MATMUL or node.layer < 0:
        return None
    for k, name in enumerate(node.inputs):
        info = graph.param_map.get(name)
        if info is not None and len(info.shape) == 2:
            return k
    return None


def _gemm_s(hw: HardwareProfile, flops: float, nbytes: float, scaling: str) -> float:
    dev = hw.device
    curve = dev.fp8_gemm_efficiency.get(scaling)
    peak = dev.peak_tflops.get(FP8_PEAK, 0.0)
    if curve is None or not peak:
        raise PlanningError(
            f"hardware {dev.name!r} prices no fp8 GEMMs (device.peak_tflops.{FP8_PEAK} and "
            f"device.fp8_gemm_efficiency.{scaling}); fp8 tensor cores are Hopper's (H100, "
            "H200) and later: use a profile that lists them, or dtype 'bf16'")
    t_flops = flops / (peak * 1e12 * curve(flops)) if flops > 0 else 0.0
    t_bytes = nbytes / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency(nbytes)) \
        if nbytes > 0 else 0.0
    return max(t_flops, t_bytes)


def cast_s(hw: HardwareProfile, elements: float, casts: str) -> float:
    """Seconds to scale and cast one bf16 tensor of ``elements`` to fp8 (its amax included)."""
    dev = hw.device
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    total = 0.0
    for per in CAST_KERNELS[casts]:
        b = per * elements
        total += b / (dev.memory_bandwidth_gbps * 1e9 * dev.memory_efficiency(b)) + fixed
    return total


def linear_elements(node: OpNode, shard: int, weight_numel: float) -> dict[str, float]:
    """Elements on one device of the linear's input x (M x K), weight w (K x N) and output
    gradient dy (M x N), from its FLOPs (2 M K N), output and weight sizes."""
    half = node.flops / 2 / shard  # M K N
    dy = (node.out.numel if node.out is not None else 0) / shard  # M N
    w = weight_numel  # K N
    x = half * half / (dy * w) if dy and w else 0.0
    return {"x": x, "w": w, "dy": dy}


def held_elements(node: OpNode, op, graph: OpGraph, shape: tuple[int, ...], m: int,
                  w8: int, fp8: Fp8Pricing, x_src=None, out_read=None) -> dict[str, float]:
    """Elements one rank casts of the linear's input x and output gradient dy, one
    microbatch: the bytes it really holds when the cast runs. Under a recipe that gathers
    TP in fp8 (``tp_fp8_gather``) the input is cast as produced (``x_src``, before the
    all-gather: a sequence shard under sequence parallelism) and a row-parallel output's
    gradient as its consumer reads the output (``out_read``: the sequence shard the fp8
    all-gather starts from); otherwise x as the linear reads it (after any bf16 gather) and
    dy as the linear produces it (whole along an axis where the output is a partial sum,
    whose gradient reaches every rank whole)."""
    gather8 = RECIPES[fp8.recipe].tp_fp8_gather
    out: dict[str, float] = {}
    for k, name in enumerate(node.inputs):
        if k == w8 or name in graph.param_map or k >= len(op.inputs):
            continue
        metas = graph.node(name).outputs if name in graph else \
            tuple(mm for n, mm in graph.inputs if n == name)
        if not metas:
            continue
        pl = x_src if gather8 and x_src is not None and PARTIAL not in x_src else op.inputs[k]
        out["x"] = metas[0].numel / (split_factor(pl, shape) * max(1, m))
        break
    if node.out is not None:
        whole = tuple(REPLICATE if p == PARTIAL else p for p in op.output)
        pl = out_read if gather8 and out_read is not None and PARTIAL not in out_read \
            else whole
        out["dy"] = node.out.numel / (split_factor(pl, shape) * max(1, m))
    return out


def linear_time(node: OpNode, hw: HardwareProfile, fp8: Fp8Pricing, *, shard: int,
                weight_numel: float, contention: float = 1.0,
                microbatches: int = 1, held: dict | None = None,
                tensor_parallel: bool = False) -> OpTime:
    """Forward and backward time of a block linear whose three products run in fp8:
    each product one fp8 GEMM of the forward's FLOPs, plus the recipe's casts (a weight
    cast kept over the step, ``weight_cast_per_step``, shared by its ``microbatches``).
    ``held``: the elements of x and dy one rank casts (``held_elements``); default: as
    ``linear_elements`` reads them from the GEMM's shape on one device.
    ``tensor_parallel``: the weight is split by TP, whose fp8 hooks (``tp_fp8_gather``)
    hand the backward dy and x already cast (``tp_backward_casts``)."""
    recipe = RECIPES[fp8.recipe]
    dev = hw.device
    fixed = dev.kernel_latency_s + dev.framework_overhead_s
    flops = node.flops / shard
    nbytes = (node.bytes_read + node.bytes_written) / 2 / shard  # traced fp32 -> bf16 operands
    gemm = _gemm_s(hw, flops, nbytes, recipe.scaling) + fixed
    elems = {**linear_elements(node, shard, weight_numel), **(held or {})}
    skip = ("w",) if fp8.all_gather else ()  # gathered in fp8, already cast

    per_step = max(1, microbatches) if recipe.weight_cast_per_step else 1

    def casts(which: tuple[str, ...]) -> float:
        return sum(cast_s(hw, elems[t], fp8.casts) / (per_step if t == "w" else 1)
                   for t in which if t not in skip)

    forward = (gemm + casts(recipe.forward_casts)) * contention
    tp_hooks = tensor_parallel and recipe.tp_fp8_gather
    backward = (2 * gemm + casts(recipe.tp_backward_casts if tp_hooks
                                 else recipe.backward_casts)) * contention
    return OpTime(forward, backward)


def saved_input_bytes_saved(graph: OpGraph, names, split_of, micro_fraction: float,
                            fp8: Fp8Pricing | None) -> float:
    """Bytes a recipe that saves the block linears' inputs in fp8 spares per microbatch on
    one device: 1 of the 2 bytes of each distinct input tensor it saves (0 for torchao's
    recipes, which save bf16)."""
    if fp8 is None or not RECIPES[fp8.recipe].saves_fp8_input:
        return 0.0
    seen: set[str] = set()
    total = 0.0
    for n in names:
        node = graph.node(n)
        k = fp8_weight_input(node, graph)
        if k is None:
            continue
        x = next((i for j, i in enumerate(node.inputs) if j != k and i not in graph.param_map
                  and i in graph), None)
        if x is None or x in seen:
            continue
        seen.add(x)
        meta = graph.node(x).out
        if meta is not None:
            total += meta.numel * 1 * micro_fraction / max(1, split_of(x))
    return total


# fp8 copies of each block linear's weight a recipe keeps through the step: Transformer
# Engine caches the cast weight and its transpose across the microbatches of a step
# (``is_first_microbatch``: cast once per step); torchao casts per use and frees it
FP8_WEIGHT_COPIES = {"torchao-tensorwise": 0, "torchao-rowwise": 0, "te-current": 2}


def weight_copy_bytes(stage, graph: OpGraph, fp8: Fp8Pricing | None, layer_of) -> float:
    """Bytes of the fp8 weight copies the recipe keeps on one device of ``stage``
    (1 byte per element per copy; ``layer_of(name)`` is the block a parameter belongs to)."""
    copies = FP8_WEIGHT_COPIES[fp8.recipe] if fp8 is not None else 0
    if not copies:
        return 0.0
    total = 0.0
    for name, pl in stage.params.items():
        info = graph.param_map.get(name)
        if info is None or len(info.shape) != 2 or layer_of(name) < 0:
            continue
        total += copies * info.numel / split_factor(pl, stage.mesh_shape)
    return total


AMAX_BYTES = 4  # one fp32 amax per tensor, all-reduced (max) over the axis it is sharded on
# A scalar all-reduce inside an NVLink domain runs NCCL's LL protocol, whose latency NCCL's
# own tuning model prices as a base plus one NVLink hop per ring step: NVIDIA/nccl
# src/graph/tuning.cc (commit 01afd20), baseLat Ring/LL 3.6 us and hwLat NVLink Ring/LL
# 0.47 us, 2 (n - 1) steps for an all-reduce: 10.2 us on 8 GPUs. The link's ``latency_s``
# (10 us a step, Calculon's default for the Simple protocol's large messages) would price
# it at 140 us. Across nodes the collective is priced as any other.
NCCL_LL_BASE_S = 3.6e-6
NCCL_LL_NVLINK_STEP_S = 0.47e-6


def amax_all_reduce_s(coll, axis: int, n: int) -> float:
    """Seconds of one scalar amax all-reduce over ``n`` ranks of mesh axis ``axis``."""
    links = getattr(coll, "links", None)
    if links is not None and links[axis][0]:  # crosses nodes
        return coll(Collective.ALL_REDUCE, AMAX_BYTES, axis)
    return NCCL_LL_BASE_S + 2 * (n - 1) * NCCL_LL_NVLINK_STEP_S


def tp_gathers_in_fp8(node: OpNode, src: str, graph: OpGraph,
                      fp8: Fp8Pricing | None) -> tuple[bool, bool]:
    """(forward, backward) all-gathers of the edge ``src`` -> ``node`` that move fp8 on the
    tensor-parallel axis (``Fp8Recipe.tp_fp8_gather``): the forward gather of a block
    linear's input, cast before it; the backward gather of a block linear's output
    gradient (a row-parallel output reduce-scattered in the forward)."""
    if fp8 is None or not RECIPES[fp8.recipe].tp_fp8_gather:
        return False, False
    return (fp8_weight_input(node, graph) is not None,
            src in graph and fp8_weight_input(graph.node(src), graph) is not None)


def amax_all_reduces(fp8: Fp8Pricing, sharded: dict[str, bool]) -> tuple[int, int]:
    """(forward, backward) scalar amax all-reduces over the TP axis of one block linear in
    one microbatch: one per tensorwise cast of a tensor the axis shards (``sharded``: "x",
    "w", "dy"; the backward's casts under the TP hooks, ``tp_backward_casts``); a weight gathered in fp8 by FSDP arrives cast with its scale (torchtitan's
    ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce a step for all weights,
    left out). Rowwise and Transformer Engine's recipes: none priced (rowwise scales are
    per row of the tensor as the GEMM reads it)."""
    recipe = RECIPES[fp8.recipe]
    if not recipe.tp_fp8_gather:
        return 0, 0
    skip = ("w",) if fp8.all_gather else ()

    def n(which):
        return sum(1 for t in which if t not in skip and sharded.get(t))
    return n(recipe.forward_casts), n(recipe.tp_backward_casts)
