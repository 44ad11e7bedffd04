"""The module engine's entry: which of its classes runs a plan (``build``, for
``meshplan.parallelize``) and why neither can (``module_engine_refusal``, for
``api.choose_engine``).

trace -> cost -> solve -> plan -> **run**. One stage runs on ``ModuleEngine``
(runtime/modules.py, its rules in runtime/module_plan.py ``stage_refusal``), several on
``PipelineModuleEngine`` (runtime/module_pipeline.py, its rules ``pipeline_refusal``). This
module sits above both, so neither imports the other's engine (issue 40).
"""

from __future__ import annotations

import torch.nn as nn

from meshplan.plan import Plan
from meshplan.runtime.module_pipeline import PipelineModuleEngine, pipeline_refusal
from meshplan.runtime.module_plan import ep_refusal, stage_refusal
from meshplan.runtime.modules import ModuleEngine
from meshplan.vocabulary import LossReduction


def module_engine_refusal(plan: Plan, model: nn.Module) -> str | None:
    """Why ``plan`` cannot run on ``model`` with PyTorch's composables; None when it can.
    Pure: needs no process group (the checks run the model on meta)."""
    if plan.num_stages > 1:  # cut into stage modules, run by torch.distributed.pipelining
        return ep_refusal(plan, model) or pipeline_refusal(plan, model)
    return stage_refusal(plan, model)


def build(model: nn.Module, plan: Plan, *, loss_fn=None, compile: bool = False,
          loss_reduction: str = LossReduction.MEAN):
    """The module engine for ``plan`` on ``model``, parallelized in place: ``ModuleEngine``
    for one stage, ``PipelineModuleEngine`` for several."""
    cls = PipelineModuleEngine if plan.num_stages > 1 else ModuleEngine
    engine = cls(model, plan, loss_fn=loss_fn, compile=compile)
    engine.loss_reduction = loss_reduction
    return engine
