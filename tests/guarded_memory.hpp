// A test's input between two inaccessible pages (kiln::memory::guarded_allocate, what
// KILN_HOST_GUARD_PAGES does for every host block): a kernel that reads even one element past the
// tensor, or before it, stops the test with SIGSEGV, where an ordinary buffer would hand it a
// neighbour's bytes and the result could still come out right (a masked-off lane's value is
// discarded). The CPU runs the same generated kernels as the GPU, so this finds over-reads without
// a device (a padded split's gather read rows past the logits: test_gather).
#pragma once
#include <cstddef>
#include <cstring>
#include <stdexcept>

#include <kiln/kiln.hpp>

namespace {

// Which end of the copy touches its guard page.
enum class Guard { after, before };

class GuardedHost {
 public:
  // A copy of the CPU tensor `src` with its layout (strides, the part of its storage it views),
  // the last byte of that part just before the upper guard page, or its first just after the lower:
  // exactly, not rounded to 64 bytes as KILN_HOST_GUARD_PAGES's blocks are.
  explicit GuardedHost(const kiln::Tensor& src, Guard tight = Guard::after)
      : side_(tight == Guard::after ? kiln::memory::HostGuard::after : kiln::memory::HostGuard::before) {
    std::int64_t extent = src.numel() > 0 ? 1 : 0;  // elements of the storage the view spans
    if (src.numel() > 0)
      for (int d = 0; d < src.dim(); ++d) extent += (src.shape()[d] - 1) * src.strides()[d];
    bytes_ = static_cast<std::size_t>(extent) * kiln::itemsize(src.dtype());
    data_ = kiln::memory::guarded_allocate(bytes_, side_);
    if (!data_) throw std::runtime_error("GuardedHost: mmap or mprotect failed");
    if (bytes_) std::memcpy(data_, src.data_ptr(), bytes_);
    tensor = kiln::Tensor::wrap(data_, {extent}, src.dtype(), kiln::cpu).as_strided(src.shape(), src.strides(), 0);
  }
  GuardedHost(const GuardedHost&) = delete;
  GuardedHost& operator=(const GuardedHost&) = delete;
  ~GuardedHost() { kiln::memory::guarded_free(data_, bytes_, side_); }

  kiln::Tensor tensor;  // borrows the mapping: must not outlive this object

 private:
  kiln::memory::HostGuard side_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace
