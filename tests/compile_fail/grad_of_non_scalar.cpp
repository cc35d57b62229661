// expect: k::grad needs a scalar-valued function: reduce the result with k::sum or k::mean, or use k::vjp
// k::grad of a function whose value is a whole tensor: it has no gradient in the sense of k::grad.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto not_scalar = [](auto x) { return x * 2.0f; };
  auto df = k::grad(not_scalar, k::wrt<0>);
  k::Tensor x = k::ones({3});
  k::Tensor dx = df(x);
  (void)dx;
}
