set -u
export KILN_CACHE_DIR=$PWD/build/kc
(cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > $OUT/cfg.log 2>&1 && cmake --build build -j16 --target bench > $OUT/build.log 2>&1) || { tail -40 $OUT/build.log; exit 1; }
B=build/benchmarks/bench
summ() { python3 -c 'import sys,json
for l in sys.stdin:
  try: r=json.loads(l)
  except: continue
  if "ms" in r: print(r["id"], r["ms"], r.get("note",""), end="  ")
  elif "error" in r: print(r["id"], "ERR", r["error"][:80], end="  ")'; echo; }
echo "default: $($B --only W5,W7,W3b,W12 2>&1 | summ)"
for e in 16 8; do echo "ROW_ELEMS=$e: $(KILN_TUNE_ROW_ELEMS=$e KILN_CACHE_DIR=$(mktemp -d) $B --only W5 2>&1 | summ)"; done
echo "ROW_THREADS=512: $(KILN_TUNE_ROW_THREADS=512 KILN_CACHE_DIR=$(mktemp -d) $B --only W7,W3b 2>&1 | summ)"
ncu -k regex:kiln -c 3 --section SpeedOfLight --section LaunchStats --section Occupancy $B --only W5 > $OUT/ncu_w5.txt 2>&1
KILN_TUNE_ROW_ELEMS=8 ncu -k regex:kiln -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy $B --only W5 > $OUT/ncu_w5_8.txt 2>&1
grep -E "kiln_|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Block Size|Grid Size" $OUT/ncu_w5.txt $OUT/ncu_w5_8.txt | head -40
