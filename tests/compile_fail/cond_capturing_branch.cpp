// expect: k::cond's branches are capture-less lambdas: pass the tensors they need as operands
// A branch that captures a tensor instead of taking it as an operand.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  k::Tensor x = k::ones({3}), y = k::ones({3});
  k::Tensor z = k::cond(
      k::sum(x) > 0.0f, [y](auto a) { return a + y; }, [](auto a) { return a; }, x);
  (void)z;
}
