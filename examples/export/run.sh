#!/bin/sh
# Exports residual + rms_norm with kiln, builds the exported code with plain nvcc (no kiln) and
# checks it against kiln's result on the GPU. Usage: examples/export/run.sh [build-dir]
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out="$build/exported"
cmake --build "$build" --target export_kernels
"$build/examples/export_kernels" "$out"
nvcc -std=c++17 -arch=native -I"$out" "$here/check.cu" "$out/residual_rms_norm.cu" -o "$out/check_exported"
"$out/check_exported" "$out"
