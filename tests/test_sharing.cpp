// Shared subexpressions (issue 25): reusing an expression (`h + f(h)`) shares its nodes instead of
// copying them, so a chain of residual blocks costs in proportion to its distinct nodes. Residual
// chains of 1, 4, 12 and 24 blocks on the CPU: values against the oracle, gradients by gradcheck,
// distinct-node counts linear in the blocks; and sharing that differs under one expression type
// (`y + y` with y = x * a, or x * a + x * b) compiles and runs as two different programs.
#include <doctest/doctest.h>

#include <cstdint>
#include <tuple>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "residual_chain.hpp"

namespace k = kiln;

namespace {

template <int N>
auto chain_fn() {
  return [](auto h, auto w, auto g, auto b) { return residual_chain<N>(h, w, g, b); };
}

struct Inputs {
  k::Tensor h, w, g, b;
};
Inputs inputs(std::int64_t rows, std::int64_t d, k::dtype dt = k::f32) {
  return {k::randn({rows, d}, dt, k::cpu, 71), k::Tensor(k::randn({d, d}, dt, k::cpu, 72) * (0.5 / d)),
          k::Tensor(k::randn({d}, dt, k::cpu, 73) * 0.1 + 1.0), k::Tensor(k::randn({d}, dt, k::cpu, 74) * 0.1)};
}

// What one walk of a chain's expression meets: distinct nodes (their attributes) and repeated
// meetings of a shared node.
template <int N>
std::pair<int, int> walk_counts(const Inputs& in) {
  auto e = residual_chain<N>(in.h, in.w, in.g, in.b);
  k::graph::Captured cap;
  k::graph::gather(e, cap);
  return {cap.na - (cap.meetings > 0), cap.meetings};  // (the last attribute records the sharing)
}

template <int N>
void check_chain_values(const Inputs& in) {
  INFO(N << " blocks");
  auto fn = chain_fn<N>();
  auto f = k::compile(fn);
  k::Tensor got = f(in.h, in.w, in.g, in.b);
  k::Tensor want = k::reference::eval(fn(in.h, in.w, in.g, in.b));
  auto r = k::testing::allclose(got, want, 2e-3, 2e-4);
  INFO(r.str());
  CHECK(r);
  k::Tensor again = f(in.h, in.w, in.g, in.b);  // the cached program
  CHECK(k::testing::allclose(again, want, 2e-3, 2e-4));
  CHECK(f.cache().compiles() == 1);
}

}  // namespace

TEST_CASE("sharing: residual chains of 1, 4, 12 and 24 blocks match the oracle") {
  Inputs in = inputs(7, 19);
  check_chain_values<1>(in);
  check_chain_values<4>(in);
  check_chain_values<12>(in);
  check_chain_values<24>(in);
}

TEST_CASE("sharing: a chain's expression and its captured graph grow linearly with its blocks") {
  Inputs in = inputs(7, 19);
  auto [n1, m1] = walk_counts<1>(in);
  auto [n2, m2] = walk_counts<2>(in);
  auto [n12, m12] = walk_counts<12>(in);
  auto [n24, m24] = walk_counts<24>(in);
  INFO("distinct nodes " << n1 << " " << n2 << " " << n12 << " " << n24 << ", repeated meetings " << m1 << " " << m2
                         << " " << m12 << " " << m24);
  const int per_block = n2 - n1;
  CHECK(per_block > 0);
  CHECK(n12 == n1 + 11 * per_block);  // one more block adds the same number of distinct nodes
  CHECK(n24 == n1 + 23 * per_block);
  CHECK(m24 - m12 == 12 * (m2 - m1));
  // The expression object is one handle, whatever its depth.
  CHECK(sizeof(residual_chain<24>(in.h, in.w, in.g, in.b)) == sizeof(residual_chain<1>(in.h, in.w, in.g, in.b)));
  // The captured graph: ops grow by the same count a block.
  auto ops = [&](auto fn) { return k::explain(k::compile(fn), in.h, in.w, in.g, in.b).ops_captured; };
  int o1 = ops(chain_fn<1>()), o2 = ops(chain_fn<2>()), o12 = ops(chain_fn<12>()), o24 = ops(chain_fn<24>());
  INFO("ops captured " << o1 << " " << o2 << " " << o12 << " " << o24);
  CHECK(o12 == o1 + 11 * (o2 - o1));
  CHECK(o24 == o1 + 23 * (o2 - o1));
}

TEST_CASE("sharing: gradients of residual chains pass gradcheck") {
  Inputs in = inputs(3, 5, k::f64);
  for (auto r : {k::testing::gradcheck(chain_fn<1>(), in.h, in.w, in.g, in.b),
                 k::testing::gradcheck(chain_fn<4>(), in.h, in.w, in.g, in.b),
                 k::testing::gradcheck(chain_fn<12>(), in.h, in.w, in.g, in.b)}) {
    INFO(r);
    CHECK(r);
  }
  // The compiled gradient of a 4-block chain against a central difference of the oracle's loss
  // along a random direction v: d/de loss(w + e v) = sum(dw * v). (Its backward kernels differ
  // block by block: w is shared, so each compiles; 12 blocks cost ~35 s of host compiles here.)
  auto loss = [](auto h, auto w, auto g, auto b) { return k::sum(residual_chain<4>(h, w, g, b) * h); };
  Inputs f = inputs(6, 11, k::f64);
  k::Tensor dw = k::compile(k::grad(loss, k::wrt<1>))(f.h, f.w, f.g, f.b);
  k::Tensor v = k::randn({11, 11}, k::f64, k::cpu, 78);
  const double eps = 1e-5;
  auto at = [&](double e) {
    k::Tensor we = f.w + v * e;
    return k::to_vector<double>(k::reference::eval(loss(f.h, we, f.g, f.b)))[0];
  };
  double numeric = (at(eps) - at(-eps)) / (2 * eps);
  double analytic = k::to_vector<double>(k::reference::eval(k::sum(dw * v)))[0];
  INFO("analytic " << analytic << " numeric " << numeric);
  CHECK(analytic == doctest::Approx(numeric).epsilon(1e-5));
}

TEST_CASE("sharing: one expression type shared two ways compiles two programs with the right values") {
  k::Tensor x = k::randn({5, 33}, k::f32, k::cpu, 75);
  float a = 1.5f, b = -0.25f;
  bool share = true;
  // Both branches have one type: add<mul<x, scalar>, mul<x, scalar>>.
  auto f = k::compile([&](auto t) {
    if (share) {
      auto y = t * a;
      return y + y;
    }
    return t * a + t * b;
  });
  auto want = [&](double c) { return k::reference::eval(x * static_cast<float>(c)); };
  CHECK(k::testing::allclose(f(x), want(2.0 * a), 1e-5, 1e-6));
  share = false;
  CHECK(k::testing::allclose(f(x), want(a + b), 1e-5, 1e-6));
  share = true;
  CHECK(k::testing::allclose(f(x), want(2.0 * a), 1e-5, 1e-6));
  CHECK(f.cache().compiles() == 2);

  // Full reductions (a derived node type) of a shared subexpression, compiled and eager.
  auto g = k::compile([&](auto t) {
    auto y = t * a;
    return k::sum(y) + k::amax(y) * y + k::mean(k::exp(y), 1, true);
  });
  auto y0 = x * a;
  auto full = k::sum(y0) + k::amax(y0) * y0 + k::mean(k::exp(y0), 1, true);
  k::Tensor full_want = k::reference::eval(full);
  CHECK(k::testing::allclose(g(x), full_want, 1e-4, 1e-4));
  CHECK(k::testing::allclose(k::Tensor(full), full_want, 1e-4, 1e-4));

  // Eagerly: the same expression type through one eager cache.
  auto y = x * a;
  k::Tensor shared = y + y;
  k::Tensor split = x * a + x * b;
  CHECK(k::testing::allclose(shared, want(2.0 * a), 1e-5, 1e-6));
  CHECK(k::testing::allclose(split, want(a + b), 1e-5, 1e-6));
}

TEST_CASE("sharing: outputs of one function sharing a subexpression") {
  k::Tensor x = k::randn({4, 65}, k::f32, k::cpu, 76), w = k::randn({65, 65}, k::f32, k::cpu, 77) * 0.1;
  auto fn = [](auto a, auto m) {
    auto h = k::gelu(k::matmul(a, m));
    return std::make_tuple(h, k::softmax(h, -1), h * a);
  };
  auto [h, s, p] = k::compile(fn)(x, w);
  auto [rh, rs, rp] = k::reference::eval(fn(x, w));
  CHECK(k::testing::allclose(h, rh, 1e-4, 1e-5));
  CHECK(k::testing::allclose(s, rs, 1e-4, 1e-5));
  CHECK(k::testing::allclose(p, rp, 1e-4, 1e-5));
}
