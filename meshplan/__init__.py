"""meshplan: plan how to train a PyTorch model on many devices, then run the plan.

    import meshplan
    mesh = meshplan.Mesh.preset("dgx-a100-80gb", nodes=8)
    plan = meshplan.autoparallel(model, mesh, example_inputs=(ids,))
    print(plan.summary())

    # inside a torchrun worker, in the user's own training loop:
    run = meshplan.parallelize(model, meshplan.Plan.from_json("plan.json"))
    loss = run.train_step((x,), targets=(y,))
"""

from meshplan.errors import (MemoryLimitError, MeshError, MeshplanError, NotExpressibleError,
                             NotSupportedError, PlanFileError, PlanningError, SpecError,
                             TraceError)
from meshplan.mesh import Mesh
from meshplan.plan import Estimate, Plan
from meshplan.tracing import trace
from meshplan.api import autoparallel, estimate, manual_plan
from meshplan.specs import ModelBundle, model_from_config

__all__ = [
    "Mesh", "Plan", "Estimate", "autoparallel", "manual_plan", "estimate", "trace", "ModelBundle",
    "MeshplanError", "TraceError", "MeshError", "SpecError", "PlanFileError", "PlanningError",
    "MemoryLimitError", "NotSupportedError", "parallelize", "ParallelRun", "DataError",
    "plan_for", "export_plan", "import_plan", "model_from_config", "NotExpressibleError", "fit",
    "FitAnswer", "FitLayout",
]


def __getattr__(name: str):
    # the runtime (torch.distributed) loads only when a script asks for it
    if name in ("parallelize", "ParallelRun", "DataError"):
        from meshplan.runtime import run

        return getattr(run, name)
    if name in ("plan_for", "export_plan", "import_plan"):
        # plans for torchtitan and Megatron-LM (meshplan/stacks/)
        from meshplan.stacks import commands

        return getattr(commands, name)
    if name in ("fit", "FitAnswer", "FitLayout"):
        # will it fit: the fewest nodes of a GPU, the fastest layouts on a mesh (meshplan/fitting.py)
        from meshplan import fitting

        return getattr(fitting, name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")
__version__ = "0.1.0"
