"""``--json``: a command's answer, or its error, as exactly one JSON document on stdout.

Every document is ``{"schema": "meshplan.cli/v1", "command": NAME, "ok": true, "result":
{...}}`` or ``{"schema": ..., "command": NAME, "ok": false, "error": {"code": CODE, "type":
CLASS, "message": LINE}}``; docs/cli-json.schema.json holds one schema per command's
result and the error document, docs/cli-json.md says what each field means. ``code`` is
the stable name of the error's class (``MeshplanError.code``: MEMORY_OVER_BUDGET,
NOT_EXPRESSIBLE, BAD_INPUT, ...), or of the operating system's refusal (FILE_NOT_FOUND,
PERMISSION_DENIED, IS_A_DIRECTORY), or BAD_USAGE for a command line argparse refuses.
Exit codes are those of the text mode: 0, 2 for a user error, 130 when interrupted.

While a command runs under ``--json`` whatever it prints goes to stderr (``json_mode``),
so stdout holds the document and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import math
import sys

SCHEMA = "meshplan.cli/v1"
JSON_COMMANDS = ("plan", "estimate", "fit", "show", "explain", "diff", "export")
OS_ERROR_CODES = ((IsADirectoryError, "IS_A_DIRECTORY"), (FileNotFoundError, "FILE_NOT_FOUND"),
                  (PermissionError, "PERMISSION_DENIED"))
BAD_USAGE = "BAD_USAGE"  # argparse refused the command line (an unknown flag, a bad value)
INTERRUPTED = "INTERRUPTED"


def add_json_flag(p) -> None:
    p.add_argument("--json", action="store_true", help="print the answer, or the error with "
                   "a stable code, as one JSON document on stdout (docs/cli-json.md)")


def jsonable(value):
    """Plain JSON values from dataclasses, enums, tuples, dicts and floats (NaN and
    infinities become null: JSON has no such numbers)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


def answer(args, result) -> int:
    """Keep ``result`` (a dict or a dataclass) as the command's JSON answer (``main`` prints
    it); returns 0."""
    args.json_result = jsonable(result)
    return 0


def document(command: str, result: dict) -> dict:
    return {"schema": SCHEMA, "command": command, "ok": True, "result": result}


def error_code(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    for cls, name in OS_ERROR_CODES:
        if isinstance(exc, cls):
            return name
    return "ERROR"


def error_document(command: str, exc: BaseException | None = None, *, code: str = "",
                   message: str = "") -> dict:
    err = {"code": code or error_code(exc), "type": type(exc).__name__ if exc else code,
           "message": message or str(exc)}
    if exc is not None and getattr(exc, "min_memory_gib", None) is not None:
        err["min_memory_gib"] = jsonable(exc.min_memory_gib)
    return {"schema": SCHEMA, "command": command, "ok": False, "error": err}


def emit(doc: dict, stream=None) -> None:
    """The one document, on one line, on ``stream`` (the stdout from before json_mode)."""
    stream = stream or sys.stdout
    stream.write(json.dumps(doc, allow_nan=False) + "\n")
    stream.flush()


@contextlib.contextmanager
def json_mode():
    """Whatever the command prints goes to stderr; stdout is the document's."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def command_of(argv) -> str:
    """The subcommand a command line names (for the document of a usage error)."""
    for word in argv or ():
        if word in JSON_COMMANDS:
            return word
    return ""


def plan_facts(plan) -> dict:
    """What ``meshplan show`` puts first, as data: the model, the mesh, the engine, the
    training configuration, each stage's devices, layers, recompute and ZeRO, the prediction,
    and the uniform layout torchtitan / Megatron-LM would read (None where it follows none)."""
    from meshplan.errors import MeshplanError
    from meshplan.stacks.layout import layout_of

    try:
        layout = layout_of(plan, compiled=plan.training.compiled).words()
    except MeshplanError:
        layout = None
    t = plan.training
    return {
        "model": {"name": plan.model.name, "spec": plan.model.spec or None,
                  "parameters": plan.model.param_count},
        "mesh": {"name": plan.mesh.name, "shape": list(plan.mesh.shape),
                 "devices": plan.num_devices},
        "engine": plan.engine, "layout": layout,
        "training": {"global_batch": t.global_batch, "seq_len": t.seq_len,
                     "microbatches": t.microbatches, "microbatch_size": t.microbatch_size,
                     "schedule": t.schedule, "virtual_stages": t.virtual_stages,
                     "dtype": t.dtype, "optimizer": t.optimizer},
        "stages": [{"index": st.index, "devices": len(st.devices),
                    "mesh_shape": list(st.mesh_shape), "axis_names": list(st.axis_names),
                    "layers": list(st.layers), "recompute": st.recompute, "zero": st.zero}
                   for st in plan.stages],
        "predicted": jsonable(plan.predicted),
    }
