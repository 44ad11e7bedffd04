"""Errors meshplan raises on bad input. Every message says the value, the rule and the fix.

The CLI prints one line for any ``MeshplanError`` and exits with code 2; everything else
is a bug and keeps its traceback.
"""


class MeshplanError(Exception):
    """Base class of every error a user can cause."""


class TraceError(MeshplanError):
    """The model could not be traced into an operator graph."""


class MeshError(MeshplanError):
    """An unknown preset, a malformed cluster file, or a mesh that does not fit the plan."""


class SpecError(MeshplanError):
    """A model or mesh spec on the command line could not be understood."""


class PlanFileError(MeshplanError):
    """A plan file is missing, truncated, of another schema version, or made for another model."""


class PlanningError(MeshplanError):
    """No plan in the search space satisfies the constraints (memory, divisibility)."""


class MemoryLimitError(PlanningError):
    """Even the most memory-frugal plan needs more than the device's memory.

    ``min_memory_gib`` is the smallest per-device memory any strategy in the space needs.
    """

    def __init__(self, message: str, *, min_memory_gib: float):
        super().__init__(message)
        self.min_memory_gib = min_memory_gib


class NotSupportedError(MeshplanError):
    """A capability meshplan does not have yet; the message says which."""


def gib(value: float) -> str:
    """A memory size in GiB for a message, with significant digits however small it is
    ("0.00012", not "0.00"): two decimals from 10 GiB up, three significant digits below."""
    return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3g}"
