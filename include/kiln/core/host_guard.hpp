// Host blocks against inaccessible pages, for finding kernels that read or write outside a buffer
// (KILN_HOST_GUARD_PAGES, read once, at the first host allocation): `after` (or 1) ends each block
// at a PROT_NONE page, `before` starts each block right after one. A generated kernel that touches
// a byte outside its block then stops the process with SIGSEGV, where an ordinary heap would hand
// it a neighbour's bytes and the result could still come out right (a masked-off lane's value is
// discarded: a padded split's gather read 512 KB past the logits for weeks, benchmarks/NOTES.md
// item 129). The CPU runs the same kernel source as the GPU, so this checks both without a device.
// Blocks stay 64-byte aligned: with `after` a block's last bytes past its tensor's end (fewer than
// 64) are still readable. Every block is its own mapping, freed at once (no host cache): slow, for
// tests.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <string_view>

#include "config.hpp"

namespace kiln::memory {

enum class HostGuard { off, after, before };

inline HostGuard host_guard() {
  static const HostGuard mode = [] {
    const char* v = config::env("KILN_HOST_GUARD_PAGES");
    if (!v || std::string_view(v) == "0") return HostGuard::off;
    return std::string_view(v) == "before" ? HostGuard::before : HostGuard::after;
  }();
  return mode;
}

namespace detail {

inline std::size_t page_bytes() {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return page;
}
// The pages of a guarded block of `block` bytes, without its two guard pages.
inline std::size_t guarded_body(std::size_t block) { return (block + page_bytes() - 1) / page_bytes() * page_bytes(); }

}  // namespace detail

// A block of `block` bytes between two PROT_NONE pages, touching the one `side` names (after: its
// last byte before the upper page; before: its first after the lower); nullptr when the system
// refuses the mapping. The block's alignment is the page's less `block` (after) or the page's.
inline void* guarded_allocate(std::size_t block, HostGuard side) {
  const std::size_t page = detail::page_bytes(), body = detail::guarded_body(block);
  void* m = mmap(nullptr, body + 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  char* base = static_cast<char*>(m);
  if (mprotect(base, page, PROT_NONE) != 0 || mprotect(base + page + body, page, PROT_NONE) != 0) {
    munmap(m, body + 2 * page);
    return nullptr;
  }
  return side == HostGuard::before ? base + page : base + page + body - block;
}

inline void guarded_free(void* p, std::size_t block, HostGuard side) {
  const std::size_t page = detail::page_bytes(), body = detail::guarded_body(block);
  char* data = static_cast<char*>(p);
  char* base = side == HostGuard::before ? data - page : data + block - body - page;
  munmap(base, body + 2 * page);
}

}  // namespace kiln::memory
