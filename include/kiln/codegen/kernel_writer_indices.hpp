// A kernel's indices: the domain's and a row value's, in the kernel's tile symbols, and the width
// of its index arithmetic: int where every index it forms fits in 32 bits
// (KernelWriter::narrow_indices), else i64.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernel_writer.hpp"

namespace kiln::codegen {

inline std::vector<Sym> KernelWriter::domain_index() {
  const auto& p = env_[plan_.domain];
  if (!rows()) return tile_dim_ >= 0 || probe_ ? tiled_index() : col_tiles_ ? col_index() : unravel(xindex_, detail::nonzero(p));
  std::vector<Sym> kept, red;
  for (int i = 0; i < static_cast<int>(p.size()); ++i)
    (std::find(plan_.rdims.begin(), plan_.rdims.end(), i) != plan_.rdims.end() ? red : kept).push_back(p[i]);
  auto xi = unravel(kept_flat(), detail::nonzero(kept)), ri = unravel(rindex_, detail::nonzero(red));
  std::vector<Sym> idx;
  std::size_t a = 0, b = 0;
  for (int i = 0; i < static_cast<int>(p.size()); ++i)
    idx.push_back(std::find(plan_.rdims.begin(), plan_.rdims.end(), i) != plan_.rdims.end() ? ri[b++] : xi[a++]);
  return idx;
}

// The index of a row-level node (shape = the kept dims, with or without keepdim's 1s).
inline std::vector<Sym> KernelWriter::row_index(int node) { return unravel(kept_flat(), detail::nonzero(env_[node])); }

// Whether every index this kernel forms fits in 32 bits, so that its index arithmetic (the
// kernel's `ix`) is int: on the GPU a 64-bit division or remainder by a constant is several 32-bit
// multiplies, and kernels whose indices go through permuted heads, slices or pads were bound by
// them (Inductor indexes in int32 likewise). GPU only, with the domain, every node the kernel
// computes (an iota's or a view's positions) and every buffer it touches (a strided argument's
// reach, column partials' row groups) at most 2^30 elements: an index is a sum of terms each within
// one of them, and masked lanes past the end stay below twice that. Symbolic sizes are taken at the
// compiling call's values (index_bound_: the program then guards its sizes, ProgramCache), where a
// division by a size parameter is otherwise a 64-bit division. Otherwise i64, as on the CPU.
inline bool KernelWriter::narrow_indices() {
  index_bound_ = false;
  if (target_ != Target::cuda || tune_.index32 == 0 || (!sizes_.empty() && tune_.index32 == 1)) return false;
  constexpr std::int64_t limit = index32_limit;
  const std::vector<std::int64_t>& example = env_.example;
  auto value = [&](const Sym& s) { return s.is_constant() ? s.constant_value() : s.eval(example); };
  auto within = [&](const std::vector<Sym>& shape, const std::vector<Sym>& strides, std::int64_t copies) {
    std::int64_t reach = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::int64_t n = value(shape[d]), st = value(strides[d]);
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
  index_bound_ = !sizes_.empty();
  return true;
}

// What a kernel's int indices rely on at other sizes (KernelSource::index_nodes, index_span): the
// nodes it touches, and the span its programs' indices cover, rows or elements past the end
// included (a block of ROWS rows over a row of rnumel; tiles as four times the domain).
inline void KernelWriter::note_index_bound(KernelSource& ks) const {
  ks.index_bound = index_bound_;
  if (!index_bound_) return;
  ks.index_nodes = {plan_.domain};
  ks.index_nodes.insert(ks.index_nodes.end(), plan_.members.begin(), plan_.members.end());
  for (const Param& pr : params_)
    if (pr.kind == Param::in_ptr || pr.kind == Param::out_ptr) ks.index_nodes.push_back(pr.ref);
  if (rows())
    ks.index_span = {(col_tiles_ ? kept_tiles_xnumel() : xnumel_) + Sym(config_.rows),  // (by kept rows: padded)
                     rnumel_ + Sym(std::int64_t{config_.rvec} * config_.row_threads * std::max(1, config_.riters))};
  else if (tile_dim_ >= 0 || col_tiles_)
    ks.index_span = {xnumel_, Sym(4)};
  else
    ks.index_span = {xnumel_ + Sym(config_.xblock), Sym(1)};
}

}  // namespace kiln::codegen
