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
#include "attention_prelude.hpp"

namespace kiln::codegen {

struct AttentionKernel {
  int head_dim = 64;  // D, a multiple of 16, at most 128
  int warps = 4;      // warps a block
  int row_tiles = 1;  // 16-row tiles of queries a warp: each key and value fragment serves them all
  bool causal = false;
  dtype dt = dtype::bf16;  // bf16 or f16

  int key_rows = 64;           // keys a tile (64 or 32; Hopper: 128, or 192 under KILN_TUNE_ATTENTION_KEYS)
  bool q_in_registers = true;  // else q's fragments are read from shared memory at each key tile
  // > 0: the Hopper kernel (attention_kernel_sm90.hpp), this many warpgroups of 64 query rows a
  // block, 128 keys a tile, q and two stages of k and v in shared memory; warps, row_tiles and
  // q_in_registers are then unused.
  int warpgroups = 0;
  // Hopper only: a producer warpgroup loads q and the key tiles behind mbarriers into `stages()` stages,
  // and the two warpgroups (three at head dim 64 without a score_mod, KILN_TUNE_ATTENTION_WGMMA's
  // default) take turns on the tensor cores (attention_kernel_sm90_pingpong.hpp).
  bool producer = false;
  // With a producer (KILN_TUNE_ATTENTION_WGMMA=5): one block an SM loops over the query tiles, q in two
  // buffers (the launcher's grid is the SMs, attention_flash's; NOTES item 183).
  bool persistent = false;
  // Looping (KILN_TUNE_ATTENTION_WGMMA=6): each block's tiles after its first come from a counter in
  // device memory, one at a time as it finishes, instead of a round robin fixed in advance (NOTES
  // item 188; each launch leaves it zero for the next: runtime tile_counter).
  bool dynamic = false;
  // With a producer (by default; KILN_TUNE_ATTENTION_TMA=0 its 128 threads' cp.async): its thread 0 loads q and each
  // key tile by TMA, from tensor maps of q, k and v the launcher encodes (the kernel's last parameters; NOTES item
  // 191), rows past T filled with zeros by the copy engine. The launcher takes the cp.async kernel where a map cannot
  // describe an operand (no keys, strides the copy engine does not take).
  bool tma = false;
  // Hopper's forwards: each key tile's max taken over the raw scores and the scale applied inside the
  // exponent's FFMA (attention_kernel_sm90.hpp's softmax_tile; benchmarks/NOTES.md item 178), which
  // needs a positive scale (a score_mod's scores come scaled, so it always holds there); false scales
  // every score first (the launcher's choice for a scale that is not positive).
  bool raw_max = true;
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
  // With `producer`, two warpgroups fed by a producer warpgroup, `persistent` one block an SM.
  static AttentionKernel hopper(AttentionKernel a, int warpgroups = 2, bool producer = false, bool persistent = false,
                                bool dynamic = false) {
    if (a.head_dim != 64 && a.head_dim != 128) return a;
    // Three consumer warpgroups only without a score_mod: with one they spill at 160 registers a thread
    // (ptxas, sm_90a: a soft-cap 80-100 bytes, a bias and mask mod 460-520).
    a.warpgroups = producer ? (warpgroups == 3 && a.head_dim == 64 && a.score_mod.empty() ? 3 : 2) : warpgroups;
    a.warps = 4 * a.warpgroups;
    static const int keys = Tuning::from_environment().attention_keys;  // an A/B knob: see Tuning
    a.key_rows = producer && a.warpgroups == 2 && a.head_dim == 64 && keys == 192 ? 192 : 128;
    a.producer = producer;
    // Looping where q's second buffer still leaves three stages (D 64; at D 128 it would cost one,
    // 27-38% slower: NOTES item 183), and without a score_mod: the loop's q buffers and phases cost
    // registers, and with a mod it spills 72-148 bytes a thread where the tile-a-block kernel spills
    // 16-44 (ptxas, sm_90a).
    a.persistent = producer && persistent && a.score_mod.empty();
    if (a.persistent && a.stages() < 3) a.persistent = false;
    a.dynamic = a.persistent && dynamic;
    static const bool tma = Tuning::from_environment().attention_tma != 0;  // an A/B knob: see Tuning
    a.tma = producer && tma;
    return a;
  }
  int threads() const { return 32 * warps + (producer ? 128 : 0); }
  int query_rows() const { return warpgroups > 0 ? 64 * warpgroups : 16 * row_tiles * warps; }
  // Stages of key and value tiles in shared memory: two, or with a producer three where they fit
  // the 227 KB a block may have on Hopper (they do at D 64 and 128: 113 and 225 KB; looping, with q's
  // second buffer, 145 KB at D 64 and not at D 128).
  int stages() const {
    if (!producer) return 2;
    return (q_buffers() * query_rows() + 6 * key_rows) * head_dim * 2 + 1024 + barrier_bytes() <= 227 * 1024 ? 3 : 2;
  }
  int q_buffers() const { return persistent ? 2 : 1; }
  // A producer's mbarriers: q's "full" (and, looping, "empty") a buffer, each stage's "full" and "empty".
  // (Dynamic: also each q buffer's tile index and its "ready" mbarrier, within the 128 bytes.)
  int barrier_bytes() const { return producer ? (persistent ? 128 : 64) : 0; }
  // Hopper: q and the stages of k and v, 1024 bytes to align the tiles on the swizzle's period, and
  // with a producer its mbarriers.
  int shared_bytes() const {
    return warpgroups > 0
               ? (q_buffers() * query_rows() + 2 * stages() * key_rows) * head_dim * 2 + 1024 + barrier_bytes()
               : (query_rows() + 2 * key_rows) * head_dim * 2;
  }
  std::string name() const {
    if (warpgroups > 0)
      return "kiln_attention_fwd_wgmma_d" + std::to_string(head_dim) + "_wg" + std::to_string(warpgroups) + "_k" +
             std::to_string(key_rows) + (producer ? "_pp" : "") +
             (dynamic      ? "_dyn"
              : persistent ? "_loop"
                           : "") +
             (tma ? "_tma" : "") + (raw_max ? "" : "_scaled") + (causal ? "_causal" : "") + "_" +
             std::string(kiln::name(dt)) + score_mod_suffix(score_mod, score_mod_tag);
    return "kiln_attention_fwd_d" + std::to_string(head_dim) + "_w" + std::to_string(warps) + "x" +
           std::to_string(row_tiles) + "_k" + std::to_string(key_rows) + (q_in_registers ? "" : "_qs") +
           (causal ? "_causal" : "") + "_" + std::string(kiln::name(dt)) + score_mod_suffix(score_mod, score_mod_tag);
  }
};

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
