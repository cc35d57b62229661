// One row op at one shape, timed as the shape sweep times it (CUDA events after an L2 flush, median
// of 30), for comparing the row kernels' tuning variables side by side (NOTES item 98): run it once
// a process under each KILN_TUNE_* setting (benchmarks/row_knobs.sh). 256 MiB inputs.
// Usage: row_knobs <layer_norm|softmax|rms_norm> <row length> <f32|bf16>. Needs a CUDA device.
#include <kiln/kiln.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "timing.hpp"
namespace k = kiln;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: row_knobs <layer_norm|softmax|rms_norm> <row length> <f32|bf16>\n");
    return 2;
  }
  if (!kiln_bench::cuda_device_present()) {
    std::printf("row_knobs: no CUDA device\n");
    return 0;
  }
  const std::string op = argv[1];
  const std::int64_t cols = std::atoll(argv[2]);
  const k::dtype dt = std::strcmp(argv[3], "bf16") == 0 ? k::bf16 : k::f32;
  const std::int64_t bytes = dt == k::bf16 ? 2 : 4, rows = (std::int64_t{256} << 20) / (cols * bytes);
  auto x = k::randn({rows, cols}, dt, k::cuda, 1), w = k::randn({cols}, dt, k::cuda, 2),
       b = k::randn({cols}, dt, k::cuda, 3);
  auto ln = k::compile([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); });
  auto sm = k::compile([](auto x) { return k::softmax(x, -1); });
  auto rn = k::compile([](auto x, auto w) { return k::rms_norm(x, w); });
  std::function<void()> f;
  if (op == "layer_norm") f = [&] { ln(x, w, b); };
  if (op == "softmax") f = [&] { sm(x); };
  if (op == "rms_norm") f = [&] { rn(x, w); };
  if (!f) {
    std::fprintf(stderr, "row_knobs: unknown op %s\n", op.c_str());
    return 2;
  }
  f();
  const double ms = kiln_bench::cuda_time_ms(f, 30);
  const double moved = 2.0 * static_cast<double>(rows * cols * bytes);  // read x, write y
  std::printf("%-10s %lldx%lld %s %.4f ms %.0f GB/s\n", op.c_str(), static_cast<long long>(rows),
              static_cast<long long>(cols), argv[3], ms, moved / ms / 1e6);
  return 0;
}
