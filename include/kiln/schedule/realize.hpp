// Which shared pointwise values get a buffer. Fusion inlines a pointwise node into every kernel
// that reads it, so a value that several kernels read is computed once per kernel: free when its
// tree is one load, ruinous when it is a chain — a residual stream `x + a1 + a2 + ...` read by
// each layer's norm would reload every earlier block's output in every later layer (quadratic in
// depth: in GPT-2 the norms re-read the embedding gather and 12 residual adds).
//
// The rule counts memory traffic in units of the node's size. Inlined into C kernels, a node whose
// tree loads R full-size buffers (arguments, other kernels' buffers, gathered rows; broadcast
// operands such as a bias or a row statistic are cheap and not counted) costs C * R loads; realised,
// it costs R loads and one store where it is computed, then one load in each of the C kernels:
// R + 1 + C. So it is realised when C * R > R + 1 + C, that is (C - 1)(R - 1) > 2. Nodes are
// decided in topological order, a realised node counting as one load for the nodes above it, and
// the anchors are grouped again until nothing changes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuse.hpp"

namespace kiln::schedule {
namespace detail {

// How many kernels inline each node (walking each kernel's roots down to buffers).
inline std::vector<int> inlining_count(const graph::Graph& g, const Schedule& s) {
  std::vector<int> count(g.size(), 0), last(g.size(), -1);
  std::vector<int> stack;
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    const KernelPlan& plan = s.kernels[k];
    if (plan.kind == Kind::extern_) continue;  // reads its operands' buffers
    for (const auto* roots : {&plan.stores, &plan.reductions})
      for (int r : *roots)
        for (int c = 0; c < g[r].n_in; ++c) stack.push_back(g[r].in[c]);
    while (!stack.empty()) {
      int v = stack.back();
      stack.pop_back();
      if (v < 0 || s.kernel_of[v] >= 0 || g[v].op == Op::arg || last[v] == k) continue;
      last[v] = k;
      ++count[v];
      for (int c = 0; c < g[v].n_in; ++c) stack.push_back(g[v].in[c]);
    }
  }
  return count;
}

// Marks the nodes worth a buffer under the rule above; true when it marked any.
inline bool mark_shared(const graph::Graph& g, const std::vector<int>& count, std::vector<bool>& anchor) {
  constexpr std::size_t cap = 16;  // leaves tracked per node: past a few the rule has decided
  std::vector<std::vector<int>> leaves(g.size());
  auto numel = [&](int v) { return g[v].shape.product(); };
  bool marked = false;
  for (int v = 0; v < g.size(); ++v) {
    const graph::Node& n = g[v];
    const auto cls = info(n.op).cls;
    if (n.op == Op::arg || anchor[v] || cls == OpClass::index) {  // a load for the nodes above
      leaves[v] = {v};
      continue;
    }
    // Constants and scalars: kernel arguments, no load. (numel and iota_of read only a shape, but
    // their input's loads are counted: without them a pre-norm chain's gradient had kernels of 13
    // inputs where 10 was the rule's result: test_realize.)
    if (cls == OpClass::leaf) continue;
    std::vector<int>& mine = leaves[v];
    for (int c = 0; c < n.n_in && mine.size() < cap; ++c)
      for (int l : leaves[n.in[c]])
        if (std::find(mine.begin(), mine.end(), l) == mine.end() && mine.size() < cap) mine.push_back(l);
    if (!is_pointwise(n.op) || count[v] < 2) continue;
    const auto size = numel(v);
    const auto loads = std::count_if(mine.begin(), mine.end(), [&](int l) { return numel(l) >= size; });
    if (static_cast<std::int64_t>(count[v] - 1) * (loads - 1) > 2) {
      anchor[v] = marked = true;
      mine = {v};
    }
  }
  return marked;
}

}  // namespace detail

// Gives buffers to the pointwise values that several kernels would otherwise recompute at a cost
// (see above), regrouping the kernels after each round.
inline void realize_shared(const graph::Graph& g, Schedule& s) {
  std::vector<bool> anchor(g.size());
  for (int v = 0; v < g.size(); ++v) anchor[v] = s.kernel_of[v] >= 0;
  for (int round = 0; round < 4; ++round) {
    if (!detail::mark_shared(g, detail::inlining_count(g, s), anchor)) return;
    s = fuse(g, anchor, s.epilogues);
  }
}

}  // namespace kiln::schedule
