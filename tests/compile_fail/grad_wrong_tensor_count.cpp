// expect: k::compile: the function is called with another number of tensors than it takes
// The gradient of a two-tensor function called with three tensors.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto df = k::grad([](auto a, auto b) { return k::sum(a * b); }, k::wrt<0>);
  k::Tensor x = k::ones({3});
  k::Tensor dx = df(x, x, x);
  (void)dx;
}
