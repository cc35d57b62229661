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
// attention_kernel_sm90.hpp's; KILN_TUNE_ATTENTION_WGMMA=3 chooses this kernel (=4 with three
// consumer warpgroups at D 64; =5 also looping over query tiles under KILN_PERSISTENT; =6, the default,
// taking each block's next tile from a counter under KILN_DYNAMIC_TILES).
// By default (KILN_TUNE_ATTENTION_IDLE_WARPGROUPS) a warpgroup with no rows before Tq keeps only its
// turns and releases (NOTES items 182, 185).
#pragma once
#include <string>

#include "attention_kernel_sm90.hpp"

namespace kiln::codegen {

inline std::string attention_forward_source_sm90_pingpong(const AttentionKernel& a) {
  if (!a.producer || (a.warpgroups != 2 && (a.warpgroups != 3 || a.head_dim != 64)))
    throw error(
        "attention: the producer/ping-pong forward takes two consumer warpgroups, or three at head dim 64, not " +
        a.name());
  std::string s = attention_sm90_detail::forward_header(a);
  s += "#define KILN_STAGES " + std::to_string(a.stages()) + "\n";
  static const bool idle = Tuning::from_environment().attention_idle_warpgroups != 0;  // an A/B knob: see Tuning
  if (idle) s += "#define KILN_IDLE_WARPGROUPS 1\n";
  if (a.persistent) s += "#define KILN_PERSISTENT 1\n";
  if (a.dynamic) s += "#define KILN_DYNAMIC_TILES 1\n";
  if (a.tma) s += "#define KILN_TMA 1\n";
  // The registers each role keeps (setmaxnreg): the producer's and the consumers' add up to the
  // register file at one block an SM of (warpgroups + 1) * 128 threads (two consumers: 128 * (40 + 2 *
  // 232) = 64512; three: 128 * (32 + 3 * 160) = 65536, FlashAttention-3's split).
  // At 32 registers the producer's copies unrolled by 4 spill (ptxas, sm_90a): by 2 they do not. With
  // load_tile_sw128's lean copies (the default; KILN_TUNE_ATTENTION_COPIES=0 the loop before) the kernels taking tiles
  // from a counter spill by 2 as well (4-16 bytes): the three-warpgroup producers then do not unroll them.
  static const bool lean = Tuning::from_environment().attention_copies != 0;  // an A/B knob: see Tuning
  s += a.warpgroups == 2 ? "#define KILN_PRODUCER_REGS 40\n#define KILN_CONSUMER_REGS 232\n"
                         : "#define KILN_PRODUCER_REGS 32\n#define KILN_CONSUMER_REGS 160\n";
  s += std::string("#define KILN_PRODUCE_UNROLL ") + (a.warpgroups == 2 ? "4" : lean ? "1" : "2") + "\n";
  s += attention_sm90_detail::forward_tile_steps();
  s += R"(
// ---- mbarriers and named barriers --------------------------------------------------------------------
)";
  s += attention_sm90_detail::mbarrier_functions();
  s += R"(// One arrival on `bar` once this thread's cp.async copies so far have landed (counted in the
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
#ifdef KILN_DYNAMIC_TILES
__device__ __forceinline__ void kiln_st_shared(u32 addr, int v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int kiln_ld_shared(u32 addr) {
  int v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
#define KILN_COUNTER_PARAM , int* __restrict__ kiln_counter
#else
#define KILN_COUNTER_PARAM
#endif

#ifdef KILN_TMA
// ---- the producer's copies by TMA (NOTES item 191) -----------------------------------------------------
)";
  s += attention_sm90_detail::tma_functions();
  s += R"(#define KILN_TMA_PARAMS                                                                         \
  , const __grid_constant__ kiln_tensor_map q_map, const __grid_constant__ kiln_tensor_map k_map, \
      const __grid_constant__ kiln_tensor_map v_map
#define KILN_LOAD_ARRIVALS 1  // the producer's thread 0 arrives once, expecting the tile's bytes
#else
#define KILN_TMA_PARAMS
#define KILN_LOAD_ARRIVALS 128  // the producer's threads, as their copies land
#endif

// Rows [r0, r0 + ROWS) of a [T, D] operand into a swizzled tile by the producer's 128 threads (t).
constexpr int kiln_produce_unroll = KILN_PRODUCE_UNROLL;  // (a pragma's argument is not macro-expanded)
template <int ROWS>
__device__ __forceinline__ void produce_tile(u32 tile, const u16* src, i64 st, int r0, int T, int t) {
#ifdef KILN_LEAN_COPIES
  load_tile_sw128<ROWS, 128, kiln_produce_unroll>(tile, src, st, r0, T, t);  // (NOTES item 190)
#else
#pragma unroll kiln_produce_unroll
  for (int c = t; c < ROWS * CH; c += 128) {
    const int r = c / CH, ch = c % CH;
    const bool in = r0 + r < T;
    const u32 dst = tile + (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst),
                 "l"(in ? src + (i64)(r0 + r) * st + ch * 8 : src), "r"(in ? 16 : 0));
  }
#endif
}

// ---- the forward kernel ------------------------------------------------------------------------------
// Threads 0 to 128 * WG - 1: the consumer warpgroups (64 query rows each); the last 128: the producer.
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32 + 128, 1)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, u16* __restrict__ o,
          int BH, int H, int G, int Tq, int Tk, float scale_log2, i64 qb, i64 qh, i64 qt, i64 kb, i64 kh, i64 kt, i64 vb,
          i64 vh, i64 vt, i64 ob, i64 oh, i64 ot, float* __restrict__ lse KILN_MOD_PARAMS KILN_COUNTER_PARAM KILN_TMA_PARAMS) {
  extern __shared__ __align__(1024) unsigned char kiln_smem[];
  // q (looping: two buffers), then stage i's k at Ks + i * 2 * TILE_BYTES(BN) and its v right after,
  // then the mbarriers: q's "full", each stage's "full" and each stage's "empty" (looping: q's "full"
  // and "empty" a buffer).
  const u32 Qs = (kiln_shared_address(kiln_smem) + 1023u) & ~1023u;
#ifdef KILN_PERSISTENT
  const u32 Ks = Qs + 2 * TILE_BYTES(BM), bars = Ks + KILN_STAGES * 2 * TILE_BYTES(BN);
#define Q_BUF (Qs + (it & 1) * TILE_BYTES(BM))  // query tile it's buffer
#define Q_FULL(i) (bars + 8 * (i))
#define FULL(i) (bars + 16 + 8 * (i))
#define EMPTY(i) (bars + 16 + 8 * KILN_STAGES + 8 * (i))
#define Q_EMPTY(i) (bars + 16 + 16 * KILN_STAGES + 8 * (i))
#define TILE_READY(i) (bars + 32 + 16 * KILN_STAGES + 8 * (i))  // (dynamic) q buffer i's tile index is in
#define TILE_SLOT(i) (bars + 48 + 16 * KILN_STAGES + 4 * (i))   // (dynamic) that index
#define KV(j) (kv0 + (j))  // key tiles are counted across query tiles: stages and phases run on
#else
  const u32 Ks = Qs + TILE_BYTES(BM), bars = Ks + KILN_STAGES * 2 * TILE_BYTES(BN);
#define Q_BUF Qs
#define Q_FULL(i) bars
#define FULL(i) (bars + 8 + 8 * (i))
#define EMPTY(i) (bars + 8 + 8 * KILN_STAGES + 8 * (i))
#define KV(j) (j)
#endif
#define STAGE_K(i) (Ks + (i) * 2 * TILE_BYTES(BN))
#define STAGE_V(i) (STAGE_K(i) + TILE_BYTES(BN))
  const int wg = KILN_WARPGROUP_INDEX, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
// The named barrier of the next warpgroup's turn, and whether this one hands it a turn after step j
// (the last warpgroup hands warpgroup 0 the next step's, looping the next query tile's first).
// Two warpgroups keep the expressions of the kernel measured before three existed (ptxas schedules
// the same cubin).
#define NEXT_TURN (WG == 2 ? 2 - wg : wg + 1 < WG ? wg + 2 : 1)
#if defined(KILN_DYNAMIC_TILES)
#define HANDS_ON(j) ((WG == 2 ? wg == 0 : wg + 1 < WG) || (j) + 1 < n_tiles || next_tile())
#elif defined(KILN_PERSISTENT)
#define HANDS_ON(j) ((WG == 2 ? wg == 0 : wg + 1 < WG) || (j) + 1 < n_tiles || more)
#else
#define HANDS_ON(j) ((WG == 2 ? wg == 0 : wg + 1 < WG) || (j) + 1 < n_tiles)
#endif
  // A query tile's place: causal, the tiles with the most keys first (attention_prelude's
  // kiln_block_tile); its first row m0 and its key tiles.
#define PLACE_TILE(tiles)                                                \
  const int m0 = (KILN_CAUSAL ? (tiles) - 1 - rank : rank) * BM;         \
  const int b = bh / H, h = bh % H, hk = h / G;                          \
  const int n_end = KILN_CAUSAL && m0 + BM < Tk ? m0 + BM : Tk;          \
  const int n_tiles = (n_end + BN - 1) / BN;
#ifdef KILN_PERSISTENT
  // One block an SM: round `it` of the blocks takes the order's tiles [it * gridDim.x, (it + 1) *
  // gridDim.x), block b the b-th of them, the last first in odd rounds (causal: the block that took
  // the longest tile of a round takes the shortest of the next, as a snake draft; not causal, short
  // last tiles after the full ones).
  const int q_tiles = (Tq + BM - 1) / BM;
  const bool short_last = Tq % BM != 0;
#define TILE_AT(it, rank, bh)                                                                                  \
  kiln_tile_at((long long)(it) * gridDim.x + ((it) & 1 ? gridDim.x - 1 - blockIdx.x : blockIdx.x), q_tiles, \
               KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh, short_last)
  // Dynamic: the tile at `index` of the order; a block's first is blockIdx.x, each later one the
  // counter's next value past the first round, taken by the producer as it starts that tile (NOTES
  // item 188).
#define TILE_OF(index, rank, bh) kiln_tile_at(index, q_tiles, KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh, short_last)
  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      kiln_mbar_init(Q_FULL(i), KILN_LOAD_ARRIVALS);
      kiln_mbar_init(Q_EMPTY(i), KILN_WARPS);
#ifdef KILN_DYNAMIC_TILES
      kiln_mbar_init(TILE_READY(i), 1);
#endif
    }
#else
  int rank, bh;
  if (!kiln_block_tile(KILN_CAUSAL, BH, 4ll * Tk * KILN_D, rank, bh)) return;
  PLACE_TILE(gridDim.x)
  if (threadIdx.x == 0) {
    kiln_mbar_init(Q_FULL(0), KILN_LOAD_ARRIVALS);
#endif
    for (int i = 0; i < KILN_STAGES; ++i) {
      kiln_mbar_init(FULL(i), KILN_LOAD_ARRIVALS);
      kiln_mbar_init(EMPTY(i), KILN_WARPS);  // the consumer warps
    }
#ifdef KILN_TMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // (seen by the copy engine)
#endif
  }
  __syncthreads();

  // One block an SM: ptxas allocates 65536 / threads registers a thread (168 at 384 threads, 128 at
  // 512), and the producer's and the consumers' counts add up within the register file (above); a
  // change of the launch bounds must keep that sum, or setmaxnreg.inc waits forever.
  if (wg == WG) {  // ---- the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(KILN_PRODUCER_REGS) : "memory");
    const int t = threadIdx.x - WG * 128;
#ifdef KILN_TMA
    if (t != 0) return;  // one thread issues every copy
#endif
#if defined(KILN_DYNAMIC_TILES)
    int rank, bh, kv0 = 0;
    long long index = blockIdx.x;
    for (int it = 0;; ++it) {
      // q's buffer (and its index slot) is free once every consumer warp is done with query tile
      // it - 2; then thread 0 takes tile it's index and publishes it (release: the mbarrier's arrive).
      if (it >= 2) kiln_mbar_wait(Q_EMPTY(it & 1), ((it >> 1) - 1) & 1);
      if (it >= 1) {
        if (t == 0) {
          // A launch adds once a tile: each block once for each tile past its first and once to
          // find none left. So the add that takes the last value is the launch's last, and puts
          // the word back to zero for the next launch on this stream (runtime's tile_counter).
          const int taken = atomicAdd(kiln_counter, 1);
          if (taken == (long long)q_tiles * BH - 1) atomicExch(kiln_counter, 0);
          kiln_st_shared(TILE_SLOT(it & 1), taken + (int)gridDim.x);
          kiln_mbar_arrive(TILE_READY(it & 1));
        }
        kiln_mbar_wait(TILE_READY(it & 1), ((it - 1) >> 1) & 1);
        index = kiln_ld_shared(TILE_SLOT(it & 1));
      }
      if (!TILE_OF(index, rank, bh)) break;
      PLACE_TILE(q_tiles)
#elif defined(KILN_PERSISTENT)
    int rank, bh, kv0 = 0;
    for (int it = 0; TILE_AT(it, rank, bh); ++it) {
      PLACE_TILE(q_tiles)
      // q's buffer is free once every consumer warp is done with query tile it - 2.
      if (it >= 2) kiln_mbar_wait(Q_EMPTY(it & 1), ((it >> 1) - 1) & 1);
#endif
#ifdef KILN_TMA
    kiln_mbar_expect(Q_FULL(it & 1), TILE_BYTES(BM));
    kiln_tma_tile<BM>(Q_BUF, q_map, m0, h, b, Q_FULL(it & 1));
    for (int j = 0; j < n_tiles; ++j) {
      const int stage = KV(j) % KILN_STAGES;
      if (KV(j) >= KILN_STAGES) kiln_mbar_wait(EMPTY(stage), (KV(j) / KILN_STAGES - 1) & 1);
      kiln_mbar_expect(FULL(stage), 2 * TILE_BYTES(BN));
      kiln_tma_tile<BN>(STAGE_K(stage), k_map, j * BN, hk, b, FULL(stage));
      kiln_tma_tile<BN>(STAGE_V(stage), v_map, j * BN, hk, b, FULL(stage));
    }
#else
    const u16* kp = k + b * kb + hk * kh;
    const u16* vp = v + b * vb + hk * vh;
    produce_tile<BM>(Q_BUF, q + b * qb + h * qh, qt, m0, Tq, t);
    kiln_cp_async_arrive(Q_FULL(it & 1));
    for (int j = 0; j < n_tiles; ++j) {
      const int stage = KV(j) % KILN_STAGES;
      if (KV(j) >= KILN_STAGES) kiln_mbar_wait(EMPTY(stage), (KV(j) / KILN_STAGES - 1) & 1);
      produce_tile<BN>(STAGE_K(stage), kp, kt, j * BN, Tk, t);
      produce_tile<BN>(STAGE_V(stage), vp, vt, j * BN, Tk, t);
      kiln_cp_async_arrive(FULL(stage));
    }
#endif
#ifdef KILN_PERSISTENT
      kv0 += n_tiles;
    }
#endif
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ---- the consumer warpgroups
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(KILN_CONSUMER_REGS) : "memory");
#if defined(KILN_DYNAMIC_TILES)
  int rank, bh, kv0 = 0;
  long long index = blockIdx.x;
  for (int it = 0; TILE_OF(index, rank, bh); ++it) {
    PLACE_TILE(q_tiles)
    // The next tile's index: published by the producer as it starts that tile, a few key tiles
    // before this one ends; waited for only where needed (the last warpgroup's last turn, and
    // after the store).
    long long next_index = -1;
    auto next_tile = [&]() {
      if (next_index < 0) {
        kiln_mbar_wait(TILE_READY((it + 1) & 1), (it >> 1) & 1);
        next_index = kiln_ld_shared(TILE_SLOT((it + 1) & 1));
      }
      int next_rank, next_bh;
      return TILE_OF(next_index, next_rank, next_bh);
    };
#elif defined(KILN_PERSISTENT)
  int rank, bh, kv0 = 0;
  for (int it = 0; TILE_AT(it, rank, bh); ++it) {
    PLACE_TILE(q_tiles)
    int next_rank, next_bh;
    const bool more = TILE_AT(it + 1, next_rank, next_bh);
#endif
  const int w0 = m0 + wg * 64;                  // this warpgroup's first query row
  const int r0 = w0 + warp * 16 + (lane >> 2);  // this thread's rows: r0 and r0 + 8
  const u64 q_desc = kiln_wgmma_desc(Q_BUF + wg * 64 * 128, 16, 1024);
#define DIM_STEP(kk, rows) (((kk) >> 2) * (rows) * 128 + ((kk) & 3) * 32)
  float acc[KILN_D / 2];  // o, unnormalised, in the accumulator layout (attention_kernel_sm90.hpp)
#pragma unroll
  for (int i = 0; i < KILN_D / 2; ++i) acc[i] = 0.f;
  float row_max[2] = {KILN_NEG_INF, KILN_NEG_INF}, row_sum[2] = {0.f, 0.f};
  float s[BN / 2];
  u32 p[BN / 16][4];  // the last tile's probabilities, waiting for their product with its v
  float alpha[2];
  // Causal: a warpgroup whose rows all come before a tile's first key has nothing to add from it
  // (those tiles come last; with query and key tiles of 128 rows no warpgroup has any, but the
  // turns and releases below stay balanced should the tiles differ).
#ifdef KILN_IDLE_WARPGROUPS
  // A warpgroup whose rows all lie past Tq (the last query tile, where Tq is not a multiple of BM)
  // has nothing to compute: it only keeps its turns and releases (NOTES item 182).
  const int n_active = w0 >= Tq ? 0 : KILN_CAUSAL ? min(n_tiles, (w0 + 63) / BN + 1) : n_tiles;
#else
  const int n_active = KILN_CAUSAL ? min(n_tiles, (w0 + 63) / BN + 1) : n_tiles;
#endif

  // Step j: this warpgroup's turn on the tensor cores (warpgroup 0 first: barrier 1 + w is warpgroup
  // w's turn) issues s_j = q k_j^T and, after the first step, o += p_{j-1} v_{j-1}; the next
  // warpgroup's turn follows at once (round robin: the last one hands step j + 1 to warpgroup 0).
  // The softmax of s_j runs while o's product does, then o is rescaled and tile j - 1 released.
  // (A template on FIRST: no wgmma sits in a branch.)
  auto step = [&](int j, auto first) {
    constexpr bool FIRST = decltype(first)::value;
    const int n0 = j * BN, stage = KV(j) % KILN_STAGES;
    kiln_mbar_wait(FULL(stage), (KV(j) / KILN_STAGES) & 1);
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
      issue_pv(acc, p, values_desc(STAGE_V(KV(j - 1) % KILN_STAGES)));
      kiln_wgmma_commit();
    }
    if (HANDS_ON(j)) kiln_named_arrive(NEXT_TURN);
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
      if (lane == 0) kiln_mbar_arrive(EMPTY(KV(j - 1) % KILN_STAGES));  // this warp is done with tile j - 1
    }
    pack_probabilities(p, s);
  };

#ifdef KILN_PERSISTENT
  if (wg == WG - 1 && n_tiles > 0 && it == 0) kiln_named_arrive(1);  // (later tiles: the last one's HANDS_ON)
  kiln_mbar_wait(Q_FULL(it & 1), (it >> 1) & 1);
#else
  if (wg == WG - 1 && n_tiles > 0) kiln_named_arrive(1);
  kiln_mbar_wait(Q_FULL(0), 0);
#endif
  if (n_active > 0) {
    step(0, kiln_bool<true>{});
    for (int j = 1; j < n_active; ++j) step(j, kiln_bool<false>{});
    // The last active tile's o += p v.
    const u64 v_desc = values_desc(STAGE_V(KV(n_active - 1) % KILN_STAGES));
    kiln_hold(acc);
    kiln_wgmma_fence();
    issue_pv(acc, p, v_desc);
    kiln_wgmma_commit();
    kiln_wgmma_wait<0>();
    kiln_hold(acc);
  }
  for (int j = n_active; j < n_tiles; ++j) {  // causal tiles past its rows (idle: every tile): turns, releases
    kiln_mbar_wait(FULL(KV(j) % KILN_STAGES), (KV(j) / KILN_STAGES) & 1);
    kiln_named_sync(1 + wg);
    if (HANDS_ON(j)) kiln_named_arrive(NEXT_TURN);
#ifdef KILN_IDLE_WARPGROUPS
    if (lane == 0 && j > 0) kiln_mbar_arrive(EMPTY(KV(j - 1) % KILN_STAGES));  // (idle: from tile 0, no tile -1)
#else
    if (lane == 0) kiln_mbar_arrive(EMPTY(KV(j - 1) % KILN_STAGES));
#endif
  }
#ifdef KILN_PERSISTENT
  // The next query tile's q may load into this one's buffer once every warp is past its last
  // q k^T, and its keys into the stage of this one's last tile (before the store: neither is read
  // by it).
  // Every lane has passed q's Q_FULL wait (and, under KILN_DYNAMIC_TILES, read the next tile's
  // index) before lane 0 frees the buffer: without a product in the tile (Tk = 0) nothing else
  // gathers the warp between the two (a helper's lane-level model, NOTES item 188).
  __syncwarp();
  if (lane == 0) {
    kiln_mbar_arrive(Q_EMPTY(it & 1));
    if (n_tiles > 0) kiln_mbar_arrive(EMPTY(KV(n_tiles - 1) % KILN_STAGES));
  }
#endif
  store_output(o + b * ob + h * oh, ot, lse ? lse + (i64)bh * Tq : nullptr, acc, row_max, row_sum, r0, Tq);
#ifdef KILN_DYNAMIC_TILES
    next_tile();
    index = next_index;
#endif
#ifdef KILN_PERSISTENT
    kv0 += n_tiles;
  }
#endif
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
