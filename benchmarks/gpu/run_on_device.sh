#!/usr/bin/env bash
# The GPU machine's side of benchmarks/gpu_check.py: meshplan's packages laid out as the
# install would (setup.cfg package_dir) on PYTHONPATH, since that machine has no registry to
# install from; then the measurement, its results under $OUT.
set -uo pipefail
PKG=/tmp/mp_pkg; rm -rf "$PKG"; mkdir -p "$PKG"
cp -r meshplan "$PKG/meshplan"
for p in planner costmodel runtime; do cp -r "$p" "$PKG/meshplan/$p"; done
# jsonschema (plan validation) from the wheels benchmarks/gpu/device_wheels.sh fetched here
DEPS=/tmp/mp_deps
if [ -d devwheels ] && ! python3 -c "import jsonschema" 2>/dev/null; then
    # only what the device lacks (its own typing_extensions stays first on the path)
    python3 -m pip install -q --no-index --no-deps --target "$DEPS" devwheels/jsonschema-*.whl \
        devwheels/jsonschema_specifications-*.whl devwheels/referencing-*.whl \
        devwheels/rpds_py-*.whl devwheels/attrs-*.whl \
        2>&1 | grep -v "^WARNING: Running pip as the 'root' user"
    PYTHONPATH="$DEPS" python3 -c "import jsonschema" || {
        echo "jsonschema did not install from devwheels/ (benchmarks/gpu/device_wheels.sh)"; exit 2; }
fi
export PYTHONPATH="$PKG:$DEPS" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv | tee "$OUT/nvidia_smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# the SM clock and power every 100 ms beside the measurement (sac_compile reads its modes'
# windows against it: benchmarks/gpu/gpu_compare.py); stopped however the script ends
echo "local $(date '+%Y/%m/%d %H:%M:%S') utc $(date -u '+%Y/%m/%d %H:%M:%S')" >> "$OUT/nvidia_smi.txt"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 \
    > "$OUT/smi_clock.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT INT TERM
python3 benchmarks/gpu_check.py measure --out "$OUT" --budget-s "${1:-400}" --sections "${2:-}" 2>&1 | tee "$OUT/gpu_check_log.txt"
