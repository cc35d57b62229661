// simplify: algebraic clean-up after decomposition and differentiation, so the fuser never sees
// x*1, -(-x), casts and views that do nothing, constant-only arithmetic, duplicated subtrees or
// nodes no output needs. Only Op::constant operands (from rewrite rules) are folded: user scalars
// are run-time slots whose values change between calls without recompiling.
#pragma once
#include <array>
#include <cmath>
#include <cstdlib>
#include <numbers>
#include <optional>
#include <string>
#include <type_traits>

#include "../debug/log.hpp"
#include "builder.hpp"

namespace kiln::rewrite {

namespace detail {

// One simplification: given a node just built into b, the id that replaces it, or -1.
using Simplification = int (*)(Builder& b, int id);

constexpr bool foldable(Op op) {
  return is_pointwise(op) && !is_comparison(op) && op != Op::cast && op != Op::logical_not && op != Op::where;
}

constexpr double fold_value(Op op, double x, double y) {
  switch (op) {
    case Op::neg:
      return -x;
    case Op::abs:
      return std::abs(x);
    case Op::sign:
      return x > 0 ? 1.0 : x < 0 ? -1.0 : 0.0;
    case Op::exp:
      return std::exp(x);
    case Op::exp2:
      return std::exp2(x);
    case Op::log:
      return std::log(x);
    case Op::log2:
      return std::log2(x);
    case Op::log1p:
      return std::log1p(x);
    case Op::expm1:
      return std::expm1(x);
    case Op::sqrt:
      return std::sqrt(x);
    case Op::rsqrt:
      return 1.0 / std::sqrt(x);
    case Op::reciprocal:
      return 1.0 / x;
    case Op::square:
      return x * x;
    case Op::sin:
      return std::sin(x);
    case Op::cos:
      return std::cos(x);
    case Op::tanh:
      return std::tanh(x);
    case Op::sigmoid:
      return 1.0 / (1.0 + std::exp(-x));
    case Op::erf:
      return std::erf(x);
    case Op::relu:
      return x > 0 ? x : 0.0;
    case Op::add:
      return x + y;
    case Op::sub:
      return x - y;
    case Op::mul:
      return x * y;
    case Op::div:
      return x / y;
    case Op::maximum:
      return std::isnan(x) || std::isnan(y) ? NAN : std::max(x, y);
    case Op::minimum:
      return std::isnan(x) || std::isnan(y) ? NAN : std::min(x, y);
    case Op::pow:
      return std::pow(x, y);
    default:
      throw error("simplify: cannot fold op " + std::string(name(op)));
  }
}

// What a constant expression can fold: the C++20 <cmath> functions are not constexpr.
constexpr bool foldable_at_compile_time(Op op) {
  switch (op) {
    case Op::neg:
    case Op::sign:
    case Op::square:
    case Op::reciprocal:
    case Op::relu:
    case Op::add:
    case Op::sub:
    case Op::mul:
    case Op::div:
      return true;
    default:
      return false;
  }
}

// Arithmetic on constants only becomes one constant (constants are weak f64 scalars, so is the result).
constexpr int fold_constants(Builder& b, int id) {
  const graph::Node& n = b[id];
  if (!foldable(n.op) || n.dt != kiln::dtype::f64) return -1;
  if (std::is_constant_evaluated() && !foldable_at_compile_time(n.op)) return -1;
  for (int k = 0; k < n.n_in; ++k)
    if (b[n.in[k]].op != Op::constant) return -1;
  const double x = b[n.in[0]].value, y = n.n_in > 1 ? b[n.in[1]].value : 0.0;
  return b.constant(fold_value(n.op, x, y));
}

// x*1, 1*x, x+0, 0+x, x-0, x/1 -> x, when x already has the result's shape and dtype.
constexpr int drop_identity_operand(Builder& b, int id) {
  const graph::Node n = b[id];
  auto keeps = [&](int x) { return b.dt(x) == n.dt && b.shape(x) == n.shape && b[x].weak == n.weak; };
  auto is = [&](int k, double v) { return b.is_constant(n.in[k], v) && keeps(n.in[1 - k]); };
  switch (n.op) {
    case Op::mul:
      return is(1, 1) ? n.in[0] : is(0, 1) ? n.in[1] : -1;
    case Op::add:
      return is(1, 0) ? n.in[0] : is(0, 0) ? n.in[1] : -1;
    case Op::sub:
      return is(1, 0) ? n.in[0] : -1;
    case Op::div:
      return is(1, 1) ? n.in[0] : -1;
    default:
      return -1;
  }
}

constexpr int cancel_double_negation(Builder& b, int id) {
  const graph::Node& n = b[id];
  if (n.op != Op::neg || b[n.in[0]].op != Op::neg) return -1;
  const int x = b[n.in[0]].in[0];
  return b.dt(x) == n.dt ? x : -1;
}

constexpr int drop_noop_cast(Builder& b, int id) {
  const graph::Node& n = b[id];
  return n.op == Op::cast && b.dt(n.in[0]) == n.dt ? n.in[0] : -1;
}

// Views that change nothing (same shape; permute identity; a full slice with step 1) are their
// input; chains of reshapes, of expands and of permutes become one view (the Builder merges them).
constexpr int simplify_view(Builder& b, int id) {
  if (!b.shaped()) return -1;  // what a view does depends on sizes
  const graph::Node n = b[id];
  const int x = n.in[0];
  switch (n.op) {
    case Op::reshape: {
      int r = b.reshape(x, n.shape);
      return r == id ? -1 : r;
    }
    case Op::expand: {  // chains become one expand
      int r = b.expand(x, n.shape, n.n_in == 2 ? n.in[1] : -1);
      return r == id ? -1 : r;
    }
    case Op::permute: {
      int r = b.permute(x, n.attrs.dims);
      return r == id ? -1 : r;
    }
    case Op::slice: {
      const int rank = b.rank(x);
      const std::int64_t start =
          n.attrs.b < 0 ? n.attrs.b + (rank ? b.shape(x)[normalize_dim(n.attrs.a, rank, "slice")] : 1) : n.attrs.b;
      return b.shape(x) == n.shape && n.attrs.d == 1 && start <= 0 ? x : -1;
    }
    default:
      return -1;
  }
}

// gather(f(x), t) -> f(gather(x, t)) for a one-input pointwise f (a cross_entropy over bf16 logits
// picks from their f32 cast): a gather's source must be a buffer, so f(x) was written whole (a
// full-size f32 copy of the logits) only to read one element a row. The same through a reshape,
// gather(reshape(f(x)), t) -> f(gather(reshape(x), t)), which sink_reshape makes of
// `cast(reshape(logits, {B * T, V}), f32)`.
constexpr int gather_before_pointwise(Builder& b, int id) {
  const graph::Node n = b[id];
  if (n.op != Op::gather) return -1;
  graph::Node f = b[n.in[0]];
  const bool reshaped = f.op == Op::reshape && !f.attrs.keepdim && !f.sym_attrs && b.shaped();
  const Dims view = f.shape;
  if (reshaped) f = b[f.in[0]];
  if (!is_pointwise(f.op) || f.n_in != 1 || f.sym_attrs) return -1;
  const int source = reshaped ? b.reshape(f.in[0], view) : f.in[0];
  int picked = b.op(Op::gather, {source, n.in[1]}, n.attrs);
  int in[1] = {picked};
  graph::Node g = f;
  return b.rebuild(g, in);
}

// numel depends only on its input's shape: one node per shape rather than one per input.
constexpr int share_numel(Builder& b, int id) {
  if (!b.shaped()) return -1;  // which shapes are equal is known at run time only
  const graph::Node n = b[id];
  if (n.op != Op::numel) return -1;
  int r = b.numel(n.in[0], n.attrs.dims);
  return r == id ? -1 : r;
}

// f(expand(x), s...) -> expand(f(x, s...)) for a pointwise f whose other operands are rank-0 (a
// one-input f, or a division by a count), and reshape(expand(x)) -> expand(x reshaped to ones) for
// a one-element x: a broadcast moves towards its readers, where drop_broadcast_expands leaves it to
// their own broadcasting (a mean's gradient, negated and viewed as [N, 1, 1] in a cross_entropy's
// derivative, and a var's, divided by its degrees of freedom, named the compiling call's N).
constexpr int sink_expand(Builder& b, int id) {
  if (!b.shaped()) return -1;
  const graph::Node n = b[id];
  if (n.n_in < 1 || n.sym_attrs) return -1;
  if (is_pointwise(n.op)) {
    int in[3] = {-1, -1, -1}, expanded = -1;
    for (int k = 0; k < n.n_in; ++k) {
      const graph::Node& e = b[n.in[k]];
      in[k] = n.in[k];
      if (e.op == Op::expand && !e.sym_attrs && expanded < 0)
        expanded = k, in[k] = e.in[0];
      else if (b.rank(n.in[k]) != 0)
        return -1;
    }
    if (expanded < 0) return -1;
    const int like = b[n.in[expanded]].n_in == 2 ? b[n.in[expanded]].in[1] : -1;
    return b.expand(b.rebuild(n, in), n.shape, like);
  }
  if (n.n_in != 1) return -1;
  const graph::Node e = b[n.in[0]];
  if (e.op != Op::expand || e.sym_attrs) return -1;
  if (n.op != Op::reshape || b.shape(e.in[0]).product() != 1 || n.attrs.keepdim) return -1;
  Dims ones;
  for (int i = 0; i < n.shape.size(); ++i) ones.push_back(1);
  return b.expand(b.reshape(e.in[0], ones), n.shape);
}

// f(reshape(x)) -> reshape(f(x)) for a one-input pointwise f (a cast of a norm's gradient viewed
// as [B * T, d] for a matmul): f(x) keeps x's shape, so it joins the kernel that walks x's rows,
// and the view moves to its reader (a matmul reads a reshape of a buffer as a view:
// schedule/fuse.hpp's matmul_operand). A padded split's reshape (keepdim) stays.
constexpr int sink_reshape(Builder& b, int id) {
  if (!b.shaped()) return -1;
  const graph::Node n = b[id];
  if (!is_pointwise(n.op) || n.n_in != 1 || n.sym_attrs) return -1;
  const graph::Node r = b[n.in[0]];
  if (r.op != Op::reshape || r.attrs.keepdim || r.sym_attrs) return -1;
  int in[1] = {r.in[0]};
  return b.reshape(b.rebuild(n, in), n.shape);
}

inline constexpr std::array<Simplification, 9> simplifications = {
    fold_constants,          drop_identity_operand, cancel_double_negation,
    drop_noop_cast,          simplify_view,         share_numel,
    gather_before_pointwise, sink_expand,           sink_reshape};

// Builds node n (inputs already mapped) and applies the simplifications until none fires.
// A node with symbolic attributes stays as it is: what it does depends on each call's values.
constexpr int simplify_node(Builder& b, const graph::Node& n, const int* in) {
  int id = n.op == Op::constant ? b.constant(n.value) : b.rebuild(n, in);
  if (n.sym_attrs) return id;
  for (int round = 0; round < 16; ++round) {
    int next = -1;
    for (auto rule : simplifications)
      if ((next = rule(b, id)) >= 0 && next != id) break;
    if (next < 0 || next == id) return id;
    id = next;
  }
  return id;
}

// An expand whose every reader is a pointwise op that keeps its shape when it broadcasts the
// expand's input with its other operands is that op's own broadcasting: the input is read instead.
// The other operands count as their inputs where they are expands too (they may be dropped alike).
// A derivative broadcasts a reduction's cotangent to its input's shape (a mean's gradient: [1, 1]
// to [N, C]); as an expand it named the compiling call's N, and a program with symbolic sizes
// failed at every other N.
constexpr graph::Graph drop_broadcast_expands(const graph::Graph& g) {
  if (g.structural) return g;
  std::vector<char> keep(static_cast<std::size_t>(g.size()), 0);
  for (int o : g.outputs) keep[o] = 1;
  auto below = [&](int x) -> const Dims& { return g[x].op == Op::expand ? g[g[x].in[0]].shape : g[x].shape; };
  for (const graph::Node& u : g.nodes)
    for (int k = 0; k < u.n_in; ++k) {
      const int e = u.in[k];
      if (g[e].op != Op::expand || keep[e]) continue;
      std::optional<Dims> shape = g[g[e].in[0]].shape;
      if (!is_pointwise(u.op) || u.n_in < 2) shape.reset();
      for (int j = 0; shape && j < u.n_in; ++j)
        if (j != k) shape = try_broadcast_shapes(*shape, below(u.in[j]));
      if (!shape || !(*shape == u.shape)) keep[e] = 1;
    }
  bool any = false;
  for (int i = 0; i < g.size(); ++i) any = any || (g[i].op == Op::expand && !keep[i] && !g[i].sym_attrs);
  if (!any) return g;
  return remove_dead(rebuild_graph(g, [&](Builder& b, const graph::Node& n, const int* in) {
    const bool dropped = n.op == Op::expand && !keep[static_cast<std::size_t>(&n - g.nodes.data())] && !n.sym_attrs;
    return dropped ? in[0] : b.rebuild(n, in);
  }));
}

}  // namespace detail

// Simplifies g (with shapes); outputs keep their order and point at the simplified nodes.
constexpr graph::Graph simplify(const graph::Graph& g) {
  graph::Graph built =
      rebuild_graph(g, [](Builder& b, const graph::Node& n, const int* in) { return detail::simplify_node(b, n, in); });
  graph::Graph out = detail::drop_broadcast_expands(remove_dead(built));
  if (!std::is_constant_evaluated())
    debug::log_lazy(debug::Channel::decomp, [&] {
      return "after simplify (" + std::to_string(g.count_ops()) + " ops -> " + std::to_string(out.count_ops()) +
             " ops):\n" + out.str();
    });
  return out;
}

// (A @ B)^T = B^T @ A^T for 2-D matmuls whose only reader is the transpose (a weight gradient of
// k::linear comes out of autodiff that way): the library reads transposed operands through their
// strides, so the product is written in the layout wanted instead of being copied into it (two
// transposing copies of a linear's weight gradient saved: benchmarks/NOTES.md).
// (A Tuning's matmul_t knob keeps the transposing copies, for A/B runs: runtime/lower.hpp.)
inline graph::Graph fold_matmul_transposes(const graph::Graph& g) {
  std::vector<int> readers(g.size(), 0);
  for (const auto& n : g.nodes)
    for (int k = 0; k < n.n_in; ++k) ++readers[n.in[k]];
  for (int o : g.outputs) ++readers[o];
  bool any = false;
  graph::Graph built = rebuild_graph(g, [&](Builder& b, const graph::Node& n, const int* in) {
    const int m = n.n_in ? n.in[0] : -1;
    bool fold = n.op == Op::permute && n.shape.size() == 2 && n.attrs.dims == Dims{1, 0} && g[m].op == Op::matmul &&
                readers[m] == 1 && g[g[m].in[0]].shape.size() == 2 && g[g[m].in[1]].shape.size() == 2;
    if (!fold) return b.rebuild(n, in);
    any = true;
    const graph::Node& mm = b[in[0]];
    return b.matmul(b.transpose_last(mm.in[1]), b.transpose_last(mm.in[0]));
  });
  return any ? remove_dead(built) : g;
}

// A returned cast(matmul(a, b), f32) of 16-bit a and b, the cast the product's only reader and
// read by nothing but the caller -> one matmul written in f32 (attrs.a = 1, attrs.dt = f32:
// graph/infer_dtype.hpp): the library accumulates in f32 and writes it, instead of rounding to 16
// bits for a copy that widens it again (each weight gradient of a bf16 model over f32 master
// weights: a copy a weight a step saved; the result is the f32 sum, no longer rounded to 16 bits
// first). A cast that kernels read stays: they widen the 16-bit product as they load it, half
// the bytes of an f32 one (GPT-2's logits). So does one k::assign writes into an argument (`into`:
// the outputs' argument slots, -1 for none). CUDA programs (runtime/lower.hpp); a Tuning's
// matmul_wide knob keeps the cast.
inline graph::Graph widen_matmul_casts(const graph::Graph& g, const std::vector<int>& into) {
  std::vector<int> readers(g.size(), 0), returned(g.size(), 0);
  for (const auto& n : g.nodes)
    for (int k = 0; k < n.n_in; ++k) ++readers[n.in[k]];
  for (std::size_t o = 0; o < g.outputs.size(); ++o) {
    ++readers[g.outputs[o]];
    returned[g.outputs[o]] += o < into.size() && into[o] >= 0 ? -g.size() : 1;  // (assigned: never > 0)
  }
  bool any = false;
  graph::Graph built = rebuild_graph(g, [&](Builder& b, const graph::Node& n, const int* in) {
    const int m = n.n_in ? n.in[0] : -1;
    const int self = static_cast<int>(&n - g.nodes.data());
    const bool widen = n.op == Op::cast && n.dt == dtype::f32 && g[m].op == Op::matmul && !g[m].attrs.a &&
                       readers[m] == 1 && (g[m].dt == dtype::bf16 || g[m].dt == dtype::f16) && returned[self] > 0 &&
                       readers[self] == returned[self];
    if (!widen) return b.rebuild(n, in);
    any = true;
    graph::Node mm = b[in[0]];
    mm.attrs.a = 1;
    mm.attrs.dt = dtype::f32;
    return b.rebuild(mm, mm.in.data());
  });
  return any ? remove_dead(built) : g;
}

}  // namespace kiln::rewrite
