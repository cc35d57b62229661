#!/usr/bin/env bash
# One device call's worth of the shape sweep (issue 19) on a GPU machine: builds benchmarks/sweep.cpp,
# then runs one or more op families for kiln and for torch.compile, interleaved (kiln, torch, kiln,
# torch ... for ${SWEEP_ROUNDS:-1} rounds), appending JSON lines to $OUT/sweep.jsonl, and prints the
# table (benchmarks/sweep_report.py) of what $OUT/sweep.jsonl holds so far.
#   OUT=/tmp/o benchmarks/sweep.sh softmax,log_softmax
#   SWEEP_ARGS="--dtypes f32 --cols 4096,8192" benchmarks/sweep.sh layer_norm
# Families: softmax log_softmax layer_norm layer_norm_bwd rms_norm rms_norm_bwd cross_entropy
# pointwise colsum 3d small. Each device call is at most 10 minutes: one or two row families a call
# (torch.compile compiles each of the 38 cases twice; about 2-4 s a compile cold).
# torch's compile cache and kiln's kernel cache live under ${SWEEP_CACHE:-/tmp/kiln_sweep_cache},
# which a warm machine keeps between calls, so a rerun of a family compiles little.
# SWEEP_PHASES (default build,kiln,torch) picks the phases; "warm" fills torch's compile cache first
# with ${SWEEP_WARM:-8} processes at once (each compiling every N-th case, one repetition, nothing
# kept), so that the timed torch phase only loads compiled kernels: all 308 cases in two calls.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: $0 FAMILY[,FAMILY...]   (see the comment at the top)" >&2
  exit 2
fi
families=$1
out=${OUT:-build/bench}
cache=${SWEEP_CACHE:-/tmp/kiln_sweep_cache}
mkdir -p "$out" "$cache"
bin=build/sweep/sweep
phases=,${SWEEP_PHASES:-build,kiln,torch},
has() { [[ $phases == *,$1,* ]]; }
if has warm; then
  n=${SWEEP_WARM:-8}
  echo "sweep.sh: warming torch's compile cache with $n processes" >&2
  for i in $(seq 0 $((n - 1))); do
    PYTHONUNBUFFERED=1 python3 benchmarks/sweep_peer.py --only "$families" --reps 1 --shard "$i/$n" \
      --cache-dir "$cache/torch" ${SWEEP_ARGS:-} > /dev/null 2>> "$out/sweep-warm.err" &
  done
fi
# Build: with CMake where a configured build/ exists, else g++ directly; only when a source is newer.
if [ -f build/CMakeCache.txt ]; then
  cmake --build build --target sweep -j 16 > "$out/sweep-build.log" 2>&1 || { tail -30 "$out/sweep-build.log"; exit 1; }
  bin=build/benchmarks/sweep
elif [ ! -x "$bin" ] || [ -n "$(find include benchmarks/sweep.cpp benchmarks/timing.hpp -newer "$bin" -print -quit)" ]; then
  mkdir -p build/sweep
  cuda=${CUDA_HOME:-/usr/local/cuda}
  g++ -std=c++20 -O3 -DNDEBUG -Wall -Wextra -I include -I "$cuda/include" benchmarks/sweep.cpp -o "$bin" \
    -L"$cuda/lib64" -lnvrtc -ldl -lpthread -Wl,-rpath,"$cuda/lib64" > "$out/sweep-build.log" 2>&1 ||
    { tail -30 "$out/sweep-build.log"; exit 1; }
fi
wait  # the warm-up
# The two sides must list the same cases (ids) for the same arguments.
if ! diff <("$bin" --list --only "$families" ${SWEEP_ARGS:-}) \
  <(python3 benchmarks/sweep_peer.py --list --only "$families" ${SWEEP_ARGS:-}) > "$out/sweep-list.diff"; then
  echo "sweep.sh: kiln's and torch's case lists differ:"; head -20 "$out/sweep-list.diff"; exit 1
fi
for round in $(seq "${SWEEP_ROUNDS:-1}"); do
  if has kiln; then
    echo "sweep.sh: round $round, $families: kiln" >&2
    KILN_CACHE_DIR=$cache/kiln "$bin" --only "$families" --reps "${SWEEP_REPS:-100}" ${SWEEP_ARGS:-} \
      >> "$out/sweep.jsonl" 2>> "$out/sweep-kiln.err" || echo "sweep.sh: kiln exited $? (see $out/sweep-kiln.err)" >&2
  fi
  if has torch; then
    echo "sweep.sh: round $round, $families: torch.compile" >&2
    PYTHONUNBUFFERED=1 python3 benchmarks/sweep_peer.py --only "$families" --reps "${SWEEP_REPS:-100}" \
      --cache-dir "$cache/torch" ${SWEEP_ARGS:-} >> "$out/sweep.jsonl" 2>> "$out/sweep-torch.err" ||
      echo "sweep.sh: torch exited $? (see $out/sweep-torch.err)" >&2
  fi
done
grep -h '"error"' "$out/sweep.jsonl" | tail -20
python3 benchmarks/sweep_report.py "$out/sweep.jsonl" --png-dir "$out"
