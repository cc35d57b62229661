// expect: k::wrt<...> names an argument that the function does not take
// k::wrt<2> names a third argument, but the function is called with two.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto df = k::grad([](auto x, auto w) { return k::sum(x * w); }, k::wrt<0, 2>);
  k::Tensor x = k::ones({3}), w = k::ones({3});
  auto [dx, dw] = df(x, w);
  (void)dx;
  (void)dw;
}
