// Host-only tile operations written as whole vectors (GCC's vector extensions), for the few places
// where the lane-by-lane loops of prelude.hpp do not vectorise: the NaN-propagating maximum and
// minimum of row reductions (softmax's max, amax). Their accumulator is read three times a step
// (two NaN tests and the comparison), which GCC's loop vectoriser does not take for a reduction
// (without -ffinite-math-only it cannot use a plain max), so the row's max stayed scalar. As vector
// operations the same selects are one compare-and-blend per 4, 8 or 16 f32 lanes (SSE or NEON, AVX,
// AVX-512). The last piece of the prelude; nothing here for the device, and other compilers keep the
// generic loops.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_cpu_tiles = R"KILN(
#if !defined(KILN_DEVICE_CODE) && defined(__GNUC__) && !defined(__clang__)
namespace kiln {
// Tiles of N lanes of f32 or f64 (N a power of two) go through as GCC vectors.
template <class T> struct vector_lane { static constexpr bool value = false; };
template <> struct vector_lane<float> { static constexpr bool value = true; };
template <> struct vector_lane<double> { static constexpr bool value = true; };
// (A trait of its own: instantiating a vector of bool or i64 lanes to ask would be an error, not a
// substitution failure.)
template <class T, int N> struct vector_fits {
  static constexpr bool value = vector_lane<T>::value && N > 1 && (N & (N - 1)) == 0;
};
// The widest vector the target computes in one instruction, in bytes. A wider GCC vector is split
// by the compiler, and its compares and selects may be split lane by lane: 16-lane f32 tiles on an
// AVX2 machine ran softmax's max 3x slower than a scalar loop. So tiles go through in pieces of
// this width.
#if defined(__AVX512F__)
#define KILN_VECTOR_BYTES 64
#elif defined(__AVX__)
#define KILN_VECTOR_BYTES 32
#else
#define KILN_VECTOR_BYTES 16
#endif
template <class T, int N> struct native_lanes {
  static constexpr int value = N * (int)sizeof(T) <= KILN_VECTOR_BYTES ? N : KILN_VECTOR_BYTES / (int)sizeof(T);
};
// f(x, y) over two tiles, a native vector at a time.
template <class T, int N, class F> KILN_FN tile<T, N> vector_map2(const tile<T, N>& a, const tile<T, N>& b, F f) {
  constexpr int C = native_lanes<T, N>::value;
  typedef T V __attribute__((vector_size(C * sizeof(T))));
  tile<T, N> r;
  for (int i = 0; i < N; i += C) {
    V x, y;
    __builtin_memcpy(&x, a.v + i, sizeof x);
    __builtin_memcpy(&y, b.v + i, sizeof y);
    const V o = f(x, y);
    __builtin_memcpy(r.v + i, &o, sizeof o);
  }
  return r;
}
// As the generic maximum and minimum: NaN if either lane is NaN (torch.maximum / torch.minimum).
// x where x > y or x is NaN, else y (NaN when y is): two compares and one blend a vector, not
// three of each.
struct vector_max {
  template <class V> KILN_FN V operator()(V x, V y) const { return ((x > y) | (x != x)) ? x : y; }
};
struct vector_min {
  template <class V> KILN_FN V operator()(V x, V y) const { return ((x < y) | (x != x)) ? x : y; }
};
// name(a, b) for two tiles, or a tile and a scalar (a tile of equal lanes), through vector_map2.
#define KILN_VECTOR_OP(name, fn)                                                                        \
  template <class T, int N, class = typename enable_if<vector_fits<T, N>::value>::type>                    \
  KILN_FN tile<T, N> name(const tile<T, N>& a, const tile<T, N>& b) { return vector_map2(a, b, fn()); }      \
  template <class T, int N, class = typename enable_if<vector_fits<T, N>::value>::type>                    \
  KILN_FN tile<T, N> name(const tile<T, N>& a, T b) { return vector_map2(a, full<N>(b), fn()); }             \
  template <class T, int N, class = typename enable_if<vector_fits<T, N>::value>::type>                    \
  KILN_FN tile<T, N> name(T a, const tile<T, N>& b) { return vector_map2(full<N>(a), b, fn()); }
KILN_VECTOR_OP(maximum, vector_max)
KILN_VECTOR_OP(minimum, vector_min)
// Arithmetic on f32 and f64 tiles as whole vectors, so that a row kernel's arithmetic reaches the
// vector units without GCC's SLP pass having to find it lane by lane (it left layer_norm's backward
// mostly scalar: NOTES 70). The same IEEE operations, so the same results. Only in row kernels
// (KILN_VECTOR_ARITH, runtime/compile/kernel_units.hpp): a pointwise kernel's loop is vectorised
// across its tiles, and vector operations there broke that for special functions (W1b 2.3x slower).
#ifdef KILN_VECTOR_ARITH
struct vector_add { template <class V> KILN_FN V operator()(V x, V y) const { return x + y; } };
struct vector_sub { template <class V> KILN_FN V operator()(V x, V y) const { return x - y; } };
struct vector_mul { template <class V> KILN_FN V operator()(V x, V y) const { return x * y; } };
struct vector_div { template <class V> KILN_FN V operator()(V x, V y) const { return x / y; } };
KILN_VECTOR_OP(add, vector_add)
KILN_VECTOR_OP(sub, vector_sub)
KILN_VECTOR_OP(mul, vector_mul)
KILN_VECTOR_OP(div, vector_div)
#endif
#undef KILN_VECTOR_OP
}  // namespace kiln
#endif
)KILN";

}  // namespace kiln::codegen
