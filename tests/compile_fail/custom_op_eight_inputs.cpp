// expect: a k::custom_op takes 1 to 7 inputs
// Graph nodes hold eight inputs (the op's backward node reads its inputs and the cotangent), so an
// eighth input cannot compile.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  k::CustomOp op = k::custom_op("eight", {.forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {}});
  k::Tensor x = k::ones({3});
  k::Tensor y = op(x, x, x, x, x, x, x, x);
  (void)y;
}
