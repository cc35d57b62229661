// kiln's quick start: the classic gelu(x @ W + b) of the torch.compile literature and a softmax,
// compiled into fused kernels, run on the GPU when one is usable (else on the CPU), checked
// against the f64 reference, with kiln's explain report.
#include <iostream>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

int main() {
  k::Device dev = k::driver::available() ? k::Device(k::cuda) : k::cpu;
  std::cout << "kiln quick start on " << dev << "\n\n";

  auto x = k::randn({64, 256}, k::f32, dev, 1);
  auto w = k::randn({256, 128}, k::f32, dev, 2) * 0.0625f;
  k::Tensor W = w;
  auto b = k::randn({128}, k::f32, dev, 3);

  // Capture: the lambda's return type is the graph; nothing runs until it is called.
  auto mlp = k::compile([](auto x, auto W, auto b) { return k::gelu(k::matmul(x, W) + b); });
  k::Tensor y = mlp(x, W, b);
  std::cout << "gelu(x @ W + b): y[0, :4] =";
  auto yv = k::to_vector<float>(y);
  for (int i = 0; i < 4; ++i) std::cout << " " << yv[i];
  std::cout << "\n  vs reference: "
            << k::testing::allclose(y, k::reference::eval(k::gelu(k::matmul(x, W) + b)), 1e-4, 1e-4) << "\n\n"
            << k::explain(mlp, x, W, b) << "\n";

  // An eager expression is compiled and cached the same way.
  k::Tensor p = k::softmax(x * 0.5f, -1);
  std::cout << "softmax(x * 0.5, -1): row sums ";
  k::Tensor sums = k::sum(p, -1);
  auto sv = k::to_vector<float>(sums);
  std::cout << sv[0] << " " << sv[1] << " " << sv[63] << "\n";
  auto report = k::explain(k::softmax(x * 0.5f, -1));
  std::cout << report << "\n" << report.kernels.front().source;
}
