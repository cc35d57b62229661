// k::structure<N>(fn) (API.md, "Compile-time structure"): the primitive graph of a capture-less
// function of N tensors, or of k::grad / value_and_grad / vjp of one, after decomposition (and
// differentiation), computed as a C++ constant expression by the passes the runtime runs at the
// first call: the expression type is flattened to a structural node table (graph/flatten_type.hpp),
// then rewrite::decompose, rewrite::simplify, the function's transform_graph (autodiff) and
// rewrite::simplify again, as runtime/lower.hpp orders them. What needs sizes is not in it: views
// and reductions keep unknown sizes, a cotangent summed back to an operand that sizes may have
// broadcast is one sum_to_shape_of node (none where the two have one shape at any sizes: the
// Builder's shape classes), and attention stays one node (its graph depends on the head counts).
// Arguments are taken as f32 tensors.
#pragma once
#include <array>
#include <cstddef>
#include <ostream>
#include <utility>

#include "../graph/flatten_type.hpp"
#include "../rewrite/decompose.hpp"
#include "../rewrite/simplify.hpp"
#include "grad.hpp"

namespace kiln {

// One node of a Structure: its op, inputs, argument or scalar slot, constant value and dtype.
struct StructureNode {
  Op op = Op::arg;
  std::array<int, graph::max_inputs> in{-1, -1, -1, -1, -1, -1, -1, -1};
  int n_in = 0;
  int slot = -1;
  double value = 0;
  kiln::dtype dt = kiln::dtype::f32;
};

// A primitive graph as a constant: Nodes nodes in topological order, Outputs output ids.
template <std::size_t Nodes, std::size_t Outputs>
struct Structure {
  std::array<StructureNode, Nodes> nodes{};
  std::array<int, Outputs> outs{};

  // Every node, leaves (arguments, scalars, constants) included.
  constexpr int size() const { return static_cast<int>(Nodes); }
  constexpr int count(Op op) const {
    int c = 0;
    for (const auto& n : nodes) c += n.op == op;
    return c;
  }
  // The non-leaf nodes: k::explain's ops_decomposed for the same function.
  constexpr int count_ops() const {
    int c = 0;
    for (const auto& n : nodes) c += info(n.op).cls != OpClass::leaf;
    return c;
  }
  constexpr const std::array<int, Outputs>& outputs() const { return outs; }
  constexpr const StructureNode& operator[](int i) const { return nodes[static_cast<std::size_t>(i)]; }

  // One node a line, as graph::Graph prints: %id = op(inputs) : dtype
  friend std::ostream& operator<<(std::ostream& os, const Structure& s) {
    for (std::size_t i = 0; i < Nodes; ++i) {
      const StructureNode& n = s.nodes[i];
      os << "  %" << i << " = " << name(n.op) << "(";
      if (n.op == Op::arg) os << "arg" << n.slot;
      if (n.op == Op::scalar) os << "s" << n.slot;
      if (n.op == Op::constant) os << n.value;
      for (int k = 0; k < n.n_in; ++k) os << (k ? ", " : "") << "%" << n.in[k];
      os << ") : " << name(n.dt) << "\n";
    }
    os << "  return";
    for (int o : s.outs) os << " %" << o;
    return os << "\n";
  }
};

namespace detail {

// What k::structure can derive for function G over N tensors (checked before deriving, so each
// limit is one static_assert sentence).
template <class G>
constexpr bool takes_cotangent() {
  if constexpr (is_gradient_fn<G>::value)
    return G::mode == autodiff::Mode::vjp;
  else
    return false;
}

template <class G, int N>
struct StructureOf {
  static constexpr bool is_grad = is_gradient_fn<G>::value;
  static constexpr int traced_args = N + (takes_cotangent<G>() ? 1 : 0);
  using Traced = decltype(structure_traced_type<G>(std::make_index_sequence<static_cast<std::size_t>(traced_args)>{}));
  static constexpr bool walkable = graph::detail::type_walkable<Traced>::value;
  static constexpr bool in_budget = graph::detail::tree_nodes<Traced>::value <= graph::structure_node_budget;

  // The passes of runtime/lower.hpp, on the structural graph.
  static constexpr graph::Graph derive() {
    graph::Graph g = graph::flatten_type<Traced>(traced_args);
    g = rewrite::simplify(rewrite::decompose(g));
    if constexpr (is_grad) {
      for (const auto& n : g.nodes)  // their graphs or gradients need sizes or the registry
        if (n.op == Op::attention || n.op == Op::score_arg || is_custom(n.op)) return graph::Graph{};
      g = rewrite::simplify(transform_graph(G{}, std::move(g)));
    }
    return g;
  }
  static constexpr std::pair<std::size_t, std::size_t> sizes() {
    const graph::Graph g = derive();
    return {g.nodes.size(), g.outputs.size()};
  }
};

template <class G, int N>
constexpr auto derive_structure() {
  using S = StructureOf<G, N>;
  constexpr auto sizes = S::sizes();
  static_assert(sizes.second > 0,
                "k::structure: the gradient of k::attention or of a k::custom_op needs sizes or the op's registry: "
                "it is derived at the first call only");
  Structure<sizes.first, sizes.second> s;
  const graph::Graph g = S::derive();
  for (std::size_t i = 0; i < sizes.first; ++i) {
    const graph::Node& n = g.nodes[i];
    s.nodes[i] = {n.op, n.in, n.n_in, n.slot, n.value, n.dt};
  }
  for (std::size_t i = 0; i < sizes.second; ++i) s.outs[i] = g.outputs[i];
  return s;
}

}  // namespace detail

// The primitive graph of fn over N tensor arguments (for k::vjp: N besides the cotangent), as a
// constant expression: `constexpr auto s = k::structure<1>(fn); static_assert(s.count(k::Op::exp) == 1);`.
// fn must be capture-less (its type alone is the graph). A function that breaks its graph with
// k::item has no single structure (it runs as several compiled segments): k::item says so in a
// static_assert when k::structure traces it.
template <int N, class G>
constexpr auto structure(const G&) {
  static_assert(std::is_empty_v<G> || is_gradient_fn<G>::value,
                "k::structure needs a capture-less function: its graph must follow from its type alone");
  using S = detail::StructureOf<G, N>;
  static_assert(S::walkable,
                "k::structure: the function's result holds a k::expression or a container argument, whose graph is "
                "known only from the object at run time; k::explain shows it");
  static_assert(S::in_budget,
                "k::structure: the expression is larger than graph::structure_node_budget nodes (counted as a tree): "
                "too large to derive in a constant expression; k::compile derives it at the first call");
  if constexpr (S::walkable && S::in_budget)
    return detail::derive_structure<G, N>();
  else
    return Structure<0, 0>{};
}

}  // namespace kiln
