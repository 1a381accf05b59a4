#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on one GPU): installs the package into a venv, runs the CUDA tests
# and bench/gpu/check.py. Needs a CUDA build of torch on the machine (pip's default torch wheel is one).
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv .venv-gpu
.venv-gpu/bin/pip install --quiet -e . pytest
.venv-gpu/bin/python -m pytest -q tests/gpu
.venv-gpu/bin/python bench/gpu/check.py
