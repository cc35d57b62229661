// Capture that scales (issue 25): a chain of N residual blocks h = layer_norm(h + gelu(h @ w), g, b)
// written as one compiled function, on the CPU at a small size (8 x 16) so that the host's work
// shows: distinct nodes of the expression, the first call with an empty kernel cache, a second
// compile of the same function (its kernels cached), and the cached call. Targets: the cached call
// of 12 blocks within 15x that of 1 block, 24 blocks within 30x.
// Usage: deep_capture [max blocks, default 24] [cpu|cuda, default cpu]. Sets KILN_CACHE_DIR to a
// fresh folder. On CUDA the cached call is timed with a synchronisation after each call.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

#include <kiln/kiln.hpp>

namespace k = kiln;

namespace {

template <int N>
auto residual_chain(auto h, auto w, auto g, auto b) {
  if constexpr (N == 0) {
    return h;
  } else {
    auto r = residual_chain<N - 1>(h, w, g, b);
    return k::layer_norm(r + k::gelu(k::matmul(r, w)), g, b);
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median over 7 rounds of the time of one call, in microseconds.
template <class F>
double call_us(F&& f, int calls) {
  std::vector<double> t;
  for (int r = 0; r < 7; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) f();
    t.push_back(seconds_since(t0) * 1e6 / calls);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Row {
  int blocks, nodes, kernels;
  double cold_s, again_s, call_us;
};

template <int N>
Row measure(const k::Tensor& h, const k::Tensor& w, const k::Tensor& g, const k::Tensor& b) {
  auto fn = [](auto h, auto w, auto g, auto b) { return residual_chain<N>(h, w, g, b); };
  Row row{N, 0, 0, 0, 0, 0};
  {
    auto e = fn(h, w, g, b);
    k::graph::Captured cap;
    k::graph::gather(e, cap);
    row.nodes = cap.na - (cap.meetings > 0);
  }
  auto t0 = std::chrono::steady_clock::now();
  auto f = k::compile(fn);
  k::Tensor y = f(h, w, g, b);
  row.cold_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  auto f2 = k::compile(fn);
  y = f2(h, w, g, b);
  row.again_s = seconds_since(t0);
  row.kernels = static_cast<int>(k::explain(f, h, w, g, b).kernels.size());
  row.call_us = call_us(
      [&] {
        y = f(h, w, g, b);
        if (y.device().is_cuda()) k::synchronize();
      },
      N >= 12 ? 500 : 2000);
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  int max_blocks = argc > 1 ? std::atoi(argv[1]) : 24;
  const k::Device dev = argc > 2 && std::string(argv[2]) == "cuda" ? k::Device(k::cuda) : k::Device(k::cpu);
  auto dir = std::filesystem::temp_directory_path() / ("kiln-deep-capture-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  ::setenv("KILN_CACHE_DIR", dir.c_str(), 1);
  k::Tensor h = k::randn({8, 16}, k::f32, dev, 1), w = k::randn({16, 16}, k::f32, dev, 2) * 0.1,
            g = k::randn({16}, k::f32, dev, 3), b = k::randn({16}, k::f32, dev, 4);
  std::printf("device %s\n", dev.str().c_str());
  std::vector<Row> rows;
  rows.push_back(measure<1>(h, w, g, b));
  if (max_blocks >= 4) rows.push_back(measure<4>(h, w, g, b));
  if (max_blocks >= 8) rows.push_back(measure<8>(h, w, g, b));
  if (max_blocks >= 12) rows.push_back(measure<12>(h, w, g, b));
  if (max_blocks >= 24) rows.push_back(measure<24>(h, w, g, b));
  std::printf(
      "| blocks | distinct nodes | kernels | first call, empty cache (s) | compiled again, kernels cached (s) | cached "
      "call (us) | x 1 block |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %d | %d | %d | %.3f | %.4f | %.1f | %.1f |\n", r.blocks, r.nodes, r.kernels, r.cold_s, r.again_s,
                r.call_us, r.call_us / rows[0].call_us);
  std::filesystem::remove_all(dir);
}
