// The Hopper attention kernels' mbarriers and TMA copies, as kernel text: an mbarrier's init, phase
// wait and arrival (the producer forward's stages and q buffers), and the copy engine's loads of
// swizzled tiles from tensor maps the launcher encodes (runtime/extern/attention.hpp's tile_map;
// benchmarks/NOTES.md item 191).
#pragma once
#include <string>

#include "prelude_tma.hpp"

namespace kiln::codegen::attention_sm90_detail {

using codegen::mbarrier_functions;

// TMA: the tensor map parameter, an arrival expecting bytes (prelude_tma.hpp), and a swizzled tile's
// rows of a [B, H, T, D] operand (dims {D, T, H, B} innermost first, boxes of 64 columns and a tile's
// rows: the tiles' layout, attention_kernel_sm90.hpp's load_tile_sw128) by the copy engine (NOTES
// item 191).
inline std::string tma_functions() {
  return tma_map_functions() +
         R"(// Rows [r0, r0 + ROWS) of (batch, head) into a swizzled tile, one 64-column panel a box; its bytes
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
