// The Hopper attention forward with a producer warpgroup and two consumer warpgroups that take turns on
// the tensor cores (FlashAttention-3's warp specialisation and ping-pong, with cp.async instead of
// TMA). attention_kernel_sm90.hpp's kernel holds its two warpgroups in step with a barrier at every
// key tile, so both run their exponentials at once while the tensor cores wait. Here:
// - a producer warpgroup loads q, then each key tile (k and v) into one of `stages` stages, and
//   signals the stage's "full" mbarrier as its copies land (cp.async.mbarrier.arrive.noinc); it waits
//   on the stage's "empty" mbarrier, which each consumer warp signals once it is done with the tile,
//   before filling the stage again. The consumers share no other barrier. ptxas budgets registers
//   by warpgroups (a producer warp would cost as much), so the producer gives its registers to the
//   consumers (setmaxnreg: 40 and 232 a thread, as FlashAttention-3 does);
// - each consumer warpgroup issues, at step j, s_j = q k_j^T and o += p_{j-1} v_{j-1} (the previous
//   tile's probabilities, still in registers), then hands the tensor cores to the other warpgroup
//   (named barriers 1 and 2), runs the softmax of s_j while its o product finishes, rescales o, and
//   releases tile j - 1. So one warpgroup's exponentials run under the other's products.
// The tile steps, the masks, the lazily rescaled o, the causal order of blocks and the arguments are
// attention_kernel_sm90.hpp's. The kernel loops over query tiles (kiln_tile_at's order, a stride of
// gridDim.x): KILN_TUNE_ATTENTION_WGMMA=3 launches one block an SM, so the next tile's q and first
// key tiles load under this tile's last products and store; =4 launches one block a tile.
#pragma once
#include <string>

#include "attention_kernel_sm90.hpp"

namespace kiln::codegen {

inline std::string attention_forward_source_sm90_pingpong(const AttentionKernel& a) {
  if (!a.producer || a.warpgroups != 2)
    throw error("attention: the producer/ping-pong forward takes two consumer warpgroups, not " + a.name());
  std::string s = attention_sm90_detail::forward_header(a);
  s += "#define KILN_STAGES " + std::to_string(a.stages()) + "\n";
  s += attention_sm90_detail::forward_tile_steps();
  s += R"(
// ---- mbarriers and named barriers --------------------------------------------------------------------
__device__ __forceinline__ void kiln_mbar_init(u32 bar, u32 count) {
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
// One arrival on `bar` once this thread's cp.async copies so far have landed (counted in the
// barrier's expected arrivals: noinc).
__device__ __forceinline__ void kiln_cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void kiln_named_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
template <bool B>
struct kiln_bool {
  static constexpr bool value = B;
};
__device__ __forceinline__ void kiln_named_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// Rows [r0 + FIRST, r0 + FIRST + ROWS) of a [T, D] operand into rows [FIRST, FIRST + ROWS) of a
// swizzled tile of TILE_ROWS rows, by the producer's 128 threads (t).
template <int ROWS, int TILE_ROWS = ROWS>
__device__ __forceinline__ void produce_tile(u32 tile, const u16* src, i64 st, int r0, int T, int t, int first = 0) {
#pragma unroll 2  // by 4, the halves of q spill the producer's 40 registers
  for (int c = t; c < ROWS * CH; c += 128) {
    const int r = first + c / CH, ch = c % CH;
    const bool in = r0 + r < T;
    const u32 dst = tile + (ch >> 3) * (TILE_ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(in ? src + (i64)(r0 + r) * st + ch * 8 : src), "r"(in ? 16 : 0));
  }
}

// ---- the forward kernel ------------------------------------------------------------------------------
// Threads 0-255: the consumer warpgroups (64 query rows each); 256-383: the producer. A block takes
// the query tiles at places blockIdx.x, + gridDim.x, ... of kiln_tile_at's order: one block an SM
// (the launcher's default), so the producer loads the next tile's q and keys while the consumers
// finish this one's last product and store it; or one tile a block (KILN_TUNE_ATTENTION_WGMMA=4).
// Key tiles count on across query tiles (`seen`): their stages and phases go on where they were.
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32 + 128, 1)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
          int BH, int H, int G, int Tq, int Tk, float scale_log2, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb,
          i64 vh, i64 vt, i64 ob, i64 oh, i64 ot, float* __restrict__ lse KILN_MOD_PARAMS) {
  extern __shared__ __align__(1024) unsigned char kiln_smem[];
  // q, then stage i's k at Ks + i * 2 * TILE_BYTES(BN) and its v right after, then the mbarriers:
  // "full" and "empty" for each warpgroup's 64 rows of q, each stage's "full" and each stage's "empty".
  const u32 Qs = (kiln_shared_address(kiln_smem) + 1023u) & ~1023u;
  const u32 Ks = Qs + TILE_BYTES(BM), bars = Ks + KILN_STAGES * 2 * TILE_BYTES(BN);
#define STAGE_K(i) (Ks + (i) * 2 * TILE_BYTES(BN))
#define STAGE_V(i) (STAGE_K(i) + TILE_BYTES(BN))
#define Q_FULL(w) (bars + 8 * (w))
#define Q_EMPTY(w) (bars + 16 + 8 * (w))
#define FULL(i) (bars + 32 + 8 * (i))
#define EMPTY(i) (bars + 32 + 8 * KILN_STAGES + 8 * (i))
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int tiles = (Tq + BM - 1) / BM;
  const long long places = (long long)tiles * BH;
  if (threadIdx.x == 0) {
    for (int w = 0; w < 2; ++w) {
      kiln_mbar_init(Q_FULL(w), 128);  // the producer's threads, as their copies land
      kiln_mbar_init(Q_EMPTY(w), 4);   // warpgroup w's warps, done with their rows of q
    }
    for (int i = 0; i < KILN_STAGES; ++i) {
      kiln_mbar_init(FULL(i), 128);
      kiln_mbar_init(EMPTY(i), 8);
    }
  }
  __syncthreads();
  // Query tile `at`'s place: its first row m0, (batch, head) and key tiles (false past the last).
  int m0, b, h, n_tiles;
  auto tile = [&](long long at) {
    int rank, bh;  // causal: the tiles with the most keys first (attention_prelude's kiln_tile_at)
    if (!kiln_tile_at(KILN_CAUSAL, at, tiles, BH, 4ll * Tk * KILN_D, rank, bh)) return false;
    m0 = (KILN_CAUSAL ? tiles - 1 - rank : rank) * BM;
    b = bh / H, h = bh % H;
    const int n_end = KILN_CAUSAL && m0 + BM < Tk ? m0 + BM : Tk;
    n_tiles = (n_end + BN - 1) / BN;
    return true;
  };

  // 384 threads at one block an SM: ptxas allocates 168 registers a thread (65536 / 384), so the
  // producer's 40 and the consumers' 232 add up (128 * (40 + 2 * 232) = 64512); a change of the
  // launch bounds must keep that sum within the register file, or setmaxnreg.inc waits forever.
  if (wg == 2) {  // ---- the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    const int t = threadIdx.x - 256;
    int seen = 0, round = 0;
    for (long long at = blockIdx.x; at < places && tile(at); at += gridDim.x, ++round) {
      const int hk = h / G;
      const u16* kp = k + b * kb + hk * kh;
      const u16* vp = v + b * vb + hk * vh;
      // Warpgroup w's rows of q once its last q k^T of the tile before is in: warpgroup 0's first
      // (it leads by half a step), then the first key tile, so that warpgroup 0 can start before
      // warpgroup 1 has finished the tile before; then warpgroup 1's rows and the other key tiles.
      auto produce_q = [&](int w) {
        if (round > 0) kiln_mbar_wait(Q_EMPTY(w), (round - 1) & 1);
        produce_tile<64, BM>(Qs, q + b * qb + h * qh, qt, m0, Tq, t, 64 * w);
        kiln_cp_async_arrive(Q_FULL(w));
      };
      produce_q(0);
      for (int j = 0; j < n_tiles; ++j, ++seen) {
        const int stage = seen % KILN_STAGES;
        if (seen >= KILN_STAGES) kiln_mbar_wait(EMPTY(stage), (seen / KILN_STAGES - 1) & 1);
        produce_tile<BN>(STAGE_K(stage), kp, kt, j * BN, Tk, t);
        produce_tile<BN>(STAGE_V(stage), vp, vt, j * BN, Tk, t);
        kiln_cp_async_arrive(FULL(stage));
        if (j == 0) produce_q(1);
      }
      if (n_tiles == 0) produce_q(1);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ---- the consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  const u64 q_desc = kiln_wgmma_desc(Qs + wg * 64 * 128, 16, 1024);
#define DIM_STEP(kk, rows) (((kk) >> 2) * (rows) * 128 + ((kk) & 3) * 32)
  float acc[KILN_D / 2];  // o, unnormalised, in the accumulator layout (attention_kernel_sm90.hpp)
  float row_max[2], row_sum[2];
  float s[BN / 2];
  u32 p[BN / 16][4];  // the last tile's probabilities, waiting for their product with its v
  float alpha[2];
  int seen = 0, round = 0;  // key tiles and query tiles before this one
  for (long long at = blockIdx.x; at < places && tile(at); at += gridDim.x, ++round, seen += n_tiles) {
    // Whether this block has another query tile with keys (every place below `places` is a tile):
    // then warpgroup 1's last turn of this tile hands the tensor cores to warpgroup 0 for the next.
    const bool more = Tk > 0 && at + gridDim.x < places;
    const int w0 = m0 + wg * 64;                  // this warpgroup's first query row
    const int r0 = w0 + warp * 16 + (lane >> 2);  // this thread's rows: r0 and r0 + 8
#pragma unroll
    for (int i = 0; i < KILN_D / 2; ++i) acc[i] = 0.f;
    row_max[0] = row_max[1] = KILN_NEG_INF;
    row_sum[0] = row_sum[1] = 0.f;
    // Causal: a warpgroup whose rows all come before a tile's first key has nothing to add from it
    // (those tiles come last; with query and key tiles of 128 rows no warpgroup has any, but the
    // turns and releases below stay balanced should the tiles differ).
    const int n_active = KILN_CAUSAL ? min(n_tiles, (w0 + 63) / BN + 1) : n_tiles;

    // Step j: this warpgroup's turn on the tensor cores (warpgroup 0 first: barrier 1 is its turn,
    // 2 warpgroup 1's) issues s_j = q k_j^T and, after the first step, o += p_{j-1} v_{j-1}; the
    // other warpgroup's turn follows at once. The softmax of s_j runs while o's product does, then
    // o is rescaled and key tile j - 1 released. (A template on FIRST: no wgmma sits in a branch.)
    auto step = [&](int j, auto first) {
      constexpr bool FIRST = decltype(first)::value;
      const int n0 = j * BN, stage = (seen + j) % KILN_STAGES;
      kiln_mbar_wait(FULL(stage), ((seen + j) / KILN_STAGES) & 1);
      kiln_fence_proxy_async();  // the producer's copies, for wgmma's reads
      kiln_named_sync(1 + wg);
      kiln_hold(acc);
      kiln_wgmma_fence();
      const u64 k_desc = kiln_wgmma_desc(STAGE_K(stage), 16, 1024);
      kiln_wgmma_qk_first(s, q_desc, k_desc);
#pragma unroll
      for (int kk = 1; kk < KILN_D / 16; ++kk)
        kiln_wgmma_qk(s, q_desc + (DIM_STEP(kk, BM) >> 4), k_desc + (DIM_STEP(kk, BN) >> 4));
      kiln_wgmma_commit();
      if constexpr (!FIRST) {
        issue_pv(acc, p, values_desc(STAGE_V((seen + j - 1) % KILN_STAGES)));
        kiln_wgmma_commit();
      }
      if (wg == 0 || j + 1 < n_tiles || more) kiln_named_arrive(2 - wg);
      if constexpr (FIRST)
        kiln_wgmma_wait<0>();
      else
        kiln_wgmma_wait<1>();  // s_j is in; o's product may still run
      kiln_hold(s);
#ifdef KILN_SCORE_MOD
      mod_tile(s, b, h, n0, r0, Tq, Tk, scale, mod_scalars);
      const bool moved = softmax_tile(s, row_max, row_sum, alpha, n0, w0, r0, Tk, 1.f);
#else
      const bool moved = softmax_tile(s, row_max, row_sum, alpha, n0, w0, r0, Tk, scale_log2);
#endif
      if constexpr (!FIRST) {
        kiln_wgmma_wait<0>();
        kiln_hold(acc);
        if (__any_sync(0xffffffffu, moved))
#pragma unroll
          for (int i = 0; i < KILN_D / 2; ++i) acc[i] *= alpha[(i >> 1) & 1];
        if (lane == 0) kiln_mbar_arrive(EMPTY((seen + j - 1) % KILN_STAGES));  // this warp is done with tile j - 1
      }
      pack_probabilities(p, s);
    };

    if (wg == 1 && n_tiles > 0 && round == 0) kiln_named_arrive(1);  // later tiles: at the last turn of the one before
    kiln_mbar_wait(Q_FULL(wg), round & 1);
    if (n_active > 0) {
      step(0, kiln_bool<true>{});
      for (int j = 1; j < n_active; ++j) step(j, kiln_bool<false>{});
    }
    if (lane == 0) kiln_mbar_arrive(Q_EMPTY(wg));  // this warp's products with q are done: its rows of the next q may load
    if (n_active > 0) {  // the last active key tile's o += p v
      const u64 v_desc = values_desc(STAGE_V((seen + n_active - 1) % KILN_STAGES));
      kiln_hold(acc);
      kiln_wgmma_fence();
      issue_pv(acc, p, v_desc);
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(acc);
    }
    for (int j = n_active; j < n_tiles; ++j) {  // causal tiles past this warpgroup's rows: turns and releases
      kiln_mbar_wait(FULL((seen + j) % KILN_STAGES), ((seen + j) / KILN_STAGES) & 1);
      kiln_named_sync(1 + wg);
      if (wg == 0 || j + 1 < n_tiles || more) kiln_named_arrive(2 - wg);
      if (lane == 0 && j > 0) kiln_mbar_arrive(EMPTY((seen + j - 1) % KILN_STAGES));
    }
    if (lane == 0 && n_tiles > 0) kiln_mbar_arrive(EMPTY((seen + n_tiles - 1) % KILN_STAGES));  // the last key tile
    store_output(o + b * ob + h * oh, ot, lse ? lse + (i64)(b * H + h) * Tq : nullptr, acc, row_max, row_sum, r0, Tq);
  }
}
)";
  return s;
}

// The forward kernel's source for any kind (AttentionKernel::warpgroups and producer pick).
inline std::string attention_forward_kernel_source(const AttentionKernel& a) {
  if (a.producer) return attention_forward_source_sm90_pingpong(a);
  return a.warpgroups > 0 ? attention_forward_source_sm90(a) : attention_forward_source(a);
}

}  // namespace kiln::codegen
