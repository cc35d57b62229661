// What callers of the lowering driver (lower.hpp) see: what lowering records (LoweringStats), how
// the entry points take an argument slot's tensor (ArgRef) and lower_graph's declaration, apart
// from the passes so that a TU built with KILN_SEPARATE_COMPILATION sees them without the pipeline.
#pragma once
#include "../core/linkage.hpp"
#include "../core/tensor.hpp"
#include "../core/tuning.hpp"
#include "../graph/graph.hpp"

namespace kiln::runtime {

// What lowering recorded: op counts for k::explain, and the tuning it read from the environment
// (core/tuning.hpp), which the program built from the graph carries.
struct LoweringStats {
  int ops_captured = 0;
  int ops_decomposed = 0;
  Tuning tuning;
  bool for_gpu = false;   // set by the caller: lower for a GPU whatever the arguments' devices
                          // (k::export_kernels plans CUDA programs from CPU tensors)
  bool symbolic = false;  // set by the caller: the program will have symbolic sizes (split sums
                          // then read through zero-padded chunks at any length: schedule/split.hpp)
};

// An argument slot's tensor, as the entry points take it.
using ArgRef = FunctionRef<const Tensor&(int)>;

// The captured graph -> the primitive graph a program is built from (inference, decomposition,
// `transform` (a function's autodiff), simplification): an entry point, defined in lower.hpp.
KILN_DECL graph::Graph lower_graph(graph::Graph g, ArgRef arg, FunctionRef<graph::Graph(graph::Graph)> transform,
                                   LoweringStats& stats);

}  // namespace kiln::runtime
