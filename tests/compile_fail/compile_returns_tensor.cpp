// expect: a compiled or differentiated function returns kiln expressions, not a k::Tensor
// A compiled function that returns a k::Tensor: k::Tensor(expr) evaluates while the function is
// traced, so the program would return the first call's values again at every call.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto f = k::compile([](auto x) { return k::Tensor(x * 2.0f); });
  k::Tensor x = k::ones({3});
  k::Tensor y = f(x);
  (void)y;
}
