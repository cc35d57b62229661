// The oracle's attention, from its definition in f64: per (batch, head, query) the scores against
// every key of the head's k/v group, masked (causal: keys after the query), a softmax (a row the
// mask empties gives zeros), and the weighted sum of v's rows. Split from eval_node.hpp.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "../autodiff/score_mods.hpp"
#include "../graph/graph.hpp"
#include "../graph/infer.hpp"
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

// The probabilities of attention for one (batch, head): p[i * Tk + j], rows the mask empties all
// zeros; lse[i] each row's log-sum-exp (+inf for an empty row). mod: the modded scores [B, H, Tq,
// Tk] of an inlined score_mod (null: q k^T * scale).
inline void attention_probabilities(const graph::Node& n, const Value& q, const Value& k, double given_scale,
                                    std::int64_t b, std::int64_t h, std::vector<double>& p, std::vector<double>& lse,
                                    const Value* mod = nullptr) {
  const std::int64_t H = q.shape[1], Tq = q.shape[2], D = q.shape[3], Hkv = k.shape[1], Tk = k.shape[2];
  const double scale = n.attrs.b ? given_scale : 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  const double* qh = q.data.data() + (b * H + h) * Tq * D;
  const double* kh = k.data.data() + (b * Hkv + h / (H / Hkv)) * Tk * D;
  const double inf = std::numeric_limits<double>::infinity();
  p.assign(static_cast<std::size_t>(Tq * Tk), 0.0);
  lse.assign(static_cast<std::size_t>(Tq), inf);
  for (std::int64_t i = 0; i < Tq; ++i) {
    double m = -inf;
    for (std::int64_t j = 0; j < Tk; ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < D; ++d) dot += qh[i * D + d] * kh[j * D + d];
      const std::int64_t at[4] = {b, h, i, j};
      p[i * Tk + j] = (n.attrs.a && j > i) ? -inf : mod ? broadcast_at(*mod, at) : dot * scale;
      m = std::max(m, p[i * Tk + j]);
    }
    if (std::isinf(m) && m < 0) {
      for (std::int64_t j = 0; j < Tk; ++j) p[i * Tk + j] = 0;
      continue;
    }
    double l = 0;
    for (std::int64_t j = 0; j < Tk; ++j) l += p[i * Tk + j] = std::exp(p[i * Tk + j] - m);
    for (std::int64_t j = 0; j < Tk; ++j) p[i * Tk + j] /= l;
    lse[i] = m + std::log(l);
  }
}

// attention_lse(q, k, scale) -> [B, H, Tq]: each row's log-sum-exp of its scaled, masked scores
// (+inf for a row with no key).
inline void eval_attention_lse(const graph::Node& n, const Value& q, const Value& k, double given_scale, Value& out,
                               const Value* mod = nullptr) {
  const std::int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2];
  std::vector<double> p, lse;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      attention_probabilities(n, q, k, given_scale, b, h, p, lse, mod);
      for (std::int64_t i = 0; i < Tq; ++i) out.data[(b * H + h) * Tq + i] = lse[i];
    }
}

// attention_grad(q, k, v, g, stats, scale), attrs.c = 0, 1, 2: the gradient of q, k or v of
// attention given g, its output's cotangent (from the definition; the statistics are not read);
// attrs.c = 3: k's and v's, stacked as [2, B, Hkv, Tk, D]; attrs.c = 4: k's, v's and q's, stacked as
// [5, B, H, T, D] (q, k and v of one shape; the last two slots are the kernel's scratch, zeros
// here). mod: the modded scores of an inlined
// score_mod, and `through(dS)` dS of the modded scores [B, H, Tq, Tk] sent back through it.
template <class Through>
void eval_attention_grad(const graph::Node& n, const Value& q, const Value& k, const Value& v, const Value& g,
                         double given_scale, Value& out, const Value* mod, Through&& through) {
  const std::int64_t B = q.shape[0], H = q.shape[1], Tq = q.shape[2], D = q.shape[3];
  const std::int64_t Hkv = k.shape[1], Tk = k.shape[2], Dv = v.shape[3], G = H / Hkv;
  const double scale = n.attrs.b ? given_scale : 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  std::fill(out.data.begin(), out.data.end(), 0.0);
  const std::int64_t c = n.attrs.c;
  const std::int64_t dv_at = c >= 3 ? B * Hkv * Tk * D : 0;      // where v's gradient starts
  const std::int64_t dq_at = c == 4 ? 2 * B * Hkv * Tk * D : 0;  // and q's
  std::vector<double> p, lse;
  Value probs = make_value(Dims{B, H, Tq, Tk}, kiln::dtype::f64), dS = probs;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      attention_probabilities(n, q, k, given_scale, b, h, p, lse, mod);
      const std::int64_t hk = b * Hkv + h / G;
      const double* gh = g.data.data() + (b * H + h) * Tq * Dv;
      const double* vh = v.data.data() + hk * Tk * Dv;
      double* ds = dS.data.data() + (b * H + h) * Tq * Tk;
      std::copy(p.begin(), p.end(), probs.data.begin() + (b * H + h) * Tq * Tk);
      for (std::int64_t i = 0; i < Tq; ++i) {  // dS = P (dP - rowsum(P dP)), dP = g v^T
        double dot = 0;
        for (std::int64_t j = 0; j < Tk; ++j) {
          double dp = 0;
          for (std::int64_t d = 0; d < Dv; ++d) dp += gh[i * Dv + d] * vh[j * Dv + d];
          ds[i * Tk + j] = dp;
          dot += p[i * Tk + j] * dp;
        }
        for (std::int64_t j = 0; j < Tk; ++j) ds[i * Tk + j] = p[i * Tk + j] * (ds[i * Tk + j] - dot);
      }
    }
  if (mod) dS = through(dS);  // dS of the scaled scores
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t hk = b * Hkv + h / G;
      const double* gh = g.data.data() + (b * H + h) * Tq * Dv;
      const double* pr = probs.data.data() + (b * H + h) * Tq * Tk;
      const double* ds = dS.data.data() + (b * H + h) * Tq * Tk;
      const double* qh = q.data.data() + (b * H + h) * Tq * D;
      const double* kh = k.data.data() + hk * Tk * D;
      for (std::int64_t i = 0; i < Tq; ++i)
        for (std::int64_t j = 0; j < Tk; ++j) {
          const double pij = pr[i * Tk + j], dsij = ds[i * Tk + j] * scale;
          if (c == 0 || c == 4)
            for (std::int64_t d = 0; d < D; ++d)
              out.data[dq_at + ((b * H + h) * Tq + i) * D + d] += dsij * kh[j * D + d];
          if (c == 1 || c >= 3)
            for (std::int64_t d = 0; d < D; ++d) out.data[(hk * Tk + j) * D + d] += dsij * qh[i * D + d];
          if (c == 2 || c >= 3)
            for (std::int64_t d = 0; d < Dv; ++d) out.data[dv_at + (hk * Tk + j) * Dv + d] += pij * gh[i * Dv + d];
        }
    }
}

// An inlined score_mod's graph (autodiff/score_mods.hpp: the mod's, or its vjp's first output, the
// cotangent of each score) at every score [B, H, Tq, Tk] of a fused node: over the scaled scores,
// their indices, the cotangent `ct` (vjp only) and the tensors the node's score_mod reads, each
// broadcast to the scores. In f64, as the oracle computes; eval(g, i, values, args) evaluates
// node i of g (eval_node.hpp's, with the program's scalars).
template <class EvalNode>
Value eval_score_mod(const graph::Graph& f, const graph::Node& n, const Value& q, const Value& k, double given_scale,
                     const Value* ct, const std::vector<const Value*>& captured, EvalNode&& eval) {
  Value scores = make_value(Dims{q.shape[0], q.shape[1], q.shape[2], k.shape[2]}, kiln::dtype::f64);
  std::vector<Tensor> args;
  for (std::int64_t which = 0; which <= 4; ++which) {  // the scaled score, then its b, h, i and j
    graph::Node arg = n;
    arg.attrs.a = which;
    Value v = make_value(scores.shape, which ? kiln::dtype::i64 : kiln::dtype::f64);
    eval_score_arg(arg, q, k, given_scale, v);
    args.push_back(to_tensor(v));
  }
  args.push_back(ct ? to_tensor(*ct) : to_tensor(scores));  // (the mod itself does not read it)
  for (const Value* c : captured) args.push_back(to_tensor(*c));
  graph::Graph g = f;
  g.outputs.resize(1);
  graph::infer_shapes(g, [&](int slot) -> const Tensor& { return args.at(static_cast<std::size_t>(slot)); });
  std::vector<Value> vals(static_cast<std::size_t>(g.size()));
  for (int i = 0; i < g.size(); ++i)
    vals[static_cast<std::size_t>(i)] = eval(g, i, vals, std::span<const Tensor>(args));  // (in order)
  Value out = vals[static_cast<std::size_t>(g.outputs.at(0))];
  if (!(out.shape == scores.shape)) {  // (a mod that ignores the score is one value: spread it)
    Value full = make_value(scores.shape, out.dt);
    std::size_t o = 0;
    for (std::int64_t b = 0; b < scores.shape[0]; ++b)
      for (std::int64_t h = 0; h < scores.shape[1]; ++h)
        for (std::int64_t i = 0; i < scores.shape[2]; ++i)
          for (std::int64_t j = 0; j < scores.shape[3]; ++j) {
            const std::int64_t at[4] = {b, h, i, j};
            full.data[o++] = broadcast_at(out, at);
          }
    return full;
  }
  return out;
}

// The fused kernels' nodes, from their inputs `in`: attention_flash(q, k, v, scale, ...),
// attention_lse(q, k, scale, ...), attention_grad(q, k, v, g, stats, scale, ...), the inputs after
// the scale the tensors an inlined score_mod (attrs.custom) reads; its graphs at every score.
template <class EvalNode>
void eval_fused_attention(const graph::Node& n, const std::vector<const Value*>& in, Value& out, EvalNode&& eval) {
  const int first = n.op == Op::attention_flash ? 4 : n.op == Op::attention_lse ? 3 : 6;
  const double scale = in[static_cast<std::size_t>(first - 1)]->data[0];
  const std::vector<const Value*> captured(in.begin() + first, in.end());
  const autodiff::ScoreMod* m = n.attrs.custom >= 0 ? &autodiff::ScoreMods::instance().get(n.attrs.custom) : nullptr;
  const Value &q = *in[0], &k = *in[1];
  Value modded;
  if (m) modded = eval_score_mod(m->mod, n, q, k, scale, nullptr, captured, eval);
  const Value* mod = m ? &modded : nullptr;
  if (n.op == Op::attention_flash)
    eval_attention(n, q, k, *in[2], scale, mod, out);
  else if (n.op == Op::attention_lse)
    eval_attention_lse(n, q, k, scale, out, mod);
  else
    eval_attention_grad(n, q, k, *in[2], *in[3], scale, out, mod,
                        [&](const Value& ds) { return eval_score_mod(m->vjp, n, q, k, scale, &ds, captured, eval); });
}

}  // namespace kiln::reference::detail
