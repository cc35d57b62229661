#!/usr/bin/env bash
# On a GPU machine: builds kiln's benchmarks, runs kiln and PyTorch (eager, torch.compile) in the
# same run on the same GPU, and writes benchmarks/RESULTS.md (and a PNG of the ratios).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > "$out/bench-build.log" 2>&1 &&
  cmake --build build --target bench -j "$(nproc)" >> "$out/bench-build.log" 2>&1 || { tail -30 "$out/bench-build.log"; exit 1; }
# W10 and W11 count compiles: fresh processes on empty caches, three times (compile times on the
# lent machines vary up to 10x between processes; the report keeps the median). W11: cold compile;
# W11w: a second process on the now warm cache, timed from just before its start; W10 on its own
# cache, so no kernel of another workload (W4 compiles the same layer_norm kernels) is found.
for i in 1 2 3; do
  w11_cache=$(mktemp -d)
  KILN_CACHE_DIR=$w11_cache build/benchmarks/bench --only W11
  KILN_CACHE_DIR=$w11_cache KILN_BENCH_T0=$(date +%s%N) build/benchmarks/bench --only W11
  KILN_CACHE_DIR=$(mktemp -d) build/benchmarks/bench --only W10
done | grep -v '"env"' > "$out/kiln.jsonl"
KILN_CACHE_DIR=$(mktemp -d) build/benchmarks/bench --skip W10,W11 ${KILN_BENCH_ARGS:-} >> "$out/kiln.jsonl"
# BENCH_MAX=1 adds torch.compile's max-autotune mode (minutes of autotuning) for the table that
# compares it with kiln's .autotune; without it that table shows kiln's two modes only.
max_args=$([ "${BENCH_MAX:-0}" = 1 ] && echo --max-autotune)
PYTHONUNBUFFERED=1 python3 benchmarks/torch_peer.py $max_args ${TORCH_BENCH_ARGS:-} > "$out/torch.jsonl" 2> "$out/torch.err"
python3 benchmarks/report.py "$out/torch.jsonl" "$out/kiln.jsonl" benchmarks/RESULTS.md
{ echo; echo "## Compile time of user code (this machine)"; echo; benchmarks/compile_times.sh; } >> benchmarks/RESULTS.md
# BENCH_W14=1 adds the GPT-2 training step (benchmarks/w14.sh, about 6 minutes) as raw summary lines.
if [ "${BENCH_W14:-0}" = 1 ]; then
  { echo; echo "## W14: GPT-2 small training step (benchmarks/w14.sh)"; echo; echo '```'; benchmarks/w14.sh; echo '```'; } >> benchmarks/RESULTS.md
fi
cat "$out/kiln.jsonl"
