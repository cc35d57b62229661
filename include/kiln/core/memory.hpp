// Raw memory for tensors on any device: host memory is 64-byte aligned, large host blocks are kept
// for reuse (core/host_cache.hpp), device memory comes from the driver's stream-ordered caching
// allocator (core/driver.hpp). Every block kiln allocates is counted per device (k::memory_stats):
// bytes in use, their peak, and what the caches hold besides.
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "device.hpp"
#include "driver.hpp"
#include "host_cache.hpp"
#include "host_guard.hpp"

namespace kiln::memory {

inline void require_device(Device d, const char* op) {
  if (!d.is_cuda()) return;
  if (!driver::available())
    throw device_error(std::string(op) + ": " + d.str() +
                       " was asked for, but this machine has no usable CUDA driver or device");
  if (d.index >= driver::device_count())
    throw device_error(std::string(op) + ": " + d.str() + " does not exist (this machine has " +
                       std::to_string(driver::device_count()) + " CUDA devices)");
}

namespace detail {

// The bytes a block of `bytes` occupies: host blocks are rounded to 64 B, or from a megabyte up to
// the size classes the host cache keeps; device blocks to the caching allocator's size class.
inline std::size_t block_bytes(std::size_t bytes, Device d) {
  if (d.is_cpu()) return bytes >= HostCache::min_block ? driver::size_class(bytes) : bytes ? (bytes + 63) / 64 * 64 : 64;
  return bytes ? driver::size_class(bytes) : 0;
}

// Counters of one device: bytes in blocks handed out and not yet freed, and their peak.
struct Counters {
  std::atomic<std::size_t> allocated{0}, peak{0};
};
inline constexpr int max_counted_devices = 64;
// Slot 0 is the host; slot 1 + n is cuda:n (devices past the table are not counted).
inline Counters* counters(Device d) {
  static std::array<Counters, max_counted_devices + 1> table;
  const int slot = d.is_cpu() ? 0 : 1 + d.index;
  return slot >= 0 && slot <= max_counted_devices ? &table[static_cast<std::size_t>(slot)] : nullptr;
}
inline void count_allocated(Device d, std::size_t n) {
  Counters* c = counters(d);
  if (!c || !n) return;
  const std::size_t now = c->allocated.fetch_add(n, std::memory_order_relaxed) + n;
  std::size_t peak = c->peak.load(std::memory_order_relaxed);
  while (now > peak && !c->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}
inline void count_freed(Device d, std::size_t n) {
  if (Counters* c = counters(d); c && n) c->allocated.fetch_sub(n, std::memory_order_relaxed);
}

}  // namespace detail

inline void* allocate(std::size_t bytes, Device d, CUstream s) {
  if (d.is_cpu()) {
    const std::size_t block = detail::block_bytes(bytes, d);
    if (host_guard() != HostGuard::off) {  // KILN_HOST_GUARD_PAGES: each block its own mapping
      void* p = guarded_allocate(block, host_guard());
      if (!p) throw std::bad_alloc();
      detail::count_allocated(d, block);
      return p;
    }
    void* p = block >= HostCache::min_block ? host_cache().take(block) : nullptr;
    if (!p) p = std::aligned_alloc(64, block);
    if (!p && host_cache().release() > 0) p = std::aligned_alloc(64, block);
    if (!p) throw std::bad_alloc();
    detail::count_allocated(d, block);
    return p;
  }
  require_device(d, "allocate");
  if (!bytes) return nullptr;
  void* p = driver::allocate(bytes, d.index, s);
  detail::count_allocated(d, detail::block_bytes(bytes, d));
  return p;
}

inline void deallocate(void* p, std::size_t bytes, Device d, CUstream s) noexcept {
  if (!p) return;
  const std::size_t block = detail::block_bytes(bytes, d);
  detail::count_freed(d, block);
  if (d.is_cpu()) {
    if (host_guard() != HostGuard::off) return guarded_free(p, block, host_guard());
    // Cached while the cache stays within the peak in use.
    const detail::Counters* c = detail::counters(d);
    if (!host_cache().keep(p, block, c ? c->peak.load(std::memory_order_relaxed) : 0)) std::free(p);
    return;
  }
  try {
    driver::deallocate(p, bytes, d.index, s);
  } catch (...) {  // freeing during shutdown must not throw
  }
}

// Copies bytes between any two devices, ordered on the stream.
inline void copy(void* dst, Device dd, const void* src, Device sd, std::size_t bytes, CUstream s) {
  if (bytes == 0) return;
  if (dd.is_cpu() && sd.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  driver::make_current(dd.is_cuda() ? dd.index : sd.index);
  driver::copy_async(dst, src, bytes, s);
}

// Waits for the stream when work on a device was involved (host reads after a device copy).
inline void synchronize(CUstream s, Device involved) {
  if (involved.is_cuda()) driver::synchronize(s);
}

}  // namespace kiln::memory

namespace kiln {

// What k::memory_stats reports for one device, in bytes, as torch.cuda.memory_stats does:
// `allocated` is held by live tensors and kiln's intermediates (in the blocks the allocator hands
// out: host blocks rounded to 64 B, or to size classes from a megabyte up, device blocks to the
// caching allocator's size classes), `reserved` is that plus the blocks the caches keep for reuse
// (host blocks of a megabyte or more, core/host_cache.hpp; equal to `allocated` under a user's
// device allocator, which kiln cannot see into), and `peak` the most
// `allocated` has been since the process started or the last k::reset_peak_memory_stats. Memory
// the caller owns (k::Tensor::wrap) is not counted; neither is cuBLASLt's workspace.
struct memory_info {
  std::size_t allocated = 0, reserved = 0, peak = 0;
};

inline memory_info memory_stats(Device d = cpu) {
  memory::require_device(d, "memory_stats");
  memory_info out;
  if (memory::detail::Counters* c = memory::detail::counters(d)) {
    out.allocated = c->allocated.load(std::memory_order_relaxed);
    out.peak = std::max(c->peak.load(std::memory_order_relaxed), out.allocated);
  }
  out.reserved = out.allocated;
  if (d.is_cpu()) out.reserved += memory::host_cache().cached_bytes();
  if (d.is_cuda() && &driver::current_allocator() == &driver::caching_allocator())
    out.reserved += driver::caching_allocator().cached_bytes(d.index);
  return out;
}

// Starts a new peak for device d at what is allocated now.
inline void reset_peak_memory_stats(Device d = cpu) {
  memory::require_device(d, "reset_peak_memory_stats");
  if (memory::detail::Counters* c = memory::detail::counters(d))
    c->peak.store(c->allocated.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace kiln
