// k::Stream: a borrowed CUstream / cudaStream_t on which kiln orders its work, and k::synchronize().
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

#include "driver.hpp"

namespace kiln {

// Never owns its stream. cudaStream_t is the same type as CUstream (CUstream_st*), so one implicit
// constructor accepts either; the default is the legacy default stream, 0.
class Stream {
 public:
  constexpr Stream() = default;
  constexpr Stream(CUstream s) : handle_(s) {}

  constexpr CUstream handle() const { return handle_; }
  constexpr bool is_default() const { return handle_ == nullptr; }

  // Waits for everything queued on the stream so far.
  void synchronize() const { driver::synchronize(handle_); }

  friend constexpr bool operator==(Stream a, Stream b) { return a.handle_ == b.handle_; }
  std::string str() const {
    if (!handle_) return "stream(default)";
    return "stream(0x" + to_hex(reinterpret_cast<std::uintptr_t>(handle_)) + ")";
  }
  friend std::ostream& operator<<(std::ostream& os, Stream s) { return os << s.str(); }

 private:
  static std::string to_hex(std::uintptr_t v) {
    std::string s;
    do s.insert(s.begin(), "0123456789abcdef"[v % 16]);
    while (v /= 16);
    return s;
  }
  CUstream handle_ = nullptr;
};

// Waits for kiln's work on the current device (the one kiln made current last on this thread,
// device 0 before any). Nothing can be pending before the driver is loaded, so then it returns at once.
inline void synchronize() {
  if (driver::initialized()) driver::synchronize_device(driver::current_device());
}

}  // namespace kiln
