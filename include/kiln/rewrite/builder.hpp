// Builder: how rewrite and derivative rules add nodes to a graph. Every new node is shared with an
// identical one already there (CSE, so rule outputs form a DAG, never copies of subtrees) and gets
// its shape and dtype at once, so the next rule can read them. The named helpers skip no-ops (a cast
// to the same dtype, a reshape to the same shape) and merge chains of views.
// On a structural graph (no sizes: k::structure, in a constant expression) the same rules run with
// dtypes only: nodes whose attributes need sizes (views, reductions, iota, numel) are built as they
// are, marked unsized and tagged with the node they come from (set_origin), and the size-dependent
// no-op checks are left to the run time.
#pragma once
#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../graph/infer.hpp"
#include "../graph/infer_dtype.hpp"

namespace kiln::rewrite {

inline constexpr int op_count = static_cast<int>(op_table.size());

inline constexpr double inf = std::numeric_limits<double>::infinity();

class Builder {
 public:
  constexpr Builder() = default;
  // Starts from a graph (inferred, or structural) and keeps its node ids (the forward part of a
  // joint graph).
  constexpr explicit Builder(graph::Graph base) : g_(std::move(base)) { index_.index_all(g_); }
  // An empty builder of a graph like g: with sizes, or structural.
  static constexpr Builder like(const graph::Graph& g) {
    Builder b;
    b.g_.structural = g.structural;
    return b;
  }

  constexpr graph::Graph& graph() { return g_; }
  constexpr const graph::Graph& graph() const { return g_; }
  constexpr const graph::Node& operator[](int i) const { return g_[i]; }
  constexpr int size() const { return g_.size(); }
  // Whether nodes have shapes (false on a structural graph: rules then skip what reads sizes).
  constexpr bool shaped() const { return !g_.structural; }
  // The node that the next unsized nodes stand for (structural graphs only; see above).
  constexpr void set_origin(int origin) { origin_ = origin; }
  // By value: a reference would dangle once the next node is added.
  constexpr Dims shape(int i) const { return g_[i].shape; }
  constexpr kiln::dtype dt(int i) const { return g_[i].dt; }
  constexpr int rank(int i) const { return g_[i].shape.size(); }
  constexpr bool is_constant(int i, double v) const { return g_[i].op == Op::constant && g_[i].value == v; }

  // Adds n (its inputs already in this graph; leaves other than constants carry their shape) or
  // returns the id of an identical node. Scalars are never merged: each is its own run-time slot.
  constexpr int node(graph::Node n) {
    if (!shaped() && sized_attrs(n.op) && n.capture < 0) {
      n.unsized = true;
      n.capture = origin_;
    }
    const std::uint64_t k = graph::structure_key(n);
    if (int at = index_.find(g_, n, k); at >= 0) return at;
    if (n.op == Op::constant) {
      n.shape = {};
      n.dt = kiln::dtype::f64;
      n.weak = true;
    }
    g_.nodes.push_back(n);
    if (info(n.op).cls != OpClass::leaf || n.op == Op::iota) {
      if (shaped())
        graph::detail::infer_node(g_, g_.nodes.back());
      else
        graph::detail::infer_dtype(g_, g_.nodes.back());
    }
    index_.insert(k, g_.size() - 1);
    return g_.size() - 1;
  }
  constexpr int op(Op o, std::initializer_list<int> in, Attrs at = {}) {
    graph::Node n;
    n.op = o;
    for (int i : in) n.in[n.n_in++] = i;
    n.attrs = at;
    return node(n);
  }
  // A node standing for `like` (a derivative of it): it takes like's captured attributes and
  // their symbolic bits, so that each call's values reach it too.
  constexpr int op_like(const graph::Node& like, Op o, std::initializer_list<int> in, Attrs at) {
    graph::Node n;
    n.op = o;
    for (int i : in) n.in[n.n_in++] = i;
    n.attrs = at;
    n.capture = like.capture;
    n.sym_attrs = like.sym_attrs;
    n.unsized = like.unsized;
    return node(n);
  }
  // A copy of node n of another graph with its inputs replaced by `in` (ids in this graph).
  constexpr int rebuild(const graph::Node& n, const int* in) {
    graph::Node m = n;
    for (int k = 0; k < m.n_in; ++k) m.in[k] = in[k];
    if (info(m.op).cls != OpClass::leaf) m.shape = {};
    return node(m);
  }

  constexpr int constant(double v) {
    graph::Node n;
    n.op = Op::constant;
    n.value = v;
    return node(n);
  }

  // ---- pointwise ------------------------------------------------------------------------------
  constexpr int unary(Op o, int x) { return op(o, {x}); }
  constexpr int neg(int x) { return op(Op::neg, {x}); }
  constexpr int square(int x) { return op(Op::square, {x}); }
  constexpr int exp(int x) { return op(Op::exp, {x}); }
  constexpr int log(int x) { return op(Op::log, {x}); }
  constexpr int add(int a, int b) { return op(Op::add, {a, b}); }
  constexpr int sub(int a, int b) { return op(Op::sub, {a, b}); }
  constexpr int mul(int a, int b) { return op(Op::mul, {a, b}); }
  constexpr int div(int a, int b) { return op(Op::div, {a, b}); }
  constexpr int add(int a, double c) { return add(a, constant(c)); }
  constexpr int mul(int a, double c) { return mul(a, constant(c)); }
  constexpr int sub(double c, int b) { return sub(constant(c), b); }
  constexpr int where(int c, int a, int b) { return op(Op::where, {c, a, b}); }
  constexpr int where(int c, int a, double b) { return where(c, a, constant(b)); }
  constexpr int where(int c, double a, int b) { return where(c, constant(a), b); }
  constexpr int cmp(Op o, int a, int b) { return op(o, {a, b}); }
  constexpr int cast(int x, kiln::dtype d) {
    if (g_[x].dt == d) return x;
    Attrs at;
    at.dt = d;
    return op(Op::cast, {x}, at);
  }

  // ---- reductions (dims normalised and sorted) ---------------------------------------------------
  constexpr int reduce(Op o, int x, const Dims& dims, bool keepdim) {
    Attrs at;
    at.dims = dims;
    at.keepdim = keepdim;
    return op(o, {x}, at);
  }
  constexpr int sum(int x, const Dims& dims, bool keepdim) { return reduce(Op::sum, x, dims, keepdim); }
  // amax used only as a numerically stabilising shift (softmax, logsumexp): the result does not
  // depend on its value, so it is marked (attrs.d) to get no gradient, as PyTorch's decompositions
  // .detach() it; this drops a reduction and a mask from every softmax backward.
  static constexpr std::int64_t detached_shift = Attrs::shift_flag;
  constexpr int shift_max(int x, const Dims& dims) {
    Attrs at;
    at.dims = dims;
    at.keepdim = true;
    at.d = detached_shift;
    return op(Op::amax, {x}, at);
  }
  // The element count of x's dims `dims`, a weak f64 scalar that stays symbolic in the graph.
  constexpr int numel(int x, const Dims& dims) { return reduce(Op::numel, shape_source(x), dims, false); }
  constexpr int mean(int x, const Dims& dims, bool keepdim) { return div(sum(x, dims, keepdim), numel(x, dims)); }

  // ---- views and indexing ----------------------------------------------------------------------
  // g summed over the dims that x was broadcast along, then reshaped to x's shape (a broadcast
  // input's cotangent). With sizes that is a sum and a reshape, or g itself; on a structural graph
  // it is g itself where g is known to have the shape of a node `like` that x has at any sizes
  // (same_shape), else one sum_to_shape_of node, which decompose settles when sizes are known.
  constexpr int sum_to_shape_of(int g, int x, int like = -1) {
    if (!shaped()) return like >= 0 && same_shape(like, x) ? g : op(Op::sum_to_shape_of, {g, x});
    const Dims gs = shape(g), xs = shape(x);
    if (gs == xs) return g;
    const int lead = gs.size() - xs.size();
    Dims rd;
    for (int i = 0; i < gs.size(); ++i)
      if (i < lead || (xs[i - lead] == 1 && gs[i] != 1)) rd.push_back(i);
    return reshape(rd.empty() ? g : sum(g, rd, true), xs);
  }

  // Whether nodes a and b have one shape at any sizes: with sizes, their shapes; on a structural
  // graph, their shape classes (a simplification that needs no sizes).
  constexpr bool same_shape(int a, int b) {
    if (shaped()) return g_[a].shape == g_[b].shape;
    if (class_.size() > g_.nodes.size()) class_.clear();  // g_ was replaced through graph()
    for (int i = static_cast<int>(class_.size()); i < g_.size(); ++i) class_.push_back(shape_class(i));
    return class_[a] == class_[b];
  }

  constexpr int reshape(int x, const Dims& shape) {
    if (shaped() && g_[x].shape == shape) return x;
    if (g_[x].op == Op::reshape && !g_[x].attrs.keepdim) x = g_[x].in[0];  // reshape(reshape(x)) = reshape(x)
    if (shaped() && g_[x].shape == shape) return x;
    Attrs at;
    at.dims = shape;
    // Sizes follow the input where they can, so that a program with symbolic sizes serves other
    // sizes too: a reshape that only adds or drops 1s takes each other size from the input's dim
    // (the [N, C] of a one-hot summed over its [N, 1, C] named the class count); else the trailing
    // dims both shapes have are the input's (a reshape keeps the order of elements), and a leading
    // size kept from the input, or one before such dims, follows the element count (-1: the
    // [N, 1] views of a cross_entropy's derivative, the [B * T, D] of a linear's and attention's
    // [B * H, T, D] and back named the compiling call's N and T).
    if (shaped() && keep_input_sizes(g_[x].shape, at.dims)) return op(Op::reshape, {x}, at);
    if (shaped() && shape.size() > 0 && rank(x) > 0 && shape[0] > 1 && shape.product() > 0 &&
        std::find(shape.begin(), shape.end(), -1) == shape.end()) {
      const Dims& in = g_[x].shape;
      int t = 0;  // trailing dims equal in both, the first of `shape` aside
      while (t + 1 < shape.size() && t < in.size() && shape[shape.size() - 1 - t] == in[in.size() - 1 - t]) ++t;
      for (int i = shape.size() - t; i < shape.size(); ++i)
        if (shape[i] != 1) at.dims[i] = Attrs::input_dim(in.size() - shape.size() + i);
      if (shape[0] == in[0] || shape.size() == 1 || t > 0) at.dims[0] = -1;
    }
    return op(Op::reshape, {x}, at);
  }
  // x broadcast to `shape`; with `like` (a node of that shape), sized from it where x has a 1 that
  // `shape` does not (a second input, shape_of(like): graph/infer_views.hpp's sized_view_shape), so that a
  // program with symbolic sizes serves every size there (a full sum's cotangent spread over
  // attention's [B * H, T, D] named the compiling call's T).
  constexpr int expand(int x, const Dims& shape, int like = -1) {
    if (shaped() && g_[x].shape == shape) return x;
    if (g_[x].op == Op::expand && !g_[x].sym_attrs) x = g_[x].in[0];  // expand(expand(x)) = expand(x)
    if (shaped() && g_[x].shape == shape) return x;
    if (shaped() && like >= 0 && names_a_size(g_[x].shape, shape)) return op(Op::expand, {x, shape_of(like)});
    Attrs at;
    at.dims = shape;
    // A dim the input already has keeps its size (-1): a program with symbolic sizes then serves
    // other sizes there (the expand of a norm's backward named the compiling call's row count).
    if (shaped())
      for (int i = 0, lead = shape.size() - rank(x); i < rank(x); ++i)
        if (g_[x].shape[i] == shape[lead + i]) at.dims[lead + i] = -1;
    return op(Op::expand, {x}, at);
  }
  // A node of x's shape and no value, which views sized from x read (graph/infer_views.hpp); with y, of x
  // and y joined along dim d (a cat's shape).
  constexpr int shape_of(int x) {
    if (g_[x].op == Op::shape_of) return x;
    return op(Op::shape_of, {shape_source(x)});
  }
  constexpr int shape_of(int x, int y, int d) {
    Attrs at;
    at.a = d;
    return op(Op::shape_of, {shape_source(x), shape_source(y)}, at);
  }
  // order: normalised dims; permute(permute(x, p), q) = permute(x, p[q[i]]).
  constexpr int permute(int x, Dims order) {
    if (g_[x].op == Op::permute && shaped()) {
      const Dims inner = g_[x].attrs.dims;
      for (auto& d : order) d = inner[static_cast<int>(d)];
      x = g_[x].in[0];
    }
    bool identity = true;
    for (int i = 0; i < order.size(); ++i) identity = identity && order[i] == i;
    if (identity) return x;
    Attrs at;
    at.dims = order;
    return op(Op::permute, {x}, at);
  }
  // Swaps the last two dims (a matrix transpose, batched or not).
  constexpr int transpose_last(int x) {
    if (!shaped()) return op(Op::permute, {x});  // the order needs the rank
    Dims order;
    for (int i = 0; i < rank(x); ++i) order.push_back(i);
    std::swap(order[order.size() - 1], order[order.size() - 2]);
    return permute(x, order);
  }
  constexpr int matmul(int a, int b) { return op(Op::matmul, {a, b}); }
  // A tensor of `shape` filled with v. Built from iota == iota rather than an expanded constant:
  // anything computed only from constants is weak (promotes like a C++ scalar), which a cotangent
  // must not be.
  constexpr int full(const Dims& shape, double v, kiln::dtype d) {
    int i = iota(shape.empty() ? Dims{1} : shape, 0);  // a rank-0 shape goes through [1]
    int ones = reshape(cast(cmp(Op::eq, i, i), d), shape);
    return v == 1 ? ones : mul(ones, v);
  }
  // The index along dim d of x, as a broadcastable tensor of `rank` dims: 1 in each but `at`, which
  // has x's size along d. It is sized from x, not named: a program with symbolic sizes then serves
  // every length of that dim (a one-hot's iota named the class count, an argmax's the row length).
  constexpr int iota_of(int x, int d, int rank, int at) {
    Attrs a;
    for (int i = 0; i < rank; ++i) a.dims.push_back(1);
    a.a = at;
    a.b = d;
    return op(Op::iota_of, {shape_source(x)}, a);
  }
  constexpr int iota(const Dims& shape, int dim) {
    Attrs at;
    at.dims = shape;
    at.a = dim;
    return op(Op::iota, {}, at);
  }

 private:
  // A label for node i of a structural graph such that nodes with one label have one shape at any
  // sizes: a pointwise op takes its operands' label when they share one (C++ scalars, constants and
  // element counts, labelled -1, broadcast into any shape), sum_to_shape_of takes its target's; any other node is
  // its own label. Labels of earlier nodes are in class_.
  constexpr int shape_class(int i) const {
    const graph::Node& n = g_[i];
    if (n.op == Op::constant || n.op == Op::scalar || n.op == Op::numel) return -1;  // one element
    if (n.op == Op::sum_to_shape_of) return class_[n.in[1]];
    if (!is_pointwise(n.op)) return i;
    int c = -1;
    for (int k = 0; k < n.n_in; ++k) {
      const int ck = class_[n.in[k]];
      if (ck == -1 || ck == c) continue;
      if (c != -1) return i;
      c = ck;
    }
    return c;
  }
  // A node of x's shape that computes less: only the shape of what numel and iota_of read matters,
  // so x is walked back through same-shape pointwise ops, and one node serves them all.
  constexpr int shape_source(int x) const {
    while (is_pointwise(g_[x].op) &&
           (shaped() ? g_[g_[x].in[0]].shape == g_[x].shape : info(g_[x].op).cls == OpClass::unary))
      x = g_[x].in[0];
    return x;
  }
  // When `out` has in's sizes other than 1, in order (a reshape that only adds or drops 1s), writes
  // each of them as the input's dim it is (Attrs::input_dim) and says so.
  static constexpr bool keep_input_sizes(const Dims& in, Dims& out) {
    Dims from;
    for (int j = 0; j < in.size(); ++j)
      if (in[j] != 1) from.push_back(j);
    int k = 0;
    for (int i = 0; i < out.size(); ++i)
      if (out[i] != 1 && (k >= from.size() || in[static_cast<int>(from[k++])] != out[i])) return false;
    if (k != from.size()) return false;
    k = 0;
    for (int i = 0; i < out.size(); ++i)
      if (out[i] != 1) out[i] = Attrs::input_dim(static_cast<int>(from[k++]));
    return true;
  }
  // Whether broadcasting `in` to `out` gives a dim a size that `in` does not have (a 1 spread out).
  static constexpr bool names_a_size(const Dims& in, const Dims& out) {
    for (int i = 0; i < out.size(); ++i) {
      const int j = i - (out.size() - in.size());
      if (out[i] != 1 && (j < 0 || in[j] != out[i])) return true;
    }
    return false;
  }
  // Ops whose attributes a structural graph cannot know (they hold or depend on sizes).
  static constexpr bool sized_attrs(Op o) {
    const OpClass c = info(o).cls;
    return c == OpClass::reduce || c == OpClass::view || c == OpClass::meta || o == Op::iota ||
           o == Op::embedding_backward;
  }
  graph::Graph g_;
  graph::CseIndex index_;
  int origin_ = -1;
  std::vector<int> class_;  // shape_class of g_'s nodes so far (structural graphs, as same_shape asks)
};

// The shape of every rewrite pass: rebuilds g node by node in order, `rule(b, node, inputs)`
// returning the new id of each node from its inputs' new ids, and keeps g's outputs, argument and
// scalar counts and k::assign targets. A rule that reads other earlier nodes of g than its inputs
// takes a fourth argument, the new ids of g's nodes so far (`map[old]`).
template <class Rule>
constexpr graph::Graph rebuild_graph(const graph::Graph& g, Rule&& rule) {
  Builder b = Builder::like(g);
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    std::array<int, graph::max_inputs> in{};
    for (int k = 0; k < n.n_in; ++k) in[k] = map[n.in[k]];
    if constexpr (std::is_invocable_v<Rule&, Builder&, const graph::Node&, const int*, const std::vector<int>&>)
      map[i] = rule(b, n, in.data(), std::as_const(map));
    else
      map[i] = rule(b, n, in.data());
  }
  graph::Graph out = std::move(b.graph());
  for (int o : g.outputs) out.outputs.push_back(map[o]);
  out.num_args = g.num_args;
  out.num_scalars = g.num_scalars;
  out.output_into = g.output_into;  // k::assign targets, one per output
  return out;
}

// Keeps only the nodes that reach g's outputs, in their order; old_to_new (if given) maps ids (-1:
// removed).
constexpr graph::Graph remove_dead(const graph::Graph& g, std::vector<int>* old_to_new = nullptr) {
  std::vector<char> live(static_cast<std::size_t>(g.size()), 0);
  for (int o : g.outputs) live[o] = 1;
  for (int i = g.size() - 1; i >= 0; --i)
    if (live[i])
      for (int k = 0; k < g[i].n_in; ++k) live[g[i].in[k]] = 1;
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  graph::Graph out;
  out.num_args = g.num_args;
  out.num_scalars = g.num_scalars;
  out.structural = g.structural;
  for (int i = 0; i < g.size(); ++i) {
    if (!live[i]) continue;
    graph::Node n = g[i];
    for (int k = 0; k < n.n_in; ++k) n.in[k] = map[n.in[k]];
    map[i] = out.size();
    out.nodes.push_back(n);
  }
  for (int o : g.outputs) out.outputs.push_back(map[o]);
  out.output_into = g.output_into;
  if (old_to_new) *old_to_new = std::move(map);
  return out;
}

}  // namespace kiln::rewrite
