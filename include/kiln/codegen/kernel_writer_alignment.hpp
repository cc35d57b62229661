// A kernel's contiguous tiles and their alignment: when every tile starts on a 16-byte vector
// whenever the kernel's pointers are aligned (and, with Tuning::aligned_sizes, its program sizes are
// multiples of a vector), the kernel tests that once and runs a body without an alignment test at
// each access (access_base in kernel_writer_access.hpp marks such accesses KILN_ALIGNED).
#pragma once
#include <algorithm>
#include <sstream>

#include "kernel_writer.hpp"

namespace kiln::codegen {

// With Tuning::aligned_sizes: whether a tile at `base` starts on a vector of m elements whenever the
// program's sizes are multiples of m (each size taken as a multiple of 16 elements, the most a
// vector holds); if so the sizes it needs join the kernel's test (split_on_alignment).
inline bool KernelWriter::aligned_at_sizes(const Sym& base, std::int64_t m, int start, std::int64_t vec) {
  if (tune_.aligned_sizes != 1) return false;
  const std::vector<std::int64_t> multiples(env_.example.size(), 16);
  Assumptions sizes{&multiples, m, {}};
  if (!multiple_of(base, m, start, vec, &sizes)) return false;
  for (const Sym& size : sizes.used) {
    auto at = std::find_if(aligned_sizes_.begin(), aligned_sizes_.end(), [&](const auto& a) { return a.first == size; });
    if (at == aligned_sizes_.end())
      aligned_sizes_.emplace_back(size, m);
    else
      at->second = std::max(at->second, m);
  }
  return true;
}

// When the kernel's tiles cover its domain exactly (no bounds tests), or its held rows are whole
// vectors that its tiles overrun (one test a vector), and every contiguous tile starts on a vector:
// the body twice, both without an alignment test at each access. With 16-byte aligned pointers
// whole vectors move with no branch at all; otherwise (offset or foreign buffers) element
// by element. Other kernels keep one body that tests each access (with bounds tests left the split
// measured slower). A Tuning's aligned = 0 (KILN_TUNE_ALIGNED=0) keeps the tests everywhere.
inline std::string KernelWriter::split_on_alignment(const std::string& body) {
  // Held rows of whole vectors whose tiles overrun them: one test a vector, and the split pays
  // (with only a row's test left it measured 2-7% slower, and for looped rows 3% slower over 40
  // long rows, up to 1.9x at 1046 x 128256 bf16: NOTES item 51).
  // Rows that start on vectors without a shift (buffers with room for a GEMM) end in a part vector
  // as shifted rows do: the same split.
  bool vector_tests =
      (vector_rows_ && !full_tiles_ && config_.riters > 0 && tune_.vector_masks != 1) || row_shift_ || rows_on_vectors_;
  if (aligned_ptrs_.empty() || unaligned_tiles_ || !(exact_tiles_ || vector_tests || !aligned_sizes_.empty()) ||
      tune_.aligned == 0) {
    std::string plain = body;
    auto replace_all = [&](const std::string& mark, const std::string& by) {
      for (auto at = plain.find(mark); at != std::string::npos; at = plain.find(mark, at))
        plain.replace(at, mark.size(), by);
    };
    replace_all(", KILN_ALIGNED>", ">");
    replace_all(", KILN_ALIGNED,", ", kiln::align::test,");
    return plain;
  }
  std::string ptrs, sizes, indented;
  for (const auto& p : aligned_ptrs_) ptrs += (ptrs.empty() ? "" : ", ") + p;
  for (const auto& [size, m] : aligned_sizes_) sizes += " && " + index_code(size) + " % " + std::to_string(m) + " == 0";
  std::istringstream in(body);
  for (std::string l; std::getline(in, l);) indented += (l.empty() ? "" : "  ") + l + "\n";
  return std::string(
             "  auto kiln_body = [&](auto kiln_aligned) {\n"
             "    constexpr kiln::align KILN_ALIGNED = decltype(kiln_aligned)::value ? kiln::align::vector : "
             "kiln::align::scalar;\n") +
         indented + "  };\n  if (kiln::aligned16(" + ptrs + ")" + sizes +
         ") kiln_body(kiln::bool_c<true>{});\n  else kiln_body(kiln::bool_c<false>{});\n";
}

}  // namespace kiln::codegen
