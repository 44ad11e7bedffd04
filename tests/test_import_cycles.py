"""No import cycle among meshplan's modules (issue 40), read by tools/import_cycles.py.

The tool counts function-local imports as edges (they run, only later), so a cycle cannot be
hidden by moving an import into a function. Before issue 40: 7 cycles (9, 5, 3, 3, 2, 2 and 2
modules; benchmarks/results/import_cycles.md), the largest tying the module engine and the
graph engine together. Cheap: parses the sources, imports nothing of meshplan.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# strongly connected components still allowed, each exactly (sorted module names); a new
# cycle, or a change to one of these, fails the test. Empty when issue 40 is done.
ALLOWED: list[list[str]] = []


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_cycles"] = module  # its dataclass resolves annotations through it
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["import_cycles"]
    return module


@pytest.fixture(scope="module")
def edges(tool):
    return tool.import_edges(tool.discover(tool.package_folders(ROOT)), ROOT)


def test_meshplan_has_no_import_cycle_but_the_allowed_ones(tool, edges):
    found = tool.cycles(edges)
    new = [c for c in found if c not in ALLOWED]
    detail = {" ".join(c): [f"{e.source} -> {e.target} {e.path}:{e.line}"
                            for e in tool.cycle_edges(edges, c)] for c in new}
    assert not new, f"import cycles (move what both sides use to the module that owns it): {detail}"
    gone = [c for c in ALLOWED if c not in found]
    assert not gone, f"these cycles are gone: remove them from ALLOWED: {gone}"


def test_the_two_engines_share_code_only_through_runtime_shared_modules(edges):
    """The module engine (runtime/modules.py, module_plan.py, module_pipeline.py,
    module_engine.py) and the graph engine (runtime/graph/) never import each other;
    what both use is in runtime/shared.py or runtime/engine.py (issue 40)."""
    module_engine = {"meshplan.runtime.modules", "meshplan.runtime.module_plan",
                     "meshplan.runtime.module_pipeline", "meshplan.runtime.module_engine"}

    def graph(m):
        return m.startswith("meshplan.runtime.graph.")

    crossing = sorted(f"{e.source} -> {e.target} {e.path}:{e.line}" for e in edges
                      if (e.source in module_engine and graph(e.target))
                      or (graph(e.source) and e.target in module_engine))
    assert not crossing, crossing


def _package(root: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return {"pkg": root / "pkg"}


def test_a_cycle_hidden_in_a_function_is_found(tool, tmp_path):
    folders = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "def f():\n    from .c import g\n    return g\n",
        "c.py": "import pkg.a\n",
        # not edges: an import for type checkers only, a module outside the package
        "d.py": "from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from pkg import a\n",
        "sub/__init__.py": "",
        "sub/e.py": "from ..d import os\n",
    })
    edges = tool.import_edges(tool.discover(folders), tmp_path)
    assert tool.cycles(edges) == [["pkg.a", "pkg.b", "pkg.c"]]
    local = [(e.source, e.target, e.line) for e in edges if e.local]
    assert local == [("pkg.b", "pkg.c", 2)]
    assert ("pkg.sub.e", "pkg.d") in {(e.source, e.target) for e in edges}
    assert not any(e.source == "pkg.d" for e in edges)
    assert tool.local_counts(edges, ["pkg", "pkg.sub"]) == {"pkg": 1}


def test_a_cycle_planted_in_meshplan_fails_the_check(tool, tmp_path):
    """meshplan/errors.py (imported by every package) importing the runtime inside a function
    closes a cycle through every module between them: the check above would fail on it."""
    folders = tool.package_folders(ROOT)
    copies = {}
    for package, folder in folders.items():
        copies[package] = tmp_path / folder.name
        shutil.copytree(folder, copies[package], ignore=shutil.ignore_patterns("__pycache__"))
    with open(copies["meshplan"] / "errors.py", "a") as f:
        f.write("\n\ndef _planted():\n    from meshplan.runtime import run  # noqa\n")
    edges = tool.import_edges(tool.discover(copies), tmp_path)
    new = [c for c in tool.cycles(edges) if c not in ALLOWED]
    assert new and any({"meshplan.errors", "meshplan.runtime.run"} <= set(c) for c in new)
