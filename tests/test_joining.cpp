// k::argmax / k::argmin, k::cat and k::stack (API.md "indexing and joining"): values against
// indices and layouts computed here and against the oracle, PyTorch's tie and NaN rules, no gradient
// through an index, gradients through a cat by gradcheck, typed errors, fusion into the consumer,
// sizes that change between calls; on the CPU and, where there is one, the GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

// argmax (or argmin) of a row-major [R, C] matrix along dim 1, computed here: the first index of
// the extremum, or of the first NaN.
std::vector<std::int64_t> expected_rows(const std::vector<double>& x, std::int64_t R, std::int64_t C, bool max) {
  std::vector<std::int64_t> out;
  for (std::int64_t r = 0; r < R; ++r) {
    std::int64_t best = 0;
    for (std::int64_t c = 1; c < C; ++c) {
      double b = x[r * C + best], v = x[r * C + c];
      if (std::isnan(b)) break;
      if (std::isnan(v) || (max ? v > b : v < b)) best = c;
    }
    out.push_back(best);
  }
  return out;
}

std::vector<std::int64_t> as_i64(const k::Tensor& t) { return k::to_vector<std::int64_t>(t); }

void check_argmax_rows(k::Device dev) {
  const std::int64_t R = 37, C = 129;
  // Small integers as floats: many ties, so "the first index" is exercised; a NaN in row 5.
  std::vector<double> xv(static_cast<std::size_t>(R * C));
  for (std::size_t i = 0; i < xv.size(); ++i) xv[i] = static_cast<double>((i * 7919 + 13) % 11) - 5.0;
  xv[5 * C + 40] = std::numeric_limits<double>::quiet_NaN();
  xv[5 * C + 90] = std::numeric_limits<double>::quiet_NaN();
  k::Tensor x = k::from_vector(xv, {R, C}, k::f32, dev);
  for (bool max : {true, false}) {
    INFO(std::string(max ? "argmax" : "argmin") << " on " << dev);
    k::Tensor got = max ? k::Tensor(k::argmax(x, 1)) : k::Tensor(k::argmin(x, -1));
    CHECK(got.dtype() == k::i64);
    CHECK(got.shape() == std::vector<std::int64_t>{R});
    const auto want = expected_rows(xv, R, C, max);
    CHECK(as_i64(got) == want);
    CHECK(as_i64(got)[5] == 40);  // the first NaN
    k::Tensor kept = max ? k::Tensor(k::argmax(x, 1, true)) : k::Tensor(k::argmin(x, 1, true));
    CHECK(kept.shape() == std::vector<std::int64_t>{R, 1});
    CHECK(as_i64(kept) == want);
  }
  // Along dim 0 of a transposed view, and of 16-bit and integer inputs, against the oracle.
  k::Tensor y = k::randn({19, 33}, k::f32, dev, 3);
  auto yt = k::transpose(y, 0, 1);
  CHECK(as_i64(k::Tensor(k::argmax(yt, 0))) == as_i64(k::reference::eval(k::argmax(yt, 0))));
  k::Tensor h = y.to(k::bf16);
  CHECK(as_i64(k::Tensor(k::argmin(h, 0, true))) == as_i64(k::reference::eval(k::argmin(h, 0, true))));
  k::Tensor ints = k::cast(y * 3.0f, k::i32);
  CHECK(as_i64(k::Tensor(k::argmax(ints, 1))) == as_i64(k::reference::eval(k::argmax(ints, 1))));
}

// [A, B, C] row-major tensors joined along `dim` (0..2), computed here.
std::vector<double> joined(const std::vector<std::vector<double>>& parts, const std::vector<k::Dims>& shapes, int dim) {
  std::vector<double> out;
  const k::Dims& s0 = shapes[0];
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= s0[i];
  for (int i = dim + 1; i < s0.size(); ++i) inner *= s0[i];
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::size_t p = 0; p < parts.size(); ++p) {
      const std::int64_t block = shapes[p][dim] * inner;
      for (std::int64_t j = 0; j < block; ++j) out.push_back(parts[p][static_cast<std::size_t>(o * block + j)]);
    }
  return out;
}

void check_cat(k::Device dev) {
  for (int dim : {0, 1, 2}) {
    INFO("cat along " << dim << " on " << dev);
    k::Dims sa{5, 7, 9}, sb{5, 7, 9}, sc{5, 7, 9};
    sa[dim] = 3, sb[dim] = 1, sc[dim] = 6;
    k::Tensor a = k::randn(sa, k::f32, dev, 1), b = k::randn(sb, k::f32, dev, 2), c = k::randn(sc, k::f32, dev, 3);
    k::Tensor got = k::cat(dim, a, b, c);
    k::Dims want_shape = sa;
    want_shape[dim] = 10;
    CHECK(got.shape() == want_shape);
    CHECK(values(got) == joined({values(a), values(b), values(c)}, {sa, sb, sc}, dim));
    // A negative dim, and a consumer fused with the cat into one kernel.
    auto fused = k::cat(dim - 3, a, b, c) * 2.0f + 1.0f;
    auto r = k::testing::allclose(k::Tensor(fused), k::reference::eval(fused), 1e-6, 1e-6);
    CHECK_MESSAGE(bool(r), r);
    CHECK(k::explain(fused).kernels.size() == 1);
  }
  // Mixed dtypes promote as arithmetic does: f32 with bf16 is f32, i32 with i64 is i64.
  k::Tensor f = k::randn({4, 3}, k::f32, dev, 4), h = k::randn({4, 5}, k::bf16, dev, 5);
  k::Tensor fh = k::cat(1, f, h);
  CHECK(fh.dtype() == k::f32);
  auto r = k::testing::allclose(fh, k::reference::eval(k::cat(1, f, h)), 0, 0);
  CHECK_MESSAGE(bool(r), r);
  k::Tensor i = k::cast(f * 10.0f, k::i32), j = k::cast(f * 100.0f, k::i64);
  k::Tensor ij = k::cat(0, i, j);
  CHECK(ij.dtype() == k::i64);
  CHECK(values(ij) == values(k::reference::eval(k::cat(0, i, j))));
}

void check_stack(k::Device dev) {
  k::Tensor a = k::randn({6, 5}, k::f32, dev, 7), b = k::randn({6, 5}, k::f32, dev, 8);
  k::Tensor s0 = k::stack(0, a, b), s2 = k::stack(-1, a, b);
  CHECK(s0.shape() == std::vector<std::int64_t>{2, 6, 5});
  CHECK(s2.shape() == std::vector<std::int64_t>{6, 5, 2});
  std::vector<double> want0 = values(a), bv = values(b);
  want0.insert(want0.end(), bv.begin(), bv.end());
  CHECK(values(s0) == want0);
  std::vector<double> want2;
  const auto av = values(a);
  for (std::size_t e = 0; e < av.size(); ++e) want2.push_back(av[e]), want2.push_back(bv[e]);
  CHECK(values(s2) == want2);
}

}  // namespace

TEST_CASE("argmax/argmin: first index of the extremum, NaN first, keepdim, views, dtypes (cpu)") {
  check_argmax_rows(k::cpu);
}
TEST_CASE("argmax/argmin: first index of the extremum, NaN first, keepdim, views, dtypes (cuda)" * needs_gpu()) {
  check_argmax_rows(k::cuda);
}

TEST_CASE("argmax: over a dim of size 0 is a shape_error naming the op; a bad dim too; a 0-d tensor") {
  k::Tensor e = k::empty({3, 0}, k::f32, k::cpu);
  CHECK_THROWS_AS(k::Tensor(k::argmax(e, 1)), k::shape_error);
  try {
    k::Tensor t = k::argmin(e, 1);
  } catch (const k::shape_error& err) {
    CHECK(std::string(err.what()).find("argmin") != std::string::npos);
    CHECK(std::string(err.what()).find("[3, 0]") != std::string::npos);
  }
  CHECK_THROWS_AS(k::Tensor(k::argmax(k::randn({3, 4}, k::f32, k::cpu, 1), 2)), k::shape_error);
  // A 0-d tensor's index is 0 (as PyTorch), fused and in the oracle.
  k::Tensor s = k::full({}, 3.0, k::f32, k::cpu);
  k::Tensor i = k::argmax(s, 0);
  CHECK(i.shape() == std::vector<std::int64_t>{});
  CHECK(as_i64(i) == std::vector<std::int64_t>{0});
  CHECK(as_i64(k::reference::eval(k::argmin(s, -1, true))) == std::vector<std::int64_t>{0});
}

TEST_CASE("argmax: no gradient flows through the index; inside a compiled function") {
  k::Tensor x = k::randn({7, 11}, k::f64, k::cpu, 9);
  // d/dx sum(x * argmax(x)) is argmax(x) itself: the index is a constant for the derivative.
  auto fn = [](auto a) { return k::sum(a * k::cast(k::argmax(a, 1, true), k::f64)); };
  auto g = k::compile(k::grad(fn, k::wrt<0>));
  k::Tensor want = k::expand(k::cast(k::argmax(x, 1, true), k::f64), {7, 11});
  auto r = k::testing::allclose(g(x), want, 0, 0);
  CHECK_MESSAGE(bool(r), r);
  CHECK(k::testing::gradcheck(fn, x));
  // A compiled argmax over rows whose length changes between calls.
  auto f = k::compile([](auto a) { return k::argmax(a, -1); });
  for (std::int64_t cols : {13, 29, 7}) {
    k::Tensor y = k::randn({5, cols}, k::f32, k::cpu, static_cast<std::uint64_t>(cols));
    CHECK(as_i64(f(y)) == as_i64(k::reference::eval(k::argmax(y, -1))));
  }
}

TEST_CASE("cat: along each dim, three operands, fused with its consumer, promoted dtypes (cpu)") { check_cat(k::cpu); }
TEST_CASE("cat: along each dim, three operands, fused with its consumer, promoted dtypes (cuda)" * needs_gpu()) {
  check_cat(k::cuda);
}
TEST_CASE("stack: along a new first and last dim (cpu)") { check_stack(k::cpu); }
TEST_CASE("stack: along a new first and last dim (cuda)" * needs_gpu()) { check_stack(k::cuda); }

TEST_CASE("cat: gradients reach every operand (gradcheck), in a compiled function whose sizes change") {
  k::Tensor a = k::randn({3, 4}, k::f64, k::cpu, 11), b = k::randn({3, 2}, k::f64, k::cpu, 12);
  k::Tensor w = k::randn({3, 6}, k::f64, k::cpu, 13);
  auto fn = [](auto x, auto y, auto v) { return k::sum(k::tanh(k::cat(1, x, y)) * v); };
  CHECK(k::testing::gradcheck(fn, a, b, w));
  auto st = [](auto x, auto y) { return k::sum(k::square(k::stack(0, x, y * 2.0))); };
  CHECK(k::testing::gradcheck(st, a, k::randn({3, 4}, k::f64, k::cpu, 14)));
  // The joined sizes change between calls. (Each joined size compiles its own program for now: a
  // cat is lowered with the sizes of its call, and a program for others fails its re-inference.)
  auto f = k::compile([](auto x, auto y) { return k::cat(0, x, y) + 1.0f; });
  for (std::int64_t n : {4, 9, 2, 17}) {
    k::Tensor x = k::randn({n, 5}, k::f32, k::cpu, static_cast<std::uint64_t>(n));
    k::Tensor y = k::randn({n + 3, 5}, k::f32, k::cpu, static_cast<std::uint64_t>(n + 1));
    auto r = k::testing::allclose(f(x, y), k::reference::eval(k::cat(0, x, y) + 1.0f), 1e-6, 1e-6);
    CHECK_MESSAGE(bool(r), r);
  }
}

TEST_CASE("cat: operands that differ outside the joined dim, or in rank, are shape_errors naming both") {
  k::Tensor a = k::randn({3, 4}, k::f32, k::cpu, 1), b = k::randn({2, 5}, k::f32, k::cpu, 2);
  try {
    k::Tensor t = k::cat(1, a, b);
    FAIL("no error");
  } catch (const k::shape_error& e) {
    std::string m = e.what();
    CHECK(m.find("cat") != std::string::npos);
    CHECK(m.find("[3, 4]") != std::string::npos);
    CHECK(m.find("[2, 5]") != std::string::npos);
  }
  CHECK_THROWS_AS(k::Tensor(k::cat(0, a, k::randn({4}, k::f32, k::cpu, 3))), k::shape_error);
  CHECK_THROWS_AS(k::Tensor(k::cat(2, a, a)), k::shape_error);
  k::Tensor out = k::full({6, 4}, 3.0, k::f32, k::cpu);
  CHECK_THROWS_AS(k::eval(out, k::cat(0, a, b)), k::shape_error);
  CHECK(values(out) == std::vector<double>(24, 3.0));  // a failed evaluation leaves out untouched
}
