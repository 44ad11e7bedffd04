"""The closed sets a plan names, each defined once: recompute modes, compute dtypes and
engines (schedules: ``meshplan/schedules.py``; placements: ``meshplan/placements.py``).

trace -> cost -> solve -> **plan** -> run. Each set is a ``StrEnum`` whose values are the
plan file's strings, so a member equals its string (``Recompute.FULL == "full"``): plan
records keep plain strings (the JSON boundary), code compares them against members, and the
file format does not change.
"""

from __future__ import annotations

from enum import StrEnum


class PlanName(StrEnum):
    """A closed set of plan-file strings: a member equals, formats and reprs as its string
    (``repr(Recompute.FULL) == "'full'"``), so an error message reads exactly as with the
    plain string. Plan records store the plain string (``plain``): a member pickles as its
    class, which ``torch.load(weights_only=True)`` refuses."""

    def __repr__(self) -> str:
        return repr(self.value)


def plain(value):
    """A member -> its plain string (what plan records hold); anything else unchanged."""
    return value.value if isinstance(value, PlanName) else value


class Recompute(PlanName):
    """Activation recomputation of a stage (Korthikanti et al. 2022): ``selective`` keeps
    the matmul outputs and recomputes attention and pointwise ops; ``full`` keeps only each
    block's input."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


RECOMPUTE = tuple(r.value for r in Recompute)  # ("none", "selective", "full")


class BatchNormStats(PlanName):
    """Which rows a BatchNorm normalises together in training, ``TrainingConfig.batch_norm``:
    ``batch`` the step's whole global batch, as one process normalising it (the plan then
    has one microbatch; dp ranks share their statistics, SyncBatchNorm's semantics);
    ``microbatch`` each global microbatch alone, as one process accumulating gradients over
    the same microbatches (a choice the user makes: the plan may then cut the batch)."""

    BATCH = "batch"
    MICROBATCH = "microbatch"


BATCH_NORM_STATS = tuple(b.value for b in BatchNormStats)  # ("batch", "microbatch")


class Engine(PlanName):
    """meshplan's own runtimes, ``Plan.engine``: ``modules`` runs PyTorch's composables on
    the user's modules (runtime/modules.py, runtime/module_pipeline.py); ``graph`` interprets
    the exported graph on DTensor (runtime/graph/). Other training stacks the cost model can
    price a plan as (Megatron-LM, torchtitan) are *profiles*, not engines: they are priced,
    never run (``costmodel.estimate.STACKS``, ``PROFILES = ENGINES + stacks``)."""

    GRAPH = "graph"
    MODULES = "modules"


ENGINES = tuple(e.value for e in Engine)  # ("graph", "modules")


class LossReduction(StrEnum):
    """What the user's ``loss_fn`` returns over the targets it is given (``loss_reduction=``
    of manual_plan, autoparallel and parallelize; docs/running.md): ``mean`` over the
    labelled targets (labels != -100; every entry of float targets), F.cross_entropy's
    default; ``sum`` over them; ``sequence``: each row's (sequence's) labelled mean,
    averaged over the rows. The runtime weighs the pieces of a step so that the step's loss
    is that reduction over the global batch."""

    MEAN = "mean"
    SUM = "sum"
    SEQUENCE = "sequence"


LOSS_REDUCTIONS = tuple(r.value for r in LossReduction)  # ("mean", "sum", "sequence")


class Stack(PlanName):
    """Training stacks meshplan plans for and exports to (meshplan/stacks/): a plan made with
    ``plan --for`` names one in ``Plan.engine`` — the runtime that executes it is that stack,
    after ``meshplan export``; meshplan's own runtimes refuse it in one line."""

    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"


STACK_TARGETS = tuple(s.value for s in Stack)  # ("torchtitan", "megatron")

# the configuration `meshplan export --to` writes for a plan priced for each stack (none of
# them runs in meshplan: support.stack_refusal). NeMo's GPT recipes run Megatron-Core and
# Megatron-LM as of SC'21 is Megatron-LM: their layouts are Megatron-LM's tensor, pipeline
# and data parallelism, so their plans export as Megatron-LM's arguments (the export checks
# the layout, meshplan/stacks/megatron.py); meshplan writes no NeMo recipe.
EXPORT_TARGET = {"megatron": "megatron", "megatron-2021": "megatron", "nemo": "megatron",
                 "torchtitan": "torchtitan"}


class ComputeDtype(PlanName):
    """``Plan.training.dtype``: the compute dtype; bf16/fp16/fp8 are mixed precision with fp32
    master weights. fp8 is priced (torchtitan's float8, Transformer Engine: costmodel/fp8.py),
    never trained by meshplan's runtimes."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


DTYPES = tuple(d.value for d in ComputeDtype)  # every dtype a plan may name

# what each of meshplan's runtimes trains in: the graph engine scales the fp16 loss
# (runtime/graph/parallelize.py FP16_LOSS_SCALE); the module engine does no loss scaling,
# so it runs fp32 and bf16 only (fully_shard's MixedPrecisionPolicy, autocast)
ENGINE_DTYPES = {Engine.GRAPH: (ComputeDtype.FP32, ComputeDtype.BF16, ComputeDtype.FP16),
                 Engine.MODULES: (ComputeDtype.FP32, ComputeDtype.BF16)}
TRAINED_DTYPES = ENGINE_DTYPES[Engine.GRAPH]  # some runtime of meshplan trains in it
PRICED_ONLY_DTYPES = (ComputeDtype.FP8,)  # a plan may say it and loads; the runtimes refuse it
