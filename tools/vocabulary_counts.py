"""Count the vocabulary literals issue 28 names, so a unification can show its before and after.

For each literal: how many times it is written as a Python string constant (``ast``: string
literals and the constant parts of f-strings, docstrings excluded since they never equal a
bare placement or schedule name) and in how many files; the module-level definitions of
``SCHEDULES``, ``RECOMPUTE`` and ``COMPUTE_DTYPES`` (and any name ending so), local
``R = "R"`` style constants, the files that import the ``Schedule`` enum, and the lines that
spell "virtual stages if interleaved, else 1" on one line (a lower bound: an expression
split over lines is not seen). Run from the repository root:
``python tools/vocabulary_counts.py [--all]`` (``--all`` adds tests/, benchmarks/, examples/).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import sys

PACKAGES = ("meshplan", "planner", "costmodel", "runtime")
MORE = ("tests", "benchmarks", "examples", "tools")
LITERALS = ("S(0)", "S(1)", "R", "P", "interleaved-1f1b", "1f1b", "gpipe", "selective",
            "full", "bf16", "fp16", "fp32", "modules", "graph")
DEFINED = re.compile(r"^(SCHEDULES|RECOMPUTE\w*|COMPUTE_DTYPES|\w*_SCHEDULES)$")
VIRTUAL = re.compile(r"interleaved.*else 1\b|else 1\b.*interleaved")


def files(folders) -> list[pathlib.Path]:
    return sorted(p for f in folders for p in pathlib.Path(f).rglob("*.py")
                  if "__pycache__" not in p.parts)


def count(folders) -> dict:
    uses = collections.Counter()
    where = collections.defaultdict(set)
    defined = collections.defaultdict(list)
    local_constants, schedule_importers, virtual = [], [], []
    for path in files(folders):
        text = path.read_text()
        tree = ast.parse(text)
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                        ast.ClassDef))
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings and node.value in LITERALS:
                uses[node.value] += 1
                where[node.value].add(str(path))
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(target, ast.Name) and DEFINED.match(target.id):
                        defined[target.id].append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and node.value.value in ("R", "P", "S(0)") and any(
                        isinstance(t, ast.Name) for t in node.targets):
                local_constants.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.endswith("schedules") and any(a.name == "Schedule"
                                                              for a in node.names):
                schedule_importers.append(str(path))
        virtual += [f"{path}:{i}" for i, line in enumerate(text.splitlines(), 1)
                    if VIRTUAL.search(line) and not line.lstrip().startswith("#")]
    return dict(uses=uses, where=where, defined=defined, local_constants=local_constants,
                schedule_importers=sorted(set(schedule_importers)), virtual=virtual)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folders = PACKAGES + (MORE if "--all" in argv else ())
    c = count(folders)
    print(f"string literals in {', '.join(folders)} ({len(files(folders))} files):")
    for lit in LITERALS:
        print(f"  {lit!r:20} {c['uses'][lit]:4} times in {len(c['where'][lit]):3} files")
    for name, places in sorted(c["defined"].items()):
        print(f"  {name} defined {len(places)} times: {', '.join(places)}")
    print(f"  local placement constants (R = \"R\" ...): {len(c['local_constants'])}: "
          + ", ".join(c["local_constants"]))
    print(f"  files importing the Schedule enum: {len(c['schedule_importers'])}: "
          + ", ".join(c["schedule_importers"]))
    print(f"  lines spelling 'virtual stages if interleaved, else 1': {len(c['virtual'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
