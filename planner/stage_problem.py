"""One stage's integer program as data: the options of a stage search, each operator group's
priced choices, the problem ``planner/pricing.py`` builds and ``planner/intra.py`` solves.
Below both, so that the builder and the solver do not import each other (issue 40).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from meshplan.errors import PlanningError
from meshplan.plan import MemoryBreakdown
from meshplan.planner.strategies import Strategy
from meshplan.vocabulary import RECOMPUTE, ComputeDtype, Recompute

NS = 1e9  # objective unit: 1 ns (integer costs for the solver)


@dataclass(frozen=True, slots=True)
class StageOptions:
    memory_limit_gib: float | None = None  # None: the device's capacity
    dtype: str = ComputeDtype.BF16
    optimizer: str = "adam"
    recompute: str = Recompute.NONE  # none | selective (attention core) | full (whole layers)
    batch_fraction: float = 1.0  # microbatch size / traced global batch
    microbatches: int = 1  # microbatches of this stage per step (compute and edges repeat)
    inflight_microbatches: int = 1  # activations of this many microbatches are alive at once
    zero: int = 3  # 0: none; 1/2: that ZeRO stage over a data-parallel axis; 3: the solver
    #                picks none or ZeRO-3 for the whole stage (the runtime shards every weight)
    time_limit_s: float = 30.0
    backend: str = "cbc"  # measured fastest on GPT stages (planner/ilp.py docstring)

    def __post_init__(self):
        if self.recompute not in RECOMPUTE:
            raise PlanningError(f"recompute={self.recompute!r} is not one of {RECOMPUTE}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanningError(f"zero={self.zero} is not a ZeRO stage; choose 0, 1, 2 or 3")
        if not 0 < self.batch_fraction <= 1:
            raise PlanningError(f"batch_fraction={self.batch_fraction} must lie in (0, 1]")


@dataclass(frozen=True, slots=True)
class GroupChoice:
    """One priced choice of one group: a strategy of its anchor, with or without ZeRO-3."""

    strategy: Strategy
    zero3: bool
    microbatch_s: float  # per microbatch: compute + follower fix-ups + ZeRO-3 gathers
    step_s: float  # once per step: gradient sync (all-reduce / reduce-scatter) + optimizer
    comm_s: float  # the communication part of microbatches x microbatch_s + step_s
    memory: MemoryBreakdown  # GiB this group adds on every device
    member_inputs: tuple  # per group member: the placements it consumes
    member_outputs: tuple  # per group member: its output placement
    storage: tuple  # per owned parameter: storage placement
    zero: int = 0  # the stage-wide ZeRO level this candidate assumes (StageProblem.flags)
    dp_axis: int | None = None  # ... over this data-parallel axis


@dataclass(frozen=True, slots=True)
class Group:
    anchor: str  # node name, or graph/stage input name for sources
    members: tuple[str, ...]  # anchor first, then its followers in graph order
    candidates: tuple[GroupChoice, ...]
    count: int  # how many identical groups (layers) this one stands for
    owned_params: tuple[str, ...]
    rule: str
    is_source: bool = False


@dataclass(frozen=True)
class StageProblem:
    groups: tuple[Group, ...]
    edges: tuple[tuple[int, int, tuple, tuple, tuple], ...]  # u, v, u_class, v_class, cost_s
    rep: dict  # node name -> representative node name
    param_rep: dict  # param name -> representative param name
    fallbacks: tuple[str, ...]
    memory_limit_bytes: float
    microbatches: int = 1  # edges are per microbatch
    # fixed charges and stage-wide switches (planner/ilp.py IlpFlag; costs in NS units,
    # once per step) and the pairs of them that cannot both be on
    flags: tuple = ()
    conflicts: tuple = ()


def warn_fallbacks(names) -> None:
    for n in names:
        warnings.warn(f"meshplan: operator {n} has no sharding rule; it runs replicated",
                      stacklevel=3)
