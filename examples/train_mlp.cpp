// Trains a 2-layer MLP with layer_norm and cross_entropy on synthetic data with a fused AdamW
// step: the loss and all gradients come from one compiled k::value_and_grad program, and each
// AdamW update of p, m, v is one in-place kernel (k::assign). Runs on the GPU when one is usable.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <vector>

#include <kiln/kiln.hpp>

namespace k = kiln;

namespace {

// Synthetic classification: the label is the argmax of x @ w_true, so a small MLP can learn it.
k::Tensor make_labels(const k::Tensor& x, int classes) {
  auto w = k::randn({x.shape()[1], classes}, k::f32, k::cpu, 99);
  k::Tensor scores = k::matmul(x.to(k::cpu), w);
  auto s = k::to_vector<float>(scores);
  std::vector<std::int64_t> y(static_cast<std::size_t>(x.shape()[0]));
  for (std::size_t i = 0; i < y.size(); ++i) {
    int best = 0;
    for (int c = 1; c < classes; ++c)
      if (s[i * classes + c] > s[i * classes + best]) best = c;
    y[i] = best;
  }
  return k::from_vector(y, {x.shape()[0]});
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  k::Device dev = k::driver::available() ? k::Device(k::cuda) : k::cpu;
  const std::int64_t n = 1024, d = 32, h = 128, classes = 10;
  auto x = k::randn({n, d}, k::f32, dev, 1);
  k::Tensor y = make_labels(x, classes).to(dev);

  // Parameters (PyTorch's Linear layout: weight [out, in]).
  std::vector<k::Tensor> params = {k::Tensor(k::randn({h, d}, k::f32, dev, 2) * 0.17f),
                                   k::zeros({h}, k::f32, dev),
                                   k::ones({h}, k::f32, dev),
                                   k::zeros({h}, k::f32, dev),
                                   k::Tensor(k::randn({classes, h}, k::f32, dev, 3) * 0.09f),
                                   k::zeros({classes}, k::f32, dev)};
  std::vector<k::Tensor> m, v;
  for (auto& p : params) m.push_back(k::zeros(p.shape(), k::f32, dev)), v.push_back(k::zeros(p.shape(), k::f32, dev));

  auto loss_fn = [](auto x, auto y, auto w1, auto b1, auto g, auto be, auto w2, auto b2) {
    auto hidden = k::layer_norm(k::gelu(k::linear(x, w1, b1)), g, be);
    return k::cross_entropy(k::linear(hidden, w2, b2), y);
  };
  auto step = k::compile(k::value_and_grad(loss_fn, k::wrt<2, 3, 4, 5, 6, 7>));

  // AdamW (lr 1e-2, betas 0.9/0.999, eps 1e-8, weight decay 0.01): one in-place kernel a tensor.
  float lr = 1e-2f, bc1 = 1, bc2 = 1;
  auto adamw = k::compile([&](auto p, auto g, auto m, auto v) {
    auto m2 = m * 0.9f + g * 0.1f;
    auto v2 = v * 0.999f + g * g * 0.001f;
    auto p2 = p * (1 - lr * 0.01f) - (m2 / bc1) / (k::sqrt(v2 / bc2) + 1e-8f) * lr;
    return std::make_tuple(k::assign(p, p2), k::assign(m, m2), k::assign(v, v2));
  });

  std::printf("training a %lldx%lldx%lld MLP on %s, %d steps\n", (long long)d, (long long)h, (long long)classes,
              dev.str().c_str(), steps);
  double first = 0, last = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int s = 1; s <= steps; ++s) {
    auto [loss, g1, gb1, gg, gbe, g2, gb2] =
        step(x, y, params[0], params[1], params[2], params[3], params[4], params[5]);
    std::vector<k::Tensor> grads = {g1, gb1, gg, gbe, g2, gb2};
    bc1 = 1 - std::pow(0.9f, static_cast<float>(s));
    bc2 = 1 - std::pow(0.999f, static_cast<float>(s));
    for (std::size_t i = 0; i < params.size(); ++i) adamw(params[i], grads[i], m[i], v[i]);
    last = k::to_vector<float>(loss)[0];
    if (s == 1) first = last;
    if (s == 1 || s % 5 == 0) std::printf("step %3d  loss %.4f\n", s, last);
  }
  k::synchronize();
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  std::printf("loss %.4f -> %.4f, %.3f ms per step (compiles included in the first)\n\n", first, last, ms);
  std::cout << k::explain(step, x, y, params[0], params[1], params[2], params[3], params[4], params[5]);
  return last < first ? 0 : 1;
}
