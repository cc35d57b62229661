// Layout planning for cuda_matmul: how row-major operands, strides and batches map onto one
// strided-batched call of column-major cuBLASLt. Pure arithmetic on a MatmulGeometry: needs no GPU.
#pragma once
#include <algorithm>
#include <cstdint>

#include "matmul_geometry.hpp"

namespace kiln::runtime {
namespace cuda_mm_detail {

// How a row-major-view R x C matrix with strides (sr, sc) reads in cuBLAS's column-major view:
// stored row-major, the memory is the column-major C x R matrix X^T (op N); stored column-major,
// it is X itself, R x C (op T), which cuBLAS transposes. ok = false: neither, copy it first.
struct OperandLayout {
  bool ok = false;
  bool transpose = false;  // op T
  std::int64_t rows = 0, cols = 0, ld = 0;
};

inline OperandLayout classify(std::int64_t R, std::int64_t C, std::int64_t sr, std::int64_t sc) {
  const std::int64_t r1 = std::max<std::int64_t>(R, 1), c1 = std::max<std::int64_t>(C, 1);
  if ((sc == 1 || C == 1) && (R == 1 || sr >= c1)) return {true, false, C, R, R == 1 ? c1 : sr};
  if ((sr == 1 || R == 1) && (C == 1 || sc >= r1)) return {true, true, R, C, C == 1 ? r1 : sc};
  return {};
}

}  // namespace cuda_mm_detail

// How one matmul maps onto a single strided-batched cuBLASLt call: cuBLAS's D (m x n, column-major,
// m = N, n = M) = op_a(A) (m x k) * op_b(B) (k x n), where A is kiln's b and B is kiln's a.
// Pure host logic, so tests can check it against a host emulation of cuBLAS's semantics.
struct GemmPlan {
  bool copy_a = false, copy_b = false;    // kiln's a / b go through a contiguous copy first
  bool direct = true;                     // cuBLAS writes kiln's out in place (else a contiguous temporary)
  bool trans_a = false, trans_b = false;  // op T for cuBLAS's A (from b) / B (from a)
  std::int64_t m = 0, n = 0, k = 0;
  std::int64_t rows_a = 0, cols_a = 0, lda = 0;  // cuBLAS's A as stored
  std::int64_t rows_b = 0, cols_b = 0, ldb = 0;  // cuBLAS's B as stored
  std::int64_t ldd = 0;
  std::int64_t batch = 1, stride_a = 0, stride_b = 0, stride_d = 0;
};

// g describes the operands as given (K > 0); a_ok / b_ok say whether their dtypes can be used as
// they are, out_ok whether out's dtype is the one cuBLAS will write.
inline GemmPlan plan_gemm(MatmulGeometry g, bool a_ok, bool b_ok, bool out_ok) {
  using namespace cuda_mm_detail;
  GemmPlan p;
  OperandLayout la = classify(g.M, g.K, g.a_sm, g.a_sk);
  if (!la.ok || !a_ok) {
    p.copy_a = true;
    g.a_sm = g.K, g.a_sk = 1;
    g.a_bs = g.a_bs == 0 ? 0 : g.M * g.K;
    la = classify(g.M, g.K, g.a_sm, g.a_sk);
  }
  OperandLayout lb = classify(g.K, g.N, g.b_sk, g.b_sn);
  if (!lb.ok || !b_ok) {
    p.copy_b = true;
    g.b_sk = g.N, g.b_sn = 1;
    g.b_bs = g.b_bs == 0 ? 0 : g.K * g.N;
    lb = classify(g.K, g.N, g.b_sk, g.b_sn);
  }
  p.direct = out_ok && (g.o_sn == 1 || g.N == 1) && (g.M == 1 || g.o_sm >= g.N);
  p.ldd = p.direct ? (g.M == 1 ? std::max<std::int64_t>(g.N, 1) : g.o_sm) : g.N;
  p.stride_d = p.direct ? g.o_bs : g.M * g.N;
  p.batch = g.batch;
  std::int64_t M = g.M;
  // A 2-D b under a batch of row-major a whose batches (and out's) lie back to back: one GEMM of
  // batch * M rows.
  if (p.batch > 1 && g.b_bs == 0 && g.a_bs != 0 && !la.transpose && g.a_bs == g.M * la.ld &&
      p.stride_d == g.M * p.ldd) {
    M = p.batch * g.M;
    p.batch = 1;
    la.cols = M;
  }
  p.trans_a = lb.transpose, p.rows_a = lb.rows, p.cols_a = lb.cols, p.lda = lb.ld;
  p.trans_b = la.transpose, p.rows_b = la.rows, p.cols_b = la.cols, p.ldb = la.ld;
  p.m = g.N, p.n = M, p.k = g.K;
  p.stride_a = g.b_bs, p.stride_b = g.a_bs;
  return p;
}

// 16-bit GEMMs reach cuBLASLt's tensor-core kernels only when m, n and k are multiples of 8 and
// every leading dimension is 16-byte aligned: GPT-2's vocabulary of 50257 as n or k ran the lm_head
// GEMMs at 94-145 TFLOP/s on an H200, 640-750 once padded to 50264 (torch's cuBLAS alike; padding
// only the leading dimension left n = 50257 as slow). Such a GEMM may run on zero-padded copies of
// its operands into a padded output whose block is then copied back, as Inductor's pad_mm pads:
// each copy costs a pass over its matrix. Worth it when the product's flops per copied byte exceed
// what the fast kernels run per byte of bandwidth over the speedup less one: ~700 TFLOP/s over
// ~3.5 TB/s (H100/H200 alike; A100 ~250 over 1.8) is ~150-200 flop/byte, over the measured ~5x less
// one, 40-50 flop/byte; taken as 64 so that a doubtful case stays unpadded. GPT-2's three lm_head
// GEMMs have 350-380.
// A matrix's storage may already have that room, zeroed (schedule/pad_buffers.hpp plans it for
// intermediates): then the padded problem reads or writes it in place, with no copy.
struct GemmPadding {
  bool pad = false;                                             // run on padded copies
  bool a = false, b = false, d = false;                         // which of cuBLAS's A, B, D go through a padded buffer
  bool in_a = false, in_b = false, in_d = false;                // ... and which of those are padded in their own room
  std::int64_t m = 0, n = 0, k = 0;                             // the padded sizes (multiples of 8 where padded)
  std::int64_t rows_a = 0, cols_a = 0, rows_b = 0, cols_b = 0;  // the padded operands as stored (ld = rows)
};

inline constexpr double gemm_pad_min_flops_per_byte = 64;
// And only a product that the slow kernels leave compute-bound: below ~100 TFLOP/s over ~3.5 TB/s,
// about 30 flops per byte of its own operands and output, it waits on memory whatever kernel runs
// it (a matrix-vector product: 1 flop a byte), and padding could only add copies.
inline constexpr double gemm_pad_min_intensity = 32;

// The storage of cuBLAS's A, B (rows x cols as stored) and D (m x n) where it has room, else 0.
struct GemmRoom {
  std::int64_t rows_a = 0, cols_a = 0, rows_b = 0, cols_b = 0, m = 0, n = 0;
};

// ab / d: the item sizes of the operands and of the output cuBLAS writes. Only single 16-bit GEMMs
// (batch 1) are padded.
inline GemmPadding plan_padding(const GemmPlan& p, std::int64_t ab, std::int64_t d, const GemmRoom& room = {}) {
  GemmPadding r;
  if (ab != 2 || p.batch != 1 || p.m <= 0 || p.n <= 0 || p.k <= 0) return r;
  auto up = [](std::int64_t x) { return (x + 7) / 8 * 8; };
  auto aligned = [](std::int64_t ld, std::int64_t size) { return ld * size % 16 == 0; };
  r.m = up(p.m), r.n = up(p.n), r.k = up(p.k);
  r.rows_a = p.trans_a ? r.k : r.m, r.cols_a = p.trans_a ? r.m : r.k;
  r.rows_b = p.trans_b ? r.n : r.k, r.cols_b = p.trans_b ? r.k : r.n;
  r.a = r.rows_a != p.rows_a || r.cols_a != p.cols_a || !aligned(p.lda, ab);
  r.b = r.rows_b != p.rows_b || r.cols_b != p.cols_b || !aligned(p.ldb, ab);
  r.d = r.m != p.m || r.n != p.n || !aligned(p.ldd, d);
  if (!r.a && !r.b && !r.d) return r;
  r.in_a = r.a && room.rows_a >= r.rows_a && room.cols_a >= r.cols_a && aligned(p.lda, ab);
  r.in_b = r.b && room.rows_b >= r.rows_b && room.cols_b >= r.cols_b && aligned(p.ldb, ab);
  r.in_d = r.d && room.m >= r.m && room.n >= r.n && aligned(p.ldd, d);
  double bytes = 0;  // each copy reads its source and writes its destination
  if (r.a && !r.in_a) bytes += static_cast<double>(p.rows_a * p.cols_a + r.rows_a * r.cols_a) * static_cast<double>(ab);
  if (r.b && !r.in_b) bytes += static_cast<double>(p.rows_b * p.cols_b + r.rows_b * r.cols_b) * static_cast<double>(ab);
  if (r.d && !r.in_d) bytes += 2.0 * static_cast<double>(p.m * p.n) * static_cast<double>(d);
  const double flops = 2.0 * static_cast<double>(p.m) * static_cast<double>(p.n) * static_cast<double>(p.k);
  const double own = static_cast<double>(p.m * p.k + p.k * p.n) * static_cast<double>(ab) +
                     static_cast<double>(p.m * p.n) * static_cast<double>(d);
  r.pad = flops >= gemm_pad_min_flops_per_byte * bytes && flops >= gemm_pad_min_intensity * own;
  return r;
}

}  // namespace kiln::runtime
