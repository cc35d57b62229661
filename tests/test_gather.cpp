// A gather reads its source from memory, so before rewrite/simplify.hpp's gather_before_pointwise a
// gather of a pointwise value (cross_entropy's target logit, picked from the f32 cast of bf16
// logits) wrote that whole value into a buffer: a full-size f32 copy of the logits, read once
// for one element a row (bf16 cross_entropy ran at 13-25% of the copy ceiling on an H200). Now the
// gather moves before the pointwise op. Values against the oracle / a host computation in f64.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "guarded_memory.hpp"
#include "have_gpu.hpp"

namespace k = kiln;

namespace {

// cross_entropy's mean loss and its gradient over logits [rows, cols], in f64 on the host.
std::pair<double, std::vector<double>> host_cross_entropy(const std::vector<double>& l, const std::vector<double>& t,
                                                          std::int64_t rows, std::int64_t cols) {
  std::vector<double> grad(l.size());
  double loss = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, s = 0;
    for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, l[r * cols + c]);
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(l[r * cols + c] - m);
    auto picked = static_cast<std::int64_t>(t[r]);
    loss += (m + std::log(s) - l[r * cols + picked]) / rows;
    for (std::int64_t c = 0; c < cols; ++c)
      grad[r * cols + c] = (std::exp(l[r * cols + c] - m) / s - (c == picked ? 1.0 : 0.0)) / rows;
  }
  return {loss, std::move(grad)};
}

k::Tensor targets(std::int64_t rows, std::int64_t cols, k::Device dev, std::uint64_t seed) {
  return k::Tensor(k::cast(k::rand({rows}, k::f32, k::cpu, seed) * static_cast<float>(cols - 1), k::i64)).to(dev);
}

// The loss and the gradient of cross_entropy over bf16 logits of odd sizes; no kernel of the
// program is a plain copy (the f32 cast written out).
void cross_entropy_bf16(k::Device dev) {
  constexpr std::int64_t rows = 37, cols = 1003;
  k::Tensor logits = k::Tensor(k::cast(k::randn({rows, cols}, k::f32, k::cpu, 71) * 3.0f, k::bf16)).to(dev);
  k::Tensor target = targets(rows, cols, dev, 72);
  auto f = k::compile(k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>));
  auto [loss, dlogits] = f(logits, target);

  auto [want_loss, grad] =
      host_cross_entropy(k::reference::read(logits).data, k::reference::read(target).data, rows, cols);
  // The loss comes back in bf16, like torch's: within half a bf16 ulp (2^-9 relative).
  CHECK(k::reference::read(loss).data[0] == doctest::Approx(want_loss).epsilon(4e-3));
  auto r = k::testing::allclose(dlogits.to(k::cpu), k::from_vector(std::move(grad), {rows, cols}), 1e-2, 1e-4);
  CHECK_MESSAGE(bool(r), r);
  k::report e = k::explain(f, logits, target);
  for (const auto& ki : e.kernels) CHECK_MESSAGE(ki.name.find("copy") == std::string::npos, e);
}

}  // namespace

TEST_CASE("gather: cross_entropy over bf16 logits picks from them, not from a copy (cpu)") {
  cross_entropy_bf16(k::cpu);
}

TEST_CASE("gather: cross_entropy over bf16 logits picks from them, not from a copy (cuda)" * needs_gpu()) {
  cross_entropy_bf16(k::cuda);
}

// A mean over many rows is split into chunks; with symbolic sizes the last chunk is padded, and its
// positions past the rows must read nothing. The gather of each row's target logit did (its load
// lacked the padding's mask: on an H200 a read 0.5 MB past the logits faulted, once the allocation
// after them was elsewhere). Here the logits end at an inaccessible page.
TEST_CASE("gather: a dynamic cross_entropy's padded split reads no row past its logits (cpu, guard page)") {
  auto f = k::compile(k::value_and_grad([](auto l, auto t) { return k::cross_entropy(l, t); }, k::wrt<0>),
                      {.shapes = k::shapes::dynamic});
  auto loss_only = k::compile([](auto l, auto t) { return k::cross_entropy(l, t); }, {.shapes = k::shapes::dynamic});
  constexpr std::int64_t cols = 37;
  for (std::int64_t rows : {16411, 21017, 33331}) {
    CAPTURE(rows);
    GuardedHost logits(k::randn({rows, cols}, k::f32, k::cpu, 80 + rows));
    GuardedHost target(targets(rows, cols, k::cpu, 90 + rows));
    auto [want_loss, grad] =
        host_cross_entropy(k::reference::read(logits.tensor).data, k::reference::read(target.tensor).data, rows, cols);
    auto [loss, dlogits] = f(logits.tensor, target.tensor);
    CHECK(k::reference::read(loss).data[0] == doctest::Approx(want_loss).epsilon(1e-5));
    CHECK(k::reference::read(loss_only(logits.tensor, target.tensor)).data[0] ==
          doctest::Approx(want_loss).epsilon(1e-5));
    auto r = k::testing::allclose(dlogits, k::from_vector(std::move(grad), {rows, cols}), 1e-4, 1e-7);
    CHECK_MESSAGE(bool(r), r);
  }
  CHECK(f.cache().compiles() == 1);
  CHECK(loss_only.cache().compiles() == 1);
}
