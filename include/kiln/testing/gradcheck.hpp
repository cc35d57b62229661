// k::testing::gradcheck(fn, args...): central finite differences in f64 on the CPU against the
// derived gradients (API.md, "Testing helpers"). The gradients come from the same passes the runtime
// runs (flatten, decompose, simplify, differentiate) but are evaluated by the f64 oracle
// (reference/eval.hpp) without the fuser; the finite differences evaluate the captured graph with its
// composites intact, so a wrong decomposition shows up too. A non-scalar fn is checked through a
// fixed random cotangent (a vjp), as torch.autograd.gradcheck does.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "../autodiff/expand_gradients.hpp"
#include "../autodiff/grad.hpp"
#include "../core/linkage.hpp"
#include "../graph/flatten.hpp"
#include "../reference/eval.hpp"
#include "../rewrite/decompose.hpp"
#include "../rewrite/simplify.hpp"

namespace kiln::testing {

struct GradcheckOptions {
  double eps = 1e-6;   // the finite-difference step
  double atol = 1e-5;  // |analytic - numeric| <= atol + rtol * max(|analytic|, |numeric|)
  double rtol = 1e-4;
  unsigned seed = 0;  // of the random cotangent of a non-scalar fn
};

// Converts to bool (every element within tolerance) and prints the worst element.
struct GradcheckResult {
  bool ok = true;
  int arg = -1;             // argument of the worst element (-1: nothing to compare)
  std::int64_t index = -1;  // its row-major index in that argument
  Dims shape;               // that argument's shape
  double analytic = 0, numeric = 0, tolerance = 0;
  std::int64_t checked = 0;  // elements compared

  operator bool() const { return ok; }  // NOLINT: converts as allclose's result does (API.md)

  friend std::ostream& operator<<(std::ostream& os, const GradcheckResult& r) {
    os << (r.ok ? "gradcheck passed" : "gradcheck FAILED") << " (" << r.checked << " elements)";
    if (r.arg < 0) return os;
    Dims idx;
    idx.resize(r.shape.size());
    const Dims strides = contiguous_strides(r.shape);
    for (int d = 0; d < r.shape.size(); ++d) idx[d] = (r.index / strides[d]) % std::max<std::int64_t>(r.shape[d], 1);
    return os << "; worst element: argument " << r.arg << " " << r.shape.str() << " at " << idx.str() << ": analytic "
              << r.analytic << ", numeric " << r.numeric << ", |difference| " << std::abs(r.analytic - r.numeric)
              << " (tolerance " << r.tolerance << ")";
  }
};

namespace detail {

// A contiguous CPU copy in which floating dtypes become f64 (perturbed in place later).
inline Tensor f64_copy(const Tensor& t) {
  const kiln::dtype d = is_floating(t.dtype()) ? kiln::dtype::f64 : t.dtype();
  const std::vector<double> v = reference::detail::read_values(t);  // any device, strides, dtype
  Tensor out = Tensor::empty(t.shape(), d, cpu);
  for (std::size_t i = 0; i < v.size(); ++i) store_from_double(out.data_ptr(), d, static_cast<std::int64_t>(i), v[i]);
  return out;
}

inline Tensor random_cotangent(const Dims& shape, unsigned seed) {
  Tensor c = Tensor::empty(shape, kiln::dtype::f64, cpu);
  auto* p = static_cast<double*>(c.data_ptr());
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  for (std::int64_t i = 0; i < c.numel(); ++i) p[i] = shape.product() == 1 ? 1.0 : normal(rng);
  return c;
}

// Checks graph g of fn's value (flattened from an expression over args xs) against finite differences.
// Slots: xs first, then captured tensors, then the cotangent.
// An entry point (core/linkage.hpp): gradcheck's templates only trace and flatten.
KILN_DECL GradcheckResult check_graph(graph::Graph g, std::vector<Tensor> bound, std::size_t n_args,
                                      const std::vector<double>& scalars, const GradcheckOptions& opt);
#if KILN_DEFINITIONS
KILN_DECL GradcheckResult check_graph(graph::Graph g, std::vector<Tensor> bound, std::size_t n_args,
                                      const std::vector<double>& scalars, const GradcheckOptions& opt) {
  // Every floating argument becomes an extra output (as the runtime's trace of a GradFn does), so
  // that one the value does not use still has a node and gets a zero gradient.
  std::vector<int> wrt;
  graph::CseIndex cse;
  cse.index_all(g);
  for (std::size_t i = 0; i < n_args; ++i) {
    if (!is_floating(bound[i].dtype())) continue;
    wrt.push_back(static_cast<int>(i));
    graph::Node a;
    a.op = Op::arg;
    a.slot = static_cast<int>(i);
    g.outputs.push_back(cse.add(g, a));
  }
  auto at = [&](int slot) -> const Tensor& { return bound[static_cast<std::size_t>(slot)]; };
  graph::infer_shapes(g, at);
  g = autodiff::expand_inner_gradients(std::move(g), at);  // a k::grad called inside fn
  const graph::Node& out = g[g.outputs[0]];
  const int cot_slot = static_cast<int>(bound.size());
  bound.push_back(random_cotangent(out.shape, opt.seed));
  graph::Graph d = rewrite::simplify(rewrite::decompose(g));
  graph::Node c;
  c.op = Op::arg;
  c.slot = cot_slot;
  d.nodes.push_back(c);
  d.num_args = cot_slot + 1;
  d.outputs.resize(1);
  graph::infer_shapes(d, at);
  graph::Graph joint = rewrite::simplify(autodiff::differentiate_at_run_time(d, wrt, autodiff::Mode::vjp, cot_slot));
  graph::infer_shapes(joint, at);
  const std::vector<reference::Value> grads = reference::eval_graph(joint, bound, scalars);

  const auto* cot = static_cast<const double*>(bound.back().data_ptr());
  auto f = [&] {
    reference::Value v = reference::eval_graph(g, bound, scalars).at(0);
    double s = 0;
    for (std::size_t k = 0; k < v.data.size(); ++k) s += v.data[k] * cot[k];
    return s;
  };
  GradcheckResult r;
  double worst = -1;
  for (std::size_t w = 0; w < wrt.size(); ++w) {
    Tensor& x = bound[static_cast<std::size_t>(wrt[w])];
    auto* p = static_cast<double*>(x.data_ptr());
    for (std::int64_t j = 0; j < x.numel(); ++j) {
      const double orig = p[j];
      p[j] = orig + opt.eps;
      const double fp = f();
      p[j] = orig - opt.eps;
      const double fm = f();
      p[j] = orig;
      const double numeric = (fp - fm) / (2 * opt.eps), analytic = grads[w].data.at(static_cast<std::size_t>(j));
      const double tol = opt.atol + opt.rtol * std::max(std::abs(analytic), std::abs(numeric));
      const double err = std::abs(analytic - numeric);
      const double score = std::isnan(err) ? std::numeric_limits<double>::infinity() : err / tol;
      ++r.checked;
      if (score > worst) {
        worst = score;
        r.arg = wrt[w];
        r.index = j;
        r.shape = x.shape();
        r.analytic = analytic;
        r.numeric = numeric;
        r.tolerance = tol;
      }
    }
  }
  r.ok = worst <= 1;
  return r;
}
#endif

template <class E>
GradcheckResult check_expr(const E& value, std::vector<Tensor> xs, const GradcheckOptions& opt) {
  static_assert(Expr<E>, "k::testing::gradcheck needs a function returning one expression (not a std::tuple)");
  const int n_args = static_cast<int>(xs.size());
  graph::Graph g = graph::flatten_result(n_args, value);  // captured tensors take the slots after xs
  graph::Captured cap;
  graph::gather(value, cap);
  for (int k = 0; k < cap.nt; ++k) xs.push_back(*cap.tensors[static_cast<std::size_t>(k)]);
  std::vector<double> scalars(cap.scalars.begin(), cap.scalars.begin() + cap.ns);
  return check_graph(std::move(g), std::move(xs), static_cast<std::size_t>(n_args), scalars, opt);
}

}  // namespace detail

// Checks fn's derived gradients with respect to every floating argument (converted to f64).
template <class F, class... T>
requires(std::is_same_v<T, Tensor>&&...) GradcheckResult
    gradcheck(const GradcheckOptions& opt, const F& fn, const T&... args) {
  std::vector<Tensor> xs{detail::f64_copy(args)...};
  return [&]<std::size_t... K>(std::index_sequence<K...>) {
    auto value = kiln::detail::trace(fn, expr::Arg<static_cast<int>(K)>{{}, &xs[K]}...);
    return detail::check_expr(value, xs, opt);
  }
  (std::index_sequence_for<T...>{});
}
template <class F, class... T>
requires(std::is_same_v<T, Tensor>&&...) GradcheckResult gradcheck(const F& fn, const T&... args) {
  return gradcheck(GradcheckOptions{}, fn, args...);
}

}  // namespace kiln::testing
