// Column partial sums inside row kernels. A bias or weight gradient (dw, db of layer_norm) is a sum
// over rows of values a row kernel already holds (x, dy, the row's mean and rstd); split.hpp makes
// it two stages, and unfused its first stage re-reads every full-size input. Here that first stage
// moves into the row kernel: each program keeps one partial sum per column of the rows it visits,
// in registers, and writes them once at its end; the launch has exactly partial_groups programs.
// Measured motive: a separate first stage re-read x and dy, a third of a layer_norm backward's
// time (benchmarks/NOTES.md).
#pragma once
#include <algorithm>

#include "../ir/shape_env.hpp"
#include "fuse.hpp"
#include "split.hpp"

namespace kiln::schedule {

namespace detail {

// The 2-D [N, K] input of first-stage reduction r ([S, R, K] summed over R, S * R = N, or
// zero-padded: S * R >= N), or -1: what a row kernel over that input can sum as column partials.
// N and K may be symbolic where `any_rows` (a GPU's row kernel: its S programs visit the rows in
// turn, whatever their number, and keep their sums in registers where they hold the row, else in
// the output: codegen's write_rows), else static (the host's programs take R consecutive rows
// each, holding them).
inline int partial_input(const graph::Graph& g, const ir::ShapeEnv& env, int r, bool any_rows = false) {
  const graph::Node& red = g[r];
  const graph::Node& view = g[red.in[0]];
  if (red.op != Op::sum || view.op != Op::reshape || view.shape.size() != 3) return -1;
  if (reduce_dims_of(red, 3) != Dims{1}) return -1;
  int e = view.in[0];
  const Dims& full = g[e].shape;
  if (full.size() != 2 || full[1] != view.shape[2]) return -1;
  const bool padded = view.attrs.keepdim;
  if (!any_rows && (!env[e][0].is_constant() || !env[e][1].is_constant())) return -1;
  if (padded ? full[0] > view.shape[0] * view.shape[1] : full[0] != view.shape[0] * view.shape[1]) return -1;
  return e;
}

// The row kernel before `split` that can compute first-stage reduction r as column partials: its
// rows are the reduction's rows and its row length the kept columns (static), and everything r
// reads is ready by then. -1 when none. On a GPU the row must also fit registers (2048..8192
// columns) and the groups fill the machine (256 or more, one block each). A CPU program keeps its
// partials in arrays over its group's consecutive rows, so any row it holds qualifies (the kernel
// writer says, through partials_held); otherwise the first stage walks down columns, one scalar
// load a lane (layer_norm's backward over 4096x1024: NOTES item 61).
inline int partial_host(const graph::Graph& g, const Schedule& s, const ir::ShapeEnv& env,
                        const std::vector<bool>& anchor, int split, int r, bool host) {
  const graph::Node& red = g[r];
  int e = partial_input(g, env, r, !host);  // prefix split: [S, R, K] summed over R
  if (e < 0) return -1;
  const Dims& full = g[e].shape;
  if (!host && (full[1] < 2048 || full[1] > 8192 || red.shape[0] < 256)) return -1;
  int ready = first_possible_kernel(g, anchor, s.kernel_of, red.in[0]);
  for (int k = split - 1; k >= ready && k >= 0; --k) {
    const KernelPlan& plan = s.kernels[k];
    if (plan.kind == Kind::per && !plan.closed && g[plan.domain].shape == full && plan.rdims == Dims{1} &&
        reads_rows(g, anchor, s.kernel_of, plan, k, e, row_map(full, {}, full)))
      return k;
  }
  return -1;
}

// On the CPU, a first stage no row kernel hosts becomes a row kernel of its own over the input's
// rows, with the sums as its column partials: lanes along the contiguous columns and a loop over
// each group's rows, where the split kernel's lanes read down a column (sum(x, 0) over 4096x1024
// f32: NOTES item 61). Only where a row is at least a cache line: narrower rows share lines, so
// walking down them is a walk through memory. The writer may still find the row too long to hold;
// then partials_held sends the whole graph back to split kernels.
inline constexpr std::int64_t cache_line_bytes = 64;
inline bool own_partials(const graph::Graph& g, const ir::ShapeEnv& env, KernelPlan& split) {
  if (split.reductions.empty() || !split.stores.empty()) return false;
  int domain = -1;
  for (int r : split.reductions) {
    int e = partial_input(g, env, r);
    if (e < 0 || (domain >= 0 && !(g[e].shape == g[domain].shape)) ||
        g[r].shape[0] != g[split.reductions[0]].shape[0] ||
        g[e].shape[1] * static_cast<std::int64_t>(itemsize(g[e].dt)) < cache_line_bytes)
      return false;
    if (domain < 0) domain = e;
  }
  split.kind = Kind::per;
  split.domain = domain;
  split.rdims = Dims{1};
  split.partials = split.reductions;
  split.partial_groups = g[split.reductions[0]].shape[0];
  split.reductions.clear();
  return true;
}

}  // namespace detail

// Moves first stages of split column sums into the row kernels that hold their inputs (above); a
// split kernel left with nothing is dropped; nothing moves unless `allowed`. host: for the CPU,
// where a first stage left over becomes a row kernel with partials of its own (own_partials).
inline void absorb_column_partials(const graph::Graph& g, Schedule& s, const ir::ShapeEnv& env, bool allowed = true,
                                   bool host = false) {
  if (!allowed) return;
  auto anchor = detail::find_anchors(g, s.epilogues);
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    KernelPlan& split = s.kernels[k];
    if (split.kind != Kind::split) continue;
    std::vector<int> kept;
    for (int r : split.reductions) {
      int into = detail::partial_host(g, s, env, anchor, k, r, host);
      if (into < 0 || (s.kernels[into].partial_groups && s.kernels[into].partial_groups != g[r].shape[0])) {
        kept.push_back(r);
        continue;
      }
      s.kernels[into].partials.push_back(r);
      s.kernels[into].partial_groups = g[r].shape[0];
      s.kernel_of[r] = into;
    }
    split.reductions = kept;
    if (host && detail::own_partials(g, env, split)) continue;
    if (!kept.empty() || !split.stores.empty()) continue;
    s.kernels.erase(s.kernels.begin() + k);
    for (auto& of : s.kernel_of)
      if (of > k) --of;
    --k;
  }
}

}  // namespace kiln::schedule
