"""Count import statements between meshplan's packages (issue 16).

Prints one row per (importing package -> imported package) with the number of import
statements, so a change to the layering can show its before and after.  Run from the
repository root: ``python tools/import_counts.py``.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys

# folder on disk -> package name as installed (setup.cfg package_dir)
FOLDERS = {"meshplan": "meshplan", "planner": "planner", "costmodel": "costmodel", "runtime": "runtime"}


# modules of meshplan/ that form the core layer (docs/DECISIONS.md 42); the rest is app
CORE = {"context", "errors", "plan", "placements", "schedules", "graph", "tracing", "opcount", "support",
        "inspect", "export_program", "export_graph"}
PACKAGES = ("core", "costmodel", "planner", "runtime", "app")


def target_package(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "meshplan":
        return None
    if len(parts) > 1 and parts[1] in ("planner", "costmodel", "runtime"):
        return parts[1]
    return "core" if len(parts) > 1 and parts[1] in CORE else "app"


def counts(root: pathlib.Path) -> collections.Counter:
    table: collections.Counter = collections.Counter()
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).glob("*.py")):
            if folder == "meshplan":
                package = "core" if path.stem in CORE else "app"
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "meshplan":
                    modules = [f"meshplan.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                else:
                    continue
                for module in modules:
                    target = target_package(module)
                    if target is not None and target != package:
                        table[(package, target)] += 1
    return table


def main() -> None:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    table = counts(root)
    for source in PACKAGES:
        row = ", ".join(f"{target} {table[source, target]}" for target in PACKAGES
                        if table[source, target])
        print(f"{source:9} -> {row or '-'}")


if __name__ == "__main__":
    main()
