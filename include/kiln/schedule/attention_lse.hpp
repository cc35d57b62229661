// The fused attention forward's second output: the rows' log-sum-exp that the fused backward reads
// (autodiff/rules.hpp's attention_flash rule makes an attention_lse node for it), written by the
// forward's kernel beside its output where both are in one program, as a GEMM's aux output.
#pragma once
#include <algorithm>
#include <vector>

#include "../graph/graph.hpp"

namespace kiln::schedule {

namespace detail {

// attention_flash node -> the attention_lse node (the rows' log-sum-exp the fused backward reads)
// over the same q, k, scale and mask, which the forward's kernel writes beside its output; -1.
inline std::vector<int> lse_written_by_forward(const graph::Graph& g) {
  std::vector<int> lse_of(g.size(), -1);
  for (int l = 0; l < g.size(); ++l) {
    const graph::Node& L = g[l];
    if (L.op != Op::attention_lse) continue;
    for (int f = 0; f < l; ++f) {
      const graph::Node& F = g[f];
      if (F.op == Op::attention_flash && lse_of[f] < 0 && F.in[0] == L.in[0] && F.in[1] == L.in[1] &&
          F.in[3] == L.in[2] && F.attrs.a == L.attrs.a && F.attrs.b == L.attrs.b && F.attrs.custom == L.attrs.custom &&
          F.n_in - 4 == L.n_in - 3 && std::equal(F.in.begin() + 4, F.in.begin() + F.n_in, L.in.begin() + 3)) {
        lse_of[f] = l;
        break;
      }
    }
  }
  return lse_of;
}

}  // namespace detail

}  // namespace kiln::schedule
