// k::expression's body: the concrete expression behind it, walked by graph/flatten.hpp's gather and
// flatten, which it forwards to (so this comes after every overload of them). Split from flatten.hpp.
#pragma once
#include <memory>
#include <utility>

#include "flatten.hpp"

namespace kiln {
namespace expr {
template <class E>
struct ErasedImpl final : ErasedBody {
  E e;
  explicit ErasedImpl(E x) : e(std::move(x)) {}
  void gather(graph::Captured& c) const override { graph::detail::gather_into(e, c); }
  int flatten(graph::Graph& g, graph::detail::FlattenState& s) const override {
    return graph::detail::flatten_into(e, g, s);
  }
};
}  // namespace expr

template <class E>
requires(Expr<E> && !std::is_same_v<std::remove_cvref_t<E>, expression>) expression::expression(E&& e)
    : body_(std::make_shared<const expr::ErasedImpl<std::remove_cvref_t<E>>>(std::forward<E>(e))) {
  using T = std::remove_cvref_t<E>;
  static_assert(!graph::detail::is_assign<T>::value && !graph::detail::is_assign_at<T>::value,
                "a k::assign is a compiled function's result, not a value: return it (in a std::tuple, or a "
                "std::vector of updates of one type) instead of holding it in a k::expression");
}
inline expression::expression(const Tensor& t)
    : body_(std::make_shared<const expr::ErasedImpl<expr::TensorLeaf>>(expr::TensorLeaf{{}, t})) {}
}  // namespace kiln
