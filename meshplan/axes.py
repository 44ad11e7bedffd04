"""The axis table: one record per parallel dimension (issue 40), begun with expert parallelism.

trace -> cost -> solve -> plan -> run: each stage reads an axis from its record instead of a
string literal. A record holds the axis's name, the degrees a search tries, its support rules
(pure functions returning one-line refusals: the value, the rule, the fix; empty when it
runs), the slot for its cost terms, and the runtime step that applies it. ``manual_plan``,
``meshplan/support.py``, the CLI and ``show`` read ``AXES``; adding a dimension is adding a
record here (docs/ARCHITECTURE.md, "Adding a parallel dimension").

Core layer: no ``torch.distributed``; the runtime step is named as ``"module:function"`` and
resolved by the runtime (``runtime_step``), so the core never imports the runtime.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from meshplan.vocabulary import Engine

EP = "ep"


@dataclass(frozen=True, slots=True)
class AxisContext:
    """What an axis's rules read: the stage's degrees by axis name (``dp``, ``cp``, ``tp``,
    ``pp``, the axis's own), the model's routed experts (None: not known, e.g. a plan read
    without its model) and the engine the plan runs on ("" when not chosen yet)."""

    degrees: dict
    experts: int | None = None
    engine: str = ""

    def degree(self, name: str) -> int:
        return int(self.degrees.get(name, 1))


@dataclass(frozen=True, slots=True)
class Axis:
    """One parallel dimension.

    ``degrees(borrowed, experts)``: the degrees a search tries, from the ranks the axis may
    borrow (dp x cp x tp of a stage for ep) and the model's count it splits (routed experts).
    ``rules``: functions of an ``AxisContext`` returning refusals (one line each); the last
    says what meshplan's own runtime runs (left out for a plan a stack runs).
    ``cost_terms``: ``"module:function"`` under ``meshplan.costmodel`` pricing the axis on a
    stage (resolved by ``costmodel/estimate.py`` ``axis_cost_terms``, which every pricer
    calls). ``runtime_step``: ``"module:function"`` under ``meshplan.runtime`` that applies
    the axis to a model on the module engine. Both are names, not imports: the core may not
    import the layers above it."""

    name: str
    doc: str
    degrees: Callable[[int, int], tuple[int, ...]]
    rules: tuple[Callable[[AxisContext], tuple[str, ...]], ...] = ()
    cost_terms: str = ""
    runtime_step: str = ""
    borrows: tuple[str, ...] = field(default=())

    def problems(self, ctx: AxisContext, *, runtime: bool = True) -> tuple[str, ...]:
        """The refusals of ``rules``; ``runtime=False`` leaves out the last rule, the one
        saying what meshplan's own runtime runs (a plan for torchtitan or Megatron-LM is run
        by that stack: ``meshplan/stacks/search.py``, ``api._check_axes``)."""
        rules = self.rules if runtime else self.rules[:-1]
        return tuple(why for rule in rules for why in rule(ctx))


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


# -- expert parallelism -----------------------------------------------------------------------

# The forward signatures of the routed-expert modules the runtime splits (runtime/
# expert_parallel.py): transformers' MixtralExperts / Qwen3MoeExperts / DeepseekV3 experts
# (hidden states, top-k expert ids, top-k weights; 3-D gate_up_proj / down_proj, transformers
# 5.x) and a torchtitan-style grouped module fed rows sorted by expert with per-expert counts
# (examples/moe_grouped.py GroupedExperts).
ROUTED = "routed"    # forward(hidden_states, top_k_index, top_k_weights)
GROUPED = "grouped"  # forward(x_sorted_by_expert, counts)


def expert_kind(module: nn.Module) -> str | None:
    """ROUTED, GROUPED or None: how ``module`` takes its tokens, if it holds routed experts
    (its own parameters all 3-D with one leading size, the expert count, of 2 or more)."""
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() != 3 for p in own) or len({p.shape[0] for p in own}) != 1 \
            or own[0].shape[0] < 2:
        return None
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    if "top_k_index" in names and "top_k_weights" in names:
        return ROUTED
    if len(names) == 2 and names[1] == "counts":
        return GROUPED
    return None


def find_experts(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Routed-expert modules of ``model``: FQN -> (kind, experts)."""
    out = {}
    for name, mod in model.named_modules():
        kind = expert_kind(mod)
        if kind is not None:
            out[name] = (kind, next(mod.parameters(recurse=False)).shape[0])
    return out


def routed_experts(model: nn.Module) -> int:
    """The model's routed-expert count (0 without a module the runtime splits); a model
    whose MoE layers differ in count is refused by ``ep_rules`` through ``experts_mismatch``."""
    counts = {n for _, n in find_experts(model).values()}
    return min(counts) if counts else 0


def _ep_degrees(borrowed: int, experts: int) -> tuple[int, ...]:
    """ep degrees a search tries: divisors of the stage's dp x cp x tp that divide the
    routed experts (torchtitan 0.3 borrows ep from dp_shard x cp x tp; it adds no devices)."""
    return tuple(d for d in _divisors(borrowed) if experts and experts % d == 0)


def _ep_model_rule(ctx: AxisContext) -> tuple[str, ...]:
    ep = ctx.degree(EP)
    if ep < 1:
        return (f"ep={ep}: the expert-parallel degree is a whole number of ranks, at least 1; "
                "use ep=1 for no expert parallelism",)
    if ep == 1 or ctx.experts is None:
        return ()
    if ctx.experts == 0:
        return (f"ep={ep}: the model has no routed experts the runtime splits (a module whose "
                "own weights are (experts, out, in) and whose forward takes (hidden_states, "
                "top_k_index, top_k_weights) or (x, counts)); use ep=1",)
    if ctx.experts % ep:
        # the degrees that also divide the ranks ep borrows (the next rule), where known
        borrowed = ctx.degree("dp") * ctx.degree("cp") * ctx.degree("tp")
        ok = ", ".join(map(str, [d for d in _divisors(ctx.experts)
                                 if borrowed == 1 or borrowed % d == 0]))
        return (f"ep={ep} does not divide the model's {ctx.experts} routed experts (each rank "
                f"holds experts/ep of them); use one of {ok}",)
    return ()


def _ep_borrow_rule(ctx: AxisContext) -> tuple[str, ...]:
    ep = ctx.degree(EP)
    borrowed = ctx.degree("dp") * ctx.degree("cp") * ctx.degree("tp")
    if ep < 1 or borrowed % ep:
        ok = ", ".join(map(str, _divisors(borrowed)))
        return (f"ep={ep} must divide dp x cp x tp = {borrowed} (experts are split over ranks "
                f"the stage already has; ep adds no devices); use one of {ok}",)
    return ()


def _ep_runtime_rule(ctx: AxisContext) -> tuple[str, ...]:
    """What the module engine's expert parallelism runs (runtime/expert_parallel.py)."""
    ep = ctx.degree(EP)
    if ep == 1:
        return ()
    dp = ctx.degree("dp")
    if dp % ep:
        return (f"ep={ep} with dp={dp}: the runtime splits experts over data-parallel ranks "
                f"only, and ep={ep} would borrow cp or tp ranks; use an ep dividing dp={dp}",)
    if ctx.degree("tp") > 1:
        return (f"ep={ep} with tp={ctx.degree('tp')}: the module engine's expert parallelism "
                "splits experts over data-parallel ranks with the experts whole on each "
                "tensor-parallel rank, which is not run yet; use tp=1 (dp, cp or pp with ep)",)
    if ctx.degree("pp") > 1 and ctx.degree("cp") > 1:
        return (f"ep={ep} with pp={ctx.degree('pp')} and cp={ctx.degree('cp')}: expert "
                "parallelism inside pipeline stages runs with dp only (pp x cp stages' "
                "expert gradients are not checked yet); use ep with pp or with cp, not both",)
    if ctx.engine and ctx.engine != Engine.MODULES:
        return (f"ep={ep} on the {ctx.engine} engine: expert parallelism runs on the module "
                "engine only; plan with engine='auto' or 'modules'",)
    return ()


EP_AXIS = Axis(
    name=EP,
    doc="expert parallelism: each MoE layer's routed experts split over ep ranks borrowed "
        "from the stage's dp x cp x tp; tokens go to their expert's rank and back by "
        "all-to-all; experts replicated over the other dp x cp x tp / ep ranks",
    degrees=_ep_degrees,
    rules=(_ep_borrow_rule, _ep_model_rule, _ep_runtime_rule),
    cost_terms="moe:ep_cost_terms",
    runtime_step="expert_parallel:apply_expert_parallel",
    borrows=("dp", "cp", "tp"),
)

AXES: dict[str, Axis] = {EP: EP_AXIS}


def plan_problems(stage, experts: int | None = None, engine: str = "",
                  pp: int = 1) -> tuple[str, ...]:
    """Refusals of every table axis for one plan stage (``meshplan.plan.Stage``) of a plan
    with ``pp`` pipeline rank groups."""
    degrees = dict(zip(stage.axis_names, stage.mesh_shape))
    degrees[EP] = stage.ep
    degrees["pp"] = pp
    ctx = AxisContext(degrees=degrees, experts=experts, engine=engine)
    return tuple(why for axis in AXES.values() for why in axis.problems(ctx))
