#!/usr/bin/env bash
# On a GPU machine: builds kiln's benchmarks, runs kiln and PyTorch (eager, torch.compile) in the
# same run on the same GPU, and writes benchmarks/RESULTS.md (and a PNG of the ratios).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > "$out/bench-build.log" 2>&1 &&
  cmake --build build --target bench -j "$(nproc)" >> "$out/bench-build.log" 2>&1 || { tail -30 "$out/bench-build.log"; exit 1; }
# W11: cold compile in a fresh process with an empty cache, then the rest.
w11_cache=$(mktemp -d)
KILN_CACHE_DIR=$w11_cache build/benchmarks/bench --only W11 > "$out/kiln.jsonl"
# W11w: a second process on the now warm cache, timed from just before its start.
KILN_CACHE_DIR=$w11_cache KILN_BENCH_T0=$(date +%s%N) build/benchmarks/bench --only W11 >> "$out/kiln.jsonl"
KILN_CACHE_DIR=$(mktemp -d) build/benchmarks/bench ${KILN_BENCH_ARGS:-} | grep -v '"W11"' >> "$out/kiln.jsonl"
PYTHONUNBUFFERED=1 python3 benchmarks/torch_peer.py ${TORCH_BENCH_ARGS:-} > "$out/torch.jsonl" 2> "$out/torch.err"
python3 benchmarks/report.py "$out/torch.jsonl" "$out/kiln.jsonl" benchmarks/RESULTS.md
{ echo; echo "## Compile time of user code (this machine)"; echo; benchmarks/compile_times.sh; } >> benchmarks/RESULTS.md
cat "$out/kiln.jsonl"
