#!/usr/bin/env bash
# The whole test suite: lint, generated-file freshness, pytest (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check omni_core tests
python -m pytest -q
