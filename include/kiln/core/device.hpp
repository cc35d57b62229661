// Devices: k::cpu, k::cuda (device 0) and k::cuda(n).
#pragma once
#include <cstdint>
#include <ostream>
#include <string>

namespace kiln {

struct Device {
  enum class Kind : std::uint8_t { cpu, cuda };
  Kind kind = Kind::cpu;
  int index = 0;

  constexpr bool is_cpu() const { return kind == Kind::cpu; }
  constexpr bool is_cuda() const { return kind == Kind::cuda; }
  friend constexpr bool operator==(Device a, Device b) { return a.kind == b.kind && a.index == b.index; }
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  friend std::ostream& operator<<(std::ostream& os, Device d) { return os << d.str(); }
};

// k::cuda is device 0 and also callable: k::cuda(1).
struct CudaDevices {
  constexpr Device operator()(int n) const { return Device{Device::Kind::cuda, n}; }
  constexpr operator Device() const { return Device{Device::Kind::cuda, 0}; }
};

inline constexpr Device cpu{Device::Kind::cpu, 0};
inline constexpr CudaDevices cuda{};

}  // namespace kiln
