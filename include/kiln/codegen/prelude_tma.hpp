// The Hopper kernels' mbarriers and TMA copies, as kernel text (the attention kernels' stages,
// attention_tma.hpp, and the GEMM template's, prelude_dot.hpp's DOT_TMA): an mbarrier's init, phase
// wait and arrival, and the tensor map a launcher encodes (driver::encode_tile_map) with the arrival
// that expects a copy's bytes.
#pragma once
#include <string>

namespace kiln::codegen {

// mbarriers in shared memory: init, a phase's wait, an arrival.
inline std::string mbarrier_functions() {
  return R"(__device__ __forceinline__ void kiln_mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Whether the phase of parity `parity` has completed (waits a while in hardware first).
__device__ __forceinline__ bool kiln_mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  return done != 0;
}
__device__ __forceinline__ void kiln_mbar_wait(u32 bar, u32 parity) {
  while (!kiln_mbar_try_wait(bar, parity)) {
  }
}
__device__ __forceinline__ void kiln_mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
)";
}

// TMA: a tensor map parameter and an arrival expecting bytes.
inline std::string tma_map_functions() {
  return R"(// A tensor map (CUtensorMap: 128 opaque bytes the launcher encodes with cuTensorMapEncodeTiled):
// boxes of 64 columns (128 bytes) in the 128-byte swizzle, which is the tiles' layout.
struct __align__(64) kiln_tensor_map {
  unsigned long long opaque[16];
};
// One arrival on `bar` that also expects `bytes` more to land on it.
__device__ __forceinline__ void kiln_mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
)";
}

}  // namespace kiln::codegen
