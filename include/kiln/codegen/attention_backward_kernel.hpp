// The fused attention backward's kernels (k::attention's gradients on the GPU, 16-bit q/k/v), with
// the tile primitives of attention_kernel.hpp. None materialises the scores: each recomputes its
// tile of p = exp(s * scale - lse) from q and k and the row statistics.
//   stats  one block a 64-query tile: each row's log-sum-exp of its scaled, masked scores (a pass
//          over the keys, q k^T only) -> [B, H, Tq] f32; only where the forward's kernel, which
//          writes the same, is not in the program (autodiff/rules.hpp's attention_flash)
// dq and dk/dv read the rows' statistics [B, H, Tq, 2]: the log-sum-exp and delta = sum(dO * o).
//   dq     one block a 64-query tile, over the key tiles: dP = dO v^T, dS = p (dP - delta),
//          dq = scale dS k
//   dk, dv one block a 64-key tile of one key/value head, over the query tiles of every query head
//          of its group: s^T = k q^T, dv = p^T dO; dP^T = v dO^T, dk = scale dS^T q
//   dkv    dk and dv in one pass (four products a tile instead of five, each q and dO tile loaded
//          once) into [2, B, Hkv, Tk, D], where both accumulators fit the registers
//          (graph/infer_attention.hpp's fused_attention_joins_dk_dv)
//   dqkv   (Hopper only, attention_backward_kernel_sm90.hpp) dk and dv as dkv, and dq's sums over
//          the block's keys added into f32 with atomic reductions, one kernel instead of two: the
//          dq kernel's recomputed q k^T and dO v^T are gone; into [5, B, H, T, D] (dk, dv, dq, then
//          dq's f32 sums in the last two slots)
// Four warps, 16 rows each; the block's own rows and the streamed tiles sit in swizzled shared
// memory and the fragments are read from there (the registers hold the accumulators, the scores and
// dP: at D 128, 128 of them), except a warp's own rows at D <= 64, read once and held (OwnRows).
// Operands are contiguous [B, H, T, D]; a loaded tile is waited for before it is used: double
// buffering the streamed tiles measured 1-5% slower on an H200 (benchmarks/NOTES.md item 133).
#pragma once
#include <string>

#include "../core/error.hpp"
#include "attention_kernel.hpp"

namespace kiln::codegen {

struct AttentionBackwardKernel {
  enum class Part { stats, dq, dk, dv, dkv, dqkv };
  Part part = Part::dq;
  int head_dim = 64;
  bool causal = false;
  dtype dt = dtype::bf16;

  // dq and dkv on Hopper at head dims 64 and 128: attention_backward_kernel_sm90.hpp's warpgroup-MMA
  // kernels (two warpgroups, 128 rows a block, streamed tiles of 64 in two stages).
  bool hopper = false;
  // Hopper's kernels under KILN_TUNE_ATTENTION_BACKWARD_TMA=1: thread 0 loads each tile by TMA from tensor
  // maps of q, k, v and dO the launcher encodes (the kernel's last parameters; NOTES item 193), each
  // stage's landing on an mbarrier; the launcher takes the cp.async kernel where a map cannot be made.
  bool tma = false;
  // A score_mod's functions (codegen/score_mod_source.hpp): the scores are modded as the forward's
  // were, and dS goes back through the mod's derivative; empty: none (mma.sync kernels only).
  std::string_view score_mod, score_mod_tag;  // (views, as AttentionKernel's)

  static constexpr int warps = 4, rows = 64, cols = 64;  // block rows, streamed tile rows
  int threads() const { return hopper ? 256 : 32 * warps; }
  int block_rows() const { return hopper ? 128 : rows; }
  int streamed_rows() const { return cols; }
  int shared_bytes() const {
    if (hopper)  // the block's two tiles, two stages of two streamed tiles, dk/dv's statistics, alignment
                 // (dqkv: and each warpgroup's dS tile, 64 keys x 64 queries)
      return 2 * block_rows() * head_dim * 2 + 4 * streamed_rows() * head_dim * 2 + 4 * streamed_rows() * 4 + 1024 +
             (part == Part::dqkv ? block_rows() * streamed_rows() * 2 : 0) + (tma ? 64 : 0);
    const int tile = rows * head_dim * 2;
    switch (part) {
      case Part::stats: return 2 * tile;
      case Part::dq: return 4 * tile;
      default: return 4 * tile + 2 * cols * 4;  // k, v, q, dO tiles and the query rows' statistics
    }
  }
  std::string name() const {
    const char* parts[] = {"stats", "dq", "dk", "dv", "dkv", "dqkv"};
    return std::string("kiln_attention_bwd_") + parts[static_cast<int>(part)] + (hopper ? "_wgmma" : "") + "_d" +
           std::to_string(head_dim) + (tma ? "_tma" : "") + (causal ? "_causal" : "") + "_" +
           std::string(kiln::name(dt)) + score_mod_suffix(score_mod, score_mod_tag);
  }
};

// The kernel that converts the dqkv kernel's f32 sums of dq to its 16-bit dtype.
inline std::string attention_dq_convert_name(dtype dt) { return "kiln_attention_dq_to_" + std::string(kiln::name(dt)); }

inline std::string attention_backward_source(const AttentionBackwardKernel& a) {
  if (a.part == AttentionBackwardKernel::Part::dqkv)
    throw error("attention: dq, dk and dv in one kernel are Hopper's warpgroup kernels only, not " + a.name());
  const std::string t = a.dt == dtype::bf16 ? "bf16" : "f16";
  std::string s = "// " + a.name() + ": fused attention backward (codegen/attention_backward_kernel.hpp)\n";
  s += "#define KILN_D " + std::to_string(a.head_dim) + "\n";
  s += "#define KILN_WARPS " + std::to_string(AttentionBackwardKernel::warps) + "\n";
  s += "#define KILN_CAUSAL " + std::string(a.causal ? "1" : "0") + "\n";
  s += "#define KILN_MMA(d, a, b0, b1) kiln_mma_16816_" + t + "(d, a, b0, b1)\n";
  s += "#define KILN_PACK kiln_pack_" + t + "\n";
  s += "#define KILN_NAME " + a.name() + "\n";
  const char* part_macros[] = {"STATS", "DQ", "DK", "DV", "DKV", "DQKV"};
  s += "#define KILN_PART_" + std::string(part_macros[static_cast<int>(a.part)]) + " 1\n";
  s += score_mod_preamble(a.score_mod);
  s += attention_prelude();
  s += R"(
// ---- the backward kernels ----------------------------------------------------------------------
#define BR 64  // rows a block
#define BC 64  // rows a streamed tile
#define LN2 0.6931471805599453f
#define LOG2E 1.4426950408889634f
#define KILN_POS_INF __int_as_float(0x7f800000)

// This warp's 16 rows of one of the block's own [BR, D] tiles, as A fragments. At D <= 64 they are
// read from shared memory once, when the tile has landed (hold), and kept (D/4 registers): each
// streamed tile then reads only its own fragments. Wider, the registers are not there: read at
// every use.
struct OwnRows {
  const uint4* tile;
  int warp, lane;
#if KILN_D <= 64
  u32 f[KILN_D / 16][4];
  __device__ __forceinline__ void hold() {
#pragma unroll
    for (int kk = 0; kk < KILN_D / 16; ++kk) kiln_ldmatrix_x4(f[kk], TILE(tile, warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
  }
  __device__ __forceinline__ void fragment(u32 (&a)[4], int kk) const {
    a[0] = f[kk][0], a[1] = f[kk][1], a[2] = f[kk][2], a[3] = f[kk][3];
  }
#else
  __device__ __forceinline__ void hold() {}
  __device__ __forceinline__ void fragment(u32 (&a)[4], int kk) const {
    kiln_ldmatrix_x4(a, TILE(tile, warp * 16 + (lane & 15), kk * 2 + (lane >> 4)));
  }
#endif
};
// acc[BC/8][4] = (this warp's 16 rows of A) x (rows of B, a [BC, D] tile)^T.
__device__ __forceinline__ void rows_times_rows(float (&acc)[BC / 8][4], const OwnRows& A, const uint4* B, int lane) {
#pragma unroll
  for (int i = 0; i < BC / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KILN_D / 16; ++kk) {
    u32 af[4];
    A.fragment(af, kk);
#pragma unroll
    for (int n = 0; n < BC / 16; ++n) {
      u32 bf[4];
      kiln_ldmatrix_x4(bf, TILE(B, n * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 2 + ((lane >> 3) & 1)));
      KILN_MMA(acc[2 * n], af, bf[0], bf[1]);
      KILN_MMA(acc[2 * n + 1], af, bf[2], bf[3]);
    }
  }
}
// acc[D/8][4] += p (this warp's 16 rows x BC, as score accumulators) x a [BC, D] tile.
__device__ __forceinline__ void scores_times_tile(float (&acc)[KILN_D / 8][4], const float (&p)[BC / 8][4], const uint4* B, int lane) {
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
    const u32 pf[4] = {KILN_PACK(p[2 * kk][0], p[2 * kk][1]), KILN_PACK(p[2 * kk][2], p[2 * kk][3]),
                       KILN_PACK(p[2 * kk + 1][0], p[2 * kk + 1][1]), KILN_PACK(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int n = 0; n < KILN_D / 16; ++n) {
      u32 bf[4];
      kiln_ldmatrix_x4_trans(bf, TILE(B, kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3), n * 2 + (lane >> 4)));
      KILN_MMA(acc[2 * n], pf, bf[0], bf[1]);
      KILN_MMA(acc[2 * n + 1], pf, bf[2], bf[3]);
    }
  }
}
// Stores this warp's 16 rows of acc * scale as 16-bit values, rows below T.
__device__ __forceinline__ void store_rows(u16* out, const float (&acc)[KILN_D / 8][4], float scale, int r0, int T, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r0 + (lane >> 2) + r * 8;
    if (t >= T) continue;
    u16* o = out + (i64)t * KILN_D + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < KILN_D / 8; ++i)
      *reinterpret_cast<u32*>(o + i * 8) = KILN_PACK(acc[i][2 * r] * scale, acc[i][2 * r + 1] * scale);
  }
}
#define ZERO_ACC(acc) \
  _Pragma("unroll") for (int i = 0; i < KILN_D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f

#if defined(KILN_PART_STATS) || defined(KILN_PART_DQ)
// One block a tile of BR queries of one (batch, head); keys in tiles of BC.
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ g,
          float* __restrict__ stats, u16* __restrict__ dq, int BH, int H, int G, int Tq, int Tk, float scale_log2,
          float scale KILN_BACKWARD_MOD_PARAMS) {
  extern __shared__ __align__(128) unsigned char kiln_smem[];
  uint4* Qs = reinterpret_cast<uint4*>(kiln_smem);
  uint4* Ks = Qs + BR * CH;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int rank, bh;  // causal: the tiles with the most keys first (attention_prelude's kiln_block_tile)
  if (!kiln_block_tile(KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh)) return;
  const int m0 = (KILN_CAUSAL ? gridDim.x - 1 - rank : rank) * BR;
  const int b = bh / H, hk = (bh % H) / G, Hkv = H / G;
  const u16* qp = q + (i64)bh * Tq * KILN_D;
  const u16* kp = k + (i64)(b * Hkv + hk) * Tk * KILN_D;
  const int n_end = KILN_CAUSAL && m0 + BR < Tk ? m0 + BR : Tk;
  const int n_tiles = (n_end + BC - 1) / BC;
  const int row = m0 + warp * 16 + (lane >> 2);  // this thread's rows: row and row + 8
  load_tile<BR>(Qs, qp, KILN_D, m0, Tq);
#ifdef KILN_PART_DQ
  uint4* Vs = Ks + BC * CH;
  uint4* Gs = Vs + BC * CH;
  const u16* vp = v + (i64)(b * Hkv + hk) * Tk * KILN_D;
  load_tile<BR>(Gs, g + (i64)bh * Tq * KILN_D, KILN_D, m0, Tq);
  float lse2[2], delta[2];  // the rows' log-sum-exp in the exp2 domain (+inf past Tq: p = 0)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = row + r * 8 < Tq;
    lse2[r] = in ? stats[((i64)bh * Tq + row + r * 8) * 2] * LOG2E : KILN_POS_INF;
    delta[r] = in ? stats[((i64)bh * Tq + row + r * 8) * 2 + 1] : 0.f;
  }
  float acc[KILN_D / 8][4];
  ZERO_ACC(acc);
#else
  float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF}, row_sum[2] = {0.f, 0.f};
#endif
  OwnRows q_rows{Qs, warp, lane};
#ifdef KILN_PART_DQ
  OwnRows g_rows{Gs, warp, lane};
#endif
  for (int j = 0; j < n_tiles; ++j) {
    const int n0 = j * BC;
    load_tile<BC>(Ks, kp, KILN_D, n0, Tk);
#ifdef KILN_PART_DQ
    load_tile<BC>(Vs, vp, KILN_D, n0, Tk);
#endif
    kiln_cp_async_commit();
    kiln_cp_async_wait<0>();
    __syncthreads();
    if (j == 0) {  // the block's own tiles landed with the first key tile
      q_rows.hold();
#ifdef KILN_PART_DQ
      g_rows.hold();
#endif
    }
    float p[BC / 8][4];
    rows_times_rows(p, q_rows, Ks, lane);
    const bool masked = n0 + BC > Tk || (KILN_CAUSAL && n0 + BC - 1 > m0 + warp * 16);
#ifdef KILN_SCORE_MOD
    float sv[BC / 8][4];  // the scaled scores, which the mod's derivative reads
#endif
#pragma unroll
    for (int i = 0; i < BC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = n0 + i * 8 + 2 * (lane & 3) + (e & 1), r = row + (e >> 1) * 8;
#ifdef KILN_SCORE_MOD
        sv[i][e] = p[i][e] * scale;
        p[i][e] = kiln_mod_score(sv[i][e], b, bh % H, r, col, Tq, Tk, mod_scalars);
#else
        p[i][e] *= scale_log2;
#endif
        if (masked && (col >= Tk || (KILN_CAUSAL && col > r))) p[i][e] = KILN_NEG_INF;
      }
#ifdef KILN_PART_DQ
    float dp[BC / 8][4];
    rows_times_rows(dp, g_rows, Vs, lane);  // dO v^T
#pragma unroll
    for (int i = 0; i < BC / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pe = kiln_exp2(p[i][e] - lse2[e >> 1]);
        p[i][e] = pe * (dp[i][e] - delta[e >> 1]);  // dS
#ifdef KILN_SCORE_MOD  // back through the mod: dS of the scaled score
        p[i][e] = kiln_mod_vjp(sv[i][e], b, bh % H, row + (e >> 1) * 8, n0 + i * 8 + 2 * (lane & 3) + (e & 1), Tq, Tk,
                               mod_scalars, pe, p[i][e]);
#endif
      }
    scores_times_tile(acc, p, Ks, lane);  // dq += dS k
#else
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int i = 0; i < BC / 8; ++i) mx = fmaxf(mx, fmaxf(p[i][2 * r], p[i][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == KILN_NEG_INF ? 0.f : mx;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < BC / 8; ++i) sum += kiln_exp2(p[i][2 * r] - base) + kiln_exp2(p[i][2 * r + 1] - base);
      row_sum[r] = row_sum[r] * kiln_exp2(row_max[r] - base) + sum;
      row_max[r] = mx;
    }
#endif
    __syncthreads();  // every warp is done with the tiles before the next are loaded
  }
  kiln_cp_async_commit();
  kiln_cp_async_wait<0>();  // (no key tile: the block's own tiles are still landing)
#ifdef KILN_PART_DQ
  store_rows(dq + (i64)bh * Tq * KILN_D, acc, scale, m0 + warp * 16, Tq, lane);
#else
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int t = row + r * 8;
    if ((lane & 3) == 0 && t < Tq) stats[(i64)bh * Tq + t] = l == 0.f ? KILN_POS_INF : (row_max[r] + kiln_log2(l)) * LN2;
  }
#endif
}
#else
// One block a tile of BR keys of one (batch, key/value head); the query tiles of its G query heads.
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ g,
          const float* __restrict__ stats, u16* __restrict__ out, int BHkv, int H, int G, int Tq, int Tk,
          float scale_log2, float scale KILN_BACKWARD_MOD_PARAMS) {
  extern __shared__ __align__(128) unsigned char kiln_smem[];
  uint4* Ks = reinterpret_cast<uint4*>(kiln_smem);
  uint4* Vs = Ks + BR * CH;
  uint4* Qs = Vs + BR * CH;
  uint4* Gs = Qs + BC * CH;
  float* Ls = reinterpret_cast<float*>(Gs + BC * CH);  // the query tile's lse (exp2 domain) and delta
  float* Ds = Ls + BC;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int rank, bhk;  // causal: the key tiles with the most queries (the first) first
  if (!kiln_block_tile(KILN_CAUSAL, BHkv, 4ll * G * Tq * KILN_D, rank, bhk)) return;
  const int n0 = rank * BR;
  const int Hkv = H / G, b = bhk / Hkv, hk = bhk % Hkv;
  load_tile<BR>(Ks, k + (i64)bhk * Tk * KILN_D, KILN_D, n0, Tk);
#ifndef KILN_PART_DV
  load_tile<BR>(Vs, v + (i64)bhk * Tk * KILN_D, KILN_D, n0, Tk);
#endif
  const int row = n0 + warp * 16 + (lane >> 2);  // this thread's keys: row and row + 8
  float acc[KILN_D / 8][4];  // dk, or dv in the dv kernel
  ZERO_ACC(acc);
#ifdef KILN_PART_DKV
  float acc_v[KILN_D / 8][4];  // dv
  ZERO_ACC(acc_v);
#endif
  const int first = KILN_CAUSAL ? n0 / BC * BC : 0;  // earlier queries see none of these keys
  OwnRows k_rows{Ks, warp, lane}, v_rows{Vs, warp, lane};
  bool held = false;
  for (int hh = 0; hh < G; ++hh) {
    const i64 bh = (i64)b * H + hk * G + hh;
    const u16* qp = q + bh * Tq * KILN_D;
    const u16* gp = g + bh * Tq * KILN_D;
    for (int i0 = first; i0 < Tq; i0 += BC) {
      load_tile<BC>(Qs, qp, KILN_D, i0, Tq);
      load_tile<BC>(Gs, gp, KILN_D, i0, Tq);
      for (int c = threadIdx.x; c < BC; c += KILN_WARPS * 32) {
        const bool in = i0 + c < Tq;
        Ls[c] = in ? stats[(bh * Tq + i0 + c) * 2] * LOG2E : KILN_POS_INF;
        Ds[c] = in ? stats[(bh * Tq + i0 + c) * 2 + 1] : 0.f;
      }
      kiln_cp_async_commit();
      kiln_cp_async_wait<0>();
      __syncthreads();
      if (!held) {  // the block's own tiles landed with the first query tile
        k_rows.hold();
#ifndef KILN_PART_DV
        v_rows.hold();
#endif
        held = true;
      }
      float p[BC / 8][4];
      rows_times_rows(p, k_rows, Qs, lane);  // s^T = k q^T: rows keys, columns queries
      const bool masked = i0 + BC > Tq || (KILN_CAUSAL && n0 + warp * 16 + 15 > i0);
#ifdef KILN_SCORE_MOD
      float sv[BC / 8][4];  // the scaled scores, which the mod's derivative reads
#endif
#pragma unroll
      for (int i = 0; i < BC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = i * 8 + 2 * (lane & 3) + (e & 1), r = row + (e >> 1) * 8;
#ifdef KILN_SCORE_MOD  // rows are keys here, columns queries
          sv[i][e] = p[i][e] * scale;
          float x = kiln_mod_score(sv[i][e], b, hk * G + hh, i0 + c, r, Tq, Tk, mod_scalars);
#else
          float x = p[i][e] * scale_log2;
#endif
          if (masked && (i0 + c >= Tq || (KILN_CAUSAL && r > i0 + c))) x = KILN_NEG_INF;
          p[i][e] = kiln_exp2(x - Ls[c]);
        }
#ifdef KILN_PART_DV
      scores_times_tile(acc, p, Gs, lane);  // dv += p^T dO
#else
#ifdef KILN_PART_DKV
      scores_times_tile(acc_v, p, Gs, lane);  // dv += p^T dO, before p becomes dS^T
#endif
      float dp[BC / 8][4];
      rows_times_rows(dp, v_rows, Gs, lane);  // dP^T = v dO^T
#pragma unroll
      for (int i = 0; i < BC / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
#ifdef KILN_SCORE_MOD
          const float pe = p[i][e];
#endif
          p[i][e] *= dp[i][e] - Ds[i * 8 + 2 * (lane & 3) + (e & 1)];  // dS^T
#ifdef KILN_SCORE_MOD  // back through the mod
          p[i][e] = kiln_mod_vjp(sv[i][e], b, hk * G + hh, i0 + i * 8 + 2 * (lane & 3) + (e & 1), row + (e >> 1) * 8,
                                 Tq, Tk, mod_scalars, pe, p[i][e]);
#endif
        }
      scores_times_tile(acc, p, Qs, lane);  // dk += dS^T q
#endif
      __syncthreads();
    }
  }
  kiln_cp_async_commit();
  kiln_cp_async_wait<0>();  // (no query tile: the block's own tiles are still landing)
#ifdef KILN_PART_DV
  store_rows(out + (i64)bhk * Tk * KILN_D, acc, 1.f, n0 + warp * 16, Tk, lane);
#else
  store_rows(out + (i64)bhk * Tk * KILN_D, acc, scale, n0 + warp * 16, Tk, lane);
#endif
#ifdef KILN_PART_DKV
  store_rows(out + ((i64)BHkv + bhk) * Tk * KILN_D, acc_v, 1.f, n0 + warp * 16, Tk, lane);  // the second half
#endif
}
#endif
)";
  return s;
}

}  // namespace kiln::codegen
