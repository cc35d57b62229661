// expect: k::compile: the function is called with another number of tensors than it takes
// A compiled two-tensor function called with one tensor: the counts appear as
// takes_tensors<2>::called_with<1> in the instantiation note.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto f = k::compile([](auto a, auto b) { return a * b + 1.0f; });
  k::Tensor x = k::ones({3});
  k::Tensor y = f(x);
  (void)y;
}
