#!/usr/bin/env bash
# One device call of the several-GPU checks (issue 24), from the repository root on a host with 2+
# GPUs: builds test_distributed, train_mlp_dp, dist_bench and gpt2 with g++ in parallel, then runs
# the two-GPU tests, the data-parallel MLP example, dist_bench (bus bandwidth against ncclAllReduce,
# DP samples/s with and without overlap) and GPT-2 on one GPU and data-parallel on two.
# Logs go to ${OUT:-/tmp/dist_out}. Usage: benchmarks/dist.sh [gpt2 steps]
set -uo pipefail
OUT=${OUT:-/tmp/dist_out}
STEPS=${1:-12}
mkdir -p "$OUT" build-dist
CXX="g++ -std=c++20 -O2 -I include -I /usr/local/cuda/include"
LINK="-L/usr/local/cuda/lib64 -lnvrtc -ldl -lpthread -Wl,-rpath,/usr/local/cuda/lib64"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ldconfig -p | grep -i nccl | head -3
python3 -c "import nvidia.nccl, os; print('torch wheel NCCL:', os.path.dirname(nvidia.nccl.__file__))" 2>/dev/null
t0=$(date +%s)
$CXX -c tests/test_main.cpp -o build-dist/main.o &
$CXX -c tests/test_distributed.cpp -o build-dist/dist.o &
$CXX examples/train_mlp_dp.cpp -o build-dist/train_mlp_dp $LINK &
$CXX benchmarks/dist_bench.cpp -o build-dist/dist_bench $LINK &
$CXX examples/gpt2.cpp -o build-dist/gpt2 $LINK &
wait
g++ build-dist/main.o build-dist/dist.o -o build-dist/test_distributed $LINK || exit 1
echo "built in $(( $(date +%s) - t0 )) s"
export KILN_CACHE_DIR=$PWD/build-dist/kiln-cache
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Each two-GPU case on its own, under a time limit: a hang names its case.
for t in "cuda: two ranks: all_reduce*" "cuda: two ranks: gradients*" "cuda: data_parallel on two GPUs*" \
         "cuda: data_parallel overlapping*"; do
  echo "== test_distributed: $t"
  timeout ${CASE_LIMIT:-60} stdbuf -oL build-dist/test_distributed --test-case="$t" 2>&1 | tail -30
  echo "rc=${PIPESTATUS[0]}"
done
echo "== test_distributed: the rest"; timeout 60 build-dist/test_distributed --test-case-exclude="cuda: *" 2>&1 | tail -3
echo "== train_mlp_dp"; timeout 90 stdbuf -oL build-dist/train_mlp_dp 40 2>&1 | tail -8
echo "== dist_bench"; timeout 150 stdbuf -oL build-dist/dist_bench 2>&1 | tee "$OUT/dist_bench.txt"
[ -n "${SKIP_GPT2_1:-}" ] || { echo "== gpt2, one GPU"; timeout 150 stdbuf -oL build-dist/gpt2 --steps "$STEPS" 2>&1 | tee "$OUT/gpt2_1.txt" | tail -7; }
echo "== gpt2 --gpus 2"; timeout 200 stdbuf -oL build-dist/gpt2 --gpus 2 --steps "$STEPS" 2>&1 | tee "$OUT/gpt2_2.txt" | tail -8
