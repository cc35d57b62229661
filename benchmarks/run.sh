#!/usr/bin/env bash
# On a GPU machine: builds kiln's benchmarks, runs kiln and PyTorch (eager, torch.compile, and
# torch.compile over forward and backward as one graph for W5, W7, W12) in the same run on the same
# GPU, and writes benchmarks/RESULTS.md (and a PNG of the ratios).
# KILN_COMMIT names the code measured where this copy has no git history (git rev-parse otherwise).
# BENCH_STAGES picks the stages (default all: "kiln torch report"), so that a run can be split over
# several commands on one machine; OUT (default build/bench) must then be a folder they share.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/bench}
mkdir -p "$out"
stage() { [[ " ${BENCH_STAGES:-kiln torch report} " == *" $1 "* ]]; }
if stage kiln; then
  # What is measured, for RESULTS.md's header (report.py --env): kiln's commit (with a flag when
  # tracked files differ from it), the GPU and its driver, nvcc, torch and triton.
  python3 - > "$out/env.json" <<'PY'
import importlib.metadata, json, os, re, shutil, subprocess, time

def output(*cmd):
    """The command's stdout, or "" when it is missing or fails."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""

def version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""

env = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": version("torch"), "triton": version("triton")}
env["commit"] = os.environ.get("KILN_COMMIT") or output("git", "rev-parse", "--short", "HEAD")
if not os.environ.get("KILN_COMMIT") and env["commit"]:
    env["uncommitted"] = bool(output("git", "status", "--porcelain", "--untracked-files=no"))
gpus = output("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader").splitlines()
if gpus:
    env["gpu"], env["driver"] = (field.strip() for field in gpus[0].rsplit(",", 1))
    env["gpus"] = len(gpus)
# "Cuda compilation tools, release 13.0, V13.0.88" -> "13.0 (V13.0.88)"
m = re.search(r"release ([\d.]+), (V[\w.]+)", output(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--version"))
env["nvcc"] = f"{m.group(1)} ({m.group(2)})" if m else ""
print(json.dumps(env))
PY
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_BUILD_TESTS=OFF > "$out/bench-build.log" 2>&1 &&
    cmake --build build --target bench -j "$(nproc)" >> "$out/bench-build.log" 2>&1 || { tail -30 "$out/bench-build.log"; exit 1; }
  # W10 and W11 count compiles: fresh processes on empty caches, three times (compile times on the
  # lent machines vary up to 10x between processes; the report keeps the median; torch_peer.py runs
  # its own W10 and W11 the same way). W11: cold compile; W11w: a second process on the now warm
  # cache, timed from just before its start; W10 on its own cache, so no kernel of another workload
  # (W4 compiles the same layer_norm kernels) is found.
  for i in 1 2 3; do
    w11_cache=$(mktemp -d)
    KILN_CACHE_DIR=$w11_cache build/benchmarks/bench --only W11
    KILN_CACHE_DIR=$w11_cache KILN_BENCH_T0=$(date +%s%N) build/benchmarks/bench --only W11
    KILN_CACHE_DIR=$(mktemp -d) build/benchmarks/bench --only W10
  done | grep -v '"env"' > "$out/kiln.jsonl"
  KILN_CACHE_DIR=$(mktemp -d) build/benchmarks/bench --skip W10,W11 ${KILN_BENCH_ARGS:-} >> "$out/kiln.jsonl"
fi
if stage torch; then
  # BENCH_MAX=1 adds torch.compile's max-autotune mode (minutes of autotuning) for the table that
  # compares it with kiln's .autotune; without it that table shows kiln's two modes only.
  max_args=$([ "${BENCH_MAX:-0}" = 1 ] && echo --max-autotune)
  PYTHONUNBUFFERED=1 python3 benchmarks/torch_peer.py $max_args ${TORCH_BENCH_ARGS:-} > "$out/torch.jsonl" 2> "$out/torch.err"
fi
if stage report; then
  python3 benchmarks/report.py "$out/torch.jsonl" "$out/kiln.jsonl" benchmarks/RESULTS.md --env "$out/env.json"
  { echo; echo "## Compile time of user code (this machine)"; echo; benchmarks/compile_times.sh; } >> benchmarks/RESULTS.md
  # BENCH_W14=1 adds the GPT-2 training step (benchmarks/w14.sh, about 6 minutes) as raw summary lines.
  if [ "${BENCH_W14:-0}" = 1 ]; then
    { echo; echo "## W14: GPT-2 small training step (benchmarks/w14.sh)"; echo; echo '```'; benchmarks/w14.sh; echo '```'; } >> benchmarks/RESULTS.md
  fi
  cat "$out/kiln.jsonl"
fi
