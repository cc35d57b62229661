#!/usr/bin/env bash
# The row kernels under tuning variables, side by side in one device call (NOTES item 98): each
# setting and case in its own process of build/benchmarks/row_knobs. Cases and settings may be
# given as ROW_KNOBS_CASES ("op cols dtype;...") and ROW_KNOBS_SETTINGS (space-separated VAR=value,
# "" for the default). Prints one line a run.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${ROW_KNOBS_BIN:-build/benchmarks/row_knobs}
cases=${ROW_KNOBS_CASES:-"layer_norm 768 bf16;layer_norm 1000 bf16;softmax 1000 bf16;layer_norm 1024 bf16;layer_norm 768 f32"}
settings=${ROW_KNOBS_SETTINGS:-"default KILN_TUNE_ROW_BLOCK=256 KILN_TUNE_ROW_BLOCK=128 KILN_TUNE_ROW_THREADS=64"}
IFS=';' read -r -a case_list <<< "$cases"
for s in $settings; do
  for c in "${case_list[@]}"; do
    # shellcheck disable=SC2086  # a case is three words
    if [ "$s" = default ]; then out=$("$bin" $c 2>&1 | tail -1); else out=$(env "$s" "$bin" $c 2>&1 | tail -1); fi
    echo "[$s] $out"
  done
done
