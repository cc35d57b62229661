// Several GPUs (issue 24), on the GPUs of this host:
//   1. k::all_reduce's bus bandwidth against ncclAllReduce called directly on the same buffers in
//      the same program (the two interleaved, f32 and bf16, 8 MiB to 1 GiB);
//   2. data-parallel training of an MLP at a fixed per-GPU batch: samples/s on one GPU and on all of
//      them (k::dist::data_parallel over a value_and_grad, AdamW in one program per step), with the
//      gradient all-reduces overlapping the backward and, for comparison, after it.
// Prints one line per measurement; `dist_bench [gpus]` (default: all of this host's).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <kiln/distributed.hpp>

namespace k = kiln;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Bus bandwidth (NCCL's definition for all-reduce: 2 (n-1)/n of the bytes, over the time).
double bus_gbs(double bytes, double s, int n) { return bytes / s * 2.0 * (n - 1) / n / 1e9; }

void bandwidth(k::dist::group& g) {
  namespace nccl = k::runtime::nccl;
  const int n = g.world_size();
  for (k::dtype dt : {k::f32, k::bf16})
    for (std::int64_t mib : {8, 64, 256, 1024}) {
      const std::int64_t count = mib * 1024 * 1024 / static_cast<std::int64_t>(k::itemsize(dt));
      k::Tensor x = k::randn({count}, dt, g.device(), 1 + static_cast<std::uint64_t>(g.rank()));
      k::Tensor out = k::empty({count}, dt, g.device());
      auto run_kiln = [&] { k::eval(out, k::all_reduce(x, g)); };
      auto run_nccl = [&] {
        nccl::check(nccl::api().all_reduce(x.data_ptr(), out.data_ptr(), static_cast<std::size_t>(count),
                                           nccl::data_type(dt), nccl::sum, g.native(), nullptr),
                    "ncclAllReduce", "dist_bench");
      };
      const int iters = mib >= 256 ? 10 : 40;
      auto time_of = [&](auto&& run) {
        run();
        k::synchronize();
        auto t0 = clock_type::now();
        for (int i = 0; i < iters; ++i) run();
        k::synchronize();
        return seconds_since(t0) / iters;
      };
      double best_kiln = 1e30, best_nccl = 1e30;
      for (int round = 0; round < 3; ++round) {  // interleaved: kiln, then NCCL, three times
        best_kiln = std::min(best_kiln, time_of(run_kiln));
        best_nccl = std::min(best_nccl, time_of(run_nccl));
      }
      if (g.rank() == 0)
        std::printf("all_reduce %s %5lld MiB on %d GPUs: kiln %.1f GB/s, ncclAllReduce %.1f GB/s (bus), ratio %.3f\n",
                    std::string(k::name(dt)).c_str(), static_cast<long long>(mib), n,
                    bus_gbs(mib * 1048576.0, best_kiln, n), bus_gbs(mib * 1048576.0, best_nccl, n),
                    best_nccl / best_kiln);
    }
}

// One rank's training: a [batch, 1024] -> 4096 -> 1024-class MLP, bf16 matmuls off (f32 throughout).
double samples_per_second(k::dist::group& g, std::int64_t batch, int steps, bool overlap = true) {
  const std::int64_t d = 1024, h = 4096, classes = 1024;
  const k::Device dev = g.device();
  const auto seed = static_cast<std::uint64_t>(g.rank());
  k::Tensor x = k::randn({batch, d}, k::f32, dev, 10 + seed);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(batch));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int64_t>((i * 131 + seed) % classes);
  k::Tensor y = k::from_vector(labels, {batch}).to(dev);
  std::vector<k::Tensor> p = {k::Tensor(k::randn({h, d}, k::f32, dev, 1) * 0.03f), k::zeros({h}, k::f32, dev),
                              k::Tensor(k::randn({classes, h}, k::f32, dev, 2) * 0.015f),
                              k::zeros({classes}, k::f32, dev)};
  std::vector<k::Tensor> m, v;
  for (auto& t : p) m.push_back(k::zeros(t.shape(), k::f32, dev)), v.push_back(k::zeros(t.shape(), k::f32, dev));
  auto loss = [](auto x, auto y, auto p) {
    return k::cross_entropy(k::linear(k::gelu(k::linear(x, p[0], p[1])), p[2], p[3]), y);
  };
  auto step = k::dist::data_parallel(k::value_and_grad(loss, k::wrt<2>), g, {.bucket_mb = 25, .overlap = overlap});
  float lr = 1e-3f;
  auto adamw = k::compile([&](auto p, auto g, auto m, auto v) {
    auto m2 = m * 0.9f + g * 0.1f;
    auto v2 = v * 0.999f + g * g * 0.001f;
    return std::make_tuple(k::assign(p, p * (1 - lr * 0.01f) - m2 / (k::sqrt(v2) + 1e-8f) * lr), k::assign(m, m2),
                           k::assign(v, v2));
  });
  auto one = [&] {
    auto [l, grads] = step(x, y, p);
    for (std::size_t i = 0; i < p.size(); ++i) adamw(p[i], grads[i], m[i], v[i]);
    return l;
  };
  float first = k::to_vector<float>(one())[0];
  for (int i = 0; i < 3; ++i) one();
  k::synchronize();
  auto t0 = clock_type::now();
  k::Tensor last;
  for (int i = 0; i < steps; ++i) last = one();
  k::synchronize();
  const double s = seconds_since(t0);
  if (g.rank() == 0)
    std::printf("  rank 0 loss %.4f -> %.4f over %d steps\n", first, k::to_vector<float>(last)[0], steps + 4);
  return static_cast<double>(batch) * g.world_size() * steps / s;
}

}  // namespace

int main(int argc, char** argv) {
  if (!k::driver::available()) {
    std::printf("dist_bench: no CUDA device on this machine; nothing to measure\n");
    return 0;
  }
  const int gpus = argc > 1 ? std::atoi(argv[1]) : k::driver::device_count();
  std::printf("dist_bench on %d x %s, NCCL %d\n", gpus, k::driver::device_name(0).c_str(),
              k::runtime::nccl::available() ? k::runtime::nccl::api().version : 0);
  if (gpus > 1) k::dist::spawn(gpus, bandwidth);
  const std::int64_t batch = 4096;
  const int steps = 30;
  double one = 0, all = 0;
  k::dist::spawn(1, [&](k::dist::group& g) { one = samples_per_second(g, batch, steps); });
  std::printf("data-parallel MLP 1024-4096-1024, batch %lld per GPU: 1 GPU %.0f samples/s\n",
              static_cast<long long>(batch), one);
  if (gpus > 1)
    for (bool overlap : {true, false}) {
      k::dist::spawn(gpus, [&](k::dist::group& g) {
        double r = samples_per_second(g, batch, steps, overlap);
        if (g.rank() == 0) all = r;
      });
      std::printf("data-parallel MLP 1024-4096-1024, batch %lld per GPU: %d GPUs %.0f samples/s, %.2fx one GPU (%s)\n",
                  static_cast<long long>(batch), gpus, all, all / one,
                  overlap ? "all-reduce overlapping the backward" : "all-reduce after the backward");
    }
  return 0;
}
