// Devices and contexts through the CUDA driver: counting and naming devices, making one current,
// and asking about its attributes, memory and pointers.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "driver_api.hpp"

namespace kiln::driver {

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
// The shared memory a block may have once it asks for it (cuFuncSetAttribute): 227 KiB on sm_90.
inline int shared_optin(int device) { return attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device); }
// The shared memory of one SM, all of its blocks together: 228 KiB on sm_90.
inline int shared_per_sm(int device) { return attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device); }

// A TMA tensor map of a rank-`rank` tensor of 2-byte elements (f16 or bf16) at `base`: dims and byte
// strides innermost first (strides of dims 1 and up), boxes of `box` elements a dim, the 128-byte
// swizzle, zeros where a box passes the dims. False where the copy engine does not take the
// operand (a zero dim, a stride not a multiple of 16 bytes, a misaligned base): the caller then
// copies another way.
inline bool encode_tile_map(CUtensorMap& map, bool bf16, void* base, int rank, const std::uint64_t* dims,
                            const std::uint64_t* strides, const std::uint32_t* box) {
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  cuuint64_t d[5], s[4];
  cuuint32_t b[5];
  for (int i = 0; i < rank; ++i) d[i] = dims[i], b[i] = box[i];
  for (int i = 0; i + 1 < rank; ++i) s[i] = strides[i];
  return api().tensor_map_encode_tiled(&map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                       static_cast<cuuint32_t>(rank), base, d, s, b, ones,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                       CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// How many blocks of `threads` threads (and their static shared memory) of f one SM holds at once.
inline int resident_blocks(CUfunction f, int threads, std::size_t shared_bytes = 0) {
  int blocks = 0;
  check(api().occupancy_max_active_blocks(&blocks, f, threads, shared_bytes), "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  return blocks;
}

// The bytes of local memory a thread of f uses: ptxas's stack frame (spilled registers, arrays it
// could not keep in registers).
inline int local_bytes(CUfunction f) {
  int bytes = 0;
  check(api().func_get_attribute(&bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f), "cuFuncGetAttribute");
  return bytes;
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

}  // namespace kiln::driver
