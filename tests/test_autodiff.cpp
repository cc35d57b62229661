// Tests of autodiff/: gradcheck of every differentiable primitive (broadcasting, reductions, views,
// where, matmul) and of the composites; the joint graph's outputs, dtypes and size; the partition
// report; the type-level checks of k::grad behind the static_asserts; the run-time errors.
#include <doctest/doctest.h>

#include <kiln/autodiff/grad.hpp>
#include <kiln/autodiff/partition.hpp>
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing/gradcheck.hpp>

#include "gradient_oracle.hpp"

#include <random>
#include <set>
#include <sstream>

namespace k = kiln;
using k::Op;
using k::autodiff::Mode;

namespace {

k::Tensor uniform(const k::Dims& shape, unsigned seed, double lo = -1, double hi = 1, k::dtype dt = k::f64) {
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) k::store_from_double(t.data_ptr(), dt, i, u(rng));
  return t;
}
k::Tensor values(const k::Dims& shape, const std::vector<double>& v, k::dtype dt = k::f64) {
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  for (std::size_t i = 0; i < v.size(); ++i) k::store_from_double(t.data_ptr(), dt, static_cast<std::int64_t>(i), v[i]);
  return t;
}

#define GRADCHECK(...)                                  \
  do {                                                  \
    auto result_ = k::testing::gradcheck(__VA_ARGS__);  \
    CHECK_MESSAGE(static_cast<bool>(result_), result_); \
  } while (0)

const k::Tensor X = uniform({3, 4}, 1, -2, 2);
const k::Tensor POS = uniform({3, 4}, 2, 0.5, 2);

}  // namespace

TEST_CASE("gradcheck: unary primitives") {
  GRADCHECK([](auto a) { return -a; }, X);
  GRADCHECK([](auto a) { return k::abs(a); }, X);
  GRADCHECK([](auto a) { return k::exp(a); }, X);
  GRADCHECK([](auto a) { return k::exp2(a); }, X);
  GRADCHECK([](auto a) { return k::log(a); }, POS);
  GRADCHECK([](auto a) { return k::log2(a); }, POS);
  GRADCHECK([](auto a) { return k::log1p(a); }, POS);
  GRADCHECK([](auto a) { return k::expm1(a); }, X);
  GRADCHECK([](auto a) { return k::sqrt(a); }, POS);
  GRADCHECK([](auto a) { return k::rsqrt(a); }, POS);
  GRADCHECK([](auto a) { return k::reciprocal(a); }, POS);
  GRADCHECK([](auto a) { return k::square(a); }, X);
  GRADCHECK([](auto a) { return k::sin(a); }, X);
  GRADCHECK([](auto a) { return k::cos(a); }, X);
  GRADCHECK([](auto a) { return k::tanh(a); }, X);
  GRADCHECK([](auto a) { return k::sigmoid(a); }, X);
  GRADCHECK([](auto a) { return k::erf(a); }, X);
  GRADCHECK([](auto a) { return k::relu(a); }, X);
  GRADCHECK([](auto a) { return k::sign(a) * a; }, X);  // sign itself has a zero gradient
  GRADCHECK([](auto a) { return k::cast(a, k::f64) * 3.0; }, X);
}

TEST_CASE("gradcheck: binary primitives with broadcasting and scalars") {
  const k::Tensor col = uniform({3, 1}, 3), row = uniform({4}, 4), prow = uniform({4}, 5, 0.5, 2);
  GRADCHECK([](auto a, auto b) { return a + b; }, col, row);
  GRADCHECK([](auto a, auto b) { return a - b; }, col, row);
  GRADCHECK([](auto a, auto b) { return a * b; }, col, row);
  GRADCHECK([](auto a, auto b) { return a / b; }, col, prow);
  GRADCHECK([](auto a, auto b) { return k::maximum(a, b); }, col, row);
  GRADCHECK([](auto a, auto b) { return k::minimum(a, b); }, X, row);
  GRADCHECK([](auto a) { return k::pow(a, 3.0) + k::pow(a, 0.5) + k::pow(a, -1.5); }, POS);
  GRADCHECK([](auto a) { return a * 2.5 - 1.0 / a + (3.0 - a) / 2.0; }, POS);
  GRADCHECK([](auto a, auto b) { return k::where(a > b, a, b * 2.0); }, col, row);
  GRADCHECK([](auto a, auto b) { return k::where(a <= 0.0, a * a, b); }, X, row);
  GRADCHECK([](auto a, auto b) { return k::where((a > 0.0) != (b < 0.0), a, 0.5); }, X, row);
}

TEST_CASE("gradcheck: reductions") {
  const k::Tensor x3 = uniform({2, 3, 4}, 6);
  GRADCHECK([](auto a) { return k::sum(a, 1); }, X);
  GRADCHECK([](auto a) { return k::sum(a, {0, 2}, true); }, x3);
  GRADCHECK([](auto a) { return k::sum(a); }, x3);
  GRADCHECK([](auto a) { return k::amax(a, 1); }, X);
  GRADCHECK([](auto a) { return k::amin(a, {0, 1}, true); }, x3);
  GRADCHECK([](auto a) { return k::amax(a); }, x3);
  GRADCHECK([](auto a) { return k::mean(a, -1); }, x3);
  GRADCHECK([](auto a) { return k::var(a, 1); }, X);
  GRADCHECK([](auto a) { return k::var(a, {0, 2}, 0.0, true); }, x3);
  GRADCHECK([](auto a) { return k::logsumexp(a, 0); }, X);
}

TEST_CASE("autodiff: amax ties share the gradient equally") {
  auto fn = k::grad([](auto x) { return k::amax(x); }, k::wrt<0>);
  Traced t = trace_gradient_fn(fn, values({4}, {1, 3, 3, 2}));
  k::graph::Graph d = k::detail::transform_graph(fn, t.g);
  auto g = k::reference::eval_graph(d, t.args, t.scalars);
  CHECK(g[0].data == std::vector<double>{0, 0.5, 0.5, 0});
}

TEST_CASE("gradcheck: views") {
  const k::Tensor x3 = uniform({2, 3, 4}, 7), w = uniform({4, 3}, 8), c = uniform({3, 1}, 9);
  GRADCHECK([](auto a, auto w) { return k::transpose(a, 0, 1) * w; }, X, w);
  GRADCHECK([](auto a) { return k::transpose(a, -1, 0); }, x3);
  GRADCHECK([](auto a) { return k::permute(a, {2, 0, 1}); }, x3);
  GRADCHECK([](auto a) { return k::slice(a, 1, 0, 4, 2); }, X);
  GRADCHECK([](auto a) { return k::slice(a, -1, -3, 100, 2) * 2.0; }, x3);
  GRADCHECK([](auto a) { return k::slice(k::slice(a, 0, 1, 3), 2, 1, 4); }, x3);
  GRADCHECK([](auto a) { return k::expand(a, {2, 3, 4}); }, c);
  GRADCHECK([](auto a) { return k::reshape(a, {4, 3}); }, X);
  GRADCHECK([](auto a) { return k::reshape(a, {-1}); }, x3);
  GRADCHECK([](auto a) { return k::unsqueeze(a, 1); }, X);
  GRADCHECK([](auto a) { return k::squeeze(a, 1) + k::squeeze(a); }, c);
}

TEST_CASE("gradcheck: matmul, 2-D and batched") {
  GRADCHECK([](auto a, auto b) { return k::matmul(a, b); }, X, uniform({4, 5}, 10));
  GRADCHECK([](auto a, auto b) { return k::matmul(a, b); }, uniform({2, 3, 4}, 11), uniform({2, 4, 5}, 12));
  GRADCHECK([](auto a, auto b) { return k::matmul(a, b); }, uniform({2, 3, 4}, 13), uniform({4, 5}, 14));
  GRADCHECK([](auto a, auto b) { return k::matmul(k::transpose(a, 0, 1), b); }, X, uniform({3, 2}, 15));
}

TEST_CASE("gradcheck: composites") {
  const k::Tensor x = uniform({5, 6}, 16, -2, 2), w = uniform({6}, 17), b = uniform({6}, 18);
  GRADCHECK([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, x, w, b);
  GRADCHECK([](auto x, auto w, auto b) { return k::layer_norm(x, w, b, 0.1); }, uniform({2, 3, 6}, 19), w, b);
  GRADCHECK([](auto x, auto w) { return k::rms_norm(x, w); }, x, w);
  GRADCHECK([](auto x) { return k::softmax(x, 1); }, x);
  GRADCHECK([](auto x) { return k::softmax(x, 0); }, x);
  GRADCHECK([](auto x) { return k::log_softmax(x, -1); }, x);
  GRADCHECK([](auto x) { return k::gelu(x); }, x);
  GRADCHECK([](auto x) { return k::gelu(x, k::approximate::tanh); }, x);
  GRADCHECK([](auto x) { return k::silu(x); }, x);
  GRADCHECK([](auto x, auto lo) { return k::clamp(x, lo, 1.0); }, x, uniform({6}, 20));
  GRADCHECK([](auto a, auto b) { return k::mse_loss(a, b); }, x, b);
}

TEST_CASE("gradcheck: cross_entropy(linear) and an MLP loss") {
  const k::Tensor x = uniform({4, 6}, 21), w = uniform({5, 6}, 22), b = uniform({5}, 23);
  const k::Tensor t = values({4}, {0, 4, 2, 2}, k::i64);
  GRADCHECK([](auto x, auto w, auto b, auto t) { return k::cross_entropy(k::linear(x, w, b), t); }, x, w, b, t);
  GRADCHECK([](auto x, auto w, auto t) { return k::cross_entropy(k::linear(x, w), t); }, x, w, t);
  const k::Tensor w1 = uniform({8, 6}, 24), b1 = uniform({8}, 25), w2 = uniform({5, 8}, 26), b2 = uniform({5}, 27);
  const k::Tensor g = uniform({6}, 28, 0.5, 1.5), beta = uniform({6}, 29);
  auto mlp = [](auto x, auto g, auto beta, auto w1, auto b1, auto w2, auto b2, auto t) {
    auto h = k::gelu(k::linear(k::layer_norm(x, g, beta), w1, b1));
    return k::cross_entropy(k::linear(h, w2, b2), t) + 0.01 * k::sum(k::square(w1));
  };
  GRADCHECK(mlp, x, g, beta, w1, b1, w2, b2, t);
}

TEST_CASE("gradcheck: eager tensors and unused arguments") {
  const k::Tensor captured = uniform({3, 4}, 30);
  GRADCHECK([&](auto a, auto) { return a * captured + k::sum(captured); }, X, uniform({2}, 31));
}

TEST_CASE("autodiff: grad, value_and_grad and vjp through the runtime protocol") {
  const k::Tensor x = uniform({3, 4}, 32), y = uniform({4}, 33), unused = uniform({2, 2}, 34, -1, 1, k::f32);
  auto f = [](auto x, auto y, auto) { return k::sum(x * y); };
  auto grad = k::grad(f, k::wrt<0, 1, 2>);
  static_assert(k::detail::num_outputs<decltype(grad), void> == 3);
  static_assert(k::detail::num_outputs<decltype(k::value_and_grad(f, k::wrt<1>)), void> == 2);
  static_assert(k::detail::num_outputs<decltype(f), std::tuple<int, int>> == 2);
  Traced t = trace_gradient_fn(grad, x, y, unused);
  CHECK(t.g.outputs.size() == 4);  // the value, then the wrt arguments
  k::graph::Graph d = k::detail::transform_graph(grad, t.g);
  REQUIRE(d.outputs.size() == 3);
  CHECK(d[d.outputs[0]].shape == k::Dims{3, 4});
  CHECK(d[d.outputs[1]].shape == k::Dims{4});
  CHECK(d[d.outputs[2]].shape == k::Dims{2, 2});
  CHECK(d[d.outputs[2]].dt == k::f32);  // zeros of the unused argument's dtype
  auto g = k::reference::eval_graph(d, t.args, t.scalars);
  CHECK(g[2].data == std::vector<double>(4, 0.0));
  // dx = y broadcast over rows; dy = column sums of x.
  auto xs = k::reference::read(x).data, ys = k::reference::read(y).data;
  for (int i = 0; i < 12; ++i) CHECK(g[0].data[i] == doctest::Approx(ys[i % 4]));
  CHECK(g[1].data[1] == doctest::Approx(xs[1] + xs[5] + xs[9]));

  auto vg = k::value_and_grad(f, k::wrt<1>);
  Traced tv = trace_gradient_fn(vg, x, y, unused);
  k::graph::Graph dv = k::detail::transform_graph(vg, tv.g);
  REQUIRE(dv.outputs.size() == 2);
  CHECK(dv[dv.outputs[0]].shape == k::Dims{});

  const k::Tensor ct = uniform({3, 4}, 35);
  auto vjp = k::vjp([](auto x, auto y) { return k::exp(x) * y; }, k::wrt<0>);
  Traced tj = trace_gradient_fn(vjp, x, y, ct);
  CHECK(tj.g.outputs.size() == 3);  // the value, x, the cotangent
  k::graph::Graph dj = k::detail::transform_graph(vjp, tj.g);
  auto gj = k::reference::eval_graph(dj, tj.args, tj.scalars);
  auto cs = k::reference::read(ct).data;
  for (int i = 0; i < 12; ++i) CHECK(gj[0].data[i] == doctest::Approx(cs[i] * std::exp(xs[i]) * ys[i % 4]));
}

TEST_CASE("autodiff: gradients have their argument's dtype; f16 computes through f32") {
  const k::Tensor x = uniform({2, 8}, 36, -1, 1, k::f16), w = uniform({8}, 37, -1, 1, k::f32);
  auto fn = k::grad([](auto x, auto w) { return k::sum(k::softmax(x, 1) * w); }, k::wrt<0, 1>);
  Traced t = trace_gradient_fn(fn, x, w);
  k::graph::Graph d = k::detail::transform_graph(fn, t.g);
  CHECK(d[d.outputs[0]].dt == k::f16);
  CHECK(d[d.outputs[1]].dt == k::f32);
  for (auto& n : d.nodes)
    if (n.op == Op::sum) CHECK(n.dt == k::f32);
}

TEST_CASE("autodiff: run-time errors") {
  auto not_single = k::grad([](auto x) { return k::sum(x, 1); }, k::wrt<0>);  // allowed by the type
  Traced t = trace_gradient_fn(not_single, X);
  CHECK_THROWS_AS(k::detail::transform_graph(not_single, t.g), k::shape_error);
  Traced one = trace_gradient_fn(not_single, uniform({1, 4}, 38));
  CHECK(k::detail::transform_graph(not_single, one.g).outputs.size() == 1);
  auto int_arg = k::grad([](auto x, auto n) { return k::sum(x * n); }, k::wrt<1>);
  Traced ti = trace_gradient_fn(int_arg, X, values({4}, {1, 2, 3, 4}, k::i64));
  CHECK_THROWS_AS(k::detail::transform_graph(int_arg, ti.g), k::dtype_error);
  auto bad_ct = k::vjp([](auto x) { return k::exp(x); }, k::wrt<0>);
  Traced tc = trace_gradient_fn(bad_ct, X, uniform({4, 3}, 39));
  CHECK_THROWS_AS(k::detail::transform_graph(bad_ct, tc.g), k::shape_error);
}

namespace {
// A chain of 50 ops; its gradient graph must stay linear in size (shared subtrees, not copies).
template <int N, class E>
auto chain(const E& x) {
  if constexpr (N == 0)
    return x;
  else
    return chain<N - 1>(k::tanh(x) * 1.1);
}
}  // namespace

TEST_CASE("autodiff: a 50-op chain and its gradient stay O(50) nodes") {
  auto fn = k::value_and_grad([](auto x) { return k::sum(chain<25>(x)); }, k::wrt<0>);
  Traced t = trace_gradient_fn(fn, uniform({8}, 40, -0.5, 0.5));
  CHECK(t.g.count_ops() == 51);
  k::graph::Graph d = k::rewrite::simplify(k::detail::transform_graph(fn, t.g));
  CHECK(d.count_ops() <= 4 * 51);
  GRADCHECK([](auto x) { return chain<25>(x); }, uniform({8}, 40, -0.5, 0.5));
}

TEST_CASE("partition: layer_norm saves mean and rstd, recomputes the rest") {
  const k::Tensor x = uniform({4, 16}, 41), w = uniform({16}, 42), b = uniform({16}, 43), ct = uniform({4, 16}, 44);
  auto fn = k::vjp([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, k::wrt<0, 1, 2>);
  Traced t = trace_gradient_fn(fn, x, w, b, ct);
  k::graph::Graph g = t.g;
  g.outputs.resize(1);
  auto joint = k::autodiff::differentiate_joint(g, std::vector<int>{0, 1, 2}, Mode::vjp, 3);
  auto report = k::autodiff::partition(joint);
  MESSAGE(report.str());
  std::multiset<Op> saved;
  for (int i : report.saved_ids()) saved.insert(joint.graph[i].op);
  CHECK(saved == std::multiset<Op>{Op::div, Op::rsqrt});  // mean = sum / n, rstd = rsqrt(var + eps)
  for (int i : report.saved_ids()) CHECK(joint.graph[i].shape == k::Dims{4, 1});
  CHECK(report.saved_bytes == 2 * 4 * 8);
  std::set<int> arg_slots;
  for (int i : report.argument_ids()) arg_slots.insert(joint.graph[i].slot);
  CHECK(arg_slots == std::set<int>{0, 1, 3});  // x, w and the cotangent; b is not read
  CHECK_FALSE(report.recomputed.empty());
  for (int i : report.recomputed_ids()) CHECK(k::is_pointwise(joint.graph[i].op));
}

TEST_CASE("partition: gelu(linear) saves the matmul output and recomputes gelu") {
  const k::Tensor x = uniform({4, 6}, 45), w = uniform({5, 6}, 46), b = uniform({5}, 47), ct = uniform({4, 5}, 48);
  auto fn = k::vjp([](auto x, auto w, auto b) { return k::gelu(k::linear(x, w, b)); }, k::wrt<0, 1, 2>);
  Traced t = trace_gradient_fn(fn, x, w, b, ct);
  k::graph::Graph g = t.g;
  g.outputs.resize(1);
  auto report = k::autodiff::partition(k::autodiff::differentiate_joint(g, std::vector<int>{0, 1, 2}, Mode::vjp, 3));
  MESSAGE(report.str());
  REQUIRE(report.saved.size() == 1);
  CHECK(report.saved[0].node.find("matmul") != std::string::npos);
  bool erf_recomputed = false;
  for (auto& e : report.recomputed) erf_recomputed = erf_recomputed || e.node.find("erf") != std::string::npos;
  CHECK(erf_recomputed);
}

// ---- the type-level checks behind k::grad's static_asserts ------------------------------------------
namespace {
using A0 = k::expr::Arg<0>;
using A1 = k::expr::Arg<1>;
template <class F>
using value_t = decltype(std::declval<F>()(A0{}, A1{}));
using k::detail::Scalarity;
constexpr auto scal = [](auto f) { return k::detail::scalarity_v<value_t<decltype(f)>>; };
}  // namespace

static_assert(scal([](auto x, auto) { return k::sum(x); }) == Scalarity::yes);
static_assert(scal([](auto x, auto) { return k::mean(x * 2.0f) * 0.5 + k::amax(x); }) == Scalarity::yes);
static_assert(scal([](auto x, auto t) { return k::cross_entropy(x, t); }) == Scalarity::yes);
static_assert(scal([](auto x, auto y) { return k::mse_loss(x, y) + k::var(y); }) == Scalarity::yes);
static_assert(scal([](auto x, auto) { return k::sum(x, 1); }) == Scalarity::maybe);
static_assert(scal([](auto x, auto) { return k::sum(k::mean(x, 0)) + k::logsumexp(x, 0); }) == Scalarity::maybe);
static_assert(scal([](auto x, auto) { return x * 2.0f; }) == Scalarity::no);
static_assert(scal([](auto x, auto y) { return k::sum(x) * y; }) == Scalarity::no);
static_assert(scal([](auto x, auto) { return k::expand(k::sum(x), {3}); }) == Scalarity::no);

static_assert(k::detail::arg_use_v<1, value_t<decltype([](auto x, auto t) { return k::cross_entropy(x, t); })>> ==
              k::detail::used_as_index);
static_assert(k::detail::arg_use_v<0, value_t<decltype([](auto x, auto t) { return k::cross_entropy(x, t); })>> ==
              k::detail::used_as_value);
static_assert(k::detail::arg_use_v<1, value_t<decltype([](auto x, auto) { return k::sum(x); })>> == 0);

TEST_CASE("gradcheck: reports the worst element when gradients disagree") {
  // relu at exactly 0: the derived gradient is 0, the central difference 0.5.
  auto r = k::testing::gradcheck([](auto a) { return k::relu(a); }, values({2, 2}, {1, -1, 0, 2}));
  CHECK_FALSE(r);
  CHECK(r.arg == 0);
  CHECK(r.index == 2);
  CHECK(r.analytic == 0);
  CHECK(std::abs(r.numeric) > 0.1);  // 0.5 times the random cotangent of that element
  std::ostringstream os;
  os << r;
  MESSAGE(os.str());
  CHECK(os.str().find("argument 0 [2, 2] at [1, 0]") != std::string::npos);
}

// ---- through k::compile: the fused CPU kernels against the oracle's evaluation of the same graph ----
namespace {
template <class G, class... T>
void check_compiled(const G& fn, const T&... ts) {
  auto compiled = k::compile(fn)(ts...);
  std::vector<k::Tensor> got;
  if constexpr (std::is_same_v<decltype(compiled), k::Tensor>)
    got.push_back(compiled);
  else
    std::apply([&](const auto&... t) { (got.push_back(t), ...); }, compiled);
  Traced t = trace_gradient_fn(fn, ts...);
  auto want = k::reference::eval_graph(k::detail::transform_graph(fn, t.g), t.args, t.scalars);
  REQUIRE(got.size() == want.size());
  for (std::size_t o = 0; o < got.size(); ++o) {
    auto g = k::reference::read(got[o]);
    REQUIRE(g.shape == want[o].shape);
    for (std::size_t i = 0; i < g.data.size(); ++i)
      CHECK(g.data[i] == doctest::Approx(want[o].data[i]).epsilon(1e-4).scale(1e-3));
  }
}
}  // namespace

TEST_CASE("autodiff: gradient functions run through k::compile on the CPU") {
  const k::Tensor x = uniform({4, 6}, 50, -2, 2, k::f32), w = uniform({5, 6}, 51, -1, 1, k::f32),
                  b = uniform({5}, 52, -1, 1, k::f32);
  const k::Tensor t = values({4}, {0, 4, 2, 2}, k::i64), ct = uniform({4, 5}, 53, -1, 1, k::f32);
  const k::Tensor g = uniform({6}, 54, 0.5, 1.5, k::f32), beta = uniform({6}, 55, -1, 1, k::f32);
  auto loss = [](auto x, auto g, auto beta, auto w, auto b, auto t) {
    return k::cross_entropy(k::linear(k::gelu(k::layer_norm(x, g, beta)), w, b), t);
  };
  check_compiled(k::value_and_grad(loss, k::wrt<0, 1, 2, 3, 4>), x, g, beta, w, b, t);
  check_compiled(
      k::grad([](auto x) { return k::amax(k::softmax(x, 0)) + k::mean(k::slice(x, 1, 1, 6, 2)); }, k::wrt<0>), x);
  check_compiled(
      k::vjp([](auto x, auto w) { return k::log_softmax(k::matmul(x, k::transpose(w, 0, 1)), 1); }, k::wrt<0, 1>), x, w,
      ct);
  k::Tensor dx = k::grad([](auto x) { return k::sum(k::square(x)); }, k::wrt<0>)(x);  // called directly
  auto xs = k::reference::read(x).data, dxs = k::reference::read(dx).data;
  for (std::size_t i = 0; i < xs.size(); ++i) CHECK(dxs[i] == doctest::Approx(2 * xs[i]));
}
