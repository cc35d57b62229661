// The f64 oracle (reference/eval.hpp) and k::testing::allclose: every op against values computed
// here by hand-written loops over random inputs (odd sizes, broadcasting, size-1 and zero-size dims,
// non-contiguous views, 16-bit and integer inputs).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <kiln/core/driver.hpp>
#include <kiln/expr/ops.hpp>
#include <kiln/graph/flatten.hpp>
#include <kiln/graph/infer.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/reference/eval.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace {

namespace k = kiln;
using k::Dims;
using k::Tensor;
using Vec = std::vector<double>;

constexpr double NaN = std::numeric_limits<double>::quiet_NaN();
constexpr double Inf = std::numeric_limits<double>::infinity();

std::mt19937& gen() {
  static std::mt19937 g(20240611);
  return g;
}

// A contiguous CPU tensor holding the given values (rounded once to dt).
Tensor from(const Vec& v, const Dims& shape, k::dtype dt = k::f32) {
  REQUIRE(static_cast<std::int64_t>(v.size()) == shape.product());
  Tensor t = Tensor::empty(shape, dt, k::cpu);
  for (std::size_t i = 0; i < v.size(); ++i) k::store_from_double(t.data_ptr(), dt, static_cast<std::int64_t>(i), v[i]);
  return t;
}

// Random values in [lo, hi], never (close to) zero; integers for integral dtypes, both truth
// values for boolean.
Tensor rnd(const Dims& shape, k::dtype dt = k::f32, double lo = -2, double hi = 2) {
  Vec v(static_cast<std::size_t>(shape.product()));
  std::uniform_real_distribution<double> u(lo, hi);
  for (auto& x : v) {
    if (dt == k::boolean) {
      x = u(gen()) > (lo + hi) / 2;
      continue;
    }
    do {
      x = u(gen());
      if (k::is_integral(dt)) x = std::round(x);
    } while (std::abs(x) < 1e-2);
  }
  return from(v, shape, dt);
}

// Random class indices in [0, n).
Tensor rnd_index(const Dims& shape, std::int64_t n, k::dtype dt = k::i64) {
  Vec v(static_cast<std::size_t>(shape.product()));
  std::uniform_int_distribution<std::int64_t> u(0, n - 1);
  for (auto& x : v) x = static_cast<double>(u(gen()));
  return from(v, shape, dt);
}

// The values of a contiguous CPU tensor (read directly, not through the oracle).
Vec host(const Tensor& t) {
  REQUIRE(t.device() == k::cpu);
  REQUIRE(t.is_contiguous());
  Vec v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = k::load_as_double(t.data_ptr(), t.dtype(), static_cast<std::int64_t>(i));
  return v;
}

struct Result {
  Dims shape;
  k::dtype dt;  // the node's dtype (the oracle keeps the values in f64)
  Vec v;
};

// Evaluates through the public k::reference::eval, and the node dtype through eval_values.
template <class E>
Result ev(const E& e) {
  Tensor t = k::reference::eval(e);
  REQUIRE(t.device() == k::cpu);
  REQUIRE(t.dtype() == k::f64);
  REQUIRE(t.is_contiguous());
  auto vals = k::reference::eval_values(e);
  REQUIRE(vals.size() == 1);
  CHECK(vals[0].shape == t.shape());
  return {t.shape(), vals[0].dt, host(t)};
}

bool same(double got, double want, double tol) {
  if (std::isnan(got) || std::isnan(want)) return std::isnan(got) && std::isnan(want);
  if (got == want) return true;
  return std::abs(got - want) <= tol * (1 + std::abs(want));
}

void check_vec(const Vec& got, const Vec& want, double tol = 1e-12) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!same(got[i], want[i], tol)) {
      if (!bad) first = i;
      ++bad;
    }
  std::ostringstream msg;
  msg.precision(17);
  if (bad)
    msg << bad << " of " << got.size() << " differ; first at " << first << ": got " << got[first] << ", want "
        << want[first];
  CHECK_MESSAGE(bad == 0, msg.str());
}

void check_result(const Result& r, const Dims& shape, const Vec& want, double tol = 1e-12) {
  CHECK(r.shape == shape);
  check_vec(r.v, want, tol);
}

template <class F>
Vec map(const Vec& x, F f) {
  Vec o(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) o[i] = f(x[i]);
  return o;
}

}  // namespace

// The oracle has one rule per op of expr/op.hpp: a new op must be taught to reference/eval.hpp
// (and tested here) before this count is raised.
static_assert(k::op_table.size() == 85, "a new op: add its rule to reference/eval.hpp and a test here");

// grad_leaf and grad_of: a k::grad called with expressions, which the oracle expands first.
TEST_CASE("reference: a gradient taken inside an expression") {
  Tensor x = rnd({5, 7}), w = rnd({5, 7});
  auto g = k::grad([](auto x, auto w) { return k::sum(k::sin(x) * w); }, k::wrt<0>);
  const Vec got = host(k::reference::eval(g(k::expression(x), k::expression(w))));
  const Vec xv = host(x), wv = host(w);
  Vec want(xv.size());
  for (std::size_t i = 0; i < xv.size(); ++i) want[i] = std::cos(xv[i]) * wv[i];
  check_vec(got, want, 1e-12);
}

// ---- pointwise ---------------------------------------------------------------------------------

TEST_CASE("reference: every unary op on a 37x129 tensor") {
  Tensor x = rnd({37, 129});
  Tensor p = rnd({37, 129}, k::f32, 0.05, 3.0);  // positive, for log/sqrt/rsqrt
  const Vec xv = host(x), pv = host(p);
  const Dims s{37, 129};
  const double s2pi = std::sqrt(2.0 / std::numbers::pi);

  check_result(ev(-x), s, map(xv, [](double v) { return -v; }));
  check_result(ev(k::abs(x)), s, map(xv, [](double v) { return v < 0 ? -v : v; }));
  check_result(ev(k::sign(x)), s, map(xv, [](double v) { return v > 0 ? 1.0 : -1.0; }));
  check_result(ev(k::exp(x)), s, map(xv, [](double v) { return std::exp(v); }));
  check_result(ev(k::exp2(x)), s, map(xv, [](double v) { return std::pow(2.0, v); }));
  check_result(ev(k::log(p)), s, map(pv, [](double v) { return std::log(v); }));
  check_result(ev(k::log2(p)), s, map(pv, [](double v) { return std::log(v) / std::log(2.0); }));
  check_result(ev(k::log1p(p)), s, map(pv, [](double v) { return std::log(1 + v); }), 1e-10);
  check_result(ev(k::expm1(x)), s, map(xv, [](double v) { return std::exp(v) - 1; }), 1e-10);
  check_result(ev(k::sqrt(p)), s, map(pv, [](double v) { return std::pow(v, 0.5); }));
  check_result(ev(k::rsqrt(p)), s, map(pv, [](double v) { return std::pow(v, -0.5); }));
  check_result(ev(k::reciprocal(x)), s, map(xv, [](double v) { return 1 / v; }));
  check_result(ev(k::square(x)), s, map(xv, [](double v) { return v * v; }));
  check_result(ev(k::sin(x)), s, map(xv, [](double v) { return std::sin(v); }));
  check_result(ev(k::cos(x)), s, map(xv, [](double v) { return std::cos(v); }));
  check_result(ev(k::tanh(x)), s, map(xv, [](double v) { return (std::exp(2 * v) - 1) / (std::exp(2 * v) + 1); }));
  // sigmoid and silu through the tanh identity, gelu through erfc: independent formulas.
  check_result(ev(k::sigmoid(x)), s, map(xv, [](double v) { return 0.5 * (1 + std::tanh(v / 2)); }));
  check_result(ev(k::silu(x)), s, map(xv, [](double v) { return v * 0.5 * (1 + std::tanh(v / 2)); }));
  check_result(ev(k::erf(x)), s, map(xv, [](double v) { return 1 - std::erfc(v); }));
  check_result(ev(k::relu(x)), s, map(xv, [](double v) { return v > 0 ? v : 0.0; }));
  check_result(ev(k::gelu(x)), s, map(xv, [](double v) { return 0.5 * v * std::erfc(-v / std::sqrt(2.0)); }));
  auto gelu_t = [&](double v) { return 0.5 * v * (1 + std::tanh(s2pi * (v + 0.044715 * v * v * v))); };
  check_result(ev(k::gelu(x, k::approximate::tanh)), s, map(xv, gelu_t));
  check_result(ev(k::expr::make<k::Op::gelu_tanh>({}, x)), s, map(xv, gelu_t));
  Result ln = ev(k::logical_not(x > 0.5));
  CHECK(ln.dt == k::boolean);
  check_result(ln, s, map(xv, [](double v) { return v > 0.5 ? 0.0 : 1.0; }));
}

TEST_CASE("reference: unary ops at special values") {
  Tensor x = from({0.0, -0.0, NaN, Inf, -Inf, -3.0}, {6}, k::f64);
  check_vec(ev(k::relu(x)).v, {0, 0, NaN, Inf, 0, 0});
  check_vec(ev(k::sign(x)).v, {0, 0, NaN, 1, -1, -1});
  check_vec(ev(k::sigmoid(x)).v, {0.5, 0.5, NaN, 1, 0, 1 / (1 + std::exp(3.0))});
  check_vec(ev(k::logical_not(x)).v, {1, 1, 0, 0, 0, 0});
  Tensor big = from({-1000, -745.5, 710, 1000}, {4}, k::f64);  // no overflow to NaN in sigmoid/silu
  check_vec(ev(k::sigmoid(big)).v, {0, 1 / (1 + std::exp(745.5)), 1, 1});
  check_vec(ev(k::silu(big)).v, {-0.0, -745.5 / (1 + std::exp(745.5)), 710, 1000});
}

TEST_CASE("reference: binary ops with broadcasting") {
  // [5,1,3] with [4,3] -> [5,4,3]: rank mismatch plus a size-1 dim.
  Tensor a = rnd({5, 1, 3}), b = rnd({4, 3});
  const Vec av = host(a), bv = host(b);
  auto bcast = [&](auto f) {
    Vec o;
    for (int i = 0; i < 5; ++i)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 3; ++l) o.push_back(f(av[i * 3 + l], bv[j * 3 + l]));
    return o;
  };
  const Dims s{5, 4, 3};
  check_result(ev(a + b), s, bcast([](double x, double y) { return x + y; }));
  check_result(ev(a - b), s, bcast([](double x, double y) { return x - y; }));
  check_result(ev(b - a), s, bcast([](double x, double y) { return y - x; }));
  check_result(ev(a * b), s, bcast([](double x, double y) { return x * y; }));
  check_result(ev(a / b), s, bcast([](double x, double y) { return x / y; }));
  check_result(ev(k::maximum(a, b)), s, bcast([](double x, double y) { return x > y ? x : y; }));
  check_result(ev(k::minimum(a, b)), s, bcast([](double x, double y) { return x < y ? x : y; }));
  for (auto [r, f] : {std::pair{ev(a < b), +[](double x, double y) { return double(x < y); }},
                      std::pair{ev(a <= b), +[](double x, double y) { return double(x <= y); }},
                      std::pair{ev(a > b), +[](double x, double y) { return double(x > y); }},
                      std::pair{ev(a >= b), +[](double x, double y) { return double(x >= y); }}}) {
    CHECK(r.dt == k::boolean);
    check_result(r, s, bcast(f));
  }
  // == and != on values with exact repeats.
  Tensor ai = rnd({5, 1, 3}, k::i32, -2, 2), bi = rnd({4, 3}, k::i32, -2, 2);
  const Vec aiv = host(ai), biv = host(bi);
  Vec eq, ne;
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 3; ++l) {
        eq.push_back(aiv[i * 3 + l] == biv[j * 3 + l]);
        ne.push_back(aiv[i * 3 + l] != biv[j * 3 + l]);
      }
  check_result(ev(ai == bi), s, eq);
  check_result(ev(ai != bi), s, ne);

  // [37,129] with [129] and [37,1] with [1,129]; a 0-d tensor with a matrix.
  Tensor x = rnd({37, 129}), row = rnd({129}), col = rnd({37, 1}), lin = rnd({1, 129}), s0 = rnd({});
  const Vec xv = host(x), rv = host(row), cv = host(col), lv = host(lin), sv = host(s0);
  Vec w1, w2, w3;
  for (int i = 0; i < 37; ++i)
    for (int j = 0; j < 129; ++j) {
      w1.push_back(xv[i * 129 + j] * rv[j]);
      w2.push_back(cv[i] - lv[j]);
      w3.push_back(sv[0] / xv[i * 129 + j]);
    }
  check_result(ev(x * row), {37, 129}, w1);
  check_result(ev(col - lin), {37, 129}, w2);
  check_result(ev(s0 / x), {37, 129}, w3);

  // Zero-size: [0,3] + [3] is [0,3]; [2,0] + [2,1] is [2,0].
  Result z = ev(rnd({0, 3}) + rnd({3}));
  CHECK(z.shape == Dims{0, 3});
  CHECK(z.v.empty());
  CHECK(ev(rnd({2, 0}) * rnd({2, 1})).shape == Dims{2, 0});
}

TEST_CASE("reference: C++ scalars, pow, where, clamp") {
  Tensor x = rnd({7, 11}), y = rnd({11});
  const Vec xv = host(x), yv = host(y);
  check_result(ev(x * 2.5), {7, 11}, map(xv, [](double v) { return v * 2.5; }));
  check_result(ev(2.5f - x), {7, 11}, map(xv, [](double v) { return 2.5 - v; }));
  check_result(ev(3 / x), {7, 11}, map(xv, [](double v) { return 3 / v; }));
  check_result(ev(x * 2.0 + 1.0), {7, 11}, map(xv, [](double v) { return v * 2 + 1; }));
  check_result(ev((x - 0.25) * (x + 0.25)), {7, 11}, map(xv, [](double v) { return (v - 0.25) * (v + 0.25); }));

  Tensor p = rnd({7, 11}, k::f32, 0.1, 3);
  const Vec pv = host(p);
  check_result(ev(k::pow(p, 2.5)), {7, 11}, map(pv, [](double v) { return std::exp(2.5 * std::log(v)); }));
  check_result(ev(k::pow(x, 3)), {7, 11}, map(xv, [](double v) { return v * v * v; }));
  check_result(ev(k::pow(x, -2)), {7, 11}, map(xv, [](double v) { return 1 / (v * v); }));

  // where(cond, a, b) broadcasting all three: cond [7,11], a [11], b a scalar.
  Vec wv;
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 11; ++j) wv.push_back(xv[i * 11 + j] > 0 ? yv[j] : -1.5);
  check_result(ev(k::where(x > 0, y, -1.5)), {7, 11}, wv);
  Tensor c = rnd({7, 1}, k::boolean);
  const Vec cvv = host(c);
  Vec wv2;
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 11; ++j) wv2.push_back(cvv[i] != 0 ? xv[i * 11 + j] : yv[j]);
  check_result(ev(k::where(c, x, y)), {7, 11}, wv2);

  // clamp with scalar bounds and with tensor bounds (broadcast).
  check_result(ev(k::clamp(x, -0.5, 0.75)), {7, 11}, map(xv, [](double v) {
                 return v < -0.5 ? -0.5 : v > 0.75 ? 0.75 : v;
               }));
  Tensor lo = rnd({11}, k::f32, -1, 0), hi = rnd({7, 1}, k::f32, 0.1, 1);
  const Vec lov = host(lo), hiv = host(hi);
  Vec cl;
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 11; ++j) cl.push_back(std::min(std::max(xv[i * 11 + j], lov[j]), hiv[i]));
  check_result(ev(k::clamp(x, lo, hi)), {7, 11}, cl);
  // PyTorch: when lo > hi the result is hi; NaN propagates.
  Tensor sp = from({NaN, -3, 0.5, 3}, {4}, k::f64);
  check_vec(ev(k::clamp(sp, -1.0, 1.0)).v, {NaN, -1, 0.5, 1});
  check_vec(ev(k::clamp(sp, 2.0, 1.0)).v, {NaN, 1, 1, 1});
}

TEST_CASE("reference: maximum/minimum propagate NaN like PyTorch") {
  Tensor a = from({NaN, 1, NaN, -2, Inf}, {5}, k::f64), b = from({3, NaN, NaN, -1, 2}, {5}, k::f64);
  check_vec(ev(k::maximum(a, b)).v, {NaN, NaN, NaN, -1, Inf});
  check_vec(ev(k::minimum(a, b)).v, {NaN, NaN, NaN, -2, 2});
  check_vec(ev(k::amax(a)).v, {NaN});
  check_vec(ev(k::amin(b, 0)).v, {NaN});
  // Comparisons with NaN are false, except !=.
  check_vec(ev(a < b).v, {0, 0, 0, 1, 0});
  check_vec(ev(a != b).v, {1, 1, 1, 1, 1});
}

TEST_CASE("reference: casts round through the target dtype") {
  Tensor x = from({2.7, -2.7, 0.5, -0.5, 0.0, 1e10 + 0.5, -7.99}, {7}, k::f64);
  Result ri = ev(k::cast(x, k::i64));
  CHECK(ri.dt == k::i64);
  check_vec(ri.v, {2, -2, 0, 0, 0, 1e10, -7});
  check_vec(ev(k::cast(from({2.7, -2.7, 0.5, -0.5, 0.0, -7.99}, {6}, k::f64), k::i32)).v, {2, -2, 0, 0, 0, -7});
  Result rb = ev(k::cast(x, k::boolean));
  CHECK(rb.dt == k::boolean);
  check_vec(rb.v, {1, 1, 1, 1, 0, 1, 1});

  // f16: ties to even, overflow to inf, underflow to zero, subnormals.
  const double e11 = std::ldexp(1.0, -11), e8 = std::ldexp(1.0, -8);
  Tensor h =
      from({1 + e11, 1 + 3 * e11, 65504, 65520, 70000, std::ldexp(1.0, -24), std::ldexp(1.0, -26), -0.1}, {8}, k::f64);
  Result rh = ev(k::cast(h, k::f16));
  CHECK(rh.dt == k::f16);
  check_vec(rh.v, {1, 1 + 4 * e11, 65504, Inf, Inf, std::ldexp(1.0, -24), 0, -0.0999755859375}, 0);
  // bf16: 8 bits of mantissa.
  Tensor bb = from({1 + e8, 1 + 3 * e8, 3.0e38, 1.0 / 3}, {4}, k::f64);
  check_vec(ev(k::cast(bb, k::bf16)).v, {1, 1 + 4 * e8, std::ldexp(226.0, 120), 0.333984375}, 0);
  // f32: rounds once to float; random values compared with float's own rounding.
  Tensor r = rnd({41}, k::f64);
  const Vec rv = host(r);
  check_vec(ev(k::cast(r, k::f32)).v, map(rv, [](double v) { return double(float(v)); }), 0);
  check_vec(ev(k::cast(r, k::f16)).v, map(rv, [](double v) { return double(float(k::half(float(v)))); }), 0);
  check_vec(ev(k::cast(r, k::bf16)).v, map(rv, [](double v) { return double(float(k::bfloat16(float(v)))); }), 0);
  // A cast back to f64 of an f16 cast keeps the rounded value; arithmetic after it is in f64.
  check_vec(ev(k::cast(k::cast(h, k::f16), k::f64) * 3.0).v,
            {3, 3 * (1 + 4 * e11), 3 * 65504.0, Inf, Inf, 3 * std::ldexp(1.0, -24), 0, 3 * -0.0999755859375}, 0);
}

TEST_CASE("reference: integer and boolean arithmetic is exact") {
  Tensor a = rnd({6, 9}, k::i32, -50, 50), b = rnd({9}, k::i32, -50, 50);
  const Vec av = host(a), bv = host(b);
  auto each = [&](auto f) {
    Vec o;
    for (int i = 0; i < 6; ++i)
      for (int j = 0; j < 9; ++j) o.push_back(f(av[i * 9 + j], bv[j]));
    return o;
  };
  Result s = ev(a + b);
  CHECK(s.dt == k::i32);
  check_result(s, {6, 9}, each([](double x, double y) { return x + y; }), 0);
  check_result(ev(a * b - 3), {6, 9}, each([](double x, double y) { return x * y - 3; }), 0);
  Result d = ev(a / b);  // true division
  CHECK(d.dt == k::f32);
  check_result(d, {6, 9}, each([](double x, double y) { return x / y; }));
  Result f = ev(a * 2.5);
  CHECK(f.dt == k::f32);
  check_result(f, {6, 9}, map(av, [](double v) { return v * 2.5; }));
  Tensor t = rnd({5}, k::boolean);
  const Vec tv = host(t);
  Result bp = ev(t + 1);
  CHECK(bp.dt == k::i64);
  check_vec(bp.v, map(tv, [](double v) { return v + 1; }), 0);
  // 32-bit overflow wraps around like integer arithmetic; an i64 sum does not overflow.
  Tensor big = from({2e9, -2e9, 1.5e9}, {3}, k::i32);
  check_vec(ev(big + big).v, {4e9 - 4294967296.0, -4e9 + 4294967296.0, 3e9 - 4294967296.0}, 0);
  CHECK(ev(big + 0).dt == k::i32);  // an int scalar keeps i32 ...
  Result sum64 = ev(k::sum(big + big + big));
  CHECK(sum64.dt == k::i64);  // ... and the sum of i32 is i64, of the wrapped values
  check_vec(sum64.v, {(6e9 - 4294967296.0) + (-6e9 + 4294967296.0) + (4.5e9 - 4294967296.0)}, 0);
  check_vec(ev(k::sum(big)).v, {1.5e9}, 0);
  check_vec(ev(k::sum(k::cast(big, k::i64) * 2)).v, {3e9}, 0);
  Tensor i64 = from({3e12, -7, 11}, {3}, k::i64);
  check_vec(ev(i64 * 3).v, {9e12, -21, 33}, 0);
  // f16 * 2.0 is an f16 node whose values the oracle keeps in f64 (no per-node f16 rounding).
  Tensor hh = rnd({13}, k::f16);
  Result hr = ev(hh * 2.0);
  CHECK(hr.dt == k::f16);
  check_vec(hr.v, map(host(hh), [](double v) { return v * 2; }), 0);
  Result h3 = ev(hh / 3.0);
  check_vec(h3.v, map(host(hh), [](double v) { return v / 3; }), 0);
}

// ---- reductions ----------------------------------------------------------------------------------

namespace {
// Reduces a [A,B,C] buffer over the dims marked in r, row-major in the kept dims.
template <class F>
Vec reduce3(const Vec& x, int A, int B, int C, std::array<bool, 3> r, double init, F f) {
  const int oa = r[0] ? 1 : A, ob = r[1] ? 1 : B, oc = r[2] ? 1 : C;
  Vec o(static_cast<std::size_t>(oa * ob * oc), init);
  for (int i = 0; i < A; ++i)
    for (int j = 0; j < B; ++j)
      for (int l = 0; l < C; ++l) {
        int oi = ((r[0] ? 0 : i) * ob + (r[1] ? 0 : j)) * oc + (r[2] ? 0 : l);
        o[oi] = f(o[oi], x[(i * B + j) * C + l]);
      }
  return o;
}
double add(double a, double b) { return a + b; }
}  // namespace

TEST_CASE("reference: sum / amax / amin over dims, all, keepdim") {
  const int A = 5, B = 7, C = 9;
  Tensor x = rnd({A, B, C});
  const Vec xv = host(x);
  auto mx = [](double a, double b) { return a > b ? a : b; };
  auto mn = [](double a, double b) { return a < b ? a : b; };
  check_result(ev(k::sum(x, 1)), {A, C}, reduce3(xv, A, B, C, {false, true, false}, 0, add));
  check_result(ev(k::sum(x, -1, true)), {A, B, 1}, reduce3(xv, A, B, C, {false, false, true}, 0, add));
  check_result(ev(k::sum(x, {0, 2})), {B}, reduce3(xv, A, B, C, {true, false, true}, 0, add));
  check_result(ev(k::sum(x, {2, 0}, true)), {1, B, 1}, reduce3(xv, A, B, C, {true, false, true}, 0, add));
  check_result(ev(k::sum(x)), {}, reduce3(xv, A, B, C, {true, true, true}, 0, add));
  check_result(ev(k::sum(x, {}, true)), {1, 1, 1}, reduce3(xv, A, B, C, {true, true, true}, 0, add));
  check_result(ev(k::amax(x, 0)), {B, C}, reduce3(xv, A, B, C, {true, false, false}, -Inf, mx), 0);
  check_result(ev(k::amax(x, {-2, -1}, true)), {A, 1, 1}, reduce3(xv, A, B, C, {false, true, true}, -Inf, mx), 0);
  check_result(ev(k::amin(x, 2)), {A, B}, reduce3(xv, A, B, C, {false, false, true}, Inf, mn), 0);
  check_result(ev(k::amin(x)), {}, reduce3(xv, A, B, C, {true, true, true}, Inf, mn), 0);

  // Odd 2-D size: a row sum of 37x129.
  Tensor y = rnd({37, 129});
  const Vec yv = host(y);
  check_result(ev(k::sum(y, 1)), {37}, reduce3(yv, 37, 129, 1, {false, true, false}, 0, add));
  // Integer sums are i64 and exact; amax keeps the dtype.
  Tensor yi = rnd({37, 129}, k::i32, -1000, 1000);
  const Vec yiv = host(yi);
  Result si = ev(k::sum(yi, 0));
  CHECK(si.dt == k::i64);
  check_result(si, {129}, reduce3(yiv, 1, 37, 129, {false, true, false}, 0, add), 0);
  Result mi = ev(k::amax(yi, 1));
  CHECK(mi.dt == k::i32);
  check_result(mi, {37}, reduce3(yiv, 37, 129, 1, {false, true, false}, -Inf, mx), 0);
  // Sum of booleans counts them.
  Tensor bl = rnd({4, 6}, k::boolean);
  check_result(ev(k::sum(bl, 1)), {4}, reduce3(host(bl), 4, 6, 1, {false, true, false}, 0, add), 0);

  // Zero-size: a sum over an empty dim is 0; over a non-reduced empty dim the result is empty.
  Tensor z = rnd({0, 5});
  check_result(ev(k::sum(z, 0)), {5}, Vec(5, 0.0), 0);
  check_result(ev(k::sum(z)), {}, {0}, 0);
  CHECK(ev(k::amax(z, 1)).shape == Dims{0});
  check_result(ev(k::mean(z)), {}, {NaN});
  // Size-1 dims reduce to the value itself.
  Tensor one = rnd({3, 1, 4});
  check_result(ev(k::amax(one, 1)), {3, 4}, host(one), 0);
}

TEST_CASE("reference: mean, var (correction), logsumexp") {
  const int A = 4, B = 13, C = 6;
  Tensor x = rnd({A, B, C});
  const Vec xv = host(x);
  for (auto r : {std::array<bool, 3>{false, true, false}, std::array<bool, 3>{true, false, true},
                 std::array<bool, 3>{true, true, true}}) {
    Vec s = reduce3(xv, A, B, C, r, 0, add);
    const double n = (r[0] ? A : 1) * (r[1] ? B : 1) * (r[2] ? C : 1);
    Vec mean = map(s, [&](double v) { return v / n; });
    // Sum of squared deviations, by hand.
    const int ob = r[1] ? 1 : B, oc = r[2] ? 1 : C;
    Vec ss(mean.size(), 0.0);
    for (int i = 0; i < A; ++i)
      for (int j = 0; j < B; ++j)
        for (int l = 0; l < C; ++l) {
          int oi = ((r[0] ? 0 : i) * ob + (r[1] ? 0 : j)) * oc + (r[2] ? 0 : l);
          double d = xv[(i * B + j) * C + l] - mean[oi];
          ss[oi] += d * d;
        }
    k::DimList dl;
    Dims kept;
    if (!(r[0] && r[1] && r[2])) {
      Dims ds;
      for (int d = 0; d < 3; ++d)
        if (r[d]) ds.push_back(d);
      dl = k::DimList(ds.vec());
    }
    for (int d = 0; d < 3; ++d)
      if (!r[d]) kept.push_back(d == 0 ? A : d == 1 ? B : C);
    CAPTURE(r[0]);
    CAPTURE(r[1]);
    CAPTURE(r[2]);
    check_result(ev(k::mean(x, dl)), kept, mean);
    check_result(ev(k::var(x, dl)), kept, map(ss, [&](double v) { return v / (n - 1); }));
    check_result(ev(k::var(x, dl, 0.0)), kept, map(ss, [&](double v) { return v / n; }));
    check_result(ev(k::var(x, dl, 2.0)), kept, map(ss, [&](double v) { return v / (n - 2); }));
  }
  CHECK(ev(k::var(x, 1, 1.0, true)).shape == Dims{A, 1, C});
  Result mi = ev(k::mean(rnd({3, 5}, k::i32, -9, 9), 1));
  CHECK(mi.dt == k::f32);

  // logsumexp = log(sum(exp(x))) for moderate values ...
  Vec lse = map(reduce3(xv, A, B, C, {false, true, false}, 0, [](double a, double b) { return a + std::exp(b); }),
                [](double v) { return std::log(v); });
  check_result(ev(k::logsumexp(x, 1)), {A, C}, lse);
  check_result(ev(k::logsumexp(x, -2, true)), {A, 1, C}, lse);
  // ... and is max-shifted: huge values stay finite.
  Tensor big = from({1000, 999, 998, -1000, -1001, -Inf, -Inf, -Inf, -Inf}, {3, 3}, k::f64);
  const double l3 = std::log(1 + std::exp(-1.0) + std::exp(-2.0));
  check_vec(ev(k::logsumexp(big, 1)).v, {1000 + l3, -1000 + std::log(1 + std::exp(-1.0)), -Inf});
}

TEST_CASE("reference: softmax and log_softmax over any dim") {
  const int A = 3, B = 17, C = 5;
  Tensor x = rnd({A, B, C}, k::f32, -4, 4);
  const Vec xv = host(x);
  for (int dim : {0, 1, 2, -1}) {
    CAPTURE(dim);
    const int d = dim < 0 ? dim + 3 : dim;
    std::array<bool, 3> r{d == 0, d == 1, d == 2};
    Vec den = reduce3(xv, A, B, C, r, 0, [](double a, double b) { return a + std::exp(b); });
    const int ob = r[1] ? 1 : B, oc = r[2] ? 1 : C;
    Vec sm, lsm;
    for (int i = 0; i < A; ++i)
      for (int j = 0; j < B; ++j)
        for (int l = 0; l < C; ++l) {
          double v = xv[(i * B + j) * C + l];
          double dn = den[((r[0] ? 0 : i) * ob + (r[1] ? 0 : j)) * oc + (r[2] ? 0 : l)];
          sm.push_back(std::exp(v) / dn);
          lsm.push_back(v - std::log(dn));
        }
    check_result(ev(k::softmax(x, dim)), {A, B, C}, sm);
    check_result(ev(k::log_softmax(x, dim)), {A, B, C}, lsm);
  }
  // Large logits: shifted by the max; -inf entries give 0 probability; an all -inf row is NaN (PyTorch).
  Tensor big = from({1000, 1001, -Inf, -Inf, -Inf, -Inf}, {3, 2}, k::f64);
  const double p = 1 / (1 + std::exp(1.0));
  check_vec(ev(k::softmax(big, 1)).v, {p, 1 - p, NaN, NaN, NaN, NaN});
  Tensor mixed = from({2, -Inf, 1}, {1, 3}, k::f64);
  check_vec(ev(k::softmax(mixed, -1)).v, {1 / (1 + std::exp(-1.0)), 0, std::exp(-1.0) / (1 + std::exp(-1.0))});
  check_vec(ev(k::log_softmax(big, 1)).v,
            {-std::log(1 + std::exp(1.0)), -std::log(1 + std::exp(-1.0)), NaN, NaN, NaN, NaN});
  // -inf among finite values: -inf (probability 0); a row holding +inf is NaN throughout in both, as
  // PyTorch computes x - max - log(sum(exp(x - max))) with max = +inf.
  check_vec(ev(k::log_softmax(mixed, -1)).v, {-std::log(1 + std::exp(-1.0)), -Inf, -1 - std::log(1 + std::exp(-1.0))});
  Tensor with_inf = from({Inf, -Inf, 1, 2, 3, 4}, {2, 3}, k::f64);
  check_vec(ev(k::log_softmax(with_inf, 1)).v,
            {NaN, NaN, NaN, 2 - std::log(std::exp(2.0) + std::exp(3.0) + std::exp(4.0)),
             3 - std::log(std::exp(2.0) + std::exp(3.0) + std::exp(4.0)),
             4 - std::log(std::exp(2.0) + std::exp(3.0) + std::exp(4.0))});
  check_vec(ev(k::softmax(with_inf, 1)).v,
            {NaN, NaN, NaN, std::exp(2.0) / (std::exp(2.0) + std::exp(3.0) + std::exp(4.0)),
             std::exp(3.0) / (std::exp(2.0) + std::exp(3.0) + std::exp(4.0)),
             std::exp(4.0) / (std::exp(2.0) + std::exp(3.0) + std::exp(4.0))});
}

// ---- views -----------------------------------------------------------------------------------------

TEST_CASE("reference: reshape, permute, transpose, expand, unsqueeze, squeeze") {
  Tensor x = rnd({2, 3, 4});
  const Vec xv = host(x);
  auto X = [&](int i, int j, int l) { return xv[(i * 3 + j) * 4 + l]; };
  check_result(ev(k::reshape(x, {6, 4})), {6, 4}, xv, 0);
  check_result(ev(k::reshape(x, {4, -1})), {4, 6}, xv, 0);
  check_result(ev(k::reshape(x, {24})), {24}, xv, 0);
  Vec pv;  // permute {2,0,1}: out[a,b,c] = x[b,c,a], shape [4,2,3]
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 2; ++b)
      for (int c = 0; c < 3; ++c) pv.push_back(X(b, c, a));
  check_result(ev(k::permute(x, {2, 0, 1})), {4, 2, 3}, pv, 0);
  check_result(ev(k::permute(x, {-1, 0, -2})), {4, 2, 3}, pv, 0);
  Vec tv;  // transpose(0, 2): out[a,b,c] = x[c,b,a]
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 2; ++c) tv.push_back(X(c, b, a));
  check_result(ev(k::transpose(x, 0, -1)), {4, 3, 2}, tv, 0);
  check_result(ev(k::transpose(k::transpose(x, 0, 2), 2, 0)), {2, 3, 4}, xv, 0);

  Tensor c = rnd({3, 1});
  const Vec cv = host(c);
  Vec e;  // expand [3,1] -> [2,3,4]: out[a,b,l] = c[b]
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int l = 0; l < 4; ++l) e.push_back(cv[b]);
  check_result(ev(k::expand(c, {2, 3, 4})), {2, 3, 4}, e, 0);
  check_result(ev(k::expand(c, {2, -1, 4})), {2, 3, 4}, e, 0);
  check_result(ev(k::expand(c, {3, 0})), {3, 0}, {}, 0);

  check_result(ev(k::unsqueeze(x, 1)), {2, 1, 3, 4}, xv, 0);
  check_result(ev(k::unsqueeze(x, -1)), {2, 3, 4, 1}, xv, 0);
  Tensor s = rnd({1, 5, 1, 3, 1});
  const Vec sv = host(s);
  check_result(ev(k::squeeze(s)), {5, 3}, sv, 0);
  check_result(ev(k::squeeze(s, 2)), {1, 5, 3, 1}, sv, 0);
  check_result(ev(k::squeeze(s, -1)), {1, 5, 1, 3}, sv, 0);
  check_result(ev(k::squeeze(s, 1)), {1, 5, 1, 3, 1}, sv, 0);  // not size 1: unchanged
  // A view feeding arithmetic: (x^T) * row, broadcasting over the permuted shape.
  Tensor row = rnd({2});
  const Vec rv = host(row);
  Vec tr;
  for (int a = 0; a < 4; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c2 = 0; c2 < 2; ++c2) tr.push_back(X(c2, b, a) * rv[c2]);
  check_result(ev(k::transpose(x, 0, 2) * row), {4, 3, 2}, tr);
}

TEST_CASE("reference: slice with steps and negative / clamped bounds") {
  Tensor x = rnd({37, 129});
  const Vec xv = host(x);
  auto sl = [&](int r0, int r1, int c0, int c1, int cs) {  // rows r0:r1, cols c0:c1:cs
    Vec o;
    for (int i = r0; i < r1; ++i)
      for (int j = c0; j < c1; j += cs) o.push_back(xv[i * 129 + j]);
    return o;
  };
  check_result(ev(k::slice(x, 1, 1, 120, 3)), {37, 40}, sl(0, 37, 1, 120, 3), 0);
  check_result(ev(k::slice(x, -1, -10, 1000)), {37, 10}, sl(0, 37, 119, 129, 1), 0);
  check_result(ev(k::slice(x, 0, -1000, 5)), {5, 129}, sl(0, 5, 0, 129, 1), 0);
  auto rows = [&](int r0, int r1, int rs) {  // rows r0:r1:rs, all columns
    Vec o;
    for (int i = r0; i < r1; i += rs)
      for (int j = 0; j < 129; ++j) o.push_back(xv[i * 129 + j]);
    return o;
  };
  check_result(ev(k::slice(x, 0, 30, -2, 2)), {3, 129}, rows(30, 35, 2), 0);
  check_result(ev(k::slice(x, 0, 1, 37, 5)), {8, 129}, rows(1, 37, 5), 0);
  check_result(ev(k::slice(x, 0, 36, 100, 7)), {1, 129}, rows(36, 37, 1), 0);
  // Empty slices: start after stop, start past the end.
  CHECK(ev(k::slice(x, 1, 50, 10)).shape == Dims{37, 0});
  CHECK(ev(k::slice(x, 0, 40, 50)).shape == Dims{0, 129});
  // Slices of views: columns 2:9:2 of the transpose are rows 2,4,6,8 transposed.
  Vec tv;
  for (int j = 0; j < 129; ++j)
    for (int i = 2; i < 9; i += 2) tv.push_back(xv[i * 129 + j]);
  check_result(ev(k::slice(k::transpose(x, 0, 1), 1, 2, 9, 2)), {129, 4}, tv, 0);
}

TEST_CASE("reference: slice_backward scatters into zeros") {
  Tensor g = rnd({37, 40});
  const Vec gv = host(g);
  k::Attrs at;
  at.dims = {37, 129};
  at.a = 1;
  at.b = 1;
  at.c = 120;
  at.d = 3;
  Vec want(37 * 129, 0.0);
  for (int i = 0; i < 37; ++i)
    for (int j = 0; j < 40; ++j) want[i * 129 + 1 + 3 * j] = gv[i * 40 + j];
  check_result(ev(k::expr::make<k::Op::slice_backward>(at, g)), {37, 129}, want, 0);
  // Negative dim and bounds, as slice normalises them: rows -5: of a [9, 3].
  Tensor g2 = rnd({5, 3});
  const Vec g2v = host(g2);
  k::Attrs at2;
  at2.dims = {9, 3};
  at2.a = -2;
  at2.b = -5;
  at2.c = 100;
  at2.d = 1;
  Vec want2(27, 0.0);
  for (int i = 0; i < 15; ++i) want2[12 + i] = g2v[i];
  check_result(ev(k::expr::make<k::Op::slice_backward>(at2, g2)), {9, 3}, want2, 0);
  // It inverts slice: slice(slice_backward(g)) == g.
  check_result(ev(k::slice(k::expr::make<k::Op::slice_backward>(at, g), 1, 1, 120, 3)), {37, 40}, gv, 0);
  // A gradient whose shape is not that of the slice is an error.
  CHECK_THROWS_AS(ev(k::expr::make<k::Op::slice_backward>(at, rnd({37, 41}))), k::shape_error);
}

// Views sized from a second input, a shape_of node (graph/infer.hpp's sized_view_shape): the
// pipeline's own, so that nothing in them names a size (a cat's padded parts, a slice's gradient).
TEST_CASE("reference: views sized from a shape_of node") {
  using k::expr::make;
  Tensor a = rnd({3, 4}), b = rnd({3, 5}), x = rnd({3, 9}), r = rnd({3, 1});
  const Vec av = host(a), bv = host(b), xv = host(x), rv = host(r);
  k::Attrs along;
  along.a = 1;
  auto joined = make<k::Op::shape_of>(along, a, b);  // [3, 9]: a and b joined along dim 1
  k::Attrs front;
  front.a = 1;
  front.d = 1;
  k::Attrs back = front;
  back.keepdim = true;
  Vec want_a(27, 0.0), want_b(27, 0.0), first, last, spread;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 4; ++j) want_a[i * 9 + j] = av[i * 4 + j];
    for (int j = 0; j < 5; ++j) want_b[i * 9 + 4 + j] = bv[i * 5 + j];
    for (int j = 0; j < 5; ++j) first.push_back(xv[i * 9 + j]), last.push_back(xv[i * 9 + 4 + j]);
    for (int j = 0; j < 9; ++j) spread.push_back(rv[i]);
  }
  // slice_backward(x, s): x placed into zeros of s's shape, at the start or against the end.
  check_result(ev(make<k::Op::slice_backward>(front, a, joined)), {3, 9}, want_a, 0);
  check_result(ev(make<k::Op::slice_backward>(back, b, joined)), {3, 9}, want_b, 0);
  // slice(x, s): the part of x of s's size, from the start or the last ones.
  auto five = make<k::Op::shape_of>(k::Attrs{}, b);
  check_result(ev(make<k::Op::slice>(front, x, five)), {3, 5}, first, 0);
  check_result(ev(make<k::Op::slice>(back, x, five)), {3, 5}, last, 0);
  // expand(x, s): x broadcast to s's shape.
  check_result(ev(make<k::Op::expand>(k::Attrs{}, r, make<k::Op::shape_of>(k::Attrs{}, x))), {3, 9}, spread, 0);
  // Sizes that do not fit are shape errors naming both shapes.
  CHECK_THROWS_WITH_AS(ev(make<k::Op::slice>(front, b, make<k::Op::shape_of>(k::Attrs{}, x))),
                       doctest::Contains("cannot view shape [3, 5] as sized by [3, 9]"), k::shape_error);
  CHECK_THROWS_AS(ev(make<k::Op::shape_of>(along, a, rnd({4, 5}))), k::shape_error);
  CHECK_THROWS_AS(ev(make<k::Op::expand>(k::Attrs{}, x, make<k::Op::shape_of>(k::Attrs{}, r))), k::shape_error);
}

TEST_CASE("reference: sum_to_shape_of sums g over the dims its target was broadcast along") {
  using k::expr::make;
  Tensor g = rnd({2, 3, 4}), x = rnd({3, 1}), same = rnd({2, 3, 4});
  const Vec gv = host(g);
  Vec want(3, 0.0);
  for (int a = 0; a < 2; ++a)
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) want[static_cast<std::size_t>(i)] += gv[static_cast<std::size_t>((a * 3 + i) * 4 + j)];
  check_result(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, g, x)), {3, 1}, want, 1e-6);  // rounded to f32
  check_result(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, g, same)), {2, 3, 4}, gv, 0);
  // A target that does not broadcast to g is a shape error naming both shapes.
  CHECK_THROWS_WITH_AS(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, x, g)),
                       doctest::Contains("[2, 3, 4] does not broadcast to [3, 1]"), k::shape_error);
  CHECK_THROWS_WITH_AS(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, g, rnd({5}))),
                       doctest::Contains("[5] and [2, 3, 4] cannot be broadcast"), k::shape_error);
  // Leading dims only, and a 0-dim target: everything summed into one element.
  Vec rows(4, 0.0);
  for (std::size_t i = 0; i < gv.size(); ++i) rows[i % 4] += gv[i];
  check_result(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, g, rnd({4}))), {4}, rows, 1e-6);
  double all = 0;
  for (double v : gv) all += v;
  check_result(ev(make<k::Op::sum_to_shape_of>(k::Attrs{}, g, k::Tensor(k::full({}, 2.0f)))), {}, {all}, 1e-6);
}

TEST_CASE("reference: gather along the last dim") {
  Tensor x = rnd({5, 9}), idx = rnd_index({5, 4}, 9);
  const Vec xv = host(x), iv = host(idx);
  Vec want;
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 4; ++j) want.push_back(xv[i * 9 + static_cast<int>(iv[i * 4 + j])]);
  Result r = ev(k::expr::make<k::Op::gather>({}, x, idx));
  CHECK(r.dt == k::f32);
  check_result(r, {5, 4}, want, 0);
  // 3-D with i32 indices.
  Tensor x3 = rnd({2, 3, 7}), i3 = rnd_index({2, 3, 2}, 7, k::i32);
  const Vec x3v = host(x3), i3v = host(i3);
  Vec want3;
  for (int r0 = 0; r0 < 6; ++r0)
    for (int j = 0; j < 2; ++j) want3.push_back(x3v[r0 * 7 + static_cast<int>(i3v[r0 * 2 + j])]);
  check_result(ev(k::expr::make<k::Op::gather>({}, x3, i3)), {2, 3, 2}, want3, 0);
  // Out-of-range indices are an error.
  CHECK_THROWS_AS(ev(k::expr::make<k::Op::gather>({}, x, from({0, 9, 1, 2, 3}, {5, 1}, k::i64))), k::shape_error);
  CHECK_THROWS_AS(ev(k::expr::make<k::Op::gather>({}, x, from({0, -1, 1, 2, 3}, {5, 1}, k::i64))), k::shape_error);
}

TEST_CASE("reference: argmax / argmin (first of ties, first NaN) and cat along a dim") {
  // Rows: ties at the extremum, a NaN, -inf and +inf.
  Tensor x = from({1, 3, 3, -2, /**/ 0, NaN, 5, NaN, /**/ -Inf, -Inf, 2, Inf}, {3, 4});
  Result amax = ev(k::argmax(x, 1));
  CHECK(amax.dt == k::i64);
  check_result(amax, {3}, {1, 1, 3}, 0);
  check_result(ev(k::argmin(x, -1, true)), {3, 1}, {3, 1, 0}, 0);
  check_result(ev(k::argmax(x, 0)), {4}, {0, 1, 1, 1}, 0);
  CHECK_THROWS_AS(ev(k::argmax(from({}, {2, 0}), 1)), k::shape_error);
  // cat of [2, 2] and [2, 1] along dim 1 and of [1, 2] and [2, 2] along dim 0; dtypes promote.
  Tensor a = from({1, 2, 3, 4}, {2, 2}), b = from({5, 6}, {2, 1}, k::i64), c = from({7, 8}, {1, 2}, k::bf16);
  Result ab = ev(k::cat(1, a, b));
  CHECK(ab.dt == k::f32);
  check_result(ab, {2, 3}, {1, 2, 5, 3, 4, 6}, 0);
  Result ca = ev(k::cat(-2, c, a, c));
  CHECK(ca.dt == k::f32);
  check_result(ca, {4, 2}, {7, 8, 1, 2, 3, 4, 7, 8}, 0);
  check_result(ev(k::stack(1, a, a)), {2, 2, 2}, {1, 2, 1, 2, 3, 4, 3, 4}, 0);
  CHECK_THROWS_AS(ev(k::cat(0, a, b)), k::shape_error);
}

TEST_CASE("reference: numel, iota and constants") {
  Tensor x = rnd({3, 5, 7});
  k::Attrs at;
  at.dims = {0, -1};
  Result n = ev(k::expr::make<k::Op::numel>(at, x));
  CHECK(n.shape == Dims{});
  CHECK(n.dt == k::f64);
  check_vec(n.v, {21}, 0);
  at.all = true;
  check_vec(ev(k::expr::make<k::Op::numel>(at, x)).v, {105}, 0);
  // sum(x, dims) / numel(x, dims) is the mean.
  k::Attrs at1;
  at1.dims = {1};
  Vec m = reduce3(host(x), 3, 5, 7, {false, true, false}, 0, add);
  check_result(ev(k::sum(x, 1) / k::expr::make<k::Op::numel>(at1, x)), {3, 7}, map(m, [](double v) { return v / 5; }));

  k::expr::Iota io;
  io.attrs.dims = {3, 4};
  io.attrs.a = 1;
  Result r = ev(io);
  CHECK(r.dt == k::i64);
  check_result(r, {3, 4}, {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}, 0);
  io.attrs.a = -2;
  check_result(ev(io), {3, 4}, {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}, 0);
  // A one-hot mask built from iota, as the cross-entropy decomposition does.
  Tensor t = from({2, 0, 3}, {3, 1}, k::i64);
  io.attrs.a = 1;
  check_result(ev(k::cast(io == t, k::f32)), {3, 4}, {0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1}, 0);
  // iota_of: the index along dim a of a broadcastable shape, sized from x's dim b (x's values unread).
  k::Attrs of;
  of.dims = {1, 1, 1};
  of.a = 2;
  of.b = 1;
  Result ix = ev(k::expr::make<k::Op::iota_of>(of, x));
  CHECK(ix.dt == k::i64);
  check_result(ix, {1, 1, 5}, {0, 1, 2, 3, 4}, 0);
  of.a = 3;  // past the shape's rank
  CHECK_THROWS_AS(ev(k::expr::make<k::Op::iota_of>(of, x)), k::shape_error);
  // A reshape's size that is the input's along a dim (k::Attrs::input_dim: the pipeline's own).
  k::Attrs rs;
  rs.dims = {k::Attrs::input_dim(2), -1};
  check_result(ev(k::expr::make<k::Op::reshape>(rs, x)), {7, 15}, host(x), 0);

  // Constants only come from rewrite rules: build the graph by hand, and drive eval_graph directly.
  k::graph::Graph g;
  k::graph::CseIndex cse;
  auto add = [&](k::Op op, std::initializer_list<int> in) {
    k::graph::Node n;
    n.op = op;
    for (int i : in) n.in[n.n_in++] = i;
    return cse.add(g, n);
  };
  k::graph::Node arg;
  arg.op = k::Op::arg;
  arg.slot = 0;
  int a = cse.add(g, arg);
  k::graph::Node c;
  c.op = k::Op::constant;
  c.value = 0.125;
  int ci = cse.add(g, c);
  k::graph::Node s;
  s.op = k::Op::scalar;
  s.slot = 0;
  s.floating = true;
  int si = cse.add(g, s);
  int mul = add(k::Op::mul, {a, ci});
  g.outputs = {add(k::Op::add, {mul, si}), mul};
  g.num_args = 1;
  g.num_scalars = 1;
  Tensor y = rnd({4, 3});
  std::vector<Tensor> args{y};
  k::graph::infer_shapes(g, [&](int i) -> const Tensor& { return args[static_cast<std::size_t>(i)]; });
  std::vector<double> scalars{-2.5};
  auto out = k::reference::eval_graph(g, args, scalars);
  REQUIRE(out.size() == 2);
  CHECK(out[0].shape == Dims{4, 3});
  CHECK(out[0].dt == k::f32);
  const Vec yv = host(y);
  check_vec(out[0].data, map(yv, [](double v) { return v * 0.125 - 2.5; }), 0);
  check_vec(out[1].data, map(yv, [](double v) { return v * 0.125; }), 0);
  // Missing arguments or scalars are errors, not out-of-bounds reads.
  CHECK_THROWS_AS(k::reference::eval_graph(g, args, std::span<const double>{}), k::error);
  CHECK_THROWS_AS(k::reference::eval_graph(g, std::span<const Tensor>{}, scalars), k::error);
}

// ---- matmul and composites ---------------------------------------------------------------------

namespace {
Vec mm(const Vec& a, const Vec& b, int M, int K, int N) {
  Vec o(static_cast<std::size_t>(M * N), 0.0);
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      for (int l = 0; l < K; ++l) o[i * N + j] += a[i * K + l] * b[l * N + j];
  return o;
}
}  // namespace

TEST_CASE("reference: matmul 2-D, batched 3-D, 3-D x 2-D") {
  Tensor a = rnd({37, 19}), b = rnd({19, 23});
  const Vec av = host(a), bv = host(b);
  check_result(ev(k::matmul(a, b)), {37, 23}, mm(av, bv, 37, 19, 23));
  Tensor a3 = rnd({3, 5, 7}), b3 = rnd({3, 7, 4}), b2 = rnd({7, 4});
  const Vec a3v = host(a3), b3v = host(b3), b2v = host(b2);
  Vec w3, w32;
  for (int bt = 0; bt < 3; ++bt) {
    Vec ab(a3v.begin() + bt * 35, a3v.begin() + (bt + 1) * 35), bb(b3v.begin() + bt * 28, b3v.begin() + (bt + 1) * 28);
    Vec r = mm(ab, bb, 5, 7, 4), r2 = mm(ab, b2v, 5, 7, 4);
    w3.insert(w3.end(), r.begin(), r.end());
    w32.insert(w32.end(), r2.begin(), r2.end());
  }
  check_result(ev(k::matmul(a3, b3)), {3, 5, 4}, w3);
  check_result(ev(k::matmul(a3, b2)), {3, 5, 4}, w32);
  // With a transposed operand and a pointwise epilogue.
  Tensor bt = rnd({23, 19}), bias = rnd({23});
  const Vec btv = host(bt), biasv = host(bias);
  Vec bT(19 * 23);
  for (int i = 0; i < 19; ++i)
    for (int j = 0; j < 23; ++j) bT[i * 23 + j] = btv[j * 19 + i];
  Vec ep = mm(av, bT, 37, 19, 23);
  for (int i = 0; i < 37; ++i)
    for (int j = 0; j < 23; ++j) ep[i * 23 + j] = std::max(ep[i * 23 + j] + biasv[j], 0.0);
  check_result(ev(k::relu(k::matmul(a, k::transpose(bt, 0, 1)) + bias)), {37, 23}, ep);
  // Size-0 inner dimension: all zeros.
  check_result(ev(k::matmul(rnd({2, 0}), rnd({0, 3}))), {2, 3}, Vec(6, 0.0), 0);
}

TEST_CASE("reference: layer_norm and rms_norm") {
  const int R = 3 * 5, D = 129;
  Tensor x = rnd({3, 5, D}, k::f32, -3, 3), w = rnd({D}), b = rnd({D});
  const Vec xv = host(x), wv = host(w), bv = host(b);
  for (double eps : {1e-5, 0.5}) {
    CAPTURE(eps);
    Vec ln, rn;
    for (int r = 0; r < R; ++r) {
      double s = 0, s2 = 0, sq = 0;
      for (int j = 0; j < D; ++j) s += xv[r * D + j];
      const double mu = s / D;
      for (int j = 0; j < D; ++j) s2 += (xv[r * D + j] - mu) * (xv[r * D + j] - mu);
      for (int j = 0; j < D; ++j) sq += xv[r * D + j] * xv[r * D + j];
      for (int j = 0; j < D; ++j) ln.push_back((xv[r * D + j] - mu) / std::sqrt(s2 / D + eps) * wv[j] + bv[j]);
      for (int j = 0; j < D; ++j) rn.push_back(xv[r * D + j] / std::sqrt(sq / D + eps) * wv[j]);
    }
    check_result(ev(k::layer_norm(x, w, b, eps)), {3, 5, D}, ln, 1e-11);
    check_result(ev(k::rms_norm(x, w, eps)), {3, 5, D}, rn, 1e-11);
  }
  // Default eps values: 1e-5 for layer_norm, 1e-6 for rms_norm (a constant row shows eps).
  Tensor c = from({2, 2, 2, 2}, {1, 4}, k::f64), ones = from({1, 1, 1, 1}, {4}, k::f64),
         zeros = from({0, 0, 0, 0}, {4}, k::f64);
  check_vec(ev(k::layer_norm(c + k::cast(k::expr::Iota{{},
                                                       [] {
                                                         k::Attrs at;
                                                         at.dims = {1, 4};
                                                         at.a = 1;
                                                         return at;
                                                       }()},
                                         k::f64),
                             ones, zeros))
                .v,
            {-1.5 / std::sqrt(1.25 + 1e-5), -0.5 / std::sqrt(1.25 + 1e-5), 0.5 / std::sqrt(1.25 + 1e-5),
             1.5 / std::sqrt(1.25 + 1e-5)});
  check_vec(ev(k::rms_norm(c, ones)).v, Vec(4, 2 / std::sqrt(4 + 1e-6)));
}

TEST_CASE("reference: cross_entropy, mse_loss, linear") {
  const int N = 37, C = 11;
  Tensor logits = rnd({N, C}, k::f32, -5, 5), t = rnd_index({N}, C);
  const Vec lv = host(logits), tv = host(t);
  double ce = 0;
  for (int i = 0; i < N; ++i) {
    double z = 0;
    for (int j = 0; j < C; ++j) z += std::exp(lv[i * C + j]);
    ce += -std::log(std::exp(lv[i * C + static_cast<int>(tv[i])]) / z);
  }
  Result r = ev(k::cross_entropy(logits, t));
  CHECK(r.dt == k::f32);
  check_result(r, {}, {ce / N}, 1e-12);
  check_result(ev(k::cross_entropy(logits, k::cast(t, k::i32))), {}, {ce / N}, 1e-12);
  check_vec(ev(k::cross_entropy(logits * 300.0, t)).v, {[&] {  // huge logits stay finite
              double s = 0;
              for (int i = 0; i < N; ++i) {
                double m = -Inf;
                for (int j = 0; j < C; ++j) m = std::max(m, 300 * lv[i * C + j]);
                double z = 0;
                for (int j = 0; j < C; ++j) z += std::exp(300 * lv[i * C + j] - m);
                s += m + std::log(z) - 300 * lv[i * C + static_cast<int>(tv[i])];
              }
              return s / N;
            }()},
            1e-12);
  CHECK_THROWS_AS(ev(k::cross_entropy(logits, from(Vec(N, 11.0), {N}, k::i64))), k::shape_error);

  // mse_loss with broadcasting [5,1,3] vs [4,3]: the mean over the broadcast shape [5,4,3].
  Tensor a = rnd({5, 1, 3}), b = rnd({4, 3});
  const Vec av = host(a), bv = host(b);
  double se = 0;
  for (int i = 0; i < 5; ++i)
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 3; ++l) se += (av[i * 3 + l] - bv[j * 3 + l]) * (av[i * 3 + l] - bv[j * 3 + l]);
  check_result(ev(k::mse_loss(a, b)), {}, {se / 60});

  // linear: x [3,7,19] @ w[11,19]^T + b[11]; without bias.
  Tensor x = rnd({3, 7, 19}), w = rnd({11, 19}), bias = rnd({11});
  const Vec xv = host(x), wv = host(w), biv = host(bias);
  Vec lin, lin0;
  for (int r0 = 0; r0 < 21; ++r0)
    for (int o = 0; o < 11; ++o) {
      double s = 0;
      for (int i = 0; i < 19; ++i) s += xv[r0 * 19 + i] * wv[o * 19 + i];
      lin.push_back(s + biv[o]);
      lin0.push_back(s);
    }
  check_result(ev(k::linear(x, w, bias)), {3, 7, 11}, lin);
  check_result(ev(k::linear(x, w)), {3, 7, 11}, lin0);
  // The API's definition: matmul(x, transpose(w)) + b.
  CHECK(k::testing::allclose(k::reference::eval(k::linear(x, w, bias)), k::matmul(x, k::transpose(w, 0, 1)) + bias,
                             1e-13, 1e-13));
}

// ---- inputs: layouts, dtypes, placeholders -----------------------------------------------------

TEST_CASE("reference: non-contiguous inputs are read through their strides") {
  Tensor base = rnd({10, 20});
  const Vec bv = host(base);
  // A strided window with an offset: v[i, j] = base_flat[4 + 2i + 3j].
  Tensor v = base.as_strided({7, 5}, {2, 3}, 4);
  CHECK_FALSE(v.is_contiguous());
  Vec want;
  for (int i = 0; i < 7; ++i)
    for (int j = 0; j < 5; ++j) want.push_back(std::exp(bv[4 + 2 * i + 3 * j]));
  check_result(ev(k::exp(v)), {7, 5}, want);
  // A transposed view (strides {1, 20}) in a matmul.
  Tensor tr = base.as_strided({20, 10}, {1, 20}, 0);
  CHECK_FALSE(tr.is_contiguous());
  Tensor m = rnd({10, 3});
  Vec trv(200);
  for (int i = 0; i < 20; ++i)
    for (int j = 0; j < 10; ++j) trv[i * 10 + j] = bv[j * 20 + i];
  check_result(ev(k::matmul(tr, m)), {20, 3}, mm(trv, host(m), 20, 10, 3));
  // A stride-0 (expanded) view.
  Tensor ex = base.as_strided({3, 20}, {0, 1}, 20);
  Vec exv;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 20; ++j) exv.push_back(bv[20 + j]);
  check_result(ev(k::sum(ex, 0)), {20}, map(Vec(bv.begin() + 20, bv.begin() + 40), [](double x) { return 3 * x; }));
  // eval of a plain tensor copies it to a contiguous f64 CPU tensor.
  Tensor c = k::reference::eval(v);
  CHECK(c.dtype() == k::f64);
  CHECK(c.is_contiguous());
  check_vec(host(c), map(want, [](double x) { return std::log(x); }), 1e-12);
  // Negative strides (a reversed view).
  Tensor rev = base.as_strided({20}, {-1}, 19);
  Vec rv;
  for (int j = 19; j >= 0; --j) rv.push_back(bv[j]);
  check_result(ev(rev * 1.0), {20}, rv, 0);
}

TEST_CASE("reference: f16, bf16 and f64 inputs are read exactly") {
  for (k::dtype dt : {k::f16, k::bf16, k::f64, k::i64, k::i32}) {
    CAPTURE(k::name(dt));
    Tensor x = rnd({3, 17}, dt, -8, 8);
    const Vec xv = host(x);
    Result r = ev(x * x);
    CHECK(r.dt == dt);
    check_result(r, {3, 17}, map(xv, [](double v) { return v * v; }), 0);
  }
  // Mixed f16 + bf16 promotes to f32; values are exact sums.
  Tensor h = rnd({9}, k::f16), b = rnd({9}, k::bf16);
  Result r = ev(h + b);
  CHECK(r.dt == k::f32);
  const Vec hv = host(h), bv = host(b);
  Vec s;
  for (int i = 0; i < 9; ++i) s.push_back(hv[i] + bv[i]);
  check_vec(r.v, s, 0);
}

TEST_CASE("reference: placeholders, several outputs, shared subexpressions") {
  Tensor x = rnd({4, 6}), y = rnd({6});
  const Vec xv = host(x), yv = host(y);
  // Arg<I> placeholders bound to tensors, mixed with an eager tensor leaf.
  k::expr::Arg<0> a0{{}, &x};
  k::expr::Arg<1> a1{{}, &y};
  Tensor z = rnd({6});
  const Vec zv = host(z);
  Vec want;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) want.push_back(xv[i * 6 + j] * yv[j] + zv[j]);
  check_result(ev(a0 * a1 + z), {4, 6}, want);
  k::expr::Arg<2> unbound{};
  CHECK_THROWS_AS(ev(a0 + unbound), k::error);
  // k::assign(a, expr) evaluates to expr (the write-back is the compiler's business).
  check_result(ev(k::assign(unbound, a0 * a1 + z)), {4, 6}, want);
  // k::sum(x) with no dims (typed as a full reduction) is an ordinary node here.
  check_result(ev(k::sum(a0)), {}, {[&] {
                 double t = 0;
                 for (double v : xv) t += v;
                 return t;
               }()});

  // A tuple: one graph, several results (expressions and plain tensors).
  auto e = k::exp(x);
  auto [t1, t2, t3] = k::reference::eval(std::tuple{e, k::sum(e, 1), y});
  CHECK(t1.shape() == Dims{4, 6});
  CHECK(t2.shape() == Dims{4});
  CHECK(t3.dtype() == k::f64);
  Vec ex = map(xv, [](double v) { return std::exp(v); });
  check_vec(host(t1), ex);
  check_vec(host(t2), reduce3(ex, 4, 6, 1, {false, true, false}, 0, add));
  check_vec(host(t3), yv, 0);
  // The same scalar value at two places, and a repeated subexpression.
  check_result(ev(e * 2.0 + e * 2.0), {4, 6}, map(ex, [](double v) { return 4 * v; }));
  check_result(ev(e * 2.0 + e * 3.0), {4, 6}, map(ex, [](double v) { return 5 * v; }));
}

TEST_CASE("reference: a CUDA tensor is copied to the host" * needs_gpu()) {
  Tensor h = rnd({6, 9});
  const Vec hv = host(h);
  Tensor d = Tensor::empty({6, 9}, k::f32, k::cuda);
  k::memory::copy(d.data_ptr(), k::cuda, h.data_ptr(), k::cpu, h.nbytes(), nullptr);
  k::synchronize();
  check_result(ev(d * 1.0), {6, 9}, hv, 0);
  Tensor tv = d.as_strided({9, 3}, {1, 18}, 1);  // a transposed, offset view on the device
  Vec want;
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 3; ++j) want.push_back(hv[1 + i + 18 * j]);
  check_result(ev(tv + 0.0), {9, 3}, want, 0);
  CHECK(k::testing::allclose(d, h));
}

// ---- allclose -------------------------------------------------------------------------------------

TEST_CASE("testing: allclose") {
  namespace kt = k::testing;
  Vec xv = host(rnd({37, 129}));
  xv[5 * 129 + 7] = 1.5;
  Tensor x = from(xv, {37, 129}, k::f32);
  CHECK(kt::allclose(x, x));
  CHECK(kt::allclose(x, x * 1.0));  // b as an expression (the oracle evaluates it)
  CHECK(kt::allclose(x * 2.0, x + x));
  CHECK(kt::allclose(x, k::cast(x, k::f64)));  // any dtypes
  bool as_bool = kt::allclose(x, x);
  CHECK(as_bool);

  // One element off: reported with its index, both values and the mismatch count.
  Vec yv = xv;
  yv[5 * 129 + 7] += 0.01;
  Tensor y = from(yv, {37, 129}, k::f64);
  auto r = kt::allclose(x, y);
  CHECK_FALSE(r);
  CHECK(r.mismatches == 1);
  CHECK(r.worst == 5 * 129 + 7);
  CHECK(r.worst_index == Dims{5, 7});
  std::ostringstream os;
  os << r;
  CHECK(os.str().find("[5, 7]") != std::string::npos);
  CHECK(os.str().find("1 of 4773") != std::string::npos);
  CHECK(kt::allclose(x, y, 0, 0.011));  // within atol
  CHECK_FALSE(kt::allclose(x, y, 0, 0.009));
  CHECK(kt::allclose(x, y, 0.01, 0));  // 0.01 <= 0.01 * 1.51
  CHECK_FALSE(kt::allclose(x, y, 0.006, 0));

  // The worst of several mismatches is the one furthest outside its tolerance.
  auto r2 = kt::allclose(from({1, 1, 1, 1}, {4}, k::f64), from({1, 1.5, 2, 1.25}, {4}, k::f64));
  CHECK(r2.mismatches == 3);
  CHECK(r2.worst == 2);
  CHECK(r2.worst_a == 1);
  CHECK(r2.worst_b == 2);
  CHECK(r2.worst_error == 1);

  // NaN == NaN only at the same position; infinities equal only themselves.
  Tensor n1 = from({1, NaN, Inf, -Inf}, {4}, k::f64);
  CHECK(kt::allclose(n1, from({1, NaN, Inf, -Inf}, {4}, k::f32)));
  CHECK_FALSE(kt::allclose(n1, from({1, 2, Inf, -Inf}, {4}, k::f64)));
  CHECK_FALSE(kt::allclose(from({NaN, 1}, {2}, k::f64), from({1, NaN}, {2}, k::f64)));
  CHECK_FALSE(kt::allclose(n1, from({1, NaN, -Inf, -Inf}, {4}, k::f64)));
  CHECK_FALSE(kt::allclose(from({1e300}, {1}, k::f64), from({Inf}, {1}, k::f64), 1, 1));
  auto rn = kt::allclose(from({1, 2}, {2}, k::f64), from({1, NaN}, {2}, k::f64));
  CHECK(rn.worst == 1);

  // Shapes must match: the message names both.
  auto rs = kt::allclose(rnd({2, 3}), rnd({3, 2}));
  CHECK_FALSE(rs);
  std::ostringstream os2;
  os2 << rs;
  CHECK(os2.str().find("[2, 3]") != std::string::npos);
  CHECK(os2.str().find("[3, 2]") != std::string::npos);
  CHECK_FALSE(kt::allclose(rnd({6}), rnd({1, 6})));
  // Zero-size tensors of the same shape are close.
  CHECK(kt::allclose(rnd({0, 4}), rnd({0, 4})));
  // f16 against the f64 oracle needs an f16 tolerance.
  Tensor h = rnd({64}, k::f16);
  CHECK(kt::allclose(k::cast(k::exp(h), k::f16), k::exp(h), 1e-3, 1e-3));
  CHECK_FALSE(kt::allclose(k::cast(k::exp(h), k::f16), k::exp(h), 1e-7, 0));
}

// ---- custom ops --------------------------------------------------------------------------------

TEST_CASE("reference: a custom op runs the user's forward on CPU tensors of the nodes' dtypes") {
  static k::dtype seen = k::f64;
  k::CustomOp halve_to_f16 = k::custom_op(
      "halve_to_f16", {
                          .infer =
                              [](std::span<const k::TensorSpec> in) {
                                return k::TensorSpec{in[0].shape, k::f16};
                              },
                          .forward =
                              [](std::span<const k::Tensor> in, Tensor& out, k::Stream) {
                                seen = in[0].dtype();
                                for (std::int64_t i = 0; i < out.numel(); ++i)
                                  k::store_from_double(out.data_ptr(), out.dtype(), i,
                                                       k::load_as_double(in[0].data_ptr(), in[0].dtype(), i) / 2);
                              },
                      });
  Tensor x = rnd({7, 9}, k::f32);
  Result r = ev(halve_to_f16(x * 3) + 1);
  CHECK(seen == k::f32);
  CHECK(r.dt == k::f16);
  const Vec xv = host(x);
  Vec want(xv.size());
  for (std::size_t i = 0; i < xv.size(); ++i)
    want[i] =
        static_cast<double>(static_cast<float>(k::half(static_cast<float>(static_cast<float>(xv[i] * 3) / 2)))) + 1;
  check_result(r, Dims{7, 9}, want, 1e-3);
}

// ---- embedding, its scatter-add gradient, rand ---------------------------------------------------

TEST_CASE("reference: embedding reads the table's rows at the ids; a bad id throws naming it") {
  Tensor table = rnd({7, 5});
  const Vec t = host(table);
  Tensor ids = from({6, 0, 3, 3, 1, 6}, {2, 3}, k::i64);
  Vec want;
  for (double id : {6, 0, 3, 3, 1, 6})
    for (int d = 0; d < 5; ++d) want.push_back(t[static_cast<std::size_t>(id * 5 + d)]);
  Result r = ev(k::embedding(table, ids));
  check_result(r, {2, 3, 5}, want, 0);
  CHECK(r.dt == k::f32);
  check_result(ev(k::embedding(table, from({6, 0, 3, 3, 1, 6}, {6}, k::i32))), {6, 5}, want, 0);
  CHECK_THROWS_WITH_AS(ev(k::embedding(table, from({1, 7}, {2}, k::i64))), doctest::Contains("index 7 at position 1"),
                       k::shape_error);
  CHECK_THROWS_AS(ev(k::embedding(table, from({-1}, {1}, k::i64))), k::shape_error);
}

TEST_CASE("reference: embedding_backward sums the gradient's rows per id") {
  Tensor g = rnd({2, 3, 4});
  const Vec gv = host(g);
  const std::vector<int> id = {2, 0, 2, 4, 2, 0};
  k::Attrs at;
  at.a = 5;
  Result r = ev(k::expr::make<k::Op::embedding_backward>(at, g, from({2, 0, 2, 4, 2, 0}, {2, 3}, k::i64)));
  Vec want(20, 0.0);
  for (std::size_t p = 0; p < id.size(); ++p)
    for (int d = 0; d < 4; ++d) want[static_cast<std::size_t>(id[p] * 4 + d)] += gv[p * 4 + d];
  check_result(r, {5, 4}, want, 1e-15);
}

TEST_CASE("reference: rand is Philox 4x32-10 per row-major position, in [0, 1)") {
  // Random123's known answers (kat_vectors) for philox4x32_10.
  static_assert(k::philox::philox4x32_10({0, 0, 0, 0}, 0, 0) ==
                std::array<std::uint32_t, 4>{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  static_assert(k::philox::philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffu,
                                         0xffffffffu) ==
                std::array<std::uint32_t, 4>{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  static_assert(k::philox::philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u,
                                         0x299f31d0u) ==
                std::array<std::uint32_t, 4>{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
  Tensor x = rnd({3, 5, 7});
  const std::uint64_t seed = 0x123456789abcdefull, offset = (std::uint64_t{1} << 32) - 50;  // crosses a word
  Result r = ev(k::rand_like(x, seed, offset));
  CHECK(r.dt == k::f32);
  Vec want;
  for (std::uint64_t i = 0; i < 105; ++i)
    want.push_back(k::philox::uniform(seed, offset, i));
  check_result(r, {3, 5, 7}, want, 0);
  for (double v : r.v) CHECK((v >= 0 && v < 1));
  // The first word of Philox(counter 0, key 0), as a uniform: 0x6627e8d5 >> 8 / 2^24.
  CHECK(k::philox::uniform(0, 0, 0) == static_cast<float>(0x6627e8u) / 16777216.0f);
}

TEST_CASE("reference: attention is softmax(q k^T * scale) v per head, computed here for one head") {
  // One batch, one head, Tq = 2, Tk = 3, D = 2, Dv = 1: by hand.
  Tensor q = from({1, 0, 0, 2}, {1, 1, 2, 2}), kk = from({1, 1, 0, 1, 2, 0}, {1, 1, 3, 2});
  Tensor v = from({1, 2, 4}, {1, 1, 3, 1});
  const double s = 1 / std::sqrt(2.0);
  auto row = [&](std::vector<double> sc, int upto) {
    double m = -Inf, l = 0, acc = 0;
    for (int j = 0; j <= upto; ++j) m = std::max(m, sc[j] * s);
    for (int j = 0; j <= upto; ++j) {
      double p = std::exp(sc[j] * s - m);
      l += p;
      acc += p * std::vector<double>{1, 2, 4}[j];
    }
    return acc / l;
  };
  // scores: q0 . k = [1, 0, 2], q1 . k = [2, 2, 0]
  check_result(ev(k::attention(q, kk, v)), {1, 1, 2, 1}, {row({1, 0, 2}, 2), row({2, 2, 0}, 2)}, 1e-14);
  check_result(ev(k::attention(q, kk, v, {.causal = true})), {1, 1, 2, 1}, {row({1, 0, 2}, 0), row({2, 2, 0}, 1)},
               1e-14);
  // attention_flash, the node lowering gives the fused GPU kernel: the same values.
  k::Attrs causal;
  causal.a = 1;
  check_result(ev(k::expr::make<k::Op::attention_flash>(causal, q, kk, v, 0.0)), {1, 1, 2, 1},
               {row({1, 0, 2}, 0), row({2, 2, 0}, 1)}, 1e-14);
  k::Attrs scaled;  // a given scale (attrs.b): 1 / sqrt(2) again, through the scalar
  scaled.b = 1;
  check_result(ev(k::expr::make<k::Op::attention_flash>(scaled, q, kk, v, s)), {1, 1, 2, 1},
               {row({1, 0, 2}, 2), row({2, 2, 0}, 2)}, 1e-14);
  // A node lowering gave the fused kernel (warps set) refuses head dims the kernel does not take
  // (a dynamic program reached with them then compiles again), and takes those it does.
  k::Attrs lowered;
  lowered.d = 4;
  Tensor q24 = rnd({1, 2, 3, 24}), k24 = rnd({1, 2, 5, 24}), v24 = rnd({1, 2, 5, 24});
  CHECK_THROWS_WITH_AS(ev(k::expr::make<k::Op::attention_flash>(lowered, q24, k24, v24, 0.0)),
                       doctest::Contains("fused kernel does not take head dims 24"), k::shape_error);
  Tensor q32 = rnd({1, 2, 3, 32}), k32 = rnd({1, 2, 5, 32}), v32 = rnd({1, 2, 5, 32});
  check_result(ev(k::expr::make<k::Op::attention_flash>(lowered, q32, k32, v32, 0.0)), {1, 2, 3, 32},
               ev(k::attention(q32, k32, v32)).v, 1e-12);
}

// The fused backward's nodes: attention_grad against kiln's CPU gradient of the f64 decomposition
// (which passes gradcheck in test_attention), attention_lse against its definition.
TEST_CASE("reference: attention_lse and attention_grad are the rows' log-sum-exp and gradients of attention") {
  for (bool causal : {false, true}) {
    INFO("causal " << causal);
    Tensor q = rnd({2, 4, 5, 3}, k::f64), kk = rnd({2, 2, 7, 3}, k::f64), v = rnd({2, 2, 7, 3}, k::f64),
           g = rnd({2, 4, 5, 3}, k::f64);
    auto vjp = k::vjp([causal](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = causal, .scale = 0.6}); },
                      k::wrt<0, 1, 2>)(q, kk, v, g);
    k::Attrs at;
    at.a = causal;
    at.b = 1;
    auto stats = k::expr::make<k::Op::attention_lse>(at, q, kk, 0.6);  // (attention_grad's oracle does not read it)
    const Vec sv = ev(stats).v, qv = host(q), kv = host(kk);
    for (int bh = 0; bh < 8; ++bh)
      for (int i = 0; i < 5; ++i) {
        double m = -Inf, l = 0;
        std::vector<double> s;
        for (int j = 0; j < 7; ++j) {
          double dot = 0;
          for (int d = 0; d < 3; ++d) dot += qv[(bh * 5 + i) * 3 + d] * kv[((bh / 4 * 2 + bh % 4 / 2) * 7 + j) * 3 + d];
          s.push_back(causal && j > i ? -Inf : dot * 0.6);
          m = std::max(m, s.back());
        }
        for (double x : s) l += std::exp(x - m);
        CHECK(sv[bh * 5 + i] == doctest::Approx(m + std::log(l)).epsilon(1e-12));
      }
    const k::Tensor want[3] = {std::get<0>(vjp), std::get<1>(vjp), std::get<2>(vjp)};
    for (int which = 0; which < 3; ++which) {
      at.c = which;
      Result r = ev(k::expr::make<k::Op::attention_grad>(at, q, kk, v, g, stats, 0.6));
      check_result(r, want[which].shape(), host(want[which]), 1e-9);
    }
    at.c = 3;  // dk and dv stacked, as the joined kernel writes them
    Vec both = host(want[1]), dv = host(want[2]);
    both.insert(both.end(), dv.begin(), dv.end());
    check_result(ev(k::expr::make<k::Op::attention_grad>(at, q, kk, v, g, stats, 0.6)), {2, 2, 2, 7, 3}, both, 1e-9);
  }
}

TEST_CASE("reference: score_arg gives a score_mod the scaled scores and their indices") {
  Tensor q = from({1, 0, 0, 2}, {1, 1, 2, 2}), kk = from({1, 1, 0, 1, 2, 0}, {1, 1, 3, 2});
  Tensor v = from({1, 2, 4}, {1, 1, 3, 1});
  // Scores replaced by the key index j (plus 0 * s): softmax([0, 1, 2]) . [1, 2, 4] for both rows;
  // with the query index i instead, every score of a row is equal: the mean of v.
  const double e0 = 1, e1 = std::exp(1.0), e2 = std::exp(2.0), by_j = (e0 * 1 + e1 * 2 + e2 * 4) / (e0 + e1 + e2);
  auto by_key = [](auto s, auto, auto, auto, auto j) { return s * 0.0 + k::cast(j, k::f64); };
  check_result(ev(k::attention(q, kk, v, by_key)), {1, 1, 2, 1}, {by_j, by_j}, 1e-14);
  auto by_query = [](auto s, auto b, auto h, auto i, auto) { return s * 0.0 + k::cast(i + b + h, k::f64); };
  check_result(ev(k::attention(q, kk, v, by_query)), {1, 1, 2, 1}, {7.0 / 3, 7.0 / 3}, 1e-14);
  // The score itself: q . k / sqrt(2), as without a score_mod.
  auto same = [](auto s, auto...) { return s; };
  check_result(ev(k::attention(q, kk, v, same)), {1, 1, 2, 1}, ev(k::attention(q, kk, v)).v, 1e-14);
}
