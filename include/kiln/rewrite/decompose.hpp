// decompose: lowers every composite op of API.md (softmax, layer_norm, cross_entropy, ...) to the
// primitives the fuser understands, as AOTAutograd's decomposition table does for Inductor. One table
// entry per composite; each builds its primitives into the new graph through the CSE Builder.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <span>
#include <string>
#include <type_traits>

#include "../debug/log.hpp"
#include "builder.hpp"

namespace kiln::rewrite {

namespace detail {

using graph::Node;

// Builds the primitives of composite node n (of the source graph) whose inputs are `in` in b.
using Decomposition = int (*)(Builder& b, const Node& n, std::span<const int> in);

struct DecompositionRule {
  Decomposition build = nullptr;
  // Bit k: input k is computed in f32 when it is f16/bf16 (as Inductor upcasts), so that
  // reductions accumulate in f32; the result is cast back to the node's dtype.
  std::uint8_t upcast = 0;
};

// (On a structural graph, the dims as captured: normalising them needs the rank.)
constexpr Dims reduce_dims_of(const Builder& b, const Node& n, int x) {
  if (!b.shaped()) return n.attrs.dims;
  return graph::detail::reduced_dims(n.attrs, b.rank(x), n.op);
}
constexpr Dims last_dim(const Builder& b, int x) { return Dims{b.shaped() ? b.rank(x) - 1 : -1}; }
constexpr Dims all_dims(const Builder& b, int x) {
  Dims d;
  for (int i = 0; i < b.rank(x); ++i) d.push_back(i);
  return d;
}

// m + log(sum(exp(x - m))) with m = amax(x); a row of -inf (or one holding +inf) shifts by 0 instead,
// so that it gives -inf (+inf) as PyTorch does rather than NaN.
constexpr int logsumexp_of(Builder& b, int x, const Dims& dims, bool keepdim) {
  int m = b.shift_max(x, dims);
  int m_safe = b.where(b.cmp(Op::eq, b.unary(Op::abs, m), b.constant(inf)), 0.0, m);
  int s = b.sum(b.exp(b.sub(x, m_safe)), dims, keepdim);
  return b.add(b.log(s), keepdim ? m_safe : b.reshape(m_safe, b.shape(s)));
}

constexpr int gelu_exact(Builder& b, int x) {  // 0.5 x (1 + erf(x / sqrt 2))
  int e = b.unary(Op::erf, b.mul(x, std::numbers::sqrt2 / 2));
  return b.mul(b.mul(x, 0.5), b.add(e, 1.0));
}
constexpr int gelu_tanh(Builder& b, int x) {  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  const double k = std::numbers::sqrt2 * std::numbers::inv_sqrtpi;
  int inner = b.add(x, b.mul(b.mul(b.square(x), x), 0.044715));
  int t = b.unary(Op::tanh, b.mul(inner, k));
  return b.mul(b.mul(x, 0.5), b.add(t, 1.0));
}

// ---- the table entries --------------------------------------------------------------------------
constexpr int silu(Builder& b, const Node&, std::span<const int> in) {
  return b.mul(in[0], b.unary(Op::sigmoid, in[0]));
}
constexpr int gelu(Builder& b, const Node& n, std::span<const int> in) {
  return n.op == Op::gelu_tanh || n.attrs.a == 1 ? gelu_tanh(b, in[0]) : gelu_exact(b, in[0]);
}
constexpr int clamp(Builder& b, const Node&, std::span<const int> in) {
  return b.op(Op::minimum, {b.op(Op::maximum, {in[0], in[1]}), in[2]});
}
constexpr int mean(Builder& b, const Node& n, std::span<const int> in) {
  return b.mean(in[0], reduce_dims_of(b, n, in[0]), n.attrs.keepdim);
}
// sum((x - mean)^2) / max(numel - correction, 0); the correction is a run-time scalar.
constexpr int var(Builder& b, const Node& n, std::span<const int> in) {
  const Dims rd = reduce_dims_of(b, n, in[0]);
  int centred = b.sub(in[0], b.mean(in[0], rd, true));
  int ss = b.sum(b.square(centred), rd, n.attrs.keepdim);
  int dof = b.op(Op::maximum, {b.sub(b.numel(in[0], rd), in[1]), b.constant(0)});
  return b.div(ss, dof);
}
constexpr int logsumexp(Builder& b, const Node& n, std::span<const int> in) {
  return logsumexp_of(b, in[0], reduce_dims_of(b, n, in[0]), n.attrs.keepdim);
}
constexpr int softmax(Builder& b, const Node& n, std::span<const int> in) {
  const Dims rd = reduce_dims_of(b, n, in[0]);
  int e = b.exp(b.sub(in[0], b.shift_max(in[0], rd)));
  return b.div(e, b.sum(e, rd, true));
}
constexpr int log_softmax(Builder& b, const Node& n, std::span<const int> in) {
  const Dims rd = reduce_dims_of(b, n, in[0]);
  int shifted = b.sub(in[0], b.shift_max(in[0], rd));
  return b.sub(shifted, b.log(b.sum(b.exp(shifted), rd, true)));
}
// (x - mean) * rsqrt(biased var + eps) * w + b over the last dim.
constexpr int layer_norm(Builder& b, const Node&, std::span<const int> in) {
  const Dims rd = last_dim(b, in[0]);
  int centred = b.sub(in[0], b.mean(in[0], rd, true));
  int rstd = b.unary(Op::rsqrt, b.add(b.mean(b.square(centred), rd, true), in[3]));
  return b.add(b.mul(b.mul(centred, rstd), in[1]), in[2]);
}
constexpr int rms_norm(Builder& b, const Node&, std::span<const int> in) {
  int rstd = b.unary(Op::rsqrt, b.add(b.mean(b.square(in[0]), last_dim(b, in[0]), true), in[2]));
  return b.mul(b.mul(in[0], rstd), in[1]);
}
// mean over rows of logsumexp(logits[r]) - logits[r, target[r]].
constexpr int cross_entropy(Builder& b, const Node&, std::span<const int> in) {
  const std::int64_t rows = b.shape(in[0])[0];
  int lse = logsumexp_of(b, in[0], Dims{1}, false);
  int picked = b.reshape(b.op(Op::gather, {in[0], b.reshape(in[1], Dims{rows, 1})}), Dims{rows});
  int loss = b.sub(lse, picked);
  return b.mean(loss, Dims{0}, false);
}
constexpr int mse_loss(Builder& b, const Node&, std::span<const int> in) {
  int d = b.square(b.sub(in[0], in[1]));
  return b.mean(d, all_dims(b, d), false);
}
// matmul(x, w^T) + b; matmul takes 2-D and 3-D operands, so other ranks go through a 2-D reshape.
// Linear without bias passes a scalar 0 placeholder as b, which is skipped.
constexpr int linear(Builder& b, const Node& n, std::span<const int> in) {
  int x = in[0];
  const Dims xs = b.shape(x);
  const bool reshaped = b.shaped() && xs.size() != 2 && xs.size() != 3;  // rank-dependent: at run time
  if (reshaped) x = b.reshape(x, Dims{xs.product() / std::max<std::int64_t>(xs.back(), 1), xs.back()});
  int y = b.matmul(x, b.permute(in[1], Dims{1, 0}));
  if (reshaped) y = b.reshape(y, n.shape);
  const Op bias = b[in[2]].op;
  if (bias == Op::scalar || (bias == Op::constant && b[in[2]].value == 0)) return y;
  return b.add(y, in[2]);
}
constexpr int transpose(Builder& b, const Node& n, std::span<const int> in) {
  const int rank = b.rank(in[0]);
  Dims order;
  for (int i = 0; i < rank; ++i) order.push_back(i);
  if (rank > 0)
    std::swap(order[normalize_dim(n.attrs.a, rank, "transpose")], order[normalize_dim(n.attrs.b, rank, "transpose")]);
  return b.permute(in[0], order);
}
constexpr int to_reshape(Builder& b, const Node& n, std::span<const int> in) { return b.reshape(in[0], n.shape); }
// The first index along the dim holding the extremum m = amax (amin) there, or the first NaN where
// m is NaN (x != x): the least index among the hits, each miss standing as the dim's size.
constexpr int arg_extremum(Builder& b, const Node& n, std::span<const int> in) {
  const bool scalar = b.shaped() && b.rank(in[0]) == 0;  // a 0-d x is taken as [1]: its index is 0
  const int x = scalar ? b.reshape(in[0], Dims{1}) : in[0];
  const Dims rd = scalar ? Dims{0} : reduce_dims_of(b, n, x);
  const int d = static_cast<int>(rd[0]);
  const int m = b.reduce(n.op == Op::argmax ? Op::amax : Op::amin, x, rd, true);
  const int index = b.iota_of(x, d, b.rank(x), d);  // broadcast along the other dims
  const int miss = b.cast(b.numel(x, Dims{d}), kiln::dtype::i64);  // weak: the where stays i64
  const int nan_index = b.where(b.cmp(Op::ne, x, x), index, miss);
  return b.reduce(Op::amin, b.where(b.cmp(Op::eq, x, m), index, nan_index), rd, n.attrs.keepdim && !scalar);
}
// sum_to_shape_of(g, x), settled by sizes: a sum and a reshape, or g itself.
constexpr int sum_to_shape_of(Builder& b, const Node&, std::span<const int> in) {
  return b.sum_to_shape_of(in[0], in[1]);
}
// cat(a, b) along d: where(index < a's size, a zero-padded to the joined shape, b likewise); the
// padded views are slice_backward nodes sized from the joined shape (a at its start, b against its
// end: graph/infer_views.hpp's sized_view_shape), read in place by the consumer's kernel. Nothing names a
// size, so a program with symbolic sizes serves every size of a and b (a growing cache).
constexpr int cat(Builder& b, const Node& n, std::span<const int> in) {
  const int d = b.shaped() ? normalize_dim(n.attrs.a, n.shape.size(), "cat") : 0;
  const int x = b.cast(in[0], n.dt), y = b.cast(in[1], n.dt);
  const int joined = b.shape_of(x, y, d);
  auto padded = [&](int part, bool at_end) {
    Attrs at;
    at.a = d;
    at.d = 1;
    at.keepdim = at_end;
    return b.op(Op::slice_backward, {part, joined}, at);
  };
  const int a = padded(x, false);
  const int first = b.cmp(Op::lt, b.iota_of(a, d, n.shape.size(), d), b.numel(in[0], Dims{d}));
  return b.where(first, a, padded(y, true));
}

// attention(q [B, H, Tq, D], k [B, Hkv, Tk, D], v, scale, modded scores): softmax(q k^T * scale
// [causal mask]) v, with k and v repeated over each group of H / Hkv query heads, as batched matmuls
// over B * H. With a score_mod (attrs.c) the scores are its result, built from score_arg nodes.
// The scores are materialised (one [B*H, Tq, Tk] buffer); on a GPU, lowering gives attention without
// a score_mod to the fused kernel before this runs (runtime/lower.hpp). A row that the
// mask empties gives zeros (FlexAttention's choice), not NaN. Causal masks are aligned top-left, as
// torch's scaled_dot_product_attention: query i sees keys j <= i.
struct AttentionDims {
  std::int64_t B, H, Tq, D, Hkv, G, Tk;
  constexpr AttentionDims(const Builder& b, int q, int k) {
    const Dims qs = b.shape(q), ks = b.shape(k);
    B = qs[0], H = qs[1], Tq = qs[2], D = qs[3], Hkv = ks[1], G = H / Hkv, Tk = ks[2];
  }
  // [B, Hkv, Tk, d] -> [B*H, Tk, d], each kv head G times.
  constexpr int heads(Builder& b, int x) const {
    const Dims s = b.shape(x);
    if (G == 1) return b.reshape(x, Dims{B * H, s[2], s[3]});
    int e = b.expand(b.reshape(x, Dims{B, Hkv, 1, s[2], s[3]}), Dims{B, Hkv, G, s[2], s[3]});
    return b.reshape(e, Dims{B * H, s[2], s[3]});
  }
  // [B*H, Tk, d] -> [B, Hkv, Tk, d]: the cotangents of each group's heads summed (in dtype ct).
  constexpr int group_sum(Builder& b, int x, kiln::dtype ct) const {
    const Dims s = b.shape(x);
    if (G == 1) return b.reshape(x, Dims{B, Hkv, s[1], s[2]});
    return b.sum(b.cast(b.reshape(x, Dims{B, Hkv, G, s[1], s[2]}), ct), Dims{2}, false);
  }
  constexpr int scale_of(Builder& b, int scale, bool given) const {
    return given ? scale : b.constant(1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1))));
  }
  // q k^T * scale as [B*H, Tq, Tk], in the compute dtype (f32 for 16-bit inputs, whose product is a
  // 16-bit GEMM on tensor cores, as torch's math attention does).
  constexpr int scores(Builder& b, int q, int k, int scale, bool given) const {
    const int s = b.matmul(b.reshape(q, Dims{B * H, Tq, D}), b.permute(heads(b, k), Dims{0, 2, 1}));
    return b.mul(b.cast(s, compute_dtype(b[q].dt)), scale_of(b, scale, given));
  }
  // Query i sees keys j <= i.
  static constexpr int causal_mask(Builder& b, int s) {
    return b.where(b.cmp(Op::le, b.iota_of(s, 2, 3, 2), b.iota_of(s, 1, 3, 1)), s, -inf);
  }
};

// The cotangents of q, k and v of attention without a score_mod (the fused kernel's node,
// attention_flash) given g, its output's cotangent. The probabilities are computed again from q and
// k and materialised ([B*H, Tq, Tk], in the compute dtype): dv = P^T g, dP = g v^T,
// dS = P (dP - rowsum(P dP)) scale, dq = dS k, dk = dS^T q, with grouped heads' k and v
// cotangents summed over their group. (The fused kernels of autodiff/rules.hpp's attention_flash
// never materialise P; this is their fallback under KILN_TUNE_ATTENTION_BACKWARD=0.)
constexpr std::array<int, 3> attention_backward(Builder& b, const Node& n, int q, int k, int v, int scale, int g) {
  const AttentionDims a(b, q, k);
  const kiln::dtype ct = compute_dtype(b[q].dt), vt = b[v].dt, qt = b[q].dt;
  int s = a.scores(b, q, k, scale, n.attrs.b);
  if (n.attrs.a) s = AttentionDims::causal_mask(b, s);
  const int m = b.shift_max(s, Dims{2});
  const int e = b.exp(b.sub(s, b.where(b.cmp(Op::eq, m, b.constant(-inf)), 0.0, m)));
  const int l = b.sum(e, Dims{2}, true);
  const int p = b.div(e, b.where(b.cmp(Op::eq, l, b.constant(0)), 1.0, l));
  const std::int64_t Dv = b.shape(v)[3];
  const int go = b.reshape(b.cast(g, vt), Dims{a.B * a.H, a.Tq, Dv});
  const int dv = b.matmul(b.permute(b.cast(p, vt), Dims{0, 2, 1}), go);
  const int dp = b.cast(b.matmul(go, b.permute(a.heads(b, v), Dims{0, 2, 1})), ct);
  const int ds = b.mul(b.mul(p, b.sub(dp, b.sum(b.mul(p, dp), Dims{2}, true))), a.scale_of(b, scale, n.attrs.b));
  const int ds16 = b.cast(ds, qt);
  const int dq = b.reshape(b.matmul(ds16, a.heads(b, k)), b.shape(q));
  const int dk = b.matmul(b.permute(ds16, Dims{0, 2, 1}), b.reshape(q, Dims{a.B * a.H, a.Tq, a.D}));
  return {dq, a.group_sum(b, dk, ct), a.group_sum(b, dv, ct)};
}
constexpr int attention(Builder& b, const Node& n, std::span<const int> in) {
  const AttentionDims a(b, in[0], in[1]);
  const Dims ss{a.B * a.H, a.Tq, a.Tk}, full{a.B, a.H, a.Tq, a.Tk};
  int s = -1;
  const kiln::dtype ct = compute_dtype(b[in[0]].dt);
  if (n.attrs.c) {  // the score_mod's result, broadcast to [B, H, Tq, Tk]
    const int mod = b.cast(in[4], ct);
    Dims ms = b.shape(mod);
    while (ms.size() < 4) ms.insert(0, 1);
    s = b.reshape(b.expand(b.reshape(mod, ms), full), ss);
  } else {
    s = a.scores(b, in[0], in[1], in[3], n.attrs.b);
  }
  if (n.attrs.a) s = AttentionDims::causal_mask(b, s);
  const int m = b.shift_max(s, Dims{2});
  const int p = b.exp(b.sub(s, b.where(b.cmp(Op::eq, m, b.constant(-inf)), 0.0, m)));
  const int l = b.sum(p, Dims{2}, true);
  // p v in v's dtype (p in [0, 1], unnormalised), normalised in the compute dtype.
  const int pv = b.cast(b.matmul(b.cast(p, b[in[2]].dt), a.heads(b, in[2])), ct);
  const int o = b.div(pv, b.where(b.cmp(Op::eq, l, b.constant(0)), 1.0, l));
  return b.reshape(o, Dims{a.B, a.H, a.Tq, b.shape(in[2])[3]});
}
// What a score_mod receives (attrs.a): 0 the scaled score, 1..4 the batch, head, query and key
// index, each of shape [B, H, Tq, Tk].
constexpr int score_arg(Builder& b, const Node& n, std::span<const int> in) {
  const AttentionDims a(b, in[0], in[1]);
  const Dims full{a.B, a.H, a.Tq, a.Tk};
  if (n.attrs.a == 0) return b.reshape(a.scores(b, in[0], in[1], in[2], n.attrs.b), full);
  return b.iota(full, static_cast<int>(n.attrs.a - 1));
}

inline constexpr std::array<DecompositionRule, op_count> decompositions = [] {
  std::array<DecompositionRule, op_count> t{};
  auto set = [&](Op op, Decomposition f, std::uint8_t upcast) { t[static_cast<int>(op)] = {f, upcast}; };
  set(Op::silu, silu, 0b1);
  set(Op::gelu, gelu, 0b1);
  set(Op::gelu_tanh, gelu, 0b1);
  set(Op::clamp, clamp, 0);
  set(Op::mean, mean, 0b1);
  set(Op::var, var, 0b1);
  set(Op::logsumexp, logsumexp, 0b1);
  set(Op::softmax, softmax, 0b1);
  set(Op::log_softmax, log_softmax, 0b1);
  set(Op::layer_norm, layer_norm, 0b111);
  set(Op::rms_norm, rms_norm, 0b11);
  set(Op::cross_entropy, cross_entropy, 0b1);
  set(Op::mse_loss, mse_loss, 0b11);
  set(Op::linear, linear, 0);
  set(Op::transpose, transpose, 0);
  set(Op::unsqueeze, to_reshape, 0);
  set(Op::squeeze, to_reshape, 0);
  set(Op::argmax, arg_extremum, 0);
  set(Op::argmin, arg_extremum, 0);
  set(Op::cat, cat, 0);
  set(Op::attention, attention, 0);  // 16-bit GEMMs, the softmax in f32 (the rule casts)
  set(Op::score_arg, score_arg, 0);
  set(Op::sum_to_shape_of, sum_to_shape_of, 0);
  return t;
}();

// Composites whose primitive graph depends on sizes (grouped heads, broadcasts): on a structural graph they
// stay as they are, to be decomposed at the first call.
constexpr bool decomposes_by_size(Op op) {
  return op == Op::attention || op == Op::score_arg || op == Op::sum_to_shape_of;
}

// A gradient taken inside a function (grad_of over its grad_leaf arguments): kept, for
// autodiff/expand_gradients.hpp to differentiate the decomposed value.
constexpr bool expands_later(Op op) { return op == Op::grad_of || op == Op::grad_leaf; }

// Decomposes one composite: inputs to the compute dtype, the rule, the result back to n's dtype.
constexpr int decompose_node(Builder& b, const Node& n, std::span<const int> in) {
  if ((!b.shaped() && decomposes_by_size(n.op)) || expands_later(n.op)) return b.rebuild(n, in.data());
  b.set_origin(n.capture);
  const DecompositionRule& rule = decompositions[static_cast<int>(n.op)];
  if (!rule.build) throw error("decompose: no decomposition rule for composite op " + std::string(name(n.op)));
  const kiln::dtype compute = is_floating(n.dt) ? compute_dtype(n.dt) : n.dt;
  std::array<int, graph::max_inputs> args{};
  for (int k = 0; k < n.n_in; ++k) args[k] = (rule.upcast >> k & 1) && !b[in[k]].weak ? b.cast(in[k], compute) : in[k];
  int out = b.cast(rule.build(b, n, std::span<const int>(args.data(), n.n_in)), n.dt);
  if (b.shaped() && !(b.shape(out) == n.shape))
    throw error("decompose: the rule for " + std::string(name(n.op)) + " built shape " + b.shape(out).str() +
                " instead of " + n.shape.str());
  return out;
}

// Copies a leaf: arguments and scalars keep their slot, shape and dtype.
constexpr int copy_leaf(Builder& b, const Node& n) {
  if (n.op == Op::constant) return b.constant(n.value);
  return b.node(n);
}

}  // namespace detail

// Rebuilds g (with shapes, from graph::infer_shapes) with every composite replaced by primitives;
// nodes that no output needs are dropped.
constexpr graph::Graph decompose(const graph::Graph& g) {
  if (!std::is_constant_evaluated())
    debug::log_lazy(debug::Channel::decomp, [&] { return "before decompose:\n" + g.str(); });
  graph::Graph built = rebuild_graph(g, [](Builder& b, const graph::Node& n, const int* in) {
    if (info(n.op).cls == OpClass::leaf) return detail::copy_leaf(b, n);
    if (is_composite(n.op)) return detail::decompose_node(b, n, std::span<const int>(in, n.n_in));
    return b.rebuild(n, in);
  });
  graph::Graph out = remove_dead(built);
  if (!std::is_constant_evaluated())
    debug::log_lazy(debug::Channel::decomp, [&] {
      return "after decompose (" + std::to_string(g.count_ops()) + " ops -> " + std::to_string(out.count_ops()) +
             " ops):\n" + out.str();
    });
  return out;
}

}  // namespace kiln::rewrite
