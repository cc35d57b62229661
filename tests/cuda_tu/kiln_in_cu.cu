// kiln included from a CUDA translation unit: nvcc must accept the headers beside a
// user's own __global__ kernel, and the host side must still evaluate on the CPU.
#include <kiln/kiln.hpp>

#include <cstdio>
#include <vector>

namespace k = kiln;

// Never launched (CI has no GPU): it only proves device code coexists with kiln.
__global__ void scale(float* data, float factor, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] *= factor;
}

int main() {
  k::Tensor x = k::from_vector(std::vector<float>{1, 2, 3}, {3});
  k::Tensor y = x * 2.0f;
  if (k::to_vector<float>(y) != std::vector<float>{2, 4, 6}) {
    std::fprintf(stderr, "kiln_in_cu: x * 2 gave the wrong values\n");
    return 1;
  }
  return 0;
}
