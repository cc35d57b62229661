// Data-parallel training on every GPU of this host (k::dist::spawn, one thread per GPU): each rank
// trains examples/train_mlp.cpp's MLP on its own share of the batch, k::dist::data_parallel averages
// the gradients over NCCL, and the ranks' parameters stay equal. Without a GPU it runs one CPU rank.
// Several processes or hosts: call k::dist::init() (KILN_RANK, KILN_WORLD_SIZE, KILN_DIST_ID_FILE)
// instead of spawn; the training code is the same.
#include <cmath>
#include <cstdio>
#include <vector>

#include <kiln/distributed.hpp>

namespace k = kiln;

void train(k::dist::group& g, int steps) {
  const std::int64_t n = 1024 / g.world_size(), d = 32, h = 128, classes = 10;
  const k::Device dev = g.device();
  // This rank's share of a synthetic batch (labels from a fixed linear teacher).
  k::Tensor x = k::randn({n, d}, k::f32, dev, 1 + static_cast<std::uint64_t>(g.rank()));
  k::Tensor y = k::argmax(k::matmul(x, k::randn({d, classes}, k::f32, dev, 99)), 1);
  // The same initial parameters on every rank (same seeds).
  std::vector<k::Tensor> p = {k::Tensor(k::randn({h, d}, k::f32, dev, 2) * 0.17f), k::zeros({h}, k::f32, dev),
                              k::Tensor(k::randn({classes, h}, k::f32, dev, 3) * 0.09f),
                              k::zeros({classes}, k::f32, dev)};
  std::vector<k::Tensor> m, v;
  for (auto& t : p) m.push_back(k::zeros(t.shape(), k::f32, dev)), v.push_back(k::zeros(t.shape(), k::f32, dev));
  auto loss = [](auto x, auto y, auto p) {
    return k::cross_entropy(k::linear(k::gelu(k::linear(x, p[0], p[1])), p[2], p[3]), y);
  };
  auto step = k::dist::data_parallel(k::value_and_grad(loss, k::wrt<2>), g);
  float lr = 1e-2f, bc1 = 1, bc2 = 1;
  auto adamw = k::compile([&](auto p, auto g, auto m, auto v) {
    auto m2 = m * 0.9f + g * 0.1f;
    auto v2 = v * 0.999f + g * g * 0.001f;
    auto p2 = p * (1 - lr * 0.01f) - (m2 / bc1) / (k::sqrt(v2 / bc2) + 1e-8f) * lr;
    return std::make_tuple(k::assign(p, p2), k::assign(m, m2), k::assign(v, v2));
  });
  for (int s = 1; s <= steps; ++s) {
    auto [l, grads] = step(x, y, p);  // grads: averaged over the ranks
    bc1 = 1 - std::pow(0.9f, static_cast<float>(s));
    bc2 = 1 - std::pow(0.999f, static_cast<float>(s));
    for (std::size_t i = 0; i < p.size(); ++i) adamw(p[i], grads[i], m[i], v[i]);
    // The mean loss over the ranks, for printing.
    k::Tensor mean_loss = k::all_reduce(l, g, k::reduce_op::avg);
    if (g.rank() == 0 && (s == 1 || s % 10 == 0))
      std::printf("step %3d  loss %.4f\n", s, k::to_vector<float>(mean_loss)[0]);
  }
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int ranks = k::driver::available() ? k::driver::device_count() : 1;
  std::printf("data-parallel MLP on %d rank%s (%s)\n", ranks, ranks == 1 ? "" : "s",
              k::driver::available() ? "one per GPU" : "the CPU");
  k::dist::spawn(ranks, [&](k::dist::group& g) { train(g, steps); });
  return 0;
}
