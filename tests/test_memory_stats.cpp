// k::memory_stats / k::reset_peak_memory_stats (API.md "Models"): bytes of live tensors, their peak
// and the allocator's cache, per device, checked against sizes computed here.
#include <doctest/doctest.h>

#include <cstdlib>

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

TEST_CASE("memory_stats (cpu): tensors count while alive, the peak stays until reset, wrapped memory never counts") {
  const k::memory_info before = k::memory_stats(k::cpu);
  CHECK(before.reserved >= before.allocated);  // large blocks freed earlier may be cached
  CHECK(before.peak >= before.allocated);
  std::size_t peak_with_both = 0;
  {
    k::Tensor a = k::empty({1000}, k::f32, k::cpu);  // 4,000 bytes in a 4,032-byte block
    CHECK(k::memory_stats(k::cpu).allocated == before.allocated + 4032);
    k::Tensor b = k::empty({3, 5}, k::f64, k::cpu);  // 120 bytes in 128
    const k::memory_info both = k::memory_stats(k::cpu);
    CHECK(both.allocated == before.allocated + 4032 + 128);
    CHECK(both.peak >= both.allocated);
    peak_with_both = both.peak;
    k::Tensor c = a;  // a handle: no new memory
    CHECK(k::memory_stats(k::cpu).allocated == both.allocated);
  }
  const k::memory_info after = k::memory_stats(k::cpu);
  CHECK(after.allocated == before.allocated);
  CHECK(after.peak == peak_with_both);  // the peak outlives the tensors
  k::reset_peak_memory_stats(k::cpu);
  CHECK(k::memory_stats(k::cpu).peak == after.allocated);

  std::vector<float> mine(256, 1.5f);
  k::Tensor view = k::Tensor::wrap(mine.data(), {256}, k::f32, k::cpu);
  CHECK(k::memory_stats(k::cpu).allocated == after.allocated);

  // An evaluation's result stays counted; the peak saw it.
  k::Tensor x = k::randn({64, 33}, k::f32, k::cpu, 3);
  const std::size_t with_x = k::memory_stats(k::cpu).allocated;
  k::reset_peak_memory_stats(k::cpu);
  k::Tensor y = k::softmax(x * 2.0f, -1);
  const k::memory_info evaluated = k::memory_stats(k::cpu);
  CHECK(evaluated.allocated >= with_x + 64 * 33 * 4);
  CHECK(evaluated.peak >= evaluated.allocated);
}

TEST_CASE("memory_stats (cuda): freed blocks leave allocated but stay reserved in the cache" * needs_gpu()) {
  k::synchronize();
  const k::memory_info before = k::memory_stats(k::cuda);
  CHECK(before.reserved >= before.allocated);
  const std::size_t bytes = std::size_t(3) << 20;  // 3 MiB: its own size class
  std::optional<k::Tensor> t = k::empty({static_cast<std::int64_t>(bytes / 4)}, k::f32, k::cuda);
  const k::memory_info held = k::memory_stats(k::cuda);
  CHECK(held.allocated == before.allocated + bytes);
  CHECK(held.peak >= held.allocated);
  CHECK(held.reserved >= held.allocated);
  t.reset();
  const k::memory_info freed = k::memory_stats(k::cuda);
  CHECK(freed.allocated == before.allocated);
  CHECK(freed.reserved >= freed.allocated + bytes);  // cached for the next tensor of that size
  CHECK(freed.peak >= held.allocated);
  k::reset_peak_memory_stats(k::cuda);
  CHECK(k::memory_stats(k::cuda).peak == freed.allocated);
}

TEST_CASE("memory_stats (cpu): a freed large host block is cached within the peak and reused, pages and all") {
  const std::size_t bytes = std::size_t(3) << 20;  // 3 MiB: its own size class
  const auto n = static_cast<std::int64_t>(bytes / 4);
  const k::memory_info before = k::memory_stats(k::cpu);
  std::optional<k::Tensor> t = k::full({n}, 2.5f, k::f32, k::cpu);
  const void* first = t->data_ptr();
  const k::memory_info held = k::memory_stats(k::cpu);
  CHECK(held.allocated == before.allocated + bytes);
  t.reset();
  const k::memory_info freed = k::memory_stats(k::cpu);
  CHECK(freed.allocated == before.allocated);
  CHECK(freed.reserved >= freed.allocated + bytes);  // kept: the peak holds it
  // The next tensor of that size class gets the same block and computes into it correctly.
  k::Tensor x = k::randn({n}, k::f32, k::cpu, 5);
  std::vector<float> xs = k::to_vector<float>(x);
  k::Tensor y = k::compile([](auto a) { return a * 3.0f - 1.0f; })(x);
  std::vector<float> ys = k::to_vector<float>(y);
  CHECK((x.data_ptr() == first || y.data_ptr() == first));
  for (std::size_t i = 0; i < xs.size(); i += 997) CHECK(ys[i] == doctest::Approx(xs[i] * 3.0f - 1.0f));
  CHECK(k::memory_stats(k::cpu).reserved >= k::memory_stats(k::cpu).allocated);
}

// The cache's policy on its own: within its limit, a newly freed block displaces the blocks freed
// longest ago (a process that moves from large tensors to smaller ones keeps its new working set
// warm instead of faulting in fresh pages at every call).
TEST_CASE("host cache: a freed block makes room by evicting the oldest, and is taken back newest first") {
  kiln::memory::HostCache c;
  const std::size_t mib = std::size_t(1) << 20, limit = 12 * mib;
  void* a = std::malloc(8 * mib);
  void* b = std::malloc(2 * mib);
  void* d = std::malloc(4 * mib);
  REQUIRE((a && b && d));
  CHECK(c.keep(a, 8 * mib, limit));
  CHECK(c.keep(b, 2 * mib, limit));
  CHECK(c.cached_bytes() == 10 * mib);
  CHECK(c.keep(d, 4 * mib, limit));  // 14 > 12: a, the oldest, goes
  CHECK(c.cached_bytes() == 6 * mib);
  CHECK(c.take(8 * mib) == nullptr);
  void* b2 = std::malloc(2 * mib);
  REQUIRE(b2);
  CHECK(c.keep(b2, 2 * mib, limit));
  CHECK(c.take(2 * mib) == b2);  // the newest of its size first
  CHECK(c.take(2 * mib) == b);
  CHECK(c.take(2 * mib) == nullptr);
  void* big = std::malloc(16 * mib);
  REQUIRE(big);
  CHECK_FALSE(c.keep(big, 16 * mib, limit));  // past the limit on its own: the caller frees it
  std::free(big);
  CHECK_FALSE(c.keep(b, std::size_t(512) << 10, limit));  // under a megabyte: never cached
  CHECK(c.cached_bytes() == 4 * mib);
  CHECK(c.release() == 4 * mib);  // frees d
  CHECK(c.cached_bytes() == 0);
  std::free(b);
  std::free(b2);
}

TEST_CASE("memory_stats of a CUDA device on a machine without one is a device_error" * needs_no_gpu()) {
  CHECK_THROWS_AS(k::memory_stats(k::cuda), k::device_error);
  CHECK_THROWS_AS(k::reset_peak_memory_stats(k::cuda(1)), k::device_error);
}

namespace {

template <int N>
auto residual_chain(auto h, auto w) {
  if constexpr (N == 0)
    return h;
  else {
    auto r = residual_chain<N - 1>(h, w);
    return k::relu(k::matmul(r, w)) * 0.5f + r;
  }
}

// The peak of one call of a 12-block residual chain on `dev`, beyond what was allocated before it,
// in buffers of the blocks' [97, 97] f32 shape; checks the result against the oracle.
double chain_peak_in_buffers(k::Device dev) {
  auto f = k::compile([](auto h, auto w) { return residual_chain<12>(h, w); });
  k::Tensor h = k::randn({97, 97}, k::f32, k::cpu, 3), w = k::randn({97, 97}, k::f32, k::cpu, 4);
  k::eval(w, w * 0.1f);  // keeps the chain's values moderate
  k::Tensor hd = h.to(dev), wd = w.to(dev);
  k::Tensor warm = f(hd, wd);  // compiled; its blocks cached
  k::synchronize();
  warm = k::Tensor();
  const std::int64_t before = k::memory_stats(dev).allocated;
  k::reset_peak_memory_stats(dev);
  k::Tensor y = f(hd, wd);
  k::synchronize();
  const std::int64_t peak = k::memory_stats(dev).peak;
  auto r = k::testing::allclose(y.to(k::cpu), k::reference::eval(residual_chain<12>(h, w)), 1e-4, 1e-4);
  CHECK_MESSAGE(bool(r), r);
  return static_cast<double>(peak - before) / (97.0 * 97.0 * 4.0);
}

}  // namespace

TEST_CASE("memory_stats (cpu): a program's intermediates live from the step that writes them to the last that reads it") {
  // 24 intermediates (12 products, 12 block outputs) if all lived for the whole call; a block reads
  // only the one before it, so about three at a time, plus the output.
  const double peak = chain_peak_in_buffers(k::cpu);
  MESSAGE("peak of one call: " << peak << " buffers");
  CHECK(peak >= 1.0);  // the output at least
  CHECK(peak <= 6.0);
}

TEST_CASE("memory_stats (cuda): a program's intermediates live from the step that writes them to the last that reads it" *
          needs_gpu()) {
  const double peak = chain_peak_in_buffers(k::cuda);
  MESSAGE("peak of one call: " << peak << " buffers");
  CHECK(peak >= 1.0);
  CHECK(peak <= 6.0);
}

TEST_CASE("pack_buffers: buffers live together never overlap, and the block is the live peak here") {
  // Steps 0-3; buffers 1 and 2 live together, 3 after 1, 4 after both (larger than either).
  k::runtime::BufferLifetimes life;
  life.allocate_before = {{1, 2}, {}, {3}, {4}};
  life.release_after = {{1}, {2}, {3}, {4}};
  const std::size_t bytes[] = {0, 400, 100, 300, 1000};
  auto packed = k::runtime::pack_buffers(life, 5, [&](int b) { return bytes[b]; });
  CHECK(packed.offset_of[0] == -1);
  // Rounded to 256 bytes: 512, 256, 512, 1024; the busiest step is 3 (1024), then 0 (768).
  CHECK(packed.live_peak == 1024);
  CHECK(packed.bytes == 1024);  // one block a buffer, grown to fit, took 1100 (rounded, 1280)
  CHECK(packed.offset_of[1] % 256 == 0);
  CHECK((packed.offset_of[1] + 512 <= packed.offset_of[2] || packed.offset_of[2] + 256 <= packed.offset_of[1]));
}

// Random lifetimes over 40 steps: every two buffers live at one step are apart in the block, the
// block is at least the live peak (it cannot be less) and, greedy by size, within a third of it.
TEST_CASE("pack_buffers: random lifetimes, no overlap while live, near the live peak") {
  std::mt19937 rng(7);
  for (int round = 0; round < 50; ++round) {
    const int steps = 40, n = 120;
    k::runtime::BufferLifetimes life;
    life.allocate_before.assign(steps, {});
    life.release_after.assign(steps, {});
    std::vector<std::size_t> size(n, 0);
    std::vector<int> first(n), last(n);
    for (int b = 1; b < n; ++b) {
      first[b] = static_cast<int>(rng() % steps);
      last[b] = std::min(steps - 1, first[b] + static_cast<int>(rng() % 8));
      size[b] = 1 + rng() % (rng() % 4 == 0 ? 1 << 20 : 1 << 14);
      life.allocate_before[first[b]].push_back(b);
      life.release_after[last[b]].push_back(b);
    }
    auto packed = k::runtime::pack_buffers(life, n, [&](int b) { return size[b]; });
    auto rounded = [&](int b) { return static_cast<std::ptrdiff_t>((size[b] + 255) / 256 * 256); };
    for (int a = 1; a < n; ++a)
      for (int b = a + 1; b < n; ++b) {
        if (first[a] > last[b] || first[b] > last[a]) continue;
        const std::ptrdiff_t oa = packed.offset_of[a], ob = packed.offset_of[b];
        CHECK_MESSAGE((oa + rounded(a) <= ob || ob + rounded(b) <= oa), "buffers " << a << " and " << b);
      }
    CHECK(packed.bytes >= packed.live_peak);
    CHECK(packed.bytes <= packed.live_peak + packed.live_peak / 3);
  }
}

// A plain run allocates each fresh output as the step that writes it starts: a product that a
// sum consumes is released before the output that the last kernel writes exists, so the run's
// peak is one [512, 512] matrix and the inputs, not two (a training step's gradients do not sit
// on top of its forward's activations).
TEST_CASE("memory_stats (cpu): a run's outputs are allocated as their steps start, not all at once") {
  const std::int64_t n = 512;
  auto x = k::randn({n, n}, k::f32, k::cpu, 5), w = k::randn({n, n}, k::f32, k::cpu, 6);
  auto f = k::compile([](auto x, auto w) { return x * k::sum(k::matmul(x, w)); });
  k::Tensor warm = f(x, w);  // compiled; its kernels and scratch exist
  const k::Tensor want = k::reference::eval(x * k::sum(k::matmul(x, w)));
  warm = k::Tensor();
  const std::size_t base = k::memory_stats(k::cpu).allocated;
  k::reset_peak_memory_stats(k::cpu);
  k::Tensor y = f(x, w);
  const std::size_t matrix = static_cast<std::size_t>(n * n) * 4;
  const k::memory_info after = k::memory_stats(k::cpu);
  CHECK(after.allocated >= base + matrix);             // the result stays
  CHECK(after.peak < base + 2 * matrix);               // never the product and the result at once
  auto r = k::testing::allclose(y, want, 1e-3, 1e-3);  // x times one sum: the sum's relative error
  CHECK_MESSAGE(bool(r), r);
}
