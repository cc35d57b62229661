// A real training step on the CPU: value_and_grad of an MLP with layer_norm and cross_entropy
// (matmuls and their gradients included) and an in-place AdamW; the loss must fall over 50 steps.
#include <doctest/doctest.h>

#include <cmath>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

namespace k = kiln;

TEST_CASE("train: a 2-layer MLP's loss falls over 50 AdamW steps on the CPU") {
  const std::int64_t n = 257, d = 19, h = 37, classes = 5;
  auto x = k::randn({n, d}, k::f32, k::cpu, 1);
  // Labels from a random linear teacher, computed in the test.
  auto wt = k::randn({d, classes}, k::f32, k::cpu, 9);
  auto xv = k::to_vector<float>(x), wv = k::to_vector<float>(wt);
  std::vector<std::int64_t> labels(n);
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<float> s(classes, 0.0f);
    for (std::int64_t c = 0; c < classes; ++c)
      for (std::int64_t j = 0; j < d; ++j) s[c] += xv[i * d + j] * wv[j * classes + c];
    labels[i] = std::max_element(s.begin(), s.end()) - s.begin();
  }
  k::Tensor y = k::from_vector(labels, {n});

  std::vector<k::Tensor> p = {
      k::Tensor(k::randn({h, d}, k::f32, k::cpu, 2) * 0.2f),        k::zeros({h}),      k::ones({h}), k::zeros({h}),
      k::Tensor(k::randn({classes, h}, k::f32, k::cpu, 3) * 0.15f), k::zeros({classes})};
  std::vector<k::Tensor> m, v;
  for (auto& t : p) m.push_back(k::zeros(t.shape())), v.push_back(k::zeros(t.shape()));
  auto loss_fn = [](auto x, auto y, auto w1, auto b1, auto g, auto be, auto w2, auto b2) {
    return k::cross_entropy(k::linear(k::layer_norm(k::gelu(k::linear(x, w1, b1)), g, be), w2, b2), y);
  };
  auto step = k::compile(k::value_and_grad(loss_fn, k::wrt<2, 3, 4, 5, 6, 7>));
  float bc1 = 1, bc2 = 1;
  auto adamw = k::compile([&](auto p, auto g, auto m, auto v) {
    auto m2 = m * 0.9f + g * 0.1f;
    auto v2 = v * 0.999f + g * g * 0.001f;
    return std::make_tuple(k::assign(p, p * (1 - 1e-4f) - (m2 / bc1) / (k::sqrt(v2 / bc2) + 1e-8f) * 1e-2f),
                           k::assign(m, m2), k::assign(v, v2));
  });
  double first = 0, last = 0;
  for (int s = 1; s <= 50; ++s) {
    auto [loss, g1, gb1, gg, gbe, g2, gb2] = step(x, y, p[0], p[1], p[2], p[3], p[4], p[5]);
    if (s == 1) {  // the first loss and a gradient agree with the f64 oracle
      CHECK(k::to_vector<float>(loss)[0] == doctest::Approx(k::to_vector<double>(k::reference::eval(
                                                                loss_fn(x, y, p[0], p[1], p[2], p[3], p[4], p[5])))[0])
                                                .epsilon(1e-4));
    }
    std::vector<k::Tensor> g = {g1, gb1, gg, gbe, g2, gb2};
    bc1 = 1 - std::pow(0.9f, float(s));
    bc2 = 1 - std::pow(0.999f, float(s));
    for (std::size_t i = 0; i < p.size(); ++i) adamw(p[i], g[i], m[i], v[i]);
    last = k::to_vector<float>(loss)[0];
    if (s == 1) first = last;
  }
  INFO("loss " << first << " -> " << last);
  CHECK(std::isfinite(last));
  CHECK(last < 0.5 * first);
  CHECK(k::explain(adamw, p[0], p[0], m[0], v[0]).kernels.size() == 1);  // p, m, v in one kernel
}
