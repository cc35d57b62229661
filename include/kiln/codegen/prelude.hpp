// The prelude of every generated kernel: tiles and their operations, loads, stores and reductions,
// written once for both targets. Under NVRTC a tile is the run of elements one thread owns and
// row reductions cross threads with warp shuffles and shared memory; under the host compiler a
// tile is a short array the compiler vectorises and programs are spread over cores by the runtime.
// It is embedded as a string so nothing at run time depends on where kiln's sources live.
#pragma once
#include <string>
#include <string_view>

#include "prelude_cpu_math.hpp"
#include "prelude_cpu_tiles.hpp"
#include "prelude_memory.hpp"
#include "prelude_programs.hpp"

namespace kiln::codegen {

// Types, tiles and their arithmetic (prelude_ops below: scalar math); prelude_memory.hpp has loads,
// stores and reductions, prelude_programs.hpp the loops.
inline constexpr std::string_view prelude_core = R"KILN(
// Device code under NVRTC, and under nvcc for kernels exported ahead of time (k::export_kernels).
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define KILN_DEVICE_CODE 1
#endif
#ifdef KILN_DEVICE_CODE
#define KILN_FN __device__ __forceinline__
#ifndef KILN_KERNEL  // exported sources make their kernels static: two exports link side by side
#define KILN_KERNEL extern "C" __global__ void
#endif
#define KILN_BOUNDS(threads) __launch_bounds__(threads)
// A held-row kernel's bound with blocks an SM (launch_config.hpp's min_blocks_for): taken only in
// the compiles that runtime/compile/nvrtc.hpp makes again when ptxas, left alone, gave the kernel
// more registers than that many blocks leave a thread. KILN_HELD_BOUND is the most blocks those
// compiles ask for: the kernel's own, then one block more than ptxas gave it alone.
#ifdef KILN_HELD_BOUND
#define KILN_HELD_BOUNDS(threads, blocks) \
  __launch_bounds__(threads, (blocks) < KILN_HELD_BOUND ? (blocks) : KILN_HELD_BOUND)
#else
#define KILN_HELD_BOUNDS(threads, blocks) __launch_bounds__(threads)
#endif
#define KILN_PROGRAM_PARAMS
#define KILN_UNROLL _Pragma("unroll")
typedef long long i64;
#define KILN_INF __int_as_float(0x7f800000)
#define KILN_LIBM(f) ::f
// The 16-bit float headers are large: only kernels that move f16/bf16 include them (KILN_HALF).
#ifdef KILN_HALF
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef __half f16;
typedef __nv_bfloat16 bf16;
namespace kiln {
KILN_FN float to_compute(f16 x) { return __half2float(x); }
KILN_FN float to_compute(bf16 x) { return __bfloat162float(x); }
template <class T> KILN_FN T from_compute(float x);
template <> KILN_FN f16 from_compute<f16>(float x) { return __float2half_rn(x); }
template <> KILN_FN bf16 from_compute<bf16>(float x) { return __float2bfloat16_rn(x); }
}  // namespace kiln
#else
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
namespace kiln {
template <class T> KILN_FN T from_compute(float x) { return T{}; }
KILN_FN float to_compute(f16) { return 0.0f; }
KILN_FN float to_compute(bf16) { return 0.0f; }
}  // namespace kiln
#endif
#else
// No standard headers on the host: <cmath> alone took 0.28 s of a 0.45 s kernel compile (a CPU
// program's first call). GCC's and Clang's builtins stand in for what the prelude uses: the math
// functions below (KILN_LIBM), memcpy and the special values.
#define KILN_LIBM(f) __builtin_##f
#define KILN_FN inline __attribute__((always_inline))
#define KILN_KERNEL static void
#define KILN_BOUNDS(threads)
#define KILN_HELD_BOUNDS(threads, blocks)
#define KILN_PROGRAM_PARAMS , i64 kiln_pid
#define KILN_UNROLL _Pragma("GCC unroll 16")
typedef long long i64;
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
#define KILN_INF __builtin_inff()
#define KILN_NAN __builtin_nanf("")
namespace kiln {
KILN_FN unsigned bits_of(float f) { unsigned u; __builtin_memcpy(&u, &f, 4); return u; }
KILN_FN float float_of(unsigned u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
// Every path computed and one picked through masks (no branch), so that a tile's lanes vectorise.
KILN_FN unsigned m_mask(bool c) { return 0u - (unsigned)c; }
inline float to_compute(f16 h) {
  const unsigned sign = (h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
  const unsigned special = 0x7f800000u | (mant << 13);                  // inf, NaN
  const unsigned tiny = bits_of((float)mant * (1.0f / 16777216.0f));  // zero and subnormals: exact
  const unsigned normal = ((exp + 112u) << 23) | (mant << 13);
  const unsigned is_special = m_mask(exp == 0x1fu), is_tiny = m_mask(exp == 0u);
  return float_of(sign | (special & is_special) | (tiny & is_tiny) | (normal & ~(is_special | is_tiny)));
}
KILN_FN float to_compute(bf16 b) { return float_of((unsigned)b.bits << 16); }
template <class T> T from_compute(float x);
// Round to nearest even; past the largest f16, inf; NaN stays a (quiet) NaN.
template <> inline f16 from_compute<f16>(float f) {
  const unsigned x = bits_of(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  const unsigned special = 0x7c00u | (m_mask(a > 0x7f800000u) & 0x200u);
  // Results below the smallest normal f16: a scaled by 2^24 is the result's integer, rounded by hand
  // (other lanes scale a zero, so the conversion to unsigned stays in range).
  const unsigned is_tiny = m_mask(a < 0x38800000u);
  const float s = float_of(a & is_tiny) * 16777216.0f;
  const unsigned m = (unsigned)(int)s;  // s < 1025: through int, which AVX2 converts in vectors
  const float rem = s - (float)m;
  const unsigned tiny = m + (unsigned)((rem > 0.5f) | ((rem == 0.5f) & ((m & 1u) != 0u)));  // | and &: no branches
  const unsigned h = (((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13), rest = a & 0x1fffu;
  const unsigned normal = h + (unsigned)((rest > 0x1000u) | ((rest == 0x1000u) & ((h & 1u) != 0u)));
  const unsigned is_special = m_mask(a >= 0x7f800000u), is_over = m_mask(a >= 0x477ff000u) & ~is_special;
  const unsigned rest_mask = ~(is_special | is_over | is_tiny);
  const unsigned r = (special & is_special) | (0x7c00u & is_over) | (tiny & is_tiny) | (normal & rest_mask);
  return f16{(unsigned short)(sign | r)};
}
template <> inline bf16 from_compute<bf16>(float f) {
  unsigned x = bits_of(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16{(unsigned short)((x >> 16) | 0x40u)};
  return bf16{(unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
}  // namespace kiln
#endif

namespace kiln {
template <class T> KILN_FN T to_compute(T x) { return x; }
template <class T, class C> KILN_FN T store_cast(C x) { return (T)x; }
template <> KILN_FN f16 store_cast<f16, float>(float x) { return from_compute<f16>(x); }
template <> KILN_FN bf16 store_cast<bf16, float>(float x) { return from_compute<bf16>(x); }
template <class T> struct compute_of { typedef T type; };
template <> struct compute_of<f16> { typedef float type; };
template <> struct compute_of<bf16> { typedef float type; };

// ---- tiles ---------------------------------------------------------------------------------
template <class T, int N>
struct tile {
  T v[N];
};
template <class T> struct tile_traits { static constexpr int width = 0; typedef T elem; };
template <class T, int N> struct tile_traits<tile<T, N> > { static constexpr int width = N; typedef T elem; };
template <class A> KILN_FN auto lane(const A& a, int i) {
  if constexpr (tile_traits<A>::width > 0) return a.v[i]; else return a;
}
template <class A, class B> struct width_of {
  static constexpr int value = tile_traits<A>::width > tile_traits<B>::width ? tile_traits<A>::width : tile_traits<B>::width;
};
template <int N, class I = i64> KILN_FN tile<I, N> arange() {
  tile<I, N> t;
KILN_UNROLL
  for (int i = 0; i < N; ++i) t.v[i] = i;
  return t;
}
template <int N, class T> KILN_FN tile<T, N> full(T x) {
  tile<T, N> t;
KILN_UNROLL
  for (int i = 0; i < N; ++i) t.v[i] = x;
  return t;
}
// A value as a tile of N lanes: a tile as it is, a scalar (a row's value) broadcast; for arrays of
// tiles that may hold either (the host's kept values).
template <int N, class T> KILN_FN const tile<T, N>& as_tile(const tile<T, N>& t) { return t; }
template <int N, class T> KILN_FN tile<T, N> as_tile(T x) { return full<N>(x); }

// Element-wise application over scalars and tiles (a scalar broadcasts against a tile).
template <class F, class A> KILN_FN auto map1(F f, const A& a) {
  if constexpr (tile_traits<A>::width == 0) {
    return f(a);
  } else {
    constexpr int N = tile_traits<A>::width;
    tile<decltype(f(a.v[0])), N> r;
KILN_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = f(a.v[i]);
    return r;
  }
}
template <class F, class A, class B> KILN_FN auto map2(F f, const A& a, const B& b) {
  constexpr int N = width_of<A, B>::value;
  if constexpr (N == 0) {
    return f(a, b);
  } else {
    tile<decltype(f(lane(a, 0), lane(b, 0))), N> r;
KILN_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = f(lane(a, i), lane(b, i));
    return r;
  }
}
template <class A, class B, class C> struct widest {
  static constexpr int value = width_of<A, B>::value > tile_traits<C>::width ? width_of<A, B>::value : tile_traits<C>::width;
};
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <class A, class B> struct any_tile { static constexpr bool value = width_of<A, B>::value > 0; };

template <class A, class B> KILN_FN auto m_div(A a, B b) { return a / b; }
#ifdef KILN_DEVICE_CODE
// Triton's default for f32 division, so results match torch.compile's: div.full (2 ulp).
KILN_FN float m_div(float a, float b) { float r; asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
#else
KILN_FN float m_div(float a, float b) { return a / b; }
#endif

#define KILN_BINARY(name, expr) \
  template <class A, class B> KILN_FN auto name(const A& a, const B& b) { return map2([](auto x, auto y) { return expr; }, a, b); }
KILN_BINARY(add, x + y)
KILN_BINARY(sub, x - y)
KILN_BINARY(mul, x * y)
KILN_BINARY(div, m_div(x, y))
KILN_BINARY(lt, x < y)
KILN_BINARY(le, x <= y)
KILN_BINARY(gt, x > y)
KILN_BINARY(ge, x >= y)
KILN_BINARY(eq, x == y)
KILN_BINARY(ne, x != y)
KILN_BINARY(logical_and, x && y)
KILN_BINARY(logical_or, x || y)
// NaN-propagating, as torch.maximum / torch.minimum.
KILN_BINARY(maximum, (x != x) ? x : ((y != y) ? y : (x > y ? x : y)))
KILN_BINARY(minimum, (x != x) ? x : ((y != y) ? y : (x < y ? x : y)))
#undef KILN_BINARY

)KILN";

// Scalar math and its tile forms; the host's f32 exp, log, tanh, erf and sigmoid come before it
// (prelude_cpu_math.hpp).
inline constexpr std::string_view prelude_ops = R"KILN(
// Scalar math for each compute type, then lifted to tiles. On the device f32 is CUDA's; on the host
// f32 exp, log, tanh, erf and sigmoid are prelude_cpu_math.hpp's polynomial kernels (just before
// this), which the host compiler vectorises across a tile (a call into libm would stop it).
#ifdef KILN_DEVICE_CODE
KILN_FN float m_exp(float x) { return __expf(x); }  // ex2.approx, as Triton's tl.exp
KILN_FN float m_log(float x) { return KILN_LIBM(logf)(x); }
KILN_FN float m_tanh(float x) { return KILN_LIBM(tanhf)(x); }
KILN_FN float m_erf(float x) { return KILN_LIBM(erff)(x); }
#endif
KILN_FN double m_exp(double x) { return KILN_LIBM(exp)(x); }
KILN_FN float m_exp2(float x) { return KILN_LIBM(exp2f)(x); }
KILN_FN double m_exp2(double x) { return KILN_LIBM(exp2)(x); }
KILN_FN double m_log(double x) { return KILN_LIBM(log)(x); }
KILN_FN float m_log2(float x) { return KILN_LIBM(log2f)(x); }
KILN_FN double m_log2(double x) { return KILN_LIBM(log2)(x); }
KILN_FN float m_log1p(float x) { return KILN_LIBM(log1pf)(x); }
KILN_FN double m_log1p(double x) { return KILN_LIBM(log1p)(x); }
KILN_FN float m_expm1(float x) { return KILN_LIBM(expm1f)(x); }
KILN_FN double m_expm1(double x) { return KILN_LIBM(expm1)(x); }
KILN_FN float m_sqrt(float x) { return KILN_LIBM(sqrtf)(x); }
KILN_FN double m_sqrt(double x) { return KILN_LIBM(sqrt)(x); }
#ifdef KILN_DEVICE_CODE
KILN_FN float m_rsqrt(float x) { return KILN_LIBM(rsqrtf)(x); }
KILN_FN double m_rsqrt(double x) { return KILN_LIBM(rsqrt)(x); }
#else
KILN_FN float m_rsqrt(float x) { return 1.0f / KILN_LIBM(sqrtf)(x); }
KILN_FN double m_rsqrt(double x) { return 1.0 / KILN_LIBM(sqrt)(x); }
#endif
KILN_FN float m_sin(float x) { return KILN_LIBM(sinf)(x); }
KILN_FN double m_sin(double x) { return KILN_LIBM(sin)(x); }
KILN_FN float m_cos(float x) { return KILN_LIBM(cosf)(x); }
KILN_FN double m_cos(double x) { return KILN_LIBM(cos)(x); }
KILN_FN double m_tanh(double x) { return KILN_LIBM(tanh)(x); }
KILN_FN double m_erf(double x) { return KILN_LIBM(erf)(x); }
KILN_FN float m_pow(float x, float y) { return KILN_LIBM(powf)(x, y); }
KILN_FN double m_pow(double x, double y) { return KILN_LIBM(pow)(x, y); }
// Integer powers as PyTorch's: exact, wrapping on overflow (by squaring, in unsigned arithmetic),
// and for a negative exponent 1, -1 or 0 (what an integer result of 1 / x^-y can be).
template <class T, class U> KILN_FN T m_ipow(T x, T y) {
  if (y < 0) return x == 1 ? T(1) : x == -1 ? ((y & 1) ? T(-1) : T(1)) : T(0);
  U r = 1, b = (U)x;
  for (U e = (U)y; e; e >>= 1, b *= b)
    if (e & 1) r *= b;
  return (T)r;
}
KILN_FN int m_pow(int x, int y) { return m_ipow<int, unsigned>(x, y); }
KILN_FN i64 m_pow(i64 x, i64 y) { return m_ipow<i64, unsigned long long>(x, y); }
template <class T> KILN_FN T m_abs(T x) { return x < T(0) ? -x : x; }
template <class T> KILN_FN T m_sign(T x) { return (T)((x > T(0)) - (x < T(0))); }
template <class T> KILN_FN T m_relu(T x) { return (x != x) ? x : (x > T(0) ? x : T(0)); }
template <class T> KILN_FN T m_sigmoid(T x) { return m_div(T(1), T(1) + m_exp(-x)); }

#define KILN_UNARY(name, expr) \
  template <class A> KILN_FN auto name(const A& a) { return map1([](auto x) { return expr; }, a); }
KILN_UNARY(neg, -x)
KILN_UNARY(abs, m_abs(x))
KILN_UNARY(sign, m_sign(x))
KILN_UNARY(exp, m_exp(x))
KILN_UNARY(log, m_log(x))
#if defined(KILN_DEVICE_CODE) || !defined(KILN_LIBMVEC) || KILN_LIBMVEC < 2  // else prelude_libmvec_ops
KILN_UNARY(exp2, m_exp2(x))
KILN_UNARY(log2, m_log2(x))
KILN_UNARY(log1p, m_log1p(x))
KILN_UNARY(expm1, m_expm1(x))
#endif
KILN_UNARY(sqrt, m_sqrt(x))
KILN_UNARY(rsqrt, m_rsqrt(x))
KILN_UNARY(reciprocal, m_div(decltype(x)(1), x))
KILN_UNARY(square, x * x)
#if defined(KILN_DEVICE_CODE) || !defined(KILN_LIBMVEC) || KILN_LIBMVEC < 1  // else prelude_libmvec_ops (prelude_cpu_math.hpp)
KILN_UNARY(sin, m_sin(x))
KILN_UNARY(cos, m_cos(x))
#endif
KILN_UNARY(tanh, m_tanh(x))
KILN_UNARY(sigmoid, m_sigmoid(x))
KILN_UNARY(erf, m_erf(x))
KILN_UNARY(relu, m_relu(x))
KILN_UNARY(logical_not, !x)
#undef KILN_UNARY
#if defined(KILN_DEVICE_CODE) || !defined(KILN_LIBMVEC) || KILN_LIBMVEC < 1
template <class A, class B> KILN_FN auto pow(const A& a, const B& b) { return map2([](auto x, auto y) { return m_pow(x, y); }, a, b); }
#endif

template <class T, class A> KILN_FN auto cast(const A& a) { return map1([](auto x) { return (T)x; }, a); }
// Rounds f32 values through a 16-bit float type (a cast to f16/bf16 inside a kernel).
template <class T, class A> KILN_FN auto round_to(const A& a) {
  return map1([](float x) { return to_compute(store_cast<T>(x)); }, a);
}

template <class C, class A, class B> KILN_FN auto where(const C& c, const A& a, const B& b) {
  constexpr int N = widest<C, A, B>::value;
  if constexpr (N == 0) {
    return c ? a : b;
  } else {
    tile<decltype(lane(a, 0)), N> r;
KILN_UNROLL
    for (int i = 0; i < N; ++i) r.v[i] = lane(c, i) ? lane(a, i) : lane(b, i);
    return r;
  }
}

// Operators on tiles, so generated code reads `tmp2 = tmp0 + tmp1` (scalars use the built-ins).
#define KILN_TILE_OPERATOR(op, fn)                                                             \
  template <class A, class B, class = typename enable_if<any_tile<A, B>::value>::type>        \
  KILN_FN auto operator op(const A& a, const B& b) { return fn(a, b); }
KILN_TILE_OPERATOR(+, add)
KILN_TILE_OPERATOR(-, sub)
KILN_TILE_OPERATOR(*, mul)
KILN_TILE_OPERATOR(/, div)
KILN_TILE_OPERATOR(<, lt)
KILN_TILE_OPERATOR(<=, le)
KILN_TILE_OPERATOR(>, gt)
KILN_TILE_OPERATOR(>=, ge)
KILN_TILE_OPERATOR(==, eq)
KILN_TILE_OPERATOR(!=, ne)
KILN_TILE_OPERATOR(&, logical_and)
#undef KILN_TILE_OPERATOR
template <class T, int N> KILN_FN tile<T, N> operator-(const tile<T, N>& a) { return neg(a); }
template <class T, int N, class B> KILN_FN auto operator%(const tile<T, N>& a, B b) {
  return map1([b](T x) { return x % b; }, a);
}
// The helpers of symbolic index expressions (ir/sym.hpp: kiln_floordiv, kiln_mod, kiln_min,
// kiln_max) on tiles of indices, lane by lane; found by argument-dependent lookup when an operand is
// a tile (symbolic slice bounds put them into tiled index arithmetic), in the wider of the two
// operands' types (32-bit lanes stay 32-bit: the kernel's `ix`).
template <class A, class B> KILN_FN auto kiln_floordiv(const A& a, const B& b) {
  return map2([](auto x, auto y) { auto q = x / y; return (x % y != 0 && ((x < 0) != (y < 0))) ? q - 1 : q; }, a, b);
}
template <class A, class B> KILN_FN auto kiln_mod(const A& a, const B& b) {
  return map2([](auto x, auto y) { auto r = x % y; return (r != 0 && ((r < 0) != (y < 0))) ? r + y : r; }, a, b);
}
template <class A, class B> KILN_FN auto kiln_min(const A& a, const B& b) {
  return map2([](auto x, auto y) { return x < y ? x : y; }, a, b);
}
template <class A, class B> KILN_FN auto kiln_max(const A& a, const B& b) {
  return map2([](auto x, auto y) { return x < y ? y : x; }, a, b);
}

// Philox 4x32-10, the counter-based generator of k::rand_like and k::dropout (core/philox.hpp has
// the host's copy, the oracle's): position i of the draw (seed, offset) is the first word of
// Philox(counter = offset + i, 0, 0; key = seed), its top 24 bits scaled into [0, 1).
#ifdef KILN_DEVICE_CODE
KILN_FN unsigned m_mulhi(unsigned a, unsigned b) { return __umulhi(a, b); }
#else
KILN_FN unsigned m_mulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
#endif
KILN_FN float m_philox_uniform(unsigned k0, unsigned k1, unsigned long long c) {
  unsigned c0 = (unsigned)c, c1 = (unsigned)(c >> 32), c2 = 0u, c3 = 0u;
KILN_UNROLL
  for (int round = 0; round < 10; ++round) {
    if (round) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    unsigned hi0 = m_mulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    unsigned hi1 = m_mulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0; c2 = hi0 ^ c3 ^ k1; c1 = lo1; c3 = lo0;
  }
  return (float)(c0 >> 8) * (1.0f / 16777216.0f);
}
// rand over a tile (or one) of row-major positions; the seed and offset come as 32-bit words.
template <class I> KILN_FN auto rand_uniform(i64 seed_lo, i64 seed_hi, i64 off_lo, i64 off_hi, const I& pos) {
  const unsigned k0 = (unsigned)seed_lo, k1 = (unsigned)seed_hi;
  const unsigned long long base = ((unsigned long long)off_hi << 32) | (unsigned long long)(unsigned)off_lo;
  return map1([=](i64 i) { return m_philox_uniform(k0, k1, base + (unsigned long long)i); }, pos);
}

// One pass over a looped row for a sum that reads an earlier reduction of the row through a row
// value D known only after the loop (codegen's one-pass pairs): each lane keeps a summary of its
// values x, and after the loop gives its share of the sum at D exactly.
// sum((x - D)^2): Welford's count n, mean and squared deviations m2 of x - k, k the thread's first
// value (NaN until it has one; a mean of 1000 in f32 takes no step below 6e-5: the shift keeps the
// running mean near zero); a lane's share is m2 + n (k - D + mean)^2, which holds for any D (every
// term nonnegative).
template <class T, int N, class X, class K>
KILN_FN void welford_step(tile<T, N>& n, T& k, tile<T, N>& mean, tile<T, N>& m2, const X& x, const K& keep) {
  if (k != k)
    for (int i = N - 1; i >= 0; --i)
      if (lane(keep, i)) k = (T)lane(x, i);
KILN_UNROLL
  for (int i = 0; i < N; ++i) {
    const T y = (T)lane(x, i) - k, c = n.v[i] + T(1), d = y - mean.v[i], mi = mean.v[i] + m_div(d, c);
    const bool kept = lane(keep, i);
    m2.v[i] = kept ? m2.v[i] + d * (y - mi) : m2.v[i];
    mean.v[i] = kept ? mi : mean.v[i];
    n.v[i] = kept ? c : n.v[i];
  }
}
template <class T, int N, class D>
KILN_FN tile<T, N> squares_about(const tile<T, N>& n, T k, const tile<T, N>& mean, const tile<T, N>& m2, const D& d) {
  tile<T, N> r;
KILN_UNROLL
  for (int i = 0; i < N; ++i) {
    const T off = (k - (T)d) + mean.v[i];
    r.v[i] = n.v[i] == T(0) ? T(0) : m2.v[i] + n.v[i] * off * off;
  }
  return r;
}
// sum(exp(x - D)): the running max m and s = sum(exp(x - m)), one exp a value (exp(-|x - m|) is
// the new value's term or the old sum's scale); a lane's share is s exp(m - D), 0 for a lane that
// kept nothing. A value equal to m (-inf on -inf included) adds 1.
template <class T, int N, class X, class K>
KILN_FN void online_exp_step(tile<T, N>& m, tile<T, N>& s, const X& x, const K& keep) {
KILN_UNROLL
  for (int i = 0; i < N; ++i) {
    const T xi = (T)lane(x, i), mi = m.v[i];
    const bool up = xi > mi;
    const T e = xi == mi ? T(1) : m_exp(up ? mi - xi : xi - mi);
    const bool k = lane(keep, i);
    s.v[i] = k ? (up ? s.v[i] * e + T(1) : s.v[i] + e) : s.v[i];
    m.v[i] = k && up ? xi : mi;
  }
}
template <class T, int N, class D> KILN_FN tile<T, N> exp_sum_at(const tile<T, N>& m, const tile<T, N>& s, const D& d) {
  tile<T, N> r;
KILN_UNROLL
  for (int i = 0; i < N; ++i) r.v[i] = s.v[i] == T(0) ? T(0) : s.v[i] * m_exp(m.v[i] - (T)d);
  return r;
}

)KILN";

// The whole prelude, as generated translation units begin.
// Joined by a function, not a constexpr-looking initialiser: GCC would try to evaluate the
// concatenation at compile time in every TU (about a second per TU) before giving up.
inline std::string joined_prelude() {
  std::string s;
  for (std::string_view part : {prelude_core, prelude_libmvec, prelude_cpu_math, prelude_ops, prelude_libmvec_ops,
                                prelude_memory, prelude_programs, prelude_cpu_tiles})
    s += part;
  return s;
}
inline const std::string prelude = joined_prelude();

}  // namespace kiln::codegen
