// Host work the runtime spreads over cores itself (the blocked GEMM, a BLAS's GEMM cut into tiles):
// how many threads a problem gets, and running a worker on each of them. Threads come from the
// generated kernels' OpenMP team where there is one (compile/host_team.hpp), so the runtime's work
// and the kernels that follow it share one pool; else from OpenMP when the program itself is built
// with it; else from std::thread.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../core/config.hpp"
#include "../compile/host_compiler.hpp"

namespace kiln::runtime {

// The kernels' OpenMP team for the runtime's own host work (host_team.hpp), or nullptr where the
// kernels have none (no OpenMP, or no host compiler: then found once and never again).
inline const HostTeam* host_team() noexcept {
  static const HostTeam* team = []() -> const HostTeam* {
    try {
      const detail::HostToolchain& t = detail::toolchain();
      return t.team ? &t.team : nullptr;
    } catch (...) {
      return nullptr;
    }
  }();
  return team;
}

namespace host_parallel {

// The threads host work may use: KILN_NUM_THREADS when set, else the kernels' team size
// (OMP_NUM_THREADS, else every core), else OpenMP's or the hardware's count.
inline int max_threads() {
  if (const char* env = kiln::config::env("KILN_NUM_THREADS"); env && *env)
    if (const int n = std::atoi(env); n > 0) return n;
  if (const HostTeam* team = host_team()) return std::max(team->size(), 1);
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return std::max(static_cast<int>(std::thread::hardware_concurrency()), 1);
#endif
}

// How many threads `tasks` tasks of `flops` floating-point operations in all should use: 1 for
// small problems, else about 1 MFLOP a thread at least, at most one a task and max_threads().
inline int thread_count(std::int64_t tasks, double flops) {
  if (tasks <= 1 || flops < 4.0e6) return 1;
  const double per_thread = 1.0e6;
  const int n = static_cast<int>(std::min<double>(max_threads(), flops / per_thread));
  return static_cast<int>(std::clamp<std::int64_t>(n, 1, tasks));
}

// Runs worker(next) on `threads` threads (the caller's included where it can be); each worker takes
// task indices from the shared counter until none are left. The first exception is rethrown after
// all finish.
template <class Worker>
void run(int threads, const Worker& worker) {
  std::atomic<std::int64_t> next{0};
  if (threads <= 1) {
    worker(next);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto guarded = [&] {
    try {
      worker(next);
    } catch (...) {
      std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  if (const HostTeam* team = host_team()) {
    team->run(
        threads, +[](void* context) { (*static_cast<decltype(guarded)*>(context))(); }, &guarded);
  } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    guarded();
#else
    std::vector<std::thread> pool;
    pool.reserve(threads - 1);
    try {
      for (int i = 1; i < threads; ++i) pool.emplace_back(guarded);
    } catch (...) {  // could not start more threads: the ones started (and this one) do the work
    }
    guarded();
    for (std::thread& t : pool) t.join();
#endif
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace host_parallel
}  // namespace kiln::runtime
