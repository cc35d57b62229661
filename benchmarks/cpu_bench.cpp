// The CPU path (issue 23): BENCHMARKS.md's W1, W1b, W3 and W4 at CPU sizes on k::cpu, W2's shape
// `gelu(a @ b + bias)` against the host BLAS's GEMM alone, and the first call of a CPU kernel with
// an empty disk cache. Each workload is checked against the f64 oracle on its first rows, then timed
// on the wall clock (warm-up, median). Prints one JSON object a line in bench.cpp's format, ids
// `cpu-W1` ...; a torch peer printing the same ids with impl "torch.compile" lines up with it.
// Usage: cpu_bench [reps] [only-ids,comma-separated]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

int reps = 15;
std::string only;

bool selected(const std::string& id) {
  return only.empty() || ("," + only + ",").find("," + id + ",") != std::string::npos;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Median wall-clock milliseconds of fn() over reps, after two warm-up calls (the first compiles).
double time_ms(const std::function<void()>& fn) {
  fn(), fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    double t0 = now_ms();
    fn();
    t.push_back(now_ms() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// bytes: those that must move (GB/s); for a GEMM, its flops instead (the field is then "gflops").
void emit(const std::string& id, const std::string& what, double ms, double bytes, const std::string& impl = "kiln",
          const char* rate = "gbps") {
  std::printf("{\"id\": \"%s\", \"impl\": \"%s\", \"ms\": %.3f, \"%s\": %.2f, \"note\": \"%s\"}\n", id.c_str(),
              impl.c_str(), ms, rate, bytes / ms / 1e6, what.c_str());
  std::fflush(stdout);
}

// The first `rows` rows of got against the oracle of the same expression on those rows.
template <class Check>
void check(const std::string& id, Check&& check_fn) {
  auto r = check_fn();
  if (!r) std::printf("{\"id\": \"%s\", \"impl\": \"kiln\", \"error\": \"wrong result\"}\n", id.c_str());
}

k::Tensor head(const k::Tensor& t, std::int64_t rows) { return k::Tensor(k::slice(t, 0, 0, rows)).contiguous(); }

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) reps = std::atoi(argv[1]);
  if (argc > 2) only = argv[2];
  // A fresh disk cache, so the first call below compiles (and the others do not reuse stale kernels).
  std::string cache =
      (std::filesystem::temp_directory_path() / ("kiln-cpu-bench-" + std::to_string(::getpid()))).string();
  setenv("KILN_CACHE_DIR", cache.c_str(), 1);
  std::printf("# cpu_bench: %u hardware threads, BLAS %s, host compiler %s\n", std::thread::hardware_concurrency(),
              k::runtime::cpu_blas_name().empty() ? "(none: blocked GEMM)" : k::runtime::cpu_blas_name().c_str(),
              k::runtime::host_compiler_command().c_str());

  const std::int64_t n = std::int64_t{1} << 24;
  k::Tensor x = k::randn({n}, k::f32, k::cpu, 1);
  if (selected("cpu-W11")) {  // first call: capture, schedule, host compile, load, run
    auto f = k::compile([](auto a) { return k::relu(a * 2.0f + 1.0f); });
    k::Tensor small = k::randn({1024}, k::f32, k::cpu, 9);
    double t0 = now_ms();
    k::Tensor y = f(small);
    emit("cpu-W11", "first call of relu(x*2+1), empty disk cache", now_ms() - t0, 0);
  }
  if (selected("cpu-W1")) {
    auto f = k::compile([](auto a) { return k::relu(a * 2.0f + 1.0f); });
    k::Tensor y = f(x);
    check("cpu-W1", [&] {
      return k::testing::allclose(head(y, 4096), k::reference::eval(k::relu(head(x, 4096) * 2.0f + 1.0f)), 1e-6, 1e-6);
    });
    emit("cpu-W1", "relu(x*2+1) 2^24 f32", time_ms([&] { f(x); }), 8.0 * n);
  }
  if (selected("cpu-W1b")) {
    auto fn = [](auto a) { return k::sigmoid(k::tanh(a * 0.5f + 0.1f) * a) * k::exp(-a * a); };
    auto f = k::compile(fn);
    k::Tensor y = f(x);
    check("cpu-W1b",
          [&] { return k::testing::allclose(head(y, 4096), k::reference::eval(fn(head(x, 4096))), 1e-5, 1e-6); });
    emit("cpu-W1b", "sigmoid(tanh(x*.5+.1)*x)*exp(-x*x) 2^24 f32", time_ms([&] { f(x); }), 8.0 * n);
  }
  k::Tensor m = k::randn({4096, 1024}, k::f32, k::cpu, 2);
  if (selected("cpu-W3")) {
    auto f = k::compile([](auto a) { return k::softmax(a, -1); });
    k::Tensor y = f(m);
    check("cpu-W3", [&] {
      return k::testing::allclose(head(y, 64), k::reference::eval(k::softmax(head(m, 64), -1)), 1e-5, 1e-7);
    });
    emit("cpu-W3", "softmax 4096x1024 f32", time_ms([&] { f(m); }), 8.0 * m.numel());
  }
  if (selected("cpu-W4")) {
    k::Tensor w = k::randn({1024}, k::f32, k::cpu, 3), b = k::randn({1024}, k::f32, k::cpu, 4);
    auto f = k::compile([](auto a, auto w, auto b) { return k::layer_norm(a, w, b); });
    k::Tensor y = f(m, w, b);
    check("cpu-W4", [&] {
      return k::testing::allclose(head(y, 64), k::reference::eval(k::layer_norm(head(m, 64), w, b)), 1e-4, 1e-5);
    });
    emit("cpu-W4", "layer_norm 4096x1024 f32", time_ms([&] { f(m, w, b); }), 8.0 * m.numel());
  }
  if (selected("cpu-W2")) {
    const std::int64_t s = 1024;
    k::Tensor a = k::randn({s, s}, k::f32, k::cpu, 5), bm = k::randn({s, s}, k::f32, k::cpu, 6);
    k::Tensor bias = k::randn({s}, k::f32, k::cpu, 7), out = k::empty({s, s}, k::f32, k::cpu);
    auto f = k::compile([](auto a, auto b, auto c) { return k::gelu(k::matmul(a, b) + c); });
    k::Tensor y = f(a, bm, bias);
    check("cpu-W2", [&] {
      return k::testing::allclose(head(y, 16), k::reference::eval(k::gelu(k::matmul(head(a, 16), bm) + bias)), 1e-4,
                                  1e-4);
    });
    const double flops = 2.0 * s * s * s;
    emit("cpu-W2", "gelu(a@b+bias) 1024^3 f32", time_ms([&] { f(a, bm, bias); }), flops, "kiln", "gflops");
    emit("cpu-W2", "the GEMM alone (k::runtime::cpu_matmul)", time_ms([&] { k::runtime::cpu_matmul(a, bm, out); }),
         flops, "blas", "gflops");
  }
  std::error_code ec;
  std::filesystem::remove_all(cache, ec);
  return 0;
}
