// expect: a compiled function runs on k::Tensor or std::vector<k::Tensor> arguments
// An unevaluated expression (k::cast(...)) passed where a compiled call needs a tensor: explain and
// stream calls reach the program cache directly, so the sentence comes from there.
#include <kiln/kiln.hpp>

namespace k = kiln;

int main() {
  auto f = k::compile([](auto a, auto t) { return a * k::cast(t, k::f32); });
  k::Tensor x = k::ones({3});
  auto r = k::explain(f, x, k::cast(x, k::i64));
  (void)r;
}
