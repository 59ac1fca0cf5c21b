#!/usr/bin/env bash
# The GPU checks of staging from CUDA, for a session with a CUDA device (< 6 minutes):
# the tests marked gpu, then benchmarks/gpu_staging.py at a small size. Both run even
# where the first fails (one run on a lent machine gives all there is to see); the exit
# status is non-zero where either failed.
#   bash benchmarks/gpu_check.sh [python] [wheel-dir]
# python: one whose torch is a CUDA build (default python3). wheel-dir: wheels of this
# package's requirements that python lacks (zstandard, crc32c), installed into a
# temporary directory first, without an index (for a machine that reaches none).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
WHEELS="${2:-}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ]; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:$site" # the persist worker inherits it
fi
"$PY" -c 'import sys, torch
print("torch", torch.__version__, "CUDA", torch.version.cuda, "python", sys.version.split()[0])
sys.exit(0 if torch.cuda.is_available() else "no CUDA device")' || exit 1
"$PY" -c 'import storage' || exit 1 # a requirement missing: name it in wheel-dir
timeout 240 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider tests/checkpoint/test_cuda_staging.py
tests=$?
timeout 120 "$PY" benchmarks/gpu_staging.py --gb 0.3 --saves 2 --every 3
bench=$?
echo "gpu tests: exit $tests; benchmark: exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
