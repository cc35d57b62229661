// A k::grad / value_and_grad / vjp called while another function is traced (compiled or not):
// `auto [loss, grads] = vg(params, x, y);` inside a k::compile'd training step. The callee's
// value is traced into the caller's graph with each wrt argument behind a grad_leaf node, and each
// gradient is a grad_of node over the value and that leaf; autodiff/expand_gradients.hpp
// differentiates them after decomposition, so the step is one program: its gradients are
// intermediates that the update reads where they are made. Results as a call with tensors gives
// them (autodiff/grad.hpp), k::expressions in place of k::Tensors, std::vector<k::expression> for
// a container.
#pragma once
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../graph/flatten.hpp"
#include "grad.hpp"

namespace kiln::detail {

template <class T>
struct is_expression_list : std::false_type {};
template <>
struct is_expression_list<std::vector<expression>> : std::true_type {};

// An argument as a callee inlined into a caller's trace receives it (a tensor as a leaf of the
// caller's graph); runtime/api.hpp's compiled functions too.
template <class T>
decltype(auto) inner_argument(const T& a) {
  if constexpr (std::is_same_v<T, Tensor>)
    return expression(a);
  else
    return (a);
}

// A wrt argument as the callee receives it: behind a grad_leaf, each element of a container (a
// placeholder's, or a std::vector of tensors or expressions). Leaves are never merged (graph.hpp's
// CseIndex): two over one expression are two independent inputs.
inline expression grad_leaf(expression x) {
  return expression(expr::Node<Op::grad_leaf, expression>(Attrs{}, std::move(x)));
}
template <class T>
auto received_as_leaf(const T& a) {
  if constexpr (is_arg_list<T>::value || graph::is_vector<T>::value) {
    std::vector<expression> leaves;
    leaves.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) leaves.push_back(grad_leaf(expression(a[i])));
    return leaves;
  } else {
    return grad_leaf(expression(a));
  }
}

template <class F, autodiff::Mode M, int... I, class... T>
auto inner_gradient_checked(const GradFn<F, M, I...>& gf, const T&... a) {
  constexpr bool vjp = M == autodiff::Mode::vjp;
  constexpr int n = static_cast<int>(sizeof...(T)) - (vjp ? 1 : 0);
  const auto args = std::forward_as_tuple(a...);
  const auto received = [&]<std::size_t... K>(std::index_sequence<K...>) {
    auto one = [&]<std::size_t P>() {
      if constexpr (((static_cast<int>(P) == I) || ...))
        return received_as_leaf(std::get<P>(args));
      else
        return inner_argument(std::get<P>(args));
    };
    return std::make_tuple(one.template operator()<K>()...);
  }
  (std::make_index_sequence<static_cast<std::size_t>(n)>{});
  auto traced = std::apply(gf.fn, received);
  static_assert(Expr<decltype(traced)>,
                "a k::grad / value_and_grad / vjp called inside a function needs its function to return one "
                "expression (its value)");
  if constexpr (!Expr<decltype(traced)>) {
    return expression(expr::Arg<0>{});  // after the assertion: no second error
  } else {
    check_value<M, decltype(traced), I...>();
    const expression value(std::move(traced));
    auto grad_of = [&](const expression& leaf) {
      if constexpr (vjp) {
        const expression cotangent(inner_argument(std::get<sizeof...(T) - 1>(args)));
        return expression(expr::Node<Op::grad_of, expression, expression, expression>(Attrs{}, value, leaf, cotangent));
      } else {
        return expression(expr::Node<Op::grad_of, expression, expression>(Attrs{}, value, leaf));
      }
    };
    auto gradient = [&]<int P>() {
      const auto& leaf = std::get<static_cast<std::size_t>(P)>(received);
      if constexpr (is_expression_list<std::remove_cvref_t<decltype(leaf)>>::value) {
        std::vector<expression> g;
        g.reserve(leaf.size());
        for (const expression& l : leaf) g.push_back(grad_of(l));
        return g;
      } else {
        return grad_of(leaf);
      }
    };
    if constexpr (M == autodiff::Mode::value_and_grad)
      return std::tuple{value, gradient.template operator()<I>()...};
    else if constexpr (sizeof...(I) == 1)
      return gradient.template operator()<I...>();
    else
      return std::tuple{gradient.template operator()<I>()...};
  }
}

// Whether an argument is one of k::structure's placeholders (or an expression over them).
template <class T>
constexpr bool structural_argument() {
  if constexpr (Expr<T> && !std::is_same_v<T, expression>)
    return graph::Counts<T>::max_arg >= expr::structure_arg_base;
  else
    return false;
}

template <class F, autodiff::Mode M, int... I, class... T>
auto inner_gradient_of(const GradFn<F, M, I...>& gf, const T&... a) {
  static_assert(!(structural_argument<T>() || ...),
                "k::structure: the function takes a gradient inside (a k::grad / value_and_grad / vjp called in it), "
                "which is derived at the first call, not in a constant expression; take k::structure of the "
                "gradient function itself");
  constexpr bool vjp = M == autodiff::Mode::vjp;
  static_assert(!vjp || sizeof...(T) >= 1, "k::vjp takes the cotangent of the function's value as its last argument");
  constexpr int n = static_cast<int>(sizeof...(T)) - (vjp ? 1 : 0);
  if constexpr ((structural_argument<T>() || ...))
    return std::get<0>(std::forward_as_tuple(a...));  // after the assertion: no second error
  else if constexpr (n < 0 || !(wrt_index_check<I, n>::ok && ...))
    return expression(expr::Arg<0>{});  // after an assertion: no second error
  else
    return inner_gradient_checked(gf, a...);
}

template <class G, class... T>
auto inner_gradient(const G& gf, const T&... a) {
  return inner_gradient_of(gf, a...);
}

}  // namespace kiln::detail
