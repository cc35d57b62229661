// Host memory between two inaccessible pages: a kernel that reads even one element past a tensor
// placed against one of them stops the test with SIGSEGV, where an ordinary buffer would hand it a
// neighbour's bytes and the result could still come out right (a masked-off lane's value is
// discarded). The CPU runs the same generated kernels as the GPU, so this finds over-reads without
// a device (a padded split's gather read rows past the logits: test_gather).
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <stdexcept>

#include <kiln/kiln.hpp>

namespace {

// Which end of the copy touches its guard page (both ends have one).
enum class Guard { after, before };

class GuardedHost {
 public:
  // A copy of the CPU tensor `src` with its layout (strides, the part of its storage it views),
  // the last byte of that part just before the upper guard page, or its first just after the lower.
  explicit GuardedHost(const kiln::Tensor& src, Guard tight = Guard::after) {
    std::int64_t extent = src.numel() > 0 ? 1 : 0;  // elements of the storage the view spans
    if (src.numel() > 0)
      for (int d = 0; d < src.dim(); ++d) extent += (src.shape()[d] - 1) * src.strides()[d];
    const std::size_t bytes = static_cast<std::size_t>(extent) * kiln::itemsize(src.dtype());
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t body = (bytes + page - 1) / page * page;
    len_ = body + 2 * page;
    void* p = mmap(nullptr, len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("GuardedHost: mmap failed");
    base_ = static_cast<char*>(p);
    if (mprotect(base_, page, PROT_NONE) != 0 || mprotect(base_ + page + body, page, PROT_NONE) != 0)
      throw std::runtime_error("GuardedHost: mprotect failed");
    char* data = tight == Guard::after ? base_ + page + body - bytes : base_ + page;
    if (bytes) std::memcpy(data, src.data_ptr(), bytes);
    tensor = kiln::Tensor::wrap(data, {extent}, src.dtype(), kiln::cpu).as_strided(src.shape(), src.strides(), 0);
  }
  GuardedHost(const GuardedHost&) = delete;
  GuardedHost& operator=(const GuardedHost&) = delete;
  ~GuardedHost() { munmap(base_, len_); }

  kiln::Tensor tensor;  // borrows the mapping: must not outlive this object

 private:
  char* base_ = nullptr;
  std::size_t len_ = 0;
};

}  // namespace
