#!/usr/bin/env bash
# The vLLM currency check (CPU, no vLLM import): for each release named (default: the lowest of
# pyproject's `vllm` range and the newest on the index), download its wheel without
# dependencies, unpack its Python files and check every vLLM internal omni-core touches
# (scripts/vllm_surface.py). Prints one report per release and exits non-zero when any
# release lacks something, so a move of the range is a known diff.
#
#   bash scripts/vllm_currency.sh               # the pinned floor and the newest release
#   bash scripts/vllm_currency.sh 0.27.* 0.34.0 # these
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if [ "$#" -eq 0 ]; then
  floor="$(sed -n 's/^vllm = \["vllm>=\([0-9.]*\),.*/\1/p' pyproject.toml)"
  set -- "${floor}.*" ""
fi
status=0
for version in "$@"; do
  spec="vllm${version:+==$version}"
  dir="$work/$(echo "${version:-newest}" | tr -c 'A-Za-z0-9.\n' '_')"
  mkdir -p "$dir"
  echo "== $spec"
  "$PYTHON" -m pip download "$spec" --no-deps --only-binary :all: -d "$dir" --progress-bar off -q
  wheel="$(ls "$dir"/vllm-*.whl)"
  echo "   $(basename "$wheel")"
  "$PYTHON" - "$wheel" "$dir/src" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:  # the Python sources only: nothing is imported
    for name in wheel.namelist():
        if name.startswith("vllm/") and name.endswith(".py"):
            wheel.extract(name, sys.argv[2])
PY
  rm -f "$wheel"
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/vllm_surface.py "$dir/src" --json "$dir/report.json" || status=1
  rm -rf "$dir/src"
done
exit "$status"
