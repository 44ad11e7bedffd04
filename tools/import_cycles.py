"""Import cycles among meshplan's modules, and the function-local imports (issue 40).

Builds the module-level import graph of meshplan as setup.cfg installs it (the folders
meshplan/, planner/, costmodel/ and runtime/ become meshplan, meshplan.planner, ...), with an
edge for every ``import`` / ``from ... import`` of a meshplan module, at the top of a file or
inside a function alike: a function-local import still runs, it only runs later, so it hides
a cycle from the reader without removing it. Prints every strongly connected component of more
than one module (an import cycle), each edge inside it with its file:line, and the number of
function-local import statements that name a meshplan module, per package.

``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``
(import-linter's convention; the implicit import of a parent package's ``__init__`` is not an
edge). Imports under ``if TYPE_CHECKING:`` never run and are not edges. Names built at run time
(``importlib.import_module(f"...{x}")``) cannot be read statically and are not edges.

Run from the repository root: ``python tools/import_cycles.py`` (``--json`` for a machine
readable dump).
"""

from __future__ import annotations

import ast
import collections
import configparser
import dataclasses
import json
import pathlib
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Edge:
    source: str      # importing module
    target: str      # imported module
    path: str        # file of the import statement, relative to the root
    line: int
    local: bool      # inside a function (runs when the function is first called)


def package_folders(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Installed package -> folder, from setup.cfg's ``package_dir`` (meshplan's four folders)."""
    cfg = configparser.ConfigParser()
    cfg.read(root / "setup.cfg")
    lines = cfg["options"]["package_dir"].strip().splitlines()
    return {name.strip(): root / folder.strip()
            for name, folder in (line.split("=") for line in lines)}


def discover(folders: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """Module name -> file, for every .py under each package folder (subpackages included,
    a subfolder mapped to its own package by ``folders`` left to that entry)."""
    own = {folder.resolve() for folder in folders.values()}
    modules: dict[str, pathlib.Path] = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder)
            if "__pycache__" in rel.parts:
                continue
            # a subfolder that setup.cfg maps to another package is discovered under that one
            if any((folder / pathlib.Path(*rel.parts[:i])).resolve() in own
                   for i in range(1, len(rel.parts))):
                continue
            parts = [package, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.Module):
    """(node, inside a function) for every import statement that runs (TYPE_CHECKING skipped)."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, local = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    stack.append((sub, local))
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, local
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            stack.append((child, inner))


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(modules: dict[str, pathlib.Path], root: pathlib.Path = ROOT) -> list[Edge]:
    """Every import of a module in ``modules`` by a module in ``modules``."""
    edges: list[Edge] = []
    for module, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        try:
            shown = str(path.relative_to(root))
        except ValueError:
            shown = str(path)
        for node, local in _import_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # ``import a.b.c`` binds a and runs a.b.c: the deepest known module
                    parts = alias.name.split(".")
                    found = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                                  if ".".join(parts[:i]) in modules), None)
                    if found:
                        targets.append(found)
            else:
                base = _resolve(module, is_package, node)
                if base is None:
                    continue
                for alias in node.names:
                    name = f"{base}.{alias.name}"
                    if name in modules:
                        targets.append(name)
                    elif base in modules:
                        targets.append(base)
            for target in dict.fromkeys(targets):
                if target != module:
                    edges.append(Edge(module, target, shown, node.lineno, local))
    return edges


def graph_of(edges: list[Edge], modules=()) -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for edge in edges:
        graph.add_edge(edge.source, edge.target)
    return graph


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module, biggest first, each
    sorted by name."""
    found = [sorted(c) for c in nx.strongly_connected_components(graph_of(edges)) if len(c) > 1]
    return sorted(found, key=lambda c: (-len(c), c))


def cycle_edges(edges: list[Edge], component: list[str]) -> list[Edge]:
    inside = set(component)
    return sorted((e for e in edges if e.source in inside and e.target in inside),
                  key=lambda e: (e.source, e.target, e.line))


def package_of(module: str, packages) -> str:
    """The deepest package in ``packages`` that holds ``module``."""
    return max((p for p in packages if module == p or module.startswith(p + ".")), key=len)


def local_counts(edges: list[Edge], packages) -> collections.Counter:
    """Function-local import statements naming a package module, per importing package
    (one statement importing two modules counts once)."""
    statements = {(e.path, e.line): e.source for e in edges if e.local}
    return collections.Counter(package_of(source, packages) for source in statements.values())


def analyse(folders: dict[str, pathlib.Path], root: pathlib.Path = ROOT) -> dict:
    modules = discover(folders)
    edges = import_edges(modules, root)
    # packages for the per-package count: every folder with an __init__ (subpackages too)
    packages = sorted(m for m, p in modules.items() if p.name == "__init__.py")
    found = cycles(edges)
    return {
        "modules": len(modules),
        "edges": len({(e.source, e.target) for e in edges}),
        "cycles": [{"modules": c,
                    "edges": [f"{e.source} -> {e.target}  {e.path}:{e.line}"
                              + ("  (local)" if e.local else "")
                              for e in cycle_edges(edges, c)]}
                   for c in found],
        "local_imports": dict(sorted(local_counts(edges, packages).items())),
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    root = pathlib.Path(next((a for a in argv if not a.startswith("--")), ROOT))
    result = analyse(package_folders(root), root)
    if "--json" in argv:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['modules']} modules, {result['edges']} module-to-module imports")
    print(f"{len(result['cycles'])} import cycles (strongly connected components > 1 module)")
    for i, cycle in enumerate(result["cycles"], 1):
        print(f"\ncycle {i}: {len(cycle['modules'])} modules: {', '.join(cycle['modules'])}")
        for edge in cycle["edges"]:
            print(f"  {edge}")
    total = sum(result["local_imports"].values())
    print(f"\nfunction-local imports of meshplan modules: {total}")
    for package, n in result["local_imports"].items():
        print(f"  {package:28} {n}")


if __name__ == "__main__":
    main()
