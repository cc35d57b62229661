// The Hopper attention kernels' mbarriers and TMA copies, as kernel text: an mbarrier's init, phase
// wait and arrival (the producer forward's stages and q buffers), and the copy engine's loads of
// swizzled tiles from tensor maps the launcher encodes (runtime/extern/attention.hpp's tile_map;
// benchmarks/NOTES.md item 191).
#pragma once
#include <string>

namespace kiln::codegen::attention_sm90_detail {

// mbarriers in shared memory: init, a phase's wait, an arrival (the producer forward and the
// backwards' TMA stages).
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

// TMA: a tensor map parameter, an arrival expecting bytes, and a swizzled tile's rows by the copy
// engine (NOTES item 191).
inline std::string tma_functions() {
  return R"(// A tensor map (CUtensorMap: 128 opaque bytes the launcher encodes with cuTensorMapEncodeTiled) of a
// [B, H, T, D] operand: dims {D, T, H, B} innermost first, boxes of 64 columns and a tile's rows,
// the 128-byte swizzle, which is the tiles' layout (attention_kernel_sm90.hpp's load_tile_sw128).
struct __align__(64) kiln_tensor_map {
  unsigned long long opaque[16];
};
// One arrival on `bar` that also expects `bytes` more to land on it.
__device__ __forceinline__ void kiln_mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Rows [r0, r0 + ROWS) of (batch, head) into a swizzled tile, one 64-column panel a box; its bytes
// land on `bar` (rows past T count too: the copy engine writes them as zeros).
template <int ROWS>
__device__ __forceinline__ void kiln_tma_tile(u32 tile, const kiln_tensor_map& map, int r0, int head, int batch,
                                              u32 bar) {
  const unsigned long long m = reinterpret_cast<unsigned long long>(&map);
#pragma unroll
  for (int p = 0; p < KILN_D / 64; ++p)
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5}], [%6];\n" ::"r"(tile + p * (ROWS * 128)),
        "l"(m), "r"(p * 64), "r"(r0), "r"(head), "r"(batch), "r"(bar)
        : "memory");
}
)";
}

}  // namespace kiln::codegen::attention_sm90_detail
