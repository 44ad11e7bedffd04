"""meshplan: plan how to train a PyTorch model on many devices, then run the plan.

    import meshplan
    mesh = meshplan.Mesh.preset("dgx-a100-80gb", nodes=8)
    plan = meshplan.autoparallel(model, mesh, example_inputs=(ids,))
    print(plan.summary())
"""

from meshplan.errors import (MemoryLimitError, MeshError, MeshplanError, NotSupportedError,
                             PlanFileError, PlanningError, SpecError, TraceError)
from meshplan.mesh import Mesh
from meshplan.plan import Estimate, Plan
from meshplan.planner.trace import trace
from meshplan.api import autoparallel, estimate, manual_plan

__all__ = [
    "Mesh", "Plan", "Estimate", "autoparallel", "manual_plan", "estimate", "trace",
    "MeshplanError", "TraceError", "MeshError", "SpecError", "PlanFileError", "PlanningError",
    "MemoryLimitError", "NotSupportedError",
]
__version__ = "0.1.0"
