"""Errors meshplan raises on bad input. Every message says the value, the rule and the fix.

The CLI prints one line for any ``MeshplanError`` and exits with code 2; everything else
is a bug and keeps its traceback. Each class has a stable ``code`` (what ``--json`` prints
in its error document, docs/cli-json.md): a subclass keeps its parent's unless it names
its own, and a code, once published, is never renamed.
"""


class MeshplanError(Exception):
    """Base class of every error a user can cause."""

    code = "ERROR"


class TraceError(MeshplanError):
    """The model could not be traced into an operator graph."""

    code = "TRACE_FAILED"


class MeshError(MeshplanError):
    """An unknown preset, a malformed cluster file, or a mesh that does not fit the plan."""

    code = "BAD_MESH"


class SpecError(MeshplanError):
    """A model or mesh spec on the command line could not be understood."""

    code = "BAD_INPUT"


class PlanFileError(MeshplanError):
    """A plan file is missing, truncated, of another schema version, or made for another model."""

    code = "BAD_PLAN_FILE"


class PlanningError(MeshplanError):
    """No plan in the search space satisfies the constraints (memory, divisibility)."""

    code = "NO_PLAN"


class MemoryLimitError(PlanningError):
    """Even the most memory-frugal plan needs more than the device's memory.

    ``min_memory_gib`` is the smallest per-device memory any strategy in the space needs.
    """

    code = "MEMORY_OVER_BUDGET"

    def __init__(self, message: str, *, min_memory_gib: float):
        super().__init__(message)
        self.min_memory_gib = min_memory_gib


class NotSupportedError(MeshplanError):
    """A capability meshplan does not have yet; the message says which."""

    code = "NOT_SUPPORTED"


class NotExpressibleError(NotSupportedError):
    """A plan the target stack (torchtitan, Megatron-LM) cannot run as written: the message
    names what the stack lacks (``meshplan export``, ``export_plan``)."""

    code = "NOT_EXPRESSIBLE"


def gib(value: float) -> str:
    """A memory size in GiB for a message, with significant digits however small it is
    ("0.00012", not "0.00"): two decimals from 10 GiB up, three significant digits below."""
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3g}"
