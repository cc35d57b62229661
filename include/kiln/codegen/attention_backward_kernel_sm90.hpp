// The fused attention backward's dq and dk/dv kernels on Hopper (compute capability 9.0, head dims
// 64 and 128): warpgroup MMA over the 128-byte-swizzled tiles of attention_kernel_sm90.hpp, the same
// arithmetic as attention_backward_kernel.hpp's mma.sync kernels (p recomputed from q, k and the
// rows' log-sum-exp; nothing materialised). A block is two warpgroups of 64 rows (queries for dq,
// keys for dk/dv), 128 rows a block; the streamed tiles of 64 rows come in two stages, the next
// one's load in flight while this one is used. Each streamed tile is both a K-major operand (of
// s = q k^T and dP = dO v^T) and an MN-major one (of dq += dS k, dv += p^T dO, dk += dS^T q), as
// in the forward kernel.
//   dq   s = q k^T, dP = dO v^T (two products from shared memory), dS = p (dP - delta), dq += dS k
//   dkv  s^T = k q^T, dP^T = v dO^T, dv += p^T dO, dk += dS^T q; into [2, B, Hkv, Tk, D]
//   dqkv dkv's, and each warpgroup's dS^T (scaled) into shared memory while its dk/dv products run,
//        then its half of dq's dims, dS k over the block's 128 keys (a product from shared memory, A
//        read MN-major; one wait for it and the dk/dv products), added into dq's f32 rows with
//        atomic reductions; into [5, B, H, T, D]: dk, dv, dq (16-bit, converted from the sums
//        by attention_dq_convert_source's kernel after this one), then the f32 sums (which the
//        launcher zeroes) in the last two slots
#pragma once
#include <string>

#include "attention_backward_kernel.hpp"
#include "attention_backward_kernel_sm90_dkv.hpp"
#include "attention_kernel_sm90.hpp"

namespace kiln::codegen {

inline std::string attention_backward_source_sm90(const AttentionBackwardKernel& a) {
  using attention_sm90_detail::wgmma_function;
  const std::string t = a.dt == dtype::bf16 ? "bf16" : "f16";
  using Part = AttentionBackwardKernel::Part;
  const bool dq = a.part == Part::dq, dqkv = a.part == Part::dqkv;
  if ((!dq && !dqkv && a.part != Part::dkv) || (a.head_dim != 64 && a.head_dim != 128) || !a.hopper)
    throw error("attention: the Hopper backward kernels are dq, dk/dv and dq/dk/dv at head dims 64 and 128, not " +
                a.name());
  std::string s =
      "// " + a.name() + ": fused attention backward, warpgroup MMA (codegen/attention_backward_kernel_sm90.hpp)\n";
  s += "#define KILN_D " + std::to_string(a.head_dim) + "\n";
  s += "#define KILN_WARPS " + std::to_string(a.threads() / 32) + "\n";
  s += "#define KILN_STREAMED " + std::to_string(a.streamed_rows()) + "\n";
  s += "#define KILN_CAUSAL " + std::string(a.causal ? "1" : "0") + "\n";
  s += "#define KILN_PACK kiln_pack_" + t + "\n";
  s += "#define KILN_NAME " + a.name() + "\n";
  if (dqkv) s += "#define KILN_DQKV 1\n";
  s += score_mod_preamble(a.score_mod);
  // The warpgroup index from lane 0 only under KILN_TUNE_ATTENTION_UNIFORM=1: causal backwards 1-2%
  // faster on an H100, non-causal ones at D 64 3% slower (NOTES item 184).
  static const bool uniform = Tuning::from_environment().attention_uniform == 1;  // an A/B knob: see Tuning
  s += wgmma_prelude(uniform);
  if (a.tma) {  // q, dO, k and v tiles by the copy engine, each stage's landing on an mbarrier (NOTES item 193)
    s += "#define KILN_BWD_TMA 1\n";
    s += attention_sm90_detail::mbarrier_functions();
    s += attention_sm90_detail::tma_functions();
    s += "#define KILN_BWD_TMA_PARAMS , const __grid_constant__ kiln_tensor_map q_map, const __grid_constant__ "
         "kiln_tensor_map k_map, const __grid_constant__ kiln_tensor_map v_map, const __grid_constant__ "
         "kiln_tensor_map g_map\n";
  } else {
    s += "#define KILN_BWD_TMA_PARAMS\n";
  }
  s += wgmma_function("kiln_wgmma_rows_first", a.streamed_rows(), false, true, 0, t);  // own rows x streamed rows^T
  s += wgmma_function("kiln_wgmma_rows", a.streamed_rows(), false, false, 0, t);
  s += wgmma_function("kiln_wgmma_tile", a.head_dim, true, false, 1, t);  // (registers) x a streamed tile
  if (dqkv) {  // dS (shared memory, MN-major) x half the dims of the block's keys (MN-major)
    s += wgmma_function("kiln_wgmma_ds_first", a.head_dim / 2, false, true, 1, t, 1);
    s += wgmma_function("kiln_wgmma_ds", a.head_dim / 2, false, false, 1, t, 1);
  }
  s += R"(
#define BR 128             // rows a block: two warpgroups of 64
#define BC KILN_STREAMED   // rows a streamed tile
#define TILE_BYTES(rows) ((rows) * KILN_D * 2)
#define LOG2E 1.4426950408889634f
#define KILN_POS_INF __int_as_float(0x7f800000)
#define DIM_STEP(kk, rows) (((kk) >> 2) * (rows) * 128 + ((kk) & 3) * 32)
#ifdef KILN_BWD_TMA
// A block's start: thread 0 initialises its three mbarriers (its own two tiles', then each stage's),
// which the block waits for (as the forward does), and loads its own two tiles, rows r0 of (batch,
// head), onto the first.
__device__ __forceinline__ void kiln_bwd_tma_start(u32 bars, u32 t0, const kiln_tensor_map& m0, u32 t1,
                                                   const kiln_tensor_map& m1, int r0, int head, int batch) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < 3; ++i) kiln_mbar_init(bars + 8 * i, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // (seen by the copy engine)
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    kiln_mbar_expect(bars, 2 * TILE_BYTES(BR));
    kiln_tma_tile<BR>(t0, m0, r0, head, batch, bars);
    kiln_tma_tile<BR>(t1, m1, r0, head, batch, bars);
  }
}
#endif

// acc = (this warpgroup's 64 own rows, a K-major descriptor) x (a streamed [BC, D] tile)^T.
__device__ __forceinline__ void own_times_streamed(float (&acc)[BC / 2], u64 own, u64 tile) {
  kiln_wgmma_rows_first(acc, own, tile);
#pragma unroll
  for (int kk = 1; kk < KILN_D / 16; ++kk) kiln_wgmma_rows(acc, own + (DIM_STEP(kk, BR) >> 4), tile + (DIM_STEP(kk, BC) >> 4));
}
// Values in registers (64 x BC in the accumulator layout) as the A fragments of a product with a
// streamed tile: two columns of 8 make one step of 16.
__device__ __forceinline__ void pack_fragments(u32 (&f)[BC / 16][4], const float (&x)[BC / 2]) {
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) f[kk][e] = KILN_PACK(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
}
// acc += (packed fragments) x a streamed [BC, D] tile at `tile`, read MN-major.
__device__ __forceinline__ void fragments_times_tile(float (&acc)[KILN_D / 2], const u32 (&f)[BC / 16][4], u32 tile) {
  const u64 desc = kiln_wgmma_desc(tile, TILE_BYTES(BC) / (KILN_D / 64), 1024);
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) kiln_wgmma_tile(acc, f[kk], desc + ((kk * 2048) >> 4));
}
// Stores this warpgroup's rows of acc * scale as 16-bit values, rows below T; r0 the thread's first.
__device__ __forceinline__ void store_rows(u16* out, const float (&acc)[KILN_D / 2], float scale, int r0, int T) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = r0 + r * 8;
    if (t >= T) continue;
    u16* o = out + (i64)t * KILN_D + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < KILN_D / 8; ++i)
      *reinterpret_cast<u32*>(o + i * 8) = KILN_PACK(acc[4 * i + 2 * r] * scale, acc[4 * i + 2 * r + 1] * scale);
  }
}
#ifdef KILN_DQKV
#define KILN_KEYS_MASKED 1
// Issues this warpgroup's part of dq for one query tile: the block's dS^T (scaled, in shared memory
// at ds: 128 keys of 128 bytes of queries, swizzled; both warpgroups' rows) times the block's k tile
// over all 128 keys. This warpgroup takes half the dims (a 64-byte step into the 128-byte rows at
// D 64, the second column block at D 128), so each element of dq gets one reduction a block. The
// caller commits the group and waits for it (with the dk/dv products still in flight).
__device__ __forceinline__ void issue_dq_part(float (&part)[KILN_D / 4], u32 ds, u32 keys) {
  const int wg = KILN_WARPGROUP_INDEX;
  const u64 a_desc = kiln_wgmma_desc(ds, BR * 128, 1024);
  const u32 half = KILN_D == 64 ? wg * 64 : wg * (TILE_BYTES(BR) / 2);
  const u64 b_desc = kiln_wgmma_desc(keys + half, TILE_BYTES(BR) / (KILN_D / 64), 1024);
  kiln_wgmma_fence();
  kiln_wgmma_ds_first(part, a_desc, b_desc);
#pragma unroll
  for (int kk = 1; kk < BR / 16; ++kk) kiln_wgmma_ds(part, a_desc + ((kk * 2048) >> 4), b_desc + ((kk * 2048) >> 4));
}
// Adds this warpgroup's part of dq (issue_dq_part's, waited for) into dq's f32 sums for query tile
// rows [i0, i0 + 64) of one head, rows below Tq, with atomic reductions.
__device__ __forceinline__ void add_dq(float* dq, const float (&part)[KILN_D / 4], int i0, int Tq) {
  const int wg = KILN_WARPGROUP_INDEX, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int t = i0 + warp * 16 + (lane >> 2) + 8 * r;
    if (t >= Tq) continue;
    float* row = dq + (i64)t * KILN_D + wg * (KILN_D / 2) + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < KILN_D / 16; ++i)
      asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(row + i * 8), "f"(part[4 * i + 2 * r]),
                   "f"(part[4 * i + 2 * r + 1]) : "memory");
  }
}
// This warpgroup's rows of the block's dS^T tile (keys; 64 queries a row), 16-bit.
__device__ __forceinline__ void store_ds(u32 ds, const float (&x)[BC / 2], float scale) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
#pragma unroll
  for (int blk = 0; blk < BC / 8; ++blk)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = warp * 16 + (lane >> 2) + 8 * r;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ds + key * 128 + ((blk ^ (key & 7)) << 4) + (lane & 3) * 4),
                   "r"(KILN_PACK(x[4 * blk + 2 * r] * scale, x[4 * blk + 2 * r + 1] * scale))
                   : "memory");
    }
}
#else
#define KILN_KEYS_MASKED 0
#endif
)";
  if (dq)
    s += R"(
// ---- dq: one block 128 queries of one (batch, head); keys in tiles of BC -------------------------------
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32, 1)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ g,
          const float* __restrict__ stats, u16* __restrict__ dq, int BH, int H, int G, int Tq, int Tk, float scale_log2,
          float scale KILN_BACKWARD_MOD_PARAMS KILN_BWD_TMA_PARAMS) {
  extern __shared__ __align__(1024) unsigned char kiln_smem[];
  const u32 Qs = (kiln_shared_address(kiln_smem) + 1023u) & ~1023u, Gs = Qs + TILE_BYTES(BR);
  const u32 Ks = Gs + TILE_BYTES(BR), Vs = Ks + 2 * TILE_BYTES(BC);  // two stages each
  const int wg = KILN_WARPGROUP_INDEX, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  int rank, bh;  // causal: the tiles with the most keys first (attention_prelude's kiln_block_tile)
  if (!kiln_block_tile(KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh)) return;
  const int m0 = (KILN_CAUSAL ? gridDim.x - 1 - rank : rank) * BR;
  const int b = bh / H, hk = (bh % H) / G, Hkv = H / G;
#ifndef KILN_BWD_TMA
  const u16* kp = k + (i64)(b * Hkv + hk) * Tk * KILN_D;
  const u16* vp = v + (i64)(b * Hkv + hk) * Tk * KILN_D;
#endif
  const int n_end = KILN_CAUSAL && m0 + BR < Tk ? m0 + BR : Tk;
  const int n_tiles = (n_end + BC - 1) / BC;
  const int w0 = m0 + wg * 64, r0 = w0 + warp * 16 + (lane >> 2);  // this thread's rows: r0 and r0 + 8
#ifdef KILN_BWD_TMA
  // mbarriers in the statistics' bytes, unused here: the block's q and dO tiles, then each stage's
  const u32 bars = Vs + 2 * TILE_BYTES(BC);
  auto load = [&](int j) {  // (thread 0)
    const u32 bar = bars + 8 + 8 * (j & 1);
    kiln_mbar_expect(bar, 2 * TILE_BYTES(BC));
    kiln_tma_tile<BC>(Ks + (j & 1) * TILE_BYTES(BC), k_map, j * BC, hk, b, bar);
    kiln_tma_tile<BC>(Vs + (j & 1) * TILE_BYTES(BC), v_map, j * BC, hk, b, bar);
  };
  kiln_bwd_tma_start(bars, Qs, q_map, Gs, g_map, m0, bh % H, b);
  if (threadIdx.x == 0)
    for (int j = 0; j < 2 && j < n_tiles; ++j) load(j);
#else
  load_tile_sw128<BR>(Qs, q + (i64)bh * Tq * KILN_D, KILN_D, m0, Tq);
  load_tile_sw128<BR>(Gs, g + (i64)bh * Tq * KILN_D, KILN_D, m0, Tq);
  kiln_cp_async_commit();
  for (int j = 0; j < 2; ++j) {
    if (j < n_tiles) {
      load_tile_sw128<BC>(Ks + j * TILE_BYTES(BC), kp, KILN_D, j * BC, Tk);
      load_tile_sw128<BC>(Vs + j * TILE_BYTES(BC), vp, KILN_D, j * BC, Tk);
    }
    kiln_cp_async_commit();
  }
#endif
  float lse2[2], delta[2];  // the rows' log-sum-exp in the exp2 domain (+inf past Tq: p = 0)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool in = r0 + r * 8 < Tq;
    lse2[r] = in ? stats[((i64)bh * Tq + r0 + r * 8) * 2] * LOG2E : KILN_POS_INF;
    delta[r] = in ? stats[((i64)bh * Tq + r0 + r * 8) * 2 + 1] : 0.f;
  }
  const u64 q_desc = kiln_wgmma_desc(Qs + wg * 64 * 128, 16, 1024), g_desc = kiln_wgmma_desc(Gs + wg * 64 * 128, 16, 1024);
  float acc[KILN_D / 2];
#pragma unroll
  for (int i = 0; i < KILN_D / 2; ++i) acc[i] = 0.f;
  float p[BC / 2], dp[BC / 2];
  for (int j = 0; j < n_tiles; ++j) {
    const int n0 = j * BC, stage = j & 1;
#ifdef KILN_BWD_TMA
    // Each thread waits for the copy engine itself: no block barrier (the stage's refill waits for
    // the one at the tile's end).
    kiln_mbar_wait(bars, 0);                          // the block's rows
    kiln_mbar_wait(bars + 8 + 8 * stage, (j >> 1) & 1);  // key tile j
#else
    kiln_cp_async_wait<1>();  // the block's rows and key tile j are in
    kiln_fence_proxy_async();
    __syncthreads();
#endif
    if (!KILN_CAUSAL || n0 <= w0 + 63) {  // (causal: a warpgroup whose rows all come before the tile has nothing to add)
      const u32 kt = Ks + stage * TILE_BYTES(BC), vt = Vs + stage * TILE_BYTES(BC);
      kiln_wgmma_fence();
      own_times_streamed(p, q_desc, kiln_wgmma_desc(kt, 16, 1024));   // s = q k^T
      own_times_streamed(dp, g_desc, kiln_wgmma_desc(vt, 16, 1024));  // dP = dO v^T
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(p);
      kiln_hold(dp);
      const bool masked = n0 + BC > Tk || (KILN_CAUSAL && n0 + BC - 1 > w0);
#pragma unroll
      for (int i = 0; i < BC / 2; ++i) {
        const int col = n0 + (i >> 2) * 8 + 2 * (lane & 3) + (i & 1), r = (i >> 1) & 1;
#ifdef KILN_SCORE_MOD  // the mod of the scaled score
        const float sv = p[i] * scale;
        float x = kiln_mod_score(sv, b, bh % H, r0 + r * 8, col, Tq, Tk, mod_scalars);
#else
        float x = p[i] * scale_log2;
#endif
        if (masked && (col >= Tk || (KILN_CAUSAL && col > r0 + r * 8))) x = KILN_NEG_INF;
        const float pe = kiln_exp2(x - lse2[r]);
        p[i] = pe * (dp[i] - delta[r]);  // dS
#ifdef KILN_SCORE_MOD  // back through the mod: dS of the scaled score
        p[i] = kiln_mod_vjp(sv, b, bh % H, r0 + r * 8, col, Tq, Tk, mod_scalars, pe, p[i]);
#endif
      }
      u32 f[BC / 16][4];
      pack_fragments(f, p);
      kiln_hold(acc);
      kiln_wgmma_fence();
      fragments_times_tile(acc, f, kt);  // dq += dS k
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(acc);
    }
    __syncthreads();  // every warpgroup is done with this stage
#ifdef KILN_BWD_TMA
    if (j + 2 < n_tiles && threadIdx.x == 0) load(j + 2);
  }
  kiln_mbar_wait(bars, 0);  // (no key tile: the block's own tiles may still be landing)
#else
    if (j + 2 < n_tiles) {
      load_tile_sw128<BC>(Ks + stage * TILE_BYTES(BC), kp, KILN_D, n0 + 2 * BC, Tk);
      load_tile_sw128<BC>(Vs + stage * TILE_BYTES(BC), vp, KILN_D, n0 + 2 * BC, Tk);
    }
    kiln_cp_async_commit();
  }
  kiln_cp_async_wait<0>();  // (no key tile: the block's own tiles are still landing)
#endif
  store_rows(dq + (i64)bh * Tq * KILN_D, acc, scale, r0, Tq);
}
)";
  else
    s += attention_sm90_detail::backward_dkv_kernel;
  return s;
}

// After the dqkv kernel: dq's f32 sums (n values, a multiple of 8, at `sums`) into 16-bit values at `dq`.
inline std::string attention_dq_convert_source(dtype dt) {
  const std::string t = dt == dtype::bf16 ? "bf16" : "f16";
  return "// " + attention_dq_convert_name(dt) + ": dq's f32 sums to " + t +
         " (codegen/attention_backward_kernel_sm90.hpp)\ntypedef unsigned int u32;\ntypedef long long i64;\n"
         "__device__ __forceinline__ u32 pack(float x0, float x1) {\n  u32 r;\n  asm(\"cvt.rn." +
         t +
         "x2.f32 %0, %2, %1;\" : \"=r\"(r) : \"f\"(x0), \"f\"(x1));\n  return r;\n}\n"
         "extern \"C\" __global__ void " +
         attention_dq_convert_name(dt) +
         "(const float4* __restrict__ sums, uint4* __restrict__ dq, i64 n) {\n"
         "  for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n / 8; i += (i64)gridDim.x * blockDim.x) {\n"
         "    const float4 a = sums[2 * i], b = sums[2 * i + 1];\n"
         "    dq[i] = make_uint4(pack(a.x, a.y), pack(a.z, a.w), pack(b.x, b.y), pack(b.z, b.w));\n  }\n}\n";
}

// The backward kernel's source for either kind (AttentionBackwardKernel::hopper picks).
inline std::string attention_backward_kernel_source(const AttentionBackwardKernel& a) {
  return a.hopper ? attention_backward_source_sm90(a) : attention_backward_source(a);
}

}  // namespace kiln::codegen
