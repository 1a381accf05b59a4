#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on one GPU): the CUDA tests, then bench/gpu/check.py, whose JSON
# goes to $1 (default bench/results/gpu-<date>.json). It uses the machine's own python3 and its CUDA build of torch
# and installs nothing (GPU machines often reach no network): the package is imported from src/. Needs numpy,
# scipy, pytest and hypothesis there; PYTHON=... picks another interpreter.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" -c "import torch, numpy, scipy; assert torch.cuda.is_available(), 'bench/gpu/run.sh: torch sees no CUDA device'"
"$PY" -m pytest -q -p no:cacheprovider tests/gpu
"$PY" bench/gpu/check.py ${1:+--out "$1"}
