// The inner parts of the CPU GEMM (cpu_matmul.hpp): blocking sizes, the MR x NR register-blocked
// micro-kernel, and the routines that pack a and b into compute-type panels and round out results.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>

#include "../../core/dtype.hpp"

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

}  // namespace mm_detail
}  // namespace kiln::runtime

#undef KILN_MM_UNROLL
#undef KILN_MM_VECTOR_BYTES
#undef KILN_MM_GNU_VECTORS
