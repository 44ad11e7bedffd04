"""The packages import one way: core <- costmodel <- planner <- runtime <- app.

The contract is `.importlinter` at the repository root (docs/DECISIONS.md 42). import-linter
reads a package from one folder, while setup.cfg installs meshplan from four (``package_dir``),
so the test copies the sources into the installed layout and runs ``lint-imports`` on that.
"""

from __future__ import annotations

import configparser
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def installed_layout(dest: pathlib.Path) -> pathlib.Path:
    """meshplan as setup.cfg installs it, under ``dest``; returns the package folder."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    mapping = dict(line.split(" = ") for line in
                   cfg["options"]["package_dir"].strip().splitlines())
    for package, folder in sorted(mapping.items()):  # meshplan before meshplan.planner
        shutil.copytree(ROOT / folder, dest.joinpath(*package.split(".")),
                        ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    return dest / "meshplan"


def layer_modules() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / ".importlinter")
    layers = cfg["importlinter:contract:layers"]["layers"]
    return {m.strip() for line in layers.strip().splitlines() for m in line.split(":")}


def lint_imports() -> str:
    beside = pathlib.Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports not found: pip install -e '.[test]' (setup.cfg's test extra)"
    return found


def test_every_module_of_meshplan_is_in_a_layer():
    listed = layer_modules()
    modules = {f"meshplan.{p.stem}" for p in (ROOT / "meshplan").glob("*.py")
               if p.stem != "__init__"}
    missing = sorted(modules - listed)
    assert not missing, f"add {missing} to the core or the app layer in .importlinter"


def run_lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([lint_imports(), "--config", str(ROOT / ".importlinter"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_imports_follow_the_layers(tmp_path):
    installed_layout(tmp_path)
    proc = run_lint(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "1 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_an_import_against_the_flow_breaks_the_contract(tmp_path):
    package = installed_layout(tmp_path)
    with open(package / "costmodel" / "comm.py", "a") as f:  # cost model -> runtime
        f.write("\nfrom meshplan.runtime import launch# noqa\n")
    proc = run_lint(tmp_path)
    assert proc.returncode != 0 and "0 kept, 1 broken" in proc.stdout, proc.stdout[-2000:]
    assert "meshplan.costmodel.comm -> meshplan.runtime.launch" in proc.stdout
