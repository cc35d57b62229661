// The block programs' matrix product of tiles, `dot` (what Triton's tl.dot is to its programs): a
// program computes a DOT_BM x DOT_BN tile of C = A B, A [M, K] and B [K, N] of any strides, in
// steps of DOT_BK along K, with an f32 accumulator. One text for both targets:
// - on the GPU (sm_80 and later) the block's warps each multiply a part of the tile on tensor cores,
//   mma.sync m16n8k16 for bf16/f16 (fragments by ldmatrix, plain or transposed as the operand's
//   tile lies), m16n8k8 through TF32 for f32 where the kernel allows it (DOT_TF32, from
//   KILN_ALLOW_TF32=1), FMA otherwise; operand tiles are staged DOT_STAGES deep in shared memory,
//   by cp.async where rows start on 16 bytes, their 16-byte chunks XOR-swizzled by row so that the
//   eight rows one ldmatrix reads lie in eight bank groups;
//   on Hopper wgmma m64nNk16 instead, a warpgroup's 64 rows at a time from the same shared tiles;
// - on the CPU the tile is an array and the product plain loops the host compiler vectorises.
// Appended after prelude.hpp (and, on the GPU, prelude_mma.hpp) by the kernels that use it
// (codegen/gemm_template.hpp); a kernel defines, before it:
//   DOT_T                     the operands' element type (bf16, f16 or float)
//   DOT_BM, DOT_BN            the program's tile of C (multiples of 64 on the GPU)
//   DOT_WARPS_M, DOT_WARPS_N  the GPU block's warps along M and N
//   DOT_STAGES                tiles in flight on the GPU (2 or more)
//   DOT_A_K, DOT_B_K          1: the operand's tile lies K-contiguous (A as [m][k], B as [n][k]);
//                             0: M- or N-contiguous (A as [k][m], B as [k][n])
//   DOT_ASYNC                 1: the operands' contiguous dims have stride 1 and their rows start
//                             on 16 bytes (cp.async); 0: element by element, any strides
//   DOT_TF32                  f32 on the GPU: 1 through TF32 on tensor cores, 0 by FMA
//   DOT_WGMMA                 16-bit on sm_90a: 1 by warpgroup MMA (DOT_WARPS_M = DOT_BM / 16,
//                             DOT_WARPS_N = 1, and the kernel defines kiln_wgmma_dot), 0 mma.sync
//   DOT_OVERLAP               with DOT_WGMMA: 1 keeps a step's products in flight under the next
//                             step's (DOT_STAGES >= 3), 0 waits for them
//   DOT_TMA                   with DOT_WGMMA and DOT_BM 128: 1 stages the tiles by TMA from a
//                             producer warpgroup (dot_k_loop_tma; the kernel's source has
//                             prelude_tma.hpp's functions), 0 (or undefined) by every thread's cp.async
// and names its sizes M, N and K.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_dot = R"KILN(
// ---- dot: products of tiles ---------------------------------------------------------------------
#define DOT_BK (128 / (int)sizeof(DOT_T))  // a tile row of K: 128 bytes
#ifndef DOT_TMA
#define DOT_TMA 0
#endif
#ifdef KILN_DEVICE_CODE
#define DOT_THREADS (DOT_WARPS_M * DOT_WARPS_N * 32 + (DOT_TMA ? 128 : 0))  // (TMA: the producer warpgroup last)
#define DOT_WM (DOT_BM / DOT_WARPS_M)  // a warp's rows of the tile ...
#define DOT_WN (DOT_BN / DOT_WARPS_N)  // ... and its columns
#define DOT_MT (DOT_WM / 16)           // the warp's mma tiles along M (16 rows each) ...
#define DOT_NT (DOT_WN / 8)            // ... and along N (8 columns each)
#define DOT_VEC (16 / (int)sizeof(DOT_T))  // elements a 16-byte chunk
static_assert(DOT_BM % 64 == 0 && DOT_BN % 64 == 0 && DOT_BN <= 256 && DOT_STAGES >= 2,
              "dot: tiles of multiples of 64 rows and columns (at most 256), two stages or more");
#if DOT_WGMMA
static_assert(DOT_WARPS_M == DOT_BM / 16 && DOT_WARPS_N == 1, "dot: wgmma's warps run along M, 16 rows each");
static_assert(!DOT_OVERLAP || DOT_STAGES >= 3, "dot: products in flight need three stages or more");
static_assert(!DOT_TMA || DOT_BM == 128, "dot: TMA feeds two consumer warpgroups (128 rows)");
#else
static_assert(!DOT_TMA, "dot: TMA stages feed wgmma only");
static_assert(DOT_WM % 16 == 0 && DOT_WN % 16 == 0, "dot: each warp's part a multiple of 16 rows and columns");
#endif
namespace kiln {
// Element offset of (row r, column c) in a tile of ROWS x COLS: panels of 128-byte column blocks
// (one for a K-contiguous tile, whose rows are 128 bytes), each ROWS rows of 128 bytes whose 16-byte
// chunks are XOR-swizzled by the row: the layout of wgmma's 128-byte swizzle, and the eight rows
// one ldmatrix reads lie in eight bank groups.
#define DOT_PANEL (128 / (int)sizeof(DOT_T))  // elements a panel's row
template <int ROWS, int COLS> KILN_FN int dot_at(int r, int c) {
  return ((c / DOT_PANEL) * ROWS + r) * DOT_PANEL + ((c % DOT_PANEL / DOT_VEC) ^ (r & 7)) * DOT_VEC + c % DOT_VEC;
}
// The slice [r0, r0 + ROWS) x [k0, k0 + DOT_BK) of an operand X (element (r, k) at p[r s_r + k s_k],
// R rows, K columns) into tile t, zeros past X's ends: [ROWS][DOT_BK] when KMAJOR, else [DOT_BK][ROWS].
template <int ROWS, bool KMAJOR>
KILN_FN void dot_stage(DOT_T* t, const DOT_T* p, i64 s_r, i64 s_k, i64 r0, i64 k0, i64 R, i64 K) {
  constexpr int COLS = KMAJOR ? DOT_BK : ROWS, CHUNKS = ROWS * DOT_BK / DOT_VEC;
  for (int c = threadIdx.x; c < CHUNKS; c += DOT_THREADS) {
    const int row = c / (COLS / DOT_VEC), col = c % (COLS / DOT_VEC) * DOT_VEC;  // the chunk's place in t
    const i64 r = r0 + (KMAJOR ? row : col), k = k0 + (KMAJOR ? col : row);   // its first element in X
#if DOT_ASYNC
    // Along the contiguous dim, the elements left before X's end (a short chunk reads zeros past it).
    const i64 left = KMAJOR ? (r < R ? K - k : 0) : (k < K ? R - r : 0);
    const int bytes = left <= 0 ? 0 : left >= DOT_VEC ? 16 : (int)left * (int)sizeof(DOT_T);
    kiln_cp_async16(t + dot_at<KMAJOR ? ROWS : DOT_BK, COLS>(row, col), bytes ? p + r * s_r + k * s_k : p, bytes);
#else
    __align__(16) DOT_T v[DOT_VEC];
    for (int e = 0; e < DOT_VEC; ++e) {
      const i64 re = KMAJOR ? r : r + e, ke = KMAJOR ? k + e : k;
      v[e] = re < R && ke < K ? p[re * s_r + ke * s_k] : DOT_T{};
    }
    *(uint4*)(t + dot_at<KMAJOR ? ROWS : DOT_BK, COLS>(row, col)) = *(const uint4*)v;
#endif
  }
}
// A block's accumulator: each thread's part of its warp's (DOT_WM x DOT_WN) tile, as mma leaves
// it: in each 16 x 8 tile, rows lane/4 and lane/4 + 8, columns 2 (lane % 4) and the next.
struct dot_acc {
  float v[DOT_MT][DOT_NT][4];
  i64 m0, n0;  // the tile's first row and column of C
  KILN_FN dot_acc(i64 m, i64 n) : m0(m), n0(n) {
    for (int i = 0; i < DOT_MT; ++i)
      for (int j = 0; j < DOT_NT; ++j)
        for (int e = 0; e < 4; ++e) v[i][j][e] = 0.f;
  }
  // Row and column in the tile of value e of mma tile (i, j).
  KILN_FN int row(int i, int e) const { return (threadIdx.x / 32) / DOT_WARPS_N * DOT_WM + i * 16 + threadIdx.x % 32 / 4 + e / 2 * 8; }
  KILN_FN int col(int j, int e) const { return (threadIdx.x / 32) % DOT_WARPS_N * DOT_WN + j * 8 + threadIdx.x % 4 * 2 + e % 2; }
};
#if DOT_WGMMA
// Hopper: each warpgroup's 64 rows of the tile by wgmma m64nBNk16 (kiln_wgmma_dot, written by the
// kernel's source for BN and the operands' layouts), both operands read from shared memory through
// descriptors of the 128-byte swizzle. K-contiguous: 8-row groups 1024 bytes apart, a step of 16
// along K 32 bytes into the rows; M- or N-contiguous: panels of 64 columns, 16 rows of K a step
// (2048 bytes). The block's warps run along M only (DOT_WARPS_M = DOT_BM / 16), so a warpgroup's
// accumulator is dot_acc's v[0], 8 columns a group of 4, as mma leaves it.
// The warpgroup's accumulator as wgmma's fragment: dot_acc's v[0], all of it.
KILN_FN float (&dot_wgmma_acc(dot_acc& acc))[DOT_BN / 2] {
  return *reinterpret_cast<float (*)[DOT_BN / 2]>(&acc.v[0][0][0]);
}
// Issues (and commits) one step's products; dot() below waits for them.
KILN_FN void dot_issue(dot_acc& acc, const DOT_T* a, const DOT_T* b) {
  const u32 wg = threadIdx.x / 128, as = kiln_shared_address(a), bs = kiln_shared_address(b);
#if DOT_A_K
  const u64 ad = kiln_wgmma_desc(as + wg * 64 * 128, 16, 1024);
  constexpr u32 a_step = 32;
#else
  const u64 ad = kiln_wgmma_desc(as + wg * DOT_BK * 128, DOT_BK * 128, 1024);
  constexpr u32 a_step = 2048;
#endif
#if DOT_B_K
  const u64 bd = kiln_wgmma_desc(bs, 16, 1024);
  constexpr u32 b_step = 32;
#else
  const u64 bd = kiln_wgmma_desc(bs, DOT_BK * 128, 1024);
  constexpr u32 b_step = 2048;
#endif
  float (&d)[DOT_BN / 2] = dot_wgmma_acc(acc);
  kiln_wgmma_fence();
  KILN_UNROLL for (int kk = 0; kk < DOT_BK / 16; ++kk)
    kiln_wgmma_dot(d, ad + ((kk * a_step) >> 4), bd + ((kk * b_step) >> 4));
  kiln_wgmma_commit();
}
KILN_FN void dot(dot_acc& acc, const DOT_T* a, const DOT_T* b) {
  dot_issue(acc, a, b);
  // DOT_OVERLAP: this step's products stay in flight while the next step's are issued (the loop
  // then stages one step less ahead, so the buffer a pending product reads is not refilled).
  kiln_wgmma_wait<DOT_OVERLAP ? 1 : 0>();
  kiln_hold(dot_wgmma_acc(acc));
}
#if DOT_TMA
// One box of a 3-D tensor map ({inner, outer, batch}, boxes of 64 inner columns) at (c0, c1, c2)
// into shared memory at dst; its bytes land on `bar` (past the tensor's ends: zeros).
KILN_FN void dot_tma_box(u32 dst, const kiln_tensor_map& map, int c0, int c1, int c2, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
// The boxes a stage of rows [r0, r0 + ROWS) of an operand of R rows copies: a K-contiguous one's
// single box (rows past R come as zeros), an M- or N-contiguous one's 64-column panels that start
// before R (a panel wholly past R is not copied: the products it would feed are never stored).
template <int ROWS, bool KMAJOR>
KILN_FN int dot_tma_boxes(i64 r0, i64 R) {
  const i64 panels = (R - r0 + 63) / 64;
  return KMAJOR ? 1 : panels < ROWS / 64 ? (int)panels : ROWS / 64;
}
// The slice [r0, r0 + ROWS) x [k0, k0 + DOT_BK) of an operand of batch z into tile t (dot_stage's
// layout) in `boxes` boxes: a K-contiguous operand's map is {K, rows, batch} with boxes of 64 x
// ROWS, one box (ROWS * 128 bytes); an M- or N-contiguous one's {rows, K, batch} with boxes of 64 x
// DOT_BK, one a 64-column panel (DOT_BK * 128 bytes).
template <int ROWS, bool KMAJOR>
KILN_FN void dot_tma_stage(u32 t, const kiln_tensor_map& map, i64 r0, i64 k0, i64 z, int boxes, u32 bar) {
  if (KMAJOR) {
    dot_tma_box(t, map, (int)k0, (int)r0, (int)z, bar);
  } else {
    for (int p = 0; p < boxes; ++p) dot_tma_box(t + p * DOT_BK * 128, map, (int)r0 + p * 64, (int)k0, (int)z, bar);
  }
}
// acc += A[m0:, :] B[:, n0:] over the whole of K with TMA stages (sm_90a): the block's last
// warpgroup is the producer, whose first thread copies each step's A and B tiles by the copy
// engine into one of DOT_STAGES stages and expects their bytes on the stage's "full" mbarrier,
// after each consumer warp has arrived on its "empty" one (done with the stage's products); the
// two consumer warpgroups multiply by wgmma, a step's products in flight under the next's. No
// block barrier after the start. The producer gives its registers to the consumers (setmaxnreg 40
// and 232 a thread: one block an SM, 384 threads). Returns false in the producer, which holds no
// part of C. az, bz: the operands' batch coordinates in their maps (0 where broadcast); M, N: the
// operands' rows, past which an M- or N-contiguous operand's panels are not copied (their shared
// memory keeps an earlier step's values, which feed only products the epilogue does not store).
// shared: the stages' tiles from a 1024-byte boundary, then the 2 DOT_STAGES mbarriers.
KILN_FN bool dot_k_loop_tma(dot_acc& acc, unsigned char* shared, const kiln_tensor_map& a_map,
                            const kiln_tensor_map& b_map, i64 az, i64 bz, i64 M, i64 N, i64 K) {
  DOT_T* as = (DOT_T*)shared;
  DOT_T* bs = as + DOT_STAGES * DOT_BM * DOT_BK;
  const u32 bars = kiln_shared_address(bs + DOT_STAGES * DOT_BN * DOT_BK);
#define DOT_FULL(s) (bars + 8u * (u32)(s))
#define DOT_EMPTY(s) (bars + 8u * (u32)(DOT_STAGES + (s)))
  const int steps = (int)((K + DOT_BK - 1) / DOT_BK);
  constexpr int consumers = DOT_WARPS_M * 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < DOT_STAGES; ++s) kiln_mbar_init(DOT_FULL(s), 1), kiln_mbar_init(DOT_EMPTY(s), DOT_WARPS_M);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // (seen by the copy engine)
  }
  __syncthreads();
  if (threadIdx.x >= consumers) {  // ---- the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == consumers) {
      const int a_boxes = dot_tma_boxes<DOT_BM, DOT_A_K>(acc.m0, M), b_boxes = dot_tma_boxes<DOT_BN, DOT_B_K>(acc.n0, N);
      const u32 bytes = (DOT_A_K ? DOT_BM * 128 : a_boxes * DOT_BK * 128) + (DOT_B_K ? DOT_BN * 128 : b_boxes * DOT_BK * 128);
      for (int s = 0; s < steps; ++s) {
        const int buf = s % DOT_STAGES;
        if (s >= DOT_STAGES) kiln_mbar_wait(DOT_EMPTY(buf), (s / DOT_STAGES - 1) & 1);
        kiln_mbar_expect(DOT_FULL(buf), bytes);
        dot_tma_stage<DOT_BM, DOT_A_K>(kiln_shared_address(as + buf * DOT_BM * DOT_BK), a_map, acc.m0, (i64)s * DOT_BK,
                                       az, a_boxes, DOT_FULL(buf));
        dot_tma_stage<DOT_BN, DOT_B_K>(kiln_shared_address(bs + buf * DOT_BN * DOT_BK), b_map, acc.n0, (i64)s * DOT_BK,
                                       bz, b_boxes, DOT_FULL(buf));
      }
    }
    return false;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");  // ---- the consumers
  for (int s = 0; s < steps; ++s) {
    const int buf = s % DOT_STAGES;
    kiln_mbar_wait(DOT_FULL(buf), (s / DOT_STAGES) & 1);
    dot_issue(acc, as + buf * DOT_BM * DOT_BK, bs + buf * DOT_BN * DOT_BK);
    kiln_wgmma_wait<1>();  // step s - 1's products are done: its stage is free
    if (s > 0 && threadIdx.x % 32 == 0) kiln_mbar_arrive(DOT_EMPTY((s - 1) % DOT_STAGES));
  }
  kiln_wgmma_wait<0>();
  kiln_hold(dot_wgmma_acc(acc));
#undef DOT_FULL
#undef DOT_EMPTY
  return true;
}
#endif
#elif DOT_IS_16BIT
KILN_FN void dot_mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DOT_IS_BF16
  kiln_mma_16816_bf16(d, a, b0, b1);
#else
  kiln_mma_16816_f16(d, a, b0, b1);
#endif
}
// acc += a b for one stage's tiles (a: DOT_BM x DOT_BK of A, b: DOT_BK x DOT_BN of B).
KILN_FN void dot(dot_acc& acc, const DOT_T* a, const DOT_T* b) {
  const int lane = threadIdx.x % 32, wm = threadIdx.x / 32 / DOT_WARPS_N * DOT_WM, wn = threadIdx.x / 32 % DOT_WARPS_N * DOT_WN;
  KILN_UNROLL for (int kk = 0; kk < DOT_BK; kk += 16) {
    u32 af[DOT_MT][4], bf[DOT_NT][2];
    // ldmatrix.x4: lanes 8q..8q+7 give the rows of matrix q (see the fragment layouts of mma.m16n8k16).
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i) {
      const int m = wm + i * 16;
#if DOT_A_K
      kiln_ldmatrix_x4(af[i], a + dot_at<DOT_BM, DOT_BK>(m + lane % 8 + lane / 8 % 2 * 8, kk + lane / 16 * 8));
#else
      kiln_ldmatrix_x4_trans(af[i], a + dot_at<DOT_BK, DOT_BM>(kk + lane % 8 + lane / 16 * 8, m + lane / 8 % 2 * 8));
#endif
    }
    KILN_UNROLL for (int j = 0; j < DOT_NT; j += 2) {  // two 8-column tiles of B a load
      const int n = wn + j * 8;
      u32 r[4];
#if DOT_B_K
      kiln_ldmatrix_x4(r, b + dot_at<DOT_BN, DOT_BK>(n + lane % 8 + lane / 16 * 8, kk + lane / 8 % 2 * 8));
#else
      kiln_ldmatrix_x4_trans(r, b + dot_at<DOT_BK, DOT_BN>(kk + lane % 8 + lane / 8 % 2 * 8, n + lane / 16 * 8));
#endif
      bf[j][0] = r[0], bf[j][1] = r[1], bf[j + 1][0] = r[2], bf[j + 1][1] = r[3];
    }
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i)
      KILN_UNROLL for (int j = 0; j < DOT_NT; ++j) dot_mma(acc.v[i][j], af[i], bf[j][0], bf[j][1]);
  }
}
#else
// f32 operands: element (m, k) of A's tile and (k, n) of B's.
KILN_FN float dot_a(const float* a, int m, int k) {
#if DOT_A_K
  return a[dot_at<DOT_BM, DOT_BK>(m, k)];
#else
  return a[dot_at<DOT_BK, DOT_BM>(k, m)];
#endif
}
KILN_FN float dot_b(const float* b, int k, int n) {
#if DOT_B_K
  return b[dot_at<DOT_BN, DOT_BK>(n, k)];
#else
  return b[dot_at<DOT_BK, DOT_BN>(k, n)];
#endif
}
KILN_FN void dot(dot_acc& acc, const float* a, const float* b) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int wm = threadIdx.x / 32 / DOT_WARPS_N * DOT_WM, wn = threadIdx.x / 32 % DOT_WARPS_N * DOT_WN;
#if DOT_TF32
  // mma.m16n8k8 through TF32: a's fragment rows g, g + 8 at columns t, t + 4; b's rows t, t + 4 at column g.
  KILN_UNROLL for (int kk = 0; kk < DOT_BK; kk += 8) {
    u32 af[DOT_MT][4], bf[DOT_NT][2];
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i) {
      const int m = wm + i * 16 + g;
      const float x[4] = {dot_a(a, m, kk + t), dot_a(a, m + 8, kk + t), dot_a(a, m, kk + t + 4), dot_a(a, m + 8, kk + t + 4)};
      KILN_UNROLL for (int e = 0; e < 4; ++e) asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(af[i][e]) : "f"(x[e]));
    }
    KILN_UNROLL for (int j = 0; j < DOT_NT; ++j) {
      const int n = wn + j * 8 + g;
      asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(bf[j][0]) : "f"(dot_b(b, kk + t, n)));
      asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(bf[j][1]) : "f"(dot_b(b, kk + t + 4, n)));
    }
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i)
      KILN_UNROLL for (int j = 0; j < DOT_NT; ++j) {
        float (&d)[4] = acc.v[i][j];
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(af[i][0]), "r"(af[i][1]), "r"(af[i][2]), "r"(af[i][3]), "r"(bf[j][0]), "r"(bf[j][1]));
      }
  }
#else
  // FMA: each k an outer product of the thread's rows of A and columns of B.
  for (int k = 0; k < DOT_BK; ++k) {
    float am[DOT_MT][2], bn[DOT_NT][2];
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i) am[i][0] = dot_a(a, wm + i * 16 + g, k), am[i][1] = dot_a(a, wm + i * 16 + g + 8, k);
    KILN_UNROLL for (int j = 0; j < DOT_NT; ++j) bn[j][0] = dot_b(b, k, wn + j * 8 + 2 * t), bn[j][1] = dot_b(b, k, wn + j * 8 + 2 * t + 1);
    KILN_UNROLL for (int i = 0; i < DOT_MT; ++i)
      KILN_UNROLL for (int j = 0; j < DOT_NT; ++j)
        KILN_UNROLL for (int e = 0; e < 4; ++e) acc.v[i][j][e] = fmaf(am[i][e / 2], bn[j][e % 2], acc.v[i][j][e]);
  }
#endif
}
#endif
// acc += A[m0:, :] B[:, n0:] over the whole of K: tiles staged DOT_STAGES - 1 steps ahead of the
// product (cp.async groups; each stage's buffer written again only after the barrier that follows
// every warp's product of it). shared: the block's dynamic shared memory, DOT_STAGES A and B tiles
// from a 1024-byte boundary (where the 128-byte swizzle's pattern repeats: wgmma reads it from the
// address bits), plus 1024 bytes to reach it: codegen::GemmKernel::shared_bytes().
KILN_FN void dot_k_loop(dot_acc& acc, unsigned char* shared, const DOT_T* a, i64 sam, i64 sak, const DOT_T* b, i64 sbk,
                        i64 sbn, i64 M, i64 N, i64 K) {
  DOT_T* as = (DOT_T*)shared;
  DOT_T* bs = as + DOT_STAGES * DOT_BM * DOT_BK;
  const int steps = (int)((K + DOT_BK - 1) / DOT_BK);
  // B's slice [k0, k0 + BK) x [n0, n0 + BN) is X's rows n (stride sbn) and columns k (stride sbk).
  auto stage = [&](int s) {
    const int buf = s % DOT_STAGES;
    dot_stage<DOT_BM, DOT_A_K>(as + buf * DOT_BM * DOT_BK, a, sam, sak, acc.m0, (i64)s * DOT_BK, M, K);
    dot_stage<DOT_BN, DOT_B_K>(bs + buf * DOT_BN * DOT_BK, b, sbn, sbk, acc.n0, (i64)s * DOT_BK, N, K);
  };
  // Steps staged ahead of the product: all but one buffer, or all but two where a step's product
  // may still be reading its buffer after the next barrier (DOT_OVERLAP).
  constexpr int AHEAD = DOT_STAGES - 1 - (DOT_WGMMA && DOT_OVERLAP ? 1 : 0);
  KILN_UNROLL for (int s = 0; s < AHEAD; ++s) {
    if (s < steps) stage(s);
    kiln_cp_async_commit();
  }
  for (int s = 0; s < steps; ++s) {
    kiln_cp_async_wait<AHEAD - 1>();  // step s's copies are in
#if DOT_WGMMA
    kiln_fence_proxy_async();  // (the copies' writes, seen by wgmma's reads)
#endif
    __syncthreads();  // ... everyone's, and every product that read the buffer refilled next is done
    if (s + AHEAD < steps) stage(s + AHEAD);
    kiln_cp_async_commit();
    dot(acc, as + s % DOT_STAGES * DOT_BM * DOT_BK, bs + s % DOT_STAGES * DOT_BN * DOT_BK);
  }
#if DOT_WGMMA && DOT_OVERLAP
  kiln_wgmma_wait<0>();
  kiln_hold(dot_wgmma_acc(acc));
#endif
  kiln_cp_async_wait<0>();
}
}  // namespace kiln
// The program's batch and tile of C (GPU: blockIdx.x the tiles, grouped eight rows of tiles at a
// time so that a wave's tiles share A's and B's slices in L2, as Triton's GROUP_M; blockIdx.y the
// batch), and its shared memory (KILN_DOT_SHARED, on a 1024-byte boundary).
#define KILN_DOT_PROGRAM(bz, m0, n0)                                                                    \
  extern __shared__ __align__(1024) unsigned char kiln_dot_smem[];                                    \
  unsigned char* const kiln_dot_shared = kiln_dot_smem + (-kiln_shared_address(kiln_dot_smem) & 1023u); \
  const i64 kiln_tiles_m = (M + DOT_BM - 1) / DOT_BM, kiln_tiles_n = (N + DOT_BN - 1) / DOT_BN;        \
  const i64 kiln_group = (i64)blockIdx.x / (8 * kiln_tiles_n), kiln_first = kiln_group * 8;            \
  const i64 kiln_rows = kiln_tiles_m - kiln_first < 8 ? kiln_tiles_m - kiln_first : 8;                 \
  const i64 bz = blockIdx.y, m0 = (kiln_first + (i64)blockIdx.x % kiln_rows) * DOT_BM,                 \
            n0 = (i64)blockIdx.x % (8 * kiln_tiles_n) / kiln_rows * DOT_BN
#define KILN_DOT_SHARED kiln_dot_shared
// Each value of C this thread holds, inside C: its row m, column n and value x (the epilogue's loop).
#define KILN_DOT_ELEMENTS(acc, m, n, x)                                                         \
  KILN_UNROLL for (int kiln_i = 0; kiln_i < DOT_MT; ++kiln_i)                                   \
    KILN_UNROLL for (int kiln_j = 0; kiln_j < DOT_NT; ++kiln_j)                                 \
      KILN_UNROLL for (int kiln_e = 0; kiln_e < 4; ++kiln_e)                                    \
        if (const i64 m = (acc).m0 + (acc).row(kiln_i, kiln_e), n = (acc).n0 + (acc).col(kiln_j, kiln_e); m < M && n < N) \
          if (const float x = (acc).v[kiln_i][kiln_j][kiln_e]; true)
#else
// The CPU: a program's tile is an array, staged in f32.
namespace kiln {
struct dot_acc {
  float v[DOT_BM][DOT_BN];
  i64 m0, n0;
  dot_acc(i64 m, i64 n) : m0(m), n0(n) {
    for (int r = 0; r < DOT_BM; ++r)
      for (int c = 0; c < DOT_BN; ++c) v[r][c] = 0.f;
  }
};
inline void dot_k_loop(dot_acc& acc, unsigned char*, const DOT_T* a, i64 sam, i64 sak, const DOT_T* b, i64 sbk, i64 sbn,
                       i64 M, i64 N, i64 K) {
  static thread_local float at[DOT_BM][DOT_BK], bt[DOT_BK][DOT_BN];
  const i64 rows = M - acc.m0 < DOT_BM ? M - acc.m0 : DOT_BM, cols = N - acc.n0 < DOT_BN ? N - acc.n0 : DOT_BN;
  for (i64 k0 = 0; k0 < K; k0 += DOT_BK) {
    const int ks = (int)(K - k0 < DOT_BK ? K - k0 : DOT_BK);
    for (int r = 0; r < DOT_BM; ++r)
      for (int k = 0; k < DOT_BK; ++k)
        at[r][k] = r < rows && k < ks ? (float)to_compute(a[(acc.m0 + r) * sam + (k0 + k) * sak]) : 0.f;
    for (int k = 0; k < DOT_BK; ++k)
      for (int c = 0; c < DOT_BN; ++c)
        bt[k][c] = c < cols && k < ks ? (float)to_compute(b[(k0 + k) * sbk + (acc.n0 + c) * sbn]) : 0.f;
    for (int r = 0; r < DOT_BM; ++r)
      for (int k = 0; k < DOT_BK; ++k) {
        const float x = at[r][k];
        for (int c = 0; c < DOT_BN; ++c) acc.v[r][c] += x * bt[k][c];
      }
  }
}
}  // namespace kiln
// kiln_pid: the batch, then the tiles of C row by row.
#define KILN_DOT_PROGRAM(bz, m0, n0)                                                             \
  const i64 kiln_tiles_m = (M + DOT_BM - 1) / DOT_BM, kiln_tiles_n = (N + DOT_BN - 1) / DOT_BN; \
  const i64 bz = kiln_pid / (kiln_tiles_m * kiln_tiles_n),                                     \
            m0 = kiln_pid % (kiln_tiles_m * kiln_tiles_n) / kiln_tiles_n * DOT_BM,            \
            n0 = kiln_pid % kiln_tiles_n * DOT_BN
#define KILN_DOT_SHARED nullptr
#define KILN_DOT_ELEMENTS(acc, m, n, x)                                                          \
  for (int kiln_r = 0; kiln_r < DOT_BM; ++kiln_r)                                                \
    for (int kiln_c = 0; kiln_c < DOT_BN; ++kiln_c)                                              \
      if (const i64 m = (acc).m0 + kiln_r, n = (acc).n0 + kiln_c; m < M && n < N)                \
        if (const float x = (acc).v[kiln_r][kiln_c]; true)
#endif
)KILN";

}  // namespace kiln::codegen
