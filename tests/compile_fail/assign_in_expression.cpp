// expect: a k::assign is a compiled function's result, not a value
// An update held in a k::expression (a std::vector<k::expression> of updates): it has no value to
// compute, so it cannot be an operand or an erased expression; the function returns it instead.
#include <kiln/kiln.hpp>

#include <vector>

namespace k = kiln;

int main() {
  auto f = k::compile([](auto p) {
    std::vector<k::expression> out;
    out.push_back(k::assign(p[0], p[0] * 2.0f));
    return out;
  });
  std::vector<k::Tensor> p = {k::ones({3})};
  f(p);
}
