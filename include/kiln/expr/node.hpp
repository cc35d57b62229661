// Expression nodes: the C++ type of an expression is its graph. A node is Node<Op, Children...>;
// leaves are tensors (eager), argument placeholders (k::compile) and scalar slots. Values that may
// change between calls (scalars, dims, view sizes) live in the object, never in the type; the
// object is a DAG of shared node bodies.
#pragma once
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/tensor.hpp"
#include "op.hpp"

namespace kiln {

// Run-time attributes of a node: reduction dims, view sizes, slice bounds, a cast's dtype, the
// identity of a custom op.
struct Attrs {
  Dims dims;                                // reduce: dims; reshape/expand: sizes; permute: order; iota: shape
  std::int64_t a = 0, b = 0, c = 0, d = 0;  // slice: dim, start, stop, step; iota: dim; custom_backward: a = input;
                                            // amax: d = shift_flag (see below); attention: a = causal,
                                            // b = scale given, c = score_mod (attention_grad: which
                                            // gradient, d = Hopper kernels); attention_flash: d = warps,
                                            // dims = {row tiles, Hopper kernels},
                                            // keepdim = fused backward (runtime/lower.hpp)
  std::int32_t custom = -1;                 // custom ops: the registry id (expr/custom_op.hpp)
  kiln::dtype dt = kiln::dtype::f32;        // cast: target; iota: dtype
  bool keepdim = false;  // reductions; on a reshape: zero-padded (graph/infer_views.hpp's infer_padded_reshape)
  bool all = false;      // reduce over every dim
  friend constexpr bool operator==(const Attrs&, const Attrs&) = default;
  // attrs.d of an amax that only shifts values for a stable exp (softmax, logsumexp): it carries no
  // gradient, and over a dim of size 0 it is allowed (its -inf is never read: the row is empty).
  static constexpr std::int64_t shift_flag = 1;
  // A size of a reshape that the pipeline made (never a user's: k::reshape takes sizes >= -1): the
  // input's size along dim d, whatever it is at a call, so that a program with symbolic sizes
  // serves every value of it (graph/infer_views.hpp's infer_reshape).
  static constexpr std::int64_t input_dim(int d) { return -2 - d; }
  static constexpr bool is_input_dim(std::int64_t size) { return size <= -2; }
  static constexpr int input_dim_of(std::int64_t size) { return static_cast<int>(-2 - size); }
};

// The base of every expression node. It lives in namespace kiln so that argument-dependent
// lookup finds kiln's operators and functions for any node.
struct ExprBase {
  using kiln_expr_tag = void;
};

namespace expr {

// An operation node. Nodes are immutable and their operands and attributes live in one shared
// body: copying a node (reusing `h` in `h + f(h)`) copies a handle, never the subexpression, so an
// expression's size and the work to walk it (graph/flatten.hpp visits each body once) grow with
// its distinct nodes. The body's address is the node's identity.
template <Op O, class... C>
struct Node : ExprBase {
  static constexpr Op op = O;
  struct Body {
    std::tuple<C...> in;
    Attrs attrs;
  };
  Node(Attrs at, C... c) : body_(std::make_shared<const Body>(Body{{std::move(c)...}, std::move(at)})) {}
  const std::tuple<C...>& in() const { return body_->in; }
  const Attrs& attrs() const { return body_->attrs; }
  const void* identity() const { return body_.get(); }
  // Whether another handle holds this body too (only such a node can be met twice in a walk).
  bool shared() const { return body_.use_count() > 1; }

 private:
  std::shared_ptr<const Body> body_;
};

// An eager tensor inside an expression (held by value: cheap, and never dangles).
struct TensorLeaf : ExprBase {
  Tensor t;
};

// k::structure traces a function with Arg<structure_arg_base + i> in place of Arg<i> (argument i
// all the same, structure_slot(I) below): only so that k::item, which a structural trace cannot
// evaluate, can tell it is in one and say so at compile time.
inline constexpr int structure_arg_base = 1 << 20;
constexpr int structure_slot(int I) { return I >= structure_arg_base ? I - structure_arg_base : I; }

// Argument I of a compiled function; the tensor is bound at each call.
template <int I>
struct Arg : ExprBase {
  static constexpr int index = I;
  const Tensor* t = nullptr;
};

// One tensor of a container argument (a std::vector<k::Tensor> passed to a compiled function):
// `params[i]` inside the function. Its argument slot is a run-time value (the container's first
// slot plus i), so every element has this one type and a loop over a container builds one
// expression type; the slots a call uses are gathered and guarded (graph/flatten.hpp).
struct ArgAt : ExprBase {
  const Tensor* t = nullptr;
  int slot = -1;
};

// The placeholder of a container argument at position I of a compiled function: what the function
// receives for a std::vector<k::Tensor>. It is not an expression; its elements are.
template <int I>
struct ArgList {
  static constexpr int index = I;
  const std::vector<Tensor>* tensors = nullptr;
  int base = 0;  // the argument slot of element 0

  std::size_t size() const { return tensors ? tensors->size() : 0; }
  bool empty() const { return size() == 0; }
  ArgAt operator[](std::size_t i) const {
    return {{}, tensors && i < tensors->size() ? &(*tensors)[i] : nullptr, base + static_cast<int>(i)};
  }
  struct iterator {
    const ArgList* list;
    std::size_t i;
    ArgAt operator*() const { return (*list)[i]; }
    iterator& operator++() { return ++i, *this; }
    bool operator==(const iterator& o) const { return i == o.i; }
  };
  iterator begin() const { return {this, 0}; }
  iterator end() const { return {this, size()}; }
};

// Every element of a container argument as outputs of a traced gradient function (the wrt
// arguments are extra outputs there: autodiff/grad.hpp); flattened into one arg node each.
struct ArgSpan {
  int base = 0, count = 0;
};

// A C++ scalar: its value is a kernel argument, its kind (floating or integral) a type property
// because it takes part in dtype promotion.
template <bool Floating>
struct Scalar : ExprBase {
  static constexpr bool floating = Floating;
  double v;
};

// Index-valued leaves (iota) carry their shape and dim in attrs.
struct Iota : ExprBase {
  Attrs attrs;
};

// A reduction over every dim (k::sum(x) with no dims): the same node, marked in the type so that
// k::grad can tell at C++ compile time that the value is a single element.
template <class N>
struct FullReduction : N {
  using N::N;
};

template <class T>
struct is_expr_t : std::false_type {};
template <Op O, class... C>
struct is_expr_t<Node<O, C...>> : std::true_type {};
template <>
struct is_expr_t<TensorLeaf> : std::true_type {};
template <int I>
struct is_expr_t<Arg<I>> : std::true_type {};
template <>
struct is_expr_t<ArgAt> : std::true_type {};
template <bool F>
struct is_expr_t<Scalar<F>> : std::true_type {};
template <>
struct is_expr_t<Iota> : std::true_type {};
template <class N>
struct is_expr_t<FullReduction<N>> : std::true_type {};

}  // namespace expr

// Anything that can stand in an expression: an expression node, a tensor, or a C++ arithmetic scalar.
template <class T>
concept Expr = expr::is_expr_t<std::remove_cvref_t<T>>::value;
template <class T>
concept Operand =
    Expr<T> || std::is_same_v<std::remove_cvref_t<T>, Tensor> || std::is_arithmetic_v<std::remove_cvref_t<T>>;

namespace graph {
struct Captured;
struct Graph;
namespace detail {
struct FlattenState;
}
}  // namespace graph

namespace expr {
// The walks a type-erased expression forwards to its concrete one (graph/flatten.hpp defines them).
struct ErasedBody {
  virtual ~ErasedBody() = default;
  virtual void gather(graph::Captured& c) const = 0;
  virtual int flatten(graph::Graph& g, graph::detail::FlattenState& s) const = 0;
};
template <class E>
struct ErasedImpl;
}  // namespace expr

// k::expression: any expression behind one type, as std::function is any callable. An expression's
// C++ type is its graph, so `h = block(h)` in a loop cannot compile when h's type grows each time;
// `k::expression h = ...; for (...) h = block(h);` can. The graph is the same as without erasure
// (walks go through to the expression inside, once however often it is used); what is lost is what
// the type told at C++ compile time (k::grad then checks at run time that the value is a single
// element). Build models from layers this way; keep small pointwise functions typed.
class expression : public ExprBase {
 public:
  template <class E>
  requires(Expr<E> && !std::is_same_v<std::remove_cvref_t<E>, expression>) expression(E&& e);
  expression(const Tensor& t);
  const void* identity() const { return body_.get(); }
  bool shared() const { return body_.use_count() > 1; }
  const expr::ErasedBody& body() const { return *body_; }

 private:
  std::shared_ptr<const expr::ErasedBody> body_;
};

namespace expr {
template <>
struct is_expr_t<expression> : std::true_type {};

// Lifts an operand into an expression node.
template <class T>
auto lift(T&& x) {
  using U = std::remove_cvref_t<T>;
  if constexpr (Expr<U>)
    return U(std::forward<T>(x));
  else if constexpr (std::is_same_v<U, Tensor>)
    return TensorLeaf{{}, x};
  else
    return Scalar<std::is_floating_point_v<U>>{{}, static_cast<double>(x)};
}
template <class T>
using lifted_t = decltype(lift(std::declval<T>()));

template <Op O, class... T>
auto make(Attrs at, T&&... x) {
  return Node<O, lifted_t<T>...>(std::move(at), lift(std::forward<T>(x))...);
}

}  // namespace expr
}  // namespace kiln
