// k::assign: in-place updates of a compiled function's arguments, written by the kernel that
// computes them, and the error when a later kernel would read the old value.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

TEST_CASE("assign: several arguments updated in place by one kernel") {
  auto p = k::randn({37, 129}, k::f32, k::cpu, 1), g = k::randn({37, 129}, k::f32, k::cpu, 2);
  auto m = k::randn({37, 129}, k::f32, k::cpu, 3);
  auto p0 = k::to_vector<float>(p), g0 = k::to_vector<float>(g), m0 = k::to_vector<float>(m);
  float lr = 0.1f;
  auto step = k::compile([&](auto p, auto g, auto m) {
    auto m2 = m * 0.9f + g;
    return std::make_tuple(k::assign(p, p - m2 * lr), k::assign(m, m2));
  });
  void* where = p.data_ptr();
  step(p, g, m);
  CHECK(p.data_ptr() == where);  // the same memory, updated
  auto p1 = k::to_vector<float>(p), m1 = k::to_vector<float>(m);
  for (std::size_t i = 0; i < p0.size(); ++i) {
    float mm = m0[i] * 0.9f + g0[i];
    CHECK(m1[i] == doctest::Approx(mm).epsilon(1e-6));
    CHECK(p1[i] == doctest::Approx(p0[i] - mm * lr).epsilon(1e-5));
  }
  lr = 0.0f;  // a captured scalar: new value, no recompile
  step(p, g, m);
  CHECK(k::to_vector<float>(p) == p1);
  CHECK(k::explain(step, p, g, m).kernels.size() == 1);
  CHECK(k::explain(step, p, g, m).recompiles == 0);
}

TEST_CASE("assign: the value is cast to the argument's dtype; a wrong shape is a shape_error") {
  auto h = k::randn({16}, k::bf16, k::cpu, 4);
  auto f = k::compile([](auto a, auto b) { return k::assign(a, k::cast(a, k::f32) * 2.0f + b); });
  auto b = k::randn({16}, k::f32, k::cpu, 5);
  auto want = k::reference::eval(k::cast(h, k::f32) * 2.0f + b);
  f(h, b);
  CHECK(h.dtype() == k::bf16);
  auto r = k::testing::allclose(h, want, 1e-2, 1e-2);
  CHECK_MESSAGE(bool(r), r);
  auto wrong = k::compile([](auto a, auto b) { return k::assign(a, k::sum(b, 0)); });
  auto a2 = k::randn({4, 3}, k::f32, k::cpu, 6), b2 = k::randn({5, 3}, k::f32, k::cpu, 7);
  CHECK_THROWS_AS(wrong(a2, b2), k::shape_error);
}

TEST_CASE("eval(out): rows of a larger buffer are written in place, the padding around them untouched") {
  const std::int64_t rows = 13, cols = 9, pitch = 16, start = 3;
  auto big = k::randn({rows, pitch}, k::f32, k::cpu, 21);
  auto before = k::to_vector<float>(big);
  auto x = k::randn({rows, cols}, k::f32, k::cpu, 22);
  // Columns [start, start + cols) of every row: a view with a row pitch, as a wrapped sub-buffer would be.
  k::Tensor out =
      k::Tensor::wrap(static_cast<float*>(big.data_ptr()) + start, {rows, cols}, k::f32, k::cpu, {pitch, 1});
  REQUIRE(!out.is_contiguous());
  k::eval(out, k::exp(x) - 1.0f);
  auto want = k::to_vector<float>(k::reference::eval(k::exp(x) - 1.0f));
  auto after = k::to_vector<float>(big);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < pitch; ++c) {
      bool inside = c >= start && c < start + cols;
      float expect = inside ? want[r * cols + c - start] : before[r * pitch + c];
      CHECK(after[r * pitch + c] == doctest::Approx(expect).epsilon(1e-6));
    }
  // A layout that is not evenly spaced rows (a transpose) is refused, and out is left as it was.
  k::Tensor t = k::Tensor::wrap(big.data_ptr(), {cols, rows}, k::f32, k::cpu, {1, pitch});
  CHECK_THROWS_AS(k::eval(t, k::transpose(x, 0, 1) * 2.0f), k::shape_error);
  CHECK(k::to_vector<float>(big) == after);
  // A broadcast (stride-0) layout would write overlapping rows: refused too.
  k::Tensor expanded = k::Tensor::wrap(big.data_ptr(), {3, 4, 8}, k::f32, k::cpu, {8, 0, 1});
  CHECK_THROWS_AS(k::eval(expanded, k::randn({3, 4, 8}, k::f32, k::cpu, 24) * 2.0f), k::shape_error);
  CHECK(k::to_vector<float>(big) == after);
  // A wrong shape fails before anything is written.
  auto y = k::randn({rows, cols + 1}, k::f32, k::cpu, 23);
  CHECK_THROWS_AS(k::eval(out, y * 2.0f), k::shape_error);
  CHECK(k::to_vector<float>(big) == after);
}

// A bare view of a tensor (a permute, a slice, the tensor itself) lowers to no kernel: eval(out, ...)
// must still write it into out, and out must stay out's own buffer (it once aliased the source).
TEST_CASE("eval(out): a bare tensor or view of one is copied into out") {
  std::vector<k::Device> devices = {k::cpu};
  if (k::driver::available()) devices.push_back(k::cuda);
  for (k::Device dev : devices) {
    CAPTURE(dev.str());
    k::Tensor x = k::randn({5, 7, 3}, k::f32, dev, 41);
    k::Tensor want = k::Tensor(k::permute(x, {1, 0, 2})).contiguous();
    k::Tensor out = k::full({7, 5, 3}, 2.5f, k::f32, dev);
    void* const where = out.data_ptr();
    k::eval(out, k::permute(x, {1, 0, 2}));
    CHECK(out.data_ptr() == where);
    auto r = k::testing::allclose(out.to(k::cpu), want.to(k::cpu), 0, 0);
    CHECK_MESSAGE(bool(r), r);
    k::Tensor rows = k::full({3, 7, 3}, 2.5f, k::f32, dev);  // a slice: an offset view
    k::eval(rows, k::slice(x, 0, 1, 4));
    r = k::testing::allclose(rows.to(k::cpu), k::Tensor(k::slice(x, 0, 1, 4)).contiguous().to(k::cpu), 0, 0);
    CHECK_MESSAGE(bool(r), r);
    k::Tensor half = k::full({7, 5, 3}, 2.5f, k::bf16, dev);  // with a cast on the way
    k::eval(half, k::permute(x, {1, 0, 2}));
    r = k::testing::allclose(half.to(k::cpu).to(k::f32), want.to(k::bf16).to(k::cpu).to(k::f32), 0, 0);
    CHECK_MESSAGE(bool(r), r);
  }
}

// The graph stays pure: a value that reads the argument it is stored into gives what it would give
// into a new tensor. An extern step (a GEMM) reading it writes into a copy first; a kernel reading it
// at other positions (a transpose) is refused, as storing in place would overwrite what it still
// reads; reading it element by element (a row kernel, a pointwise chain) stays in place.
TEST_CASE("assign: a value reading its own argument is computed as if into a new tensor") {
  std::vector<k::Device> devices = {k::cpu};
  if (k::driver::available()) devices.push_back(k::cuda);
  for (k::Device dev : devices) {
    CAPTURE(dev.str());
    k::Tensor b = k::randn({67, 67}, k::f32, dev, 51), c = k::randn({67, 67}, k::f32, dev, 52);
    auto want = k::reference::eval(k::matmul(b, c));
    auto into_c = k::compile([](auto b, auto c) { return k::assign(c, k::matmul(b, c)); });
    into_c(b, c);
    auto r = k::testing::allclose(c.to(k::cpu), want, 1e-4, 1e-4);
    CHECK_MESSAGE(bool(r), r);
    auto want_t = k::reference::eval(k::matmul(b, k::transpose(c, 0, 1)));
    auto into_ct = k::compile([](auto b, auto c) { return k::assign(c, k::matmul(b, k::transpose(c, 0, 1))); });
    into_ct(b, c);
    r = k::testing::allclose(c.to(k::cpu), want_t, 1e-4, 1e-4);
    CHECK_MESSAGE(bool(r), r);
    auto transposed = k::compile([](auto x) { return k::assign(x, k::transpose(x, 0, 1) + 1.0f); });
    k::Tensor before = c.to(k::cpu);
    CHECK_THROWS_WITH_AS(transposed(c), doctest::Contains("reads that argument at other positions"), k::error);
    CHECK(bool(k::testing::allclose(c.to(k::cpu), before, 0, 0)));  // untouched
    // A GEMM scheduled after the kernel that updates its operand would read the new value.
    auto later = k::compile([](auto a, auto b) { return std::make_tuple(k::assign(a, a * 2.0f), k::matmul(a, b)); });
    CHECK_THROWS_WITH_AS(later(c, b), doctest::Contains("but read afterwards by kiln_extern_matmul"), k::error);
    // Nor does a row reduction over the updated argument, read at other rows' positions, make the
    // updating kernel its row kernel (schedule/fuse.hpp's takes_rows): refused as before.
    auto sums = k::compile(
        [](auto x) { return std::make_tuple(k::assign(x, x * 2.0f), k::sum(k::transpose(x, 0, 1), 1)); });
    before = c.to(k::cpu);
    CHECK_THROWS_WITH_AS(sums(c), doctest::Contains("but read afterwards by kiln_per_fused_sum"), k::error);
    CHECK(bool(k::testing::allclose(c.to(k::cpu), before, 0, 0)));  // untouched
    // The sum first: the update does not join the sum's row kernel either (each row would
    // overwrite values the later rows' sums read); it runs after it, the sums from the old values.
    auto sums_first =
        k::compile([](auto x) { return std::make_tuple(k::sum(k::transpose(x, 0, 1), 1), k::assign(x, x * 2.0f)); });
    auto want_sums = k::reference::eval(k::sum(k::transpose(c, 0, 1), 1));  // (the oracle's copies, taken
    auto want_c = k::reference::eval(c * 2.0f);                             // before c is updated)
    k::Tensor got_sums = std::get<0>(sums_first(c));
    r = k::testing::allclose(got_sums.to(k::cpu), want_sums, 1e-4, 1e-4);
    CHECK_MESSAGE(bool(r), r);
    r = k::testing::allclose(c.to(k::cpu), want_c, 0, 0);
    CHECK_MESSAGE(bool(r), r);
    k::Tensor y = k::randn({37, 301}, k::f32, dev, 53);
    auto want_s = k::reference::eval(k::softmax(y, -1) * 2.0f + y);
    auto rows = k::compile([](auto y) { return k::assign(y, k::softmax(y, -1) * 2.0f + y); });
    rows(y);
    r = k::testing::allclose(y.to(k::cpu), want_s, 1e-5, 1e-6);
    CHECK_MESSAGE(bool(r), r);
  }
}

TEST_CASE("assign: a small update between two kernels of one loop moves ahead of the first (W8's AdamW)") {
  // The step count's update t = step + 1 ([1]) used to sit between the kernel writing m and v and
  // the one reading them back for p: three kernels, nine passes over the state. It reads only
  // arguments, so it runs first and p joins m's and v's kernel.
  std::vector<k::Device> devices = {k::cpu};
  if (k::driver::available()) devices.push_back(k::cuda);
  for (k::Device dev : devices) {
    CAPTURE(dev.str());
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    auto adamw = [=](auto p, auto g, auto m, auto v, auto step) {
      auto t = step + 1.0f;
      auto bc1 = 1.0f - k::exp(t * std::log(b1)), bc2 = 1.0f - k::exp(t * std::log(b2));
      auto m2 = m * b1 + g * (1 - b1);
      auto v2 = v * b2 + g * g * (1 - b2);
      auto p2 = p - (m2 / bc1) / (k::sqrt(v2 / bc2) + eps) * lr;
      return std::make_tuple(k::assign(p, p2), k::assign(m, m2), k::assign(v, v2), k::assign(step, t));
    };
    const std::int64_t n = 1003;
    k::Tensor p = k::randn({n}, k::f32, dev, 61), g = k::randn({n}, k::f32, dev, 62), m = k::randn({n}, k::f32, dev, 63),
              v = k::rand({n}, k::f32, dev, 64), step = k::zeros({1}, k::f32, dev);
    std::vector<double> hp = k::to_vector<double>(p), hg = k::to_vector<double>(g), hm = k::to_vector<double>(m),
                        hv = k::to_vector<double>(v);
    auto f = k::compile(adamw);
    for (int s = 1; s <= 3; ++s) {
      f(p, g, m, v, step);
      const double bc1 = 1 - std::pow(double{b1}, s), bc2 = 1 - std::pow(double{b2}, s);
      for (std::size_t i = 0; i < hp.size(); ++i) {
        hm[i] = b1 * hm[i] + (1 - double{b1}) * hg[i];
        hv[i] = b2 * hv[i] + (1 - double{b2}) * hg[i] * hg[i];
        hp[i] -= (hm[i] / bc1) / (std::sqrt(hv[i] / bc2) + eps) * lr;
      }
    }
    auto close = [](const k::Tensor& got, const std::vector<double>& want) {
      std::vector<double> x = k::to_vector<double>(got);
      double worst = 0;
      for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(x[i] - want[i]) / (1e-3 + std::abs(want[i])));
      return worst;
    };
    CHECK(close(p, hp) < 1e-4);
    CHECK(close(m, hm) < 1e-5);
    CHECK(close(v, hv) < 1e-5);
    CHECK(k::to_vector<float>(step) == std::vector<float>{3.0f});
    const k::report r = k::explain(f, p, g, m, v, step);
    CHECK_MESSAGE(r.kernels.size() == 2, r);
  }
}
