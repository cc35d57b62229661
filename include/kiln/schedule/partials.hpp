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

// The row kernel before `split` that can compute first-stage reduction r as column partials: its
// rows are the reduction's rows and its row length the kept columns (a static 2048..8192, held in
// registers), and everything r reads is ready by then. -1 when none.
inline int partial_host(const graph::Graph& g, const Schedule& s, const ir::ShapeEnv& env,
                        const std::vector<bool>& anchor, int split, int r) {
  const graph::Node& red = g[r];
  const graph::Node& view = g[red.in[0]];
  if (red.op != Op::sum || view.op != Op::reshape || view.shape.size() != 3) return -1;
  if (reduce_dims_of(red, 3) != Dims{1}) return -1;  // prefix split: [S, R, K] summed over R
  int e = view.in[0];
  const Dims& full = g[e].shape;
  if (full.size() != 2 || full[0] != view.shape[0] * view.shape[1] || full[1] != view.shape[2]) return -1;
  for (const auto& d : env[e])
    if (!d.is_constant()) return -1;
  if (full[1] < 2048 || full[1] > 8192 || view.shape[0] < 256) return -1;
  int ready = first_possible_kernel(g, anchor, s.kernel_of, red.in[0]);
  for (int k = split - 1; k >= ready && k >= 0; --k) {
    const KernelPlan& plan = s.kernels[k];
    if (plan.kind == Kind::per && !plan.closed && g[plan.domain].shape == full && plan.rdims == Dims{1} &&
        reads_rows(g, anchor, s.kernel_of, plan, k, e, row_map(full, {}, full)))
      return k;
  }
  return -1;
}

}  // namespace detail

// Moves first stages of split column sums into the row kernels that hold their inputs (above); a
// split kernel left with nothing is dropped; nothing moves unless `allowed`.
inline void absorb_column_partials(const graph::Graph& g, Schedule& s, const ir::ShapeEnv& env, bool allowed = true) {
  if (!allowed) return;
  auto anchor = detail::find_anchors(g, s.epilogues);
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    KernelPlan& split = s.kernels[k];
    if (split.kind != Kind::split) continue;
    std::vector<int> kept;
    for (int r : split.reductions) {
      int host = detail::partial_host(g, s, env, anchor, k, r);
      if (host < 0 || (s.kernels[host].partial_groups && s.kernels[host].partial_groups != g[r].shape[0])) {
        kept.push_back(r);
        continue;
      }
      s.kernels[host].partials.push_back(r);
      s.kernels[host].partial_groups = g[r].shape[0];
      s.kernel_of[r] = host;
    }
    split.reductions = kept;
    if (!kept.empty() || !split.stores.empty()) continue;
    s.kernels.erase(s.kernels.begin() + k);
    for (auto& of : s.kernel_of)
      if (of > k) --of;
    --k;
  }
}

}  // namespace kiln::schedule
