#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (a local wheel, seconds; an unpinned torch would
# pull GBs of CUDA packages) and omni-core with its test and models extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q --disable-pip-version-check torch==2.13.0
fi
# -c: the exact versions CI runs (pyproject.toml states the ranges a user's environment may meet).
python -m pip install -q --disable-pip-version-check -c scripts/constraints.txt -e ".[test,models,serve]"
