// The CPU path (issue 23): BENCHMARKS.md's W1-W8 and W12 at CPU sizes on k::cpu, f32 (W2's shape
// `gelu(a @ b + bias)` also against the host BLAS's GEMM alone), and the first call of a CPU kernel
// with an empty disk cache. benchmarks/cpu_peer.py times the same workloads under torch.compile. Each workload is checked against the f64 oracle on its first rows, then timed
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
#include <tuple>
#include <type_traits>
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

k::Tensor f64(const k::Tensor& t) { return k::Tensor(k::cast(t, k::f64)); }

// A compiled function's results as a list (one tensor, or a tuple of them).
template <class R>
std::vector<k::Tensor> tensors(R&& r) {
  if constexpr (std::is_same_v<std::decay_t<R>, k::Tensor>)
    return {r};
  else
    return std::apply([](auto&... t) { return std::vector<k::Tensor>{k::Tensor(t)...}; }, r);
}

// got (from f32 inputs) against want (the same function on the inputs in f64, a program of its
// own): a wrong kernel shows, f32 rounding stays within tol.
bool close(const std::vector<k::Tensor>& got, const std::vector<k::Tensor>& want, double tol) {
  bool ok = got.size() == want.size();
  for (std::size_t i = 0; ok && i < got.size(); ++i) ok = k::testing::allclose(got[i], want[i], tol, tol);
  return ok;
}

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
  if (selected("cpu-W1d")) {  // rotary-style trigonometry: libm's sinf/cosf once a lane, or glibc's vector variants
    auto fn = [](auto a) { return k::sin(a) * k::cos(a * 0.5f); };
    auto f = k::compile(fn);
    k::Tensor y = f(x);
    check("cpu-W1d",
          [&] { return k::testing::allclose(head(y, 4096), k::reference::eval(fn(head(x, 4096))), 1e-5, 1e-6); });
    emit("cpu-W1d", "sin(x)*cos(x*.5) 2^24 f32", time_ms([&] { f(x); }), 8.0 * n);
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
  if (selected("cpu-W1c")) {  // gelu(x + b), the bias broadcast over rows (exact gelu: erf)
    k::Tensor b = k::randn({1024}, k::f32, k::cpu, 8);
    auto fn = [](auto a, auto c) { return k::gelu(a + c); };
    auto f = k::compile(fn);
    k::Tensor y = f(m, b);
    check("cpu-W1c", [&] {
      return k::testing::allclose(head(y, 64), k::reference::eval(fn(head(m, 64), b)), 1e-5, 1e-6);
    });
    emit("cpu-W1c", "gelu(x+b) 4096x1024 f32", time_ms([&] { f(m, b); }), 8.0 * m.numel() + 4.0 * 1024);
  }
  if (selected("cpu-W5")) {  // y, and dx, dw, db from a random dy (two programs, as bench.cpp's W5)
    auto ln = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); };
    k::Tensor w = k::randn({1024}, k::f32, k::cpu, 3), b = k::randn({1024}, k::f32, k::cpu, 4),
              dy = k::randn({4096, 1024}, k::f32, k::cpu, 10);
    auto fwd = k::compile(ln);
    auto bwd = k::compile(k::vjp(ln, k::wrt<0, 1, 2>));
    auto all = [&](const k::Tensor& x, const k::Tensor& w_, const k::Tensor& b_, const k::Tensor& d) {
      std::vector<k::Tensor> out{fwd(x, w_, b_)};
      for (const k::Tensor& g : tensors(bwd(x, w_, b_, d))) out.push_back(g);
      return out;
    };
    std::vector<k::Tensor> got = all(m, w, b, dy);
    check("cpu-W5", [&] { return close(got, all(f64(m), f64(w), f64(b), f64(dy)), 2e-3); });
    emit("cpu-W5", "layer_norm fwd+bwd 4096x1024 f32", time_ms([&] { all(m, w, b, dy); }),
         4.0 * (4.0 * m.numel() + 4 * 1024));
  }
  if (selected("cpu-W6")) {
    k::Tensor w = k::randn({1024}, k::f32, k::cpu, 5);
    auto fn = [](auto x, auto w_) { return k::rms_norm(x, w_, 1e-6); };
    auto f = k::compile(fn);
    k::Tensor y = f(m, w);
    check("cpu-W6",
          [&] { return k::testing::allclose(head(y, 64), k::reference::eval(fn(head(m, 64), w)), 1e-4, 1e-5); });
    emit("cpu-W6", "rms_norm 4096x1024 f32", time_ms([&] { f(m, w); }), 8.0 * m.numel() + 4.0 * 1024);
  }
  if (selected("cpu-W7")) {  // the loss and dlogits
    auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
    auto f = k::compile(k::value_and_grad(ce, k::wrt<0>));
    k::Tensor logits = k::randn({1024, 32000}, k::f32, k::cpu, 11);
    k::Tensor t = k::Tensor(k::cast(k::rand({1024}, k::f32, k::cpu, 12) * 31999.0f, k::i64));
    check("cpu-W7", [&] { return close(tensors(f(logits, t)), tensors(f(f64(logits), t)), 1e-5); });
    emit("cpu-W7", "cross_entropy fwd+bwd 1024x32000 f32", time_ms([&] { f(logits, t); }),
         4.0 * 2 * logits.numel());
  }
  if (selected("cpu-W8")) {  // one AdamW step updating p, m, v and the step count in place
    static constexpr float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, wd = 0.01f;
    auto adamw = [](auto p, auto g, auto m_, auto v, auto step) {
      auto t = step + 1.0f;
      auto bc1 = 1.0f - k::exp(t * std::log(beta1)), bc2 = 1.0f - k::exp(t * std::log(beta2));
      auto m2 = m_ * beta1 + g * (1 - beta1);
      auto v2 = v * beta2 + g * g * (1 - beta2);
      auto p2 = p * (1 - lr * wd) - (m2 / bc1) / (k::sqrt(v2 / bc2) + eps) * lr;
      return std::make_tuple(k::assign(p, p2), k::assign(m_, m2), k::assign(v, v2), k::assign(step, t));
    };
    const std::int64_t an = std::int64_t{1} << 22;
    std::vector<k::Tensor> s{k::randn({an}, k::f32, k::cpu, 13), k::randn({an}, k::f32, k::cpu, 14),
                             k::randn({an}, k::f32, k::cpu, 15), k::rand({an}, k::f32, k::cpu, 16),
                             k::zeros({1}, k::f32, k::cpu)};
    std::vector<double> p = k::to_vector<double>(s[0]), g = k::to_vector<double>(s[1]),
                        m1 = k::to_vector<double>(s[2]), v = k::to_vector<double>(s[3]);
    auto step = k::compile(adamw);
    step(s[0], s[1], s[2], s[3], s[4]);
    check("cpu-W8", [&] {  // the first step (t = 1), against the same update in f64
      const double bc1 = 1 - double{beta1}, bc2 = 1 - double{beta2};
      std::vector<float> got = k::to_vector<float>(s[0]);
      bool ok = k::to_vector<float>(s[4]).at(0) == 1.0f;
      for (std::size_t i = 0; i < p.size(); i += 997) {
        const double mm = beta1 * m1[i] + (1 - double{beta1}) * g[i], vv = beta2 * v[i] + (1 - double{beta2}) * g[i] * g[i];
        const double want = p[i] * (1 - double{lr} * wd) - lr * (mm / bc1) / (std::sqrt(vv / bc2) + eps);
        ok = ok && std::abs(got[i] - want) <= 1e-5 + 1e-4 * std::abs(want);
      }
      return ok;
    });
    emit("cpu-W8", "AdamW step 2^22 f32, in place", time_ms([&] { step(s[0], s[1], s[2], s[3], s[4]); }),
         4.0 * 7 * an);
  }
  if (selected("cpu-W12")) {  // MLP block forward + backward, 512 rows, 1024 -> 4096 -> 1024
    auto block = [](auto x, auto w1, auto b1, auto w2, auto b2, auto g, auto be) {
      return k::layer_norm(x + k::linear(k::gelu(k::linear(x, w1, b1)), w2, b2), g, be);
    };
    auto f = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>));
    std::vector<k::Tensor> in{k::randn({512, 1024}, k::f32, k::cpu, 17),
                              k::Tensor(k::randn({4096, 1024}, k::f32, k::cpu, 18) * 0.03125f),
                              k::Tensor(k::randn({4096}, k::f32, k::cpu, 19) * 0.1f),
                              k::Tensor(k::randn({1024, 4096}, k::f32, k::cpu, 20) * 0.015625f),
                              k::Tensor(k::randn({1024}, k::f32, k::cpu, 21) * 0.1f),
                              k::randn({1024}, k::f32, k::cpu, 22),
                              k::randn({1024}, k::f32, k::cpu, 23),
                              k::randn({512, 1024}, k::f32, k::cpu, 24)};
    auto run = [&](const std::vector<k::Tensor>& v) { return tensors(f(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7])); };
    std::vector<k::Tensor> in64;
    for (const k::Tensor& t : in) in64.push_back(f64(t));
    check("cpu-W12", [&] { return close(run(in), run(in64), 2e-3); });
    const double flops = 3 * 2 * 2.0 * 512 * 1024 * 4096;  // two GEMMs forward, four backward
    emit("cpu-W12", "MLP block fwd+bwd 512x1024->4096->1024 f32", time_ms([&] { run(in); }), flops, "kiln", "gflops");
  }
  std::error_code ec;
  std::filesystem::remove_all(cache, ec);
  return 0;
}
