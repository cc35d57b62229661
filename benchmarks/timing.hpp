// Timing helpers shared by kiln's benchmark binaries (bench.cpp, sweep.cpp): the conventions of
// BENCHMARKS.md (warm-up, median of the repetitions, CUDA events on the GPU).
#pragma once
#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

#include <kiln/kiln.hpp>

namespace kiln_bench {

// Whether a CUDA device is usable (a driver and at least one device): benchmarks that need one
// print that they skip and exit 0 without it.
inline bool cuda_device_present() {
  try {
    return kiln::driver::device_count() > 0;
  } catch (const kiln::error&) {  // no driver
    return false;
  }
}

// Median milliseconds of fn() over reps, timed with events around each repetition. Like Triton's
// do_bench, each repetition first clears the L2 cache with a 256 MiB memset, which also lets the
// host's dispatch of fn() overlap GPU work, as it does in a real stream of kernels.
inline double cuda_time_ms(const std::function<void()>& fn, int reps) {
  static kiln::Tensor flush = kiln::empty({64 << 20}, kiln::f32, kiln::cuda);
  for (int i = 0; i < 10; ++i) fn();
  kiln::synchronize();
  std::vector<float> t;
  kiln::runtime::Event a, b;
  for (int i = 0; i < reps; ++i) {
    kiln::driver::memset_async(flush.data_ptr(), 0, flush.nbytes(), nullptr);
    a.record();
    fn();
    b.record();
    b.synchronize();
    t.push_back(kiln::runtime::elapsed_ms(a, b));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The same sampling on the host's wall clock, for CPU tensors (no cache flush): 10 warm-up calls,
// then the median of reps calls.
inline double wall_time_ms(const std::function<void()>& fn, int reps) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < 10; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = clock::now();
    fn();
    t.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace kiln_bench
