// The host's f32 special functions (exp, log, tanh, erf, sigmoid) as branch-free polynomial
// kernels: a tile's lanes are a loop the host compiler vectorises, which one call into libm per lane
// would stop. A piece of the prelude (prelude.hpp), inserted inside namespace kiln before the scalar
// math; the device keeps CUDA's functions, and f64 keeps libm's everywhere.
//
// Scheme, as in Cephes and SLEEF: reduce the argument exactly (Cody-Waite: a constant split in two,
// the first part short enough that its product with the reduction's integer is exact), approximate
// a smooth, slowly varying part on the reduced interval by a polynomial, and reassemble with integer
// operations on the exponent bits. Every lane computes every path and a select picks one, so there
// are no branches; selects also give the special values (±0, ±inf, NaN, denormals) what libm gives.
// Polynomials are evaluated by Horner in f32, each step a fused multiply-add where the CPU has one
// (as SLEEF's AVX2 and NEON paths do; about 6% fewer instructions in W1b's loop), else a multiply
// and an add: results may differ in the last bit between CPUs with and without FMA, both within
// the bounds below. The kernels' own arithmetic is never contracted (-ffp-contract=off).
// Coefficients: Chebyshev fits at 50 digits rounded to f32, from scripts/fit_cpu_math.py.
//
// Error bounds, in ulps of the f32 result against the exact value (long double), the largest seen
// over every 389th f32 bit pattern (every binade, denormals included): exp 1.01 (a result in the
// denormal range: within 1 ulp of the smallest denormal), log 0.82, tanh 1.30, erf 1.23, sigmoid
// 2.46, without FMA; with it, the test's inputs on an AVX2 host gave exp 0.98, log 0.80, tanh
// 1.27, erf 1.01, sigmoid 1.93. tests/test_cpu_math.cpp asserts 1.5, 1.5, 2, 2 and 3 through kiln
// expressions against the f64 oracle, and libm's results at ±0, ±inf, NaN and the ends of the
// normals and denormals.
// (libm's f32 functions are within about 0.5-1 ulp; these trade up to 2 ulp more for SIMD.)
#pragma once
#include <string_view>

namespace kiln::codegen {

// glibc's vector math library, libmvec (part of glibc on x86-64 since 2.22): where the host
// compiler's probe found it (runtime/compile/host_probes.hpp defines KILN_LIBMVEC: 1 for glibc
// 2.22's functions, 2 with those of 2.35, and links -lmvec), the f32 functions without a polynomial
// below go through its vector variants, one call for each vector of a tile's lanes, by the x86-64
// vector function ABI's names (`_ZGVeN16v_sinf`: AVX-512, 16 lanes); libm's functions otherwise,
// once a lane (GCC's loop vectoriser would call the variants itself, but a tile's lanes are an
// unrolled loop, which it leaves to the SLP vectoriser, which does not). sin over 2^24 f32 on one
// core: 6.4 ms instead of 144 (NOTES item 135). glibc documents the variants within 4 ulp (libm's
// are within 1); tests/test_cpu_math.cpp asserts that through kiln expressions. f64 keeps libm.
// Declarations here (the probe compiles them alone); the tile operations in prelude_libmvec_ops.
inline constexpr std::string_view prelude_libmvec = R"KILN(
#if !defined(KILN_DEVICE_CODE) && defined(KILN_LIBMVEC) && KILN_LIBMVEC > 0
#if defined(__AVX512F__)
#define KILN_MVEC_LANES 16
#define KILN_MVEC(f) _ZGVeN16v_##f
#define KILN_MVEC2(f) _ZGVeN16vv_##f
#elif defined(__AVX2__)
#define KILN_MVEC_LANES 8
#define KILN_MVEC(f) _ZGVdN8v_##f
#define KILN_MVEC2(f) _ZGVdN8vv_##f
#elif defined(__AVX__)
#define KILN_MVEC_LANES 8
#define KILN_MVEC(f) _ZGVcN8v_##f
#define KILN_MVEC2(f) _ZGVcN8vv_##f
#else
#define KILN_MVEC_LANES 4
#define KILN_MVEC(f) _ZGVbN4v_##f
#define KILN_MVEC2(f) _ZGVbN4vv_##f
#endif
typedef float kiln_mvec __attribute__((vector_size(KILN_MVEC_LANES * 4)));
extern "C" {
kiln_mvec KILN_MVEC(sinf)(kiln_mvec) noexcept;
kiln_mvec KILN_MVEC(cosf)(kiln_mvec) noexcept;
kiln_mvec KILN_MVEC2(powf)(kiln_mvec, kiln_mvec) noexcept;
#if KILN_LIBMVEC >= 2
kiln_mvec KILN_MVEC(exp2f)(kiln_mvec) noexcept;
kiln_mvec KILN_MVEC(log2f)(kiln_mvec) noexcept;
kiln_mvec KILN_MVEC(log1pf)(kiln_mvec) noexcept;
kiln_mvec KILN_MVEC(expm1f)(kiln_mvec) noexcept;
#endif
}
#endif
)KILN";

// The tile operations over libmvec, in namespace kiln (joined after prelude_ops, which leaves these
// names to them when KILN_LIBMVEC is defined): an f32 tile a vector of lanes at a time through a
// variant, a partial vector (a tile's last lanes) and a scalar padded to one, so that every f32
// result comes from the same function whatever its lane; other dtypes through libm.
inline constexpr std::string_view prelude_libmvec_ops = R"KILN(
#if !defined(KILN_DEVICE_CODE) && defined(KILN_LIBMVEC) && KILN_LIBMVEC > 0
template <class T> struct mvec_f32 { static constexpr bool value = false; };
template <> struct mvec_f32<float> { static constexpr bool value = true; };
// Lanes [i, i + n) of a (a tile or a scalar) as a vector; lanes past n repeat lane i (values the
// function takes without fault: they are computed and dropped).
template <class A> KILN_FN kiln_mvec mvec_lanes(const A& a, int i, int n) {
  float x[KILN_MVEC_LANES];
  for (int j = 0; j < KILN_MVEC_LANES; ++j) x[j] = (float)lane(a, i + (j < n ? j : 0));
  kiln_mvec v;
  __builtin_memcpy(&v, x, sizeof v);
  return v;
}
// The f32 result of g, which maps lanes [i, i + n) to a vector: a scalar's (N 0) from lane 0, else a
// tile of N lanes, a vector of them at a time.
template <int N, class G> KILN_FN auto mvec_apply(G g) {
  float y[KILN_MVEC_LANES];
  if constexpr (N == 0) {
    const kiln_mvec v = g(0, 1);
    __builtin_memcpy(y, &v, sizeof v);
    return y[0];
  } else {
    tile<float, N> r;
    for (int i = 0; i < N; i += KILN_MVEC_LANES) {
      const int n = N - i < KILN_MVEC_LANES ? N - i : KILN_MVEC_LANES;
      const kiln_mvec v = g(i, n);
      __builtin_memcpy(y, &v, sizeof v);
      for (int j = 0; j < n; ++j) r.v[i + j] = y[j];
    }
    return r;
  }
}
template <class V, class S, class A> KILN_FN auto mvec_map1(V vf, S sf, const A& a) {
  if constexpr (!mvec_f32<decltype(lane(a, 0))>::value)
    return map1(sf, a);
  else
    return mvec_apply<tile_traits<A>::width>([&](int i, int n) { return vf(mvec_lanes(a, i, n)); });
}
template <class V, class S, class A, class B> KILN_FN auto mvec_map2(V vf, S sf, const A& a, const B& b) {
  if constexpr (!mvec_f32<decltype(lane(a, 0))>::value || !mvec_f32<decltype(lane(b, 0))>::value)
    return map2(sf, a, b);
  else
    return mvec_apply<width_of<A, B>::value>(
        [&](int i, int n) { return vf(mvec_lanes(a, i, n), mvec_lanes(b, i, n)); });
}
#define KILN_UNARY_MVEC(name, f)                                                                          \
  template <class A> KILN_FN auto name(const A& a) {                                                      \
    return mvec_map1([](kiln_mvec v) { return KILN_MVEC(f)(v); }, [](auto x) { return m_##name(x); }, a); \
  }
KILN_UNARY_MVEC(sin, sinf)
KILN_UNARY_MVEC(cos, cosf)
#if KILN_LIBMVEC >= 2
KILN_UNARY_MVEC(exp2, exp2f)
KILN_UNARY_MVEC(log2, log2f)
KILN_UNARY_MVEC(log1p, log1pf)
KILN_UNARY_MVEC(expm1, expm1f)
#endif
#undef KILN_UNARY_MVEC
template <class A, class B> KILN_FN auto pow(const A& a, const B& b) {
  return mvec_map2([](kiln_mvec x, kiln_mvec y) { return KILN_MVEC2(powf)(x, y); },
                   [](auto x, auto y) { return m_pow(x, y); }, a, b);
}
#endif
)KILN";

inline constexpr std::string_view prelude_cpu_math = R"KILN(
#ifndef KILN_DEVICE_CODE
// c ? a : b through bit masks: GCC's jump threading duplicated some code around selects written as
// branches (the loop then has control flow and does not vectorise); masks leave nothing to thread.
KILN_FN float m_pick(bool c, float a, float b) {
  const unsigned m = m_mask(c);
  return float_of((bits_of(a) & m) | (bits_of(b) & ~m));
}

// a * b + c for the polynomials' Horner steps: fused (one rounding) where the CPU has FMA, which
// -march=native turns on, else a multiply and an add. Only here: kernels' own arithmetic stays
// unfused (-ffp-contract=off), as the device's and the oracle's.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
KILN_FN float m_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
KILN_FN float m_fma(float a, float b, float c) { return a * b + c; }
#endif

// p * 2^n for an integer n in [-152, 130], as two power-of-two factors that are each normal, so a
// result in the denormal range is rounded once (by the second product) and one past the largest
// finite f32 becomes inf.
KILN_FN float m_ldexp_small(float p, int n) {
  const int half = n >> 1;
  return p * float_of((unsigned)(half + 127) << 23) * float_of((unsigned)(n - half + 127) << 23);
}

// e^x = 2^n e^r with n = round(x / ln 2) and r = x - n ln 2 in [-ln2/2, ln2/2];
// e^r = 1 + r + r^2 P(r), P of degree 4.
// e^r for the reduced argument of xc (returned), with n in ni.
KILN_FN float m_exp_reduced(float xc, int& ni) {
  // Round to nearest by adding 1.5 * 2^23: n is then in the low bits of the sum's mantissa.
  const float shifted = xc * 1.44269504f + 12582912.0f;
  const float n = shifted - 12582912.0f;
  ni = (int)(bits_of(shifted) - 0x4b400000u);
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4
  const float p = 0.00139261759f;
  const float q = m_fma(m_fma(m_fma(m_fma(p, r, 0.00836317334f), r, 0.0416665561f), r, 0.166665778f), r, 0.5f);
  return 1.0f + (r + r * r * q);
}
KILN_FN float m_exp(float x) {
  // Beyond these e^x is 0 or inf in f32; clamping keeps n small (NaN passes and is returned last).
  const float xc = m_pick(x < -104.0f, -104.0f, m_pick(x > 89.0f, 89.0f, x));
  int ni;
  const float er = m_exp_reduced(xc, ni);
  return m_pick(x != x, x, m_ldexp_small(er, ni));
}
// e^x where the caller knows x is finite and e^x a normal f32 (|x| < 87): no clamps, no NaN test,
// one power-of-two factor. Both of m_exp's factors are exact there, so the results are m_exp's.
KILN_FN float m_exp_normal(float x) {
  int ni;
  const float er = m_exp_reduced(x, ni);
  return er * float_of((unsigned)(ni + 127) << 23);
}

// log x = e ln 2 + log(1 + f) with x = 2^e (1 + f), 1 + f in [sqrt(1/2), sqrt(2));
// log(1 + f) = f - f^2/2 + f^3 Q(f), Q of degree 8.
KILN_FN float m_log(float x) {
  // Denormals are scaled by 2^23 into the normal range first (chosen by a mask, see m_pick).
  const unsigned denormal = 0u - (unsigned)(x < 1.17549435e-38f);  // all ones or zero
  const unsigned xb = (bits_of(x * 8388608.0f) & denormal) | (bits_of(x) & ~denormal);
  // Subtracting the bits of sqrt(1/2) moves the exponent's step from 1 to sqrt(1/2): the exponent
  // field of the difference is e, its mantissa field plus those bits is 1 + f.
  const unsigned u = xb - 0x3f3504f3u;
  const int e = ((int)u >> 23) - (int)(denormal & 23u);
  const float f = float_of((u & 0x7fffffu) + 0x3f3504f3u) - 1.0f;
  float q = 0.0697161183f;
  q = m_fma(q, f, -0.114797339f);
  q = m_fma(q, f, 0.116854198f);
  q = m_fma(q, f, -0.124256872f);
  q = m_fma(q, f, 0.142490581f);
  q = m_fma(q, f, -0.166678026f);
  q = m_fma(q, f, 0.200007156f);
  q = m_fma(q, f, -0.24999997f);
  q = m_fma(q, f, 0.333333313f);
  const float f2 = f * f;
  const float l1p = (f2 * f * q - 0.5f * f2) + f;
  const float fe = (float)e;
  const float y = (fe * -2.12194440e-4f + l1p) + fe * 0.693359375f;
  // log 0 = -inf, log inf = inf, log of a negative number NaN, NaN itself.
  const float special = m_pick(x == 0.0f, -KILN_INF, m_pick(x == KILN_INF, x, KILN_NAN));
  return m_pick((x > 0.0f) & (x < KILN_INF), y, m_pick(x != x, x, special));
}

// tanh x = x + x^3 T(x^2) (T of degree 5) for |x| < 0.625, else 1 - 2 / (e^{2|x|} + 1); both on
// |x|, and the sign of x put back last (so tanh(-0) is -0).
KILN_FN float m_tanh(float x) {
  const float a = float_of(bits_of(x) & 0x7fffffffu);
  const float a2 = a * a;
  float t = 0.00229274482f;
  t = m_fma(t, a2, -0.00834394526f);
  t = m_fma(t, a2, 0.0217689183f);
  t = m_fma(t, a2, -0.0539592579f);
  t = m_fma(t, a2, 0.133333042f);
  t = m_fma(t, a2, -0.333333343f);
  const float small = a + a * a2 * t;
  const float ac = m_pick(a > 10.0f, 10.0f, a);  // tanh rounds to 1 from about 9.01 (NaN passes)
  const float large = 1.0f - 2.0f / (m_exp_normal(2.0f * ac) + 1.0f);  // 2 ac in [0, 20] (a NaN stays NaN)
  const float y = m_pick(a < 0.625f, small, large);
  return float_of(bits_of(y) | (bits_of(x) & 0x80000000u));
}

// erf x = x + x E(x^2) (E of degree 6) for |x| < 1, else sign(x) (1 - e^{-x^2} R(1/|x|)) with R of
// degree 9 fitted on |x| in [1, 4]; erf rounds to 1 in f32 from about 3.92, so |x| is clamped at 4.
KILN_FN float m_erf(float x) {
  const float x2 = x * x;
  float s = 7.87587487e-05f;
  s = m_fma(s, x2, -0.00080168643f);
  s = m_fma(s, x2, 0.00518908724f);
  s = m_fma(s, x2, -0.0268542115f);
  s = m_fma(s, x2, 0.112835944f);
  s = m_fma(s, x2, -0.37612626f);
  s = m_fma(s, x2, 0.128379166f);
  const float small = x + x * s;
  const float a = float_of(bits_of(x) & 0x7fffffffu);
  const float ac = m_pick(a > 4.0f, 4.0f, m_pick(a < 1.0f, 1.0f, a));  // NaN passes
  const float t = 1.0f / ac;
  float r = 0.0250325426f;
  r = m_fma(r, t, -0.14789845f);
  r = m_fma(r, t, 0.360861868f);
  r = m_fma(r, t, -0.42983374f);
  r = m_fma(r, t, 0.145477355f);
  r = m_fma(r, t, 0.282589793f);
  r = m_fma(r, t, -0.394859582f);
  r = m_fma(r, t, 0.0248475205f);
  r = m_fma(r, t, 0.561214626f);
  r = m_fma(r, t, 0.00015165568f);
  const float large = 1.0f - m_exp_normal(-(ac * ac)) * r;  // -(ac^2) in [-16, -1] (a NaN stays NaN)
  return m_pick(a < 1.0f, small, float_of(bits_of(large) | (bits_of(x) & 0x80000000u)));
}

// sigmoid x = 1 / (1 + e^{-x}) for x >= 0 and e^x / (1 + e^x) below, so e^{-|x|} never overflows
// and tiny results keep their digits (down to the denormals) instead of becoming 0.
KILN_FN float m_sigmoid(float x) {
  const float e = m_exp(float_of(bits_of(x) | 0x80000000u));  // e^{-|x|}
  const float s = 1.0f / (1.0f + e);
  return m_pick(x < 0.0f, e * s, s);
}
#endif
)KILN";

}  // namespace kiln::codegen
