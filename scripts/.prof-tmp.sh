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
echo "default: $($B --only W1,W1b,W1c,W3,W3b,W4,W5,W6,W7,W8 2>&1 | summ)"
ncu -k regex:kiln -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats $B --only W6 > $OUT/ncu_w6.txt 2>&1
ncu -k regex:kiln -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats $B --only W1b > $OUT/ncu_w1b.txt 2>&1
ncu -k regex:kiln -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats $B --only W1c > $OUT/ncu_w1c.txt 2>&1
for f in w6 w1b w1c; do echo "== $f"; grep -E "kiln_|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Block Size|Grid Size|Stall|Warp Cycles Per Issued" $OUT/ncu_$f.txt | head -24; done
mkdir -p $OUT/src; KILN_DEBUG_DIR=$OUT/src KILN_CACHE_DIR=$(mktemp -d) $B --only W6,W1c > /dev/null 2>&1; ls $OUT/src | head
