#!/usr/bin/env bash
# On a GPU machine: A/B runs of W14 (examples/gpt2's training step), interleaved so that drift hits
# every variant: base, KILN_TUNE_* settings, gpt2 flags or another source tree (benchmarks/ab_variants.sh)
# e.g. benchmarks/w14_ab.sh base EPILOGUE=2 PARTIALS=1 ATTENTION_ORDER=0 --two-programs tree:.snap/old
# Every variant runs ${W14_ROUNDS:-2} rounds of `gpt2 --steps 12` (--graphs unless W14_PLAIN=1),
# after one warm-up run a tree that fills its kernel cache (one cache a tree, so the rounds time
# steps, not compiles). Prints each variant's median step (ms) a round and tokens/s; logs in $OUT
# (or build/bench). Needs nothing built: it configures and builds gpt2 in each tree's build/
# (AB_NO_BUILD=1: already built).
set -uo pipefail
cd "$(dirname "$0")/.."
. benchmarks/ab_variants.sh
out=${OUT:-build/bench}
mkdir -p "$out"
[ $# -ge 1 ] || { echo "usage: $0 VARIANT... (base, KNOB=V, --flag, tree:DIR)" >&2; exit 2; }
ab_build gpt2 "$@" || exit 1
declare -A cache
for tr in "${trees[@]}"; do
  cache[$tr]=$(mktemp -d)
  KILN_CACHE_DIR=${cache[$tr]} "$tr/build/examples/gpt2" --steps 3 > "$out/w14ab-warm-$(basename "$tr").log" 2>&1
done
graphs=--graphs; [ "${W14_PLAIN:-0}" = 1 ] && graphs=
for round in $(seq "${W14_ROUNDS:-2}"); do
  for v in "$@"; do
    ab_variant "$v"
    log="$out/w14ab-$(echo "$v" | tr -c 'A-Za-z0-9_=.-' '_')-$round.log"
    env KILN_CACHE_DIR="${cache[$tr]}" "${envs[@]}" "$tr/build/examples/gpt2" --steps 12 $graphs "${flags[@]}" > "$log" 2>&1
    echo "$v round $round: $(grep -E '^tokens/s' "$log" || echo "failed (see $log)")"
  done
done
