// Column partial sums inside row kernels. A bias or weight gradient (dw, db of layer_norm) is a sum
// over rows of values a row kernel already holds (x, dy, the row's mean and rstd); split.hpp makes
// it two stages, and unfused its first stage re-reads every full-size input. Here that first stage
// moves into the row kernel: each program keeps one partial sum per column of the rows it visits,
// in registers, and writes them once at its end; the launch has exactly partial_groups programs (on
// a GPU a block each, whose row slots fold their sums together before the store).
// Measured motive: a separate first stage re-read x and dy, a third of a layer_norm backward's
// time (benchmarks/NOTES.md).
#pragma once
#include <algorithm>

#include "../ir/shape_env.hpp"
#include "fuse.hpp"
#include "split.hpp"

namespace kiln::schedule {

namespace detail {

// The [..., K] input of first-stage reduction r, its N rows the leading dims ([S, R, K] summed over
// R, S * R = N, or zero-padded: S * R >= N; GPT-2's [B, T, d] activations), or -1: what a row
// kernel over that input can sum as column partials.
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
  if (full.size() < 2 || full.back() != view.shape[2]) return -1;
  const bool padded = view.attrs.keepdim;
  for (const Sym& d : env[e])
    if (!any_rows && !d.is_constant()) return -1;
  const std::int64_t rows = full.product() / std::max<std::int64_t>(full.back(), 1);
  if (padded ? rows > view.shape[0] * view.shape[1] : rows != view.shape[0] * view.shape[1]) return -1;
  return e;
}

// The row kernel before `split` that can compute first-stage reduction r as column partials: its
// rows are the reduction's rows and its row length the kept columns (static), and everything r
// reads is ready by then. -1 when none. Whether the kernel's rows hold the sums is the kernel
// writer's to say (partials_held): a GPU block a group, its row slots folding their sums at its
// end, within a register budget; a CPU program keeps its partials in arrays over its group's
// consecutive rows, so any row it holds qualifies; otherwise the first stage walks down columns,
// one scalar load a lane (layer_norm's backward over 4096x1024: NOTES item 61). A row kernel after
// the split qualifies too where it may run just before it (reorder.hpp's may_run_before: it reads
// nothing the split or the kernels between compute), as GPT-2's norm backwards, whose dw and db
// sums came first in their layer's plan: the caller moves it there. before: the GPU rule before
// any width was hosted (rows of 2048..8192 columns, 256 groups or more, a row a block, none later).
inline int partial_host(const graph::Graph& g, const Schedule& s, const ir::ShapeEnv& env,
                        const std::vector<bool>& anchor, int split, int r, bool host, bool before = false) {
  const graph::Node& red = g[r];
  int e = partial_input(g, env, r, !host);  // prefix split: [S, R, K] summed over R
  if (e < 0) return -1;
  const Dims& full = g[e].shape;
  if (!host && before && (full.size() != 2 || full[1] < 2048 || full[1] > 8192 || red.shape[0] < 256)) return -1;
  auto hosts = [&](int k) {
    const KernelPlan& plan = s.kernels[k];
    return plan.kind == Kind::per && !plan.closed && g[plan.domain].shape == full &&
           plan.rdims == Dims{full.size() - 1} &&
           reads_rows(g, anchor, s.kernel_of, plan, k, e, row_map(full, {}, full));
  };
  int ready = first_possible_kernel(g, anchor, s.kernel_of, red.in[0]);
  for (int k = split - 1; k >= ready && k >= 0; --k)
    if (hosts(k)) return k;
  if (before) return -1;
  for (int k = split + 1; k < static_cast<int>(s.kernels.size()); ++k)
    if (hosts(k) && may_run_before(g, anchor, s, k, split)) return k;
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
        g[e].shape.back() * static_cast<std::int64_t>(itemsize(g[e].dt)) < cache_line_bytes)
      return false;
    if (domain < 0) domain = e;
  }
  split.kind = Kind::per;
  split.domain = domain;
  split.rdims = Dims{g[domain].shape.size() - 1};
  split.partials = split.reductions;
  split.partial_groups = g[split.reductions[0]].shape[0];
  split.reductions.clear();
  return true;
}

}  // namespace detail

// Moves first stages of split column sums into the row kernels that hold their inputs (above); a
// split kernel left with nothing is dropped. partials: a Tuning's (0: nothing moves; 1: the GPU
// rule before). host: for the CPU, where a first stage left over becomes a row kernel with
// partials of its own (own_partials).
inline void absorb_column_partials(const graph::Graph& g, Schedule& s, const ir::ShapeEnv& env, int partials = -1,
                                   bool host = false) {
  if (partials == 0) return;
  // Every value a kernel computes into a buffer (realize_shared's as well as fusion's anchors):
  // may_run_before must see the kernel that stores a value, not walk through it to its inputs.
  auto anchor = detail::find_anchors(g, s.epilogues);
  for (int v = 0; v < g.size(); ++v) anchor[v] = anchor[v] || s.kernel_of[v] >= 0;
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    if (s.kernels[k].kind != Kind::split) continue;
    std::vector<int> kept;
    const std::vector<int> reductions = s.kernels[k].reductions;
    for (int r : reductions) {
      int into = detail::partial_host(g, s, env, anchor, k, r, host, partials == 1);
      if (into < 0 || (s.kernels[into].partial_groups && s.kernels[into].partial_groups != g[r].shape[0])) {
        kept.push_back(r);
        continue;
      }
      if (into > k) {  // a later row kernel: it runs just before the split now
        detail::move_kernel(s, into, k);
        into = k++;
      }
      s.kernels[into].partials.push_back(r);
      s.kernels[into].partial_groups = g[r].shape[0];
      s.kernel_of[r] = into;
    }
    KernelPlan& split = s.kernels[k];
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
