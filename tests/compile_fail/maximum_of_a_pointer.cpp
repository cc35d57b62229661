// expect: kiln: operands must be tensors, kiln expressions or arithmetic scalars
// The binary functions (k::maximum, k::minimum) reject what the operators reject, with the same sentence.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  k::Tensor x = k::ones({3});
  const float* p = nullptr;
  auto y = k::maximum(p, x * 2.0f);
  (void)y;
}
