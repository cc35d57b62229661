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

// An update of one tensor of a container argument (k::assign(params[i], expr)): its slot is a
// run-time value, so updates of every element have one type and a loop can collect them in a
// std::vector that the function returns.
template <class E>
struct AssignAt : ExprBase {
  int slot = -1;
  E value;
};

template <class E>
struct is_expr_t<AssignAt<E>> : std::true_type {};

}  // namespace expr

template <int I, class E>
requires Operand<E>
auto assign(const expr::Arg<I>&, E&& value) {
  return expr::Assign<I, expr::lifted_t<E>>{{}, expr::lift(std::forward<E>(value))};
}

template <class E>
requires Operand<E>
auto assign(const expr::ArgAt& a, E&& value) {
  return expr::AssignAt<expr::lifted_t<E>>{{}, a.slot, expr::lift(std::forward<E>(value))};
}

}  // namespace kiln
