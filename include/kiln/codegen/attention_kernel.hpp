// The fused attention forward kernel's source (k::attention on the GPU, 16-bit q/k/v): one block of
// W warps computes 16 * W query rows of one (batch, head) against every key tile, FlashAttention-2's
// schedule. Each warp holds its 16 rows' q as tensor-core fragments; key and value tiles of 64 rows
// are staged in shared memory by cp.async (16-byte chunks, XOR-swizzled so that ldmatrix's eight
// row reads hit eight bank groups), the scores q k^T come from mma.sync m16n8k16 with f32
// accumulation, the softmax is online (running max and sum a row, in the exp2 domain), and the
// probabilities go back into the second mma as A fragments straight from the score registers.
// Keys past Tk and, for causal attention, keys after the query (aligned top-left, as torch's SDPA)
// are masked; a row with no key gives zeros. The value tile's load overlaps q k^T, the next key
// tile's load overlaps p v. Given an lse buffer [B, H, Tq] f32, each row's log-sum-exp goes there
// too (what the fused backward reads; +inf for a row with no key).
//
// The tile primitives (kiln_cp_async16, kiln_ldmatrix_x4, kiln_mma_16816) are what a block
// program's `dot` is made of (issue 20); the kernel is written out once here, specialised by
// defines: the head dim, the warps, causal, bf16 or f16.
#pragma once
#include <string>
#include <string_view>

#include "../core/dtype.hpp"
#include "../core/tuning.hpp"
#include "prelude.hpp"

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

struct AttentionKernel {
  int head_dim = 64;  // D, a multiple of 16, at most 128
  int warps = 4;      // warps a block
  int row_tiles = 1;  // 16-row tiles of queries a warp: each key and value fragment serves them all
  bool causal = false;
  dtype dt = dtype::bf16;  // bf16 or f16

  int key_rows = 64;           // keys a tile (64 or 32)
  bool q_in_registers = true;  // else q's fragments are read from shared memory at each key tile
  // > 0: the Hopper kernel (attention_kernel_sm90.hpp), this many warpgroups of 64 query rows a
  // block, 128 keys a tile, q and two stages of k and v in shared memory; warps, row_tiles and
  // q_in_registers are then unused.
  int warpgroups = 0;
  // Hopper only: a producer warpgroup loads q and the key tiles behind mbarriers into `stages()` stages,
  // and the two warpgroups take turns on the tensor cores (attention_kernel_sm90_pingpong.hpp).
  bool producer = false;
  // A score_mod's functions (codegen/score_mod_source.hpp), applied to each scaled score before the
  // mask and the softmax; empty: none. Both kinds take one, as do both kinds of backward kernels.
  // Views of the registered
  // mod's text (autodiff/score_mods.hpp), which lives as long as the process: no copy a launch.
  std::string_view score_mod, score_mod_tag;

  // The values a thread holds, in 32-bit registers: per row tile o's D/2, the scores' key_rows/2
  // and, in registers, q's D/4.
  int held_registers() const { return row_tiles * (head_dim / 2 + key_rows / 2 + (q_in_registers ? head_dim / 4 : 0)); }
  // The configuration for a head dim: the most reuse of each shared-memory fragment (two row tiles
  // a warp, q in registers, 64 keys a tile, given up in that order) whose held values fit 192 of the
  // 255 registers a thread may have, leaving the rest to addresses and fragments in flight (ptxas,
  // sm_90a: D 64 with 2 tiles and q in registers, 160 held, takes 244 registers without spilling;
  // D 128 with q in shared memory, 192 held, spills 130-250 bytes and still runs 5-8% faster on
  // an H200 than its 32-key tiles, 160 held, which o's rescaling and the loop cost at every 32 keys;
  // q in registers too, 256 held, spills 600 bytes). row_tiles > 0 forces the row tiles.
  static AttentionKernel for_head_dim(int head_dim, int row_tiles = 0) {
    AttentionKernel a;
    a.head_dim = head_dim;
    for (int t : {2, 1}) {
      if (row_tiles > 0 && t != row_tiles) continue;
      a.row_tiles = t;
      for (bool in_registers : {true, false})
        for (int keys : {64, 32}) {
          a.q_in_registers = in_registers;
          a.key_rows = keys;
          if (a.held_registers() <= 192) return a;
        }
    }
    return a;  // the last tried: 1 tile, q in shared memory, 32 keys
  }
  // The Hopper kernel for a head dim it takes (64 or 128), else nothing changed: two warpgroups a
  // block, or one (64 query rows, several blocks an SM where registers and shared memory allow).
  // With `producer`, two warpgroups fed by a producer warpgroup.
  static AttentionKernel hopper(AttentionKernel a, int warpgroups = 2, bool producer = false) {
    if (a.head_dim != 64 && a.head_dim != 128) return a;
    a.warpgroups = producer ? 2 : warpgroups;
    a.warps = 4 * a.warpgroups;
    a.key_rows = 128;
    a.producer = producer;
    return a;
  }
  int threads() const { return 32 * warps + (producer ? 128 : 0); }
  int query_rows() const { return warpgroups > 0 ? 64 * warpgroups : 16 * row_tiles * warps; }
  // Stages of key and value tiles in shared memory: two, or with a producer three where they fit
  // the 227 KB a block may have on Hopper (they do at D 64 and 128: 113 and 225 KB).
  int stages() const {
    if (!producer) return 2;
    return (query_rows() + 6 * key_rows) * head_dim * 2 + 1024 + 64 <= 227 * 1024 ? 3 : 2;
  }
  // Hopper: q and the stages of k and v, 1024 bytes to align the tiles on the swizzle's period, and
  // with a producer its mbarriers.
  int shared_bytes() const {
    return warpgroups > 0 ? (query_rows() + 2 * stages() * key_rows) * head_dim * 2 + 1024 + (producer ? 64 : 0)
                          : (query_rows() + 2 * key_rows) * head_dim * 2;
  }
  std::string name() const {
    if (warpgroups > 0)
      return "kiln_attention_fwd_wgmma_d" + std::to_string(head_dim) + "_wg" + std::to_string(warpgroups) + "_k" +
             std::to_string(key_rows) + (producer ? "_pp" : "") + (causal ? "_causal" : "") + "_" +
             std::string(kiln::name(dt)) + score_mod_suffix(score_mod, score_mod_tag);
    return "kiln_attention_fwd_d" + std::to_string(head_dim) + "_w" + std::to_string(warps) + "x" +
           std::to_string(row_tiles) + "_k" + std::to_string(key_rows) + (q_in_registers ? "" : "_qs") +
           (causal ? "_causal" : "") + "_" + std::string(kiln::name(dt)) + score_mod_suffix(score_mod, score_mod_tag);
  }
};

// What the attention kernels share (after their KILN_D and KILN_WARPS defines): the tile primitives
// and the swizzled shared-memory tiles that cp.async fills.
inline std::string attention_prelude() {
  static const bool longest_first = Tuning::from_environment().attention_order != 0;  // an A/B knob: see Tuning
  return std::string(longest_first ? "" : "#define KILN_TILE_BY_TILE 1\n") + R"(
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// ---- tile primitives -------------------------------------------------------------------------------
__device__ __forceinline__ u32 kiln_shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// 16 bytes global -> shared, asynchronously; bytes < 16 fills the rest with zeros.
__device__ __forceinline__ void kiln_cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(kiln_shared_address(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void kiln_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void kiln_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// Four 8x8 16-bit matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void kiln_ldmatrix_x4(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_shared_address(row)));
}
__device__ __forceinline__ void kiln_ldmatrix_x4_trans(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(kiln_shared_address(row)));
}
// d += a b for a 16x16 tile a (row major), a 16x8 tile b (column major), f32 d.
__device__ __forceinline__ void kiln_mma_16816_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void kiln_mma_16816_f16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 values as one word of two 16-bit values, x0 in the low half (the lower address).
__device__ __forceinline__ u32 kiln_pack_bf16(float x0, float x1) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x0), "f"(x1));
  return r;
}
__device__ __forceinline__ u32 kiln_pack_f16(float x0, float x1) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;\n" : "=r"(r) : "f"(x0), "f"(x1));
  return r;
}
__device__ __forceinline__ float kiln_log2(float x) {
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
// pair.
#define KILN_L2_GROUP_BYTES (24ll << 20)
__device__ __forceinline__ bool kiln_block_tile(bool causal, int pairs, long long bytes_a_pair, int& rank, int& pair) {
  const int tiles = gridDim.x;
#ifdef KILN_TILE_BY_TILE
  causal = false;  // KILN_TUNE_ATTENTION_ORDER=0: the order before
#endif
  if (!causal) {
    rank = blockIdx.x;
    pair = blockIdx.z * 65535 + blockIdx.y;  // more than 65535 pairs go on along z
    return pair < pairs;
  }
  const long long at = ((long long)blockIdx.z * gridDim.y + blockIdx.y) * tiles + blockIdx.x;
  const long long group = bytes_a_pair > 0 && bytes_a_pair < KILN_L2_GROUP_BYTES ? KILN_L2_GROUP_BYTES / bytes_a_pair : 1;
  const long long g = at / (group * tiles), first = g * group;
  if (first >= pairs) return false;
  const long long size = pairs - first < group ? pairs - first : group, r = at - g * group * tiles;
  rank = (int)(r / size);
  pair = (int)(first + r % size);
  return rank < tiles;
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

inline std::string attention_forward_source(const AttentionKernel& a) {
  const std::string mma_type = a.dt == dtype::bf16 ? "bf16" : "f16";
  std::string s = "// " + a.name() + ": fused attention forward (codegen/attention_kernel.hpp)\n";
  s += "#define KILN_D " + std::to_string(a.head_dim) + "\n";
  s += "#define KILN_WARPS " + std::to_string(a.warps) + "\n";
  s += "#define KILN_ROW_TILES " + std::to_string(a.row_tiles) + "\n";
  s += "#define KILN_KEY_ROWS " + std::to_string(a.key_rows) + "\n";
  s += "#define KILN_Q_IN_REGISTERS " + std::string(a.q_in_registers ? "1" : "0") + "\n";
  s += "#define KILN_CAUSAL " + std::string(a.causal ? "1" : "0") + "\n";
  s += "#define KILN_MMA(d, a, b0, b1) kiln_mma_16816_" + mma_type + "(d, a, b0, b1)\n";
  s += "#define KILN_PACK kiln_pack_" + mma_type + "\n";
  s += "#define KILN_NAME " + a.name() + "\n";
  s += score_mod_preamble(a.score_mod);
  s += attention_prelude();
  s += R"(
// ---- the forward kernel ------------------------------------------------------------------------
#define MT KILN_ROW_TILES  // 16-row tiles a warp
#define BM (16 * MT * KILN_WARPS)
#define BN KILN_KEY_ROWS
#define KILN_RESCALE 8.f  // how far a row's max may pass the base before o is rescaled (log2)

extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
          int BH, int H, int G, int Tq, int Tk, float scale_log2, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb,
          i64 vh, i64 vt, i64 ob, i64 oh, i64 ot, float* __restrict__ lse KILN_MOD_PARAMS) {
  extern __shared__ __align__(128) unsigned char kiln_smem[];
  uint4* Qs = reinterpret_cast<uint4*>(kiln_smem);
  uint4* Ks = Qs + BM * CH;
  uint4* Vs = Ks + BN * CH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Causal blocks near the end of the sequence have the most keys: they start first.
  int rank, bh;
  if (!kiln_block_tile(KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh)) return;
  const int m0 = (KILN_CAUSAL ? gridDim.x - 1 - rank : rank) * BM;
  const int b = bh / H, h = bh % H, hk = h / G;
  const u16* qp = q + b * qb + h * qh;
  const u16* kp = k + b * kb + hk * kh;
  const u16* vp = v + b * vb + hk * vh;
  const int n_end = KILN_CAUSAL && m0 + BM < Tk ? m0 + BM : Tk;
  const int n_tiles = (n_end + BN - 1) / BN;
  const int w0 = m0 + warp * 16 * MT;  // this warp's first query row

  load_tile<BM>(Qs, qp, qt, m0, Tq);
  kiln_cp_async_commit();
  if (n_tiles > 0) load_tile<BN>(Ks, kp, kt, 0, Tk);
  kiln_cp_async_commit();
  kiln_cp_async_wait<1>();
  __syncthreads();
  // This warp's MT x 16 rows of q as A fragments, one a step of 16 dims (kept in registers, or read
  // again from the shared tile at each key tile). Each key or value fragment read from shared
  // memory then serves MT row tiles.
#define Q_FRAGMENT(f, mt, kk) kiln_ldmatrix_x4(f, TILE(Qs, (warp * MT + (mt)) * 16 + (lane & 15), (kk) * 2 + (lane >> 4)))
#if KILN_Q_IN_REGISTERS
  u32 qf[MT][KILN_D / 16][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < KILN_D / 16; ++kk) Q_FRAGMENT(qf[mt][kk], mt, kk);
#endif

  float acc[MT][KILN_D / 8][4];  // o, unnormalised: rows g and g + 8 (g = lane / 4), two columns each
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < KILN_D / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  float row_max[MT][2], row_sum[MT][2];  // row_sum: this thread's part of the sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) row_max[mt][0] = row_max[mt][1] = KILN_NEG_INF, row_sum[mt][0] = row_sum[mt][1] = 0.f;

  for (int j = 0; j < n_tiles; ++j) {
    const int n0 = j * BN;
    kiln_cp_async_wait<0>();
    __syncthreads();  // k tile j is in; every warp is done with the last v tile
    load_tile<BN>(Vs, vp, vt, n0, Tk);
    kiln_cp_async_commit();
    // Causal: a warp whose rows all come before the tile's first key has nothing to add; it only
    // takes part in the block's loads and barriers.
    const bool live = !KILN_CAUSAL || n0 <= w0 + 16 * MT - 1;
    float s[MT][BN / 8][4];
    if (live) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KILN_D / 16; ++kk) {
#if KILN_Q_IN_REGISTERS
#define QF(mt) qf[mt][kk]
#else
        u32 qk[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) Q_FRAGMENT(qk[mt], mt, kk);
#define QF(mt) qk[mt]
#endif
#pragma unroll
        for (int n = 0; n < BN / 16; ++n) {
          u32 kf[4];
          kiln_ldmatrix_x4(kf, TILE(Ks, n * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            KILN_MMA(s[mt][2 * n], QF(mt), kf[0], kf[1]);
            KILN_MMA(s[mt][2 * n + 1], QF(mt), kf[2], kf[3]);
          }
        }
#undef QF
      }
      // Scale into the exp2 domain, then mask keys past Tk and (causal) after the query.
      const bool masked = n0 + BN > Tk || (KILN_CAUSAL && n0 + BN - 1 > w0);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
#ifdef KILN_SCORE_MOD  // the mod of the scaled score, then into the exp2 domain
            {
              const int r = w0 + mt * 16 + (lane >> 2) + (e >> 1) * 8, col = n0 + i * 8 + 2 * (lane & 3) + (e & 1);
              s[mt][i][e] = kiln_mod_score(s[mt][i][e] * scale, b, h, r, col, Tq, Tk, mod_scalars);
            }
#else
            s[mt][i][e] *= scale_log2;
#endif
            if (masked) {
              const int col = n0 + i * 8 + 2 * (lane & 3) + (e & 1), r = w0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
              if (col >= Tk || (KILN_CAUSAL && col > r)) s[mt][i][e] = KILN_NEG_INF;
            }
          }
      // Online softmax. The running max (the base of the exponentials) moves only when the tile's
      // max exceeds it by more than KILN_RESCALE (exp2 domain): the probabilities then stay below
      // 2^KILN_RESCALE, o and the row sum share the base, and o is rescaled only in the tiles where
      // some row of the warp moved, mostly the first ones (the result is the same up to rounding).
      float alpha[MT][2];
      bool moved = false;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = KILN_NEG_INF;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[mt][i][2 * r], s[mt][i][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          alpha[mt][r] = 1.f;
          if (mx > row_max[mt][r] + KILN_RESCALE) {  // (-inf: the first key of the row sets it)
            alpha[mt][r] = kiln_exp2(row_max[mt][r] - mx);
            row_max[mt][r] = mx;
            moved = true;
          }
          const float base = row_max[mt][r] == KILN_NEG_INF ? 0.f : row_max[mt][r];
          float sum = 0.f;
#pragma unroll
          for (int i = 0; i < BN / 8; ++i) {
            s[mt][i][2 * r] = kiln_exp2(s[mt][i][2 * r] - base);
            s[mt][i][2 * r + 1] = kiln_exp2(s[mt][i][2 * r + 1] - base);
            sum += s[mt][i][2 * r] + s[mt][i][2 * r + 1];
          }
          row_sum[mt][r] = row_sum[mt][r] * alpha[mt][r] + sum;
        }
      if (__any_sync(0xffffffffu, moved))
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int i = 0; i < KILN_D / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][i][e] *= alpha[mt][e >> 1];
    }
    kiln_cp_async_wait<0>();
    __syncthreads();  // v tile j is in; every warp is done with k tile j
    if (j + 1 < n_tiles) load_tile<BN>(Ks, kp, kt, n0 + BN, Tk);
    kiln_cp_async_commit();
    // o += p v: the score accumulators of two key columns of 8 are the A fragment of 16 keys.
    if (live) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        u32 pf[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pf[mt][0] = KILN_PACK(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pf[mt][1] = KILN_PACK(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pf[mt][2] = KILN_PACK(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pf[mt][3] = KILN_PACK(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < KILN_D / 16; ++n) {
          u32 vf[4];
          kiln_ldmatrix_x4_trans(vf, TILE(Vs, kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), n * 2 + (lane >> 4)));
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            KILN_MMA(acc[mt][2 * n], pf[mt], vf[0], vf[1]);
            KILN_MMA(acc[mt][2 * n + 1], pf[mt], vf[2], vf[3]);
          }
        }
      }
    }
  }
  // Normalise and store: each quad of lanes holds two rows' sums in four parts.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l == 0.f ? 0.f : 1.f / l;
      const int t = w0 + mt * 16 + (lane >> 2) + r * 8;
      if (t >= Tq) continue;
      if (lse && (lane & 3) == 0)  // the row's log-sum-exp for the backward (+inf: no key, p = 0)
        lse[(i64)bh * Tq + t] = l == 0.f ? __int_as_float(0x7f800000) : (row_max[mt][r] + kiln_log2(l)) * 0.6931471805599453f;
      u16* out = o + b * ob + h * oh + (i64)t * ot + 2 * (lane & 3);
#pragma unroll
      for (int i = 0; i < KILN_D / 8; ++i)
        *reinterpret_cast<u32*>(out + i * 8) = KILN_PACK(acc[mt][i][2 * r] * inv, acc[mt][i][2 * r + 1] * inv);
    }
}
)";
  return s;
}

}  // namespace kiln::codegen
