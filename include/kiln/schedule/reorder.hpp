// Reordering kernels while fusing: a small generated kernel that reads only what earlier kernels
// computed may run before a kernel that a later anchor could join, so that anchor needs no kernel
// of its own (schedule/fuse.hpp calls these while grouping anchors into kernels).
#pragma once
#include <algorithm>
#include <vector>

#include "../graph/graph.hpp"
#include "plan.hpp"

namespace kiln::schedule {

namespace detail {

// The kernels whose buffers node i's inlined operands read.
inline std::vector<int> kernels_read(const graph::Graph& g, const std::vector<bool>& anchor,
                                     const std::vector<int>& kernel_of, const std::vector<int>& roots, int own) {
  std::vector<int> out;
  graph::walk_inputs(g, graph::inputs_of(g, roots), [&](int v) {
    if (!(anchor[v] && kernel_of[v] >= 0 && kernel_of[v] != own)) return true;
    if (std::find(out.begin(), out.end(), kernel_of[v]) == out.end()) out.push_back(kernel_of[v]);
    return false;
  });
  return out;
}

// The argument slots a kernel's inlined trees read (kernel `own`'s roots down to other anchors).
inline std::vector<int> args_read(const graph::Graph& g, const std::vector<bool>& anchor, const std::vector<int>& kernel_of,
                                  const std::vector<int>& roots, int own) {
  std::vector<int> out;
  graph::walk_inputs(g, roots, [&](int v) {
    if (g[v].op == Op::arg) out.push_back(g[v].slot);
    return g[v].op != Op::arg && !(anchor[v] && kernel_of[v] >= 0 && kernel_of[v] != own);
  });
  return out;
}

inline std::vector<int> roots_of(const KernelPlan& k) {
  std::vector<int> r = k.stores;
  r.insert(r.end(), k.reductions.begin(), k.reductions.end());
  return r;
}

// Whether kernel k may run just before kernel j (< k) instead: it is generated (not a library
// step), reads only what kernels before j compute (so kernels moved together never read each other), and writes in place (k::assign) no argument
// that they read. Then an anchor that reads k and could join j's loop need not open a kernel of its
// own: W8's AdamW, whose [1] step-count update sat between the kernel writing m and v and the one
// reading them back for p (nine passes over the state instead of seven).
inline bool may_run_before(const graph::Graph& g, const std::vector<bool>& anchor, const Schedule& s, int k, int j) {
  const KernelPlan& plan = s.kernels[static_cast<std::size_t>(k)];
  if (plan.kind == Kind::extern_ || plan.closed) return false;
  const std::vector<int> roots = roots_of(plan);
  for (int producer : kernels_read(g, anchor, s.kernel_of, roots, k))
    if (producer >= j) return false;
  std::vector<int> written;
  for (std::size_t o = 0; o < g.outputs.size() && o < g.output_into.size(); ++o)
    if (g.output_into[o] >= 0 && s.kernel_of[g.outputs[o]] == k) written.push_back(g.output_into[o]);
  for (int m = j; m < k && !written.empty(); ++m)
    for (int slot : args_read(g, anchor, s.kernel_of, roots_of(s.kernels[static_cast<std::size_t>(m)]), m))
      if (std::find(written.begin(), written.end(), slot) != written.end()) return false;
  return true;
}

// The last kernel so far, from kernel `from` on, whose inlined trees (or extern step's operands)
// read argument `slot`, or -1.
// A value stored into that argument in place (k::assign) joins no kernel before it: a training
// step's update of a norm's weight, whose gradient's column sum runs before the backward kernel
// that still reads the weight, gets a kernel after that one.
inline int last_reader(const graph::Graph& g, const std::vector<bool>& anchor, const Schedule& s, int slot, int from) {
  for (int m = static_cast<int>(s.kernels.size()) - 1; m >= from; --m) {
    const std::vector<int> read =
        args_read(g, anchor, s.kernel_of, roots_of(s.kernels[static_cast<std::size_t>(m)]), m);
    if (std::find(read.begin(), read.end(), slot) != read.end()) return m;
  }
  return -1;
}

// Whether a kernel reads an argument that an earlier kernel writes in place.
inline bool reads_after_assign(const graph::Graph& g, const std::vector<bool>& anchor, const Schedule& s) {
  const int n = static_cast<int>(s.kernels.size());
  for (std::size_t o = 0; o < g.outputs.size() && o < g.output_into.size(); ++o) {
    const int writer = s.kernel_of[g.outputs[o]];
    if (g.output_into[o] < 0 || writer < 0) continue;
    for (int m = writer + 1; m < n; ++m) {
      auto read = args_read(g, anchor, s.kernel_of, roots_of(s.kernels[static_cast<std::size_t>(m)]), m);
      if (std::find(read.begin(), read.end(), g.output_into[o]) != read.end()) return true;
    }
  }
  return false;
}

// Moves kernel k to position j (< k), renumbering the kernels in between.
inline void move_kernel(Schedule& s, int k, int j) {
  KernelPlan moved = std::move(s.kernels[static_cast<std::size_t>(k)]);
  s.kernels.erase(s.kernels.begin() + k);
  s.kernels.insert(s.kernels.begin() + j, std::move(moved));
  for (int& ko : s.kernel_of)
    if (ko == k)
      ko = j;
    else if (ko >= j && ko < k)
      ++ko;
}

}  // namespace detail

}  // namespace kiln::schedule
