// The CUDA driver API, opened with dlopen on first use so that kiln loads (and its CPU path runs)
// on machines without a driver: devices, contexts, a stream-ordered caching allocator and copies.
#pragma once
#include <cuda.h>  // types and prototypes only: libcuda is never linked
#include <dlfcn.h>

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

#include "error.hpp"
#include "faults.hpp"

namespace kiln::driver {

// X(member, symbol): every entry point kiln uses, under its exported name in libcuda.so.1 (the
// versioned one where the driver has several). The prototype comes from cuda.h, whose macros map
// the plain names onto the same versions.
#define KILN_CUDA_DRIVER_FUNCTIONS(X)                                         \
  X(init, cuInit)                                                             \
  X(get_error_name, cuGetErrorName)                                           \
  X(get_error_string, cuGetErrorString)                                       \
  X(device_get, cuDeviceGet)                                                  \
  X(device_get_count, cuDeviceGetCount)                                       \
  X(device_get_attribute, cuDeviceGetAttribute)                               \
  X(device_get_name, cuDeviceGetName)                                         \
  X(device_primary_ctx_retain, cuDevicePrimaryCtxRetain)                      \
  X(ctx_set_current, cuCtxSetCurrent)                                         \
  X(ctx_get_current, cuCtxGetCurrent)                                         \
  X(ctx_synchronize, cuCtxSynchronize)                                        \
  X(mem_alloc, cuMemAlloc_v2)                                                 \
  X(mem_free, cuMemFree_v2)                                                   \
  X(mem_alloc_async, cuMemAllocAsync)                                         \
  X(mem_free_async, cuMemFreeAsync)                                           \
  X(mem_get_info, cuMemGetInfo_v2)                                            \
  X(memcpy_async, cuMemcpyAsync)                                              \
  X(memcpy_2d_async, cuMemcpy2DAsync_v2)                                      \
  X(memset_d8_async, cuMemsetD8Async)                                         \
  X(pointer_get_attribute, cuPointerGetAttribute)                             \
  X(stream_create, cuStreamCreate)                                            \
  X(stream_destroy, cuStreamDestroy_v2)                                       \
  X(stream_synchronize, cuStreamSynchronize)                                  \
  X(stream_query, cuStreamQuery)                                              \
  X(event_create, cuEventCreate)                                              \
  X(event_record, cuEventRecord)                                              \
  X(event_synchronize, cuEventSynchronize)                                    \
  X(event_elapsed_time, cuEventElapsedTime)                                   \
  X(event_destroy, cuEventDestroy_v2)                                         \
  X(module_load_data, cuModuleLoadData)                                       \
  X(module_get_function, cuModuleGetFunction)                                 \
  X(module_unload, cuModuleUnload)                                            \
  X(func_set_attribute, cuFuncSetAttribute)                                   \
  X(occupancy_max_active_blocks, cuOccupancyMaxActiveBlocksPerMultiprocessor) \
  X(launch_kernel, cuLaunchKernel)                                            \
  X(stream_begin_capture, cuStreamBeginCapture_v2)                            \
  X(stream_end_capture, cuStreamEndCapture)                                   \
  X(stream_is_capturing, cuStreamIsCapturing)                                 \
  X(graph_instantiate, cuGraphInstantiateWithFlags)                           \
  X(graph_launch, cuGraphLaunch)                                              \
  X(graph_exec_update, cuGraphExecUpdate_v2)                                  \
  X(stream_wait_event, cuStreamWaitEvent)                                     \
  X(graph_exec_destroy, cuGraphExecDestroy)                                   \
  X(graph_destroy, cuGraphDestroy)

// The driver's entry points, e.g. api().launch_kernel(...) calls cuLaunchKernel.
struct Api {
#define KILN_DRIVER_MEMBER(member, symbol) decltype(&::symbol) member = nullptr;
  KILN_CUDA_DRIVER_FUNCTIONS(KILN_DRIVER_MEMBER)
#undef KILN_DRIVER_MEMBER
};

namespace detail {

// One device's primary context, retained the first time kiln makes the device current.
struct DeviceSlot {
  std::once_flag retained;
  CUcontext context = nullptr;
};

// The outcome of loading the driver, computed once: the table, or why there is none.
struct Loaded {
  Api api;
  std::string error;
  int devices = 0;
  std::unique_ptr<DeviceSlot[]> slots;
};

inline std::atomic<bool> ready{false};  // true once the driver loaded with at least one device
inline thread_local int current = 0;    // the device kiln made current last on this thread

inline std::string describe(const Api& a, CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (!a.get_error_name || a.get_error_name(r, &name) != CUDA_SUCCESS || !name) name = "CUDA_ERROR_UNKNOWN";
  if (!a.get_error_string || a.get_error_string(r, &text) != CUDA_SUCCESS || !text) text = "unrecognised error code";
  return std::string(name) + " (" + text + ")";
}

// Fills the table; returns the symbols the driver lacks, comma-separated.
inline std::string bind(void* lib, Api& a) {
  std::string missing;
#define KILN_DRIVER_BIND(member, symbol)                                \
  a.member = reinterpret_cast<decltype(a.member)>(dlsym(lib, #symbol)); \
  if (!a.member) missing += (missing.empty() ? "" : ", ") + std::string(#symbol);
  KILN_CUDA_DRIVER_FUNCTIONS(KILN_DRIVER_BIND)
#undef KILN_DRIVER_BIND
  return missing;
}

inline Loaded load() {
  Loaded l;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    l.error = "CUDA: no CUDA driver on this machine (libcuda.so.1 could not be loaded: " +
              std::string(why ? why : "unknown reason") + ")";
    return l;
  }
  if (std::string missing = bind(lib, l.api); !missing.empty()) {
    l.error = "CUDA: the CUDA driver is too old for kiln (libcuda.so.1 lacks " + missing + ")";
    return l;
  }
  if (CUresult r = l.api.init(0); r != CUDA_SUCCESS) {
    l.error = "CUDA: the CUDA driver failed to initialise (cuInit: " + describe(l.api, r) + ")";
    return l;
  }
  if (l.api.device_get_count(&l.devices) != CUDA_SUCCESS || l.devices <= 0) {
    l.error = "CUDA: the CUDA driver found no CUDA device on this machine";
    return l;
  }
  l.slots = std::make_unique<DeviceSlot[]>(l.devices);
  ready.store(true, std::memory_order_release);
  return l;
}

// Thread-safe and done once: a failure is remembered too, so asking again costs nothing.
inline const Loaded& loaded() {
  static const Loaded l = load();
  return l;
}

}  // namespace detail

// True when the driver loads, initialises and sees at least one device.
inline bool available() noexcept {
  try {
    return detail::loaded().error.empty();
  } catch (...) {
    return false;
  }
}

// True when the driver has already been loaded successfully; never loads it.
inline bool initialized() noexcept { return detail::ready.load(std::memory_order_acquire); }

// The entry points; a kiln::device_error saying why when there is no usable driver or device.
inline const Api& api() {
  const detail::Loaded& l = detail::loaded();
  if (!l.error.empty()) [[unlikely]]
    throw device_error(l.error);
  return l.api;
}

[[noreturn]] inline void throw_error(CUresult r, const std::string& what) {
  throw cuda_error(what + ": " + detail::describe(detail::loaded().api, r));
}

// Throws kiln::cuda_error("<what>: CUDA_ERROR_NAME (description)") unless r is CUDA_SUCCESS.
inline void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) [[unlikely]]
    throw_error(r, what);
}

// --- devices and contexts ---

inline int device_count() {
  api();  // throws when there is no usable driver
  return detail::loaded().devices;
}

inline void require_device(int device) {
  int n = device_count();
  if (device < 0 || device >= n)
    throw device_error("CUDA: there is no device cuda:" + std::to_string(device) + " (this machine has " +
                       std::to_string(n) + ")");
}

inline CUdevice device_handle(int device) {
  require_device(device);
  CUdevice d = 0;
  check(api().device_get(&d, device), "cuDeviceGet");
  return d;
}

inline CUcontext primary_context(int device) {
  require_device(device);
  detail::DeviceSlot& slot = detail::loaded().slots[device];
  std::call_once(slot.retained, [&] {
    check(api().device_primary_ctx_retain(&slot.context, device_handle(device)), "cuDevicePrimaryCtxRetain");
  });
  return slot.context;
}

// Makes the device's primary context current on this thread. Asking the driver what is current
// (a thread-local read) instead of trusting a cache keeps kiln right when the CUDA runtime
// switches devices behind its back.
inline void make_current(int device) {
  CUcontext wanted = primary_context(device);
  CUcontext now = nullptr;
  check(api().ctx_get_current(&now), "cuCtxGetCurrent");
  if (now != wanted) check(api().ctx_set_current(wanted), "cuCtxSetCurrent");
  detail::current = device;
}

// The device kiln made current last on this thread (0 before any).
inline int current_device() noexcept { return detail::current; }

// Calls that take no device (copies, stream waits) need some context: kiln's current device's
// when the thread has none, otherwise whatever the caller made current.
inline void ensure_context() {
  CUcontext now = nullptr;
  check(api().ctx_get_current(&now), "cuCtxGetCurrent");
  if (!now) make_current(detail::current);
}

inline int attribute(CUdevice_attribute a, int device) {
  int value = 0;
  check(api().device_get_attribute(&value, a, device_handle(device)), "cuDeviceGetAttribute");
  return value;
}

// 90 for compute capability 9.0.
inline int compute_capability(int device) {
  return 10 * attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device) +
         attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device);
}

// The NVRTC target: Hopper gets sm_90a so kernels may use its architecture-specific features.
inline std::string arch(int device) {
  int cc = compute_capability(device);
  return "sm_" + std::to_string(cc) + (cc == 90 ? "a" : "");
}

inline int sm_count(int device) { return attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device); }

// How many blocks of `threads` threads (and their static shared memory) of f one SM holds at once.
inline int resident_blocks(CUfunction f, int threads) {
  int blocks = 0;
  check(api().occupancy_max_active_blocks(&blocks, f, threads, 0), "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

inline std::string device_name(int device) {
  char name[256] = {};
  check(api().device_get_name(name, sizeof(name), device_handle(device)), "cuDeviceGetName");
  return name;
}

// {free, total} bytes of the device's memory.
inline std::pair<std::size_t, std::size_t> memory_info(int device) {
  make_current(device);
  std::size_t free = 0, total = 0;
  check(api().mem_get_info(&free, &total), "cuMemGetInfo");
  return {free, total};
}

// The device that owns a pointer, or -1 for memory the driver does not know (ordinary host memory).
inline int pointer_device(const void* p) {
  int ordinal = -1;
  CUresult r =
      api().pointer_get_attribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, reinterpret_cast<CUdeviceptr>(p));
  return r == CUDA_SUCCESS ? ordinal : -1;
}

// --- streams, copies ---

inline void synchronize(CUstream s) {
  ensure_context();
  check(api().stream_synchronize(s), "cuStreamSynchronize");
}

// True while a CUDA graph capture is recording work queued on s (kiln's or the caller's).
inline bool is_capturing(CUstream s) {
  ensure_context();
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(api().stream_is_capturing(s, &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

inline void synchronize_device(int device) {
  make_current(device);
  check(api().ctx_synchronize(), "cuCtxSynchronize");
}

// Any direction (unified addressing). Host memory is pageable: after a device-to-host copy the
// caller synchronises the stream before reading.
inline void copy_async(void* dst, const void* src, std::size_t bytes, CUstream s) {
  if (bytes == 0) return;
  ensure_context();
  check(api().memcpy_async(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), bytes, s),
        "cuMemcpyAsync");
}

// `height` rows of `width` bytes, each `dst_pitch` / `src_pitch` bytes apart (unified addressing).
inline void copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch, std::size_t width,
                          std::size_t height, CUstream s) {
  if (width == 0 || height == 0) return;
  ensure_context();
  CUDA_MEMCPY2D c{};
  c.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
  c.srcDevice = reinterpret_cast<CUdeviceptr>(src);
  c.srcPitch = src_pitch;
  c.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
  c.dstDevice = reinterpret_cast<CUdeviceptr>(dst);
  c.dstPitch = dst_pitch;
  c.WidthInBytes = width;
  c.Height = height;
  check(api().memcpy_2d_async(&c, s), "cuMemcpy2DAsync");
}

inline void memset_async(void* p, unsigned char v, std::size_t bytes, CUstream s) {
  if (bytes == 0) return;
  ensure_context();
  check(api().memset_d8_async(reinterpret_cast<CUdeviceptr>(p), v, bytes, s), "cuMemsetD8Async");
}

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

// The default allocator. A freed block goes back to a bin keyed by (stream, size class) and is
// reused only on the same stream, where stream order makes reuse safe without events. Blocks go
// back to the driver only when an allocation runs out of memory (or on release_cached).
class CachingAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, int device, CUstream stream) override {
    if (bytes == 0) return nullptr;
    std::size_t size = size_class(bytes);
    if (void* p = take(device, stream, size)) return p;
    // cuMemAlloc would break a capture the caller is recording on this stream.
    if (stream && is_capturing(stream))
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
