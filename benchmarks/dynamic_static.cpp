// Dynamic against static kernels (issue 19 item 2): each function compiled twice in one process,
// `.shapes = static_` and `dynamic`, timed at the same shape (median of 7 samples of 50 calls) and
// their outputs compared. For an A/B, run it again under a tuning variable (KILN_TUNE_DYNAMIC_ROWS=0:
// rows of symbolic length looped; KILN_TUNE_INDEX32=0: i64 indices). Needs a CUDA device.
#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>

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
template <class Fn, class... T>
void row(const char* name, Fn fn, const T&... a) {
  auto fs = k::compile(fn, {.shapes = k::shapes::static_});
  auto fd = k::compile(fn, {.shapes = k::shapes::dynamic});
  double s = time_ms(fs, a...), d = time_ms(fd, a...);
  auto r = k::testing::allclose(fd(a...), fs(a...), 1e-2, 1e-2);
  std::printf("%-34s static %.4f ms  dynamic %.4f ms  dyn/static %.2f  %s\n", name, s, d, d / s, bool(r) ? "equal" : "DIFFER");
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
}
