// What every fused attention kernel's source begins with (codegen/attention_kernel.hpp's mma.sync
// kernels, the Hopper kernels of attention_kernel_sm90*.hpp and the backward's): an inlined
// score_mod's functions, the tile primitives (cp.async, ldmatrix, mma.sync, packing, exp2), the
// order in which blocks take (batch, head) tiles, and the swizzled shared-memory tiles.
#pragma once
#include <string>
#include <string_view>

#include "../core/tuning.hpp"
#include "prelude.hpp"
#include "prelude_mma.hpp"

namespace kiln::codegen {

// A kernel name's mark of the score_mod it inlines (its tag: a hash of its source, computed once
// when lowering registers it; nothing without one).
inline std::string score_mod_suffix(std::string_view mod_source, std::string_view tag) {
  return mod_source.empty() ? std::string() : "_mod" + std::string(tag);
}
// What a kernel's source puts first: without a score_mod, empty parameter macros; with one, the
// prelude its functions are written with (16-bit types only where the mod rounds to them), the
// functions, and the parameters they add (the forward's scale, the mod's scalars by value).
inline std::string score_mod_preamble(std::string_view mod_source) {
  if (mod_source.empty()) return "#define KILN_MOD_PARAMS\n#define KILN_BACKWARD_MOD_PARAMS\n";
  std::string s = "#define KILN_SCORE_MOD 1\n";
  s += "#define KILN_MOD_PARAMS , float scale, kiln_score_scalars mod_scalars\n";
  s += "#define KILN_BACKWARD_MOD_PARAMS , kiln_score_scalars mod_scalars\n";
  if (mod_source.find("round_to<") != std::string::npos || mod_source.find("to_compute(") != std::string::npos)
    s += "#define KILN_HALF 1\n";  // (the mod rounds to or reads 16-bit values)
  return s + prelude + std::string(mod_source) + R"(
// The mod at the score of query i and key j, into the exp2 domain (-inf outside Tq x Tk), and back
// through it (the cotangent ds of the modded score given, none where its probability p is 0:
// outside the scores too, where a non-finite dO or v gives NaN). Both run at every score without a
// branch, at indices clamped into the scores (the tensors the mod reads end there): a branch around
// each score's mod made it a block of its own, and a tile's scores ran one after the other.
__device__ __forceinline__ float kiln_mod_score(float s, int b, int h, int i, int j, int Tq, int Tk,
                                                const kiln_score_scalars& S) {
  const float m = kiln_score_mod(s, b, h, i < Tq ? i : Tq - 1, j < Tk ? j : Tk - 1, S) * 1.4426950408889634f;
  return i < Tq && j < Tk ? m : -KILN_INF;
}
__device__ __forceinline__ float kiln_mod_vjp(float s, int b, int h, int i, int j, int Tq, int Tk,
                                              const kiln_score_scalars& S, float p, float ds) {
  const float d = kiln_score_mod_vjp(s, b, h, i < Tq ? i : Tq - 1, j < Tk ? j : Tk - 1, S, ds);
  return p != 0.f ? d : ds;
}
)";
}

// What the attention kernels share (after their KILN_D and KILN_WARPS defines): the tile primitives
// and the swizzled shared-memory tiles that cp.async fills.
inline std::string attention_prelude() {
  static const int order = Tuning::from_environment().attention_order;  // an A/B knob: see Tuning
  return std::string(order == 0   ? "#define KILN_TILE_BY_TILE 1\n"
                     : order == 2 ? "#define KILN_SHORT_TILES_LAST 1\n"
                                  : "") +
         R"(
)" + std::string(prelude_mma) +
         R"(__device__ __forceinline__ float kiln_log2(float x) {
  float r;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float kiln_bf16_to_f32(u16 x) { return __uint_as_float((u32)x << 16); }
__device__ __forceinline__ float kiln_f16_to_f32(u16 x) {
  float r;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(r) : "h"(x));
  return r;
}
__device__ __forceinline__ float kiln_exp2(float x) {  // 2^x, -inf -> 0
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// ---- which tile of which (batch, head) a block computes ----------------------------------------------
// Blocks start in the order of their linear index (x fastest, then y, then z: x the tiles of a pair,
// y and z the pairs). Causal tiles differ in work (a query tile near the sequence's end reads every
// key before it); tile by tile within each pair put the longest tiles of the last pairs into the
// final wave. So causal blocks go longest first (LPT): over groups of pairs whose `bytes_a_pair` of
// re-read operands (keys and values, or queries and their gradient) fit KILN_L2_GROUP_BYTES (half
// an H100's L2) together, each tile rank in turn over the group's pairs, so the group's operands
// stay in L2 while all its tiles run. A list schedule of GPT-2's causal forward (96 pairs of 8
// tiles of 128 rows, 25 MB of keys and values: one group; 1-2 blocks on each of 132 SMs) then ends
// 13-22% sooner (benchmarks/NOTES.md item 156). Not causal: every tile the same work, tile by tile
// within each pair as before. rank: the tile's place in the order (0 first); false past the last
// pair. kiln_tile_at places the tile at `at` of that order (a looping block's tiles: tiles a pair).
// A looping block's tiles are fixed in advance (round robin), so where the last tile of each pair
// is `short_last` (Tq no multiple of the block's rows) and not causal, those short tiles go after
// every full one: tile by tile, the short ones all fall to the same blocks whenever the number of
// blocks is a multiple of the tiles a pair (132 SMs, 6 tiles of 192 rows at T 1024), which then
// take a whole tile more than the rest (NOTES item 186; under KILN_TUNE_ATTENTION_ORDER=2 for now).
#define KILN_L2_GROUP_BYTES (24ll << 20)
__device__ __forceinline__ bool kiln_tile_at(long long at, int tiles, bool causal, int pairs, long long bytes_a_pair,
                                             int& rank, int& pair, bool short_last = false) {
#ifdef KILN_TILE_BY_TILE
  causal = false;  // KILN_TUNE_ATTENTION_ORDER=0: the order before
#endif
  if (!causal) {
#ifdef KILN_SHORT_TILES_LAST
    if (short_last) {
      const long long whole = (long long)pairs * (tiles - 1);
      if (at < whole) {
        rank = (int)(at % (tiles - 1));
        pair = (int)(at / (tiles - 1));
        return true;
      }
      rank = tiles - 1;  // past the full tiles: each pair's short one
      pair = (int)(at - whole);
      return pair < pairs;
    }
#endif
    rank = (int)(at % tiles);
    pair = (int)(at / tiles);
    return pair < pairs;
  }
  const long long group = bytes_a_pair > 0 && bytes_a_pair < KILN_L2_GROUP_BYTES ? KILN_L2_GROUP_BYTES / bytes_a_pair : 1;
  const long long g = at / (group * tiles), first = g * group;
  if (first >= pairs) return false;
  const long long size = pairs - first < group ? pairs - first : group, r = at - g * group * tiles;
  rank = (int)(r / size);
  pair = (int)(first + r % size);
  return rank < tiles;
}
__device__ __forceinline__ bool kiln_block_tile(bool causal, int pairs, long long bytes_a_pair, int& rank, int& pair) {
  const int tiles = gridDim.x;
#ifdef KILN_TILE_BY_TILE
  causal = false;
#endif
  if (!causal) {
    rank = blockIdx.x;
    pair = blockIdx.z * 65535 + blockIdx.y;  // more than 65535 pairs go on along z
    return pair < pairs;
  }
  return kiln_tile_at(((long long)blockIdx.z * gridDim.y + blockIdx.y) * tiles + blockIdx.x, tiles, true, pairs,
                      bytes_a_pair, rank, pair);
}

// ---- shared-memory tiles ---------------------------------------------------------------------------
#define KILN_NEG_INF __int_as_float(0xff800000)
#define CH (KILN_D / 8)             // 16-byte chunks a row of a tile
#define SWZ (CH % 8 == 0 ? 8 : (CH & (CH - 1)) == 0 ? CH : 1)  // an XOR that stays inside the row
// Chunk `c` of tile row `r`, XOR-swizzled: the eight rows one ldmatrix reads sit in eight bank groups.
#define TILE(t, r, c) ((t) + (r) * CH + ((c) ^ ((r) % SWZ)))

// Rows [r0, r0 + ROWS) of a [T, D] operand with row stride st into a tile; rows past T read zeros.
template <int ROWS>
__device__ __forceinline__ void load_tile(uint4* tile, const u16* src, i64 st, int r0, int T) {
  for (int c = threadIdx.x; c < ROWS * CH; c += KILN_WARPS * 32) {
    const int r = c / CH, ch = c % CH;
    const bool in = r0 + r < T;
    kiln_cp_async16(TILE(tile, r, ch), in ? src + (i64)(r0 + r) * st + ch * 8 : src, in ? 16 : 0);
  }
}
)";
}

}  // namespace kiln::codegen
