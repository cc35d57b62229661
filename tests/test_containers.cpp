// Container arguments (API.md "Models"): a std::vector<k::Tensor> stands where a tensor does in
// k::compile and k::grad / value_and_grad / vjp; k::wrt over it gives the gradients in a vector of
// the same order. Checked against the same functions written over separate tensors (the same bits),
// through elements used twice or not at all, loops over the container, indexing by a run-time
// value, containers whose size changes, optimizer updates written into container elements with
// k::assign, and on the GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

// A two-layer MLP's parameters [w1, b1, w2, b2] for inputs of width 13.
std::vector<k::Tensor> mlp_params(k::Device dev, k::dtype dt = k::f32) {
  return {k::randn({13, 37}, dt, dev, 1), k::randn({37}, dt, dev, 2), k::randn({37, 5}, dt, dev, 3),
          k::randn({5}, dt, dev, 4)};
}

auto mlp_loss_vec = [](auto p, auto x) {
  auto h = k::gelu(k::matmul(x, p[0]) + p[1]);
  return k::mean(k::square(k::matmul(h, p[2]) + p[3]));
};
auto mlp_loss = [](auto w1, auto b1, auto w2, auto b2, auto x) {
  auto h = k::gelu(k::matmul(x, w1) + b1);
  return k::mean(k::square(k::matmul(h, w2) + b2));
};

void check_mlp(k::Device dev) {
  auto ps = mlp_params(dev);
  k::Tensor x = k::randn({29, 13}, k::f32, dev, 5);
  // Forward: the same bits as the function over separate tensors.
  auto f = k::compile(mlp_loss_vec);
  auto f_plain = k::compile(mlp_loss);
  CHECK(values(f(ps, x)) == values(f_plain(ps[0], ps[1], ps[2], ps[3], x)));
  auto oracle = k::testing::allclose(f(ps, x), k::reference::eval(mlp_loss(ps[0], ps[1], ps[2], ps[3], x)), 1e-5, 1e-6);
  CHECK_MESSAGE(oracle, oracle);
  // value_and_grad with k::wrt over the container: (value, std::vector of gradients in order).
  auto step = k::compile(k::value_and_grad(mlp_loss_vec, k::wrt<0>));
  auto step_plain = k::compile(k::value_and_grad(mlp_loss, k::wrt<0, 1, 2, 3>));
  auto [loss, grads] = step(ps, x);
  static_assert(std::is_same_v<decltype(grads), std::vector<k::Tensor>>);
  auto [loss_p, g0, g1, g2, g3] = step_plain(ps[0], ps[1], ps[2], ps[3], x);
  REQUIRE(grads.size() == 4);
  CHECK(values(loss) == values(loss_p));
  const k::Tensor plain[] = {g0, g1, g2, g3};
  for (std::size_t i = 0; i < 4; ++i) {
    INFO("gradient " << i << " on " << dev);
    CHECK(grads[i].shape() == ps[i].shape());
    CHECK(grads[i].dtype() == ps[i].dtype());
    CHECK(grads[i].device() == dev);
    CHECK(values(grads[i]) == values(plain[i]));
  }
  // k::grad of one container: just the vector; with a tensor too: a tuple in wrt order.
  std::vector<k::Tensor> only = k::compile(k::grad(mlp_loss_vec, k::wrt<0>))(ps, x);
  CHECK(values(only[2]) == values(g2));
  auto [dps, dx] = k::compile(k::grad(mlp_loss_vec, k::wrt<0, 1>))(ps, x);
  CHECK(dps.size() == 4);
  CHECK(dx.shape() == x.shape());
  auto dx_plain = k::compile(k::grad(mlp_loss, k::wrt<4>))(ps[0], ps[1], ps[2], ps[3], x);
  CHECK(values(dx) == values(dx_plain));
}

}  // namespace

TEST_CASE("containers: an MLP over a std::vector of parameters equals the one over tensors, forward and gradients") {
  check_mlp(k::cpu);
}
TEST_CASE("containers: the same on the GPU (cuda)" * needs_gpu()) { check_mlp(k::cuda); }

TEST_CASE("containers: an element used twice sums its gradient; an unused one gets zeros; a loop over all") {
  std::vector<k::Tensor> ps = {k::randn({7, 3}, k::f64, k::cpu, 11), k::randn({7, 3}, k::f64, k::cpu, 12),
                               k::randn({2}, k::f64, k::cpu, 13)};
  auto twice = k::compile(k::grad([](auto p) { return k::sum(k::sin(p[0]) * p[0] + p[1]); }, k::wrt<0>));
  std::vector<k::Tensor> g = twice(ps);
  REQUIRE(g.size() == 3);
  const auto x = values(ps[0]);
  const auto d0 = values(g[0]);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(d0[i] == doctest::Approx(std::cos(x[i]) * x[i] + std::sin(x[i])));
  for (double v : values(g[1])) CHECK(v == 1.0);
  CHECK(g[2].shape() == std::vector<std::int64_t>{2});
  for (double v : values(g[2])) CHECK(v == 0.0);
  // A range-for over the container: every element has one expression type, so a loop can collect them.
  auto norm = k::compile([](auto p) {
    std::vector<decltype(k::sum(k::square(p[0])))> terms;
    for (auto t : p) terms.push_back(k::sum(k::square(t)));
    return terms[0] + terms[1] * 2.0 + terms[2] * 3.0;
  });
  double want = 0;
  for (int i = 0; i < 3; ++i)
    for (double v : values(ps[static_cast<std::size_t>(i)])) want += (i + 1) * v * v;
  CHECK(values(norm(ps))[0] == doctest::Approx(want));
}

TEST_CASE("containers: the element a call reads may change (a run-time index), and so may the container's size") {
  std::vector<k::Tensor> ps;
  for (int i = 0; i < 5; ++i) ps.push_back(k::randn({4, 6}, k::f32, k::cpu, 20 + static_cast<unsigned>(i)));
  std::size_t which = 0;
  auto pick = k::compile([&which](auto p, auto x) { return p[which] * x; });
  k::Tensor x = k::randn({4, 6}, k::f32, k::cpu, 30);
  for (which = 0; which < 5; ++which) {
    auto want = values(k::Tensor(ps[which] * x));
    CHECK(values(pick(ps, x)) == want);
  }
  // Fewer parameters (another program), then the first size again (its cached program).
  auto sum_all = k::compile(k::value_and_grad([](auto p) { return k::sum(p[0]) + k::sum(p[1]) * 0.5; }, k::wrt<0>));
  for (std::size_t n : {5u, 2u, 5u}) {
    std::vector<k::Tensor> sub(ps.begin(), ps.begin() + static_cast<std::ptrdiff_t>(n));
    auto [v, g] = sum_all(sub);
    CHECK(g.size() == n);
    double want = 0;
    for (double e : values(ps[0])) want += e;
    for (double e : values(ps[1])) want += 0.5 * e;
    CHECK(values(v)[0] == doctest::Approx(want).epsilon(1e-5));
    for (double e : values(g[1])) CHECK(e == 0.5);
    for (std::size_t i = 2; i < n; ++i)
      for (double e : values(g[i])) CHECK(e == 0.0);
  }
}

TEST_CASE("containers: vjp, and two containers with a tensor between them") {
  std::vector<k::Tensor> a = {k::randn({3, 4}, k::f32, k::cpu, 41), k::randn({3, 4}, k::f32, k::cpu, 42)};
  std::vector<k::Tensor> b = {k::randn({3, 4}, k::f32, k::cpu, 43)};
  k::Tensor s = k::randn({3, 4}, k::f32, k::cpu, 44), ct = k::randn({3, 4}, k::f32, k::cpu, 45);
  auto fn = [](auto a, auto s, auto b) { return a[0] * s + a[1] * b[0]; };
  auto [da, db] = k::compile(k::vjp(fn, k::wrt<0, 2>))(a, s, b, ct);
  REQUIRE(da.size() == 2);
  REQUIRE(db.size() == 1);
  CHECK(values(da[0]) == values(k::Tensor(s * ct)));
  CHECK(values(da[1]) == values(k::Tensor(b[0] * ct)));
  CHECK(values(db[0]) == values(k::Tensor(a[1] * ct)));
}

TEST_CASE("containers: tensors on different devices are a device_error naming both" * needs_gpu()) {
  std::vector<k::Tensor> ps = {k::randn({3}, k::f32, k::cpu, 1), k::randn({3}, k::f32, k::cuda, 2)};
  auto f = k::compile([](auto p) { return p[0] + p[1]; });
  CHECK_THROWS_AS(f(ps), k::device_error);
}

namespace {
// One AdamW step over containers of parameters, gradients and moments: an update per element,
// collected in a std::vector (every element's update has one type), written in place.
auto adamw = [](auto p, auto g, auto m, auto v, auto lr) {
  auto update = [&](std::size_t i) {
    auto m1 = m[i] * 0.9f + g[i] * 0.1f;
    auto v1 = v[i] * 0.999f + k::square(g[i]) * 0.001f;
    return std::tuple{k::assign(m[i], m1), k::assign(v[i], v1),
                      k::assign(p[i], p[i] * (1.0f - lr * 0.01f) - lr * m1 / (k::sqrt(v1) + 1e-8f))};
  };
  std::vector<decltype(update(0))> updates;
  for (std::size_t i = 0; i < p.size(); ++i) updates.push_back(update(i));
  return updates;
};
}  // namespace

TEST_CASE("containers: an AdamW step updates every parameter and moment in place, as computed here") {
  std::vector<k::Tensor> p = {k::randn({5, 3}, k::f32, k::cpu, 51), k::randn({7}, k::f32, k::cpu, 52)};
  std::vector<k::Tensor> g = {k::randn({5, 3}, k::f32, k::cpu, 53), k::randn({7}, k::f32, k::cpu, 54)};
  std::vector<k::Tensor> m = {k::randn({5, 3}, k::f32, k::cpu, 55), k::randn({7}, k::f32, k::cpu, 56)};
  std::vector<k::Tensor> v = {k::rand({5, 3}, k::f32, k::cpu, 57), k::rand({7}, k::f32, k::cpu, 58)};
  std::vector<std::vector<double>> p0, g0, m0, v0;
  for (std::size_t i = 0; i < 2; ++i)
    p0.push_back(values(p[i])), g0.push_back(values(g[i])), m0.push_back(values(m[i])), v0.push_back(values(v[i]));
  const float lr = 0.05f;
  auto step = k::compile([lr](auto p, auto g, auto m, auto v) { return adamw(p, g, m, v, lr); });
  std::vector<k::Tensor> out = step(p, g, m, v);
  CHECK(out.size() == 6);
  for (std::size_t i = 0; i < 2; ++i) {
    auto pv = values(p[i]), mv = values(m[i]), vv = values(v[i]);
    for (std::size_t j = 0; j < pv.size(); ++j) {
      const double m1 = m0[i][j] * 0.9 + g0[i][j] * 0.1, v1 = v0[i][j] * 0.999 + g0[i][j] * g0[i][j] * 0.001;
      CHECK(mv[j] == doctest::Approx(m1).epsilon(1e-5));
      CHECK(vv[j] == doctest::Approx(v1).epsilon(1e-5));
      CHECK(pv[j] == doctest::Approx(p0[i][j] * (1 - lr * 0.01) - lr * m1 / (std::sqrt(v1) + 1e-8)).epsilon(1e-5));
    }
  }
  CHECK(out[2].data_ptr() == p[0].data_ptr());  // the outputs are the updated arguments
}
