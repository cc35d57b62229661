// expect: k::structure: the function reads a host value with k::item, so it has no single structure
// k::structure of a function with a k::item graph break (API.md "Compile-time structure"): the
// function runs as several compiled segments, so no one graph is its structure.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  constexpr auto s = k::structure<1>([](auto x) {
    const float m = k::item<float>(k::sum(x));
    return x * m;
  });
  (void)s;
}
