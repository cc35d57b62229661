// differentiate: reverse-mode autodiff as a pass over the flattened graph, producing one joint
// forward/backward graph (what AOTAutograd traces) from the table of derivative rules.
//
// Design decision: capture happens at C++ compile time (the expression type is the graph), and
// decomposition and differentiation are table-driven constexpr passes over the flattened node table.
// They run at the first call over the graph with shapes (the runtime caches the result), and in a
// constant expression over the structural graph of an expression type when k::structure asks
// (autodiff/structure.hpp): the same functions, with the Builder leaving what needs sizes to the
// run time. Working on a node table rather than on nested types keeps user compile times low and
// shares subtrees as a DAG (a 50-op chain and its gradient stay O(50) nodes instead of blowing up as
// nested types would). Misuse that the type shows (grad of a non-scalar, a bad k::wrt) is a
// static_assert, in autodiff/grad.hpp.
#pragma once
#include <algorithm>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "../core/linkage.hpp"
#include "../debug/log.hpp"
#include "rules.hpp"

namespace kiln::autodiff {

enum class Mode { grad, value_and_grad, vjp };

constexpr std::string_view name(Mode m) {
  return m == Mode::grad ? "k::grad" : m == Mode::value_and_grad ? "k::value_and_grad" : "k::vjp";
}

// The joint graph, whose nodes [0, n_forward) are the forward graph's (the partitioner's input).
struct JointGraph {
  graph::Graph graph;
  int n_forward = 0;
};

namespace detail {

constexpr int find_arg(const graph::Graph& g, int slot) {
  for (int i = 0; i < g.size(); ++i)
    if (g[i].op == Op::arg && g[i].slot == slot) return i;
  return -1;
}

// Which nodes depend on a wrt argument through floating-point values: only they get cotangents.
constexpr std::vector<char> needs_gradient(const graph::Graph& g, std::span<const int> wrt_nodes) {
  std::vector<char> needs(static_cast<std::size_t>(g.size()), 0);
  for (int a : wrt_nodes) needs[a] = 1;
  for (int i = 0; i < g.size(); ++i) {
    if (!is_floating(g[i].dt)) continue;
    for (int k = 0; k < g[i].n_in; ++k) needs[i] = needs[i] || needs[g[i].in[k]];
  }
  return needs;
}

// The cotangent that starts the backward pass: ones (grad) or the cotangent argument (vjp).
constexpr int seed(Builder& b, const graph::Graph& g, int out, Mode mode, int cotangent_arg) {
  const graph::Node& o = g[out];
  if (mode != Mode::vjp) {
    if (o.shape.product() != 1)
      throw shape_error(std::string(name(mode)) + ": the function's value has shape " + o.shape.str() +
                        ", not a single element: reduce it with k::sum or k::mean, or use k::vjp");
    return b.full(o.shape, 1, o.dt);
  }
  const int c = find_arg(g, cotangent_arg);
  if (c < 0) throw error("k::vjp: the graph has no node for the cotangent argument " + std::to_string(cotangent_arg));
  if (!(g[c].shape == o.shape))
    throw shape_error("k::vjp: the cotangent has shape " + g[c].shape.str() + " but the function's value has shape " +
                      o.shape.str());
  return b.cast(c, o.dt);
}

// Adds the contribution c to the cotangent of forward node x, cast to x's dtype.
constexpr void accumulate(Builder& b, std::vector<int>& ct, const graph::Graph& g, int x, int c, Op from) {
  c = b.cast(c, g[x].dt);
  if (!(b.shape(c) == g[x].shape))
    throw error("autodiff: the rule for " + std::string(name(from)) + " gave a cotangent of shape " + b.shape(c).str() +
                " for an input of shape " + g[x].shape.str());
  ct[x] = ct[x] < 0 ? c : b.add(ct[x], c);
}

// The arg nodes of the wrt slots, checked: each must exist and be floating point.
constexpr std::vector<int> wrt_nodes(const graph::Graph& g, std::span<const int> wrt_args, Mode mode) {
  std::vector<int> nodes;
  for (int slot : wrt_args) {
    int a = find_arg(g, slot);
    if (a < 0)
      throw error(std::string(name(mode)) + ": argument " + std::to_string(slot) + " has no node in the graph");
    if (!is_floating(g[a].dt))
      throw dtype_error(std::string(name(mode)) + ": argument " + std::to_string(slot) + " has dtype " +
                        std::string(kiln::name(g[a].dt)) + "; only floating-point arguments have gradients");
    nodes.push_back(a);
  }
  return nodes;
}

// Walks the forward graph from its output down (reverse topological order: ids are topological),
// pushing each node's cotangent through its rule; returns the cotangent of every forward node.
constexpr std::vector<int> backpropagate(Builder& b, const graph::Graph& g, int out, int seed,
                                         const std::vector<char>& needs) {
  std::vector<int> ct(static_cast<std::size_t>(g.size()), -1);
  ct[out] = seed;
  for (int i = out; i >= 0; --i) {
    if (ct[i] < 0 || info(g[i].op).cls == OpClass::leaf) continue;
    const Rule rule = derivative_rules[static_cast<int>(g[i].op)];
    if (!rule)
      throw error("autodiff: no derivative rule for composite op " + std::string(kiln::name(g[i].op)) +
                  " (run rewrite::decompose first)");
    b.set_origin(-2 - i);  // structural graphs: unsized nodes of this rule stand for node i
    const Cotangents c = rule(b, i, ct[i]);
    for (int k = 0; k < std::min<int>(g[i].n_in, static_cast<int>(c.size())); ++k)  // rand has 5 inputs, no cotangents
      if (c[k] >= 0 && needs[g[i].in[k]]) accumulate(b, ct, g, g[i].in[k], c[k], g[i].op);
  }
  return ct;
}

}  // namespace detail

// Differentiates g (one output: the function's value; shapes inferred) with respect to the
// arguments in wrt_args (arg slots), walking the DAG once in reverse topological order. Outputs:
// grad: the gradients in wrt order; value_and_grad: the value, then the gradients; vjp: the
// gradients seeded by the argument in slot cotangent_arg. Gradients have their argument's dtype;
// an argument the value does not depend on gets zeros. Every wrt argument needs an arg node in g.
constexpr JointGraph differentiate_joint(const graph::Graph& g, std::span<const int> wrt_args, Mode mode,
                                         int cotangent_arg = -1) {
  if (!std::is_constant_evaluated())
    debug::log_lazy(debug::Channel::autodiff, [&] { return "before " + std::string(name(mode)) + ":\n" + g.str(); });
  if (g.outputs.size() != 1)
    throw error(std::string(name(mode)) + ": the function must have exactly one output, it has " +
                std::to_string(g.outputs.size()));
  const int out = g.outputs[0];
  if (!is_floating(g[out].dt))
    throw dtype_error(std::string(name(mode)) + ": the function's value is " + std::string(kiln::name(g[out].dt)) +
                      "; only floating-point values have gradients");
  const std::vector<int> wrt = detail::wrt_nodes(g, wrt_args, mode);
  const std::vector<char> needs = detail::needs_gradient(g, wrt);
  Builder b(g);
  std::vector<int> ct(static_cast<std::size_t>(g.size()), -1);
  if (needs[out]) ct = detail::backpropagate(b, g, out, detail::seed(b, g, out, mode, cotangent_arg), needs);
  std::vector<int> outputs;
  if (mode == Mode::value_and_grad) outputs.push_back(out);
  for (int a : wrt) {
    b.set_origin(-2 - a);
    outputs.push_back(ct[a] >= 0 ? ct[a] : b.full(g[a].shape, 0, g[a].dt));
  }
  b.graph().outputs = outputs;
  b.graph().output_into.clear();
  std::vector<int> map;
  JointGraph result{rewrite::remove_dead(b.graph(), &map), 0};
  for (int i = 0; i < g.size(); ++i) result.n_forward += map[i] >= 0;
  if (!std::is_constant_evaluated())
    debug::log_lazy(debug::Channel::autodiff, [&] {
      return "after " + std::string(name(mode)) + " (" + std::to_string(result.n_forward) + " forward nodes, " +
             std::to_string(result.graph.size() - result.n_forward) + " backward nodes):\n" + result.graph.str();
    });
  return result;
}

constexpr graph::Graph differentiate(const graph::Graph& g, std::span<const int> wrt_args, Mode mode,
                                     int cotangent_arg = -1) {
  return differentiate_joint(g, wrt_args, mode, cotangent_arg).graph;
}

// differentiate called at run time: an entry point (core/linkage.hpp), so that a TU compiling a
// gradient does not emit the derivative rules again where the runtime is compiled once.
KILN_DECL graph::Graph differentiate_at_run_time(const graph::Graph& g, std::span<const int> wrt_args, Mode mode,
                                                 int cotangent_arg = -1);
#if KILN_DEFINITIONS
KILN_DECL graph::Graph differentiate_at_run_time(const graph::Graph& g, std::span<const int> wrt_args, Mode mode,
                                                 int cotangent_arg) {
  return differentiate(g, wrt_args, mode, cotangent_arg);
}
#endif

}  // namespace kiln::autodiff
