// Large host blocks kept for reuse. The C library maps a block past its threshold (glibc: 128 KiB
// rising to at most 32 MiB) fresh from the kernel at each allocation and unmaps it when freed, so a
// CPU call writing a fresh 64 MiB output faulted in its 16384 pages every time: `x + y` over 4096^2
// f32 took 101 ms into a fresh output and 24 ms into an existing one on a 2-core VM
// (benchmarks/NOTES.md item 53). Blocks of a megabyte or more come in the device allocator's size
// classes (driver::size_class: four a power of two) and go back to a free list of their class; the
// next allocation of that class takes one, its pages already mapped. The cache never holds more
// bytes than the peak in use (k::memory_stats' peak), so a process holds at most twice its peak,
// nor more than a quarter of the machine's memory (host memory is shared with other processes);
// to fit a newly freed block, the blocks freed longest ago go first. KILN_HOST_CACHE=0 frees every
// block at once (read at each free).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string_view>
#include <vector>

#include <unistd.h>

#include "config.hpp"

namespace kiln::memory {

class HostCache {
 public:
  // Host blocks of at least this many bytes are cached (the device allocator's first size class
  // above its 512-byte steps).
  static constexpr std::size_t min_block = std::size_t(1) << 20;

  // A cached block of exactly `block` bytes (the one freed last), or nullptr.
  void* take(std::size_t block) {
    std::lock_guard lock(mutex_);
    std::size_t best = free_.size();
    for (std::size_t i = 0; i < free_.size(); ++i)
      if (free_[i].block == block && (best == free_.size() || free_[i].tick > free_[best].tick)) best = i;
    if (best == free_.size()) return nullptr;
    void* p = free_[best].p;
    free_[best] = free_.back();
    free_.pop_back();
    cached_ -= block;
    return p;
  }
  // Keeps p (a block of `block` bytes) when caching is on, making room within `limit` bytes by
  // freeing the blocks freed longest ago: a process that once held large tensors and now works
  // on smaller ones keeps its new working set (NOTES 71: with the old blocks kept and the new ones
  // freed, a layer_norm step after a 64 MiB workload faulted in its 16 MiB outputs at every call,
  // 4.7 ms at 16 threads instead of 0.7). false: the caller frees it.
  bool keep(void* p, std::size_t block, std::size_t limit) {
    if (block < min_block || !enabled()) return false;
    static const std::size_t machine = physical_bytes() / 4;
    const std::size_t cap = limit < machine ? limit : machine;
    if (block > cap) return false;
    std::lock_guard lock(mutex_);
    while (cached_ + block > cap) {  // evict the oldest
      std::size_t oldest = 0;
      for (std::size_t i = 1; i < free_.size(); ++i)
        if (free_[i].tick < free_[oldest].tick) oldest = i;
      std::free(free_[oldest].p);
      cached_ -= free_[oldest].block;
      free_[oldest] = free_.back();
      free_.pop_back();
    }
    free_.push_back({block, p, ++tick_});
    cached_ += block;
    return true;
  }
  std::size_t cached_bytes() {
    std::lock_guard lock(mutex_);
    return cached_;
  }
  // Frees every cached block; returns how many bytes that was.
  std::size_t release() {
    std::lock_guard lock(mutex_);
    std::size_t n = cached_;
    for (const Entry& e : free_) std::free(e.p);
    free_.clear();
    cached_ = 0;
    return n;
  }

  static std::size_t physical_bytes() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : 0;
  }
  static bool enabled() {
    const char* v = config::env("KILN_HOST_CACHE");
    return !v || std::string_view(v) != "0";
  }

 private:
  struct Entry {
    std::size_t block;
    void* p;
    std::uint64_t tick;  // when it was freed
  };
  std::mutex mutex_;
  std::vector<Entry> free_;  // the cached blocks, unordered (a few dozen at most: a scan is cheap)
  std::size_t cached_ = 0;
  std::uint64_t tick_ = 0;
};

// The process's host cache; never destroyed (tensors may be freed during static destruction).
inline HostCache& host_cache() {
  static HostCache* cache = new HostCache();
  return *cache;
}

}  // namespace kiln::memory
