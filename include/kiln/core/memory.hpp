// Raw memory for tensors on any device: host memory is 64-byte aligned, device memory comes from
// the driver's stream-ordered caching allocator (core/driver.hpp).
#pragma once
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "device.hpp"
#include "driver.hpp"

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

inline void* allocate(std::size_t bytes, Device d, CUstream s) {
  if (d.is_cpu()) {
    std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded ? rounded : 64);
    if (!p) throw std::bad_alloc();
    return p;
  }
  require_device(d, "allocate");
  return bytes ? driver::allocate(bytes, d.index, s) : nullptr;
}

inline void deallocate(void* p, std::size_t bytes, Device d, CUstream s) noexcept {
  if (d.is_cpu()) return std::free(p);
  try {
    if (p) driver::deallocate(p, bytes, d.index, s);
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
