#!/usr/bin/env bash
# User compile time is a product feature: g++ -O2 seconds (one core) for a TU that only includes
# <kiln/kiln.hpp>, for examples/quickstart.cpp and examples/train_mlp.cpp, and for the value_and_grad
# MLP+layer_norm+cross_entropy TU, header-only and with KILN_SEPARATE_COMPILATION (the runtime
# compiled once, in <kiln/src.hpp>'s TU, measured too). Prints a markdown table (benchmarks/run.sh
# appends it to RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=${CXX:-g++}
flags="-std=c++20 -O2 -I include -I /usr/local/cuda/include"
tmp=$(mktemp -d)
echo '#include <kiln/kiln.hpp>' > "$tmp/include_only.cpp"
echo '#include <kiln/src.hpp>' > "$tmp/src.cpp"
measure() {  # file [extra flags] -> seconds of user+sys CPU time
  /usr/bin/time -f "%U %S" -o "$tmp/t" $cxx $flags ${2:-} -c "$1" -o "$tmp/o.o" 2>/dev/null
  awk '{printf "%.1f", $1 + $2}' "$tmp/t"
}
both() { echo "| $1 | $(measure "$2") | $(measure "$2" -DKILN_SEPARATE_COMPILATION) |"; }
echo "| translation unit (g++ -O2, one core, $($cxx --version | head -1)) | header-only s | KILN_SEPARATE_COMPILATION s |"
echo "|---|---|---|"
both "\`#include <kiln/kiln.hpp>\` only" "$tmp/include_only.cpp"
both "examples/quickstart.cpp" examples/quickstart.cpp
both "examples/train_mlp.cpp" examples/train_mlp.cpp
both "benchmarks/compile_time_autodiff.cpp (value_and_grad of MLP + layer_norm + cross_entropy)" benchmarks/compile_time_autodiff.cpp
echo "| \`<kiln/src.hpp>\` (the runtime, once a program) | — | $(measure "$tmp/src.cpp" -DKILN_SEPARATE_COMPILATION) |"
rm -rf "$tmp"
