// kiln's side of the benchmark suite (BENCHMARKS.md): each workload is checked against the f64
// reference on a slice, then timed with CUDA events (warm-up, median of >= 100 repetitions).
// Prints one JSON object per line, the format benchmarks/report.py reads.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "timing.hpp"

namespace k = kiln;
using kiln::runtime::Event;

namespace {

std::string only = "", skip = "";
int reps = 200;

bool listed(const std::string& list, const std::string& id) {
  return ("," + list + ",").find("," + id + ",") != std::string::npos;
}
bool selected(const std::string& id) { return (only.empty() || listed(only, id)) && !listed(skip, id); }

// Median milliseconds of fn() over reps (benchmarks/timing.hpp: CUDA events, an L2 flush before
// each repetition).
double time_ms(const std::function<void()>& fn) { return kiln_bench::cuda_time_ms(fn, reps); }

void emit(const std::string& id, double ms, double bytes, const std::string& note = "",
          const std::string& impl = "kiln") {
  std::printf("{\"id\": \"%s\", \"impl\": \"%s\", \"ms\": %.5f, \"gbps\": %.1f, \"note\": \"%s\"}\n", id.c_str(),
              impl.c_str(), ms, bytes / ms / 1e6, note.c_str());
  std::fflush(stdout);
}

void fail(const std::string& id, const std::string& why, const std::string& impl = "kiln") {
  std::string w = why.substr(0, 300);
  std::replace(w.begin(), w.end(), '"', '\'');
  std::replace(w.begin(), w.end(), '\n', ' ');
  std::printf("{\"id\": \"%s\", \"impl\": \"%s\", \"error\": \"%s\"}\n", id.c_str(), impl.c_str(), w.c_str());
  std::fflush(stdout);
}

// Checks kiln's result on a small slice of rows against the oracle before timing the full size.
template <class F>
bool check(const std::string& id, F make, std::vector<k::Tensor> small, double tol) {
  std::vector<k::Tensor> cpu;
  for (auto& t : small) cpu.push_back(t.to(k::cpu));
  k::Tensor got = make(small);
  auto r = k::testing::allclose(got, k::reference::eval(make(cpu)), tol, tol);
  if (!r) fail(id, "wrong result: " + std::string(r.str()));
  return bool(r);
}

// Host microseconds per call of fn, back to back (20000 calls after 100 warm-up calls).
double host_us_per_call(const std::function<void()>& fn, CUstream s = nullptr) {
  for (int i = 0; i < 100; ++i) fn();
  k::synchronize();
  k::driver::synchronize(s);
  int calls = 20000;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  k::synchronize();
  k::driver::synchronize(s);
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
}

// The kiln-autotune variant of a workload: call() runs the function compiled with .autotune, whose
// first call times each kernel's candidates (its wall time goes in the note); result(), when given,
// is then compared with the plain variant's `expected` before the timing.
bool autotune = true;
void emit_autotuned(const std::string& id, const std::function<void()>& call, const std::function<k::Tensor()>& result,
                    const k::Tensor& expected, double tol, double bytes, const std::string& note = "") {
  if (!autotune) return;
  double first = 0, ms = 0;
  try {  // a failure here is the autotuned variant's own, not the workload's
    k::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    call();
    k::synchronize();
    first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (result)
      if (auto r = k::testing::allclose(result(), expected, tol, tol); !r)
        return fail(id, "wrong result: " + std::string(r.str()), "kiln-autotune");
    ms = time_ms(call);
  } catch (const std::exception& e) {
    return fail(id, e.what(), "kiln-autotune");
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "first call (tuning) %.1f s", first);
  std::string n = note.empty() ? buf : note + "; " + buf;
  if (bytes > 0) return emit(id, ms, bytes, n, "kiln-autotune");
  std::printf("{\"id\": \"%s\", \"impl\": \"kiln-autotune\", \"ms\": %.5f, \"note\": \"%s\"}\n", id.c_str(), ms,
              n.c_str());
  std::fflush(stdout);
}

void run(const std::string& id, const std::function<void()>& body) {
  if (!selected(id)) return;
  try {
    body();
  } catch (const std::exception& e) {
    fail(id, e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) only = argv[++i];
    if (a == "--skip" && i + 1 < argc) skip = argv[++i];
    if (a == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    if (a == "--no-autotune") autotune = false;
  }
  if (!k::driver::available()) {
    fail("env", "no CUDA device");
    return 0;
  }
  std::printf("{\"id\": \"env\", \"impl\": \"kiln\", \"device\": \"%s\"}\n", k::driver::device_name(0).c_str());

  run("copy", [] {
    std::size_t bytes = std::size_t{1} << 30;
    auto a = k::empty({static_cast<std::int64_t>(bytes / 4)}, k::f32, k::cuda),
         b = k::empty({static_cast<std::int64_t>(bytes / 4)}, k::f32, k::cuda);
    double ms = time_ms([&] { k::driver::copy_async(b.data_ptr(), a.data_ptr(), bytes, nullptr); });
    std::printf("{\"id\": \"copy\", \"impl\": \"kiln\", \"gbps\": %.1f}\n", 2.0 * bytes / ms / 1e6);
  });

  const std::int64_t n26 = std::int64_t{1} << 26;
  run("W1", [&] {
    auto f = [](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); };
    std::vector<k::Tensor> small{k::randn({1 << 20}, k::f32, k::cuda, 1)};
    if (!check("W1", f, small, 1e-5)) return;
    std::vector<k::Tensor> v{k::randn({n26}, k::f32, k::cuda, 2)};
    k::Tensor out = k::empty({n26}, k::f32, k::cuda);
    emit("W1", time_ms([&] { k::eval(out, f(v)); }), 8.0 * n26);
    k::Tensor out2 = k::empty({n26}, k::f32, k::cuda);
    auto g = k::compile([](auto x, auto o) { return k::assign(o, k::relu(x * 2.0f + 1.0f)); }, {.autotune = true});
    emit_autotuned(
        "W1", [&] { g(v[0], out2); }, [&] { return out2; }, out, 1e-6, 8.0 * n26);
  });
  run("W1b", [&] {
    auto f = [](auto& v) { return k::sigmoid(k::tanh(v[0] * 0.5f + 0.1f) * v[0]) * k::exp(-v[0] * v[0]); };
    std::vector<k::Tensor> small{k::randn({1 << 20}, k::f32, k::cuda, 1)};
    if (!check("W1b", f, small, 1e-5)) return;
    std::vector<k::Tensor> v{k::randn({n26}, k::f32, k::cuda, 2)};
    k::Tensor out = k::empty({n26}, k::f32, k::cuda);
    emit("W1b", time_ms([&] { k::eval(out, f(v)); }), 8.0 * n26);
    k::Tensor out2 = k::empty({n26}, k::f32, k::cuda);
    auto g = k::compile(
        [](auto x, auto o) { return k::assign(o, k::sigmoid(k::tanh(x * 0.5f + 0.1f) * x) * k::exp(-x * x)); },
        {.autotune = true});
    emit_autotuned(
        "W1b", [&] { g(v[0], out2); }, [&] { return out2; }, out, 1e-5, 8.0 * n26);
  });
  run("W1c", [&] {
    auto f = [](auto& v) { return k::gelu(v[0] + v[1]); };
    std::vector<k::Tensor> small{k::randn({64, 4096}, k::bf16, k::cuda, 1), k::randn({4096}, k::bf16, k::cuda, 2)};
    // (gelu of bf16 inputs is bf16 already; a cast here would share the timed call's eager cache and
    // make the automatic mode compile the timed size with a symbolic row count.)
    if (!check("W1c", f, small, 2e-2)) return;
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::bf16, k::cuda, 3), k::randn({4096}, k::bf16, k::cuda, 4)};
    k::Tensor out = k::empty({16384, 4096}, k::bf16, k::cuda);
    emit("W1c", time_ms([&] { k::eval(out, f(v)); }), 2.0 * 2 * 16384 * 4096);
    k::Tensor out2 = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto g = k::compile([](auto x, auto b, auto o) { return k::assign(o, k::gelu(x + b)); }, {.autotune = true});
    emit_autotuned(
        "W1c", [&] { g(v[0], v[1], out2); }, [&] { return out2; }, out, 1e-2, 2.0 * 2 * 16384 * 4096);
  });
  auto softmax = [&](const std::string& id, std::int64_t rows, std::int64_t cols) {
    run(id, [&] {
      auto f = [](auto& v) { return k::softmax(v[0], -1); };
      std::vector<k::Tensor> small{k::randn({16, cols}, k::f32, k::cuda, 1)};
      if (!check(id, f, small, 1e-4)) return;
      std::vector<k::Tensor> v{k::randn({rows, cols}, k::f32, k::cuda, 2)};
      k::Tensor out = k::empty({rows, cols}, k::f32, k::cuda);
      // A function of its own: W3 and W3b share the expression type, and one eager cache would
      // see a changed row length and compile W3b for symbolic sizes (automatic mode), which
      // torch_peer.py avoids with torch._dynamo.reset() between workloads.
      auto g = k::compile([](auto x, auto o) { return k::assign(o, k::softmax(x, -1)); });
      emit(id, time_ms([&] { g(v[0], out); }), 8.0 * rows * cols);
      k::Tensor out2 = k::empty({rows, cols}, k::f32, k::cuda);
      auto t = k::compile([](auto x, auto o) { return k::assign(o, k::softmax(x, -1)); }, {.autotune = true});
      emit_autotuned(
          id, [&] { t(v[0], out2); }, [&] { return out2; }, out, 1e-5, 8.0 * rows * cols);
    });
  };
  softmax("W3", 16384, 4096);
  softmax("W3b", 4096, 32768);
  run("W4", [&] {
    auto f = [](auto& v) { return k::layer_norm(v[0], v[1], v[2]); };
    std::vector<k::Tensor> small{k::randn({16, 4096}, k::f32, k::cuda, 1), k::randn({4096}, k::f32, k::cuda, 2),
                                 k::randn({4096}, k::f32, k::cuda, 3)};
    if (!check("W4", f, small, 1e-4)) return;
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::f32, k::cuda, 4), small[1], small[2]};
    k::Tensor out = k::empty({16384, 4096}, k::f32, k::cuda);
    emit("W4", time_ms([&] { k::eval(out, f(v)); }), 8.0 * 16384 * 4096);
    k::Tensor out2 = k::empty({16384, 4096}, k::f32, k::cuda);
    auto t = k::compile([](auto x, auto w, auto b, auto o) { return k::assign(o, k::layer_norm(x, w, b)); },
                        {.autotune = true});
    emit_autotuned(
        "W4", [&] { t(v[0], v[1], v[2], out2); }, [&] { return out2; }, out, 1e-5, 8.0 * 16384 * 4096);
    // The same kernel compiled for symbolic sizes (looped rows, as W10's dynamic mode runs).
    auto g = k::compile([](auto x, auto w, auto b, auto o) { return k::assign(o, k::layer_norm(x, w, b)); },
                        {.shapes = k::shapes::dynamic});
    k::Tensor out_d = k::empty({16384, 4096}, k::f32, k::cuda);
    g(v[0], v[1], v[2], out_d);
    if (auto r = k::testing::allclose(out_d, out, 1e-5, 1e-5); !r)
      return fail("W4", "dynamic: " + std::string(r.str()));
    emit("W4", time_ms([&] { g(v[0], v[1], v[2], out_d); }), 8.0 * 16384 * 4096, "", "kiln-dynamic");
  });
  run("W6", [&] {
    auto f = [](auto& v) { return k::cast(k::rms_norm(k::cast(v[0], k::f32), v[1], 1e-6), k::bf16); };
    std::vector<k::Tensor> small{k::randn({16, 4096}, k::bf16, k::cuda, 1), k::randn({4096}, k::f32, k::cuda, 2)};
    if (!check("W6", f, small, 2e-2)) return;
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::bf16, k::cuda, 3), small[1]};
    k::Tensor out = k::empty({16384, 4096}, k::bf16, k::cuda);
    emit("W6", time_ms([&] { k::eval(out, f(v)); }), 4.0 * 16384 * 4096);
    k::Tensor out2 = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto t = k::compile(
        [](auto x, auto w, auto o) { return k::assign(o, k::cast(k::rms_norm(k::cast(x, k::f32), w, 1e-6), k::bf16)); },
        {.autotune = true});
    emit_autotuned(
        "W6", [&] { t(v[0], v[1], out2); }, [&] { return out2; }, out, 1e-2, 4.0 * 16384 * 4096);
  });
  run("W8", [&] {
    // One AdamW step updating p, m and v in place (k::assign), all in one kernel.
    const std::int64_t n = std::int64_t{1} << 24;
    auto adamw = [](auto p, auto g, auto m, auto v) {
      float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f, bc1 = 1 - 0.9f, bc2 = 1 - 0.999f;
      auto m2 = m * b1 + g * (1 - b1);
      auto v2 = v * b2 + g * g * (1 - b2);
      auto p2 = p * (1 - lr * wd) - (m2 / bc1) / (k::sqrt(v2 / bc2) + eps) * lr;
      return std::make_tuple(k::assign(p, p2), k::assign(m, m2), k::assign(v, v2));
    };
    auto step = k::compile(adamw);
    auto p = k::randn({n}, k::f32, k::cuda, 1), g = k::randn({n}, k::f32, k::cuda, 2),
         m = k::randn({n}, k::f32, k::cuda, 3), v = k::rand({n}, k::f32, k::cuda, 4);
    auto r = k::explain(step, p, g, m, v);
    emit("W8", time_ms([&] { step(p, g, m, v); }), 4.0 * 7 * n,
         std::to_string(r.kernels.size()) + " kernel(s), in place");
    auto tuned = k::compile(adamw, {.autotune = true});  // (tests/test_autotune.cpp checks in-place updates)
    emit_autotuned(
        "W8", [&] { tuned(p, g, m, v); }, nullptr, k::Tensor(), 0, 4.0 * 7 * n, "in place");
  });
  run("W2", [&] {
    auto mlp = [](auto x, auto w, auto b) { return k::gelu(k::matmul(x, w) + b); };
    auto f = k::compile(mlp);
    auto x = k::randn({4096, 4096}, k::bf16, k::cuda, 1), b = k::randn({4096}, k::bf16, k::cuda, 3);
    k::Tensor W = k::randn({4096, 4096}, k::bf16, k::cuda, 2) * 0.02f;
    auto xs = k::slice(x, 0, 0, 64);
    k::Tensor small = xs;
    auto r = k::testing::allclose(f(small, W, b), k::reference::eval(k::gelu(k::matmul(small, W) + b)), 3e-2, 3e-2);
    if (!r) return fail("W2", "wrong result: " + r.str());
    double ms = time_ms([&] { f(x, W, b); });
    std::printf("{\"id\": \"W2\", \"impl\": \"kiln\", \"ms\": %.5f, \"tflops\": %.1f}\n", ms,
                2.0 * 4096 * 4096 * 4096 / ms / 1e9);
    auto t = k::compile(mlp, {.autotune = true});
    k::Tensor expected = f(x, W, b);
    emit_autotuned(
        "W2", [&] { t(x, W, b); }, [&] { return t(x, W, b); }, expected, 2e-2, 0);
  });
  run("W5", [&] {
    auto ln = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); };
    auto f = k::compile(k::vjp(ln, k::wrt<0, 1, 2>));
    auto x = k::randn({16384, 4096}, k::f32, k::cuda, 1), w = k::randn({4096}, k::f32, k::cuda, 2),
         b = k::randn({4096}, k::f32, k::cuda, 3), dy = k::randn({16384, 4096}, k::f32, k::cuda, 4);
    auto xs = k::randn({8, 64}, k::f64, k::cpu, 5), ws = k::randn({64}, k::f64, k::cpu, 6),
         bs = k::randn({64}, k::f64, k::cpu, 7);
    if (!k::testing::gradcheck(ln, xs, ws, bs)) return fail("W5", "gradcheck failed");
    auto rep = k::explain(f, x, w, b, dy);
    emit("W5", time_ms([&] { f(x, w, b, dy); }), 4.0 * (3.0 * 16384 * 4096 + 4 * 4096),
         std::to_string(rep.kernels.size()) + " kernels");
    auto t = k::compile(k::vjp(ln, k::wrt<0, 1, 2>), {.autotune = true});
    k::Tensor expected = std::get<1>(f(x, w, b, dy));
    emit_autotuned(
        "W5", [&] { t(x, w, b, dy); }, [&] { return std::get<1>(t(x, w, b, dy)); }, expected, 1e-3,
        4.0 * (3.0 * 16384 * 4096 + 4 * 4096));
  });
  run("W7", [&] {
    auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
    auto f = k::compile(k::value_and_grad(ce, k::wrt<0>));
    auto logits = k::randn({4096, 32000}, k::f32, k::cuda, 1);
    auto t = (k::Tensor(k::cast(k::rand({4096}, k::f32, k::cuda, 2) * 31999.0f, k::i64)));
    auto rep = k::explain(f, logits, t);
    emit("W7", time_ms([&] { f(logits, t); }), 4.0 * 2 * 4096 * 32000, std::to_string(rep.kernels.size()) + " kernels");
    auto tuned = k::compile(k::value_and_grad(ce, k::wrt<0>), {.autotune = true});
    k::Tensor expected = std::get<1>(f(logits, t));
    emit_autotuned(
        "W7", [&] { tuned(logits, t); }, [&] { return std::get<1>(tuned(logits, t)); }, expected, 1e-5,
        4.0 * 2 * 4096 * 32000);
  });
  run("W12", [&] {
    auto block = [](auto x, auto w1, auto b1, auto w2, auto b2, auto g, auto be) {
      return k::layer_norm(x + k::linear(k::gelu(k::linear(x, w1, b1)), w2, b2), g, be);
    };
    auto f = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>));
    auto x = k::randn({8192, 1024}, k::bf16, k::cuda, 1), w1 = k::randn({4096, 1024}, k::bf16, k::cuda, 2),
         b1 = k::randn({4096}, k::bf16, k::cuda, 3), w2 = k::randn({1024, 4096}, k::bf16, k::cuda, 4),
         b2 = k::randn({1024}, k::bf16, k::cuda, 5), g = k::randn({1024}, k::bf16, k::cuda, 6),
         be = k::randn({1024}, k::bf16, k::cuda, 7), dy = k::randn({8192, 1024}, k::bf16, k::cuda, 8);
    auto rep = k::explain(f, x, w1, b1, w2, b2, g, be, dy);
    emit("W12", time_ms([&] { f(x, w1, b1, w2, b2, g, be, dy); }), 0, std::to_string(rep.kernels.size()) + " kernels");
    auto t = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>), {.autotune = true});
    k::Tensor expected = std::get<0>(f(x, w1, b1, w2, b2, g, be, dy));
    emit_autotuned(
        "W12", [&] { t(x, w1, b1, w2, b2, g, be, dy); }, [&] { return std::get<0>(t(x, w1, b1, w2, b2, g, be, dy)); },
        expected, 5e-2, 0);
  });
  run("W9", [&] {
    auto x = k::randn({1024}, k::f32, k::cuda, 1);
    for (bool graphs : {false, true}) {
      auto f = k::compile([](auto x) { return k::relu(x * 2.0f + 1.0f); }, {.cuda_graphs = graphs});
      double us = host_us_per_call([&] { f(x); });
      std::printf("{\"id\": \"W9\", \"impl\": \"%s\", \"ms\": %.5f, \"us\": %.2f}\n",
                  graphs ? "kiln-cuda_graphs" : "kiln", us / 1000, us);
    }
  });
  run("W9m", [&] {
    // A three-kernel program (a full mean, a row softmax, a column sum): plain launches, the
    // reduce-overhead mode, and the floor: the driver replaying the same launches as one graph.
    auto body = [](auto x) { return k::sum(k::softmax(x - k::mean(x), -1), 0); };
    auto x = k::randn({32, 32}, k::f32, k::cuda, 1);
    auto plain = k::compile(body);
    auto graphed = k::compile(body, {.cuda_graphs = true});
    int kernels = static_cast<int>(k::explain(plain, x).kernels.size());
    auto line = [&](const char* impl, double us) {
      std::printf("{\"id\": \"W9m\", \"impl\": \"%s\", \"ms\": %.5f, \"us\": %.2f, \"note\": \"%d kernels\"}\n", impl,
                  us / 1000, us, kernels);
    };
    line("kiln", host_us_per_call([&] { plain(x); }));
    line("kiln-cuda_graphs", host_us_per_call([&] { graphed(x); }));
    CUstream s = nullptr;
    const auto& api = k::driver::api();
    k::driver::check(api.stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    plain(k::Stream(s), x);  // warm on this stream: the capture below then allocates nothing new
    k::Stream(s).synchronize();
    CUgraph g = nullptr;
    CUgraphExec exec = nullptr;
    k::driver::check(api.stream_begin_capture(s, CU_STREAM_CAPTURE_MODE_GLOBAL), "cuStreamBeginCapture");
    k::Tensor out = plain(k::Stream(s), x);
    k::driver::check(api.stream_end_capture(s, &g), "cuStreamEndCapture");
    k::driver::check(api.graph_instantiate(&exec, g, 0), "cuGraphInstantiate");
    line("driver-graph", host_us_per_call([&] { api.graph_launch(exec, s); }, s));
    api.graph_exec_destroy(exec);
    api.graph_destroy(g);
  });
  run("W10", [&] {
    for (auto mode : {k::shapes::static_, k::shapes::dynamic}) {
      auto f = k::compile([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); },
                          {.shapes = mode, .recompile_limit = 64});
      auto w = k::randn({4096}, k::f32, k::cuda, 1), b = k::randn({4096}, k::f32, k::cuda, 2);
      std::vector<k::Tensor> xs;
      for (int e = 4; e <= 13; ++e) xs.push_back(k::randn({std::int64_t{1} << e, 4096}, k::f32, k::cuda, 3 + e));
      k::synchronize();
      auto t0 = std::chrono::steady_clock::now();
      double first = 0;
      for (auto& x : xs) {
        k::Tensor y = f(x, w, b);
        if (first == 0) {
          k::synchronize();
          first = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        }
      }
      k::synchronize();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("{\"id\": \"W10\", \"impl\": \"%s\", \"ms\": %.1f, \"s\": %.3f, \"note\": \"first call %.1f ms\"}\n",
                  mode == k::shapes::dynamic ? "kiln-dynamic" : "kiln", s * 1000, s, first);
    }
  });
  run("W11", [&] {
    // Run first in a fresh process with an empty KILN_CACHE_DIR (benchmarks/run.sh does).
    auto f = k::compile([](auto x) { return k::relu(x * 2.0f + 1.0f); });
    auto x = k::randn({1024}, k::f32, k::cuda, 1);
    k::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    k::Tensor y = f(x);
    k::synchronize();
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    // W11w: the same process run again on the now warm cache; KILN_BENCH_T0 (ns since the epoch,
    // taken by run.sh just before starting the process) makes it process start -> first result.
    if (const char* t0_env = std::getenv("KILN_BENCH_T0")) {
      auto now =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch());
      double total = (static_cast<double>(now.count()) - std::atof(t0_env)) / 1e6;
      std::printf(
          "{\"id\": \"W11w\", \"impl\": \"kiln\", \"ms\": %.2f, \"note\": \"warm disk cache: process start to "
          "first result; first call itself %.1f ms\"}\n",
          total, ms);
      return;
    }
    std::printf("{\"id\": \"W11\", \"impl\": \"kiln\", \"ms\": %.2f}\n", ms);
  });
  return 0;
}
