// Device memory through the CUDA driver: the Allocator interface, the stream-ordered caching
// allocator that is the default, and set_allocator to plug in another.
#pragma once
#include <atomic>
#include <bit>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "driver_api.hpp"
#include "driver_device.hpp"
#include "driver_stream.hpp"
#include "error.hpp"
#include "faults.hpp"

namespace kiln::driver {

// --- memory ---

// Where device memory comes from; set_allocator plugs in another (e.g. a host framework's pool).
// deallocate receives the bytes, device and stream given to allocate, or the stream the block was
// last used on: the block may be handed out again on that stream at once.
struct Allocator {
  virtual void* allocate(std::size_t bytes, int device, CUstream stream) = 0;
  virtual void deallocate(void* p, std::size_t bytes, int device, CUstream stream) = 0;
  virtual ~Allocator() = default;
};

// Blocks rounded to 512 B; above 1 MiB, four sizes per power of two, so rounding wastes < 25%.
inline std::size_t size_class(std::size_t bytes) {
  constexpr std::size_t small = 512, large = std::size_t(1) << 20;
  std::size_t step = bytes <= large ? small : std::bit_floor(bytes) / 4;
  return (bytes + step - 1) / step * step;
}

namespace detail {

inline std::string bytes_text(std::size_t n) {
  return std::to_string(n) + " bytes (" + std::to_string(n >> 20) + " MiB)";
}

// The caching allocator's answer to running out of device memory, kept apart from the driver so
// that tests reach every branch without a GPU. try_alloc(size, &ptr) asks the driver; on
// CUDA_ERROR_OUT_OF_MEMORY, release() returns the cached blocks to the driver (and says how many
// bytes that was) and try_alloc is asked once more. A second out-of-memory is a cuda_error naming
// the request and the device's free memory from memory_info() ({free, total}, or nothing when the
// driver cannot say), so the user sees whether the request was absurd or the device is just full.
template <class TryAlloc, class Release, class MemoryInfo>
void* allocate_or_retry(std::size_t bytes, std::size_t size, int device, TryAlloc&& try_alloc, Release&& release,
                        MemoryInfo&& memory_info) {
  CUdeviceptr p = 0;
  CUresult r = try_alloc(size, &p);
  std::size_t released = 0;
  if (r == CUDA_ERROR_OUT_OF_MEMORY) {
    released = release();
    r = try_alloc(size, &p);
  }
  if (r == CUDA_SUCCESS) return reinterpret_cast<void*>(p);
  std::string what = "allocate " + std::to_string(bytes) + " bytes on cuda:" + std::to_string(device);
  if (r != CUDA_ERROR_OUT_OF_MEMORY) throw_error(r, what);
  // Out of memory twice: the retry has happened.
  std::optional<std::pair<std::size_t, std::size_t>> info = memory_info();
  std::string free_text =
      info ? bytes_text(info->first) + " free of " + bytes_text(info->second) + " on the device (cuMemGetInfo)"
           : std::string("the device's free memory unknown (cuMemGetInfo failed)");
  throw cuda_error(what + ": CUDA_ERROR_OUT_OF_MEMORY (out of memory): requested " + bytes_text(bytes) + ", " +
                   free_text + ", after kiln's allocator returned its " + bytes_text(released) +
                   " of cached blocks to the driver and tried again");
}

}  // namespace detail

// True while kiln records work into a CUDA graph it captures itself (relaxed mode) and hands every
// block allocated meanwhile to that graph's keeper (runtime/launch/capture_keep.hpp): fresh blocks
// may then come from the driver during the capture. Thread-local, like the capture.
inline bool& capture_allocations_kept() {
  thread_local bool kept = false;
  return kept;
}

// The default allocator. A freed block goes back to a bin keyed by (stream, size class) and is
// reused only on the same stream, where stream order makes reuse safe without events. Blocks go
// back to the driver only when an allocation runs out of memory (or on release_cached).
class CachingAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, int device, CUstream stream) override {
    if (bytes == 0) return nullptr;
    std::size_t size = size_class(bytes);
    if (void* p = take(device, stream, size)) return p;
    // cuMemAlloc would break a capture the caller is recording on this stream; kiln's own relaxed
    // captures allocate where the graph keeps every block (capture_allocations_kept).
    if (stream && !capture_allocations_kept() && is_capturing(stream))
      throw cuda_error("CUDA graph capture: kiln needs " + std::to_string(bytes) +
                       " new bytes on cuda:" + std::to_string(device) +
                       " while the stream is being captured; call the kiln function once "
                       "before capturing (so its buffers are cached), or pass outputs with k::eval(out, expr, stream)");
    return allocate_new(bytes, size, device);
  }

  void deallocate(void* p, std::size_t bytes, int device, CUstream stream) override {
    if (!p) return;
    std::size_t size = size_class(bytes);
    Bins& b = bins(device);
    std::lock_guard lock(b.mutex);
    b.free[Key{stream, size}].push_back(p);
    b.cached += size;
  }

  // Waits for the device, then returns every cached block of it to the driver.
  void release_cached(int device) {
    std::vector<void*> blocks = take_all(device);
    if (blocks.empty()) return;
    synchronize_device(device);
    for (void* p : blocks) check(api().mem_free(reinterpret_cast<CUdeviceptr>(p)), "cuMemFree");
  }

  std::size_t cached_bytes(int device) {
    Bins& b = bins(device);
    std::lock_guard lock(b.mutex);
    return b.cached;
  }

 private:
  struct Key {
    CUstream stream;
    std::size_t size;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return std::hash<const void*>{}(k.stream) * 31 + std::hash<std::size_t>{}(k.size);
    }
  };
  struct Bins {
    std::mutex mutex;
    std::unordered_map<Key, std::vector<void*>, KeyHash> free;
    std::size_t cached = 0;
  };

  Bins& bins(int device) {
    require_device(device);
    std::call_once(made_, [&] { bins_ = std::make_unique<Bins[]>(device_count()); });
    return bins_[device];
  }

  void* take(int device, CUstream stream, std::size_t size) {
    Bins& b = bins(device);
    std::lock_guard lock(b.mutex);
    auto it = b.free.find(Key{stream, size});
    if (it == b.free.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    b.cached -= size;
    return p;
  }

  std::vector<void*> take_all(int device) {
    Bins& b = bins(device);
    std::lock_guard lock(b.mutex);
    std::vector<void*> all;
    for (auto& [key, blocks] : b.free) all.insert(all.end(), blocks.begin(), blocks.end());
    b.free.clear();
    b.cached = 0;
    return all;
  }

  // A fresh block from the driver; on out-of-memory the cache goes back first and it tries once more.
  void* allocate_new(std::size_t bytes, std::size_t size, int device) {
    make_current(device);
    auto try_alloc = [](std::size_t n, CUdeviceptr* p) {
      if (faults::detail::take(faults::detail::device_out_of_memory)) [[unlikely]]
        return CUDA_ERROR_OUT_OF_MEMORY;
      return api().mem_alloc(p, n);
    };
    auto release = [&] {
      std::size_t cached = cached_bytes(device);
      release_cached(device);
      return cached;
    };
    auto free_memory = []() -> std::optional<std::pair<std::size_t, std::size_t>> {
      std::size_t free = 0, total = 0;
      if (api().mem_get_info(&free, &total) != CUDA_SUCCESS) return std::nullopt;
      return std::pair{free, total};
    };
    return detail::allocate_or_retry(bytes, size, device, try_alloc, release, free_memory);
  }

  std::once_flag made_;
  std::unique_ptr<Bins[]> bins_;
};

// Never destroyed: blocks outlive static destructors, and the driver may be gone by then.
inline CachingAllocator& caching_allocator() {
  static CachingAllocator* a = new CachingAllocator();
  return *a;
}

namespace detail {
inline std::atomic<Allocator*> custom_allocator{nullptr};
}

// nullptr restores the caching allocator. Set it before kiln allocates: each block must return
// to the allocator it came from.
inline void set_allocator(Allocator* a) noexcept { detail::custom_allocator.store(a, std::memory_order_release); }

inline Allocator& current_allocator() {
  Allocator* a = detail::custom_allocator.load(std::memory_order_acquire);
  return a ? *a : caching_allocator();
}

inline void* allocate(std::size_t bytes, int device, CUstream stream) {
  return current_allocator().allocate(bytes, device, stream);
}

inline void deallocate(void* p, std::size_t bytes, int device, CUstream stream) {
  current_allocator().deallocate(p, bytes, device, stream);
}

}  // namespace kiln::driver

namespace kiln {
using driver::Allocator;
using driver::set_allocator;
}  // namespace kiln
