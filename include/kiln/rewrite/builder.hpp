// Builder: how rewrite and derivative rules add nodes to a graph. Every new node is shared with an
// identical one already there (CSE, so rule outputs form a DAG, never copies of subtrees) and gets
// its shape and dtype at once, so the next rule can read them. The named helpers skip no-ops (a cast
// to the same dtype, a reshape to the same shape) and merge chains of views.
#pragma once
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <unordered_map>
#include <vector>

#include "../graph/infer.hpp"

namespace kiln::rewrite {

inline constexpr int op_count = static_cast<int>(op_table.size());
inline constexpr double inf = std::numeric_limits<double>::infinity();

class Builder {
 public:
  Builder() = default;
  // Starts from an inferred graph and keeps its node ids (the forward part of a joint graph).
  explicit Builder(graph::Graph base) : g_(std::move(base)) { index_.index_all(g_); }

  graph::Graph& graph() { return g_; }
  const graph::Graph& graph() const { return g_; }
  const graph::Node& operator[](int i) const { return g_[i]; }
  int size() const { return g_.size(); }
  // By value: a reference would dangle once the next node is added.
  Dims shape(int i) const { return g_[i].shape; }
  kiln::dtype dt(int i) const { return g_[i].dt; }
  int rank(int i) const { return g_[i].shape.size(); }
  bool is_constant(int i, double v) const { return g_[i].op == Op::constant && g_[i].value == v; }

  // Adds n (its inputs already in this graph; leaves other than constants carry their shape) or
  // returns the id of an identical node. Scalars are never merged: each is its own run-time slot.
  int node(graph::Node n) {
    const std::uint64_t k = graph::structure_key(n);
    if (int at = index_.find(g_, n, k); at >= 0) return at;
    if (n.op == Op::constant) {
      n.shape = {};
      n.dt = kiln::dtype::f64;
      n.weak = true;
    }
    g_.nodes.push_back(n);
    if (info(n.op).cls != OpClass::leaf || n.op == Op::iota) graph::detail::infer_node(g_, g_.nodes.back());
    index_.insert(k, g_.size() - 1);
    return g_.size() - 1;
  }
  int op(Op o, std::initializer_list<int> in, Attrs at = {}) {
    graph::Node n;
    n.op = o;
    for (int i : in) n.in[n.n_in++] = i;
    n.attrs = at;
    return node(n);
  }
  // A node standing for `like` (a derivative of it): it takes like's captured attributes and
  // their symbolic bits, so that each call's values reach it too.
  int op_like(const graph::Node& like, Op o, std::initializer_list<int> in, Attrs at) {
    graph::Node n;
    n.op = o;
    for (int i : in) n.in[n.n_in++] = i;
    n.attrs = at;
    n.capture = like.capture;
    n.sym_attrs = like.sym_attrs;
    return node(n);
  }
  // A copy of node n of another graph with its inputs replaced by `in` (ids in this graph).
  int rebuild(const graph::Node& n, const int* in) {
    graph::Node m = n;
    for (int k = 0; k < m.n_in; ++k) m.in[k] = in[k];
    if (info(m.op).cls != OpClass::leaf) m.shape = {};
    return node(m);
  }

  int constant(double v) {
    graph::Node n;
    n.op = Op::constant;
    n.value = v;
    return node(n);
  }

  // ---- pointwise ------------------------------------------------------------------------------
  int unary(Op o, int x) { return op(o, {x}); }
  int neg(int x) { return op(Op::neg, {x}); }
  int square(int x) { return op(Op::square, {x}); }
  int exp(int x) { return op(Op::exp, {x}); }
  int log(int x) { return op(Op::log, {x}); }
  int add(int a, int b) { return op(Op::add, {a, b}); }
  int sub(int a, int b) { return op(Op::sub, {a, b}); }
  int mul(int a, int b) { return op(Op::mul, {a, b}); }
  int div(int a, int b) { return op(Op::div, {a, b}); }
  int add(int a, double c) { return add(a, constant(c)); }
  int mul(int a, double c) { return mul(a, constant(c)); }
  int sub(double c, int b) { return sub(constant(c), b); }
  int where(int c, int a, int b) { return op(Op::where, {c, a, b}); }
  int where(int c, int a, double b) { return where(c, a, constant(b)); }
  int where(int c, double a, int b) { return where(c, constant(a), b); }
  int cmp(Op o, int a, int b) { return op(o, {a, b}); }
  int cast(int x, kiln::dtype d) {
    if (g_[x].dt == d) return x;
    Attrs at;
    at.dt = d;
    return op(Op::cast, {x}, at);
  }

  // ---- reductions (dims normalised and sorted) ---------------------------------------------------
  int reduce(Op o, int x, const Dims& dims, bool keepdim) {
    Attrs at;
    at.dims = dims;
    at.keepdim = keepdim;
    return op(o, {x}, at);
  }
  int sum(int x, const Dims& dims, bool keepdim) { return reduce(Op::sum, x, dims, keepdim); }
  // amax used only as a numerically stabilising shift (softmax, logsumexp): the result does not
  // depend on its value, so it is marked (attrs.d) to get no gradient, as PyTorch's decompositions
  // .detach() it; this drops a reduction and a mask from every softmax backward.
  static constexpr std::int64_t detached_shift = Attrs::shift_flag;
  int shift_max(int x, const Dims& dims) {
    Attrs at;
    at.dims = dims;
    at.keepdim = true;
    at.d = detached_shift;
    return op(Op::amax, {x}, at);
  }
  // The element count of x's dims `dims`, a weak f64 scalar that stays symbolic in the graph.
  // Only x's shape matters, so x is walked back through same-shape pointwise ops to share one node.
  int numel(int x, const Dims& dims) {
    while (is_pointwise(g_[x].op) && g_[g_[x].in[0]].shape == g_[x].shape) x = g_[x].in[0];
    return reduce(Op::numel, x, dims, false);
  }
  int mean(int x, const Dims& dims, bool keepdim) { return div(sum(x, dims, keepdim), numel(x, dims)); }

  // ---- views and indexing ----------------------------------------------------------------------
  int reshape(int x, const Dims& shape) {
    if (g_[x].shape == shape) return x;
    if (g_[x].op == Op::reshape) x = g_[x].in[0];  // reshape(reshape(x)) = reshape(x)
    if (g_[x].shape == shape) return x;
    Attrs at;
    at.dims = shape;
    return op(Op::reshape, {x}, at);
  }
  int expand(int x, const Dims& shape) {
    if (g_[x].shape == shape) return x;
    Attrs at;
    at.dims = shape;
    return op(Op::expand, {x}, at);
  }
  // order: normalised dims; permute(permute(x, p), q) = permute(x, p[q[i]]).
  int permute(int x, Dims order) {
    if (g_[x].op == Op::permute) {
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
  int transpose_last(int x) {
    Dims order;
    for (int i = 0; i < rank(x); ++i) order.push_back(i);
    std::swap(order[order.size() - 1], order[order.size() - 2]);
    return permute(x, order);
  }
  int matmul(int a, int b) { return op(Op::matmul, {a, b}); }
  // A tensor of `shape` filled with v. Built from iota == iota rather than an expanded constant:
  // anything computed only from constants is weak (promotes like a C++ scalar), which a cotangent
  // must not be.
  int full(const Dims& shape, double v, kiln::dtype d) {
    int i = iota(shape.empty() ? Dims{1} : shape, 0);  // a rank-0 shape goes through [1]
    int ones = reshape(cast(cmp(Op::eq, i, i), d), shape);
    return v == 1 ? ones : mul(ones, v);
  }
  int iota(const Dims& shape, int dim) {
    Attrs at;
    at.dims = shape;
    at.a = dim;
    return op(Op::iota, {}, at);
  }

 private:
  graph::Graph g_;
  graph::CseIndex index_;
};

// The shape of every rewrite pass: rebuilds g node by node in order, `rule(b, node, inputs)`
// returning the new id of each node from its inputs' new ids, and keeps g's outputs, argument and
// scalar counts and k::assign targets.
template <class Rule>
graph::Graph rebuild_graph(const graph::Graph& g, Rule&& rule) {
  Builder b;
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    std::array<int, graph::max_inputs> in{};
    for (int k = 0; k < n.n_in; ++k) in[k] = map[n.in[k]];
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
inline graph::Graph remove_dead(const graph::Graph& g, std::vector<int>* old_to_new = nullptr) {
  std::vector<char> live(static_cast<std::size_t>(g.size()), 0);
  for (int o : g.outputs) live[o] = 1;
  for (int i = g.size() - 1; i >= 0; --i)
    if (live[i])
      for (int k = 0; k < g[i].n_in; ++k) live[g[i].in[k]] = 1;
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  graph::Graph out;
  out.num_args = g.num_args;
  out.num_scalars = g.num_scalars;
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
