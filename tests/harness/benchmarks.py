"""Loading a script of benchmarks/ as a module, for the tests of its pure helpers."""

from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@contextmanager
def benchmark_module(name: str):
    """``benchmarks/<name>.py`` (``name`` may be ``gpu/kernel_fit``) imported under a private name (registered in sys.modules while
    in use: dataclasses look their module up there), removed again afterwards."""
    spec = importlib.util.spec_from_file_location(
        f"{name.replace('/', '_')}_benchmark", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@contextmanager
def gpu_benchmark_module(name: str):
    """``benchmarks/gpu/<name>.py`` with benchmarks/gpu on the path while in use (its scripts
    import ``model`` from beside them); ``model`` is forgotten again afterwards."""
    gpu = os.path.join(ROOT, "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        with benchmark_module(f"gpu/{name}") as module:
            yield module
    finally:
        sys.path.remove(gpu)
        sys.modules.pop("model", None)
