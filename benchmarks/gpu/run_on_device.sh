#!/usr/bin/env bash
# The GPU machine's side of benchmarks/gpu_check.py: meshplan's packages laid out as the
# install would (setup.cfg package_dir) on PYTHONPATH, since that machine has no registry to
# install from; then the measurement, its results under $OUT.
set -uo pipefail
PKG=/tmp/mp_pkg; rm -rf "$PKG"; mkdir -p "$PKG"
cp -r meshplan "$PKG/meshplan"
for p in planner costmodel runtime; do cp -r "$p" "$PKG/meshplan/$p"; done
export PYTHONPATH="$PKG" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 benchmarks/gpu_check.py measure --out "$OUT" --budget-s "${1:-400}" --sections "${2:-}" 2>&1 | tee "$OUT/gpu_check_log.txt"
