#!/usr/bin/env bash
# On a GPU machine: ncu (--set full, clocks not locked) of one launch of W13's forward for kiln
# (benchmarks/attention, built or carried) and for torch.compile'd flex_attention, with each report's
# details page and per-instruction SASS counters (warp-stall samples, executions) as text under $OUT.
# The method of benchmarks/NOTES.md item 190.
#   OUT=/tmp/o benchmarks/attention_ncu.sh "--T 4096 --D 128" k128
# The first argument goes to both sides (--T and --D, one value each: the fourth launch profiled is the
# non-causal case's); the second names the files ($OUT/NAME-kiln.*, $OUT/NAME-flex.*). KILN_TUNE_*
# settings in the environment reach kiln.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 2 ] || { echo "usage: $0 'W13 ARGS' NAME" >&2; exit 2; }
args=$1 name=$2 out=${OUT:-build/bench}
mkdir -p "$out"
ncu_run() {  # ncu_run KERNEL-REGEX TAG COMMAND...
  local regex=$1 tag=$2
  shift 2
  timeout 240 ncu --clock-control none --set full --import-source no --launch-skip 3 --launch-count 1 \
    --kernel-name "regex:$regex" -o "$out/$name-$tag" -f "$@" > /dev/null 2>> "$out/$name-ncu.err"
  [ -f "$out/$name-$tag.ncu-rep" ] || { echo "no report for $tag (see $out/$name-ncu.err)"; return 1; }
  ncu -i "$out/$name-$tag.ncu-rep" --page details > "$out/$name-$tag.details.txt" 2>&1
  ncu -i "$out/$name-$tag.ncu-rep" --page source --csv --print-source sass > "$out/$name-$tag.sass.csv" 2>&1
  grep -E "^  [a-z_]|Duration|Executed Instructions  |Issue Slots Busy|Eligible Warps" "$out/$name-$tag.details.txt"
}
# (kiln's forward kernels are named kiln_attention_fwd_*; flex_attention's Inductor template kernel
# triton_tem_*: a plain "triton" also matches the elementwise kernels around it)
ncu_run kiln_attention_fwd kiln build/benchmarks/attention $args --bwd-T none --reps 2
ncu_run triton_tem flex python3 benchmarks/attention_peer.py $args --bwd-T '' --impls flex --reps 2
