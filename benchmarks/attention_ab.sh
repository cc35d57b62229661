#!/usr/bin/env bash
# On a GPU machine: A/B runs of W13 (benchmarks/attention), interleaved so that drift hits every
# variant. The first argument is passed to benchmarks/attention (its cases: "--T 1024 --D 64",
# "--B 8 --H 12 --T 1024 --D 64" for GPT-2's shape, ...); each variant after it is
#   base                  this tree's kernels as they are
#   ATTENTION_DQ=0,...    KILN_TUNE_* settings (without the prefix), comma-separated
#   tree:DIR              the benchmark of another source tree (an older commit unpacked on the host
#                         with `git archive REV | tar -x -C DIR` and carried to the device)
# e.g. benchmarks/attention_ab.sh "--B 8 --H 12 --T 1024 --D 64" base ATTENTION_WGMMA=4 tree:.snap/old
# ${AB_ROUNDS:-2} rounds; one kernel cache a tree (settings that change a kernel change its name).
# Prints each case's times (ms) a variant and the last variant against the first; raw JSON lines
# in $OUT/attention_ab.jsonl (or build/bench). Every kiln result is checked before it is timed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
[ $# -ge 2 ] || { echo "usage: $0 'ATTENTION ARGS' VARIANT... (base, KNOB=V, tree:DIR)" >&2; exit 2; }
args=$1; shift
trees=(.)
for v in "$@"; do [[ $v == tree:* ]] && trees+=("${v#tree:}"); done
for tr in "${trees[@]}"; do
  [ "${AB_NO_BUILD:-0}" = 1 ] && break  # (already built)
  ( cd "$tr" && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > build.log 2>&1 &&
    cmake --build build --target attention -j "$(( $(nproc) / ${#trees[@]} + 1 ))" >> build.log 2>&1 ) ||
    { tail -20 "$tr/build.log"; echo "attention_ab: the build in $tr failed"; exit 1; } &
done
wait
declare -A cache
for tr in "${trees[@]}"; do cache[$tr]=$(mktemp -d); done
raw="$out/attention_ab.jsonl"; : > "$raw"
for round in $(seq "${AB_ROUNDS:-2}"); do
  for v in "$@"; do
    tr=.; envs=()
    case $v in
      base) ;;
      tree:*) tr=${v#tree:} ;;
      *) IFS=, read -ra kv <<< "$v"; for s in "${kv[@]}"; do envs+=("KILN_TUNE_$s"); done ;;
    esac
    # (the variant's name in place of "kiln" in each line)
    env KILN_CACHE_DIR="${cache[$tr]}" "${envs[@]}" "$tr/build/benchmarks/attention" $args --reps "${AB_REPS:-20}" 2>> "$out/attention_ab.err" |
      sed "s|\"impl\": \"kiln|\"impl\": \"$v|" >> "$raw"
  done
done
python3 - "$raw" "$@" <<'PY'
import collections, json, sys
rows, variants = collections.defaultdict(list), sys.argv[2:]
for line in open(sys.argv[1]):
    try: d = json.loads(line)
    except ValueError: continue
    if 'error' in d: print('error', d)
    if 'ms' in d and d['impl'] in variants: rows[(d['id'], d['impl'])].append(d['ms'])
print('case'.ljust(34) + ''.join(v[:20].rjust(22) for v in variants) + '  last/first')
for case in sorted({k[0] for k in rows}):
    t = [rows.get((case, v), []) for v in variants]
    ratio = min(t[-1]) / min(t[0]) if t[0] and t[-1] else float('nan')
    print(case.ljust(34) + ''.join('/'.join('%.4f' % x for x in m).rjust(22) for m in t) + '  %.3f' % ratio)
PY
