// Dynamic against static kernels (issue 19 item 2): each function compiled twice in one process,
// `.shapes = static_` and `dynamic`, timed at the same shape (median of 7 samples of 50 calls) and
// their outputs compared; then column reductions over odd widths (split column sums, a norm
// backward's dw and db), some planned at one width and timed at another (the program's kernels for
// other sizes). For an A/B, run it again under a tuning variable (KILN_TUNE_DYNAMIC_ROWS=0: rows of
// symbolic length looped; KILN_TUNE_INDEX32=0: i64 indices; KILN_TUNE_COLUMN_ROWS=0: column blocks
// walked flat across kept rows, benchmarks/NOTES.md item 138). Needs a CUDA device.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>
#include <tuple>

#include "timing.hpp"
namespace k = kiln;
template <class F, class... T>
double time_ms(F& f, const T&... a) {
  for (int i = 0; i < 10; ++i) f(a...);
  k::synchronize();
  std::vector<double> t;
  for (int r = 0; r < 7; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 50; ++i) f(a...);
    k::synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 50);
  }
  std::sort(t.begin(), t.end());
  return t[3];
}
// Whether two results (a tensor, or a gradient's tuple of them) agree.
bool same(const k::Tensor& a, const k::Tensor& b) { return bool(k::testing::allclose(a, b, 1e-2, 1e-2)); }
template <class... T>
bool same(const std::tuple<T...>& a, const std::tuple<T...>& b) {
  return std::apply(
      [&](const auto&... x) { return std::apply([&](const auto&... y) { return (same(x, y) && ...); }, b); }, a);
}
template <class Fn, class... T>
void row(const char* name, Fn fn, const T&... a) {
  auto fs = k::compile(fn, {.shapes = k::shapes::static_});
  auto fd = k::compile(fn, {.shapes = k::shapes::dynamic});
  double s = time_ms(fs, a...), d = time_ms(fd, a...);
  const bool r = same(fd(a...), fs(a...));
  std::printf("%-34s static %.4f ms  dynamic %.4f ms  dyn/static %.2f  %s\n", name, s, d, d / s,
              r ? "equal" : "DIFFER");
}
// A dynamic program planned at the arguments `plan`, timed at `run` against a static one there.
template <class Fn, class... T>
void planned_elsewhere(const char* name, Fn fn, const std::tuple<T...>& plan, const std::tuple<T...>& run) {
  auto fs = k::compile(fn, {.shapes = k::shapes::static_});
  auto fd = k::compile(fn, {.shapes = k::shapes::dynamic});
  std::apply(fd, plan);
  double s = std::apply([&](const auto&... a) { return time_ms(fs, a...); }, run);
  double d = std::apply([&](const auto&... a) { return time_ms(fd, a...); }, run);
  const bool r = same(std::apply(fd, run), std::apply(fs, run));
  std::printf("%-34s static %.4f ms  dynamic %.4f ms  dyn/static %.2f  %s\n", name, s, d, d / s,
              r ? "equal" : "DIFFER");
}

void odd_widths() {
  auto ln = [](auto a, auto w, auto b) { return k::layer_norm(a, w, b); };
  auto rn = [](auto a, auto w) { return k::rms_norm(a, w); };
  auto colsum = [](auto a) { return k::sum(a, 0); };
  auto args = [](std::int64_t r, std::int64_t c, k::dtype dt, std::uint64_t s) {
    return std::make_tuple(k::randn({r, c}, dt, k::cuda, s), k::randn({c}, dt, k::cuda, s + 1),
                           k::randn({c}, dt, k::cuda, s + 2), k::randn({r, c}, dt, k::cuda, s + 3));
  };
  for (auto dt : {k::bf16, k::f32}) {
    auto [x, w, b, dy] = args(dt == k::bf16 ? 2670 : 1335, 50257, dt, 20);
    row(dt == k::bf16 ? "layer_norm_bwd 2670x50257 bf16" : "layer_norm_bwd 1335x50257 f32", k::vjp(ln, k::wrt<0, 1, 2>),
        x, w, b, dy);
    row(dt == k::bf16 ? "rms_norm_bwd 2670x50257 bf16" : "rms_norm_bwd 1335x50257 f32", k::vjp(rn, k::wrt<0, 1>), x, w,
        dy);
  }
  row("colsum 1031x50021 f32", colsum, k::randn({1031, 50021}, k::f32, k::cuda, 30));
  row("colsum 8192x12289 bf16", colsum, k::randn({8192, 12289}, k::bf16, k::cuda, 31));
  row("colsum 65536x1001 f32", colsum, k::randn({65536, 1001}, k::f32, k::cuda, 32));
  planned_elsewhere("colsum 16384x4099 (planned at 4096)", colsum,
                    std::make_tuple(k::randn({16384, 4096}, k::f32, k::cuda, 33)),
                    std::make_tuple(k::randn({16384, 4099}, k::f32, k::cuda, 34)));
  planned_elsewhere("layer_norm_bwd 8192x771 bf16 (at 768)", k::vjp(ln, k::wrt<0, 1, 2>), args(8192, 768, k::bf16, 35),
                    args(8192, 771, k::bf16, 39));
}

int main() {
  if (!kiln_bench::cuda_device_present()) {
    std::printf("dynamic_static: no CUDA device\n");
    return 0;
  }
  auto x = k::randn({16384, 4096}, k::f32, k::cuda, 1), w = k::randn({4096}, k::f32, k::cuda, 2);
  auto xb = k::randn({16384, 4096}, k::bf16, k::cuda, 3), wb = k::randn({4096}, k::bf16, k::cuda, 4);
  auto h = k::randn({8, 1024, 12, 64}, k::bf16, k::cuda, 5);
  row("W3 softmax 16384x4096 f32", [](auto a) { return k::softmax(a, -1); }, x);
  row("W4 layer_norm 16384x4096 f32", [](auto a, auto g) { return k::layer_norm(a, g, g); }, x, w);
  row("W6 rms_norm 16384x4096 bf16", [](auto a, auto g) { return k::rms_norm(a, g); }, xb, wb);
  auto xo = k::randn({8192, 3000}, k::f32, k::cuda, 6);
  auto xc = k::randn({4096, 5120}, k::bf16, k::cuda, 7), wc = k::randn({5120}, k::bf16, k::cuda, 8);
  row("softmax 8192x3000 f32", [](auto a) { return k::softmax(a, -1); }, xo);
  row("layer_norm 4096x5120 bf16", [](auto a, auto g) { return k::layer_norm(a, g, g); }, xc, wc);
  row("log_softmax 8192x3000 f32", [](auto a) { return k::log_softmax(a, -1); }, xo);
  row("heads permute [8,1024,12,64] bf16", [](auto a) { return k::permute(a, {0, 2, 1, 3}) * 2.0f; }, h);
  odd_widths();
}
