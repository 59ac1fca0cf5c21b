#!/usr/bin/env bash
# The GPU checks of staging from CUDA, for a session with a CUDA device (< 5 minutes):
# the tests marked gpu, then benchmarks/gpu_staging.py at a small size.
#   bash benchmarks/gpu_check.sh [python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device")'
timeout 180 "$PY" -m pytest -q -m gpu -rs tests/checkpoint/test_cuda_staging.py
timeout 120 "$PY" benchmarks/gpu_staging.py --gb 0.3 --saves 2 --every 3
