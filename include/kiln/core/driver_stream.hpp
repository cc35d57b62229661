// Stream-ordered work through the CUDA driver: synchronising, asking about graph capture, and
// asynchronous copies and memsets.
#pragma once
#include <cstddef>

#include "driver_device.hpp"

namespace kiln::driver {

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

// `height` rows of `width` bytes each, `pitch` bytes apart, set to v.
inline void memset_2d_async(void* p, std::size_t pitch, unsigned char v, std::size_t width, std::size_t height,
                            CUstream s) {
  if (width == 0 || height == 0) return;
  ensure_context();
  check(api().memset_d2d8_async(reinterpret_cast<CUdeviceptr>(p), pitch, v, width, height, s), "cuMemsetD2D8Async");
}

}  // namespace kiln::driver
