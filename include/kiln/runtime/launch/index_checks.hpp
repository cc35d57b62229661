// Index checks (options.check_indices: on by default on the CPU, off on CUDA where a check costs a
// synchronisation): an embedding's ids are read back and checked against its table's rows right
// after they exist — before the first kernel, or after the kernel that computes them — so that the
// kernels reading them never run on a bad id and the outputs stay untouched. Without checks a bad
// id reads zeros (and contributes nothing to the gradient), never memory outside the table.
#pragma once
#include <algorithm>
#include <string>
#include <vector>

#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../graph/graph.hpp"
#include "../../schedule/fuse.hpp"

namespace kiln::runtime {

struct IndexCheck {
  int ids = -1, table = -1;  // nodes
  int after_kernel = -1;     // checked once this kernel has run (-1: before the first)
};

inline std::vector<IndexCheck> plan_index_checks(const graph::Graph& g, const schedule::Schedule& s) {
  std::vector<IndexCheck> checks;
  for (const auto& n : g.nodes)
    if (n.op == Op::embedding) {
      const int ids = n.in[1];
      bool seen = false;
      for (const auto& c : checks) seen = seen || c.ids == ids;
      if (!seen) checks.push_back({ids, n.in[0], g[ids].op == Op::arg ? -1 : s.kernel_of[ids]});
    }
  return checks;
}

// Throws a shape_error naming the first id outside [0, rows) and its position.
inline void check_ids(const Tensor& ids, std::int64_t rows, CUstream stream) {
  const Tensor host = ids.device().is_cpu() ? ids.contiguous() : ids.to(cpu, Stream(stream));
  const std::int64_t n = host.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto v = static_cast<std::int64_t>(load_as_double(host.data_ptr(), host.dtype(), i));
    if (v >= 0 && v < rows) continue;
    Dims at = ids.shape();  // the row-major position of element i
    for (std::int64_t d = at.size() - 1, rest = i; d >= 0; --d) {
      const std::int64_t size = std::max<std::int64_t>(ids.shape()[static_cast<int>(d)], 1);
      at[static_cast<int>(d)] = rest % size;
      rest /= size;
    }
    throw shape_error("embedding: id " + std::to_string(v) + " at position " + at.str() + " of ids " +
                      ids.shape().str() + " is outside the table's " + std::to_string(rows) + " rows");
  }
}

}  // namespace kiln::runtime
