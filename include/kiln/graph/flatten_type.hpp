// Flattening an expression *type* into a structural node table, in a constant expression: what
// k::structure starts from. The walk is flatten.hpp's (children first, each node through the same
// CseIndex, attributed nodes numbered in the order gather() numbers their attributes), but over
// types only: an expression object is not needed, and cannot exist at C++ compile time (its nodes
// are shared bodies on the heap). What the object holds is unknown here and stays so: attributes
// (dims, sizes, a cast's dtype) and scalar values. Arguments are taken as f32 tensors, so dtypes
// follow infer_dtype's promotion rules from there.
#pragma once
#include <tuple>
#include <type_traits>

#include "flatten.hpp"
#include "infer_dtype.hpp"

namespace kiln::graph {

// The largest expression (counted as a tree: a subexpression used twice counts twice) that
// k::structure flattens in a constant expression; past it, GCC's constexpr operation limit comes
// near (the joint graph grows about fourfold), and k::structure says so in a static_assert.
inline constexpr int structure_node_budget = 600;

namespace detail {

// Nodes of E's type counted as a tree (memoised by the compiler: linear in distinct node types).
template <class E>
struct tree_nodes : std::integral_constant<int, 1> {};
template <Op O, class... C>
struct tree_nodes<expr::Node<O, C...>> : std::integral_constant<int, (1 + ... + tree_nodes<C>::value)> {};
template <class N>
struct tree_nodes<expr::FullReduction<N>> : tree_nodes<N> {};
template <int I, class E>
struct tree_nodes<expr::Assign<I, E>> : tree_nodes<E> {};
template <class... E>
struct tree_nodes<std::tuple<E...>>
    : std::integral_constant<int, (0 + ... + tree_nodes<std::remove_cvref_t<E>>::value)> {};

// Whether a type holds something only an object knows: an erased k::expression, a container
// element (its slot is a run-time value), or a std::vector of results.
template <class E>
struct type_walkable : std::true_type {};
template <>
struct type_walkable<expression> : std::false_type {};
template <>
struct type_walkable<expr::ArgAt> : std::false_type {};
template <>
struct type_walkable<expr::ArgSpan> : std::false_type {};
template <class T>
struct type_walkable<std::vector<T>> : std::false_type {};
template <class E>
struct type_walkable<expr::AssignAt<E>> : std::false_type {};
template <Op O, class... C>
struct type_walkable<expr::Node<O, C...>> : std::bool_constant<(type_walkable<C>::value && ...)> {};
template <class N>
struct type_walkable<expr::FullReduction<N>> : type_walkable<N> {};
template <int I, class E>
struct type_walkable<expr::Assign<I, E>> : type_walkable<E> {};
template <class... E>
struct type_walkable<std::tuple<E...>> : std::bool_constant<(type_walkable<std::remove_cvref_t<E>>::value && ...)> {};

// Ops whose captured attributes change what they compute (dims, sizes, a dtype, a flag): two of
// them are one node only when they are one capture.
constexpr bool reads_attrs(Op op) {
  switch (info(op).cls) {
    case OpClass::reduce:
    case OpClass::view:
    case OpClass::meta:
      return true;
    case OpClass::composite:
      return !(op == Op::silu || op == Op::clamp || op == Op::layer_norm || op == Op::rms_norm ||
               op == Op::cross_entropy || op == Op::mse_loss || op == Op::linear);
    default:
      return op == Op::cast || op == Op::iota || is_custom(op) || op == Op::rand || op == Op::embedding_backward;
  }
}

struct TypeFlattenState {
  CseIndex cse;
  int next_tensor = 0, next_scalar = 0, next_capture = 0;
  // A node made from captured attributes: its capture number, and unsized when they matter.
  constexpr int add_attributed(Graph& g, Node n) {
    n.capture = next_capture++;
    n.unsized = reads_attrs(n.op);
    if (info(n.op).cls != OpClass::leaf || n.op == Op::iota) infer_dtype(g, n);
    return cse.add(g, n);
  }
};

template <class E>
struct flatten_type_of;

template <int I>
struct flatten_type_of<expr::Arg<I>> {
  static constexpr int add(Graph& g, TypeFlattenState& s) {
    Node n;
    n.op = Op::arg;
    n.slot = expr::structure_slot(I);  // (k::structure's placeholders)
    return s.cse.add(g, n);  // an f32 tensor (Node's defaults)
  }
};
template <>
struct flatten_type_of<expr::TensorLeaf> {  // an eager tensor: an argument after the function's
  static constexpr int add(Graph& g, TypeFlattenState& s) {
    Node n;
    n.op = Op::arg;
    n.slot = s.next_tensor++;
    g.nodes.push_back(n);
    return g.size() - 1;
  }
};
template <bool F>
struct flatten_type_of<expr::Scalar<F>> {
  static constexpr int add(Graph& g, TypeFlattenState& s) {
    Node n;
    n.op = Op::scalar;
    n.slot = s.next_scalar++;
    n.weak = true;
    n.floating = F;
    n.dt = F ? kiln::dtype::f64 : kiln::dtype::i64;
    return s.cse.add(g, n);
  }
};
template <>
struct flatten_type_of<expr::Iota> {
  static constexpr int add(Graph& g, TypeFlattenState& s) {
    Node n;
    n.op = Op::iota;
    return s.add_attributed(g, n);
  }
};
template <Op O, class... C>
struct flatten_type_of<expr::Node<O, C...>> {
  static constexpr int add(Graph& g, TypeFlattenState& s, bool all = false) {
    Node n;
    n.op = O;
    ((n.in[n.n_in++] = flatten_type_of<C>::add(g, s)), ...);
    n.attrs.all = all;
    return s.add_attributed(g, n);
  }
};
template <class N>
struct flatten_type_of<expr::FullReduction<N>> {  // the one attribute a type shows: every dim
  static constexpr int add(Graph& g, TypeFlattenState& s) { return flatten_type_of<N>::add(g, s, true); }
};
template <int I, class E>
struct flatten_type_of<expr::Assign<I, E>> : flatten_type_of<E> {};

}  // namespace detail

// The structural graph of a function's result type R (one expression or a std::tuple of them)
// over `nargs` arguments, built in a constant expression.
template <class R>
constexpr Graph flatten_type(int nargs) {
  Graph g;
  g.structural = true;
  detail::TypeFlattenState s;
  s.next_tensor = std::max(nargs, expr::structure_slot(Counts<R>::max_arg) + 1);
  auto add_output = [&]<class X>(std::type_identity<X>) {
    g.outputs.push_back(detail::flatten_type_of<X>::add(g, s));
    g.output_into.push_back(-1);
  };
  if constexpr (is_tuple<R>::value)
    [&]<class... X>(std::type_identity<std::tuple<X...>>) {
      (add_output(std::type_identity<std::remove_cvref_t<X>>{}), ...);
    }(std::type_identity<R>{});
  else
    add_output(std::type_identity<R>{});
  g.num_args = s.next_tensor;
  g.num_scalars = s.next_scalar;
  return g;
}

}  // namespace kiln::graph
