// k::cond(pred, true_fn, false_fn, operands...) (issue 22): a data-dependent branch inside one
// program. Both branches are compiled, only the taken one runs, the program compiles once for both
// outcomes, gradients go through the taken branch, and branches that disagree are typed errors
// naming both. The predicate is read on the host: explain counts that as a break. Under
// `.cuda_graphs` it is a conditional graph node instead: test_cond_graph.cpp.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

void check_close(const k::Tensor& got, const k::Tensor& want, double tol = 1e-5) {
  auto r = k::testing::allclose(got, want, tol, tol);
  CHECK_MESSAGE(bool(r), r);
}

double sum_of_squares(const k::Tensor& t) {
  double s = 0;
  for (double v : values(t)) s += v * v;
  return s;
}

// Clipping by the global norm without leaving the program: scale g when its norm passes 1.
auto clip = [](auto g) {
  return k::cond(
      k::sum(g * g) > 1.0f, [](auto x) { return x * k::rsqrt(k::sum(x * x)); }, [](auto x) { return x * 1.0f; }, g);
};

void check_clip(k::Device dev) {
  auto step = k::compile([](auto w, auto g) { return w - 0.5f * clip(g); });
  k::Tensor w = k::randn({17, 33}, k::f32, dev, 401), big = k::randn({17, 33}, k::f32, dev, 402);
  k::Tensor small = k::Tensor(big * 0.001f);
  for (const k::Tensor& g : {big, small, big}) {
    double norm = std::sqrt(sum_of_squares(g)), scale = norm > 1 ? 1 / norm : 1;
    check_close(step(w, g), k::reference::eval(w - 0.5 * (g * scale)));
  }
  CHECK(step.cache().entries().size() == 1);  // one program for both outcomes
  k::report r = k::explain(step, w, big);
  CHECK(r.recompiles == 0);
  REQUIRE(r.graph_breaks.size() == 1);
  CHECK(r.graph_breaks[0].find("k::cond") != std::string::npos);
  bool extern_step = false;
  for (const auto& kernel : r.kernels) extern_step = extern_step || kernel.kind == "extern";
  CHECK(extern_step);
}

}  // namespace

TEST_CASE("cond: clipping by the global norm inside one compiled program (cpu)") { check_clip(k::cpu); }

TEST_CASE("cond: clipping by the global norm inside one compiled program (cuda)" * needs_gpu()) {
  check_clip(k::cuda(0));
}

TEST_CASE("cond: eager, with two operands, a predicate on a tensor, and both outcomes") {
  k::Tensor a = k::randn({5, 7}, k::f32, k::cpu, 403), b = k::randn({5, 7}, k::f32, k::cpu, 404);
  auto pick = [](const k::Tensor& p, const k::Tensor& x, const k::Tensor& y) {
    return k::Tensor(k::cond(
        p, [](auto u, auto v) { return k::exp(u) + v; }, [](auto u, auto v) { return u * v - 1.0f; }, x, y));
  };
  check_close(pick(k::Tensor(k::sum(a) > -1e9f), a, b), k::reference::eval(k::exp(a) + b));
  check_close(pick(k::Tensor(k::sum(a) < -1e9f), a, b), k::reference::eval(a * b - 1.0f));
  // A branch that returns an operand as it is.
  k::Tensor same = k::cond(
      k::amax(a) > 1e9f, [](auto u) { return u * 2.0f; }, [](auto u) { return u; }, a);
  check_close(same, a);
}

TEST_CASE("cond: gradients flow through the taken branch and pass gradcheck") {
  auto f = [](auto x, auto y) {
    return k::sum(k::cond(
        k::mean(x) > 0.0f, [](auto u, auto v) { return k::tanh(u) * v; }, [](auto u, auto v) { return u * u + v; },
        x, y));
  };
  k::Tensor x = k::randn({6, 5}, k::f32, k::cpu, 405), y = k::randn({6, 5}, k::f32, k::cpu, 406);
  k::Tensor xp = k::Tensor(k::abs(x) + 0.1f), xn = k::Tensor(-k::abs(x) - 0.1f);
  auto df = k::compile(k::grad(f, k::wrt<0, 1>));
  {
    auto [dx, dy] = df(xp, y);  // tanh(u) * v
    check_close(dx, k::reference::eval((1.0f - k::square(k::tanh(xp))) * y));
    check_close(dy, k::reference::eval(k::tanh(xp)));
  }
  {
    auto [dx, dy] = df(xn, y);  // u * u + v
    check_close(dx, k::reference::eval(2.0f * xn));
    check_close(dy, k::reference::eval(k::full({6, 5}, 1.0f, k::f32, k::cpu)));
  }
  CHECK(df.cache().entries().size() == 1);
  auto r = k::testing::gradcheck(f, xp, y);
  CHECK_MESSAGE(r.ok, r);
  r = k::testing::gradcheck(f, xn, y);
  CHECK_MESSAGE(r.ok, r);
}

namespace {

// Up to six operands (API.md: operands...); a graph node holds eight inputs, the branch's
// backward reads the predicate's operands and the cotangent.
void check_five_operands(k::Device dev) {
  auto f = [](auto a, auto b, auto c, auto d, auto e) {
    return k::sum(k::cond(
        k::mean(a) > 0.0f, [](auto p, auto q, auto r, auto s, auto t) { return p * q + r * s - t; },
        [](auto p, auto q, auto r, auto s, auto t) { return k::exp(p) * t + q - r * s; }, a, b, c, d, e));
  };
  std::vector<k::Tensor> in;
  for (unsigned i = 0; i < 5; ++i) in.push_back(k::randn({3, 7}, k::f32, dev, 410 + i));
  k::Tensor up = k::Tensor(k::abs(in[0]) + 0.1f), down = k::Tensor(-k::abs(in[0]) - 0.1f);
  auto vg = k::compile(k::value_and_grad(f, k::wrt<0, 1, 2, 3, 4>));
  {
    auto [v, g0, g1, g2, g3, g4] = vg(up, in[1], in[2], in[3], in[4]);
    check_close(v, k::reference::eval(k::sum(up * in[1] + in[2] * in[3] - in[4])), 1e-4);
    check_close(g0, in[1]);
    check_close(g1, up);
    check_close(g2, in[3]);
    check_close(g3, in[2]);
    check_close(g4, k::reference::eval(k::full({3, 7}, -1.0f, k::f32, k::cpu)));
  }
  {
    auto [v, g0, g1, g2, g3, g4] = vg(down, in[1], in[2], in[3], in[4]);
    check_close(v, k::reference::eval(k::sum(k::exp(down) * in[4] + in[1] - in[2] * in[3])), 1e-4);
    check_close(g0, k::reference::eval(k::exp(down) * in[4]));
    check_close(g1, k::reference::eval(k::full({3, 7}, 1.0f, k::f32, k::cpu)));
    check_close(g2, k::reference::eval(-in[3]));
    check_close(g3, k::reference::eval(-in[2]));
    check_close(g4, k::reference::eval(k::exp(down)));
  }
  CHECK(vg.cache().entries().size() == 1);
  if (dev != k::Device(k::cpu)) return;  // gradcheck differentiates in f64 on the CPU
  auto r = k::testing::gradcheck(f, down, in[1], in[2], in[3], in[4]);
  CHECK_MESSAGE(r.ok, r);
  bool converts = k::testing::gradcheck(f, up, in[1], in[2], in[3], in[4]);  // API.md: converts to bool
  CHECK(converts);
}

}  // namespace

TEST_CASE("cond: five operands, both outcomes and their gradients (cpu)") { check_five_operands(k::cpu); }

TEST_CASE("cond: five operands, both outcomes and their gradients (cuda)" * needs_gpu()) {
  check_five_operands(k::cuda(0));
}

TEST_CASE("cond: branches that disagree, and a predicate that is not one boolean, are typed errors") {
  k::Tensor x = k::randn({4, 6}, k::f32, k::cpu, 407);
  try {
    (void)k::Tensor(k::cond(
        k::sum(x) > 0.0f, [](auto u) { return u; }, [](auto u) { return k::sum(u, -1); }, x));
    FAIL("branches of shapes [4, 6] and [4] did not throw");
  } catch (const k::shape_error& e) {
    std::string m = e.what();
    CHECK(m.find("k::cond") != std::string::npos);
    CHECK(m.find("[4, 6]") != std::string::npos);
    CHECK(m.find("[4]") != std::string::npos);
  }
  try {
    (void)k::Tensor(k::cond(
        k::sum(x) > 0.0f, [](auto u) { return u; }, [](auto u) { return k::cast(u, k::f64); }, x));
    FAIL("branches of dtypes f32 and f64 did not throw");
  } catch (const k::dtype_error& e) {
    std::string m = e.what();
    CHECK(m.find("f32") != std::string::npos);
    CHECK(m.find("f64") != std::string::npos);
  }
  CHECK_THROWS_AS((void)k::Tensor(k::cond(
                      x > 0.0f, [](auto u) { return u; }, [](auto u) { return -u; }, x)),
                  k::shape_error);
  CHECK_THROWS_AS((void)k::Tensor(k::cond(
                      k::sum(x), [](auto u) { return u; }, [](auto u) { return -u; }, x)),
                  k::dtype_error);
}
