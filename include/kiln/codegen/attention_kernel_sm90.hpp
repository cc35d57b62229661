// The fused attention forward on Hopper (compute capability 9.0, NVRTC's sm_90a): warpgroup MMA
// (wgmma) instead of mma.sync. A block of W warpgroups (128 threads each) computes 64 * W query rows
// of one (batch, head); each warpgroup owns 64 rows. q, and key and value tiles of 128 rows (two
// stages, the next tile's load in flight while this one is used), sit in shared memory in the
// 128-byte-swizzled layout wgmma's descriptors name: a tile of rows x D is D/64 column blocks of
// rows x 128 bytes, 16-byte chunk c of row r stored at chunk c ^ (r % 8). The same tile serves k as
// the K-major B operand of s = q k^T and v as the MN-major (transposed) B operand of o += p v, so
// both are loaded by one cp.async loop. s comes back in registers (64 x 128 f32 over the
// warpgroup), the online softmax runs there as in codegen/attention_kernel.hpp, and p goes into the
// second wgmma as register A fragments, which share the accumulator's layout. What the mma.sync
// kernel pays for (each key and value fragment loaded into registers by ldmatrix, warp by warp)
// is gone: wgmma reads its B operand from shared memory itself, for the whole warpgroup.
//
// Masks, the causal order of blocks, the lazily rescaled o and the log-sum-exp are those of the
// mma.sync kernel; the arguments are the same, so runtime/extern/attention.hpp launches either.
#pragma once
#include <string>

#include "../core/error.hpp"
#include "attention_kernel.hpp"
#include "attention_tma.hpp"
#include "prelude_mma.hpp"

namespace kiln::codegen {

namespace attention_sm90_detail {

using codegen::wgmma_function;  // (prelude_mma.hpp)

}  // namespace attention_sm90_detail

// What the warpgroup-MMA kernels share (after their KILN_D and KILN_WARPS defines): attention_prelude's
// primitives, wgmma's descriptors, fences and waits, and the loader of 128-byte-swizzled tiles;
// `uniform`: the warpgroup index broadcast from lane 0 (KILN_UNIFORM_WARPGROUP below).
inline std::string wgmma_prelude(bool uniform) {
  static const bool lean = Tuning::from_environment().attention_copies != 0;  // an A/B knob: see Tuning
  return std::string(uniform ? "#define KILN_UNIFORM_WARPGROUP 1\n" : "") +
         (lean ? "#define KILN_LEAN_COPIES 1\n" : "") + attention_prelude() + R"(
typedef unsigned long long u64;
// This thread's warpgroup of 128 threads. Under KILN_UNIFORM_WARPGROUP lane 0's, broadcast: ptxas then
// knows it is one value across the warp and keeps what derives from it (a warpgroup's tile count and
// so the tile loop's counter, stage addresses, wgmma descriptors) in uniform registers, as it does
// where nothing derives from it (benchmarks/NOTES.md item 184).
#ifdef KILN_UNIFORM_WARPGROUP
#define KILN_WARPGROUP_INDEX __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0)
#else
#define KILN_WARPGROUP_INDEX (threadIdx.x >> 7)
#endif
)" + std::string(prelude_wgmma) +
         R"(#ifdef KILN_LEAN_COPIES
// Rows [r0, r0 + ROWS) of a [T, D] operand with row stride st into a swizzled tile at shared address
// `tile`, by THREADS threads (t: this one's index among them); rows past T read zeros. CH divides
// THREADS, so a thread keeps one 16-byte chunk column (t % CH) and walks rows t / CH, + STEP, ...;
// STEP is a multiple of 8, so the swizzle's row term stays put and each copy's destination and
// source move by a constant: a few instructions a copy, where recomputing the row and column from
// a running index took about 38 (ncu, benchmarks/NOTES.md item 190;
// the default: KILN_TUNE_ATTENTION_COPIES=0 leaves KILN_LEAN_COPIES undefined).
template <int ROWS, int THREADS = KILN_WARPS * 32, int UNROLL = 4>
__device__ __forceinline__ void load_tile_sw128(u32 tile, const u16* src, i64 st, int r0, int T, int t = threadIdx.x) {
  constexpr int STEP = THREADS / CH;
  static_assert(THREADS % CH == 0 && STEP % 8 == 0, "each thread walks whole rows of one chunk column");
  const int ch = t % CH, rt = t / CH;
  u32 dst = tile + (ch >> 3) * (ROWS * 128) + rt * 128 + (((ch & 7) ^ (rt & 7)) << 4);
  const u16* from = src + (i64)(r0 + rt) * st + ch * 8;
  const i64 step = STEP * st;
  int left = T - r0 - rt;  // rows from this thread's first one to T
#pragma unroll UNROLL
  for (int r = rt; r < ROWS; r += STEP) {
    // (a row past T copies 0 bytes and zero-fills; its source is the operand's start, not an
    // address past the allocation, which the PTX ISA does not say may be invalid)
    const bool in = left > 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(in ? from : src), "r"(in ? 16 : 0));
    dst += STEP * 128;
    from += step;
    left -= STEP;
  }
}
#else
// Rows [r0, r0 + ROWS) of a [T, D] operand with row stride st into a swizzled tile at shared address
// `tile`; rows past T read zeros.
template <int ROWS>
__device__ __forceinline__ void load_tile_sw128(u32 tile, const u16* src, i64 st, int r0, int T) {
#pragma unroll 4
  for (int c = threadIdx.x; c < ROWS * CH; c += KILN_WARPS * 32) {
    const int r = c / CH, ch = c % CH;
    const bool in = r0 + r < T;
    const u32 dst = tile + (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(in ? src + (i64)(r0 + r) * st + ch * 8 : src), "r"(in ? 16 : 0));
  }
}
#endif

)";
}

namespace attention_sm90_detail {

// The forward kernels' defines, score_mod, wgmma prelude and the products they issue.
inline std::string forward_header(const AttentionKernel& a) {
  if ((a.head_dim != 64 && a.head_dim != 128) || a.warpgroups < 1)  // (AttentionKernel::hopper chooses it only there)
    throw error("attention: the Hopper forward kernels take head dims 64 and 128 with warpgroups, not " + a.name());
  const std::string type = a.dt == dtype::bf16 ? "bf16" : "f16";
  std::string s = "// " + a.name() + ": fused attention forward, warpgroup MMA (codegen/attention_kernel_sm90.hpp)\n";
  s += "#define KILN_D " + std::to_string(a.head_dim) + "\n";
  s += "#define KILN_WARPS " + std::to_string(4 * a.warpgroups) + "\n";
  s += "#define KILN_WARPGROUPS " + std::to_string(a.warpgroups) + "\n";
  s += "#define KILN_KEY_ROWS " + std::to_string(a.key_rows) + "\n";
  s += "#define KILN_CAUSAL " + std::string(a.causal ? "1" : "0") + "\n";
  s += "#define KILN_PACK kiln_pack_" + type + "\n";
  s += "#define KILN_NAME " + a.name() + "\n";
  static const bool fma_softmax = Tuning::from_environment().attention_softmax != 0;  // an A/B knob: see Tuning
  if (fma_softmax && a.raw_max) s += "#define KILN_SOFTMAX_FMA 1\n";
  s += score_mod_preamble(a.score_mod);
  // The warpgroup index from lane 0 by default (forwards 1-11% faster on an H100: NOTES item 184).
  static const bool uniform = Tuning::from_environment().attention_uniform != 0;  // an A/B knob: see Tuning
  s += wgmma_prelude(uniform);
  s += wgmma_function("kiln_wgmma_qk_first", a.key_rows, false, true, 0, type);
  s += wgmma_function("kiln_wgmma_qk", a.key_rows, false, false, 0, type);
  s += wgmma_function("kiln_wgmma_pv", a.head_dim, true, false, 1, type);
  return s;
}

// What every forward tile does: the online softmax, a score_mod, p packed as A fragments.
inline std::string forward_tile_steps() {
  return R"(
// ---- shared-memory tiles -----------------------------------------------------------------------------
#define WG KILN_WARPGROUPS
#define BM (64 * WG)
#define BN KILN_KEY_ROWS
#define TILE_BYTES(rows) ((rows) * KILN_D * 2)
#define KILN_RESCALE 8.f  // how far a row's max may pass the base before o is rescaled (log2)

// ---- the tile steps ---------------------------------------------------------------------------------
// Scale a tile of scores into the exp2 domain, mask keys past Tk and (causal) after the query, then
// the online softmax: the scores become probabilities against the row's base, its sum is carried,
// and alpha[r] is what o must be multiplied by (the base moves only when the tile's max exceeds it
// by more than KILN_RESCALE, codegen/attention_kernel.hpp). Returns whether some row's base moved.
#ifdef KILN_SOFTMAX_FMA
// By default where scale_log2 > 0 (AttentionKernel::raw_max; KILN_TUNE_ATTENTION_SOFTMAX=0: the form
// below the #else): the tile's max over the raw scores, scaled once
// (rounding is monotonic: the same max as over the scaled scores), each probability
// exp2(s * scale_log2 - base) from one FFMA, and the max and the sum as trees of four chains.
__device__ __forceinline__ bool softmax_tile(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], int n0, int w0, int r0, int Tk, float scale_log2) {
  const int lane = threadIdx.x & 31;
  if (n0 + BN > Tk || (KILN_CAUSAL && n0 + BN - 1 > w0)) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int col = n0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1), r = r0 + ((i >> 1) & 1) * 8;
      if (col >= Tk || (KILN_CAUSAL && col > r)) s[i] = KILN_NEG_INF;
    }
  }
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m[4] = {KILN_NEG_INF, KILN_NEG_INF, KILN_NEG_INF, KILN_NEG_INF};
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) m[i & 3] = fmaxf(m[i & 3], fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
    float mx = fmaxf(fmaxf(m[0], m[1]), fmaxf(m[2], m[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx *= scale_log2;
    alpha[r] = 1.f;
    if (mx > row_max[r] + KILN_RESCALE) {
      alpha[r] = kiln_exp2(row_max[r] - mx);
      row_max[r] = mx;
      moved = true;
    }
    const float neg_base = row_max[r] == KILN_NEG_INF ? 0.f : -row_max[r];
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[4 * i + 2 * r] = kiln_exp2(fmaf(s[4 * i + 2 * r], scale_log2, neg_base));
      s[4 * i + 2 * r + 1] = kiln_exp2(fmaf(s[4 * i + 2 * r + 1], scale_log2, neg_base));
      sum[i & 3] += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha[r] + ((sum[0] + sum[1]) + (sum[2] + sum[3]));
  }
  return moved;
}
#else
__device__ __forceinline__ bool softmax_tile(float (&s)[BN / 2], float (&row_max)[2], float (&row_sum)[2],
                                             float (&alpha)[2], int n0, int w0, int r0, int Tk, float scale_log2) {
  const int lane = threadIdx.x & 31;
  const bool masked = n0 + BN > Tk || (KILN_CAUSAL && n0 + BN - 1 > w0);
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    s[i] *= scale_log2;
    if (masked) {
      const int col = n0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1), r = r0 + ((i >> 1) & 1) * 8;
      if (col >= Tk || (KILN_CAUSAL && col > r)) s[i] = KILN_NEG_INF;
    }
  }
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = KILN_NEG_INF;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    alpha[r] = 1.f;
    if (mx > row_max[r] + KILN_RESCALE) {  // (-inf: the first key of the row sets it)
      alpha[r] = kiln_exp2(row_max[r] - mx);
      row_max[r] = mx;
      moved = true;
    }
    const float base = row_max[r] == KILN_NEG_INF ? 0.f : row_max[r];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) {
      s[4 * i + 2 * r] = kiln_exp2(s[4 * i + 2 * r] - base);
      s[4 * i + 2 * r + 1] = kiln_exp2(s[4 * i + 2 * r + 1] - base);
      sum += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha[r] + sum;
  }
  return moved;
}
#endif
#ifdef KILN_SCORE_MOD
// A score_mod on a tile of scores, before softmax_tile (which then scales by 1): the mod of each
// scaled score, into the exp2 domain; -inf outside the scores (the tensors the mod reads end at Tq
// and Tk).
__device__ __forceinline__ void mod_tile(float (&s)[BN / 2], int b, int h, int n0, int r0, int Tq, int Tk, float scale,
                                         const kiln_score_scalars& mod_scalars) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const int col = n0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1), r = r0 + ((i >> 1) & 1) * 8;
    s[i] = kiln_mod_score(s[i] * scale, b, h, r, col, Tq, Tk, mod_scalars);
  }
}
#endif
// The probabilities as the A fragments of o += p v: two key columns of 8 make one of 16 keys.
__device__ __forceinline__ void pack_probabilities(u32 (&p)[BN / 16][4], const float (&s)[BN / 2]) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[kk][e] = KILN_PACK(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}
// The descriptor of a key tile's values at shared address v, read MN-major by o += p v.
__device__ __forceinline__ u64 values_desc(u32 v) { return kiln_wgmma_desc(v, TILE_BYTES(BN) / (KILN_D / 64), 1024); }
// Issues o += p v over the values of v_desc; not committed.
__device__ __forceinline__ void issue_pv(float (&acc)[KILN_D / 2], const u32 (&p)[BN / 16][4], u64 v_desc) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) kiln_wgmma_pv(acc, p[kk], v_desc + ((kk * 2048) >> 4));
}
// Normalise o and store this thread's rows r0 and r0 + 8 (below Tq) at rows of `out` ot apart, and
// where `lse` is given their log-sum-exp for the backward (+inf: no key, p = 0). Each quad of lanes
// holds two rows' sums in four parts.
__device__ __forceinline__ void store_output(u16* out, i64 ot, float* lse, const float (&acc)[KILN_D / 2],
                                             const float (&row_max)[2], const float (&row_sum)[2], int r0, int Tq) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l == 0.f ? 0.f : 1.f / l;
    const int t = r0 + r * 8;
    if (t >= Tq) continue;
    if (lse && (lane & 3) == 0)
      lse[t] = l == 0.f ? __int_as_float(0x7f800000) : (row_max[r] + kiln_log2(l)) * 0.6931471805599453f;
    u16* row = out + (i64)t * ot + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < KILN_D / 8; ++i)
      *reinterpret_cast<u32*>(row + i * 8) = KILN_PACK(acc[4 * i + 2 * r] * inv, acc[4 * i + 2 * r + 1] * inv);
  }
}

)";
}

}  // namespace attention_sm90_detail

inline std::string attention_forward_source_sm90(const AttentionKernel& a) {
  std::string s = attention_sm90_detail::forward_header(a);
  s += attention_sm90_detail::forward_tile_steps();
  s += R"(
// ---- the forward kernel ------------------------------------------------------------------------------
// Each step waits for key tile j (tile j + 1 may still be loading), runs s = q k_j^T, the softmax and
// o += p v_j, and after a barrier loads tile j + 2 into the stage it used.
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32, 1)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
          int BH, int H, int G, int Tq, int Tk, float scale_log2, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb,
          i64 vh, i64 vt, i64 ob, i64 oh, i64 ot, float* __restrict__ lse KILN_MOD_PARAMS) {
  extern __shared__ __align__(1024) unsigned char kiln_smem[];
  const u32 Qs = (kiln_shared_address(kiln_smem) + 1023u) & ~1023u;  // the swizzle repeats every 1024 bytes
  const u32 Ks = Qs + TILE_BYTES(BM), Vs = Ks + 2 * TILE_BYTES(BN);   // two stages each
  const int wg = KILN_WARPGROUP_INDEX, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
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
  const int w0 = m0 + wg * 64;                  // this warpgroup's first query row
  const int r0 = w0 + warp * 16 + (lane >> 2);  // this thread's rows: r0 and r0 + 8

  // Groups of cp.async: q, then one a key tile (k and v), two tiles ahead.
  load_tile_sw128<BM>(Qs, qp, qt, m0, Tq);
  kiln_cp_async_commit();
  for (int j = 0; j < 2; ++j) {
    if (j < n_tiles) {
      load_tile_sw128<BN>(Ks + j * TILE_BYTES(BN), kp, kt, j * BN, Tk);
      load_tile_sw128<BN>(Vs + j * TILE_BYTES(BN), vp, vt, j * BN, Tk);
    }
    kiln_cp_async_commit();
  }
  // K-major operands (q, k): 8-row groups 1024 bytes apart, a step of 16 dims 32 bytes into the
  // 128-byte row, a block of 64 dims a whole column block further. v, MN-major: 16 keys a step
  // (2048 bytes), its column blocks of 64 dims TILE_BYTES(BN) / (D / 64) apart.
  const u64 q_desc = kiln_wgmma_desc(Qs + wg * 64 * 128, 16, 1024);
#define DIM_STEP(kk, rows) (((kk) >> 2) * (rows) * 128 + ((kk) & 3) * 32)

  float acc[KILN_D / 2];  // o, unnormalised: for column block i of 8, acc[4i + 2r + e] is row r0 + 8r, column 8i + 2(lane % 4) + e
#pragma unroll
  for (int i = 0; i < KILN_D / 2; ++i) acc[i] = 0.f;
  float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF}, row_sum[2] = {0.f, 0.f};  // row_sum: this thread's part
  float s[BN / 2];    // the scores, in acc's layout over the tile's keys
  u32 p[BN / 16][4];  // the probabilities as A fragments
  float alpha[2];

  for (int j = 0; j < n_tiles; ++j) {
    const int n0 = j * BN, stage = j & 1;
    kiln_cp_async_wait<1>();  // q and key tile j are in (tile j + 1 may still be loading)
    kiln_fence_proxy_async();
    __syncthreads();
    // Causal: a warpgroup whose rows all come before the tile's first key has nothing to add.
    if (!KILN_CAUSAL || n0 <= w0 + 63) {
      const u64 k_desc = kiln_wgmma_desc(Ks + stage * TILE_BYTES(BN), 16, 1024);
      kiln_wgmma_fence();
      kiln_wgmma_qk_first(s, q_desc, k_desc);
#pragma unroll
      for (int kk = 1; kk < KILN_D / 16; ++kk)
        kiln_wgmma_qk(s, q_desc + (DIM_STEP(kk, BM) >> 4), k_desc + (DIM_STEP(kk, BN) >> 4));
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(s);
#ifdef KILN_SCORE_MOD
      mod_tile(s, b, h, n0, r0, Tq, Tk, scale, mod_scalars);
      const bool moved = softmax_tile(s, row_max, row_sum, alpha, n0, w0, r0, Tk, 1.f);
#else
      const bool moved = softmax_tile(s, row_max, row_sum, alpha, n0, w0, r0, Tk, scale_log2);
#endif
      if (__any_sync(0xffffffffu, moved))
#pragma unroll
        for (int i = 0; i < KILN_D / 2; ++i) acc[i] *= alpha[(i >> 1) & 1];
      pack_probabilities(p, s);
      const u64 v_desc = values_desc(Vs + stage * TILE_BYTES(BN));
      kiln_hold(acc);
      kiln_wgmma_fence();
      issue_pv(acc, p, v_desc);
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(acc);
    }
    __syncthreads();  // every warpgroup is done with this stage
    if (j + 2 < n_tiles) {
      load_tile_sw128<BN>(Ks + stage * TILE_BYTES(BN), kp, kt, n0 + 2 * BN, Tk);
      load_tile_sw128<BN>(Vs + stage * TILE_BYTES(BN), vp, vt, n0 + 2 * BN, Tk);
    }
    kiln_cp_async_commit();
  }
  kiln_cp_async_wait<0>();  // (no key tile: q's copy is still in flight)
  store_output(o + b * ob + h * oh, ot, lse ? lse + (i64)bh * Tq : nullptr, acc, row_max, row_sum, r0, Tq);
}
)";
  return s;
}

}  // namespace kiln::codegen
