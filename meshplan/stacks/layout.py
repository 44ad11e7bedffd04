"""A plan as the stacks people already run express it: degrees, schedule, batch, recompute.

plan -> **layout** -> export (meshplan/stacks/torchtitan.py, megatron.py), and back:
import -> **layout** -> ``manual_plan`` -> estimate. torchtitan and Megatron-LM take one
tensor/context/pipeline/data degree for the whole model, one activation-checkpointing mode,
one ZeRO level and a layer split; a meshplan plan is richer (per-operator placements, per
stage recompute and ZeRO, non-uniform stage meshes). ``layout_of`` reads the uniform layout a
plan follows and refuses, in one line naming what is missing, a plan that follows none;
``check_expressible`` then compares the plan's per-operator placements with those of the
uniform layout rebuilt by ``planner/manual.py`` (what both stacks run: Megatron's column /
row split of attention and MLP, vocab-parallel embedding and head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshplan.errors import NotExpressibleError, NotSupportedError, SpecError
from meshplan.plan import RECOMPUTE, Plan
from meshplan.schedules import SCHEDULES, Schedule, virtual_stages_for
from meshplan.support import cp_degree, data_parallel_degree, lists_rank_groups, \
    pipeline_degree
from meshplan.vocabulary import ComputeDtype

# what the stacks train in (fp16 needs loss scaling: not exported)
STACK_DTYPES = (ComputeDtype.FP32, ComputeDtype.BF16, ComputeDtype.FP8)


@dataclass(frozen=True, slots=True)
class StackLayout:
    """One training configuration in the terms torchtitan and Megatron-LM use.

    ``global_batch`` and ``microbatch_size`` count sequences of ``seq_len`` tokens;
    ``microbatch_size`` is per data-parallel rank (Megatron's ``--micro-batch-size``,
    torchtitan's ``pipeline_parallel_microbatch_size``; without a pipeline, torchtitan's
    ``local_batch_size`` is the whole per-rank batch and Megatron accumulates microbatches).
    ``zero``: 0 plain data parallel, 1 optimizer state sharded (Megatron's distributed
    optimizer), 2 and gradients (FSDP2 without resharding after forward), 3 and parameters
    (FSDP2 / ``fully_shard``); sharded over dp x cp, as both stacks shard.
    ``stage_layers``: repeated blocks per pipeline chunk, in chunk order (pp x virtual
    stages entries; chunk j runs on rank j % pp); empty for an even split.
    """

    dp: int
    global_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    schedule: str = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    microbatch_size: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    dtype: str = ComputeDtype.BF16
    compiled: bool = False
    stage_layers: tuple[int, ...] = ()
    # expert parallelism: the routed experts split over ``ep`` ranks borrowed from dp x cp x
    # tp (torchtitan's expert_parallel_degree, Megatron's --expert-model-parallel-size with
    # --expert-tensor-parallel-size 1); it adds no devices (plan.py ``Stage.ep``)
    ep: int = 1
    # under fp8, a recipe other than the stack's own (costmodel/fp8.py PUBLIC_RECIPES);
    # "": the stack's own (torchtitan: tensorwise-fp8-all-gather; Megatron-LM: tensorwise)
    fp8_recipe: str = ""

    def __post_init__(self):
        for name in ("dp", "tp", "cp", "pp", "virtual_stages", "microbatch_size",
                     "global_batch", "seq_len", "ep"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name}={getattr(self, name)}: must be a positive integer")
        if self.schedule not in SCHEDULES:
            raise SpecError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise SpecError(f"recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}")
        if self.zero not in (0, 1, 2, 3):
            raise SpecError(f"zero={self.zero}: must be 0, 1, 2 or 3")
        if self.dtype not in STACK_DTYPES:
            raise SpecError(f"dtype {self.dtype!r}: the stacks train in {', '.join(STACK_DTYPES)}")
        if (self.dp * self.cp * self.tp) % self.ep:
            raise SpecError(f"ep={self.ep} must divide dp x cp x tp = "
                            f"{self.dp * self.cp * self.tp} (expert parallelism borrows those "
                            "ranks and adds none); choose a divisor")
        if self.global_batch % (self.dp * self.microbatch_size):
            raise SpecError(f"global batch {self.global_batch} is not a multiple of dp "
                            f"{self.dp} x microbatch size {self.microbatch_size}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def microbatches(self) -> int:
        """Microbatches per data-parallel rank and step."""
        return self.global_batch // (self.dp * self.microbatch_size)

    @property
    def chunks(self) -> int:
        return self.pp * virtual_stages_for(self.schedule, self.virtual_stages)

    def layers_per_chunk(self, num_layers: int) -> tuple[int, ...]:
        """Blocks per pipeline chunk: ``stage_layers``, or the even split meshplan's
        manual plans use (planner/manual.py ``layer_bounds`` / ``chunk_bounds``)."""
        if self.stage_layers:
            return self.stage_layers
        from meshplan.planner.manual import chunk_bounds, layer_bounds

        n = self.chunks
        bounds = layer_bounds(num_layers, n) if num_layers % n == 0 or \
            self.schedule != Schedule.INTERLEAVED else chunk_bounds(num_layers, n)
        return tuple(b - a for a, b in bounds)

    def manual_kwargs(self) -> dict:
        """The ``meshplan.manual_plan`` keyword arguments of this layout (``ep`` aside:
        ``with_ep`` sets it)."""
        return dict(dp=self.dp, tp=self.tp, cp=self.cp, pp=self.pp,
                    microbatch_size=self.microbatch_size, schedule=self.schedule,
                    virtual_stages=self.virtual_stages, recompute=self.recompute,
                    sequence_parallel=self.sequence_parallel, zero=self.zero, dtype=self.dtype,
                    stage_layers=self.stage_layers)

    def words(self) -> str:
        """One line, e.g. ``dp8 tp8 cp16 pp16 interleaved-1f1b x2 mb1 full SP ZeRO-1 bf16``."""
        parts = [f"dp{self.dp}"] + [f"{k}{v}" for k, v in
                                    (("tp", self.tp), ("cp", self.cp), ("pp", self.pp),
                                     ("ep", self.ep)) if v > 1]
        if self.pp > 1:
            parts.append(self.schedule + (f" x{self.virtual_stages}"
                                          if self.schedule == Schedule.INTERLEAVED else ""))
        parts += [f"mb{self.microbatch_size}", f"recompute {self.recompute}"]
        parts += ["SP"] if self.sequence_parallel else []
        parts += [f"ZeRO-{self.zero}"] if self.zero else []
        parts += [self.dtype] + (["compiled"] if self.compiled else [])
        return " ".join(parts)


def with_ep(plan: Plan, ep: int) -> Plan:
    """``plan`` with every stage's routed experts split over ``ep`` ranks (``Stage.ep``),
    repriced; ``plan`` itself when ep is 1."""
    if ep == 1:
        return plan
    from meshplan.api import estimate

    plan = replace(plan, stages=tuple(replace(st, ep=ep) for st in plan.stages))
    return plan.with_prediction(estimate(plan)) if plan.graph is not None else plan


def manual_with_ep(build, *args, ep: int = 1, **kw) -> Plan:
    """``build(*args, **kw)`` (``meshplan.manual_plan`` or planner/manual.py's
    ``build_manual_plan``) with ``ep``: passed on where the builder takes it, else set on the
    built plan's stages (``with_ep``)."""
    import inspect

    if ep > 1 and "ep" in inspect.signature(build).parameters:
        return build(*args, ep=ep, **kw)
    return with_ep(build(*args, **kw), ep)


def _one(values: set, what: str, fix: str):
    if len(values) != 1:
        raise NotExpressibleError(f"the plan's stages differ in {what} ({', '.join(map(str, sorted(values)))}); "
                                f"torchtitan and Megatron-LM take one for the whole model: {fix}")
    return next(iter(values))


def _non_default_recipe(plan: Plan) -> str:
    """The plan's fp8 recipe where it is not the one its stack runs by default ("")."""
    from meshplan.costmodel.fp8 import TE_ENGINES

    own = "tensorwise" if plan.engine in TE_ENGINES else "tensorwise-fp8-all-gather"
    recipe = plan.training.fp8_recipe
    return "" if recipe in ("", own) else recipe


def layout_of(plan: Plan, *, compiled: bool = False) -> StackLayout:
    """The uniform layout ``plan`` follows; NotSupportedError (one line) when it follows none.

    Reads the degrees from the stage meshes (axes named dp, cp, tp; the batch axes of the
    first input for dp), the rest from the training config and the stages. The per-operator
    placements are compared with the uniform layout's by ``check_expressible``."""
    t = plan.training
    shapes = {tuple(zip(st.axis_names, st.mesh_shape)) for st in plan.stages}
    axes = dict(_one(shapes, "mesh shape", "plan with meshplan plan --for torchtitan|megatron"))
    unknown = sorted(set(axes) - {"dp", "cp", "tp"})
    if unknown:
        raise NotExpressibleError(f"the plan's stage mesh has axes {', '.join(unknown)} besides dp, "
                                "cp and tp (a per-operator 2-D split); torchtitan and Megatron-LM "
                                "run one tensor-parallel axis: plan with meshplan plan --for "
                                "torchtitan|megatron")
    st0 = plan.stages[0]
    dp, tp, cp = data_parallel_degree(plan), axes.get("tp", 1), cp_degree(st0)
    if dp * tp * cp != len(st0.devices):
        raise NotExpressibleError(f"stage 0's {len(st0.devices)} devices are not dp {dp} x cp {cp} x "
                                f"tp {tp} (the batch is not split over every other axis); plan "
                                "with meshplan plan --for torchtitan|megatron")
    recompute = _one({st.recompute for st in plan.stages}, "recompute",
                     "re-plan with one recompute mode")
    zero = _one({st.zero for st in plan.stages}, "ZeRO stage", "re-plan with one ZeRO stage")
    ep = _one({st.ep for st in plan.stages}, "expert-parallel degree",
              "re-plan with one ep for every stage")
    pp = pipeline_degree(plan)
    schedule = t.schedule if pp > 1 else Schedule.ONE_F_ONE_B
    v = virtual_stages_for(schedule, t.virtual_stages)
    mb = t.microbatch_size or t.global_batch // (dp * max(t.microbatches, 1))
    if lists_rank_groups(plan):
        stage_layers = ()  # even interleaved chunks (planner/manual.py)
    else:
        stage_layers = tuple(st.layers[1] - st.layers[0] for st in plan.stages) if pp > 1 else ()
    if t.dtype not in STACK_DTYPES:
        raise NotExpressibleError(f"dtype {t.dtype!r}: the exported stacks train in "
                                f"{', '.join(STACK_DTYPES)} (fp16 needs loss scaling); re-plan with "
                                "dtype='bf16'")
    layout = StackLayout(dp=dp, tp=tp, cp=cp, pp=pp, schedule=schedule, virtual_stages=v,
                         microbatch_size=mb, global_batch=t.global_batch, seq_len=t.seq_len,
                         recompute=recompute, sequence_parallel=t.sequence_parallel and tp > 1,
                         zero=zero, dtype=t.dtype, compiled=compiled,
                         stage_layers=stage_layers, fp8_recipe=_non_default_recipe(plan),
                         ep=ep)
    if stage_layers:
        even = replace(layout, stage_layers=()).layers_per_chunk(plan.model.num_layers)
        if tuple(stage_layers) == even:
            layout = replace(layout, stage_layers=())
    return layout


def check_expressible(plan: Plan, layout: StackLayout, graph) -> None:
    """Refuse (NotSupportedError, one line) a plan whose per-operator placements are not
    those of ``layout`` as planner/manual.py builds it (the stacks' column / row split,
    vocab-parallel embedding and head; ``vocab_parallel_cp``: as the stacks keep it under cp)."""
    from meshplan.planner.manual import build_manual_plan

    if graph is None:
        raise NotSupportedError("checking the plan's per-operator placements needs its model: "
                                "pass --model SPEC (or a plan made from a model spec)")
    from meshplan.costmodel.hardware import HardwareProfile
    from meshplan.mesh import Mesh

    hw = HardwareProfile.from_dict(plan.mesh.hardware)
    mesh = Mesh(shape=plan.mesh.shape, axis_names=plan.mesh.axis_names, hardware=hw,
                name=plan.mesh.name)
    kw = layout.manual_kwargs()
    uniform = manual_with_ep(build_manual_plan, graph, mesh, optimizer=plan.training.optimizer,
                             vocab_parallel_cp=True, ep=layout.ep, **kw)
    ours = {p: pl for st in plan.stages for p, pl in st.params.items()}
    theirs = {p: pl for st in uniform.stages for p, pl in st.params.items()}
    for name, pl in ours.items():
        if name in theirs and tuple(pl) != tuple(theirs[name]):
            raise NotExpressibleError(
                f"parameter {name} is placed {'/'.join(pl)} where the stacks' uniform "
                f"{layout.words()} places it {'/'.join(theirs[name])}; torchtitan and "
                "Megatron-LM split every block alike: plan with meshplan plan --for "
                "torchtitan|megatron")

