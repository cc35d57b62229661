// Host memory that ends at an inaccessible page: a kernel that reads even one element past a tensor
// placed there stops the test with SIGSEGV, where an ordinary buffer would hand it a neighbour's
// bytes and the result could still come out right (a masked-off lane's value is discarded). The
// CPU runs the same generated kernels as the GPU, so this finds over-reads without a device.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <stdexcept>

#include <kiln/kiln.hpp>

namespace {

class GuardedHost {
 public:
  // A copy of the contiguous CPU tensor `src` whose last byte is the last one before the guard page.
  explicit GuardedHost(const kiln::Tensor& src) {
    const std::size_t bytes = src.nbytes();
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    const std::size_t body = (bytes + page - 1) / page * page;
    len_ = body + page;
    void* p = mmap(nullptr, len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("GuardedHost: mmap failed");
    base_ = static_cast<char*>(p);
    if (mprotect(base_ + body, page, PROT_NONE) != 0) throw std::runtime_error("GuardedHost: mprotect failed");
    char* data = base_ + body - bytes;
    std::memcpy(data, src.contiguous().data_ptr(), bytes);
    tensor = kiln::Tensor::wrap(data, src.shape(), src.dtype(), kiln::cpu);
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
