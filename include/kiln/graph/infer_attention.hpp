// Shape and dtype inference for k::attention(q, k, v, scale): q [B, H, Tq, D], k [B, Hkv, Tk, D],
// v [B, Hkv, Tk, Dv] with Hkv dividing H (grouped-query heads) give [B, H, Tq, Dv] in q's floating
// dtype. Split from infer.hpp.
#pragma once
#include <string>

#include "graph.hpp"

namespace kiln::graph::detail {

inline void infer_attention(const Graph& g, Node& n) {
  const Node &q = g.nodes[n.in[0]], &k = g.nodes[n.in[1]], &v = g.nodes[n.in[2]];
  const Dims &qs = q.shape, &ks = k.shape, &vs = v.shape;
  auto shapes = [&] { return " (q " + qs.str() + ", k " + ks.str() + ", v " + vs.str() + ")"; };
  if (qs.size() != 4 || ks.size() != 4 || vs.size() != 4)
    throw shape_error("attention: q, k and v must be [B, H, T, D]" + shapes());
  if (ks[0] != qs[0] || vs[0] != qs[0]) throw shape_error("attention: batch sizes differ" + shapes());
  if (ks[1] != vs[1] || ks[1] == 0 || qs[1] % ks[1] != 0)
    throw shape_error("attention: k and v need the same number of heads, dividing q's" + shapes());
  if (ks[2] != vs[2]) throw shape_error("attention: k and v need the same sequence length" + shapes());
  if (ks[3] != qs[3]) throw shape_error("attention: q and k need the same head dimension" + shapes());
  if (!is_floating(q.dt) || q.dt != k.dt || q.dt != v.dt)
    throw dtype_error("attention: q, k and v must share one floating dtype, got " + std::string(name(q.dt)) + ", " +
                      std::string(name(k.dt)) + ", " + std::string(name(v.dt)));
  n.shape = Dims{qs[0], qs[1], qs[2], vs[3]};
  n.dt = q.dt;
}

}  // namespace kiln::graph::detail
