#!/usr/bin/env bash
# Run the GPU-marked tests on the device, one process per test file (vLLM's CuMemAllocator
# and CUDA contexts do not come back clean inside one interpreter), each file's output in
# $OUT/gpu_tests/<file>.txt and one line per file in $OUT/gpu_tests/summary.txt.
#   bash scripts/device/gpu_tests.sh [budget_s] [test files...]   (default: every gpu file)
# Files whose tests must each run alone list them with -k in ALONE below.
set -u
budget_s="${1:-540}"; shift || true
out="${OUT:-/tmp/out}/gpu_tests"; mkdir -p "$out"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    mapfile -t files < <(grep -rl "pytest.mark.gpu" tests --include='test_*.py' | sort)
fi
declare -A ALONE=(
    [tests/workers/test_fast_vllm_plugin.py]="test_gpu_plugin_through_vllm_plugin_loader_and_factory test_gpu_plugin_registers_in_the_node_ledger_and_takes_its_turn"
)
start=$SECONDS
run_one() {  # file, optional -k expression, output name
    local left=$((budget_s - (SECONDS - start)))
    if [ "$left" -le 20 ]; then echo "$1 ${2:-}: not run (budget spent)" >> "$out/summary.txt"; return; fi
    local t0=$SECONDS
    timeout "$left" python3 -m pytest -q -m gpu -rs -p no:cacheprovider ${2:+-k "$2"} "$1" > "$out/$3.txt" 2>&1
    local rc=$?
    echo "$1 ${2:-}: rc=$rc $((SECONDS - t0)) s: $(tail -1 "$out/$3.txt")" >> "$out/summary.txt"
}
for f in "${files[@]}"; do
    name="$(basename "$f" .py)"
    if [ -n "${ALONE[$f]:-}" ]; then
        for t in ${ALONE[$f]}; do run_one "$f" "$t" "$name.$t"; done
    else
        run_one "$f" "" "$name"
    fi
done
cat "$out/summary.txt"
