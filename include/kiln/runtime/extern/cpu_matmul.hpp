// Matrix multiplication on the host: a blocked, packed GEMM for [M,K] x [K,N] and batched
// [B,M,K] x [B,K,N] (a 2-D operand broadcasts over the other's batch). Operands may have any
// strides (a transposed weight is the common case) and any floating dtype; the product is computed
// in f64 when either operand is f64, else in f32, and rounded once into the output's dtype.
//
// Scheme (GotoBLAS-style): the whole of b is packed once into NR-wide column panels of the compute
// type; each task (batch, MC rows, NC columns) packs its rows of a into MR-high row panels per KC
// slice of K and runs an MR x NR register-blocked micro-kernel into a compute-type accumulator
// block, which is rounded into the output once at the end. Tasks run on the kernels' OpenMP team
// (host_parallel.hpp) for large problems, else serially.
//
// Parts: matmul_geometry.hpp (the checked shapes), cpu_gemm_kernel.hpp (packing and the
// micro-kernel); here the threading, the blocked driver and cpu_matmul itself. Where a real BLAS is
// found at run time (cpu_blas.hpp: OpenBLAS, BLIS or MKL; KILN_BLAS chooses) and the product is
// f32 or f64 throughout, it computes the product instead.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../../core/config.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "cpu_blas.hpp"
#include "cpu_gemm_kernel.hpp"
#include "host_parallel.hpp"
#include "matmul_geometry.hpp"

namespace kiln::runtime {

namespace mm_detail {

using host_parallel::thread_count;

template <class T>
void gemm(const MatmulGeometry& g, const void* a, dtype ad, const void* b, dtype bd, void* out, dtype od) {
  constexpr std::int64_t nr = NR<T>;
  const std::int64_t B = g.batch, M = g.M, N = g.N, K = g.K;
  const std::int64_t n_panels = (N + nr - 1) / nr;
  const std::int64_t b_batches = g.b_bs == 0 ? 1 : B;
  const std::size_t ia = itemsize(ad), ib = itemsize(bd), io = itemsize(od);
  const PackAFn<T> pack_a = pack_a_for<T>(ad);
  const PackBFn<T> pack_b = pack_b_for<T>(bd);
  const StoreFn<T> store_out = store_for<T>(od);
  const double flops =
      2.0 * static_cast<double>(B) * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);

  // 1. All of b (once per distinct batch), packed into NR-wide panels: [batch][panel][K][NR].
  const std::int64_t panel_size = K * nr;
  Buffer<T> packed_b(b_batches * n_panels * panel_size);
  {
    const std::int64_t tasks = b_batches * n_panels;
    const int threads =
        thread_count(tasks, static_cast<double>(b_batches) * static_cast<double>(K) * static_cast<double>(N) * 8.0);
    host_parallel::run(threads, [&](std::atomic<std::int64_t>& next) {
      for (std::int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
        const std::int64_t bi = t / n_panels, q = t % n_panels;
        const char* src = static_cast<const char*>(b) + static_cast<std::int64_t>(ib) * bi * g.b_bs;
        pack_b(src, g.b_sk, g.b_sn, K, N, q, packed_b.get() + t * panel_size);
      }
    });
  }

  // 2. Tasks of MC rows x NC columns of one batch.
  const std::int64_t m_blocks = (M + MC - 1) / MC, n_blocks = (N + NC - 1) / NC;
  const std::int64_t tasks = B * m_blocks * n_blocks;
  const int threads = thread_count(tasks, flops);
  host_parallel::run(threads, [&](std::atomic<std::int64_t>& next) {
    Buffer<T> a_block(MC * std::min(KC, std::max<std::int64_t>(K, 1)));
    Buffer<T> acc(MC * NC);
    for (std::int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const std::int64_t bi = t / (m_blocks * n_blocks), rest = t % (m_blocks * n_blocks);
      const std::int64_t m0 = rest / n_blocks * MC, n0 = rest % n_blocks * NC;
      const std::int64_t mc = std::min(MC, M - m0), nc = std::min(NC, N - n0);
      const std::int64_t mp = (mc + MR - 1) / MR, np = (nc + nr - 1) / nr;
      for (std::int64_t i = 0; i < mp * MR; ++i) std::fill_n(acc.get() + i * NC, np * nr, T(0));
      const char* a_base = static_cast<const char*>(a) + static_cast<std::int64_t>(ia) * bi * g.a_bs;
      const T* b_base = packed_b.get() + (g.b_bs == 0 ? 0 : bi) * n_panels * panel_size + (n0 / nr) * panel_size;
      for (std::int64_t k0 = 0; k0 < K; k0 += KC) {
        const std::int64_t kc = std::min(KC, K - k0);
        pack_a(a_base, g.a_sm, g.a_sk, m0, mc, k0, kc, a_block.get());
        for (std::int64_t q = 0; q < np; ++q) {
          const T* bp = b_base + q * panel_size + k0 * nr;
          for (std::int64_t p = 0; p < mp; ++p)
            micro_kernel<T>(kc, a_block.get() + p * MR * kc, bp, acc.get() + p * MR * NC + q * nr, NC);
        }
      }
      char* dst = static_cast<char*>(out) + static_cast<std::int64_t>(io) * (bi * g.o_bs + m0 * g.o_sm + n0 * g.o_sn);
      store_out(acc.get(), NC, mc, nc, dst, g.o_sm, g.o_sn);
    }
  });
}

}  // namespace mm_detail

// out = a @ b on the host. a: [M,K] or [B,M,K]; b: [K,N] or [B,K,N] (a 2-D operand, or a batch of
// 1, broadcasts over the other's batch); out: [M,N], or [B,M,N] when either operand is 3-D, already
// allocated (any strides; contiguous is fastest) with a floating dtype. a and b may have any strides
// and dtypes f64/f32/f16/bf16; the product accumulates in f64 if either is f64, else in f32, and is
// rounded once into out. out must not overlap a or b.
inline void cpu_matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  MatmulGeometry g = matmul_geometry(a, b, out, "matmul");
  for (const Tensor* t : {&a, &b, &out})
    if (!t->device().is_cpu())
      throw device_error("matmul: cpu_matmul needs host tensors, got " + a.device().str() + " x " + b.device().str() +
                         " into " + out.device().str());
  if (g.batch == 0 || g.M == 0 || g.N == 0) return;
  const void* pa = a.data_ptr();
  const void* pb = b.data_ptr();
  dtype da = a.dtype(), db = b.dtype();
  if (blas_matmul(g, pa, da, pb, db, out.data_ptr(), out.dtype())) return;  // a real BLAS, where one is found
  // Few rows against a wide b (a small batch through a linear layer): packing all of b into a
  // buffer would cost more than the product, so compute out^T = b^T a^T, which streams b through
  // the cache-sized blocks of the left operand instead.
  const std::int64_t rows_sharing_b = g.b_bs == 0 ? g.batch * g.M : g.M;
  if (rows_sharing_b < 64 && g.N > 2 * g.M) {
    std::swap(g.M, g.N);
    std::swap(pa, pb);
    std::swap(da, db);
    std::swap(g.a_bs, g.b_bs);
    const std::int64_t a_sm = g.a_sm, a_sk = g.a_sk;
    g.a_sm = g.b_sn, g.a_sk = g.b_sk;
    g.b_sk = a_sk, g.b_sn = a_sm;
    std::swap(g.o_sm, g.o_sn);
  }
  if (da == dtype::f64 || db == dtype::f64)
    mm_detail::gemm<double>(g, pa, da, pb, db, out.data_ptr(), out.dtype());
  else
    mm_detail::gemm<float>(g, pa, da, pb, db, out.data_ptr(), out.dtype());
}

}  // namespace kiln::runtime
