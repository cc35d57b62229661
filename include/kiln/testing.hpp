// Testing helpers (API.md, "Testing helpers"): k::testing::allclose with a report of the worst
// element, k::testing::gradcheck (testing/gradcheck.hpp), and k::reference::eval, the unfused f64
// oracle that tests compare kiln's fused kernels against.
#pragma once
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>

#include "core/tensor.hpp"
#include "reference/eval.hpp"

namespace kiln::testing {

// The outcome of allclose: converts to bool (true when every element is close) and prints a
// one-line report naming the worst element.
struct AllcloseResult {
  bool ok = false;
  std::string message;  // set when the comparison could not be made (e.g. shapes differ)
  Dims shape;           // the common shape
  double rtol = 0, atol = 0;
  std::int64_t count = 0;       // elements compared
  std::int64_t mismatches = 0;  // elements that are not close
  // The worst element: the largest error relative to its tolerance (a NaN or infinity mismatch
  // counts as infinitely bad). worst < 0 when there are no elements.
  std::int64_t worst = -1;
  Dims worst_index;
  double worst_a = 0, worst_b = 0, worst_error = 0, worst_allowed = 0;

  operator bool() const { return ok; }

  std::string str() const {
    std::ostringstream os;
    os << std::setprecision(10);
    if (!message.empty()) return "allclose: " + message;
    os << "allclose: " << (ok ? "ok" : "FAILED") << ", " << mismatches << " of " << count << " elements differ (shape "
       << shape << ", rtol=" << rtol << ", atol=" << atol << ")";
    if (worst >= 0)
      os << "; worst at " << worst_index << " (flat " << worst << "): a=" << worst_a << " b=" << worst_b
         << " |a-b|=" << worst_error << " allowed=" << worst_allowed;
    return os.str();
  }
  friend std::ostream& operator<<(std::ostream& os, const AllcloseResult& r) { return os << r.str(); }
};

// |a - b| <= atol + rtol * |b| elementwise (b is the reference), for tensors of any dtype and device.
// NaN matches NaN only at the same position; infinities match only themselves.
inline AllcloseResult allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8) {
  AllcloseResult r;
  r.rtol = rtol;
  r.atol = atol;
  if (!(a.shape() == b.shape())) {
    r.message = "shapes " + a.shape().str() + " and " + b.shape().str() + " differ";
    return r;
  }
  r.shape = a.shape();
  const std::vector<double> va = reference::read(a).data, vb = reference::read(b).data;
  r.count = static_cast<std::int64_t>(va.size());
  double worst_ratio = -1;
  for (std::size_t i = 0; i < va.size(); ++i) {
    const double x = va[i], y = vb[i];
    const double allowed = atol + rtol * std::abs(y);
    double err, ratio;
    bool close;
    if (std::isnan(x) || std::isnan(y)) {
      close = std::isnan(x) && std::isnan(y);
      err = close ? 0 : std::numeric_limits<double>::quiet_NaN();
      ratio = close ? 0 : std::numeric_limits<double>::infinity();
    } else if (std::isinf(x) || std::isinf(y)) {
      close = x == y;
      err = close ? 0 : std::numeric_limits<double>::infinity();
      ratio = close ? 0 : std::numeric_limits<double>::infinity();
    } else {
      err = std::abs(x - y);
      close = err <= allowed;
      ratio = allowed > 0 ? err / allowed : (err > 0 ? std::numeric_limits<double>::infinity() : 0);
    }
    if (!close) ++r.mismatches;
    // The largest error relative to its tolerance: a failing element always has a ratio > 1.
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      r.worst = static_cast<std::int64_t>(i);
      r.worst_a = x;
      r.worst_b = y;
      r.worst_error = err;
      r.worst_allowed = allowed;
    }
  }
  if (r.worst >= 0) {  // unravel the flat index
    r.worst_index.resize(r.shape.size());
    std::int64_t rem = r.worst;
    for (int d = r.shape.size() - 1; d >= 0; --d) {
      r.worst_index[d] = rem % r.shape[d];
      rem /= r.shape[d];
    }
  }
  r.ok = r.mismatches == 0;
  return r;
}

namespace detail {
template <class T>
Tensor evaluated(const T& x) {
  if constexpr (std::is_same_v<T, Tensor>)
    return x;
  else
    return reference::eval(x);
}
}  // namespace detail

// Either side may be an expression: it is evaluated by the f64 oracle, k::reference::eval.
template <class A, class B>
requires((Expr<A> || std::is_same_v<A, Tensor>)&&(Expr<B> || std::is_same_v<B, Tensor>)&&(Expr<A> ||
                                                                                          Expr<B>)) AllcloseResult
    allclose(const A& a, const B& b, double rtol = 1e-5, double atol = 1e-8) {
  return allclose(detail::evaluated(a), detail::evaluated(b), rtol, atol);
}

}  // namespace kiln::testing

// ---- gradcheck ---------------------------------------------------------------------------------
// k::testing::gradcheck(fn, args...) lives in testing/gradcheck.hpp, written with the autodiff.
#include "testing/gradcheck.hpp"
