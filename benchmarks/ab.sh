#!/usr/bin/env bash
# On a GPU machine: A/B runs of kiln's tuning knobs, interleaved so that drift hits every variant.
#   benchmarks/ab.sh W1,W4,W8 base HOIST=1 POI_UNROLL=4,POI_THREADS=256
# Each variant after the workload list is `base` or comma-separated KILN_TUNE_* settings without
# the prefix; every variant runs ${AB_ROUNDS:-2} times on a fresh kernel cache. Prints one row per
# workload (and per kiln sub-variant, e.g. W4-dynamic) with each variant's times (ms) and the last against the first; raw JSON
# lines go to $OUT/ab.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  echo "usage: $0 WORKLOADS VARIANT... (e.g. $0 W1,W4 base HOIST=2)" >&2
  exit 2
fi
out=${OUT:-build/bench}
mkdir -p "$out"
workloads=$1; shift
raw="$out/ab.jsonl"; : > "$raw"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for v in "$@"; do
    envs=(KILN_CACHE_DIR="$(mktemp -d)")
    if [ "$v" != base ]; then
      IFS=, read -ra kv <<< "$v"
      for s in "${kv[@]}"; do envs+=("KILN_TUNE_$s"); done
    fi
    # "kiln" and "kiln-dynamic" become "<variant>" and "<variant>-dynamic".
    env "${envs[@]}" build/benchmarks/bench --reps "${AB_REPS:-100}" --only "$workloads" |
      sed "s/\"impl\": \"kiln/\"impl\": \"$v/" >> "$raw"
  done
done
python3 benchmarks/ab_table.py "$raw" "$@"
