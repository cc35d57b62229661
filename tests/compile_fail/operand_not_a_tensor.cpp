// expect: kiln: operands must be tensors, kiln expressions or arithmetic scalars
// A std::vector beside a tensor: one sentence from kiln (the vector type is named in the
// instantiation note), not a page of unrelated operator+ candidates.
#include <kiln/kiln.hpp>
#include <vector>

namespace k = kiln;

int main() {
  k::Tensor x = k::ones({3});
  std::vector<float> v{1, 2, 3};
  auto y = x + v;
  (void)y;
}
