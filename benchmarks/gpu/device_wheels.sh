#!/usr/bin/env bash
# Run here, before benchmarks/gpu/run_on_device.sh: the lent GPU machine has no registry, and
# meshplan needs jsonschema (plan validation, meshplan/schema.py), whose rpds-py is compiled
# per Python. Downloads jsonschema and its dependencies as wheels for the device's Python
# (3.12, x86_64 manylinux; benchmarks/results/gpu_check*.md name its torch) into devwheels/
# (git-ignored: pass carry=["devwheels"] to the device call), where run_on_device.sh installs
# them from.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${1:-3.12}"
PYTHON="${PYTHON:-.venv/bin/python}"  # the environment the README's test command makes
VERSION=$("$PYTHON" -c "import importlib.metadata as m; print(m.version('jsonschema'))")
mkdir -p devwheels
"$PYTHON" -m pip download "jsonschema==$VERSION" --python-version "$PY" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d devwheels -q
ls devwheels
