// Expressions and what the stages before codegen make of them: Tensor and Dims basics, the f16/bf16
// storage types, building and flattening expressions, shape and dtype inference with PyTorch's
// promotion rules, and the typed errors that bad graphs raise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <kiln/core/factories.hpp>
#include <kiln/core/tensor.hpp>
#include <kiln/expr/ops.hpp>
#include <kiln/graph/flatten.hpp>
#include <kiln/graph/infer.hpp>

namespace {

namespace k = kiln;
using k::Dims;
using k::Tensor;

float bitsf(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
std::uint16_t h(float f) { return k::half(f).bits; }
std::uint16_t bf(float f) { return k::bfloat16(f).bits; }
float from_h(std::uint16_t b) {
  k::half x;
  x.bits = b;
  return float(x);
}
float from_bf(std::uint16_t b) {
  k::bfloat16 x;
  x.bits = b;
  return float(x);
}

// Shape and dtype of an expression's root, after flatten + gather + infer_shapes.
struct Inferred {
  k::dtype dt;
  Dims shape;
  k::graph::Graph g;
};
template <class E>
Inferred infer(const E& e) {
  k::graph::Graph g = k::graph::flatten(e);
  k::graph::Captured cap;
  k::graph::gather(e, cap);
  std::vector<Tensor> args;
  for (int i = 0; i < cap.nt; ++i) args.push_back(*cap.tensors[static_cast<std::size_t>(i)]);
  k::graph::infer_shapes(g, [&](int s) -> const Tensor& { return args.at(static_cast<std::size_t>(s)); });
  const auto& root = g[g.outputs.at(0)];
  return {root.dt, root.shape, g};
}

Tensor T(const Dims& shape, k::dtype dt = k::f32) { return Tensor::empty(shape, dt, k::cpu); }

// The message of the exception of type Err that f throws ("" if it throws nothing or another type).
template <class Err, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Err& e) {
    return e.what();
  } catch (...) {
    return "<another exception>";
  }
  return "<no exception>";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// ---- Tensor and Dims --------------------------------------------------------------------------------

TEST_CASE("expr: Tensor basics") {
  Tensor t = Tensor::empty({37, 129}, k::f32, k::cpu);
  CHECK(t.defined());
  CHECK(t.shape() == std::vector<std::int64_t>{37, 129});
  CHECK(t.strides() == std::vector<std::int64_t>{129, 1});
  std::vector<std::int64_t> sv = t.shape();  // converts
  CHECK(sv.size() == 2);
  CHECK(t.numel() == 37 * 129);
  CHECK(t.dim() == 2);
  CHECK(t.dtype() == k::f32);
  CHECK(t.device() == k::cpu);
  CHECK(t.nbytes() == 37 * 129 * 4);
  CHECK(t.is_contiguous());
  CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 64 == 0);

  // Writing through data_ptr and reading back.
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-3, 3);
  std::vector<float> want(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < want.size(); ++i) static_cast<float*>(t.data_ptr())[i] = want[i] = u(gen);
  CHECK(k::load_as_double(t.data_ptr(), k::f32, 1234) == double(want[1234]));

  // Views share storage; a transposed view is not contiguous; offsets move data_ptr.
  Tensor tr = t.as_strided({129, 37}, {1, 129}, 0);
  CHECK_FALSE(tr.is_contiguous());
  CHECK(tr.storage() == t.storage());
  CHECK(tr.shape() == std::vector<std::int64_t>{129, 37});
  Tensor row = t.as_strided({129}, {1}, 129 * 5);
  CHECK(row.is_contiguous());
  CHECK(static_cast<float*>(row.data_ptr())[3] == want[5 * 129 + 3]);
  // Size-1 dims do not affect contiguity; zero-size tensors are contiguous.
  CHECK(t.as_strided({37, 1, 129}, {129, 999, 1}, 0).is_contiguous());
  CHECK(Tensor::empty({2, 0}, k::f32, k::cpu).is_contiguous());
  CHECK(Tensor::empty({0, 3}, k::f16, k::cpu).numel() == 0);
  Tensor s = Tensor::empty({}, k::f64, k::cpu);
  CHECK(s.dim() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.is_contiguous());

  // wrap: views caller memory, never frees it.
  std::vector<std::int32_t> buf{1, 2, 3, 4, 5, 6};
  Tensor w = Tensor::wrap(buf.data(), {2, 3}, k::i32);
  CHECK(w.data_ptr() == buf.data());
  CHECK(w.strides() == std::vector<std::int64_t>{3, 1});
  Tensor wt = Tensor::wrap(buf.data(), {3, 2}, k::i32, k::cpu, {1, 3});
  CHECK_FALSE(wt.is_contiguous());
  CHECK(wt.strides() == std::vector<std::int64_t>{1, 3});
  CHECK_THROWS_AS(Tensor::wrap(buf.data(), {2, 3}, k::i32, k::cpu, {1}), k::shape_error);
  { Tensor copy = w; }
  CHECK(buf[5] == 6);  // still ours
  CHECK(has(w.str(), "[2, 3]"));
  CHECK(has(w.str(), "i32"));
}

TEST_CASE("expr: Dims") {
  Dims d{2, 3, 4};
  CHECK(d.size() == 3);
  CHECK(d.product() == 24);
  CHECK(d == std::vector<std::int64_t>{2, 3, 4});
  CHECK(d.str() == "[2, 3, 4]");
  d.insert(1, 7);
  CHECK(d == Dims{2, 7, 3, 4});
  d.erase(0);
  CHECK(d == Dims{7, 3, 4});
  CHECK(Dims{}.product() == 1);
  CHECK(k::contiguous_strides({5, 1, 3}) == Dims{3, 3, 1});
  CHECK(k::contiguous_strides({}) == Dims{});
  CHECK_THROWS_AS(Dims({1, 1, 1, 1, 1, 1, 1, 1, 1}), k::shape_error);
  CHECK(k::normalize_dim(-1, 3, "t") == 2);
  CHECK(k::normalize_dim(0, 0, "t") == 0);
  std::string msg = error_of<k::shape_error>([] { k::normalize_dim(3, 3, "sum"); });
  CHECK(has(msg, "sum"));
  CHECK(has(msg, "dimension 3"));
  CHECK(has(msg, "rank 3"));
  CHECK(k::broadcast_shapes({5, 1, 3}, {4, 3}, "add") == Dims{5, 4, 3});
  CHECK(k::broadcast_shapes({}, {2, 0}, "add") == Dims{2, 0});
  CHECK(k::broadcast_shapes({1}, {0}, "add") == Dims{0});
}

// ---- 16-bit floats ------------------------------------------------------------------------------------

TEST_CASE("expr: half rounds to nearest even, overflows to inf, handles subnormals and NaN") {
  CHECK(h(1.0f) == 0x3C00);
  CHECK(h(-2.0f) == 0xC000);
  CHECK(h(0.0f) == 0x0000);
  CHECK(h(-0.0f) == 0x8000);
  CHECK(h(65504.0f) == 0x7BFF);  // largest finite
  CHECK(h(65519.99f) == 0x7BFF);
  CHECK(h(65520.0f) == 0x7C00);  // the tie above 65504 rounds to even: infinity
  CHECK(h(1e6f) == 0x7C00);
  CHECK(h(-1e6f) == 0xFC00);
  CHECK(h(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK(h(-std::numeric_limits<float>::infinity()) == 0xFC00);
  // Ties to even: 1 + 2^-11 is halfway between 1 and 1 + 2^-10.
  CHECK(h(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);
  CHECK(h(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);
  CHECK(h(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)) == 0x3C01);  // just above the tie
  CHECK(h(2049.0f) == h(2048.0f));                                           // integers above 2048 are even
  CHECK(h(2051.0f) == h(2052.0f));
  // Subnormals: 2^-24 is the smallest; ties round to even there too.
  CHECK(h(std::ldexp(1.0f, -14)) == 0x0400);                          // smallest normal
  CHECK(h(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -24)) == 0x03FF);  // largest subnormal
  CHECK(h(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(h(std::ldexp(1.0f, -25)) == 0x0000);      // tie between 0 and 2^-24: even is 0
  CHECK(h(3 * std::ldexp(1.0f, -25)) == 0x0002);  // tie between 1 and 2 ulps: even is 2
  CHECK(h(std::ldexp(1.0f, -25) * 1.01f) == 0x0001);
  CHECK(h(-std::ldexp(1.0f, -24)) == 0x8001);
  CHECK(h(1e-10f) == 0x0000);
  CHECK(from_h(0x0001) == std::ldexp(1.0f, -24));
  CHECK(from_h(0x03FF) == std::ldexp(1023.0f, -24));
  CHECK(from_h(0x7BFF) == 65504.0f);
  CHECK(std::isinf(from_h(0x7C00)));
  // NaN stays NaN (quiet), both ways.
  float qn = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(float(k::half(qn))));
  CHECK(std::isnan(float(k::half(-qn))));
  CHECK(std::isnan(float(k::half(bitsf(0x7F800001u)))));  // a signalling NaN with a low payload
  CHECK(std::isnan(from_h(0x7E00)));

  // Every half converts to float and back to itself.
  int bad = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    float f = from_h(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    bad += h(f) != b;
  }
  CHECK(bad == 0);
  // Random floats round to the nearest half (ties to even), checked against the neighbours.
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  std::uniform_int_distribution<int> ex(-26, 16);
  bad = 0;
  for (int i = 0; i < 200000; ++i) {
    float f = i % 2 ? u(gen) : std::ldexp(u(gen) / 70000.0f, ex(gen));
    std::uint16_t r = h(f);
    double got = from_h(r);
    if (std::isinf(got)) {
      bad += std::abs(f) < 65520.0f;
      continue;
    }
    double err = std::abs(got - double(f));
    for (int dlt : {-1, 1}) {
      std::uint16_t nb = static_cast<std::uint16_t>((r & 0x7FFF) + dlt);
      if ((r & 0x7FFF) == 0 && dlt < 0) continue;
      if (nb >= 0x7C00) continue;
      double other = from_h(static_cast<std::uint16_t>(nb | (r & 0x8000)));
      double oerr = std::abs(other - double(f));
      if (oerr < err || (oerr == err && (r & 1))) ++bad;
    }
  }
  CHECK(bad == 0);
}

TEST_CASE("expr: bfloat16 rounds to nearest even, overflows to inf, keeps NaN") {
  CHECK(bf(1.0f) == 0x3F80);
  CHECK(bf(-1.0f) == 0xBF80);
  CHECK(bf(bitsf(0x3F808000u)) == 0x3F80);  // tie, even below
  CHECK(bf(bitsf(0x3F818000u)) == 0x3F82);  // tie, even above
  CHECK(bf(bitsf(0x3F808001u)) == 0x3F81);  // above the tie
  CHECK(bf(bitsf(0x3F807FFFu)) == 0x3F80);
  CHECK(bf(std::numeric_limits<float>::max()) == 0x7F80);  // overflows to inf
  CHECK(bf(bitsf(0x7F7F7FFFu)) == 0x7F7F);                 // the largest finite stays finite
  CHECK(bf(std::numeric_limits<float>::infinity()) == 0x7F80);
  CHECK(bf(-std::numeric_limits<float>::infinity()) == 0xFF80);
  CHECK(bf(bitsf(0x00018000u)) == 0x0002);  // subnormal tie: even
  CHECK(bf(bitsf(0x00008000u)) == 0x0000);
  CHECK(bf(bitsf(0x00010000u)) == 0x0001);
  CHECK(bf(-0.0f) == 0x8000);
  float qn = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(float(k::bfloat16(qn))));
  CHECK(std::isnan(float(k::bfloat16(bitsf(0x7F800001u)))));  // payload only in the low bits: must not become inf
  CHECK(std::isnan(float(k::bfloat16(bitsf(0xFFFFFFFFu)))));  // all-ones must not carry into the sign
  CHECK(from_bf(0x4049) == 3.140625f);
  int bad = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    float f = from_bf(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    bad += bf(f) != b;
  }
  CHECK(bad == 0);
  // Random floats: the result is one of the two truncation neighbours, the nearer (ties even).
  std::mt19937 gen(12);
  std::uniform_int_distribution<std::uint32_t> ub(0, 0x7F7FFFFFu);
  bad = 0;
  for (int i = 0; i < 200000; ++i) {
    std::uint32_t x = ub(gen);
    double f = bitsf(x);
    std::uint16_t r = bf(bitsf(x));
    double lo = from_bf(static_cast<std::uint16_t>(x >> 16)), hi = from_bf(static_cast<std::uint16_t>((x >> 16) + 1));
    if (std::isinf(hi)) hi = std::ldexp(1.0, 128);  // as if the exponent were unbounded (IEEE rounding)
    double got = from_bf(r);
    double dlo = f - lo, dhi = hi - f;
    double want = dlo < dhi ? lo : dhi < dlo ? hi : (((x >> 16) & 1) ? hi : lo);
    if (want == std::ldexp(1.0, 128)) want = std::numeric_limits<double>::infinity();  // then overflows
    bad += got != want;
  }
  CHECK(bad == 0);
}

TEST_CASE("expr: load_as_double / store_from_double round once per dtype") {
  alignas(8) unsigned char buf[64];
  k::store_from_double(buf, k::f16, 0, 1.0 + std::ldexp(1.0, -11));
  CHECK(k::load_as_double(buf, k::f16, 0) == 1.0);
  k::store_from_double(buf, k::bf16, 1, 1.0 / 3);
  CHECK(k::load_as_double(buf, k::bf16, 1) == 0.333984375);
  k::store_from_double(buf, k::f32, 1, 0.1);
  CHECK(k::load_as_double(buf, k::f32, 1) == double(0.1f));
  k::store_from_double(buf, k::i32, 2, -7.9);
  CHECK(k::load_as_double(buf, k::i32, 2) == -7);
  k::store_from_double(buf, k::i64, 1, 3e12);
  CHECK(k::load_as_double(buf, k::i64, 1) == 3e12);
  k::store_from_double(buf, k::boolean, 3, 0.5);
  CHECK(k::load_as_double(buf, k::boolean, 3) == 1);
  CHECK(k::itemsize(k::bf16) == 2);
  CHECK(k::name(k::boolean) == "boolean");
}

TEST_CASE("expr: factories fill large tensors in parts, each element as if alone") {
  const std::int64_t n = (std::int64_t{1} << 20) + 37;  // parts of at least 2^18 elements where there are cores
  const std::vector<std::int64_t> idx = k::to_vector<std::int64_t>(k::arange(n));
  bool every = true;  // every element written once, by its own index
  for (std::int64_t i = 0; i < n; ++i) every = every && idx[static_cast<std::size_t>(i)] == i;
  CHECK(every);
  // randn: element i depends on (seed, i) alone. The first values match a small tensor's (one
  // part), the last ones a one-element tensor's at each index (Box-Muller of the test's own
  // uniforms); the bf16 tensor is the f64 one rounded as store_from_double rounds (through f32);
  // the values are standard normal throughout.
  const std::vector<double> big = k::to_vector<double>(k::randn({n}, k::f64, k::cpu, 11));
  const std::vector<double> small = k::to_vector<double>(k::randn({1000}, k::f64, k::cpu, 11));
  CHECK(std::equal(small.begin(), small.end(), big.begin()));
  for (std::int64_t i : {n - 1, n - 2, n / 2 + 1, 3 * n / 4}) {
    const double u1 = k::detail::uniform(11, static_cast<std::uint64_t>(i), 1),
                 u2 = k::detail::uniform(11, static_cast<std::uint64_t>(i), 2);
    CHECK(big[static_cast<std::size_t>(i)] == std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  const std::vector<float> half16 = k::to_vector<float>(k::randn({n}, k::bf16, k::cpu, 11));
  bool rounded = true;
  double sum = 0, squares = 0;
  for (std::size_t i = 0; i < big.size(); ++i) {
    rounded = rounded && half16[i] == static_cast<float>(k::bfloat16(static_cast<float>(big[i])));
    sum += big[i], squares += big[i] * big[i];
  }
  CHECK(rounded);
  const double mean = sum / double(n);
  CHECK(std::abs(mean) < 0.01);
  CHECK(std::abs(squares / double(n) - mean * mean - 1) < 0.01);
  const std::vector<float> sevens = k::to_vector<float>(k::full({n}, 7.25, k::f16));
  CHECK(std::all_of(sevens.begin(), sevens.end(), [](float v) { return v == 7.25f; }));
}

// ---- building and flattening ---------------------------------------------------------------------------

TEST_CASE("expr: expressions are lazy nodes whose type is the graph") {
  Tensor x = T({4, 8}), w = T({8});
  auto e = k::relu(x * w + 1.5f);
  using E = decltype(e);
  static_assert(E::op == k::Op::relu);
  static_assert(k::Expr<E>);
  static_assert(!k::Expr<Tensor>);
  static_assert(k::Operand<Tensor> && k::Operand<double>);
  static_assert(std::is_same_v<std::tuple_element_t<1, std::remove_cvref_t<decltype(std::get<0>(e.in()).in())>>,
                               k::expr::Scalar<true>>);
  static_assert(std::is_same_v<decltype(x < 2), k::expr::Node<k::Op::lt, k::expr::TensorLeaf, k::expr::Scalar<false>>>);
  // Scalars are values in the object, never in the type.
  static_assert(std::is_same_v<decltype(x * 2.0), decltype(x * 3.0)>);
  CHECK(std::get<1>(std::get<0>(e.in()).in()).v == 1.5);
  // Attributes live in the object too.
  auto s1 = k::sum(x, 1, true);
  auto s2 = k::sum(x, {0, 1});
  static_assert(std::is_same_v<decltype(s1), decltype(s2)>);
  CHECK(s1.attrs().dims == Dims{1});
  CHECK(s1.attrs().keepdim);
  CHECK(k::sum(x).attrs().all);
  CHECK(k::gelu(x, k::approximate::tanh).attrs().a == 1);
  CHECK(k::slice(x, 1, 2, 7, 2).attrs().d == 2);
  CHECK(k::cast(x, k::bf16).attrs().dt == k::bf16);
}

TEST_CASE("expr: flatten numbers leaves, dedups subexpressions, never merges scalars") {
  Tensor x = T({4, 8}), y = T({8});
  auto e = k::exp(x) * y + k::exp(x);
  k::graph::Graph g = k::graph::flatten(e);
  // x, exp, y, mul, x (a second eager leaf: distinct argument), exp(second x), add
  CHECK(g.num_args == 3);
  CHECK(g.num_scalars == 0);
  CHECK(g.outputs.size() == 1);
  CHECK(g.count_ops() == 4);
  // Placeholder arguments are shared by index, so their subexpressions are deduplicated.
  k::expr::Arg<0> a{};
  auto f = k::exp(a) * 2.0 + k::exp(a) * 2.0;
  k::graph::Graph gf = k::graph::flatten(f);
  CHECK(gf.num_args == 1);
  CHECK(gf.num_scalars == 2);  // two scalar slots, even with equal values
  int exps = 0, muls = 0;
  for (auto& n : gf.nodes) {
    exps += n.op == k::Op::exp;
    muls += n.op == k::Op::mul;
  }
  CHECK(exps == 1);
  CHECK(muls == 2);
  // Several outputs in one graph; eager leaves after the largest placeholder index.
  k::expr::Arg<1> b{};
  k::graph::Graph g2 = k::graph::flatten(a + x, b * y);
  CHECK(g2.outputs.size() == 2);
  CHECK(g2.num_args == 4);
  // gather() collects the per-call values in flatten order.
  auto h = (x + 2.5) * (y - 7);
  k::graph::Captured cap;
  k::graph::gather(h, cap);
  CHECK(cap.nt == 2);
  CHECK(cap.tensors[0] == &std::get<0>(std::get<0>(h.in()).in()).t);
  CHECK(cap.ns == 2);
  CHECK(cap.scalars[0] == 2.5);
  CHECK(cap.scalars[1] == 7);
  // The printout names ops, shapes and dtypes after inference.
  Inferred inf = infer(k::sum(k::softmax(x, -1), 1));
  std::string s = inf.g.str();
  CHECK(has(s, "softmax"));
  CHECK(has(s, "f32[4, 8]"));
  CHECK(has(s, "f32[4]"));
}

// ---- dtype promotion -----------------------------------------------------------------------------------

TEST_CASE("expr: dtype promotion follows PyTorch") {
  Tensor f64 = T({3}, k::f64), f32 = T({3}, k::f32), f16 = T({3}, k::f16), bf16 = T({3}, k::bf16);
  Tensor i64 = T({3}, k::i64), i32 = T({3}, k::i32), b = T({3}, k::boolean);
  CHECK(infer(f16 + bf16).dt == k::f32);
  CHECK(infer(bf16 * f16).dt == k::f32);
  CHECK(infer(i32 + i64).dt == k::i64);
  CHECK(infer(i32 * 2.5).dt == k::f32);
  CHECK(infer(i64 * 2.5f).dt == k::f32);
  CHECK(infer(b + 1).dt == k::i64);
  CHECK(infer(b + 1.5).dt == k::f32);
  CHECK(infer(b + b).dt == k::boolean);
  CHECK(infer(f16 * 2.0).dt == k::f16);
  CHECK(infer(bf16 - 1).dt == k::bf16);
  CHECK(infer(f32 * 2.0).dt == k::f32);  // a double scalar does not widen a tensor
  CHECK(infer(i32 * 2).dt == k::i32);
  CHECK(infer(i32 * std::int64_t{2}).dt == k::i32);
  CHECK(infer(f32 + f64).dt == k::f64);
  CHECK(infer(f16 + f32).dt == k::f32);
  CHECK(infer(i64 + f16).dt == k::f16);
  CHECK(infer(b * bf16).dt == k::bf16);
  CHECK(infer(f32 < f64).dt == k::boolean);
  CHECK(infer(i32 == 3).dt == k::boolean);
  CHECK(infer(f16 >= 0.5).dt == k::boolean);
  CHECK(infer(i32 / i32).dt == k::f32);
  CHECK(infer(i64 / 2).dt == k::f32);
  CHECK(infer(f16 / i32).dt == k::f16);
  CHECK(infer(k::sum(i32)).dt == k::i64);
  CHECK(infer(k::sum(b, 0)).dt == k::i64);
  CHECK(infer(k::sum(f16)).dt == k::f16);
  CHECK(infer(k::amax(i32)).dt == k::i32);
  CHECK(infer(k::mean(i64)).dt == k::f32);
  CHECK(infer(k::var(i32)).dt == k::f32);
  CHECK(infer(k::mean(bf16)).dt == k::bf16);
  CHECK(infer(k::exp(i32)).dt == k::f32);
  CHECK(infer(k::sqrt(b)).dt == k::f32);
  CHECK(infer(k::sigmoid(f16)).dt == k::f16);
  CHECK(infer(k::relu(i32)).dt == k::i32);
  CHECK(infer(k::abs(i64)).dt == k::i64);
  CHECK(infer(-i32).dt == k::i32);
  CHECK(infer(k::logical_not(f32)).dt == k::boolean);
  CHECK(infer(k::cast(f32, k::bf16)).dt == k::bf16);
  CHECK(infer(k::where(f32 > 0, i32, f16)).dt == k::f16);
  CHECK(infer(k::where(f32 > 0, i32, 2.5)).dt == k::f32);
  CHECK(infer(k::where(f32 > 0, i32, i64)).dt == k::i64);
  CHECK(infer(k::maximum(i32, f16)).dt == k::f16);
  CHECK(infer(k::clamp(i32, 0, 5)).dt == k::i32);
  CHECK(infer(k::clamp(i32, 0.5, 5)).dt == k::f32);
  CHECK(infer(k::clamp(f16, 0.5, 5)).dt == k::f16);
  CHECK(infer(k::pow(i32, 2)).dt == k::i32);
  CHECK(infer(k::pow(i32, 0.5)).dt == k::f32);
  CHECK(infer(k::softmax(i64, 0)).dt == k::f32);
  CHECK(infer(k::gelu(f16)).dt == k::f16);
  CHECK(infer(k::mse_loss(i32, i32)).dt == k::f32);
  CHECK(infer(k::mse_loss(f16, bf16)).dt == k::f32);
  Tensor m16 = T({2, 3}, k::f16), n16 = T({3, 4}, k::f16), nbf = T({3, 4}, k::bf16);
  CHECK(infer(k::matmul(m16, n16)).dt == k::f16);
  CHECK(infer(k::matmul(m16, nbf)).dt == k::f32);
  Tensor lg = T({4, 5}, k::bf16), tg = T({4}, k::i64);
  CHECK(infer(k::cross_entropy(lg, tg)).dt == k::bf16);
}

TEST_CASE("expr: shape inference") {
  CHECK(infer(T({5, 1, 3}) + T({4, 3})).shape == Dims{5, 4, 3});
  CHECK(infer(T({}) * T({2, 3})).shape == Dims{2, 3});
  CHECK(infer(T({0, 3}) - T({3})).shape == Dims{0, 3});
  CHECK(infer(T({7, 1}) * 2.0).shape == Dims{7, 1});
  CHECK(infer(k::where(T({1, 3}, k::boolean), T({2, 1}), 0.0)).shape == Dims{2, 3});
  Tensor x = T({2, 3, 4});
  CHECK(infer(k::sum(x, 1)).shape == Dims{2, 4});
  CHECK(infer(k::sum(x, {-1, 0}, true)).shape == Dims{1, 3, 1});
  CHECK(infer(k::amax(x)).shape == Dims{});
  CHECK(infer(k::mean(x, {}, true)).shape == Dims{1, 1, 1});
  CHECK(infer(k::var(x, 2)).shape == Dims{2, 3});
  CHECK(infer(k::logsumexp(x, -2, true)).shape == Dims{2, 1, 4});
  CHECK(infer(k::softmax(x, 1)).shape == Dims{2, 3, 4});
  CHECK(infer(k::reshape(x, {4, -1})).shape == Dims{4, 6});
  CHECK(infer(k::reshape(x, {-1})).shape == Dims{24});
  CHECK(infer(k::reshape(T({0, 4}), {2, 0, 5})).shape == Dims{2, 0, 5});
  CHECK(infer(k::reshape(T({0, 4}), {-1, 8})).shape == Dims{0, 8});
  CHECK(infer(k::permute(x, {2, 0, 1})).shape == Dims{4, 2, 3});
  CHECK(infer(k::transpose(x, 0, -1)).shape == Dims{4, 3, 2});
  CHECK(infer(k::slice(x, 2, 1, 4, 2)).shape == Dims{2, 3, 2});
  CHECK(infer(k::slice(x, -1, -3, 100)).shape == Dims{2, 3, 3});
  CHECK(infer(k::slice(x, 1, 2, 1)).shape == Dims{2, 0, 4});
  CHECK(infer(k::expand(T({3, 1}), {5, 3, 7})).shape == Dims{5, 3, 7});
  CHECK(infer(k::expand(T({3, 1}), {-1, 2})).shape == Dims{3, 2});
  CHECK(infer(k::unsqueeze(x, 0)).shape == Dims{1, 2, 3, 4});
  CHECK(infer(k::unsqueeze(x, -1)).shape == Dims{2, 3, 4, 1});
  CHECK(infer(k::squeeze(T({1, 3, 1}))).shape == Dims{3});
  CHECK(infer(k::squeeze(T({1, 3, 1}), -1)).shape == Dims{1, 3});
  CHECK(infer(k::squeeze(T({2, 3}), 0)).shape == Dims{2, 3});
  CHECK(infer(k::matmul(T({5, 7}), T({7, 2}))).shape == Dims{5, 2});
  CHECK(infer(k::matmul(T({3, 5, 7}), T({3, 7, 2}))).shape == Dims{3, 5, 2});
  CHECK(infer(k::matmul(T({3, 5, 7}), T({7, 2}))).shape == Dims{3, 5, 2});
  CHECK(infer(k::linear(T({3, 5, 7}), T({4, 7}), T({4}))).shape == Dims{3, 5, 4});
  CHECK(infer(k::linear(T({5, 7}), T({4, 7}))).shape == Dims{5, 4});
  CHECK(infer(k::layer_norm(x, T({4}), T({4}))).shape == Dims{2, 3, 4});
  CHECK(infer(k::rms_norm(x, T({4}))).shape == Dims{2, 3, 4});
  CHECK(infer(k::cross_entropy(T({6, 9}), T({6}, k::i64))).shape == Dims{});
  CHECK(infer(k::mse_loss(T({5, 1, 3}), T({4, 3}))).shape == Dims{});
  CHECK(infer(k::clamp(T({4, 1}), T({3}), 1.0)).shape == Dims{4, 3});
  CHECK(infer(k::expr::make<k::Op::gather>({}, T({4, 9}), T({4, 2}, k::i64))).shape == Dims{4, 2});
  k::expr::Iota io;
  io.attrs.dims = {3, 5};
  CHECK(infer(io).shape == Dims{3, 5});
  CHECK(infer(io).dt == k::i64);
}

// ---- errors --------------------------------------------------------------------------------------------

TEST_CASE("expr: bad graphs raise typed errors naming the op and the shapes") {
  std::string m = error_of<k::shape_error>([] { infer(T({3, 4}) + T({5})); });
  CHECK(has(m, "add"));
  CHECK(has(m, "[3, 4]"));
  CHECK(has(m, "[5]"));
  m = error_of<k::shape_error>([] { infer(k::where(T({2}, k::boolean), T({3}), T({2}))); });
  CHECK(has(m, "where"));
  CHECK(has(m, "[2]"));
  CHECK(has(m, "[3]"));

  m = error_of<k::shape_error>([] { infer(k::reshape(T({2, 3}), {4, 2})); });
  CHECK(has(m, "reshape"));
  CHECK(has(m, "[2, 3]"));
  CHECK(has(m, "[4, 2]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::reshape(T({2, 3}), {-1, -1})); }), "-1"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::reshape(T({2, 3}), {4, -1})); }), "reshape"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::reshape(T({2, 3}), {-2, -3})); }), "invalid"));
  // -1 next to a 0 could be anything (PyTorch: ambiguous).
  CHECK(has(error_of<k::shape_error>([] { infer(k::reshape(T({0, 4}), {2, 0, -1})); }), "[2, 0, -1]"));

  m = error_of<k::shape_error>([] { infer(k::permute(T({2, 3, 4}), {0, 0, 1})); });
  CHECK(has(m, "permute"));
  CHECK(has(m, "repeats"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::permute(T({2, 3, 4}), {1, 0})); }), "[2, 3, 4]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::permute(T({2, 3}), {2, 0})); }), "rank 2"));

  m = error_of<k::shape_error>([] { infer(k::matmul(T({2, 3}), T({4, 5}))); });
  CHECK(has(m, "matmul"));
  CHECK(has(m, "[2, 3]"));
  CHECK(has(m, "[4, 5]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::matmul(T({2, 3, 4}), T({3, 4, 5}))); }), "matmul"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::matmul(T({4}), T({4, 5}))); }), "[4]"));
  CHECK(has(error_of<k::dtype_error>([] { infer(k::matmul(T({2, 3}, k::i32), T({3, 2}, k::i32))); }), "matmul"));

  m = error_of<k::shape_error>([] { infer(k::layer_norm(T({8, 16}), T({15}), T({16}))); });
  CHECK(has(m, "layer_norm"));
  CHECK(has(m, "[15]"));
  CHECK(has(m, "[8, 16]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::layer_norm(T({8, 16}), T({16}), T({1, 16}))); }), "[1, 16]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::rms_norm(T({8, 16}), T({8}))); }), "rms_norm"));

  m = error_of<k::dtype_error>([] { infer(k::cross_entropy(T({4, 5}), T({4}, k::f32))); });
  CHECK(has(m, "cross_entropy"));
  CHECK(has(m, "f32"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::cross_entropy(T({4, 5}), T({3}, k::i64))); }), "[3]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::cross_entropy(T({4, 5, 2}), T({4}, k::i64))); }), "[4, 5, 2]"));

  m = error_of<k::dtype_error>([] { infer(k::where(T({3}), T({3}), T({3}))); });
  CHECK(has(m, "where"));
  CHECK(has(m, "f32"));
  CHECK(has(error_of<k::dtype_error>([] { infer(k::where(T({3}, k::i32), 1.0, 2.0)); }), "i32"));

  // A dim out of range names the op, the dim and the rank.
  m = error_of<k::shape_error>([] { infer(k::sum(T({2, 3}), 2)); });
  CHECK(has(m, "sum"));
  CHECK(has(m, "dimension 2"));
  CHECK(has(m, "rank 2"));
  m = error_of<k::shape_error>([] { infer(k::softmax(T({2, 3, 4}), -4)); });
  CHECK(has(m, "softmax"));
  CHECK(has(m, "-4"));
  CHECK(has(m, "rank 3"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::transpose(T({2, 3}), 0, 5)); }), "transpose"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::unsqueeze(T({2, 3}), 4)); }), "rank 3"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::squeeze(T({2, 3}), -3)); }), "squeeze"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::slice(T({2, 3}), 3, 0, 1)); }), "slice"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::logsumexp(T({2, 3}), 7)); }), "logsumexp"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::mean(T({2, 3}), {0, -2})); }), "twice"));

  // Other bad arguments.
  CHECK(has(error_of<k::shape_error>([] { infer(k::slice(T({2, 3}), 1, 0, 3, 0)); }), "step"));
  m = error_of<k::shape_error>([] { infer(k::expand(T({3}), {2, 4})); });
  CHECK(has(m, "expand"));
  CHECK(has(m, "[3]"));
  CHECK(has(m, "[2, 4]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::expand(T({2, 3}), {3})); }), "fewer"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::expand(T({3}), {-1, 3})); }), "-1"));
  CHECK(has(error_of<k::dtype_error>([] { infer(-T({3}, k::boolean)); }), "logical_not"));
  m = error_of<k::shape_error>([] { infer(k::amax(T({0, 3}), 0)); });
  CHECK(has(m, "amax"));
  CHECK(has(m, "[0, 3]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::logsumexp(T({3, 0}), 1)); }), "logsumexp"));
  CHECK(has(error_of<k::dtype_error>([] { infer(k::expr::make<k::Op::gather>({}, T({4, 9}), T({4, 2}))); }), "gather"));
  CHECK(has(error_of<k::shape_error>([] {
              infer(k::expr::make<k::Op::gather>({}, T({4, 9}), T({3, 2}, k::i64)));
            }),
            "[3, 2]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::expr::make<k::Op::gather>({}, T({}), T({}, k::i64))); }), "gather"));
  m = error_of<k::shape_error>([] { infer(k::linear(T({5, 7}), T({4, 6}), T({4}))); });
  CHECK(has(m, "linear"));
  CHECK(has(m, "[4, 6]"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::linear(T({5, 7}), T({4, 7}), T({5}))); }), "bias"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::mse_loss(T({5, 3}), T({4}))); }), "mse_loss"));
  CHECK(has(error_of<k::shape_error>([] { infer(k::clamp(T({5, 3}), T({4}), 1.0)); }), "clamp"));
  // Every error is a k::error and a std::runtime_error.
  static_assert(std::is_base_of_v<k::error, k::shape_error> && std::is_base_of_v<k::error, k::dtype_error>);
  static_assert(std::is_base_of_v<std::runtime_error, k::error>);
  CHECK_THROWS_AS(infer(T({3, 4}) * T({4, 3})), k::error);
  CHECK_THROWS_AS(infer(T({3, 4}) * T({4, 3})), std::runtime_error);
}
