#!/usr/bin/env bash
# On a GPU machine: A/B runs of W14 (examples/gpt2's training step), interleaved so that drift hits
# every variant. Each variant is
#   base                  this tree's gpt2 as it is
#   ATTENTION_DQ=0,...    KILN_TUNE_* settings (without the prefix), comma-separated
#   --two-programs        a flag for gpt2 (several: --two-programs+--f32)
#   tree:DIR              the gpt2 of another source tree, e.g. an older commit unpacked on the host
#                         with `git archive REV | tar -x -C DIR` and carried to the device
# e.g. benchmarks/w14_ab.sh base EPILOGUE=2 PARTIALS=1 ATTENTION_ORDER=0 --two-programs tree:.snap/old
# Every variant runs ${W14_ROUNDS:-2} rounds of `gpt2 --steps 12` (--graphs unless W14_PLAIN=1),
# after one warm-up run a tree that fills its kernel cache (one cache a tree, so the rounds time
# steps, not compiles). Prints each variant's median step (ms) a round and tokens/s; logs in $OUT
# (or build/bench). Needs nothing built: it configures and builds gpt2 in each tree's build/
# (W14_NO_BUILD=1: already built).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
[ $# -ge 1 ] || { echo "usage: $0 VARIANT... (base, KNOB=V, --flag, tree:DIR)" >&2; exit 2; }
trees=(.)
for v in "$@"; do [[ $v == tree:* ]] && trees+=("${v#tree:}"); done
for tr in "${trees[@]}"; do
  [ "${W14_NO_BUILD:-0}" = 1 ] && break  # (already built)
  ( cd "$tr" && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > build.log 2>&1 &&
    cmake --build build --target gpt2 -j "$(( $(nproc) / ${#trees[@]} + 1 ))" >> build.log 2>&1 ) ||
    { tail -20 "$tr/build.log"; echo "w14_ab: the build in $tr failed"; exit 1; } &
done
wait
declare -A cache
for tr in "${trees[@]}"; do
  cache[$tr]=$(mktemp -d)
  KILN_CACHE_DIR=${cache[$tr]} "$tr/build/examples/gpt2" --steps 3 > "$out/w14ab-warm-$(basename "$tr").log" 2>&1
done
graphs=--graphs; [ "${W14_PLAIN:-0}" = 1 ] && graphs=
for round in $(seq "${W14_ROUNDS:-2}"); do
  for v in "$@"; do
    tr=.; envs=(); flags=()
    case $v in
      base) ;;
      tree:*) tr=${v#tree:} ;;
      --*) IFS=+ read -ra flags <<< "$v" ;;
      *) IFS=, read -ra kv <<< "$v"; for s in "${kv[@]}"; do envs+=("KILN_TUNE_$s"); done ;;
    esac
    log="$out/w14ab-$(echo "$v" | tr -c 'A-Za-z0-9_=.-' '_')-$round.log"
    env KILN_CACHE_DIR="${cache[$tr]}" "${envs[@]}" "$tr/build/examples/gpt2" --steps 12 $graphs "${flags[@]}" > "$log" 2>&1
    echo "$v round $round: $(grep -E '^tokens/s' "$log" || echo "failed (see $log)")"
  done
done
