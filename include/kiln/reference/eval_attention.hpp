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

inline void eval_attention(const graph::Node& n, const Value& q, const Value& k, const Value& v, double given_scale,
                           Value& out) {
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
          s[j] = (n.attrs.a && j > i) ? -std::numeric_limits<double>::infinity() : dot * scale;
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
