// Shape and dtype inference for k::attention(q, k, v, scale): q [B, H, Tq, D], k [B, Hkv, Tk, D],
// v [B, Hkv, Tk, Dv] with Hkv dividing H (grouped-query heads) give [B, H, Tq, Dv] in q's floating
// dtype. Split from infer.hpp.
#pragma once
#include <string>

#include "graph.hpp"

namespace kiln::graph::detail {

// score_arg(q, k, scale) with attrs.a = 0: the scaled scores [B, H, Tq, Tk] (f32, or f64 for f64
// inputs); 1..4: the batch, head, query and key index of each score (i64).
inline void infer_score_arg(const Graph& g, Node& n) {
  const Node &q = g.nodes[n.in[0]], &k = g.nodes[n.in[1]];
  if (q.shape.size() != 4 || k.shape.size() != 4 || k.shape[0] != q.shape[0] || k.shape[3] != q.shape[3])
    throw shape_error("attention: q and k must be [B, H, T, D] with one B and D (q " + q.shape.str() + ", k " +
                      k.shape.str() + ")");
  n.shape = Dims{q.shape[0], q.shape[1], q.shape[2], k.shape[2]};
}

// The head dims the fused attention kernels take (runtime/extern/attention.hpp): q's, k's and v's
// the same, a multiple of 16 from 16 to 128.
inline bool fused_attention_head_dims(const Dims& q, const Dims& k, const Dims& v) {
  const std::int64_t D = q[3];
  return D % 16 == 0 && D >= 16 && D <= 128 && k[3] == D && v[3] == D;
}

// Whether the fused backward computes dk and dv in one kernel (attention_grad with attrs.c = 3):
// a thread then holds both accumulators (D/2 floats each) beside a 64-key tile's scores and dP (32
// each), within 192 of its 255 registers, the rest for fragments and addresses (ptxas, sm_90a:
// D 96 takes 246 registers without spilling; D 128 spills 120-170 bytes, and still runs forward +
// backward 12-13% faster on an H200 than dk and dv apart, which read q and dO twice and compute
// the scores twice).
// An inlined score_mod holds the tile's scaled scores too (32 more, for its derivative): D <= 96
// (the mma.sync kernel; Hopper's warpgroup kernel holds none, and the rule asks with score_mod
// false where it runs: autodiff/rules.hpp).
constexpr bool fused_attention_joins_dk_dv(std::int64_t D, bool score_mod = false) {
  return D + 64 + (score_mod ? 32 : 0) <= 192;
}
// Whether Hopper's dk/dv kernel also takes dq (attention_grad with attrs.c = 4) by default: its
// thread then holds dk's and dv's accumulators, a tile's scores and dP, and a quarter-row of dq's
// product (D/4), within the same 192 (ptxas, sm_90a: D 64 takes 209-212 registers without
// spilling; D 128 spills, and measured 2% slower than dq apart on an H200, D 64 5% faster:
// benchmarks/NOTES.md item 159).
constexpr bool fused_attention_joins_dq(std::int64_t D) { return D + D / 4 + 64 <= 192; }

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
  if (n.attrs.c) {  // a score_mod's result: floating, broadcastable to the scores [B, H, Tq, Tk]
    const Node& m = g.nodes[n.in[4]];
    const Dims full{qs[0], qs[1], qs[2], ks[2]};
    bool fits = m.shape.size() <= 4;
    for (int i = 0; fits && i < m.shape.size(); ++i) {
      const std::int64_t have = m.shape[m.shape.size() - 1 - i], want = full[3 - i];
      fits = have == want || have == 1;
    }
    if (!fits) throw shape_error("attention: score_mod gives " + m.shape.str() + ", not the scores' " + full.str());
    if (!is_floating(m.dt))
      throw dtype_error("attention: score_mod gives " + std::string(name(m.dt)) + " scores; they must be floating");
  }
  // A node lowering gave the fused kernel (its warps set) whose program a call with other head dims
  // reaches (dynamic shapes): an error here makes the program cache compile again for them.
  if (n.op == Op::attention_flash && n.attrs.d > 0 && !fused_attention_head_dims(qs, ks, vs))
    throw shape_error("attention: the fused kernel does not take head dims " + std::to_string(qs[3]) + " and " +
                      std::to_string(vs[3]) + shapes());
  n.shape = Dims{qs[0], qs[1], qs[2], vs[3]};
}

}  // namespace kiln::graph::detail
