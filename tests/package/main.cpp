// The smallest real use of kiln from a downstream project, shared by the add_subdirectory
// and find_package package tests: include, build a tensor, evaluate, read back.
#include <kiln/kiln.hpp>

#include <cstdio>
#include <vector>

namespace k = kiln;

int main() {
  k::Tensor x = k::from_vector(std::vector<float>{1, 2, 3}, {3});
  k::Tensor y = x * 2.0f + 1.0f;
  if (k::to_vector<float>(y) != std::vector<float>{3, 5, 7}) {
    std::fprintf(stderr, "package test: x * 2 + 1 gave the wrong values\n");
    return 1;
  }
  std::puts("package test: ok");
  return 0;
}
