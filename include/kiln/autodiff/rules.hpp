// Derivative rules: one table entry per primitive op giving the cotangents of its inputs from the
// cotangent of its output (as tinygrad's pm_gradient). Composites have no entry: they are
// decomposed first. Broadcast inputs get their cotangent summed back to their shape.
#pragma once
#include <array>
#include <initializer_list>
#include <numbers>
#include <vector>

#include "../rewrite/builder.hpp"
#include "../rewrite/decompose.hpp"
#include "score_mods.hpp"

namespace kiln::autodiff {

using rewrite::Builder;

// The cotangents of a node's inputs (ids in the builder); -1 where an input gets none. (A rule that
// lists fewer than max_inputs leaves the rest 0: it is read only up to the node's input count.)
using Cotangents = std::array<int, graph::max_inputs>;
// A rule: the input cotangents of node y given g, the cotangent of y (both ids in b).
using Rule = Cotangents (*)(Builder& b, int y, int g);

inline constexpr Cotangents no_cotangents = [] {
  Cotangents c{};
  c.fill(-1);
  return c;
}();

namespace rules {

constexpr int in(const Builder& b, int y, int k) { return b[y].in[k]; }
constexpr int x0(const Builder& b, int y) { return b[y].in[0]; }
// The cotangent of input k of a broadcasting op: c (of y's shape) summed over the dims that input
// was broadcast along, back to its shape (on a structural graph, a sum_to_shape_of node unless the
// input has y's shape at any sizes).
constexpr int back(Builder& b, int y, int k, int c) { return b.sum_to_shape_of(c, in(b, y, k), y); }

constexpr Cotangents none(Builder&, int, int) { return no_cotangents; }
// A grad_leaf is its input (autodiff/expand_gradients.hpp: the value's backward ends there, its
// input needing no gradient of that group).
constexpr Cotangents grad_leaf(Builder&, int, int g) { return {g, -1, -1, -1}; }
constexpr Cotangents neg(Builder& b, int, int g) { return {b.neg(g), -1, -1, -1}; }
constexpr Cotangents abs(Builder& b, int y, int g) { return {b.mul(g, b.unary(Op::sign, x0(b, y))), -1, -1, -1}; }
constexpr Cotangents exp(Builder& b, int y, int g) { return {b.mul(g, y), -1, -1, -1}; }
constexpr Cotangents exp2(Builder& b, int y, int g) { return {b.mul(g, b.mul(y, std::numbers::ln2)), -1, -1, -1}; }
constexpr Cotangents log(Builder& b, int y, int g) { return {b.div(g, x0(b, y)), -1, -1, -1}; }
constexpr Cotangents log2(Builder& b, int y, int g) {
  return {b.div(g, b.mul(x0(b, y), std::numbers::ln2)), -1, -1, -1};
}
constexpr Cotangents log1p(Builder& b, int y, int g) { return {b.div(g, b.add(x0(b, y), 1.0)), -1, -1, -1}; }
constexpr Cotangents expm1(Builder& b, int y, int g) { return {b.mul(g, b.add(y, 1.0)), -1, -1, -1}; }
constexpr Cotangents sqrt(Builder& b, int y, int g) { return {b.div(b.mul(g, 0.5), y), -1, -1, -1}; }
// d rsqrt(x) = -x^(-3/2) / 2 = -y^3 / 2
constexpr Cotangents rsqrt(Builder& b, int y, int g) {
  return {b.mul(b.mul(g, -0.5), b.mul(b.square(y), y)), -1, -1, -1};
}
constexpr Cotangents reciprocal(Builder& b, int y, int g) { return {b.neg(b.mul(g, b.square(y))), -1, -1, -1}; }
constexpr Cotangents square(Builder& b, int y, int g) { return {b.mul(g, b.mul(x0(b, y), 2.0)), -1, -1, -1}; }
constexpr Cotangents sin(Builder& b, int y, int g) { return {b.mul(g, b.unary(Op::cos, x0(b, y))), -1, -1, -1}; }
constexpr Cotangents cos(Builder& b, int y, int g) { return {b.neg(b.mul(g, b.unary(Op::sin, x0(b, y)))), -1, -1, -1}; }
constexpr Cotangents tanh(Builder& b, int y, int g) { return {b.mul(g, b.sub(1.0, b.square(y))), -1, -1, -1}; }
constexpr Cotangents sigmoid(Builder& b, int y, int g) { return {b.mul(g, b.mul(y, b.sub(1.0, y))), -1, -1, -1}; }
constexpr Cotangents erf(Builder& b, int y, int g) {  // 2/sqrt(pi) exp(-x^2)
  int d = b.mul(b.exp(b.neg(b.square(x0(b, y)))), 2 * std::numbers::inv_sqrtpi);
  return {b.mul(g, d), -1, -1, -1};
}
constexpr Cotangents relu(Builder& b, int y, int g) {
  return {b.where(b.cmp(Op::gt, y, b.constant(0)), g, 0.0), -1, -1, -1};
}
constexpr Cotangents cast(Builder& b, int y, int g) {  // differentiate() casts g to the input's dtype
  return is_floating(b.dt(x0(b, y))) ? Cotangents{g, -1, -1, -1} : no_cotangents;
}

constexpr Cotangents add(Builder& b, int y, int g) { return {back(b, y, 0, g), back(b, y, 1, g), -1, -1}; }
constexpr Cotangents sub(Builder& b, int y, int g) { return {back(b, y, 0, g), back(b, y, 1, b.neg(g)), -1, -1}; }
constexpr Cotangents mul(Builder& b, int y, int g) {
  const int l = in(b, y, 0), r = in(b, y, 1);
  return {back(b, y, 0, b.mul(g, r)), back(b, y, 1, b.mul(g, l)), -1, -1};
}
constexpr Cotangents div(Builder& b, int y, int g) {  // d/dr (l / r) = -y / r
  const int r = in(b, y, 1);
  return {back(b, y, 0, b.div(g, r)), back(b, y, 1, b.neg(b.div(b.mul(g, y), r))), -1, -1};
}
// Ties share the cotangent equally, as PyTorch's maximum/minimum backward does.
constexpr Cotangents select(Builder& b, int y, int g, Op wins_left) {
  const int l = in(b, y, 0), r = in(b, y, 1);
  const Op wins_right = wins_left == Op::gt ? Op::lt : Op::gt;
  int tie = b.where(b.cmp(Op::eq, l, r), b.mul(g, 0.5), 0.0);
  return {back(b, y, 0, b.where(b.cmp(wins_left, l, r), g, tie)),
          back(b, y, 1, b.where(b.cmp(wins_right, l, r), g, tie)), -1, -1};
}
constexpr Cotangents maximum(Builder& b, int y, int g) { return select(b, y, g, Op::gt); }
constexpr Cotangents minimum(Builder& b, int y, int g) { return select(b, y, g, Op::lt); }
// d/dx x^p = p x^(p-1) (0 when p == 0, even at x == 0); d/dp x^p = x^p log x
constexpr Cotangents pow(Builder& b, int y, int g) {
  const int x = in(b, y, 0), p = in(b, y, 1);
  int dx = b.mul(b.mul(g, p), b.op(Op::pow, {x, b.sub(p, b.constant(1))}));
  dx = b.where(b.cmp(Op::eq, p, b.constant(0)), 0.0, dx);
  return {back(b, y, 0, dx), back(b, y, 1, b.mul(b.mul(g, y), b.log(x))), -1, -1};
}
constexpr Cotangents where(Builder& b, int y, int g) {
  const int c = in(b, y, 0);
  return {-1, back(b, y, 1, b.where(c, g, 0.0)), back(b, y, 2, b.where(c, 0.0, g)), -1};
}

// The shape a reduction's output has with keepdim, and its normalised dims.
constexpr Dims kept_shape(const Builder& b, int y, Dims& rd) {
  const graph::Node& n = b[y];
  if (!b.shaped()) {  // structural: the dims as captured, the shape unknown
    rd = n.attrs.dims;
    return {};
  }
  rd = graph::detail::reduced_dims(n.attrs, b.rank(n.in[0]), n.op);
  return graph::detail::reduced_shape(b.shape(n.in[0]), rd, true);
}
constexpr Cotangents sum(Builder& b, int y, int g) {
  Dims rd;
  const Dims kept = kept_shape(b, y, rd);
  return {b.expand(b.reshape(g, kept), b.shape(x0(b, y)), x0(b, y)), -1, -1, -1};
}
// amax/amin: the cotangent goes to the elements equal to the result, split evenly among ties.
constexpr Cotangents extremum(Builder& b, int y, int g) {
  if (b[y].attrs.d == Builder::detached_shift) return no_cotangents;
  Dims rd;
  const Dims kept = kept_shape(b, y, rd);
  const int x = x0(b, y);
  int mask = b.cmp(Op::eq, x, b.reshape(y, kept));
  int count = b.sum(b.cast(mask, b.dt(x)), rd, true);
  return {b.where(mask, b.div(b.reshape(g, kept), count), 0.0), -1, -1, -1};
}

// sum_to_shape_of is built on structural graphs (with sizes the Builder settles it at once): the
// cotangent of the summed input is g broadcast back over it.
constexpr Cotangents sum_to_shape_of(Builder& b, int y, int g) {
  const int x = x0(b, y);
  return {b.expand(g, b.shape(x), x), -1, -1, -1};
}

constexpr Cotangents reshape(Builder& b, int y, int g) { return {b.reshape(g, b.shape(x0(b, y))), -1, -1, -1}; }
constexpr Cotangents permute(Builder& b, int y, int g) {
  const Dims order = b[y].attrs.dims;
  Dims inverse = order;
  for (int i = 0; i < order.size(); ++i) inverse[static_cast<int>(order[i])] = i;
  return {b.permute(g, inverse), -1, -1, -1};
}
// A slice's gradient scatters into zeros of the input's shape, at the same (maybe symbolic) bounds,
// and the other way: each view sized from x (graph/infer_views.hpp's sized_view_shape), which a program
// with symbolic sizes serves at every size of x.
constexpr Cotangents slice(Builder& b, int y, int g) {
  const graph::Node n = b[y];  // a copy: adding nodes may move the table
  const int like = b.shape_of(n.in[0]);
  Attrs at = n.attrs;
  at.dims = {};
  return {b.op_like(n, Op::slice_backward, {g, like}, at), -1, -1, -1};
}
constexpr Cotangents slice_backward(Builder& b, int y, int g) {
  const graph::Node n = b[y];
  Attrs at = n.attrs;
  at.dims = {};
  if (n.n_in == 1) return {b.op_like(n, Op::slice, {g}, at), -1, -1, -1};
  const int like = b.shape_of(n.in[0]);
  return {b.op_like(n, Op::slice, {g, like}, at), -1, -1, -1};
}
constexpr Cotangents expand(Builder& b, int y, int g) { return {back(b, y, 0, g), -1, -1, -1}; }

// gather(x, idx) along the last dim: dx[..., c] = sum_j g[..., j] * (idx[..., j] == c), through a
// one-hot [..., J, C] built from x's classes' indices (no scatter needed).
constexpr Cotangents gather(Builder& b, int y, int g) {
  const int x = x0(b, y), idx = in(b, y, 1);
  const Dims is = b.shape(idx);
  Dims col = is;
  col.push_back(1);
  const int classes = b.iota_of(x, std::max(b.rank(x) - 1, 0), col.size(), col.size() - 1);  // [1, .., 1, C]
  int hit = b.cmp(Op::eq, b.reshape(idx, col), classes);
  int spread = b.where(hit, b.reshape(g, col), 0.0);
  return {b.sum(spread, Dims{col.size() - 2}, false), -1, -1, -1};
}

// embedding(table, ids): the table's cotangent sums g's rows at each id (embedding_backward, an
// extern step that adds in a fixed order: deterministic); embedding_backward's own cotangent is the
// rows of its cotangent at the ids. The ids get none. Its row count is the table's, read through a
// shape_of node (a third input the step does not load), so that a program with symbolic sizes
// serves every vocabulary size.
constexpr Cotangents embedding(Builder& b, int y, int g) {
  const int table = x0(b, y), ids = in(b, y, 1);
  const int rows = b.shape_of(table);
  return {b.op(Op::embedding_backward, {g, ids, rows}), -1, -1, -1};
}
constexpr Cotangents embedding_backward(Builder& b, int y, int g) {
  return {b.op(Op::embedding, {g, in(b, y, 1)}), -1, -1, -1};
}

// y = a @ b: da = g @ b^T, db = a^T @ g; a 2-D b under a batched a gets the batch folded into rows.
constexpr Cotangents matmul(Builder& b, int y, int g) {
  const int l = in(b, y, 0), r = in(b, y, 1);
  int dl = b.matmul(g, b.transpose_last(r));
  int dr;
  if (b.rank(l) == 3 && b.rank(r) == 2) {
    const Dims ls = b.shape(l), gs = b.shape(g);
    int l2 = b.reshape(l, Dims{ls[0] * ls[1], ls[2]}), g2 = b.reshape(g, Dims{gs[0] * gs[1], gs[2]});
    dr = b.matmul(b.transpose_last(l2), g2);
  } else {
    dr = b.matmul(b.transpose_last(l), g);
  }
  return {dl, dr, -1, -1};
}

// attention_flash (the fused kernel's node). With attrs.keepdim (lowering's choice: the fused
// backward) two or three kernels read q, k, v, the cotangent and the row statistics [B, H, Tq, 2]
// (each row's log-sum-exp, attention_lse, which the forward's kernel writes beside o where both
// are in one program (schedule/attention_lse.hpp); and delta = sum(g * o), a reduction),
// recomputing the probabilities tile by tile; else the backward is built from primitives with the
// probabilities materialised (rewrite/decompose.hpp's attention_backward). The scale gets no
// cotangent.
// The nodes of a rank-0 graph f (a score_mod's: autodiff/score_mods.hpp) over the nodes `args`
// (by argument slot), which broadcast its pointwise ops; its outputs' ids.
inline std::vector<int> inline_graph(Builder& b, const graph::Graph& f, const std::vector<int>& args) {
  std::vector<int> map(static_cast<std::size_t>(f.size()), -1);
  for (int i = 0; i < f.size(); ++i) {
    const graph::Node& n = f[i];
    if (n.op == Op::arg) {
      map[i] = args.at(static_cast<std::size_t>(n.slot));
    } else if (n.op == Op::constant) {
      map[i] = b.constant(n.value);
    } else if (n.op == Op::scalar) {
      map[i] = b.node(n);  // the program's scalar slot (scalars are never merged)
    } else {
      std::array<int, graph::max_inputs> in{};
      for (int k = 0; k < n.n_in; ++k) in[k] = map[n.in[k]];
      map[i] = b.rebuild(n, in.data());
    }
  }
  std::vector<int> out;
  for (int o : f.outputs) out.push_back(map[o]);
  return out;
}

// The cotangents of the floating tensors an inlined score_mod reads (attention_flash's inputs after
// the scale), into c: the probabilities materialised ([B, H, Tq, Tk], as rewrite/decompose.hpp's
// attention_backward), dS of the modded scores, and the mod's derivative in each tensor at each
// score (its vjp) summed back to the tensor's shape. A tensor whose gradient nobody asks for leaves
// these nodes dead.
inline void captured_cotangents(Builder& b, const graph::Node& n, int g16, int lse, int delta, Cotangents& c) {
  const ScoreMod& m = ScoreMods::instance().get(n.attrs.custom);
  if (m.grads.empty()) return;
  const int q = n.in[0], k = n.in[1], v = n.in[2], scale = n.in[3];
  const rewrite::detail::AttentionDims a(b, q, k);
  const Dims full{a.B, a.H, a.Tq, a.Tk};
  std::vector<int> args(ScoreMod::first_captured_arg + m.captured.size(), -1);
  // The scores and dp = dO . v in f32, from widened operands, as the kernels compute them: p must
  // agree with the kernels' log-sum-exp, and p (dp - delta) cancels where p is near 1, where a dp
  // rounded to 16 bits (a 16-bit GEMM's output) left |dp| 2^-9 against delta's f32 sum (0.056 in a
  // bias's gradient at D 128 on an H200).
  const kiln::dtype f32 = kiln::dtype::f32;
  args[0] = b.reshape(a.scores(b, b.cast(q, f32), b.cast(k, f32), scale, n.attrs.b), full);
  for (int d = 0; d < 4; ++d) args[1 + static_cast<std::size_t>(d)] = b.iota(full, d);
  for (std::size_t t = 0; t < m.captured.size(); ++t) args[ScoreMod::first_captured_arg + t] = n.in[4 + t];
  int s = inline_graph(b, m.mod, args)[0];
  if (n.attrs.a) s = b.where(b.cmp(Op::le, args[4], args[3]), s, -rewrite::inf);  // causal: key j <= query i
  const int p = b.exp(b.sub(s, b.reshape(lse, Dims{a.B, a.H, a.Tq, 1})));
  const int go = b.reshape(b.cast(g16, f32), Dims{a.B * a.H, a.Tq, b.shape(v)[3]});
  const int dp = b.matmul(go, b.permute(b.cast(a.heads(b, v), f32), Dims{0, 2, 1}));
  args[ScoreMod::cotangent_arg] = b.mul(p, b.sub(b.reshape(dp, full), delta));
  const std::vector<int> d = inline_graph(b, m.vjp, args);
  for (std::size_t t = 0; t < m.grads.size(); ++t) {
    const int x = n.in[4 + m.grads[t]];
    c[4 + static_cast<std::size_t>(m.grads[t])] = b.sum_to_shape_of(d[1 + t], x);
  }
}

constexpr Cotangents attention_flash(Builder& b, int y, int g) {
  const graph::Node n = b[y];  // a copy: adding nodes below may move the table
  const int q = n.in[0], k = n.in[1], v = n.in[2], scale = n.in[3];
  if (!n.attrs.keepdim) {
    if (n.attrs.custom >= 0)  // (lowering inlines a mod only with the fused backward)
      throw error("attention: the materialised backward has no rule for an inlined score_mod");
    const auto d = rewrite::detail::attention_backward(b, n, q, k, v, scale, g);
    return {d[0], d[1], d[2], -1};
  }
  Attrs at;
  at.a = n.attrs.a;  // causal
  at.b = n.attrs.b;  // the scale given
  at.d = n.attrs.dims.size() > 1 ? n.attrs.dims[1] : 0;  // the gradients' kernels on Hopper too
  at.custom = n.attrs.custom;                            // the score_mod the kernels inline (-1: none)
  // The fused nodes, with the tensors an inlined score_mod reads after their own inputs.
  auto fused = [&](Op op, std::initializer_list<int> in) {
    graph::Node f;
    f.op = op;
    f.attrs = at;
    for (int x : in) f.in[f.n_in++] = x;
    for (int x = 4; x < n.n_in; ++x) f.in[f.n_in++] = n.in[x];
    return b.node(f);
  };
  const int g16 = b.cast(g, n.dt);
  const int lse = fused(Op::attention_lse, {q, k, scale});
  const int delta = b.sum(b.mul(b.cast(g16, kiln::dtype::f32), b.cast(y, kiln::dtype::f32)), Dims{3}, true);
  Dims row = b.shape(lse);
  row.push_back(1);
  // [B, H, Tq, 2]: the pair's index broadcast from [1, 1, 1, 2], so that no size of the compiling
  // call is named (a program with symbolic sizes then serves every sequence length).
  const int pair = b.iota(Dims{1, 1, 1, 2}, 3);
  const int stats = b.where(b.cmp(Op::eq, pair, b.constant(0)), b.reshape(lse, row), delta);
  Cotangents c = no_cotangents;
  if (n.attrs.custom >= 0) captured_cotangents(b, n, g16, lse, delta, c);
  const std::int64_t D = b.shape(k)[3];
  const bool warpgroup = at.d != 0 && (D == 64 || D == 128);
  // Hopper, q, k and v of one shape, where the registers hold it (or KILN_TUNE_ATTENTION_DQ=1
  // asks): dq, dk and dv from one kernel, stacked as [5, B, H, T, D] (dk, dv, dq, then the
  // kernel's f32 sums of dq): views.
  const std::int64_t dq_knob = n.attrs.dims.size() > 2 ? n.attrs.dims[2] : 0;
  if (warpgroup && (dq_knob > 0 || (dq_knob < 0 && graph::detail::fused_attention_joins_dq(D))) &&
      b.shape(q) == b.shape(k) && b.shape(q) == b.shape(v)) {
    at.c = 4;
    const int all = fused(Op::attention_grad, {q, k, v, g16, stats, scale});
    for (int which = 0; which < 3; ++which) {
      Attrs third;
      const int at_ = which == 0 ? 2 : which - 1;  // slots: dk, dv, dq
      third.a = 0, third.b = at_, third.c = at_ + 1, third.d = 1;
      c[static_cast<std::size_t>(which)] = b.reshape(b.op(Op::slice, {all}, third), b.shape(q));
    }
    return c;
  }
  at.c = 0;  // dq
  c[0] = fused(Op::attention_grad, {q, k, v, g16, stats, scale});
  // (dk and dv join in one kernel where it holds both; with a mod, the mma.sync kernel also holds
  // the scaled scores, Hopper's warpgroup kernel not: it takes D 64 and 128)
  if (graph::detail::fused_attention_joins_dk_dv(D, n.attrs.custom >= 0 && !warpgroup)) {
    at.c = 3;  // dk and dv in one kernel, stacked: views of its halves
    const int both = fused(Op::attention_grad, {q, k, v, g16, stats, scale});
    for (int which = 1; which < 3; ++which) {
      Attrs half;
      half.a = 0, half.b = which - 1, half.c = which, half.d = 1;  // slice dim 0 [which - 1, which)
      c[which] = b.reshape(b.op(Op::slice, {both}, half), b.shape(which == 1 ? k : v));
    }
    return c;
  }
  for (int which = 1; which < 3; ++which) {
    at.c = which;  // dk, dv
    c[which] = fused(Op::attention_grad, {q, k, v, g16, stats, scale});
  }
  return c;
}
inline Cotangents attention_backward_node(Builder&, int, int) {
  throw error("attention: its fused backward cannot be differentiated again (no double backward)");
}

// A custom op: one custom_backward node per floating input, reading the op's inputs and g and giving
// that input's gradient through the user's backward (nodes whose gradient nobody needs are dropped as
// dead code, so backward runs once per needed gradient). Without a backward this is the error.
// (Not constexpr: the registry is a run-time table; k::structure does not differentiate custom ops.)
static_assert(custom_ops::max_inputs < graph::max_inputs,
              "a custom op's backward node holds its inputs and the cotangent");
inline Cotangents custom(Builder& b, int y, int g) {
  const graph::Node n = b[y];  // a copy: adding nodes below may move the table
  const custom_ops::Entry& e = custom_ops::entry(n.attrs.custom);
  if (!e.fns.backward)
    throw error(e.prefix() + "cannot be differentiated: it has no backward; give k::custom_op a .backward function");
  Cotangents c = no_cotangents;
  for (int k = 0; k < n.n_in; ++k) {
    if (!is_floating(b.dt(n.in[k]))) continue;
    graph::Node bw;
    bw.op = Op::custom_backward;
    for (int i = 0; i < n.n_in; ++i) bw.in[bw.n_in++] = n.in[i];
    bw.in[bw.n_in++] = b.cast(g, n.dt);
    bw.attrs.custom = n.attrs.custom;
    bw.attrs.a = k;
    c[k] = b.node(bw);
  }
  return c;
}
inline Cotangents custom_backward(Builder& b, int y, int) {
  throw error(custom_ops::entry(b[y].attrs.custom).prefix() +
              "its backward cannot be differentiated again (no double backward)");
}

}  // namespace rules

// The table: nullptr for composites (decompose first; sum_to_shape_of, which only structural graphs
// hold, has its rule); `none` for ops without a gradient.
inline constexpr std::array<Rule, rewrite::op_count> derivative_rules = [] {
  std::array<Rule, rewrite::op_count> t{};
  auto set = [&](Op op, Rule r) { t[static_cast<int>(op)] = r; };
  for (Op op : {Op::arg, Op::scalar, Op::constant, Op::iota, Op::numel, Op::iota_of, Op::shape_of, Op::sign,
                Op::logical_not, Op::lt, Op::le, Op::gt, Op::ge, Op::eq, Op::ne, Op::rand})
    set(op, rules::none);
  set(Op::neg, rules::neg);
  set(Op::abs, rules::abs);
  set(Op::exp, rules::exp);
  set(Op::exp2, rules::exp2);
  set(Op::log, rules::log);
  set(Op::log2, rules::log2);
  set(Op::log1p, rules::log1p);
  set(Op::expm1, rules::expm1);
  set(Op::sqrt, rules::sqrt);
  set(Op::rsqrt, rules::rsqrt);
  set(Op::reciprocal, rules::reciprocal);
  set(Op::square, rules::square);
  set(Op::sin, rules::sin);
  set(Op::cos, rules::cos);
  set(Op::tanh, rules::tanh);
  set(Op::sigmoid, rules::sigmoid);
  set(Op::erf, rules::erf);
  set(Op::relu, rules::relu);
  set(Op::cast, rules::cast);
  set(Op::add, rules::add);
  set(Op::sub, rules::sub);
  set(Op::mul, rules::mul);
  set(Op::div, rules::div);
  set(Op::maximum, rules::maximum);
  set(Op::minimum, rules::minimum);
  set(Op::pow, rules::pow);
  set(Op::where, rules::where);
  set(Op::sum, rules::sum);
  set(Op::amax, rules::extremum);
  set(Op::amin, rules::extremum);
  set(Op::sum_to_shape_of, rules::sum_to_shape_of);
  set(Op::grad_leaf, rules::grad_leaf);
  set(Op::reshape, rules::reshape);
  set(Op::permute, rules::permute);
  set(Op::slice, rules::slice);
  set(Op::slice_backward, rules::slice_backward);
  set(Op::expand, rules::expand);
  set(Op::gather, rules::gather);
  set(Op::embedding, rules::embedding);
  set(Op::embedding_backward, rules::embedding_backward);
  set(Op::matmul, rules::matmul);
  set(Op::attention_flash, rules::attention_flash);
  set(Op::attention_lse, rules::attention_backward_node);
  set(Op::attention_grad, rules::attention_backward_node);
  set(Op::custom, rules::custom);
  set(Op::custom_backward, rules::custom_backward);
  return t;
}();

}  // namespace kiln::autodiff
