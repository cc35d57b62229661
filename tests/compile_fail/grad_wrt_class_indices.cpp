// expect: k::wrt names an integer argument .class indices. that has no gradient
// The targets of cross_entropy are i64 class indices: they have no gradient.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto df = k::grad([](auto logits, auto targets) { return k::cross_entropy(logits, targets); }, k::wrt<0, 1>);
  k::Tensor logits = k::ones({4, 10}), targets = k::ones({4});
  auto [dl, dt] = df(logits, targets);
  (void)dl;
  (void)dt;
}
