// expect: kiln::grad needs a scalar-valued function
// PLACEHOLDER for the autodiff engineer: written by the build engineer to show the
// mechanism; replace the sentence above (a CMake regex matched against the compiler's
// "static assertion failed" line) and the misuse below with the real ones. Until
// k::grad exists and rejects this with that sentence, this test fails on purpose.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  // x * 2 is a tensor, not a scalar, so it has no gradient in the sense of k::grad.
  auto not_scalar = [](auto x) { return x * 2.0f; };
  auto df = k::grad(not_scalar, k::wrt<0>);
  k::Tensor x = k::ones({3});
  k::Tensor dx = df(x);
  (void)dx;
}
