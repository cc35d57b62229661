// Matrix multiplication on the host: a blocked, packed GEMM for [M,K] x [K,N] and batched
// [B,M,K] x [B,K,N] (a 2-D operand broadcasts over the other's batch). Operands may have any
// strides (a transposed weight is the common case) and any floating dtype; the product is computed
// in f64 when either operand is f64, else in f32, and rounded once into the output's dtype.
//
// Scheme (GotoBLAS-style): the whole of b is packed once into NR-wide column panels of the compute
// type; each task (batch, MC rows, NC columns) packs its rows of a into MR-high row panels per KC
// slice of K and runs an MR x NR register-blocked micro-kernel into a compute-type accumulator
// block, which is rounded into the output once at the end. Tasks run on OpenMP when it is enabled,
// else on std::threads for large problems, else serially.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../../core/config.hpp"
#include "../../core/dtype.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"

// GNU vector extensions give explicit SIMD at every optimisation level; other compilers (and
// nvcc's front end, to be safe) get a plain loop that an optimiser may vectorise.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define KILN_MM_GNU_VECTORS 1
#if defined(__AVX512F__)
#define KILN_MM_VECTOR_BYTES 64
#elif defined(__AVX__)
#define KILN_MM_VECTOR_BYTES 32
#else
#define KILN_MM_VECTOR_BYTES 16
#endif
#else
#define KILN_MM_GNU_VECTORS 0
#endif

#if defined(__GNUC__) && !defined(__clang__)
#define KILN_MM_UNROLL _Pragma("GCC unroll 16")
#elif defined(__clang__)
#define KILN_MM_UNROLL _Pragma("unroll")
#else
#define KILN_MM_UNROLL
#endif

namespace kiln::runtime {

// The sizes of one matmul after broadcasting, and where its operands and output lie.
struct MatmulGeometry {
  std::int64_t batch = 1, M = 0, N = 0, K = 0;
  // Element strides: per batch (0 for a broadcast operand), per row and per column.
  std::int64_t a_bs = 0, a_sm = 0, a_sk = 0;
  std::int64_t b_bs = 0, b_sk = 0, b_sn = 0;
  std::int64_t o_bs = 0, o_sm = 0, o_sn = 0;
  bool batched = false;  // either operand is 3-D, so the output is [batch, M, N]
};

namespace mm_detail {

inline std::string shapes_of(const Tensor& a, const Tensor& b) {
  return a.shape().str() + " (" + std::string(name(a.dtype())) + ") and " + b.shape().str() + " (" +
         std::string(name(b.dtype())) + ")";
}

}  // namespace mm_detail

// Checks shapes and dtypes (kiln::shape_error / dtype_error naming them) and describes the product.
inline MatmulGeometry matmul_geometry(const Tensor& a, const Tensor& b, const Tensor& out, const char* op) {
  const std::string what = std::string(op) + ": ";
  if (!a.defined() || !b.defined() || !out.defined())
    throw shape_error(what + "an operand or the output is an undefined tensor");
  if (a.dim() < 2 || a.dim() > 3 || b.dim() < 2 || b.dim() > 3)
    throw shape_error(what + "operands must be 2-D or 3-D (batched), got " + mm_detail::shapes_of(a, b));
  for (const Tensor* t : {&a, &b, &out})
    if (!is_floating(t->dtype()))
      throw dtype_error(what + "supports f64, f32, f16 and bf16 only, got " + mm_detail::shapes_of(a, b) + " into " +
                        std::string(name(out.dtype())));
  MatmulGeometry g;
  const int ad = a.dim(), bd = b.dim();
  g.M = a.shape()[ad - 2];
  g.K = a.shape()[ad - 1];
  g.N = b.shape()[bd - 1];
  if (b.shape()[bd - 2] != g.K)
    throw shape_error(what + "cannot multiply " + mm_detail::shapes_of(a, b) + ": the inner dimensions " +
                      std::to_string(g.K) + " and " + std::to_string(b.shape()[bd - 2]) + " differ");
  g.a_sm = a.strides()[ad - 2];
  g.a_sk = a.strides()[ad - 1];
  g.b_sk = b.strides()[bd - 2];
  g.b_sn = b.strides()[bd - 1];
  const std::int64_t ab = ad == 3 ? a.shape()[0] : 1, bb = bd == 3 ? b.shape()[0] : 1;
  g.batched = ad == 3 || bd == 3;
  if (ab != bb && ab != 1 && bb != 1)
    throw shape_error(what + "cannot multiply " + mm_detail::shapes_of(a, b) + ": batch sizes " + std::to_string(ab) +
                      " and " + std::to_string(bb) + " do not broadcast");
  g.batch = std::max(ab, bb);
  if (ab == 0 || bb == 0) g.batch = 0;
  g.a_bs = ad == 3 && ab != 1 ? a.strides()[0] : 0;
  g.b_bs = bd == 3 && bb != 1 ? b.strides()[0] : 0;
  Dims expect = g.batched ? Dims{g.batch, g.M, g.N} : Dims{g.M, g.N};
  if (!(out.shape() == expect))
    throw shape_error(what + "the output of " + mm_detail::shapes_of(a, b) + " must have shape " + expect.str() +
                      ", got " + out.shape().str());
  const int od = out.dim();
  g.o_bs = g.batched ? out.strides()[0] : 0;
  g.o_sm = out.strides()[od - 2];
  g.o_sn = out.strides()[od - 1];
  return g;
}

namespace mm_detail {

// Blocking: MC rows of a and NC columns of b per task, KC of K per packed slice; the micro-kernel
// computes an MR x NR tile held in registers.
inline constexpr std::int64_t MR = 6;
inline constexpr std::int64_t MC = 72;  // a multiple of MR
inline constexpr std::int64_t NC = 256;
inline constexpr std::int64_t KC = 256;
inline constexpr int NV = 2;  // vectors per micro-tile row

#if KILN_MM_GNU_VECTORS
template <class T>
struct simd;
template <>
struct simd<float> {
  typedef float V __attribute__((vector_size(KILN_MM_VECTOR_BYTES)));
};
template <>
struct simd<double> {
  typedef double V __attribute__((vector_size(KILN_MM_VECTOR_BYTES)));
};
template <class T>
inline constexpr std::int64_t lanes = KILN_MM_VECTOR_BYTES / sizeof(T);
#else
template <class T>
inline constexpr std::int64_t lanes = 16 / sizeof(T);
#endif
template <class T>
inline constexpr std::int64_t NR = NV* lanes<T>;  // divides NC

// C[MR x NR] (row stride ldc) += A_panel[kc x MR] * B_panel[kc x NR], both packed k-major.
template <class T>
inline void micro_kernel(std::int64_t kc, const T* __restrict A, const T* __restrict B, T* __restrict C,
                         std::int64_t ldc) {
  constexpr std::int64_t nr = NR<T>;
#if KILN_MM_GNU_VECTORS
  using V = typename simd<T>::V;
  constexpr std::int64_t W = lanes<T>;
  V acc[MR][NV];
  KILN_MM_UNROLL
  for (int i = 0; i < MR; ++i) KILN_MM_UNROLL
  for (int v = 0; v < NV; ++v) std::memcpy(&acc[i][v], C + i * ldc + v * W, sizeof(V));
  for (std::int64_t k = 0; k < kc; ++k) {
    V bv[NV];
    KILN_MM_UNROLL
    for (int v = 0; v < NV; ++v) std::memcpy(&bv[v], B + k * nr + v * W, sizeof(V));
    const T* ak = A + k * MR;
    KILN_MM_UNROLL
    for (int i = 0; i < MR; ++i) {
      const T ai = ak[i];
      KILN_MM_UNROLL
      for (int v = 0; v < NV; ++v) acc[i][v] += ai * bv[v];
    }
  }
  KILN_MM_UNROLL
  for (int i = 0; i < MR; ++i) KILN_MM_UNROLL
  for (int v = 0; v < NV; ++v) std::memcpy(C + i * ldc + v * W, &acc[i][v], sizeof(V));
#else
  T acc[MR][nr];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) acc[i][j] = C[i * ldc + j];
  for (std::int64_t k = 0; k < kc; ++k) {
    const T* bk = B + k * nr;
    const T* ak = A + k * MR;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < nr; ++j) acc[i][j] += ak[i] * bk[j];
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < nr; ++j) C[i * ldc + j] = acc[i][j];
#endif
}

// A 64-byte aligned scratch array.
template <class T>
struct Buffer {
  struct Free {
    void operator()(T* p) const noexcept { std::free(p); }
  };
  std::unique_ptr<T[], Free> data;
  explicit Buffer(std::int64_t n) {
    std::size_t bytes = (static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
    T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (!p) throw std::bad_alloc();
    data.reset(p);
  }
  T* get() const { return data.get(); }
};

// One element of storage type S read as the compute type T.
template <class T, class S>
inline T load(const S* p, std::int64_t i) {
  if constexpr (std::is_same_v<S, half> || std::is_same_v<S, bfloat16>)
    return static_cast<T>(static_cast<float>(p[i]));
  else
    return static_cast<T>(p[i]);
}

// The same written back, rounded once (f16/bf16 from f32; from f64 via f32).
template <class T, class S>
inline void store(S* p, std::int64_t i, T v) {
  if constexpr (std::is_same_v<S, half> || std::is_same_v<S, bfloat16>)
    p[i] = S(static_cast<float>(v));
  else
    p[i] = static_cast<S>(v);
}

template <class S>
inline constexpr bool floating_storage =
    std::is_same_v<S, float> || std::is_same_v<S, double> || std::is_same_v<S, half> || std::is_same_v<S, bfloat16>;

// Packs columns [q*NR, q*NR + NR) of the K x N matrix at src (strides sk, sn) into dst as [K][NR],
// zero beyond N.
template <class T, class S>
void pack_b_panel(const void* src_v, std::int64_t sk, std::int64_t sn, std::int64_t K, std::int64_t N, std::int64_t q,
                  T* dst) {
  const S* src = static_cast<const S*>(src_v);
  constexpr std::int64_t nr = NR<T>;
  const std::int64_t n0 = q * nr, w = std::min(nr, N - n0);
  for (std::int64_t k = 0; k < K; ++k) {
    T* d = dst + k * nr;
    const S* s = src + k * sk + n0 * sn;
    if (sn == 1)
      for (std::int64_t j = 0; j < w; ++j) d[j] = load<T>(s, j);
    else
      for (std::int64_t j = 0; j < w; ++j) d[j] = load<T>(s, j * sn);
    for (std::int64_t j = w; j < nr; ++j) d[j] = T(0);
  }
}

// Packs rows [m0, m0 + mc) x columns [k0, k0 + kc) of the matrix at src (strides sm, sk) into
// MR-high panels, each [kc][MR], zero beyond mc.
template <class T, class S>
void pack_a_block(const void* src_v, std::int64_t sm, std::int64_t sk, std::int64_t m0, std::int64_t mc,
                  std::int64_t k0, std::int64_t kc, T* dst) {
  const S* src = static_cast<const S*>(src_v);
  for (std::int64_t p = 0; p * MR < mc; ++p) {
    T* panel = dst + p * MR * kc;
    const std::int64_t rows = std::min(MR, mc - p * MR);
    const S* base = src + (m0 + p * MR) * sm + k0 * sk;
    if (sk == 1 && rows == MR) {
      // Row-major a: walk each row contiguously.
      for (std::int64_t i = 0; i < MR; ++i) {
        const S* row = base + i * sm;
        for (std::int64_t k = 0; k < kc; ++k) panel[k * MR + i] = load<T>(row, k);
      }
    } else {
      for (std::int64_t k = 0; k < kc; ++k) {
        T* d = panel + k * MR;
        const S* col = base + k * sk;
        for (std::int64_t i = 0; i < rows; ++i) d[i] = load<T>(col, i * sm);
        for (std::int64_t i = rows; i < MR; ++i) d[i] = T(0);
      }
    }
  }
}

// Rounds an mc x nc accumulator block (row stride ldc) into the output at dst (strides sm, sn).
template <class T, class S>
void store_block(const T* acc, std::int64_t ldc, std::int64_t mc, std::int64_t nc, void* dst_v, std::int64_t sm,
                 std::int64_t sn) {
  S* dst = static_cast<S*>(dst_v);
  for (std::int64_t i = 0; i < mc; ++i) {
    S* row = dst + i * sm;
    const T* c = acc + i * ldc;
    if (sn == 1)
      for (std::int64_t j = 0; j < nc; ++j) store<T>(row, j, c[j]);
    else
      for (std::int64_t j = 0; j < nc; ++j) store<T>(row, j * sn, c[j]);
  }
}

template <class T>
using PackBFn = void (*)(const void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, T*);
template <class T>
using PackAFn = void (*)(const void*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t,
                         std::int64_t, T*);
template <class T>
using StoreFn = void (*)(const T*, std::int64_t, std::int64_t, std::int64_t, void*, std::int64_t, std::int64_t);

template <class T>
PackBFn<T> pack_b_for(dtype d) {
  return visit_dtype(d, [](auto s) -> PackBFn<T> {
    using S = decltype(s);
    if constexpr (floating_storage<S>)
      return &pack_b_panel<T, S>;
    else
      return nullptr;
  });
}
template <class T>
PackAFn<T> pack_a_for(dtype d) {
  return visit_dtype(d, [](auto s) -> PackAFn<T> {
    using S = decltype(s);
    if constexpr (floating_storage<S>)
      return &pack_a_block<T, S>;
    else
      return nullptr;
  });
}
template <class T>
StoreFn<T> store_for(dtype d) {
  return visit_dtype(d, [](auto s) -> StoreFn<T> {
    using S = decltype(s);
    if constexpr (floating_storage<S>)
      return &store_block<T, S>;
    else
      return nullptr;
  });
}

// How many threads a problem of this many flops should use (1 for small ones). KILN_NUM_THREADS
// caps it; OpenMP's own setting applies when kiln is built with OpenMP.
inline int thread_count(std::int64_t tasks, double flops) {
  if (tasks <= 1 || flops < 4.0e6) return 1;
  int n = 0;
  if (const char* env = kiln::config::env("KILN_NUM_THREADS"); env && *env) n = std::atoi(env);
  if (n <= 0) {
#ifdef _OPENMP
    n = omp_get_max_threads();
#else
    n = static_cast<int>(std::thread::hardware_concurrency());
#endif
  }
  // Roughly 1 MFLOP per thread at least, so tiny problems do not pay for many threads.
  const double per_thread = 1.0e6;
  n = static_cast<int>(std::min<double>(n, flops / per_thread));
  return static_cast<int>(std::clamp<std::int64_t>(n, 1, tasks));
}

// Runs worker(next) on `threads` threads (the caller's included); each worker takes task indices
// from the shared counter until none are left. The first exception is rethrown after all finish.
template <class Worker>
void run_parallel(int threads, const Worker& worker) {
  std::atomic<std::int64_t> next{0};
  if (threads <= 1) {
    worker(next);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto guarded = [&] {
    try {
      worker(next);
    } catch (...) {
      std::lock_guard lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  guarded();
#else
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  try {
    for (int i = 1; i < threads; ++i) pool.emplace_back(guarded);
  } catch (...) {  // could not start more threads: the ones started (and this one) do the work
  }
  guarded();
  for (std::thread& t : pool) t.join();
#endif
  if (failure) std::rethrow_exception(failure);
}

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
    run_parallel(threads, [&](std::atomic<std::int64_t>& next) {
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
  run_parallel(threads, [&](std::atomic<std::int64_t>& next) {
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

#undef KILN_MM_UNROLL
#undef KILN_MM_VECTOR_BYTES
#undef KILN_MM_GNU_VECTORS
