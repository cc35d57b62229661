// The oracle's attention, from its definition in f64: per (batch, head, query) the scores against
// every key of the head's k/v group, masked (causal: keys after the query), a softmax (a row the
// mask empties gives zeros), and the weighted sum of v's rows. Split from eval_node.hpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../graph/graph.hpp"
#include "value.hpp"

namespace kiln::reference::detail {

// Element [b, h, i, j] of a value broadcast to the scores' shape (its dims aligned on the right).
inline double broadcast_at(const Value& m, const std::int64_t (&at)[4]) {
  std::int64_t lin = 0;
  const int r = m.shape.size();
  for (int d = 0; d < r; ++d) {
    const std::int64_t size = m.shape[d], index = at[4 - r + d];
    lin = lin * size + (size == 1 ? 0 : index);
  }
  return m.data[static_cast<std::size_t>(lin)];
}

// score_arg: the scaled score (attrs.a = 0) or an index of it (1..4: batch, head, query, key).
inline void eval_score_arg(const graph::Node& n, const Value& q, const Value& k, double given_scale, Value& out) {
  const std::int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const std::int64_t Hkv = k.shape[1], Tk = k.shape[2], G = H / Hkv;
  const double scale = n.attrs.b ? given_scale : 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  std::size_t o = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Tq; ++i)
        for (std::int64_t j = 0; j < Tk; ++j, ++o) {
          if (n.attrs.a > 0) {
            const std::int64_t idx[4] = {b, h, i, j};
            out.data[o] = static_cast<double>(idx[n.attrs.a - 1]);
            continue;
          }
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += q.data[static_cast<std::size_t>(((b * H + h) * Tq + i) * D + d)] *
                   k.data[static_cast<std::size_t>(((b * Hkv + h / G) * Tk + j) * D + d)];
          out.data[o] = dot * scale;
        }
}

// mod: a score_mod's result (the scores themselves), or null for q k^T * scale.
inline void eval_attention(const graph::Node& n, const Value& q, const Value& k, const Value& v, double given_scale,
                           const Value* mod, Value& out) {
  const std::int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const std::int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3], G = H / Hkv;
  const double scale = n.attrs.b ? given_scale : 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  std::vector<double> s(static_cast<std::size_t>(Tk));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t hk = h / G;
      const double* qh = q.data.data() + (b * H + h) * Tq * D;
      const double* kh = k.data.data() + (b * Hkv + hk) * Tk * D;
      const double* vh = v.data.data() + (b * Hkv + hk) * Tk * Dv;
      double* oh = out.data.data() + (b * H + h) * Tq * Dv;
      for (std::int64_t i = 0; i < Tq; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t j = 0; j < Tk; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += qh[i * D + d] * kh[j * D + d];
          const std::int64_t at[4] = {b, h, i, j};
          const double score = mod ? broadcast_at(*mod, at) : dot * scale;
          s[j] = (n.attrs.a && j > i) ? -std::numeric_limits<double>::infinity() : score;
          m = std::max(m, s[j]);
        }
        double l = 0;
        for (std::int64_t j = 0; j < Tk; ++j) l += s[j] = std::isinf(m) && m < 0 ? 0.0 : std::exp(s[j] - m);
        for (std::int64_t d = 0; d < Dv; ++d) {
          double acc = 0;
          for (std::int64_t j = 0; j < Tk; ++j) acc += s[j] * vh[j * Dv + d];
          oh[i * Dv + d] = l > 0 ? acc / l : 0.0;
        }
      }
    }
}

}  // namespace kiln::reference::detail
