#!/usr/bin/env bash
# The CPU benchmark (issue 23, BENCHMARKS.md row "cpu"): kiln's cpu_bench and PyTorch's CPU backend
# (benchmarks/cpu_peer.py: eager and torch.compile) on the same cores in one run, at each thread
# count of CPU_THREADS (default: 2 and every core), then a table of kiln / torch.compile per
# workload with the geometric mean. Where torch is not installed, kiln's side alone.
# Writes $OUT (default build/cpu-bench)/{kiln,torch}-<threads>.jsonl and report.md.
# Usage: benchmarks/cpu.sh [reps] [only-ids]      (e.g. benchmarks/cpu.sh 10 cpu-W1,cpu-W3)
# CPU_BENCH=path uses a cpu_bench binary built already; CPU_THREADS="2 16" picks the thread counts.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/cpu-bench}
reps=${1:-10}
only=${2:-}
mkdir -p "$out"
bench=${CPU_BENCH:-}  # a cpu_bench built already (e.g. by hand on a lent machine), else built here
if [[ -z $bench ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build build -j "$(nproc)" --target cpu_bench >/dev/null ||
    { echo "cpu.sh: building cpu_bench failed" >&2; exit 1; }
  bench=build/benchmarks/cpu_bench
fi
have_torch=0
python3 -c "import torch" 2>/dev/null && have_torch=1
threads=${CPU_THREADS:-"2 $(nproc)"}
for t in $threads; do
  echo "== $t threads" >&2
  OMP_NUM_THREADS=$t "$bench" "$reps" "$only" | tee "$out/kiln-$t.jsonl"
  if ((have_torch)); then
    OMP_NUM_THREADS=$t python3 benchmarks/cpu_peer.py --reps "$reps" --threads "$t" ${only:+--only "$only"} |
      tee "$out/torch-$t.jsonl"
  fi
done
python3 - "$out" $threads <<'PY' | tee "$out/report.md"
import json, math, os, sys
out, threads = sys.argv[1], sys.argv[2:]

def rows(path):
    r = {}
    if os.path.exists(path):
        for line in open(path):
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if "ms" in o:
                r[(o["id"], o["impl"])] = o
    return r

for t in threads:
    k, p = rows(f"{out}/kiln-{t}.jsonl"), rows(f"{out}/torch-{t}.jsonl")
    ids = [i for (i, impl) in k if impl == "kiln"]
    print(f"\n### {t} threads\n")
    print("| workload | kiln ms | torch.compile ms | eager ms | kiln / torch.compile |")
    print("|---|---|---|---|---|")
    ratios, earlier = [], []  # earlier: the set of runs before cpu-W1d (forty-second session)
    for i in ids:
        kn, tc, ea = k[(i, "kiln")], p.get((i, "torch.compile")), p.get((i, "eager"))
        ratio = kn["ms"] / tc["ms"] if tc else None
        if ratio and i != "cpu-W11":
            ratios.append(ratio)
            if i != "cpu-W1d":
                earlier.append(ratio)
        fmt = lambda o: f"{o['ms']:.3f}" if o else "—"
        print(f"| {i} {kn.get('note', '')} | {kn['ms']:.3f} | {fmt(tc)} | {fmt(ea)} | "
              f"{f'{ratio:.2f}' if ratio else '—'} |")
    if ("cpu-W2", "blas") in k:
        print(f"\nthe GEMM alone: kiln's BLAS {k[('cpu-W2', 'blas')]['ms']:.3f} ms"
              + (f", torch.mm {p[('cpu-W2', 'blas')]['ms']:.3f} ms" if ("cpu-W2", "blas") in p else ""))
    if ratios:
        print(f"\ngeometric mean kiln / torch.compile (W11 apart): "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} workloads"
              + (f" ({math.exp(sum(map(math.log, earlier)) / len(earlier)):.3f} without cpu-W1d, the set of "
                 f"earlier runs)" if len(earlier) < len(ratios) else ""))
PY
