// Flattening: turns an expression object into the run-time node table once per expression type,
// and gathers the values that change between calls (tensors, scalars, attributes) at every call
// into fixed arrays, in the same traversal order, without touching the heap.
#pragma once
#include <array>
#include <tuple>

#include "../expr/assign.hpp"
#include "graph.hpp"
#include "views.hpp"

namespace kiln::graph {

// Type-level counts of what one call must gather: tensor leaves, scalars, attributed nodes, and
// chains of views of an eager tensor (each gathered as one viewed tensor when views are folded).
template <class E> struct Counts;
template <> struct Counts<expr::TensorLeaf> { static constexpr int tensors = 1, scalars = 0, attrs = 0, views = 0, max_arg = -1; };
template <int I> struct Counts<expr::Arg<I>> { static constexpr int tensors = 0, scalars = 0, attrs = 0, views = 0, max_arg = I; };
template <bool F> struct Counts<expr::Scalar<F>> { static constexpr int tensors = 0, scalars = 1, attrs = 0, views = 0, max_arg = -1; };
template <> struct Counts<expr::Iota> { static constexpr int tensors = 0, scalars = 0, attrs = 1, views = 0, max_arg = -1; };
template <Op O, class... C>
struct Counts<expr::Node<O, C...>> {
  static constexpr int tensors = (0 + ... + Counts<C>::tensors);
  static constexpr int scalars = (0 + ... + Counts<C>::scalars);
  static constexpr int attrs = 1 + (0 + ... + Counts<C>::attrs);
  static constexpr int views = is_leaf_view<expr::Node<O, C...>>::value ? 1 : (0 + ... + Counts<C>::views);
  static constexpr int max_arg = std::max({-1, Counts<C>::max_arg...});
};

template <class N>
struct Counts<expr::FullReduction<N>> : Counts<N> {};
template <int I, class E>
struct Counts<expr::Assign<I, E>> : Counts<E> {
  static constexpr int max_arg = std::max(I, Counts<E>::max_arg);
};

template <class T> struct is_tuple : std::false_type {};
template <class... T> struct is_tuple<std::tuple<T...>> : std::true_type {};

template <class... E>
struct Counts<std::tuple<E...>> {
  static constexpr int tensors = (0 + ... + Counts<std::remove_cvref_t<E>>::tensors);
  static constexpr int scalars = (0 + ... + Counts<std::remove_cvref_t<E>>::scalars);
  static constexpr int attrs = (0 + ... + Counts<std::remove_cvref_t<E>>::attrs);
  static constexpr int views = (0 + ... + Counts<std::remove_cvref_t<E>>::views);
  static constexpr int max_arg = std::max({-1, Counts<std::remove_cvref_t<E>>::max_arg...});
};

// The per-call values of an expression of type E. With FoldViews, each chain of views of an eager
// tensor is gathered as the viewed tensor itself (kept in `views`: a Captured is not copied after
// gathering), and its attributes are not gathered: the runtime's evaluation does this, so those
// attributes are never guards. The oracle and export keep views as nodes.
template <class E, bool FoldViews = false>
struct Captured {
  using C = Counts<E>;
  static constexpr bool fold = FoldViews;
  std::array<const Tensor*, (C::tensors > 0 ? C::tensors : 1)> tensors{};
  std::array<double, (C::scalars > 0 ? C::scalars : 1)> scalars{};
  std::array<const Attrs*, C::attrs> attrs{};
  std::array<Op, C::attrs> ops{};  // the op of each attributed node
  std::array<Tensor, FoldViews ? C::views : 0> views{};
  int nt = 0, ns = 0, na = 0, nv = 0;
};

namespace detail {

template <class Cap>
void gather(const expr::TensorLeaf& e, Cap& c) { c.tensors[c.nt++] = &e.t; }
template <class Cap, int I>
void gather(const expr::Arg<I>&, Cap&) {}
template <class Cap, bool F>
void gather(const expr::Scalar<F>& e, Cap& c) { c.scalars[c.ns++] = e.v; }
template <class Cap>
void gather(const expr::Iota& e, Cap& c) {
  c.ops[c.na] = Op::iota;
  c.attrs[c.na++] = &e.attrs;
}
template <class Cap, Op O, class... C>
void gather(const expr::Node<O, C...>& e, Cap& c) {
  if constexpr (Cap::fold && is_leaf_view<expr::Node<O, C...>>::value) {
    c.views[c.nv] = leaf_tensor(e);
    c.tensors[c.nt++] = &c.views[c.nv++];
  } else {
    std::apply([&](const auto&... child) { (gather(child, c), ...); }, e.in);
    c.ops[c.na] = O;
    c.attrs[c.na++] = &e.attrs;
  }
}
template <class Cap, int I, class E>
void gather(const expr::Assign<I, E>& e, Cap& c) { gather(e.value, c); }

template <class T> struct is_assign : std::false_type {};
template <int I, class E> struct is_assign<expr::Assign<I, E>> : std::true_type {};

struct FlattenState {
  int next_tensor = 0;   // eager leaves are numbered after the largest Arg index
  int next_scalar = 0;
  int next_capture = 0;  // attributed nodes, numbered as gather() numbers their attrs
  bool fold_views = false;  // views of eager tensors are arguments (Captured<E, true>)
  const std::vector<std::uint8_t>* symbolic = nullptr;  // per capture: its symbolic attribute bits
  void tag(Node& n) {
    n.capture = next_capture++;
    if (symbolic && n.capture < static_cast<int>(symbolic->size()) && has_symbolic_attrs(n.op))
      n.sym_attrs = (*symbolic)[static_cast<std::size_t>(n.capture)];
  }
};

inline int flatten_into(const expr::TensorLeaf&, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::arg;
  n.slot = s.next_tensor++;
  g.nodes.push_back(n);  // eager leaves are distinct arguments even if they alias
  return g.size() - 1;
}
template <int I>
int flatten_into(const expr::Arg<I>&, Graph& g, FlattenState&) {
  Node n;
  n.op = Op::arg;
  n.slot = I;
  return g.add(n);
}
template <bool F>
int flatten_into(const expr::Scalar<F>&, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::scalar;
  n.slot = s.next_scalar++;
  n.weak = true;
  n.floating = F;
  return g.add(n);
}
inline int flatten_into(const expr::Iota& e, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::iota;
  n.attrs = e.attrs;
  s.tag(n);
  return g.add(n);
}
template <Op O, class... C>
int flatten_into(const expr::Node<O, C...>& e, Graph& g, FlattenState& s) {
  if constexpr (is_leaf_view<expr::Node<O, C...>>::value)
    if (s.fold_views) return flatten_into(expr::TensorLeaf{}, g, s);
  Node n;
  n.op = O;
  std::apply([&](const auto&... child) { ((n.in[n.n_in++] = flatten_into(child, g, s)), ...); }, e.in);
  n.attrs = e.attrs;
  s.tag(n);
  return g.add(n);
}

}  // namespace detail

// Gathers the per-call values of an expression (the cache-hit path: no allocation).
template <class E, bool Fold>
void gather(const E& e, Captured<E, Fold>& c) {
  c.nt = c.ns = c.na = c.nv = 0;
  if constexpr (is_tuple<E>::value)
    std::apply([&](const auto&... x) { (detail::gather(x, c), ...); }, e);
  else
    detail::gather(e, c);
}

// Flattens a function's result (one expression, or a std::tuple of them) into a graph whose
// first `nargs` argument slots are the function's arguments; tensors captured inside the
// expression take the slots after them. fold_views: as Captured<E, true> gathers. symbolic: per
// captured attribute, the bits of it that are symbolic (graph.hpp's sym_bits).
template <class E>
Graph flatten_result(int nargs, const E& e, bool fold_views = false, const std::vector<std::uint8_t>* symbolic = nullptr) {
  Graph g;
  detail::FlattenState s;
  s.fold_views = fold_views;
  s.symbolic = symbolic;
  s.next_tensor = std::max(nargs, Counts<E>::max_arg + 1);
  auto add_output = [&](const auto& x) {
    using X = std::remove_cvref_t<decltype(x)>;
    if constexpr (detail::is_assign<X>::value) {
      g.outputs.push_back(detail::flatten_into(x.value, g, s));
      g.output_into.push_back(X::slot);
    } else {
      g.outputs.push_back(detail::flatten_into(x, g, s));
      g.output_into.push_back(-1);
    }
  };
  if constexpr (is_tuple<E>::value)
    std::apply([&](const auto&... x) { (add_output(x), ...); }, e);
  else
    add_output(e);
  g.num_args = s.next_tensor;
  g.num_scalars = s.next_scalar;
  return g;
}

// Flattens one or several expressions (several outputs) into a graph.
template <class... E>
Graph flatten(const E&... e) {
  return flatten_result(0, std::tuple<const E&...>(e...));
}

}  // namespace kiln::graph
