// k::expression (any expression behind one type) and compiled functions called inside another
// (their body inlined into the caller's graph): loops over layers, the same values, kernels and
// gradients as the typed expressions they replace, shared subexpressions walked once, a run-time
// check where the type no longer tells that a value is a single element; on the CPU and the GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"
#include "residual_chain.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

void check_loop(k::Device dev) {
  k::Tensor x = k::randn({9, 24}, k::f32, dev, 1), w = k::randn({24, 24}, k::f32, dev, 2) * 0.2f;
  k::Tensor g = k::randn({24}, k::f32, dev, 3), b = k::randn({24}, k::f32, dev, 4);
  auto typed = k::compile([](auto x, auto w, auto g, auto b) { return residual_chain<6>(x, w, g, b); });
  auto looped = k::compile([](auto x, auto w, auto g, auto b) {
    k::expression h = x;
    for (int i = 0; i < 6; ++i) h = k::layer_norm(h + k::gelu(k::matmul(h, w)), g, b);
    return h;
  });
  CHECK(values(looped(x, w, g, b)) == values(typed(x, w, g, b)));
  CHECK(k::explain(looped, x, w, g, b).kernels.size() == k::explain(typed, x, w, g, b).kernels.size());
  // Gradients through the loop, of a scalar the type no longer shows.
  auto loss_typed = [](auto x, auto w, auto g, auto b) { return k::sum(k::square(residual_chain<3>(x, w, g, b))); };
  auto loss_looped = [](auto x, auto w, auto g, auto b) {
    k::expression h = x;
    for (int i = 0; i < 3; ++i) h = k::layer_norm(h + k::gelu(k::matmul(h, w)), g, b);
    return k::expression(k::sum(k::square(h)));
  };
  auto [lt, dwt, dgt] = k::compile(k::value_and_grad(loss_typed, k::wrt<1, 2>))(x, w, g, b);
  auto [ll, dwl, dgl] = k::compile(k::value_and_grad(loss_looped, k::wrt<1, 2>))(x, w, g, b);
  CHECK(values(ll) == values(lt));
  CHECK(values(dwl) == values(dwt));
  CHECK(values(dgl) == values(dgt));
}

void check_inlined_block(k::Device dev) {
  std::vector<k::Tensor> ws;
  for (int i = 0; i < 4; ++i) ws.push_back(k::randn({16, 16}, k::f32, dev, 10 + static_cast<unsigned>(i)) * 0.25f);
  k::Tensor x = k::randn({7, 16}, k::f32, dev, 20);
  auto block = k::compile([](auto h, auto w) { return h + k::tanh(k::matmul(h, w)); });
  auto model = k::compile([&block](auto x, auto ws) {
    k::expression h = x;
    for (auto w : ws) h = block(h, w);
    return k::sum(k::square(h), 1);
  });
  k::Tensor got = model(x, ws);
  k::expression want = x;  // the same chain for the oracle
  for (auto& w : ws) want = want + k::tanh(k::matmul(want, w));
  auto r = k::testing::allclose(got, k::reference::eval(k::sum(k::square(want), 1)), 1e-5, 1e-6);
  CHECK_MESSAGE(r, r);
  // Inlined and fused: a GEMM and one pointwise kernel a block (the last also holds the sum), not a
  // program per block call.
  auto report = k::explain(model, x, ws);
  CHECK(report.graphs == 1);
  CHECK(report.kernels.size() == 8);
  // Called on tensors the block is its own compiled function, with the same values.
  auto direct = block(x, ws[0]);
  CHECK(values(direct) == values(k::Tensor(x + k::tanh(k::matmul(x, ws[0])))));
  // Gradients through the inlined blocks, w.r.t. the container.
  auto loss = [&block](auto x, auto ws) {
    k::expression h = x;
    for (auto w : ws) h = block(h, w);
    return k::expression(k::mean(k::square(h)));
  };
  auto [v, dws] = k::compile(k::value_and_grad(loss, k::wrt<1>))(x, ws);
  REQUIRE(dws.size() == 4);
  auto loss4 = [](auto x, auto w0, auto w1, auto w2, auto w3) {
    auto f = [](auto h, auto w) { return h + k::tanh(k::matmul(h, w)); };
    return k::mean(k::square(f(f(f(f(x, w0), w1), w2), w3)));
  };
  auto [v4, d0, d1, d2, d3] = k::compile(k::value_and_grad(loss4, k::wrt<1, 2, 3, 4>))(x, ws[0], ws[1], ws[2], ws[3]);
  CHECK(values(v) == values(v4));
  CHECK(values(dws[0]) == values(d0));
  CHECK(values(dws[3]) == values(d3));
}

}  // namespace

TEST_CASE("expression: a loop of residual blocks equals the typed recursion, values, kernels and gradients (cpu)") {
  check_loop(k::cpu);
}
TEST_CASE("expression: a loop of residual blocks equals the typed recursion (cuda)" * needs_gpu()) {
  check_loop(k::cuda);
}
TEST_CASE("expression: a compiled block called inside another is inlined and fused, gradients flow (cpu)") {
  check_inlined_block(k::cpu);
}
TEST_CASE("expression: a compiled block called inside another (cuda)" * needs_gpu()) { check_inlined_block(k::cuda); }

TEST_CASE("expression: a value used twice is walked once (40 doublings stay linear)") {
  k::Tensor x = k::randn({5}, k::f32, k::cpu, 30);
  auto f = k::compile([](auto x) {
    k::expression h = x;
    for (int i = 0; i < 40; ++i) h = h + h * 0.5f;  // 2^40 paths, 80 nodes
    return h;
  });
  const auto got = values(f(x)), xv = values(x);
  for (std::size_t i = 0; i < xv.size(); ++i) CHECK(got[i] == doctest::Approx(xv[i] * std::pow(1.5, 40)).epsilon(1e-4));
}

TEST_CASE("expression: k::grad of an erased value checks at run time that it is a single element") {
  k::Tensor x = k::randn({3, 4}, k::f32, k::cpu, 40);
  auto g = k::compile(k::grad([](auto x) { return k::expression(x * 2.0f); }, k::wrt<0>));
  CHECK_THROWS_WITH_AS(g(x), doctest::Contains("not a single element"), k::error);
}
