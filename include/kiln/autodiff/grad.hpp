// k::grad, k::value_and_grad and k::vjp (API.md, "gradients"): wrappers that the runtime traces like
// any function and then differentiates with autodiff::differentiate. Misuse that the expression type
// shows (a non-scalar value, a k::wrt index out of range, class indices in k::wrt) is a
// static_assert with a sentence, raised when the wrapper is traced.
//
// Protocol with the runtime (runtime/function.hpp), for any function object f:
//   1. traced = kiln::detail::trace(f, expr::Arg<0>{..}, ..., expr::Arg<M-1>{..})   (every call)
//   2. g = flatten(traced) -> infer_shapes -> rewrite::decompose -> infer_shapes -> rewrite::simplify
//   3. g = kiln::detail::transform_graph(f, g) -> infer_shapes -> rewrite::simplify  (once per type)
//   4. kiln::detail::num_outputs<F, decltype(traced)> results, in g.outputs order.
// For a GradFn, trace returns std::tuple{value, Arg<I>..., [cotangent Arg<M-1> for vjp]}: the extra
// outputs give every wrt argument (and the cotangent) a node with an inferred shape even when the
// value does not use it; transform_graph drops them again.
#pragma once
#include <cstddef>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../expr/ops.hpp"
#include "differentiate.hpp"

namespace kiln {

template <int... I>
struct wrt_t {};
template <int... I>
inline constexpr wrt_t<I...> wrt{};

namespace detail {
template <class G, int NumArgs>
constexpr void check_gradient_fn();
template <class G, class... T>
auto inner_gradient(const G& gf, const T&... args);  // autodiff/inner_grad.hpp
}  // namespace detail

// The function returned by k::grad / k::value_and_grad / k::vjp: F's gradients with respect to the
// arguments I... (value first for value_and_grad), as one k::Tensor or a std::tuple of them.
template <class F, autodiff::Mode M, int... I>
struct GradFn {
  static_assert(sizeof...(I) > 0, "k::wrt<...> needs at least one argument index");
  static constexpr autodiff::Mode mode = M;
  F fn;

  // Runs through k::compile, which <kiln/kiln.hpp> defines and ADL finds when this is instantiated,
  // so this header does not depend on the runtime. For repeated calls, keep k::compile(grad_fn).
  template <class... T>
  requires((std::is_same_v<T, Tensor> || std::is_same_v<T, std::vector<Tensor>>)&&...) auto operator()(
      const T&... args) const {
    if constexpr ((std::is_same_v<T, Tensor> && ...))
      detail::check_gradient_fn<GradFn, static_cast<int>(sizeof...(T))>();
    return compile(*this)(args...);
  }
  // Called while another function is traced (with its expressions or placeholders): the value and
  // gradients as expressions of the caller's graph, differentiated with it (autodiff/inner_grad.hpp).
  template <class... T>
  requires(!((std::is_same_v<T, Tensor> || std::is_same_v<T, std::vector<Tensor>>)&&...)) auto operator()(
      const T&... args) const {
    return detail::inner_gradient(*this, args...);
  }
};

template <class F, int... I>
constexpr auto grad(F fn, wrt_t<I...>) {
  return GradFn<F, autodiff::Mode::grad, I...>{std::move(fn)};
}
template <class F, int... I>
constexpr auto value_and_grad(F fn, wrt_t<I...>) {
  return GradFn<F, autodiff::Mode::value_and_grad, I...>{std::move(fn)};
}
// The returned function takes the cotangent of F's value as an extra last argument.
template <class F, int... I>
constexpr auto vjp(F fn, wrt_t<I...>) {
  return GradFn<F, autodiff::Mode::vjp, I...>{std::move(fn)};
}

template <class T>
struct is_gradient_fn : std::false_type {};
template <class F, autodiff::Mode M, int... I>
struct is_gradient_fn<GradFn<F, M, I...>> : std::true_type {};

namespace detail {

// ---- what the expression type says about its value: a single element? -------------------------
enum class Scalarity { no, maybe, yes };  // maybe: a reduction with dims, checked at run time

constexpr Scalarity node_scalarity(Op op, std::initializer_list<Scalarity> in) {
  if (op == Op::cross_entropy || op == Op::mse_loss || op == Op::numel) return Scalarity::yes;
  if (is_reduction(op) || op == Op::mean || op == Op::var || op == Op::logsumexp) return Scalarity::maybe;
  if (is_pointwise(op) || op == Op::silu || op == Op::gelu || op == Op::gelu_tanh || op == Op::clamp) {
    bool all_yes = true;
    for (auto s : in) {
      if (s == Scalarity::no) return Scalarity::no;
      all_yes = all_yes && s == Scalarity::yes;
    }
    return all_yes ? Scalarity::yes : Scalarity::maybe;
  }
  switch (op) {  // views and shape-preserving ops of one input keep its answer
    case Op::reshape:
    case Op::permute:
    case Op::transpose:
    case Op::unsqueeze:
    case Op::squeeze:
    case Op::slice:
    case Op::softmax:
    case Op::log_softmax:
      return *in.begin();
    case Op::custom:  // the user's shape rule decides, at run time
      return Scalarity::maybe;
    default:
      return Scalarity::no;
  }
}

template <class E>
struct scalarity : std::integral_constant<Scalarity, Scalarity::no> {};
template <bool F>
struct scalarity<expr::Scalar<F>> : std::integral_constant<Scalarity, Scalarity::yes> {};
template <class N>
struct scalarity<expr::FullReduction<N>> : std::integral_constant<Scalarity, Scalarity::yes> {};
template <>  // erased: checked at run time
struct scalarity<expression> : std::integral_constant<Scalarity, Scalarity::maybe> {};
template <Op O, class... C>
struct scalarity<expr::Node<O, C...>> : std::integral_constant<Scalarity, node_scalarity(O, {scalarity<C>::value...})> {
};

template <class E>
inline constexpr Scalarity scalarity_v = scalarity<std::remove_cvref_t<E>>::value;
// True when the type guarantees a single-element value (full reductions, losses, their pointwise
// combinations with each other and with C++ scalars).
template <class E>
inline constexpr bool is_scalar_valued = scalarity_v<E> == Scalarity::yes;

// ---- how argument I is used: as a value (differentiable) and/or as class indices ---------------
inline constexpr int used_as_value = 1, used_as_index = 2;

constexpr bool index_operand(Op op, std::size_t k) {
  return (op == Op::cross_entropy || op == Op::gather || op == Op::embedding || op == Op::embedding_backward) && k == 1;
}

template <int I, class E>
struct arg_use : std::integral_constant<int, 0> {};
template <int I>
struct arg_use<I, expr::Arg<I>> : std::integral_constant<int, used_as_value> {};
template <int I, class N>
struct arg_use<I, expr::FullReduction<N>> : arg_use<I, N> {};

template <int I, Op O, class... C, std::size_t... K>
constexpr int node_arg_use(std::index_sequence<K...>) {
  return (0 | ... | (index_operand(O, K) ? (arg_use<I, C>::value ? used_as_index : 0) : arg_use<I, C>::value));
}
template <int I, Op O, class... C>
struct arg_use<I, expr::Node<O, C...>>
    : std::integral_constant<int, node_arg_use<I, O, C...>(std::index_sequence_for<C...>{})> {};

template <int I, class E>
inline constexpr int arg_use_v = arg_use<I, std::remove_cvref_t<E>>::value;

// ---- the checks, one sentence each -------------------------------------------------------------
template <int Index, int NumArgs>
struct wrt_index_check {
  static_assert(Index >= 0 && Index < NumArgs,
                "k::wrt<...> names an argument that the function does not take: every index must be below the "
                "number of arguments (see wrt_index_check<index, number of arguments> above)");
  static constexpr bool ok = Index >= 0 && Index < NumArgs;
};

template <autodiff::Mode M, class E, int... I>
constexpr void check_value() {
  if constexpr (M == autodiff::Mode::grad)
    static_assert(scalarity_v<E> != Scalarity::no,
                  "k::grad needs a scalar-valued function: reduce the result with k::sum or k::mean, or use k::vjp");
  else if constexpr (M == autodiff::Mode::value_and_grad)
    static_assert(
        scalarity_v<E> != Scalarity::no,
        "k::value_and_grad needs a scalar-valued function: reduce the result with k::sum or k::mean, or use k::vjp");
  else
    static_assert(Expr<E>, "k::vjp needs a function returning one expression (not a std::tuple or a k::Tensor)");
  static_assert(
      ((arg_use_v<I, E> != used_as_index) && ...),
      "k::wrt names an integer argument (class indices) that has no gradient: remove its index from k::wrt<...>");
}

// ---- the protocol --------------------------------------------------------------------------------
// How many tensors f takes (0 to 8), or -1 when it is callable with none of these counts (or with
// several: a variadic function), found by calling it with argument placeholders.
template <class F, std::size_t... K>
constexpr bool callable_with(std::index_sequence<K...>) {
  return std::is_invocable_v<const F&, const expr::Arg<static_cast<int>(K)>&...>;
}
template <class F>
constexpr int tensors_taken() {
  return []<std::size_t... N>(std::index_sequence<N...>) {
    int found = -1, count = 0;
    ((callable_with<F>(std::make_index_sequence<N>{}) ? (found = static_cast<int>(N), ++count) : 0), ...);
    return count == 1 ? found : -1;
  }
  (std::make_index_sequence<9>{});
}
// Instantiated (as takes_tensors<2>::called_with<1>, which names both counts) when a function is
// called with another number of tensors than it takes.
template <int Takes>
struct takes_tensors {
  template <int Given>
  struct called_with {
    static_assert(Takes == Given,
                  "k::compile: the function is called with another number of tensors than it takes (the counts are "
                  "takes_tensors<takes>::called_with<given>)");
    static constexpr bool ok = Takes == Given;
  };
};
// Whether f may be called with Given tensors; when it takes another known count, the assertion
// above says so (and nothing else: the caller then does not call f).
template <class F, int Given>
constexpr bool tensor_count_ok() {
  if constexpr (callable_with<F>(std::make_index_sequence<static_cast<std::size_t>(Given)>{}))
    return true;
  else if constexpr (constexpr int takes = tensors_taken<F>(); takes >= 0)
    return takes_tensors<takes>::template called_with<Given>::ok;
  else
    return true;  // not callable with any count: the compiler's own error at the call says why
}

// Container arguments (std::vector<k::Tensor>) reach the function as expr::ArgList placeholders.
template <class A>
struct is_arg_list : std::false_type {};
template <int I>
struct is_arg_list<expr::ArgList<I>> : std::true_type {};
template <class... A>
inline constexpr bool any_arg_list = (is_arg_list<A>::value || ...);

// Whether f may be called with these placeholders. With a container among them f is called as it
// is (the count check would call it with tensor placeholders where it expects a container).
template <class F, int Given, class... A>
constexpr bool count_ok() {
  if constexpr (any_arg_list<A...>)
    return true;
  else
    return tensor_count_ok<F, Given>();
}

// A wrt argument as an extra traced output: itself, or every element of a container.
template <class A>
auto wrt_output(const A& a) {
  if constexpr (is_arg_list<A>::value)
    return expr::ArgSpan{a.base, static_cast<int>(a.size())};
  else
    return a;
}

// Whether a traced result is (or a tuple holds) a k::Tensor: a value computed when the function was
// traced, which a compiled program would return again at every later call.
template <class R>
struct returns_tensor : std::is_same<std::remove_cvref_t<R>, Tensor> {};
template <class... R>
struct returns_tensor<std::tuple<R...>> : std::bool_constant<(returns_tensor<R>::value || ...)> {};

// A plain function: its expression, built from the argument placeholders.
template <class F, class... A>
auto trace(const F& f, const A&... a) {
  if constexpr (count_ok<F, static_cast<int>(sizeof...(A)), A...>()) {
    constexpr bool tensor = returns_tensor<decltype(f(a...))>::value;
    static_assert(!tensor,
                  "a compiled or differentiated function returns kiln expressions, not a k::Tensor (k::Tensor(expr) "
                  "evaluates when the function is traced): return the expression itself, or a k::expression");
    if constexpr (tensor)
      return expr::Arg<0>{};  // after the assertion: no second error
    else
      return f(a...);
  } else {
    return expr::Arg<0>{};  // after the assertion: no second error
  }
}

// A gradient function: F on the forward arguments (all but the cotangent for vjp), followed by the
// wrt arguments (and the cotangent) as extra outputs.
template <class F, autodiff::Mode M, int... I, class... A>
auto trace(const GradFn<F, M, I...>& gf, const A&... a) {
  constexpr bool vjp = M == autodiff::Mode::vjp;
  static_assert(!vjp || sizeof...(A) >= 1, "k::vjp takes the cotangent of the function's value as its last argument");
  constexpr int n = static_cast<int>(sizeof...(A)) - (vjp ? 1 : 0);
  if constexpr (count_ok<F, n, A...>() && (wrt_index_check<I, n>::ok && ...)) {
    auto args = std::forward_as_tuple(a...);
    auto value = [&]<std::size_t... K>(std::index_sequence<K...>) { return gf.fn(std::get<K>(args)...); }
    (std::make_index_sequence<static_cast<std::size_t>(n)>{});
    check_value<M, decltype(value), I...>();
    if constexpr (vjp)
      return std::make_tuple(value, wrt_output(std::get<I>(args))..., std::get<n>(args));
    else
      return std::make_tuple(value, wrt_output(std::get<I>(args))...);
  } else {
    return std::make_tuple(expr::Arg<0>{}, expr::Arg<I>{}...);  // after an assertion: no second error
  }
}

// Graph outputs of the transformed graph, as the runtime returns them (one: a k::Tensor).
template <class T>
struct output_count : std::integral_constant<int, 1> {};
template <class... T>
struct output_count<std::tuple<T...>> : std::integral_constant<int, sizeof...(T)> {};
template <class F, class Traced>
inline constexpr int num_outputs = output_count<Traced>::value;
template <class F, autodiff::Mode M, int... I, class Traced>
inline constexpr int num_outputs<GradFn<F, M, I...>, Traced> = static_cast<int>(sizeof...(I)) +
                                                               (M == autodiff::Mode::value_and_grad ? 1 : 0);

// Where each argument position's tensors sit among the argument slots: a container (its first
// slot and size) or a single tensor (slot = position). Empty when no argument is a container.
struct ArgLayout {
  std::vector<std::pair<int, int>> spans;  // per position: (first slot, count), or (-1, 0) for a tensor
  constexpr bool is_container(int position) const {
    return position < static_cast<int>(spans.size()) && spans[static_cast<std::size_t>(position)].first >= 0;
  }
  // The slots of the arguments at `positions`, a container giving each of its elements in order.
  constexpr std::vector<int> slots(std::initializer_list<int> positions) const {
    std::vector<int> out;
    for (int p : positions) {
      if (!is_container(p)) {
        out.push_back(p);
        continue;
      }
      auto [first, count] = spans[static_cast<std::size_t>(p)];
      for (int k = 0; k < count; ++k) out.push_back(first + k);
    }
    return out;
  }
};

// The graph pass a function object asks for after decomposition: none for a plain function.
template <class F>
constexpr graph::Graph transform_graph(const F&, graph::Graph g, const ArgLayout& = {}) {
  return g;
}
template <class F, autodiff::Mode M, int... I>
constexpr graph::Graph transform_graph(const GradFn<F, M, I...>&, graph::Graph g, const ArgLayout& layout = {}) {
  const std::vector<int> wrt_slots = layout.slots({I...});
  int cotangent = -1;
  if constexpr (M == autodiff::Mode::vjp) {
    const graph::Node& c = g[g.outputs.back()];
    if (c.op != Op::arg) throw error("k::vjp: the last traced output is not the cotangent argument");
    cotangent = c.slot;
  }
  g.outputs.resize(1);
  if (std::is_constant_evaluated()) return autodiff::differentiate(g, wrt_slots, M, cotangent);  // k::structure
  return autodiff::differentiate_at_run_time(g, wrt_slots, M, cotangent);
}

// Instantiates trace for NumArgs placeholders, so that the static_asserts above fire at the call.
template <class G, std::size_t... K>
auto traced_type(std::index_sequence<K...>)
    -> decltype(trace(std::declval<const G&>(), std::declval<const expr::Arg<static_cast<int>(K)>&>()...));
// The same for k::structure, with its own placeholders (expr::structure_arg_base).
template <class G, std::size_t... K>
auto structure_traced_type(std::index_sequence<K...>)
    -> decltype(trace(std::declval<const G&>(),
                      std::declval<const expr::Arg<expr::structure_arg_base + static_cast<int>(K)>&>()...));
template <class G, int NumArgs>
constexpr void check_gradient_fn() {
  using Traced = decltype(traced_type<G>(std::make_index_sequence<static_cast<std::size_t>(NumArgs)>{}));
  static_assert(sizeof(Traced*) > 0);
}

}  // namespace detail
}  // namespace kiln
