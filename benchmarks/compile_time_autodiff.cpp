// Compile-time benchmark (issue 3): this translation unit holds k::value_and_grad of an MLP with
// layer_norm and a cross_entropy loss, compiled with k::compile. What is measured is how long the
// C++ compiler takes on it (`time g++ -O2 -c`, budget 15 s on one core); running it does one
// training step on the CPU and prints the loss and a gradient norm.
#include <kiln/kiln.hpp>

#include <cmath>
#include <cstdio>

namespace k = kiln;

int main() {
  const std::int64_t batch = 32, in = 64, hidden = 128, classes = 10;
  auto loss = [](auto x, auto g, auto b, auto w1, auto b1, auto w2, auto b2, auto targets) {
    auto h = k::gelu(k::linear(k::layer_norm(x, g, b), w1, b1));
    return k::cross_entropy(k::linear(h, w2, b2), targets);
  };
  auto step = k::compile(k::value_and_grad(loss, k::wrt<1, 2, 3, 4, 5, 6>));

  k::Tensor x = k::randn({batch, in}, k::f32, k::cpu, 1);
  k::Tensor g = k::ones({in}), b = k::zeros({in});
  k::Tensor w1 = k::randn({hidden, in}, k::f32, k::cpu, 2), b1 = k::zeros({hidden});
  k::Tensor w2 = k::randn({classes, hidden}, k::f32, k::cpu, 3), b2 = k::zeros({classes});
  k::Tensor targets = k::from_vector(std::vector<std::int64_t>(batch, 3), {batch});

  auto [value, dg, db, dw1, db1, dw2, db2] = step(x, g, b, w1, b1, w2, b2, targets);
  double norm = 0;
  for (float v : k::to_vector<float>(dw1)) norm += double(v) * v;
  std::printf("loss %.6f  |dloss/dw1| %.6f\n", k::to_vector<float>(value)[0], std::sqrt(norm));
}
