// The CUDA driver's entry points, looked up with dlopen and dlsym on first use so that kiln loads
// (and its CPU path runs) on machines without a driver; check() turns a CUresult into an error.
#pragma once
#include <cuda.h>  // types and prototypes only: libcuda is never linked
#include <dlfcn.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "error.hpp"

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
  X(memset_d2d8_async, cuMemsetD2D8Async)                                     \
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
  X(func_get_attribute, cuFuncGetAttribute)                                   \
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
  X(graph_destroy, cuGraphDestroy)                                            \
  X(tensor_map_encode_tiled, cuTensorMapEncodeTiled)

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

}  // namespace kiln::driver
