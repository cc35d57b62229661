// k::assign(a, expr): an in-place update of argument a, functionalised — the graph stays pure and
// the kernel that computes expr writes its result into a's memory (API.md, "In-place updates").
#pragma once
#include "node.hpp"

namespace kiln {
namespace expr {

template <int I, class E>
struct Assign : ExprBase {
  static constexpr int slot = I;
  E value;
};

template <int I, class E>
struct is_expr_t<Assign<I, E>> : std::true_type {};

}  // namespace expr

template <int I, class E>
requires Operand<E>
auto assign(const expr::Arg<I>&, E&& value) {
  return expr::Assign<I, expr::lifted_t<E>>{{}, expr::lift(std::forward<E>(value))};
}

}  // namespace kiln
