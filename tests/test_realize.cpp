// schedule/realize.hpp: a pointwise value that several kernels read gets a buffer when recomputing
// it would cost more loads than storing it once, (C - 1)(R - 1) > 2. The case that made it: a
// pre-norm residual stream x + f(layer_norm(x)), where every later norm would otherwise re-read
// every earlier block's output (GPT-2's norms re-read the embedding and all residual adds).
#include <doctest/doctest.h>

#include <cstdlib>
#include <string>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

template <int N>
auto prenorm_chain(auto x, auto w, auto g, auto b) {
  if constexpr (N == 0) {
    return x;
  } else {
    auto r = prenorm_chain<N - 1>(x, w, g, b);
    return r + k::gelu(k::matmul(k::layer_norm(r, g, b), w)) * 0.5f;
  }
}

// The most buffers any generated kernel of the program reads.
int most_inputs(const k::report& r) {
  int most = 0;
  for (const auto& kern : r.kernels) {
    if (kern.kind == "extern") continue;
    const std::string head = kern.source.substr(0, kern.source.find('{'));
    int n = 0;
    for (auto at = head.find("in_ptr"); at != std::string::npos; at = head.find("in_ptr", at + 1)) ++n;
    most = std::max(most, n);
  }
  return most;
}

struct ScopedEnv {
  const char* name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name); }
};

auto chain8 = [](auto x, auto w, auto g, auto b) { return prenorm_chain<8>(x, w, g, b); };

}  // namespace

TEST_CASE("realize: a pre-norm residual stream is stored once, not re-read by every later norm") {
  auto x = k::randn({61, 48}, k::f32, k::cpu, 1);
  auto w = k::Tensor(k::randn({48, 48}, k::f32, k::cpu, 2) * 0.1f);
  auto g = k::randn({48}, k::f32, k::cpu, 3), b = k::randn({48}, k::f32, k::cpu, 4);
  auto f = k::compile(chain8);
  auto want = k::reference::eval(chain8(x, w, g, b));
  auto r = k::testing::allclose(f(x, w, g, b), want, 1e-4, 1e-5);
  CHECK_MESSAGE(bool(r), r);
  const int with = most_inputs(k::explain(f, x, w, g, b));
  int without = 0;
  {
    ScopedEnv off("KILN_TUNE_REALIZE", "0");  // the pass off: every norm recomputes the stream
    auto f0 = k::compile(chain8);
    auto r0 = k::testing::allclose(f0(x, w, g, b), want, 1e-4, 1e-5);
    CHECK_MESSAGE(bool(r0), r0);
    without = most_inputs(k::explain(f0, x, w, g, b));
  }
  INFO("most kernel inputs: " << with << " realized, " << without << " recomputed");
  CHECK(with <= 6);
  CHECK(without >= 9);
}

TEST_CASE("realize: the gradient of the chain matches the oracle, and its kernels stay narrow") {
  auto x = k::randn({29, 24}, k::f64, k::cpu, 5);
  auto w = k::Tensor(k::randn({24, 24}, k::f64, k::cpu, 6) * 0.1);
  auto g = k::randn({24}, k::f64, k::cpu, 7), b = k::randn({24}, k::f64, k::cpu, 8);
  auto loss = [](auto x, auto w, auto g, auto b) { return k::sum(k::tanh(prenorm_chain<4>(x, w, g, b))); };
  auto check = k::testing::gradcheck(loss, x, w, g, b);
  CHECK_MESSAGE(bool(check), check);
  auto step = k::compile(k::value_and_grad(loss, k::wrt<0, 1, 2, 3>));
  CHECK(most_inputs(k::explain(step, x, w, g, b)) <= 10);
}
