// k::item<T>(expr) (issue 22): a host value read inside a compiled function — a graph break. The
// function runs as segments (the item's expression, then the rest), each with its own program cache;
// explain counts them and names the break; typical uses: clipping by a global norm, an early exit on a
// NaN loss, a data-dependent loop count, and gradients of a function that reads a host value.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

void check_close(const k::Tensor& got, const k::Tensor& want, double tol = 1e-5) {
  auto r = k::testing::allclose(got, want, tol, tol);
  CHECK_MESSAGE(bool(r), r);
}

}  // namespace

TEST_CASE("item: an expression's one element, read on the host") {
  k::Tensor x = k::randn({7, 13}, k::f32, k::cpu, 301);
  double sum = 0;
  int positive = 0;
  for (double v : values(x)) sum += v, positive += v > 0;
  CHECK(k::item<double>(k::sum(x)) == doctest::Approx(sum).epsilon(1e-5));
  CHECK(k::item<int>(k::sum(k::cast(x > 0.0f, k::i32))) == positive);
  CHECK(k::item<bool>(k::amax(x) > 100.0f) == false);
  CHECK(k::item<float>(k::Tensor(k::sum(x))) == doctest::Approx(sum).epsilon(1e-5));  // a tensor too
  try {
    (void)k::item<float>(x * 2.0f);
    FAIL("k::item of 91 elements did not throw");
  } catch (const k::shape_error& e) {
    CHECK(std::string(e.what()).find("[7, 13]") != std::string::npos);
    CHECK(std::string(e.what()).find("test_item.cpp") != std::string::npos);
  }
}

TEST_CASE("item: clipping by the global norm inside a compiled function: two segments, each compiled once") {
  auto clip_step = k::compile([](auto w, auto g) {
    float norm = k::item<float>(k::sqrt(k::sum(g * g)));
    float scale = norm > 1.0f ? 1.0f / norm : 1.0f;  // a host decision
    return w - 0.5f * (g * scale);
  });
  k::Tensor w = k::randn({17, 33}, k::f32, k::cpu, 302), big = k::randn({17, 33}, k::f32, k::cpu, 303);
  k::Tensor small = k::Tensor(big * 0.001f);
  for (const k::Tensor& g : {big, small}) {
    double sq = 0;
    for (double v : values(g)) sq += v * v;
    double norm = std::sqrt(sq), scale = norm > 1 ? 1 / norm : 1;
    check_close(clip_step(w, g), k::reference::eval(w - 0.5 * (g * scale)));
  }
  // Both branches ran the same program: the host value is a run-time scalar of it.
  CHECK(clip_step.cache().entries().size() == 1);
  k::report r = k::explain(clip_step, w, big);
  CHECK(r.graphs == 2);
  REQUIRE(r.graph_breaks.size() == 1);
  CHECK(r.graph_breaks[0].find("k::item<f32>") != std::string::npos);
  CHECK(r.graph_breaks[0].find("test_item.cpp") != std::string::npos);
  CHECK(r.recompiles == 0);
  // A function without a break is one graph.
  k::report plain = k::explain(k::compile([](auto a) { return a * 2.0f; }), w);
  CHECK(plain.graphs == 1);
  CHECK(plain.graph_breaks.empty());
}

TEST_CASE("item: an early exit on a NaN loss") {
  auto loss = k::compile([](auto x, auto y) { return k::mean((x - y) * (x - y)); });
  k::Tensor y = k::randn({9, 5}, k::f32, k::cpu, 304);
  std::vector<k::Tensor> batches;
  for (int i = 0; i < 5; ++i) batches.push_back(k::randn({9, 5}, k::f32, k::cpu, 305 + static_cast<std::uint64_t>(i)));
  batches[3] = k::Tensor(batches[3] + k::log(k::full({9, 5}, -1.0f, k::f32, k::cpu)));  // NaN from here on
  int ran = 0;
  for (const auto& x : batches) {
    if (std::isnan(k::item<float>(loss(x, y)))) break;
    ++ran;
  }
  CHECK(ran == 3);
}

TEST_CASE("item: a data-dependent loop count") {
  auto f = k::compile([](auto x) {
    long n = k::item<long>(k::sum(k::cast(x > 0.0f, k::i64)));
    float s = 0;
    for (long i = 1; i <= n; ++i) s += static_cast<float>(i);
    return x * s;
  });
  for (std::uint64_t seed : {306u, 307u}) {
    k::Tensor x = k::randn({3, 11}, k::f32, k::cpu, seed);
    long n = 0;
    for (double v : values(x)) n += v > 0;
    check_close(f(x), k::reference::eval(x * (0.5 * static_cast<double>(n) * static_cast<double>(n + 1))));
  }
}

TEST_CASE("item: gradients of a function that reads a host value") {
  auto df = k::grad(
      [](auto x) {
        float m = k::item<float>(k::amax(x));
        return k::sum(x * x) * (1.0f / m);
      },
      k::wrt<0>);
  k::Tensor x = k::Tensor(k::abs(k::randn({4, 9}, k::f32, k::cpu, 308)) + 0.5f);
  double m = 0;
  for (double v : values(x)) m = std::max(m, v);
  check_close(df(x), k::reference::eval(x * (2.0 / m)));  // the host value is a constant of the graph
}

TEST_CASE("item: KILN_LOGS=graph_breaks logs each break site once") {
  static std::string text;
  text.clear();
  k::debug::set_log_channels("graph_breaks");
  auto old = k::debug::set_log_sink([](k::debug::Channel, std::string_view s) { text += s; });
  k::Tensor x = k::randn({5}, k::f32, k::cpu, 309);
  for (int i = 0; i < 3; ++i) (void)k::item<float>(k::sum(x));
  k::debug::set_log_sink(old);
  k::debug::set_log_channels("");
  CHECK(text.find("[kiln:graph_breaks] graph break: k::item<f32> at test_item.cpp") != std::string::npos);
  CHECK(text.find("graph break") == text.rfind("graph break"));  // once
}
