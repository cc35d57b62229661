#!/usr/bin/env bash
# On a GPU machine: A/B runs of W13 (benchmarks/attention), interleaved so that drift hits every
# variant. The first argument is passed to benchmarks/attention (its cases: "--T 1024 --D 64",
# "--B 8 --H 12 --T 1024 --D 64" for GPT-2's shape, ...); each variant after it is base, KILN_TUNE_*
# settings or another source tree (benchmarks/ab_variants.sh).
# e.g. benchmarks/attention_ab.sh "--B 8 --H 12 --T 1024 --D 64" base ATTENTION_WGMMA=4 tree:.snap/old
# ${AB_ROUNDS:-2} rounds; one kernel cache a tree (settings that change a kernel change its name).
# Prints each case's times (ms) a variant and the last variant against the first (ab_table.py); raw
# JSON lines in $OUT/attention_ab.jsonl (or build/bench). Every kiln result is checked before it is timed.
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/ab_variants.sh
out=${OUT:-build/bench}
mkdir -p "$out"
[ $# -ge 2 ] || { echo "usage: $0 'ATTENTION ARGS' VARIANT... (base, KNOB=V, tree:DIR)" >&2; exit 2; }
args=$1; shift
ab_build attention "$@" || exit 1
declare -A cache
for tr in "${trees[@]}"; do cache[$tr]=$(mktemp -d); done
raw="$out/attention_ab.jsonl"; : > "$raw"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for v in "$@"; do
    ab_variant "$v"
    # (the variant's name in place of "kiln" in each line)
    env KILN_CACHE_DIR="${cache[$tr]}" "${envs[@]}" "$tr/build/benchmarks/attention" $args --reps "${AB_REPS:-20}" 2>> "$out/attention_ab.err" |
      sed "s|\"impl\": \"kiln|\"impl\": \"$v|" >> "$raw"
  done
done
python3 benchmarks/ab_table.py "$raw" "$@"
