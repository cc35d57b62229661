// expand_gradients: gradients taken inside a function. A compiled k::grad / value_and_grad / vjp
// called while another function is traced (runtime/api.hpp) leaves, in the caller's graph, its
// value v over its wrt arguments each behind a grad_leaf node (where the callee received it), and
// one grad_of(v, leaf[, cotangent]) node per gradient. After decomposition this pass replaces each
// group of grad_of nodes (one value, one cotangent) by the cotangents the derivative rules give,
// as differentiate does for a whole function, with the leaves as the independent inputs: nothing
// flows through a leaf into what the caller computed its argument from. Then every leaf becomes
// its input, so the caller's graph is primitives again, one graph that fusion sees whole (a
// training step's update fuses with the gradients it reads). Groups go in node order, so a
// gradient of a function that itself takes one differentiates the expanded graph.
#pragma once
#include <vector>

#include "../graph/infer.hpp"
#include "../rewrite/decompose.hpp"
#include "differentiate.hpp"

namespace kiln::autodiff {

namespace detail {

// The cotangent that starts a group's backward pass: ones (grad, value_and_grad) or the
// cotangent node (vjp), in the value's dtype (graph/infer.hpp checked the shapes).
constexpr int group_seed(Builder& b, const graph::Node& grad_of, const int* in) {
  if (grad_of.n_in > 2) return b.cast(in[2], b.dt(in[0]));
  return b.full(b.shape(in[0]), 1, b.dt(in[0]));
}

}  // namespace detail

// Whether g takes gradients inside (grad_of or grad_leaf nodes).
constexpr bool has_inner_gradients(const graph::Graph& g) {
  for (const auto& n : g.nodes)
    if (rewrite::detail::expands_later(n.op)) return true;
  return false;
}

// g decomposed, shapes inferred; returns it with no grad_of or grad_leaf node left.
constexpr graph::Graph expand_gradients(const graph::Graph& g) {
  if (!has_inner_gradients(g)) return g;
  std::vector<int> done(static_cast<std::size_t>(g.size()), -1);  // grad_of node -> its gradient
  graph::Graph expanded =
      rewrite::rebuild_graph(g, [&](Builder& b, const graph::Node& n, const int* in, const std::vector<int>& map) {
        if (info(n.op).cls == OpClass::leaf) return rewrite::detail::copy_leaf(b, n);
        if (n.op != Op::grad_of) return b.rebuild(n, in);
        const int self = static_cast<int>(&n - g.nodes.data());
        if (done[static_cast<std::size_t>(self)] >= 0) return done[static_cast<std::size_t>(self)];
        // The group: this node and every later grad_of of the same value and cotangent.
        auto cotangent = [&](const graph::Node& m) { return m.n_in > 2 ? m.in[2] : -1; };
        std::vector<int> group, wrt;
        for (int j = self; j < g.size(); ++j)
          if (g[j].op == Op::grad_of && g[j].in[0] == n.in[0] && cotangent(g[j]) == cotangent(n)) {
            group.push_back(j);
            const int leaf = map[static_cast<std::size_t>(g[j].in[1])];  // -1: after the value, so not read by it
            if (leaf >= 0) wrt.push_back(leaf);
          }
        const graph::Graph forward = b.graph();  // a copy: the rules add nodes to b
        const std::vector<char> needs = detail::needs_gradient(forward, wrt);
        std::vector<int> ct(static_cast<std::size_t>(forward.size()), -1);
        if (needs[static_cast<std::size_t>(in[0])])
          ct = detail::backpropagate(b, forward, in[0], detail::group_seed(b, n, in), needs);
        for (int j : group) {
          const int leaf = map[static_cast<std::size_t>(g[j].in[1])];
          const bool reached = leaf >= 0 && ct[static_cast<std::size_t>(leaf)] >= 0;
          done[static_cast<std::size_t>(j)] =
              reached ? ct[static_cast<std::size_t>(leaf)] : b.full(g[j].shape, 0, g[j].dt);
        }
        return done[static_cast<std::size_t>(self)];
      });
  graph::Graph out = rewrite::rebuild_graph(expanded, [](Builder& b, const graph::Node& n, const int* in) {
    if (info(n.op).cls == OpClass::leaf) return rewrite::detail::copy_leaf(b, n);
    return n.op == Op::grad_leaf ? in[0] : b.rebuild(n, in);
  });
  return rewrite::remove_dead(out);
}

// An inferred graph that has not been through decomposition (the oracle's, gradcheck's): where it
// takes gradients inside, decomposed and expanded, shapes inferred again with arg(slot).
template <class ArgAt>
graph::Graph expand_inner_gradients(graph::Graph g, ArgAt&& arg) {
  if (!has_inner_gradients(g)) return g;
  g = rewrite::decompose(g);
  graph::infer_shapes(g, arg);
  g = expand_gradients(g);
  graph::infer_shapes(g, arg);
  return g;
}

}  // namespace kiln::autodiff
