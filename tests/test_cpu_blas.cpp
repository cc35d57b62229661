// Host GEMMs through a BLAS found at run time (runtime/extern/cpu_blas.hpp): the same products as
// the blocked GEMM (KILN_BLAS=none) for plain, transposed, batched and broadcast operands, f32 and
// f64, degenerate sizes, with the pointwise epilogue still fused after it; 16-bit operands and
// layouts a BLAS cannot address stay on the blocked GEMM; a KILN_BLAS naming nothing falls back;
// products cut into tiles, one single-threaded call a tile on the kernels' OpenMP team, equal the
// whole calls (the tiling rule, transposed and batched operands, a gradient's GEMMs).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "scoped_env.hpp"

namespace k = kiln;

namespace {

k::Tensor product(const k::Tensor& a, const k::Tensor& b) {
  k::Tensor out = k::empty(a.dim() == 3 || b.dim() == 3
                               ? k::Dims{std::max(a.dim() == 3 ? a.shape()[0] : 1, b.dim() == 3 ? b.shape()[0] : 1),
                                         a.shape()[a.dim() - 2], b.shape()[b.dim() - 1]}
                               : k::Dims{a.shape()[0], b.shape()[1]},
                           a.dtype() == k::f64 || b.dtype() == k::f64 ? k::f64 : k::f32, k::cpu);
  k::runtime::cpu_matmul(a, b, out);
  return out;
}

void same_as_blocked(const k::Tensor& a, const k::Tensor& b, double tol) {
  k::Tensor fast = product(a, b);
  k::Tensor blocked;
  {
    ScopedEnv none("KILN_BLAS", "none");
    CHECK(k::runtime::cpu_blas_name().empty());
    blocked = product(a, b);
  }
  auto r = k::testing::allclose(fast, blocked, tol, tol);
  CHECK_MESSAGE(r, r);
  auto want = k::reference::eval(k::matmul(a, b));
  auto rr = k::testing::allclose(fast, want, tol, tol);
  CHECK_MESSAGE(rr, rr);
}

}  // namespace

TEST_CASE("cpu blas: products equal the blocked GEMM's, every layout" *
          doctest::skip(k::runtime::cpu_blas_name().empty())) {
  INFO("BLAS: " << k::runtime::cpu_blas_name());
  for (k::dtype dt : {k::f32, k::f64}) {
    const double tol = dt == k::f32 ? 2e-5 : 1e-12;
    k::Tensor a = k::randn({37, 129}, dt, k::cpu, 1), b = k::randn({129, 65}, dt, k::cpu, 2);
    same_as_blocked(a, b, tol);
    // Transposed operands (a weight read as w^T), through strides.
    k::Tensor at = k::Tensor(k::transpose(a, 0, 1)).contiguous(), bt = k::Tensor(k::transpose(b, 0, 1)).contiguous();
    same_as_blocked(k::Tensor(k::transpose(at, 0, 1)), k::Tensor(k::transpose(bt, 0, 1)), tol);
    // Batched, and a 2-D weight under a batch.
    k::Tensor a3 = k::randn({3, 17, 33}, dt, k::cpu, 3), b3 = k::randn({3, 33, 9}, dt, k::cpu, 4);
    same_as_blocked(a3, b3, tol);
    same_as_blocked(a3, k::randn({33, 9}, dt, k::cpu, 5), tol);
    // Degenerate sizes: one row, one column, an inner size of one.
    same_as_blocked(k::randn({1, 40}, dt, k::cpu, 7), k::randn({40, 23}, dt, k::cpu, 8), tol);
    same_as_blocked(k::randn({23, 40}, dt, k::cpu, 9), k::randn({40, 1}, dt, k::cpu, 10), tol);
    same_as_blocked(k::randn({23, 1}, dt, k::cpu, 11), k::randn({1, 19}, dt, k::cpu, 12), tol);
  }
  // A compiled GEMM with its epilogue fused after it, against the oracle.
  k::Tensor x = k::randn({64, 96}, k::f32, k::cpu, 13), w = k::randn({96, 48}, k::f32, k::cpu, 14);
  k::Tensor bias = k::randn({48}, k::f32, k::cpu, 15);
  auto f = k::compile([](auto x, auto w, auto b) { return k::gelu(k::matmul(x, w) + b); });
  auto r = k::testing::allclose(f(x, w, bias), k::reference::eval(k::gelu(k::matmul(x, w) + bias)), 1e-5, 1e-5);
  CHECK_MESSAGE(r, r);
  CHECK(k::explain(f, x, w, bias).kernels.size() == 2);
}

TEST_CASE("cpu blas: 16-bit and mixed operands stay on the blocked GEMM; a KILN_BLAS naming nothing falls back") {
  k::Tensor a = k::randn({21, 34}, k::bf16, k::cpu, 21), b = k::randn({34, 13}, k::bf16, k::cpu, 22);
  auto r = k::testing::allclose(k::Tensor(k::matmul(a, b)), k::reference::eval(k::matmul(a, b)), 2e-2, 2e-2);
  CHECK_MESSAGE(r, r);
  k::Tensor mixed = k::randn({34, 13}, k::f32, k::cpu, 23);
  auto rm = k::testing::allclose(k::Tensor(k::matmul(a, mixed)), k::reference::eval(k::matmul(a, mixed)), 1e-5, 1e-5);
  CHECK_MESSAGE(rm, rm);
  ScopedEnv missing("KILN_BLAS", "/nonexistent/libnothing.so");
  CHECK(k::runtime::cpu_blas_name().empty());
  k::Tensor x = k::randn({9, 11}, k::f32, k::cpu, 24), y = k::randn({11, 5}, k::f32, k::cpu, 25);
  auto rx = k::testing::allclose(k::Tensor(k::matmul(x, y)), k::reference::eval(k::matmul(x, y)), 1e-5, 1e-5);
  CHECK_MESSAGE(rx, rx);
}

// The environment as the process started, before any kernel or BLAS was loaded (static
// initialisation of this file runs before main).
const bool timeout_at_start = std::getenv("OPENBLAS_THREAD_TIMEOUT") != nullptr;
const bool spin_at_start = std::getenv("GOMP_SPINCOUNT") != nullptr;

TEST_CASE("cpu threads: idle spins are shortened once, where the user chose nothing") {
  const bool policy = std::getenv("OMP_WAIT_POLICY") != nullptr;
  const bool keep = std::getenv("KILN_HOST_SPIN") && std::string(std::getenv("KILN_HOST_SPIN")) == "keep";
  k::Tensor a = k::randn({37, 29}, k::f32, k::cpu, 3), b = k::randn({29, 41}, k::f32, k::cpu, 4);
  k::Tensor y = k::compile([](auto x, auto w) { return k::relu(k::matmul(x, w) * 0.5f + 1.0f); })(a, b);
  auto r = k::testing::allclose(y, k::reference::eval(k::relu(k::matmul(a, b) * 0.5f + 1.0f)), 1e-5, 1e-5);
  CHECK_MESSAGE(r, r);
  if (keep) return;
  if (!timeout_at_start) CHECK(std::string(std::getenv("OPENBLAS_THREAD_TIMEOUT")) == "4");
  // libgomp's spin is shortened only where a BLAS with a pool of its own may run beside it.
  if (!spin_at_start && !policy)
    CHECK((std::getenv("GOMP_SPINCOUNT") != nullptr) == k::runtime::blas_may_bring_a_pool());
}

TEST_CASE("cpu blas: tiles of the output, sized for the team's threads") {
  using k::runtime::blas_detail::tiling;
  auto t = tiling(1024, 1024, 16);  // the largest tiles giving each thread one: 256 x 256
  CHECK((t.mt == 256 && t.nt == 256 && t.count() == 16));
  t = tiling(1024, 1024, 2);
  CHECK((t.mt == 512 && t.nt == 1024 && t.count() == 2));
  t = tiling(512, 4096, 16);  // halved along the longer side first
  CHECK((t.mt == 256 && t.nt == 512 && t.count() == 16));
  t = tiling(333, 777, 16);  // ragged last tiles
  CHECK((t.mt == 167 && t.nt == 98 && t.m_tiles == 2 && t.n_tiles == 8));
  t = tiling(5, 3, 16);  // too small to share: one tile
  CHECK((t.mt == 5 && t.nt == 3 && t.count() == 1));
  t = tiling(4096, 64, 16);
  CHECK((t.mt == 256 && t.nt == 64 && t.count() == 16));
  t = tiling(1024, 1024, 16, 128);  // a cap on each side (KILN_TUNE_BLAS_TILES)
  CHECK((t.mt == 128 && t.nt == 128 && t.count() == 64));
}

TEST_CASE("cpu threads: host work runs on the kernels' OpenMP team, each task once") {
  const k::runtime::HostTeam* team = k::runtime::host_team();
  CHECK(static_cast<bool>(team) == k::runtime::host_openmp());
  std::mutex m;
  std::set<std::thread::id> ids;
  std::vector<int> done(200, 0);
  k::runtime::host_parallel::run(4, [&](std::atomic<std::int64_t>& next) {
    for (std::int64_t t; (t = next.fetch_add(1)) < 200;) {
      done[t] += 1;
      std::this_thread::sleep_for(std::chrono::microseconds(100));  // long enough for every thread to start
      std::lock_guard lock(m);
      ids.insert(std::this_thread::get_id());
    }
  });
  CHECK(std::count(done.begin(), done.end(), 1) == 200);
  CHECK(ids.size() > 1);  // the team's threads (or std::threads without one), not the caller alone
  // A worker's exception reaches the caller, after every thread has finished.
  CHECK_THROWS_AS(
      k::runtime::host_parallel::run(3, [](std::atomic<std::int64_t>&) { throw k::error("worker failed"); }), k::error);
}

TEST_CASE("cpu blas: products cut into tiles on the kernels' team equal the whole calls" *
          doctest::skip(k::runtime::cpu_blas_name().empty())) {
  INFO("BLAS: " << k::runtime::cpu_blas_name()
                << ", team: " << std::string(k::runtime::host_team() ? "OpenMP" : "none"));
  ScopedEnv threads("KILN_NUM_THREADS", "5");  // several tiles even on a 2-core machine
  for (k::dtype dt : {k::f32, k::f64}) {
    const double tol = dt == k::f32 ? 2e-5 : 1e-12;
    k::Tensor a = k::randn({333, 257}, dt, k::cpu, 31), b = k::randn({257, 301}, dt, k::cpu, 32);
    k::Tensor at = k::Tensor(k::transpose(a, 0, 1)).contiguous(), bt = k::Tensor(k::transpose(b, 0, 1)).contiguous();
    k::Tensor a3 = k::randn({3, 130, 200}, dt, k::cpu, 33), b3 = k::randn({3, 200, 90}, dt, k::cpu, 34);
    const std::vector<std::pair<k::Tensor, k::Tensor>> cases = {
        {a, b},
        {k::Tensor(k::transpose(at, 0, 1)), k::Tensor(k::transpose(bt, 0, 1))},
        {a3, b3},
        {a3, k::randn({200, 90}, dt, k::cpu, 35)},
        {k::randn({7, 257}, dt, k::cpu, 36), b}};
    for (const auto& [x, y] : cases) {
      k::Tensor tiled, whole;
      {
        ScopedEnv on("KILN_TUNE_BLAS_TILES", "1");
        tiled = product(x, y);
      }
      {
        ScopedEnv off("KILN_TUNE_BLAS_TILES", "0");
        whole = product(x, y);
      }
      auto r = k::testing::allclose(tiled, whole, tol, tol);
      CHECK_MESSAGE(r, r);
      auto rr = k::testing::allclose(tiled, k::reference::eval(k::matmul(x, y)), tol, tol);
      CHECK_MESSAGE(rr, rr);
    }
  }
  // A compiled layer's forward and gradients, whose GEMMs read transposed operands, tiled: the
  // gradients of sum((x @ w) * c) are c @ w^T and x^T @ c.
  ScopedEnv on("KILN_TUNE_BLAS_TILES", "1");
  k::Tensor x = k::randn({150, 96}, k::f32, k::cpu, 37), w = k::randn({96, 140}, k::f32, k::cpu, 38);
  k::Tensor c = k::randn({150, 140}, k::f32, k::cpu, 39);
  auto loss = [](auto x, auto w, auto c) { return k::sum(k::gelu(k::matmul(x, w)) + k::matmul(x, w) * c); };
  auto [value, dx, dw] = k::compile(
      k::value_and_grad([](auto x, auto w, auto c) { return k::sum(k::matmul(x, w) * c); }, k::wrt<0, 1>))(x, w, c);
  auto rv = k::testing::allclose(value, k::reference::eval(k::sum(k::matmul(x, w) * c)), 1e-3, 1e-4);
  CHECK_MESSAGE(rv, rv);
  auto rx = k::testing::allclose(dx, k::reference::eval(k::matmul(c, k::transpose(w, 0, 1))), 1e-4, 1e-4);
  CHECK_MESSAGE(rx, rx);
  auto rw = k::testing::allclose(dw, k::reference::eval(k::matmul(k::transpose(x, 0, 1), c)), 1e-4, 1e-4);
  CHECK_MESSAGE(rw, rw);
  auto y = k::compile(loss)(x, w, c);
  auto ry = k::testing::allclose(y, k::reference::eval(loss(x, w, c)), 1e-3, 1e-4);
  CHECK_MESSAGE(ry, ry);
}
