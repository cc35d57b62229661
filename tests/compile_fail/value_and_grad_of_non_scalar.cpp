// expect: k::value_and_grad needs a scalar-valued function
// A softmax keeps its input's shape, so its value is not a single element.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto f = k::value_and_grad([](auto x, auto w) { return k::softmax(k::matmul(x, w), 1); }, k::wrt<1>);
  k::Tensor x = k::ones({2, 3}), w = k::ones({3, 4});
  auto [loss, dw] = f(x, w);
  (void)loss;
  (void)dw;
}
