// Injected faults, for tests: they make the rare failures of real machines (a device out of memory,
// a full or read-only cache disk) happen on demand, so that the code handling them is run at all.
// CI runs as root, where chmod cannot deny a write, and has no GPU whose memory could run out.
//
// All are off by default. Each is checked only on a path that already does something slow (a
// driver allocation, a file write), with one relaxed atomic load: nothing on kiln's hot paths.
#pragma once
#include <atomic>

namespace kiln::faults {

namespace detail {

// How many of the next events fail; <= 0 means none.
inline std::atomic<int> device_out_of_memory{0};
inline std::atomic<int> disk_cache_write{0};

// Consumes one pending failure: true when this event is to fail.
inline bool take(std::atomic<int>& pending) noexcept {
  int n = pending.load(std::memory_order_relaxed);
  while (n > 0)
    if (pending.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) return true;
  return false;
}

}  // namespace detail

// The next n requests to the CUDA driver for fresh device memory (cuMemAlloc, including the retry
// after the allocator returned its cache) report CUDA_ERROR_OUT_OF_MEMORY without asking the driver.
inline void fail_device_allocations(int n) noexcept { detail::device_out_of_memory.store(n); }

// The next n disk-cache entry writes stop after part of the entry, failing with ENOSPC as on a full
// disk (the partial temp file is really written, then the write fails).
inline void fail_disk_cache_writes(int n) noexcept { detail::disk_cache_write.store(n); }

// Failures still pending (tests check that their fault was reached).
inline int pending_device_allocation_failures() noexcept { return detail::device_out_of_memory.load(); }
inline int pending_disk_cache_write_failures() noexcept { return detail::disk_cache_write.load(); }

// Clears every pending fault.
inline void clear() noexcept {
  detail::device_out_of_memory.store(0);
  detail::disk_cache_write.store(0);
}

// Clears every pending fault when the scope ends, so a failed check cannot leak one into the next test.
struct scoped_clear {
  scoped_clear() = default;
  scoped_clear(const scoped_clear&) = delete;
  scoped_clear& operator=(const scoped_clear&) = delete;
  ~scoped_clear() { clear(); }
};

}  // namespace kiln::faults
