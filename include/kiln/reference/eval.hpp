// The oracle: an unfused, obviously-correct evaluator of a flattened graph, in f64 on the host.
// Every op of expr/op.hpp is computed straight from its definition (composites included: they are
// NOT decomposed here, so that comparing against the oracle checks the decomposition rules too;
// custom ops through the user's own functions on CPU tensors). A graph that takes gradients inside
// (a compiled k::grad called in an expression) is decomposed and its gradients expanded first.
// Values stay in f64 whatever the node's floating dtype; integral and boolean nodes are rounded
// to their dtype after each node so integer arithmetic is exact. Casts to f32/f16/bf16 round
// through the target type. Speed is not a goal; clarity is.
#pragma once
#include <algorithm>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../autodiff/expand_gradients.hpp"
#include "../core/linkage.hpp"
#include "../core/tensor.hpp"
#include "../expr/assign.hpp"
#include "../expr/ops.hpp"
#include "../graph/flatten.hpp"
#include "../graph/graph.hpp"
#include "../graph/infer.hpp"
#include "eval_node.hpp"
#include "value.hpp"

namespace kiln::reference {

// Evaluates every node of g (after graph::infer_shapes) and returns the values of its outputs.
// args are indexed by arg slot, scalars by scalar slot.
inline std::vector<Value> eval_graph(const graph::Graph& g, std::span<const Tensor> args,
                                     std::span<const double> scalars) {
  std::vector<Value> vals(static_cast<std::size_t>(g.size()));
  std::vector<char> state(vals.size(), 0);  // 0 = not yet, 1 = in progress, 2 = done
  // Nodes are normally in topological order; evaluate inputs first anyway, so graphs edited by
  // rewrite passes (new nodes appended, then referenced) are handled too.
  auto visit = [&](auto& self, int i) -> void {
    if (i < 0 || i >= g.size()) throw error("reference: node id " + std::to_string(i) + " is out of range");
    auto& st = state[static_cast<std::size_t>(i)];
    if (st == 2) return;
    if (st == 1) throw error("reference: the graph has a cycle through node %" + std::to_string(i));
    st = 1;
    const graph::Node& n = g.nodes[static_cast<std::size_t>(i)];
    for (int k = 0; k < n.n_in; ++k) self(self, n.in[k]);
    vals[static_cast<std::size_t>(i)] = detail::eval_node(g, i, vals, args, scalars);
    st = 2;
  };
  for (int i = 0; i < g.size(); ++i) visit(visit, i);
  std::vector<Value> outs;
  for (int o : g.outputs) outs.push_back(vals[static_cast<std::size_t>(o)]);
  return outs;
}

namespace detail {

// eval_values' work once the expressions are a graph and their tensors gathered (null where an
// argument slot is unbound): an entry point (core/linkage.hpp).
KILN_DECL std::vector<Value> infer_and_eval(graph::Graph& g, std::span<const Tensor* const> ptrs,
                                            std::span<const double> scalars);
#if KILN_DEFINITIONS
KILN_DECL std::vector<Value> infer_and_eval(graph::Graph& g, std::span<const Tensor* const> ptrs,
                                            std::span<const double> scalars) {
  std::vector<Tensor> args(ptrs.size());
  for (std::size_t k = 0; k < ptrs.size(); ++k)
    if (ptrs[k]) args[k] = *ptrs[k];
  auto arg = [&](int slot) -> const Tensor& {  // only the slots the graph reads must be bound
    if (slot < 0 || static_cast<std::size_t>(slot) >= ptrs.size() || !ptrs[static_cast<std::size_t>(slot)])
      throw error("reference::eval: argument " + std::to_string(slot) + " of the expression is not bound to a tensor");
    return args[static_cast<std::size_t>(slot)];
  };
  graph::infer_shapes(g, arg);
  g = autodiff::expand_inner_gradients(std::move(g), arg);
  return eval_graph(g, args, scalars);
}
#endif

template <class T>
decltype(auto) as_expr(const T& x) {
  if constexpr (std::is_same_v<T, Tensor>)
    return expr::TensorLeaf{{}, x};
  else
    return (x);
}

}  // namespace detail

// Flattens and evaluates one or several expressions as one graph (shared subexpressions are
// evaluated once), returning each output's Value: its shape, the node's dtype and f64 data.
template <class... E>
requires(Expr<E>&&...) std::vector<Value> eval_values(const E&... e) {
  graph::Graph g = graph::flatten(e...);
  std::vector<const Tensor*> ptrs(static_cast<std::size_t>(g.num_args), nullptr);
  std::size_t next = static_cast<std::size_t>(std::max({-1, graph::Counts<E>::max_arg...}) + 1);
  graph::Captured cap;  // one walk over all outputs, as flatten: a subexpression they share is met once
  graph::gather(std::tuple<const E&...>(e...), cap);
  for (std::size_t k = 0; k < cap.bound.size() && k < ptrs.size(); ++k) ptrs[k] = cap.bound[k];
  for (int k = 0; k < cap.nt; ++k) ptrs[next++] = cap.tensors[static_cast<std::size_t>(k)];
  return detail::infer_and_eval(g, ptrs, cap.scalars);
}

// The oracle's value of an expression: a contiguous CPU tensor of dtype f64.
template <class E>
requires Expr<E> Tensor eval(const E& e) { return to_tensor(eval_values(e).at(0)); }

// A plain tensor: its values as a contiguous CPU f64 tensor.
inline Tensor eval(const Tensor& t) { return to_tensor(read(t)); }

// Several outputs (a tuple of expressions or tensors), evaluated as one graph.
template <class... E>
requires((Expr<E> || std::is_same_v<E, Tensor>)&&...) auto eval(const std::tuple<E...>& t) {
  std::vector<Value> vs = std::apply([](const auto&... e) { return eval_values(detail::as_expr(e)...); }, t);
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple{(static_cast<void>(I), to_tensor(vs[I]))...};
  }
  (std::index_sequence_for<E...>{});
}

}  // namespace kiln::reference
