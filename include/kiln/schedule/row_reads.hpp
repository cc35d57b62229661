// Whether a row kernel's reductions are read at the row's own index (schedule/fuse.hpp asks it
// before an anchor joins a row kernel).
#pragma once
#include <algorithm>
#include <set>
#include <utility>
#include <vector>

#include "../graph/graph.hpp"
#include "plan.hpp"

namespace kiln::schedule::detail {

// A row kernel computes each reduction once a row and hands that value to every reader in the
// kernel, whatever index the reader asks for. That is right only when the reader's index reaches
// the reduction along the row's own dims: amax(x, dims=[1]) of x [3, 3, 5] is [3, 5], and `x - it`
// broadcasts it along dims 1 and 2 of x, not along the row's dims 0 and 2. `reads_rows` follows
// the index of a node through its inlined operands as a map from each of its dims to the domain dim
// that indexes it (kBroadcast: a dim of size 1; kMixed: a dim whose index a view moved or mixed)
// and checks each in-kernel reduction it reaches against the row's own map.
constexpr int kBroadcast = -1, kMixed = -2;

// The map of a node of the row kernel's shape: the domain, or its rows with (keepdim) or without
// the reduced dims.
inline std::vector<int> row_map(const Dims& domain, const Dims& rdims, const Dims& shape) {
  std::vector<int> m;
  bool keep = shape.size() == domain.size();
  for (int d = 0; d < domain.size(); ++d) {
    bool reduced = std::find(rdims.begin(), rdims.end(), d) != rdims.end();
    if (reduced && !keep) continue;
    m.push_back(domain[d] == 1 || (reduced && shape != domain) ? kBroadcast : d);
  }
  return m;
}

// The map of a view's or broadcast operand `c` read by node `p` whose map is m.
inline std::vector<int> operand_map(const graph::Graph& g, int p, int c, const std::vector<int>& m) {
  const auto& n = g[p];
  const Dims &cs = g[c].shape, &ps = n.shape;
  std::vector<int> out(cs.size(), kMixed);
  auto broadcast = [&] {
    for (int j = 0; j < cs.size(); ++j) out[j] = cs[j] == 1 ? kBroadcast : m[j + (ps.size() - cs.size())];
  };
  switch (n.op) {
    case Op::permute:
      for (int i = 0; i < n.attrs.dims.size(); ++i) out[n.attrs.dims[i]] = m[i];
      break;
    case Op::reshape: {  // dims other than size 1 kept in order map across; anything else mixes
      std::vector<int> pi, ci;
      for (int j = 0; j < ps.size(); ++j)
        if (ps[j] != 1) pi.push_back(j);
      for (int j = 0; j < cs.size(); ++j)
        if (cs[j] == 1)
          out[j] = kBroadcast;
        else
          ci.push_back(j);
      bool same = pi.size() == ci.size();
      for (std::size_t k = 0; same && k < pi.size(); ++k) same = ps[pi[k]] == cs[ci[k]];
      for (std::size_t k = 0; same && k < ci.size(); ++k) out[ci[k]] = m[pi[k]];
      break;
    }
    case Op::slice:
    case Op::slice_backward: {  // the sliced dim's index moves
      out = m;
      int d = static_cast<int>(n.attrs.a < 0 ? n.attrs.a + ps.size() : n.attrs.a);
      if (cs[d] != 1) out[d] = kMixed;
      break;
    }
    case Op::embedding:  // the ids are read at the leading dims of the output's index
      for (int j = 0; j < cs.size(); ++j) out[j] = cs[j] == 1 ? kBroadcast : m[j];
      break;
    default:
      broadcast();
  }
  return out;
}

inline bool reads_rows(const graph::Graph& g, const std::vector<bool>& anchor, const std::vector<int>& kernel_of,
                       const KernelPlan& k, int ki, int root, std::vector<int> root_map) {
  const Dims& domain = g[k.domain].shape;
  std::vector<std::pair<int, std::vector<int>>> stack{{root, std::move(root_map)}};
  std::set<std::pair<int, std::vector<int>>> seen;
  while (!stack.empty()) {
    auto [v, m] = std::move(stack.back());
    stack.pop_back();
    const auto& n = g[v];
    bool loaded = n.op == Op::arg || (anchor[v] && kernel_of[v] >= 0 && kernel_of[v] != ki);
    if (loaded || !seen.insert({v, m}).second) continue;
    if (is_reduction(n.op) && kernel_of[v] == ki) {  // computed in this kernel: its row value is read
      auto own = row_map(domain, k.rdims, n.shape);
      for (int j = 0; j < n.shape.size(); ++j)
        if (n.shape[j] != 1 && m[j] != own[j]) return false;
      continue;
    }
    auto cls = info(n.op).cls;
    if (cls == OpClass::leaf || cls == OpClass::meta || info(n.op).cls == OpClass::extern_) continue;
    for (int c = cls == OpClass::index ? 1 : 0; c < n.n_in; ++c)
      stack.push_back({n.in[c], operand_map(g, v, n.in[c], m)});
  }
  return true;
}

}  // namespace kiln::schedule::detail
