// The host's f32 special functions (codegen/prelude_cpu_math.hpp): kiln expressions evaluated on
// k::cpu against the f64 oracle (k::reference::eval), in ulps of the f32 result, over random inputs
// across the whole range (random bit patterns: every exponent, denormals included), the tails, the
// points where a kernel switches approximation, and the special values, whose results must be
// libm's exactly. Sizes are odd so that masked tails run too.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

namespace k = kiln;

namespace {

constexpr float inf = std::numeric_limits<float>::infinity();
constexpr float nan = std::numeric_limits<float>::quiet_NaN();
constexpr float min_normal = std::numeric_limits<float>::min();
constexpr float min_denormal = std::numeric_limits<float>::denorm_min();

// The spacing of f32 values at the f32 nearest to v (the smallest denormal below the normals).
double ulp_at(double v) {
  const double a = std::fabs(static_cast<double>(static_cast<float>(v)));
  if (a < min_normal) return min_denormal;
  int e = 0;
  std::frexp(a, &e);
  return std::ldexp(1.0, e - 24);
}

// Random f32 whose bit patterns are uniform (so every binade is equally likely) with magnitudes
// in [lo, hi], both signs when `negative`.
std::vector<float> random_bits(std::size_t n, float lo, float hi, bool negative, unsigned seed) {
  std::mt19937 gen(seed);
  std::uint32_t blo, bhi;
  std::memcpy(&blo, &lo, 4);
  std::memcpy(&bhi, &hi, 4);
  std::uniform_int_distribution<std::uint32_t> bits(blo, bhi);
  std::vector<float> out(n);
  for (float& x : out) {
    std::uint32_t b = bits(gen) | (negative && (gen() & 1u) ? 0x80000000u : 0u);
    std::memcpy(&x, &b, 4);
  }
  return out;
}

std::vector<float> uniform(std::size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = u(gen);
  return out;
}

// The largest error of fn on k::cpu, in ulps, against the oracle; special values (an infinite or
// NaN result on either side) must agree exactly, and so must those of libm's function `libm`.
template <class Fn, class Libm>
double max_ulp(const char* name, std::vector<float> xs, Fn fn, Libm libm) {
  const std::vector<float> specials = {0.0f,
                                       -0.0f,
                                       inf,
                                       -inf,
                                       nan,
                                       min_denormal,
                                       -min_denormal,
                                       min_normal,
                                       -min_normal,
                                       1.0f,
                                       -1.0f,
                                       std::numeric_limits<float>::max(),
                                       -std::numeric_limits<float>::max()};
  xs.insert(xs.end(), specials.begin(), specials.end());
  const auto n = static_cast<std::int64_t>(xs.size());
  k::Tensor x = k::from_vector(xs, {n});
  k::Tensor y = fn(x);
  REQUIRE(y.dtype() == k::f32);
  REQUIRE(y.device() == k::cpu);
  std::vector<float> got = k::to_vector<float>(y);
  std::vector<double> want = k::to_vector<double>(k::reference::eval(fn(x)));
  double worst = 0;
  float worst_x = 0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const float w = static_cast<float>(want[i]);
    if (!std::isfinite(w) || !std::isfinite(got[i])) {
      INFO(std::string(name) << "(" << xs[i] << ") = " << got[i] << ", the oracle's " << want[i]);
      CHECK((std::isnan(w) ? std::isnan(got[i]) : got[i] == w));
      continue;
    }
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]) / ulp_at(want[i]);
    if (err > worst) worst = err, worst_x = xs[i];
  }
  for (float s : specials) {
    k::Tensor one = k::from_vector(std::vector<float>{s}, {1});
    const float mine = k::to_vector<float>(k::Tensor(fn(one)))[0];
    const float theirs = libm(s);
    INFO(std::string(name) << "(" << s << ") = " << mine << ", libm's " << theirs);
    if (!std::isfinite(theirs)) CHECK((std::isnan(theirs) ? std::isnan(mine) : mine == theirs));
    if (s == 0.0f) CHECK(std::signbit(mine) == std::signbit(theirs));
  }
  MESSAGE(std::string(name) << ": " << worst << " ulp at most (at x = " << worst_x << "), " << xs.size() << " inputs");
  return worst;
}

}  // namespace

TEST_CASE("cpu math: exp within 1.5 ulp, tails and denormal results included") {
  std::vector<float> xs = uniform(20011, -110.0f, 95.0f, 1);
  auto tails = uniform(4001, -104.0f, -86.0f, 2);  // results in and near the denormals
  auto top = uniform(1001, 87.0f, 89.0f, 3);       // near overflow
  auto small = random_bits(4001, min_denormal, 1.0f, true, 4);
  for (auto* v : {&tails, &top, &small}) xs.insert(xs.end(), v->begin(), v->end());
  auto fn = [](const k::Tensor& x) { return k::exp(x); };
  CHECK(max_ulp("exp", xs, fn, [](float v) { return std::exp(v); }) <= 1.5);
  // exp(0) is exactly 1, and softmax's exp(x - max) of the row's largest element with it.
  CHECK(k::to_vector<float>(k::Tensor(k::exp(k::zeros({3}))))[0] == 1.0f);
}

TEST_CASE("cpu math: log within 1.5 ulp over every binade, denormals included") {
  std::vector<float> xs = random_bits(30011, min_denormal, std::numeric_limits<float>::max(), false, 5);
  auto near_one = uniform(8009, 0.6f, 1.5f, 6);
  auto negative = uniform(101, -10.0f, -1e-30f, 7);  // NaN
  for (auto* v : {&near_one, &negative}) xs.insert(xs.end(), v->begin(), v->end());
  auto fn = [](const k::Tensor& x) { return k::log(x); };
  CHECK(max_ulp("log", xs, fn, [](float v) { return std::log(v); }) <= 1.5);
}

TEST_CASE("cpu math: tanh within 2 ulp, around its switch at 0.625 and in the tails") {
  std::vector<float> xs = random_bits(20011, min_denormal, 30.0f, true, 8);
  auto mid = uniform(8009, -12.0f, 12.0f, 9);
  auto edge = uniform(2003, 0.6f, 0.65f, 10);
  for (auto* v : {&mid, &edge}) xs.insert(xs.end(), v->begin(), v->end());
  auto fn = [](const k::Tensor& x) { return k::tanh(x); };
  CHECK(max_ulp("tanh", xs, fn, [](float v) { return std::tanh(v); }) <= 2.0);
}

TEST_CASE("cpu math: erf within 2 ulp, around its switch at 1 and its clamp at 4") {
  std::vector<float> xs = random_bits(20011, min_denormal, 10.0f, true, 11);
  auto mid = uniform(8009, -5.0f, 5.0f, 12);
  auto edge = uniform(2003, 0.95f, 1.05f, 13);
  for (auto* v : {&mid, &edge}) xs.insert(xs.end(), v->begin(), v->end());
  auto fn = [](const k::Tensor& x) { return k::erf(x); };
  CHECK(max_ulp("erf", xs, fn, [](float v) { return std::erf(v); }) <= 2.0);
}

TEST_CASE("cpu math: sigmoid within 3 ulp, tiny results of very negative inputs included") {
  std::vector<float> xs = uniform(20011, -120.0f, 120.0f, 14);
  auto small = random_bits(4001, min_denormal, 20.0f, true, 15);
  xs.insert(xs.end(), small.begin(), small.end());
  auto fn = [](const k::Tensor& x) { return k::sigmoid(x); };
  CHECK(max_ulp("sigmoid", xs, fn, [](float v) { return 1.0f / (1.0f + std::exp(-v)); }) <= 3.0);
}

// The f32 functions without a polynomial of kiln's own: glibc's vector variants where the probe
// found libmvec (host_probes.hpp; glibc documents them within 4 ulp), else libm's once a lane.
TEST_CASE("cpu math: sin, cos, exp2, log2, log1p, expm1 and pow within 4 ulp, libmvec where glibc has it") {
  const auto& t = k::runtime::detail::toolchain();
  MESSAGE("host kernels: " << k::runtime::host_compiler_command());
  if (t.gcc && k::runtime::detail::libmvec_offered() > 0)  // x86-64 glibc 2.22+ under GCC: the probe must pass
    CHECK(t.libmvec == k::runtime::detail::libmvec_offered());
  std::vector<float> trig = random_bits(20011, min_denormal, std::numeric_limits<float>::max(), true, 40);
  auto near = uniform(8009, -40.0f, 40.0f, 41);
  trig.insert(trig.end(), near.begin(), near.end());
  CHECK(max_ulp(
            "sin", trig, [](const k::Tensor& x) { return k::sin(x); }, [](float v) { return std::sin(v); }) <= 4.0);
  CHECK(max_ulp(
            "cos", trig, [](const k::Tensor& x) { return k::cos(x); }, [](float v) { return std::cos(v); }) <= 4.0);
  std::vector<float> e = uniform(20011, -160.0f, 130.0f, 42);
  auto small = random_bits(4001, min_denormal, 1.0f, true, 43);
  e.insert(e.end(), small.begin(), small.end());
  CHECK(max_ulp(
            "exp2", e, [](const k::Tensor& x) { return k::exp2(x); }, [](float v) { return std::exp2(v); }) <= 4.0);
  std::vector<float> m1 = uniform(20011, -20.0f, 89.0f, 44);
  m1.insert(m1.end(), small.begin(), small.end());
  CHECK(max_ulp(
            "expm1", m1, [](const k::Tensor& x) { return k::expm1(x); }, [](float v) { return std::expm1(v); }) <= 4.0);
  std::vector<float> positive = random_bits(20011, min_denormal, std::numeric_limits<float>::max(), false, 45);
  CHECK(max_ulp(
            "log2", positive, [](const k::Tensor& x) { return k::log2(x); }, [](float v) { return std::log2(v); }) <=
        4.0);
  std::vector<float> p1 = uniform(8009, -0.999f, 4.0f, 46);
  p1.insert(p1.end(), positive.begin(), positive.end());
  p1.insert(p1.end(), small.begin(), small.end());
  CHECK(max_ulp(
            "log1p", p1, [](const k::Tensor& x) { return k::log1p(x); }, [](float v) { return std::log1p(v); }) <= 4.0);
  std::vector<float> base = random_bits(20011, 1e-3f, 1e3f, false, 47);
  CHECK(max_ulp(
            "pow", base, [](const k::Tensor& x) { return k::pow(x, 1.37f); },
            [](float v) { return std::pow(v, 1.37f); }) <= 4.0);
}

TEST_CASE("cpu math: fused in one kernel over an odd 2-D shape, and gelu through erf") {
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 16) * 3.0f;
  auto w1b = [](const auto& a) { return k::sigmoid(k::tanh(a * 0.5f + 0.1f) * a) * k::exp(-a * a); };
  k::Tensor got = w1b(x);
  k::Tensor want = k::reference::eval(w1b(x));
  auto g = k::to_vector<float>(got);
  auto w = k::to_vector<double>(want);
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    worst = std::max(worst, std::fabs(g[i] - w[i]) / (std::fabs(w[i]) + 1e-30));
  // Relative to the result: exp(-x^2) inherits the rounding of x^2 in f32 (x^2 2^-24 relative).
  MESSAGE("sigmoid(tanh(x*.5+.1)*x)*exp(-x*x): " << worst << " relative at most");
  CHECK(worst < 2e-5);
  k::Tensor gelu = k::gelu(x);
  auto gg = k::to_vector<float>(gelu);
  auto gw = k::to_vector<double>(k::reference::eval(k::gelu(x)));
  double worst_abs = 0;
  for (std::size_t i = 0; i < gg.size(); ++i) worst_abs = std::max(worst_abs, std::fabs(gg[i] - gw[i]));
  CHECK(worst_abs < 1e-6);
}

TEST_CASE("cpu math: f64 keeps libm's functions") {
  std::vector<double> xs = {-700.0, -1.5, -1e-300, 0.0, 0.3, 2.0, 50.0, 700.0};
  k::Tensor x = k::from_vector(xs, {static_cast<std::int64_t>(xs.size())});
  auto e = k::to_vector<double>(k::Tensor(k::exp(x)));
  auto t = k::to_vector<double>(k::Tensor(k::tanh(x)));
  for (std::size_t i = 0; i < xs.size(); ++i) {
    CHECK(e[i] == std::exp(xs[i]));
    CHECK(t[i] == std::tanh(xs[i]));
  }
}

// The NaN-propagating maximum and minimum (prelude_cpu_tiles.hpp: whole vectors of the target's
// width): row reductions and the pointwise ops, NaN and infinities at every lane position of a
// tile and in a row's masked tail, equal to the oracle exactly (NaN where it is NaN).
TEST_CASE("cpu math: maximum and minimum, as row reductions and pointwise, keep NaN at every lane") {
  const std::int64_t rows = 41, cols = 1003;  // 1003: a partial tile at each row's end
  const float quiet = std::numeric_limits<float>::quiet_NaN();
  for (bool f64 : {false, true}) {
    CAPTURE(f64);
    std::vector<float> xs = uniform(static_cast<std::size_t>(rows * cols), -100.0f, 100.0f, 31);
    std::vector<float> ys = uniform(xs.size(), -100.0f, 100.0f, 32);
    for (std::int64_t r = 0; r < rows; ++r) {  // row r: a special value at column (r * 37) % cols
      const std::size_t at = static_cast<std::size_t>(r * cols + (r * 37) % cols);
      xs[at] = r % 4 == 0 ? quiet : r % 4 == 1 ? inf : r % 4 == 2 ? -inf : xs[at];
      if (r % 5 == 0) ys[static_cast<std::size_t>(r * cols + cols - 1 - r)] = quiet;
    }
    k::Tensor x = k::from_vector(xs, {rows, cols}), y = k::from_vector(ys, {rows, cols});
    if (f64) x = k::Tensor(k::cast(x, k::f64)), y = k::Tensor(k::cast(y, k::f64));
    auto same = [](const k::Tensor& got, const k::Tensor& want) {
      auto g = k::to_vector<double>(k::Tensor(k::cast(got, k::f64)));
      auto w = k::to_vector<double>(want);
      int bad = 0;
      for (std::size_t i = 0; i < g.size(); ++i) bad += std::isnan(w[i]) ? !std::isnan(g[i]) : g[i] != w[i];
      return bad;
    };
    CHECK(same(k::amax(x, -1), k::reference::eval(k::amax(x, -1))) == 0);
    CHECK(same(k::amin(x, -1), k::reference::eval(k::amin(x, -1))) == 0);
    CHECK(same(k::maximum(x, y), k::reference::eval(k::maximum(x, y))) == 0);
    CHECK(same(k::minimum(x, y), k::reference::eval(k::minimum(x, y))) == 0);
    // A scalar operand (a tile of equal lanes), on either side, finite or NaN.
    for (double c : {0.25, -37.5, double(quiet)}) {
      CAPTURE(c);
      CHECK(same(k::maximum(x, c), k::reference::eval(k::maximum(x, c))) == 0);
      CHECK(same(k::minimum(c, x), k::reference::eval(k::minimum(c, x))) == 0);
      CHECK(same(k::maximum(c, x) * 2.0, k::reference::eval(k::maximum(c, x) * 2.0)) == 0);
      CHECK(same(k::minimum(x, c) * 0.5, k::reference::eval(k::minimum(x, c) * 0.5)) == 0);  // exact scalings only
    }
    auto s = k::to_vector<double>(k::Tensor(k::cast(k::softmax(x, -1), k::f64)));
    for (std::int64_t r = 0; r < rows; r += 4) CHECK(std::isnan(s[static_cast<std::size_t>(r * cols)]));
  }
}

TEST_CASE("cpu math: 512-bit vectors are preferred exactly where the CPU has AVX-512") {
  using kiln::runtime::detail::cpu_tuning_flags;
  const std::string xeon = "x86_64\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse2 avx2 avx512f avx512dq amx_tile";
  CHECK(cpu_tuning_flags(xeon) == std::vector<std::string>{"-mprefer-vector-width=512"});
  CHECK(cpu_tuning_flags("x86_64\nflags\t\t: fpu avx2 avx512f") == std::vector<std::string>{"-mprefer-vector-width=512"});
  CHECK(cpu_tuning_flags("x86_64\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma").empty());
  CHECK(cpu_tuning_flags("x86_64\nflags\t\t: fpu avx512fp16x").empty());  // not the flag itself
  CHECK(cpu_tuning_flags("aarch64\nFeatures\t: fp asimd sve").empty());
  // This machine's flags hold exactly when its identity names the feature.
  const std::string self = kiln::runtime::detail::cpu_identity();
  CHECK(cpu_tuning_flags(self).empty() == (self.find("avx512f") == std::string::npos));
}
