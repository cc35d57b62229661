#!/usr/bin/env bash
# The CPU benchmark (issue 23, BENCHMARKS.md row "cpu"): kiln's cpu_bench and PyTorch's CPU backend
# (benchmarks/cpu_peer.py: eager and torch.compile) on the same cores in one run, at each thread
# count of CPU_THREADS (default: 2 and every core), then a table of kiln / torch.compile per
# workload with the geometric mean. Where torch is not installed, kiln's side alone.
# Writes $OUT (default build/cpu-bench)/{kiln,torch}-<threads>.jsonl and report.md.
# Usage: benchmarks/cpu.sh [reps] [only-ids]      (e.g. benchmarks/cpu.sh 10 cpu-W1,cpu-W3)
# CPU_BENCH=path uses a cpu_bench binary built already; CPU_THREADS="2 16" picks the thread counts.
# CPU_ROUNDS=N (default 1) runs both sides N times in turn at each thread count: the table then
# gives each side's median over the rounds and the range of the per-round ratios (a VM's times can
# move by 1.4x between runs of the same binary, on both sides alike).
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
rounds=${CPU_ROUNDS:-1}
for t in $threads; do
  : >"$out/kiln-$t.jsonl"
  : >"$out/torch-$t.jsonl"
  for ((r = 1; r <= rounds; ++r)); do
    echo "== $t threads, round $r of $rounds" >&2
    OMP_NUM_THREADS=$t "$bench" "$reps" "$only" | tee -a "$out/kiln-$t.jsonl"
    if ((have_torch)); then
      OMP_NUM_THREADS=$t python3 benchmarks/cpu_peer.py --reps "$reps" --threads "$t" ${only:+--only "$only"} |
        tee -a "$out/torch-$t.jsonl"
    fi
  done
done
python3 - "$out" $threads <<'PY' | tee "$out/report.md"
import json, math, os, sys
out, threads = sys.argv[1], sys.argv[2:]

def rows(path):
    """(id, impl) -> its record, "ms" the median over the rounds and "runs" every round's ms."""
    r = {}
    if os.path.exists(path):
        for line in open(path):
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if "ms" in o:
                r.setdefault((o["id"], o["impl"]), dict(o, runs=[]))["runs"].append(o["ms"])
    for o in r.values():
        runs = sorted(o["runs"])
        mid = len(runs) // 2
        o["ms"] = runs[mid] if len(runs) % 2 else (runs[mid - 1] + runs[mid]) / 2
    return r

for t in threads:
    k, p = rows(f"{out}/kiln-{t}.jsonl"), rows(f"{out}/torch-{t}.jsonl")
    ids = [i for (i, impl) in k if impl == "kiln"]
    print(f"\n### {t} threads\n")
    several = any(len(o["runs"]) > 1 for o in k.values())
    if several:
        print("Medians over the rounds; the last column is the range of the per-round ratios.\n")
    print("| workload | kiln ms | torch.compile ms | eager ms | kiln / torch.compile |" + (" rounds |" if several else ""))
    print("|---|---|---|---|---|" + ("---|" if several else ""))
    ratios, earlier = [], []  # earlier: the set of runs before cpu-W1d (forty-second session)
    for i in ids:
        kn, tc, ea = k[(i, "kiln")], p.get((i, "torch.compile")), p.get((i, "eager"))
        ratio = kn["ms"] / tc["ms"] if tc else None
        if ratio and i != "cpu-W11":
            ratios.append(ratio)
            if i != "cpu-W1d":
                earlier.append(ratio)
        fmt = lambda o: f"{o['ms']:.3f}" if o else "—"
        spread = ""
        if several:
            per_round = [a / b for a, b in zip(kn["runs"], tc["runs"])] if tc else []
            spread = f" {min(per_round):.2f}–{max(per_round):.2f} |" if per_round else " — |"
        print(f"| {i} {kn.get('note', '')} | {kn['ms']:.3f} | {fmt(tc)} | {fmt(ea)} | "
              f"{f'{ratio:.2f}' if ratio else '—'} |" + spread)
    if ("cpu-W2", "blas") in k:
        print(f"\nthe GEMM alone: kiln's BLAS {k[('cpu-W2', 'blas')]['ms']:.3f} ms"
              + (f", torch.mm {p[('cpu-W2', 'blas')]['ms']:.3f} ms" if ("cpu-W2", "blas") in p else ""))
    if ratios:
        print(f"\ngeometric mean kiln / torch.compile (W11 apart): "
              f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} over {len(ratios)} workloads"
              + (f" ({math.exp(sum(map(math.log, earlier)) / len(earlier)):.3f} without cpu-W1d, the set of "
                 f"earlier runs)" if len(earlier) < len(ratios) else ""))
PY
