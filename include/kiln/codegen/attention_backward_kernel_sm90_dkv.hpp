// The Hopper attention backward's dk/dv kernel (and, under KILN_DQKV, dq's part too), as kernel text:
// one block 128 keys of one (batch, key/value head), the query tiles of its G heads streamed through
// two stages. attention_backward_kernel_sm90.hpp writes what it reads before it (the configuration,
// the tile steps, the copies and the TMA start) and the dq kernel beside it; the arithmetic is in
// that file's header comment.
#pragma once
#include <string_view>

namespace kiln::codegen::attention_sm90_detail {

inline constexpr std::string_view backward_dkv_kernel = R"(
// ---- dk and dv: one block 128 keys of one (batch, key/value head); the query tiles of its G heads ------
extern "C" __global__ void __launch_bounds__(KILN_WARPS * 32, 1)
KILN_NAME(const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ g,
          const float* __restrict__ stats, u16* __restrict__ out, int BHkv, int H, int G, int Tq, int Tk,
          float scale_log2, float scale KILN_BACKWARD_MOD_PARAMS KILN_BWD_TMA_PARAMS) {
  extern __shared__ __align__(1024) unsigned char kiln_smem[];
  const u32 Ks = (kiln_shared_address(kiln_smem) + 1023u) & ~1023u, Vs = Ks + TILE_BYTES(BR);
  const u32 Qs = Vs + TILE_BYTES(BR), Gs = Qs + 2 * TILE_BYTES(BC);  // two stages each
  float* Ls = reinterpret_cast<float*>(kiln_smem + (Gs + 2 * TILE_BYTES(BC) - kiln_shared_address(kiln_smem)));
  // Ls[stage][0..BC): a query tile's lse (exp2 domain); Ls[stage][BC..2 BC): its delta
  const int wg = KILN_WARPGROUP_INDEX, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
#ifdef KILN_DQKV  // after them, the block's dS^T tile (128 keys); dq's f32 sums in the output's last two slots
  const u32 DS = Gs + 2 * TILE_BYTES(BC) + 4 * BC * 4, DSw = DS + wg * 64 * 128;
  float* dq_sums = reinterpret_cast<float*>(out + 3 * (i64)BHkv * Tk * KILN_D);
#endif
  int rank, bhk;  // causal: the key tiles with the most queries (the first) first
  if (!kiln_block_tile(KILN_CAUSAL, BHkv, 4ll * G * Tq * KILN_D, rank, bhk)) return;
  const int n0 = rank * BR;
  const int Hkv = H / G, b = bhk / Hkv, hk = bhk % Hkv;
  const int kw0 = n0 + wg * 64, r0 = kw0 + warp * 16 + (lane >> 2);  // this thread's keys: r0 and r0 + 8
  const int first = KILN_CAUSAL ? n0 / BC * BC : 0;  // earlier queries see none of these keys
  const int per_head = first < Tq ? (Tq - first + BC - 1) / BC : 0, n_tiles = G * per_head;
#ifdef KILN_BWD_TMA
  // mbarriers after the statistics (dqkv: after the dS tile): the block's k and v tiles, then each stage's
#ifdef KILN_DQKV
  const u32 bars = DS + BR * BC * 2;
#else
  const u32 bars = Gs + 2 * TILE_BYTES(BC) + 4 * BC * 4;
#endif
  kiln_bwd_tma_start(bars, Ks, k_map, Vs, v_map, n0, hk, b);
#else
  load_tile_sw128<BR>(Ks, k + (i64)bhk * Tk * KILN_D, KILN_D, n0, Tk);
  load_tile_sw128<BR>(Vs, v + (i64)bhk * Tk * KILN_D, KILN_D, n0, Tk);
  kiln_cp_async_commit();
#endif
  // Query tile t: head hk * G + t / per_head, rows from first + (t % per_head) * BC.
  auto load = [&](int t) {
    const int stage = t & 1, i0 = first + (t % per_head) * BC;
    const i64 bh = (i64)b * H + hk * G + t / per_head;
#ifdef KILN_BWD_TMA
    if (threadIdx.x == 0) {
      const u32 bar = bars + 8 + 8 * stage;
      kiln_mbar_expect(bar, 2 * TILE_BYTES(BC));
      kiln_tma_tile<BC>(Qs + stage * TILE_BYTES(BC), q_map, i0, hk * G + t / per_head, b, bar);
      kiln_tma_tile<BC>(Gs + stage * TILE_BYTES(BC), g_map, i0, hk * G + t / per_head, b, bar);
    }
#else
    load_tile_sw128<BC>(Qs + stage * TILE_BYTES(BC), q + bh * Tq * KILN_D, KILN_D, i0, Tq);
    load_tile_sw128<BC>(Gs + stage * TILE_BYTES(BC), g + bh * Tq * KILN_D, KILN_D, i0, Tq);
#endif
    for (int c = threadIdx.x; c < BC; c += KILN_WARPS * 32) {
      const bool in = i0 + c < Tq;
      Ls[stage * 2 * BC + c] = in ? stats[(bh * Tq + i0 + c) * 2] * LOG2E : KILN_POS_INF;
      Ls[stage * 2 * BC + BC + c] = in ? stats[(bh * Tq + i0 + c) * 2 + 1] : 0.f;
    }
  };
  for (int t = 0; t < 2; ++t) {
    if (t < n_tiles) load(t);
    kiln_cp_async_commit();  // (TMA: an empty group)
  }
  const u64 k_desc = kiln_wgmma_desc(Ks + wg * 64 * 128, 16, 1024), v_desc = kiln_wgmma_desc(Vs + wg * 64 * 128, 16, 1024);
  float acc_k[KILN_D / 2], acc_v[KILN_D / 2];
#pragma unroll
  for (int i = 0; i < KILN_D / 2; ++i) acc_k[i] = acc_v[i] = 0.f;
  float p[BC / 2], dp[BC / 2];
  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t & 1, i0 = first + (t % per_head) * BC;
#ifdef KILN_BWD_TMA
    kiln_mbar_wait(bars, 0);                          // the block's keys and values
    kiln_mbar_wait(bars + 8 + 8 * stage, (t >> 1) & 1);  // query tile t
    // Each thread waits for the copy engine itself; the statistics of tile t were written before
    // the barrier that ends tile t - 1, except the first two tiles': one barrier before tile 0.
    if (t == 0) __syncthreads();
#else
    kiln_cp_async_wait<1>();  // the block's keys and values and query tile t are in
    kiln_fence_proxy_async();
    __syncthreads();
#endif
    if (!KILN_CAUSAL || i0 + BC - 1 >= kw0) {  // (causal: queries all before this warpgroup's keys see none)
      const u32 qt = Qs + stage * TILE_BYTES(BC), gt = Gs + stage * TILE_BYTES(BC);
      const float* L = Ls + stage * 2 * BC;
      kiln_wgmma_fence();
      own_times_streamed(p, k_desc, kiln_wgmma_desc(qt, 16, 1024));   // s^T = k q^T: rows keys, columns queries
      own_times_streamed(dp, v_desc, kiln_wgmma_desc(gt, 16, 1024));  // dP^T = v dO^T
      kiln_wgmma_commit();
      kiln_wgmma_wait<0>();
      kiln_hold(p);
      kiln_hold(dp);
      // (dqkv: keys past Tk too, whose dS would reach dq; dk/dv drops their rows at the store)
      const bool masked = i0 + BC > Tq || (KILN_CAUSAL && kw0 + 63 > i0) || (KILN_KEYS_MASKED && kw0 + 64 > Tk);
#pragma unroll
      for (int i = 0; i < BC / 2; ++i) {
        const int c = (i >> 2) * 8 + 2 * (lane & 3) + (i & 1), r = r0 + ((i >> 1) & 1) * 8;
#ifdef KILN_SCORE_MOD  // rows are keys here, columns queries
        const int h = hk * G + t / per_head;
        const float sv = p[i] * scale;
        float x = kiln_mod_score(sv, b, h, i0 + c, r, Tq, Tk, mod_scalars);
#else
        float x = p[i] * scale_log2;
#endif
        if (masked && (i0 + c >= Tq || (KILN_CAUSAL && r > i0 + c) || (KILN_KEYS_MASKED && r >= Tk))) x = KILN_NEG_INF;
        p[i] = kiln_exp2(x - L[c]);
        dp[i] = p[i] * (dp[i] - L[BC + c]);  // dS^T
#ifdef KILN_SCORE_MOD  // back through the mod
        dp[i] = kiln_mod_vjp(sv, b, h, i0 + c, r, Tq, Tk, mod_scalars, p[i], dp[i]);
#endif
      }
      u32 fp[BC / 16][4], fs[BC / 16][4];
      pack_fragments(fp, p);
      pack_fragments(fs, dp);
      kiln_hold(acc_v);
      kiln_hold(acc_k);
      kiln_wgmma_fence();
      fragments_times_tile(acc_v, fp, gt);  // dv += p^T dO
      fragments_times_tile(acc_k, fs, qt);  // dk += dS^T q
      kiln_wgmma_commit();
#ifdef KILN_DQKV
      store_ds(DSw, dp, scale);  // dS^T * scale (rows keys, columns queries), while the products run
#else
      kiln_wgmma_wait<0>();
      kiln_hold(acc_v);
      kiln_hold(acc_k);
#endif
    }
#ifdef KILN_DQKV
    else {  // (causal: queries all before this warpgroup's keys: its rows of dS are zeros)
      float zeros[BC / 2] = {};
      store_ds(DSw, zeros, 0.f);
    }
    kiln_fence_proxy_async();  // the dS tile, for wgmma's reads
    __syncthreads();           // both warpgroups' rows are in
    float part[KILN_D / 4];
    issue_dq_part(part, DS, Ks);
    kiln_wgmma_commit();
    kiln_wgmma_wait<0>();  // dq's part, and dk's and dv's products before it
    kiln_hold(acc_v);
    kiln_hold(acc_k);
    kiln_hold(part);
    add_dq(dq_sums + ((i64)b * H + hk * G + t / per_head) * Tq * KILN_D, part, first + (t % per_head) * BC, Tq);
#endif
    __syncthreads();  // every warpgroup is done with this stage
    if (t + 2 < n_tiles) load(t + 2);
    kiln_cp_async_commit();
  }
#ifdef KILN_BWD_TMA
  kiln_mbar_wait(bars, 0);  // (no query tile: the block's own tiles may still be landing)
#else
  kiln_cp_async_wait<0>();  // (no query tile: the block's own tiles are still landing)
#endif
  store_rows(out + (i64)bhk * Tk * KILN_D, acc_k, scale, r0, Tk);
  store_rows(out + ((i64)BHkv + bhk) * Tk * KILN_D, acc_v, 1.f, r0, Tk);  // the second half
}
)";

}  // namespace kiln::codegen::attention_sm90_detail
