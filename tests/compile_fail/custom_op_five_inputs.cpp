// expect: a k::custom_op takes 1 to 4 inputs
// Graph nodes hold four inputs (five for the op's backward node), so a fifth input cannot compile.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  k::CustomOp op = k::custom_op("five", {.forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {}});
  k::Tensor x = k::ones({3});
  k::Tensor y = op(x, x, x, x, x);
  (void)y;
}
