// expect: k::structure: the function takes a gradient inside
// k::structure of a function that calls a k::grad: the gradient is expanded at the first call
// (autodiff/expand_gradients.hpp), so the constant-expression passes cannot give its structure.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  constexpr auto s = k::structure<1>([](auto x) {
    auto g = k::grad([](auto y) { return k::sum(y * y); }, k::wrt<0>);
    return g(x) * 2.0f;
  });
  (void)s;
}
