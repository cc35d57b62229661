set -u
export OUT
bash scripts/gpu-check 2>&1 | tail -8
grep -E "custom_op \(cuda\)|FAILED" $OUT/ctest.log | head -5
cmake --build build --target bench -j16 > $OUT/bench-build.log 2>&1 || tail -20 $OUT/bench-build.log
B=build/benchmarks/bench
summ() { python3 -c 'import sys,json
for l in sys.stdin:
  try: r=json.loads(l)
  except: continue
  if "ms" in r: print(r["id"], r["ms"], end="  ")'; echo; }
for cfg in "256 4" "256 2" "256 8" "128 4" "512 2" "512 4" "128 8"; do set -- $cfg
  echo "poi threads=$1 unroll=$2: $(KILN_TUNE_POI_THREADS=$1 KILN_TUNE_POI_UNROLL=$2 KILN_CACHE_DIR=$(mktemp -d) $B --only W1,W1b,W8,W1c 2>&1 | summ)"
done
