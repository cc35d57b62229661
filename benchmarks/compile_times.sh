#!/usr/bin/env bash
# User compile time is a product feature: g++ -O2 seconds (one core) for a TU that only includes
# <kiln/kiln.hpp>, for examples/quickstart.cpp and examples/train_mlp.cpp, and for the value_and_grad
# MLP+layer_norm+cross_entropy TU. Prints a markdown table (benchmarks/run.sh appends it to RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
cxx=${CXX:-g++}
flags="-std=c++20 -O2 -I include -I /usr/local/cuda/include"
tmp=$(mktemp -d)
echo '#include <kiln/kiln.hpp>' > "$tmp/include_only.cpp"
measure() {  # file -> seconds of user+sys CPU time
  local t0 t1
  /usr/bin/time -f "%U %S" -o "$tmp/t" $cxx $flags -c "$1" -o "$tmp/o.o" 2>/dev/null
  awk '{printf "%.1f", $1 + $2}' "$tmp/t"
}
echo "| translation unit (g++ -O2, one core, $($cxx --version | head -1)) | seconds |"
echo "|---|---|"
echo "| \`#include <kiln/kiln.hpp>\` only | $(measure "$tmp/include_only.cpp") |"
echo "| examples/quickstart.cpp | $(measure examples/quickstart.cpp) |"
echo "| examples/train_mlp.cpp | $(measure examples/train_mlp.cpp) |"
echo "| benchmarks/compile_time_autodiff.cpp (value_and_grad of MLP + layer_norm + cross_entropy) | $(measure benchmarks/compile_time_autodiff.cpp) |"
rm -rf "$tmp"
