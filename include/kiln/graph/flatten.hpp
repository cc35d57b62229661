// Flattening: turns an expression object into the run-time node table once per expression type
// (and sharing), and gathers the values that change between calls (tensors, scalars, attributes)
// at every call, in the same traversal order. Both walks visit each shared node body once, so
// their cost is linear in the expression's distinct nodes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "../expr/assign.hpp"
#include "graph.hpp"
#include "views.hpp"

namespace kiln::graph {

// The largest argument index an expression of type E reads (-1: none). Computed on the type, which
// the compiler shares: linear in the expression's distinct node types.
template <class E>
struct Counts;
template <>
struct Counts<expr::TensorLeaf> {
  static constexpr int max_arg = -1;
};
template <int I>
struct Counts<expr::Arg<I>> {
  static constexpr int max_arg = I;  // (k::structure's placeholders: expr::structure_slot(I))
};
template <>
struct Counts<expr::ArgAt> {  // container slots come after the positional arguments
  static constexpr int max_arg = -1;
};
template <>
struct Counts<expression> {  // erased: a compiled function's arguments are below the call's count anyway
  static constexpr int max_arg = -1;
};
template <>
struct Counts<expr::ArgSpan> {
  static constexpr int max_arg = -1;
};
template <bool F>
struct Counts<expr::Scalar<F>> {
  static constexpr int max_arg = -1;
};
template <>
struct Counts<expr::Iota> {
  static constexpr int max_arg = -1;
};
template <Op O, class... C>
struct Counts<expr::Node<O, C...>> {
  static constexpr int max_arg = std::max({-1, Counts<C>::max_arg...});
};
template <class N>
struct Counts<expr::FullReduction<N>> : Counts<N> {};
template <int I, class E>
struct Counts<expr::Assign<I, E>> {
  static constexpr int max_arg = std::max(I, Counts<E>::max_arg);
};

template <class E>
struct Counts<expr::AssignAt<E>> : Counts<E> {};

template <class T>
struct is_tuple : std::false_type {};
template <class... T>
struct is_tuple<std::tuple<T...>> : std::true_type {};

// A function may return a std::vector of results of one type (an update per container element):
// their number is a run-time value.
template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};
template <class T>
struct Counts<std::vector<T>> : Counts<T> {};
template <class T>
struct has_vector : is_vector<T> {};
template <class... T>
struct has_vector<std::tuple<T...>> : std::bool_constant<(has_vector<std::remove_cvref_t<T>>::value || ...)> {};

template <class... E>
struct Counts<std::tuple<E...>> {
  static constexpr int max_arg = std::max({-1, Counts<std::remove_cvref_t<E>>::max_arg...});
};

// The node bodies a walk has met, by identity (expr::Node::identity), with a value each (the visit
// number in a gather, the graph node in a flatten). Open addressing over a power-of-two table that
// is reused between walks: lookups and inserts in constant time, no allocation once warm. Only
// bodies held by several handles are entered: nothing else can be met twice.
class SharedNodes {
 public:
  int find(const void* p) const {
    if (used_.empty()) return -1;
    for (std::size_t i = slot(p);; i = (i + 1) & (table_.size() - 1)) {
      if (table_[i].first == p) return table_[i].second;
      if (!table_[i].first) return -1;
    }
  }
  void insert(const void* p, int value) {
    if ((used_.size() + 1) * 2 > table_.size()) grow();
    std::size_t i = slot(p);
    while (table_[i].first) i = (i + 1) & (table_.size() - 1);
    table_[i] = {p, value};
    used_.push_back(i);
  }
  void clear() {
    for (std::size_t i : used_) table_[i] = {nullptr, 0};
    used_.clear();
  }

 private:
  std::size_t slot(const void* p) const {
    auto h = reinterpret_cast<std::uintptr_t>(p) >> 4;
    h *= 0x9e3779b97f4a7c15ull;
    return static_cast<std::size_t>(h >> 20) & (table_.size() - 1);
  }
  void grow() {
    std::vector<std::pair<const void*, int>> old;
    for (std::size_t i : used_) old.push_back(table_[i]);
    table_.assign(std::max<std::size_t>(64, table_.size() * 2), {nullptr, 0});
    used_.clear();
    for (auto& [p, v] : old) insert(p, v);
  }
  std::vector<std::pair<const void*, int>> table_;
  std::vector<std::size_t> used_;
};

// The per-call values of an expression, in the order a walk first meets them: tensor leaves,
// scalars, and each distinct node's attributes (with its op). A node body met again (a shared
// subexpression) is not walked again; where such meetings happen is the expression's sharing, and
// two expressions of one type can share differently (`x * 2 + x * 2` or `y + y` with y = x * 2), so
// the sharing is one more captured attribute (`structure`, last, op Op::arg: a hash of the
// meetings and their count), compared by the program cache like any other. With `fold` set, each
// chain of views of an eager tensor is gathered as the viewed tensor itself (kept in `views`), and
// its attributes are not gathered: the runtime's evaluation does this, so those attributes are
// never guards. The oracle and export keep views as nodes. The vectors keep their capacity between
// calls: a warm gather does not allocate.
struct Captured {
  bool fold = false;
  std::vector<const Tensor*> tensors;
  std::vector<double> scalars;
  std::vector<const Attrs*> attrs;
  std::vector<Op> ops;  // the op of each attributed node
  std::vector<Tensor> views;
  std::vector<const Tensor*> bound;  // the tensors bound to Arg<I> placeholders, by I (the oracle's)
  Attrs structure;                   // the sharing attribute (see above)
  Attrs slots;                       // the container elements' slots met, hashed (a.: hash, b: count)
  SharedNodes seen;
  int visits = 0, meetings = 0;
  int nt = 0, ns = 0, na = 0, nv = 0;

  void reset(bool fold_views) {
    fold = fold_views;
    tensors.clear();
    scalars.clear();
    attrs.clear();
    ops.clear();
    views.clear();
    bound.clear();
    seen.clear();
    structure = Attrs{};
    slots = Attrs{};
    visits = meetings = nt = ns = na = nv = 0;
  }
  void add_attrs(Op op, const Attrs* a) {
    attrs.push_back(a);
    ops.push_back(op);
    ++na;
  }
  // Node body p, met at this point of the walk: true when it was met before (not walked again).
  bool met_before(const void* p, bool shared) {
    int first = shared ? seen.find(p) : -1;
    if (first >= 0) {
      structure.a =
          static_cast<std::int64_t>(mix(static_cast<std::uint64_t>(structure.a),
                                        static_cast<std::uint64_t>(visits) << 32 | static_cast<std::uint32_t>(first)));
      structure.b = ++meetings;
      ++visits;
      return true;
    }
    if (shared) seen.insert(p, visits);
    ++visits;
    return false;
  }
  // Which container element a leaf reads is a run-time value: the slots met, in walk order, are one
  // more attribute (a function indexing its container differently compiles another program).
  void add_slot(int slot) {
    slots.a = static_cast<std::int64_t>(mix(static_cast<std::uint64_t>(slots.a), static_cast<std::uint64_t>(slot)));
    ++slots.b;
  }
  // Appends the sharing attribute when some node was met twice, and the slots attribute.
  void finish() {
    if (meetings) add_attrs(Op::arg, &structure);
    if (slots.b) add_attrs(Op::arg, &slots);
  }
  // Drops the references a call holds (viewed tensors) once the call is done.
  void release() {
    views.clear();
    tensors.clear();
    attrs.clear();
  }

 private:
  static std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xbf58476d1ce4e5b9ull;
  }
};

namespace detail {

// (Not named `gather`: argument-dependent lookup on Captured would find graph::gather, an exact
// match for a FullReduction child where these take its Node base, and restart the walk.)
inline void gather_into(const expr::TensorLeaf& e, Captured& c) {
  c.tensors.push_back(&e.t);
  ++c.nt;
}
template <int I>
void gather_into(const expr::Arg<I>& e, Captured& c) {
  if (!e.t) return;
  if (c.bound.size() <= std::size_t{I}) c.bound.resize(std::size_t{I} + 1, nullptr);
  c.bound[std::size_t{I}] = e.t;
}
inline void gather_into(const expr::ArgAt& e, Captured& c) {
  c.add_slot(e.slot);
  if (!e.t) return;
  if (c.bound.size() <= static_cast<std::size_t>(e.slot)) c.bound.resize(static_cast<std::size_t>(e.slot) + 1, nullptr);
  c.bound[static_cast<std::size_t>(e.slot)] = e.t;
}
// A type-erased expression is walked once however often it is used, like a shared node body.
inline void gather_into(const expression& e, Captured& c) {
  if (c.met_before(e.identity(), e.shared())) return;
  e.body().gather(c);
}
inline void gather_into(const expr::ArgSpan& e, Captured& c) {  // a container's layout decides its outputs
  c.add_slot(e.base);
  c.add_slot(e.count);
}
template <bool F>
void gather_into(const expr::Scalar<F>& e, Captured& c) {
  c.scalars.push_back(e.v);
  ++c.ns;
}
inline void gather_into(const expr::Iota& e, Captured& c) { c.add_attrs(Op::iota, &e.attrs); }
template <Op O, class... C>
void gather_into(const expr::Node<O, C...>& e, Captured& c) {
  if (c.met_before(e.identity(), e.shared())) return;
  if constexpr (is_leaf_view<expr::Node<O, C...>>::value) {
    if (c.fold) {
      c.views.push_back(leaf_tensor(e));
      ++c.nv;
      c.tensors.push_back(nullptr);  // pointed at the view once `views` stops growing (fix_views)
      ++c.nt;
      return;
    }
  }
  std::apply([&](const auto&... child) { (gather_into(child, c), ...); }, e.in());
  c.add_attrs(O, &e.attrs());
}
template <int I, class E>
void gather_into(const expr::Assign<I, E>& e, Captured& c) {
  gather_into(e.value, c);
}
template <class E>
void gather_into(const expr::AssignAt<E>& e, Captured& c) {
  c.add_slot(e.slot);
  gather_into(e.value, c);
}
// The results of a function: one, a tuple or a vector of them (nested).
template <class E>
void gather_result(const E& e, Captured& c) {
  if constexpr (is_tuple<E>::value)
    std::apply([&](const auto&... x) { (gather_result(x, c), ...); }, e);
  else if constexpr (is_vector<E>::value) {
    c.add_slot(static_cast<int>(e.size()));  // the number of results is part of the program
    for (const auto& x : e) gather_result(x, c);
  } else
    gather_into(e, c);
}

// The tensors of folded views point into `views`, which may move while it grows: set them last.
inline void fix_views(Captured& c) {
  int v = 0;
  for (auto& t : c.tensors)
    if (!t) t = &c.views[static_cast<std::size_t>(v++)];
}

template <class T>
struct is_assign : std::false_type {};
template <int I, class E>
struct is_assign<expr::Assign<I, E>> : std::true_type {};
template <class T>
struct is_assign_at : std::false_type {};
template <class E>
struct is_assign_at<expr::AssignAt<E>> : std::true_type {};

struct FlattenState {
  SharedNodes seen;     // node bodies met before -> their graph node
  CseIndex cse;         // equal nodes of distinct bodies become one
  int next_tensor = 0;  // eager leaves are numbered after the largest Arg index
  int next_scalar = 0;
  int next_capture = 0;     // attributed nodes, numbered as gather() numbers their attrs
  bool fold_views = false;  // views of eager tensors are arguments (as gather with fold_views)
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
int flatten_into(const expr::Arg<I>&, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::arg;
  n.slot = I;
  return s.cse.add(g, n);
}
inline int flatten_into(const expr::ArgAt& e, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::arg;
  n.slot = e.slot;
  return s.cse.add(g, n);  // one node a slot: an element used twice is one argument
}
inline int flatten_into(const expression& e, Graph& g, FlattenState& s) {
  const bool shared = e.shared();
  if (shared)
    if (int at = s.seen.find(e.identity()); at >= 0) return at;
  const int id = e.body().flatten(g, s);
  if (shared) s.seen.insert(e.identity(), id);
  return id;
}
template <bool F>
int flatten_into(const expr::Scalar<F>&, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::scalar;
  n.slot = s.next_scalar++;
  n.weak = true;
  n.floating = F;
  return s.cse.add(g, n);
}
inline int flatten_into(const expr::Iota& e, Graph& g, FlattenState& s) {
  Node n;
  n.op = Op::iota;
  n.attrs = e.attrs;
  s.tag(n);
  return s.cse.add(g, n);
}
template <Op O, class... C>
int flatten_into(const expr::Node<O, C...>& e, Graph& g, FlattenState& s) {
  const bool shared = e.shared();
  if (shared)
    if (int at = s.seen.find(e.identity()); at >= 0) return at;
  int id = -1;
  if constexpr (is_leaf_view<expr::Node<O, C...>>::value)
    if (s.fold_views) id = flatten_into(expr::TensorLeaf{}, g, s);
  if (id < 0) {
    Node n;
    n.op = O;
    std::apply([&](const auto&... child) { ((n.in[n.n_in++] = flatten_into(child, g, s)), ...); }, e.in());
    n.attrs = e.attrs();
    s.tag(n);
    id = s.cse.add(g, n);
  }
  if (shared) s.seen.insert(e.identity(), id);
  return id;
}

}  // namespace detail

// Gathers the per-call values of an expression (the cache-hit path: no allocation once `c` is warm).
template <class E>
void gather(const E& e, Captured& c, bool fold_views = false) {
  c.reset(fold_views);
  detail::gather_result(e, c);
  detail::fix_views(c);
  c.finish();
}

// Flattens a function's result (one expression, or a std::tuple of them) into a graph whose
// first `nargs` argument slots are the function's arguments; tensors captured inside the
// expression take the slots after them. fold_views: as gather(e, c, true) gathers. symbolic: per
// captured attribute, the bits of it that are symbolic (graph.hpp's sym_bits).
template <class E>
Graph flatten_result(int nargs, const E& e, bool fold_views = false,
                     const std::vector<std::uint8_t>* symbolic = nullptr) {
  Graph g;
  detail::FlattenState s;
  s.fold_views = fold_views;
  s.symbolic = symbolic;
  s.next_tensor = std::max(nargs, Counts<E>::max_arg + 1);
  auto add_output = [&](const auto& self, const auto& x) -> void {
    using X = std::remove_cvref_t<decltype(x)>;
    if constexpr (is_tuple<X>::value) {
      std::apply([&](const auto&... y) { (self(self, y), ...); }, x);
    } else if constexpr (is_vector<X>::value) {
      for (const auto& y : x) self(self, y);
    } else if constexpr (std::is_same_v<X, expr::ArgSpan>) {  // every element of a container: one output each
      for (int k = 0; k < x.count; ++k) {
        g.outputs.push_back(detail::flatten_into(expr::ArgAt{{}, nullptr, x.base + k}, g, s));
        g.output_into.push_back(-1);
      }
    } else if constexpr (detail::is_assign<X>::value) {
      g.outputs.push_back(detail::flatten_into(x.value, g, s));
      g.output_into.push_back(X::slot);
    } else if constexpr (detail::is_assign_at<X>::value) {
      g.outputs.push_back(detail::flatten_into(x.value, g, s));
      g.output_into.push_back(x.slot);
    } else {
      g.outputs.push_back(detail::flatten_into(x, g, s));
      g.output_into.push_back(-1);
    }
  };
  add_output(add_output, e);
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

#include "erased.hpp"  // k::expression's walks, which need every overload above
