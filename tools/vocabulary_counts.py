"""Count the vocabulary literals issue 28 names, so a unification can show its before and after.

For each literal: how many times it is written as a Python string constant (``ast``: string
literals and the constant parts of f-strings, docstrings excluded since they never equal a
bare placement or schedule name) and in how many files, outside the modules that define the
vocabulary (``HOMES``: their own definitions are listed on a line of their own); f-strings
that build a shard placement by hand (``f"S({d})"``); the assignments of ``SCHEDULES``,
``RECOMPUTE``, ``ENGINES`` and of any name ending in ``_SCHEDULES`` or ``DTYPES``; ``R = "R"``
style placement constants outside ``meshplan/placements.py``; the files that import the
``Schedule`` enum; and the lines that spell "virtual stages if interleaved, else 1" on one
line (any case: ``Schedule.INTERLEAVED else 1`` counts; a lower bound, since an expression
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
DEFINED = re.compile(r"^(SCHEDULES|RECOMPUTE\w*|ENGINES|\w*DTYPES|\w*_SCHEDULES)$")
VIRTUAL = re.compile(r"interleaved.*else 1\b|else 1\b.*interleaved", re.IGNORECASE)
# where the vocabulary is defined (a literal there is its one definition)
HOMES = ("meshplan/placements.py", "meshplan/schedules.py", "meshplan/vocabulary.py")


def files(folders) -> list[pathlib.Path]:
    return sorted(p for f in folders for p in pathlib.Path(f).rglob("*.py")
                  if "__pycache__" not in p.parts)


def count(folders) -> dict:
    uses, home_uses = collections.Counter(), collections.Counter()
    where = collections.defaultdict(set)
    shard_fstrings = []
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
                if path.as_posix() in HOMES:
                    home_uses[node.value] += 1
                else:
                    uses[node.value] += 1
                    where[node.value].add(str(path))
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(
                    node.values[0], ast.Constant) and node.values[0].value == "S(" \
                    and path.as_posix() not in HOMES:
                shard_fstrings.append(f"{path}:{node.lineno}")
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in getattr(node, "targets", [getattr(node, "target", None)]):
                    if isinstance(target, ast.Name) and DEFINED.match(target.id):
                        defined[target.id].append(f"{path}:{node.lineno}")
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and node.value.value in ("R", "P", "S(0)") and any(
                        isinstance(t, ast.Name) for t in node.targets) \
                    and path.as_posix() != "meshplan/placements.py":
                local_constants.append(f"{path}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.endswith("schedules") and any(a.name == "Schedule"
                                                              for a in node.names):
                schedule_importers.append(str(path))
        virtual += [f"{path}:{i}" for i, line in enumerate(text.splitlines(), 1)
                    if VIRTUAL.search(line) and not line.lstrip().startswith("#")
                    and path.as_posix() not in HOMES]  # the helper's own line
    return dict(uses=uses, home_uses=home_uses, where=where, defined=defined,
                shard_fstrings=shard_fstrings, local_constants=local_constants,
                schedule_importers=sorted(set(schedule_importers)), virtual=virtual)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folders = PACKAGES + (MORE if "--all" in argv else ())
    c = count(folders)
    print(f"string literals in {', '.join(folders)} ({len(files(folders))} files), "
          f"outside the vocabulary's homes ({', '.join(HOMES)}):")
    for lit in LITERALS:
        few = sorted(c["where"][lit]) if 0 < len(c["where"][lit]) <= 2 else ()
        print(f"  {lit!r:20} {c['uses'][lit]:4} times in {len(c['where'][lit]):3} files"
              + (f"  ({', '.join(few)})" if few else "")
              + (f"  [+{c['home_uses'][lit]} in the homes]" if c["home_uses"][lit] else ""))
    print(f"  f\"S({{...}})\" built by hand: {len(c['shard_fstrings'])}"
          + (": " + ", ".join(c["shard_fstrings"]) if c["shard_fstrings"] else ""))
    for name, places in sorted(c["defined"].items()):
        print(f"  {name} defined {len(places)} times: {', '.join(places)}")
    print(f"  placement constants (R = \"R\" ...) outside meshplan/placements.py: "
          f"{len(c['local_constants'])}: "
          + ", ".join(c["local_constants"]))
    print(f"  files importing the Schedule enum: {len(c['schedule_importers'])}: "
          + ", ".join(c["schedule_importers"]))
    print(f"  lines spelling 'virtual stages if interleaved, else 1' (outside "
          f"schedules.virtual_stages_for): {len(c['virtual'])}"
          + (": " + ", ".join(c["virtual"]) if c["virtual"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
