#!/usr/bin/env bash
# Creates .venv with the CPU build of torch (a local wheel, seconds; an unpinned torch would
# pull GBs of CUDA packages) and omni-core with its test and models extras. Idempotent.
# Each step says what it does; pip's own output goes to .venv/setup-pip.log, one line per
# package it collects shows on stderr, and a failure shows the log's end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
step() { echo "setup: $*" >&2; }
pip_install() {
  local log=.venv/setup-pip.log
  if ! python -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 | tee "$log" \
    | sed -u -n 's/^Collecting \([^ ]*\).*/setup:   collecting \1/p' >&2; then
    echo "setup: pip failed; the end of $log:" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
}
[ -x .venv/bin/python ] || { step "creating .venv"; "$PY" -m venv .venv; }
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  step "installing the CPU build of torch 2.13.0"
  pip_install torch==2.13.0
fi
# -c: the exact versions CI runs (pyproject.toml states the ranges a user's environment may meet).
step "installing omni-core with its test, models and serve extras (pinned by scripts/constraints.txt; minutes on a fresh .venv)"
pip_install -c scripts/constraints.txt -e ".[test,models,serve]"
step "done: .venv/bin/omni-core --version"
