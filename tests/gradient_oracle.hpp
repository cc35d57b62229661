// The oracle's side of a function or a gradient function: the passes the runtime runs, up to the
// joint graph, evaluated by the unfused f64 reference (reference/eval.hpp) without the fuser, the
// kernels or the program cache. Shared by test_autodiff and test_dynamic_sizes.
#pragma once
#include <utility>
#include <vector>

#include <kiln/autodiff/grad.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

namespace {

// The pipeline the runtime runs for a gradient function, up to the joint graph, on the oracle's side:
// trace (value, wrt args, cotangent) -> flatten -> infer -> decompose -> simplify -> differentiate.
struct Traced {
  kiln::graph::Graph g;  // after decompose and simplify, with the trace's extra outputs
  std::vector<kiln::Tensor> args;
  std::vector<double> scalars;
  void infer() {
    kiln::graph::infer_shapes(g, [&](int s) -> const kiln::Tensor& { return args[static_cast<std::size_t>(s)]; });
  }
};
template <class F, class... T>
Traced trace_gradient_fn(const F& fn, const T&... ts) {
  Traced t{{}, {ts...}, {}};
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    auto traced = kiln::detail::trace(fn, kiln::expr::Arg<static_cast<int>(K)>{{}, &t.args[K]}...);
    if constexpr (requires { std::tuple_size<decltype(traced)>::value; })  // a gradient function's outputs
      t.g = std::apply([](const auto&... e) { return kiln::graph::flatten(e...); }, traced);
    else  // a plain function's expression
      t.g = kiln::graph::flatten(traced);
    kiln::graph::Captured cap;  // one walk over every output, as flatten's
    kiln::graph::gather(traced, cap);
    t.scalars.assign(cap.scalars.begin(), cap.scalars.end());
  }
  (std::index_sequence_for<T...>{});
  t.infer();
  t.g = kiln::rewrite::decompose(t.g);
  t.infer();
  t.g = kiln::rewrite::simplify(t.g);
  return t;
}

// The outputs of fn (a function or kiln::grad/value_and_grad/vjp of one) at ts, by the oracle.
template <class F, class... T>
std::vector<kiln::reference::Value> oracle_outputs(const F& fn, const T&... ts) {
  Traced t = trace_gradient_fn(fn, ts...);
  return kiln::reference::eval_graph(kiln::detail::transform_graph(fn, t.g), t.args, t.scalars);
}

}  // namespace
