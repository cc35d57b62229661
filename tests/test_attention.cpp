// k::attention (API.md "attention"): against the oracle's naive f64 softmax(q k^T * scale) v and a
// composition written here, causal and not, grouped-query heads, Tq != Tk, odd sizes, a given scale,
// bf16; gradients by gradcheck; typed errors naming the shapes; on the CPU and the GPU.
#include <doctest/doctest.h>

#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

void check_values(k::Device dev, k::dtype dt, double tol) {
  for (bool causal : {false, true})
    for (auto [H, Hkv] : {std::pair{4, 4}, std::pair{6, 2}}) {
      INFO("causal " << causal << " H " << H << " Hkv " << Hkv << " " << k::name(dt) << " on " << dev);
      k::Tensor q = k::randn({2, H, 7, 5}, dt, dev, 1), kk = k::randn({2, Hkv, 11, 5}, dt, dev, 2);
      k::Tensor v = k::randn({2, Hkv, 11, 3}, dt, dev, 3);
      auto a = k::attention(q, kk, v, {.causal = causal});
      k::Tensor got = a;
      CHECK(got.shape() == std::vector<std::int64_t>{2, H, 7, 3});
      CHECK(got.dtype() == dt);
      auto r = k::testing::allclose(got, k::reference::eval(a), tol, tol);
      CHECK_MESSAGE(r, r);
      auto scaled = k::attention(q, kk, v, {.causal = causal, .scale = 0.3});
      auto rs = k::testing::allclose(k::Tensor(scaled), k::reference::eval(scaled), tol, tol);
      CHECK_MESSAGE(rs, rs);
    }
  // Equal heads, no mask: the composition softmax(q k^T / sqrt(D)) v written with k::matmul.
  k::Tensor q = k::randn({3, 9, 16}, dt, dev, 4), kk = k::randn({3, 13, 16}, dt, dev, 5);
  k::Tensor v = k::randn({3, 13, 8}, dt, dev, 6);
  auto mine = k::matmul(k::softmax(k::matmul(q, k::transpose(kk, 1, 2)) * 0.25, -1), v);
  auto theirs = k::reshape(k::attention(k::reshape(q, {1, 3, 9, 16}), k::reshape(kk, {1, 3, 13, 16}),
                                        k::reshape(v, {1, 3, 13, 8})),
                           {3, 9, 8});
  auto r = k::testing::allclose(k::Tensor(theirs), k::reference::eval(mine), tol, tol);
  CHECK_MESSAGE(r, r);
}

}  // namespace

TEST_CASE("attention: against the oracle, causal and not, grouped-query heads, Tq != Tk (cpu)") {
  check_values(k::cpu, k::f32, 1e-5);
  check_values(k::cpu, k::bf16, 3e-2);
}
TEST_CASE("attention: against the oracle (cuda)" * needs_gpu()) {
  check_values(k::cuda, k::f32, 1e-5);
  check_values(k::cuda, k::bf16, 3e-2);
}

TEST_CASE("attention: gradients of q, k and v pass gradcheck (causal, grouped-query heads)") {
  k::Tensor q = k::randn({1, 4, 5, 3}, k::f64, k::cpu, 7), kk = k::randn({1, 2, 6, 3}, k::f64, k::cpu, 8);
  k::Tensor v = k::randn({1, 2, 6, 2}, k::f64, k::cpu, 9);
  CHECK(k::testing::gradcheck([](auto q, auto k, auto v) { return k::attention(q, k, v, {.causal = true}); }, q, kk, v));
  CHECK(k::testing::gradcheck([](auto q, auto k, auto v) { return k::attention(q, k, v, {.scale = 0.7}); }, q, kk, v));
}

TEST_CASE("attention: mismatched shapes and dtypes are errors naming them") {
  k::Tensor q = k::randn({1, 4, 5, 3}), kk = k::randn({1, 3, 6, 3}), v = k::randn({1, 3, 6, 2});
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, kk, v)),
                       doctest::Contains("k and v need the same number of heads, dividing q's (q [1, 4, 5, 3]"),
                       k::shape_error);
  k::Tensor k2 = k::randn({1, 2, 6, 4}), v2 = k::randn({1, 2, 6, 2});
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, k2, v2)), doctest::Contains("same head dimension"), k::shape_error);
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(k::randn({4, 5, 3}), k2, v2)), doctest::Contains("[B, H, T, D]"),
                       k::shape_error);
  k::Tensor k3 = k::randn({1, 2, 6, 3}, k::f64, k::cpu, 1);
  CHECK_THROWS_WITH_AS(k::Tensor(k::attention(q, k3, k::randn({1, 2, 6, 2}))), doctest::Contains("one floating dtype"),
                       k::dtype_error);
}
