#!/usr/bin/env bash
# W14 on a GPU machine: a GPT-2 small training step in kiln (examples/gpt2, plain launches and
# --graphs) and in PyTorch
# (benchmarks/gpt2_peer.py: eager and torch.compile) in the same run, then the check of kiln's first
# 10 losses against PyTorch's from the same weights. Needs a configured build/ (benchmarks/run.sh
# makes one); prints the summary lines, logs under $OUT (or build/bench). About 6 minutes on an H100,
# most of it compiling (kiln's first step about 3 minutes cold, torch.compile's about 35 s).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
cmake --build build --target gpt2 -j "$(nproc)" > "$out/w14-build.log" 2>&1 || { tail -20 "$out/w14-build.log"; exit 1; }
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-$(mktemp -d)}
build/examples/gpt2 --steps 12 > "$out/w14-kiln.log" 2>&1
grep -E "^(first step|tokens/s|peak memory|loss:|kernels a step)" "$out/w14-kiln.log" | sed 's/^/kiln: /'
# The same step replayed from CUDA graphs (.cuda_graphs), the like-with-like row beside
# torch.compile-ro; W14_GRAPHS=0 skips it.
if [ "${W14_GRAPHS:-1}" != 0 ]; then
  build/examples/gpt2 --steps 12 --graphs > "$out/w14-kiln-graphs.log" 2>&1
  grep -E "^(tokens/s|peak memory|loss:)" "$out/w14-kiln-graphs.log" | sed 's/^/kiln --graphs: /'
fi
# --profile after the timed steps: torch.profiler's kernel table (stderr) and launches a step,
# beside kiln's "kernels a step" (issue 21's kernels per layer).
# W14_MODES: torch.compile-ro replays from CUDA graphs as kiln does; torch.compile-max (max-autotune)
# tunes its GEMMs at the first step (minutes, maybe more than a device call), so it is asked for alone.
PYTHONUNBUFFERED=1 python3 benchmarks/gpt2_peer.py --modes "${W14_MODES:-eager,torch.compile,torch.compile-ro}" \
  --steps 12 --profile 20 \
  2> "$out/w14-torch.err" | tee "$out/w14-torch.jsonl"
grep -E "^torch profile" "$out/w14-torch.err"
python3 benchmarks/gpt2_peer.py --write-check "$out/w14-check" > "$out/w14-check.log" 2>&1 &&
  build/examples/gpt2 --check "$out/w14-check" >> "$out/w14-check.log" 2>&1
grep -E "^check:" "$out/w14-check.log" || echo "check: did not run (see $out/w14-check.log)"
