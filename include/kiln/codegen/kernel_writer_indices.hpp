// The width of a kernel's index arithmetic: int where every index it forms fits in 32 bits
// (KernelWriter::narrow_indices), else i64.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel_writer.hpp"

namespace kiln::codegen {

// Whether every index this kernel forms fits in 32 bits, so that its index arithmetic (the
// kernel's `ix`) is int: on the GPU a 64-bit division or remainder by a constant is several 32-bit
// multiplies, and kernels whose indices go through permuted heads, slices or pads were bound by
// them (Inductor indexes in int32 likewise). Static sizes on the GPU, with the domain and every
// buffer the kernel touches (a strided argument's reach, column partials' row groups) at most 2^30
// elements: an index is a sum of terms each within one of them, and masked lanes past the end
// stay below twice that. Otherwise i64, as on the CPU.
inline bool KernelWriter::narrow_indices() {
  if (target_ != Target::cuda || !sizes_.empty()) return false;
  constexpr std::int64_t limit = std::int64_t{1} << 30;
  auto within = [&](const std::vector<Sym>& shape, const std::vector<Sym>& strides, std::int64_t copies) {
    std::int64_t reach = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      if (!shape[d].is_constant() || !strides[d].is_constant()) return false;
      const std::int64_t n = shape[d].constant_value(), st = strides[d].constant_value();
      if (n == 0) return true;
      if (st < -limit || st > limit || n > limit) return false;
      reach += (n - 1) * (st < 0 ? -st : st);
      if (reach > limit) return false;
    }
    return reach * copies <= limit;
  };
  if (!within(env_[plan_.domain], contiguous_strides(env_[plan_.domain]), 1)) return false;
  // Every node it computes too: an iota's or a rand's positions, a view's, are indices over its own
  // shape (a slice of a large iota is a small kernel forming large indices).
  for (int v : plan_.members)
    if (!within(env_[v], contiguous_strides(env_[v]), 1)) return false;
  for (const Param& pr : params_) {
    if (pr.kind != Param::in_ptr && pr.kind != Param::out_ptr) continue;
    const bool partial = std::find(plan_.partials.begin(), plan_.partials.end(), pr.ref) != plan_.partials.end();
    if (!within(env_[pr.ref], strides_of_(pr.ref), partial ? std::max<std::int64_t>(plan_.partial_groups, 1) : 1))
      return false;
  }
  return true;
}

}  // namespace kiln::codegen
