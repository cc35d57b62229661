// kiln's side of the benchmark suite (BENCHMARKS.md): each timed variant's own result is checked
// on the GPU before it is timed (against the f64 oracle, or against the plain variant already
// checked), then timed with CUDA events (warm-up, median of >= 100 repetitions).
// Prints one JSON object per line, the format benchmarks/report.py reads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
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

// ---- checking a timed variant's own result ----------------------------------------------------

// Rows [lo, hi) of t along its first dimension, as a view (no copy, no kernel).
k::Tensor rows_of(const k::Tensor& t, std::int64_t lo, std::int64_t hi) {
  k::Dims shape = t.shape();
  shape[0] = hi - lo;
  return t.as_strided(shape, t.strides(), t.offset() + lo * t.strides()[0]);
}

// The row ranges a check looks at: the first n rows and the last n (a grid's tail block is where a
// kernel goes wrong), or all of them once when n covers them.
std::vector<std::pair<std::int64_t, std::int64_t>> head_and_tail(std::int64_t rows, std::int64_t n) {
  if (2 * n >= rows) return {{0, rows}};
  return {{0, n}, {rows - n, rows}};
}

// Checks rows of `got`, a timed variant's output computed at the full size, against the f64 oracle
// (k::reference::eval) of make() on the same rows of the inputs marked in `by_row`; the other
// inputs (a weight, a broadcast bias) go in whole. For row-wise workloads, where a row of the output
// depends on the same row of the inputs only. make takes a std::vector<k::Tensor>& of inputs.
template <class F>
bool check_rows(const std::string& id, const k::Tensor& got, F make, const std::vector<k::Tensor>& in,
                const std::vector<bool>& by_row, std::int64_t n, double tol, const std::string& impl = "kiln") {
  k::synchronize();
  for (auto [lo, hi] : head_and_tail(got.shape()[0], n)) {
    std::vector<k::Tensor> cpu;
    for (std::size_t i = 0; i < in.size(); ++i) cpu.push_back((by_row[i] ? rows_of(in[i], lo, hi) : in[i]).to(k::cpu));
    if (auto r = k::testing::allclose(rows_of(got, lo, hi), k::reference::eval(make(cpu)), tol, tol); !r) {
      fail(id, "wrong result in rows " + std::to_string(lo) + "-" + std::to_string(hi) + ": " + r.str(), impl);
      return false;
    }
  }
  return true;
}

// Tolerances of a comparison: |a - b| <= atol * max|b| + rtol * |b| elementwise (b the expected
// value). atol is a share of the largest expected magnitude, so that elements near zero of a sum
// or a gradient, whose error is that of the whole sum, do not need a tolerance of their own.
struct Tol {
  double rtol = 1e-5, atol = 1e-5;
};

double max_abs(const k::Tensor& t) {
  double m = 0;
  for (double v : k::reference::read(t).data) m = std::max(m, std::abs(v));
  return m;
}

// Compares each tensor of got (any device and dtype) with the same position of want. Returns ""
// when all are close, else which output differs and its worst element.
std::string mismatch(const std::vector<k::Tensor>& got, const std::vector<k::Tensor>& want, Tol tol) {
  k::synchronize();
  if (got.size() != want.size())
    return std::to_string(got.size()) + " outputs where " + std::to_string(want.size()) + " were expected";
  for (std::size_t i = 0; i < got.size(); ++i)
    if (auto r = k::testing::allclose(got[i], want[i], tol.rtol, tol.atol * max_abs(want[i])); !r)
      return "output " + std::to_string(i) + ": " + r.str();
  return "";
}

// The outputs of a compiled function (one tensor or a tuple of them) as a vector.
std::vector<k::Tensor> tensors(const k::Tensor& t) { return {t}; }
template <class... T>
std::vector<k::Tensor> tensors(const std::tuple<T...>& t) {
  return std::apply([](const auto&... x) { return std::vector<k::Tensor>{k::Tensor(x)...}; }, t);
}

// A host vector of f64 values as a CPU tensor of this shape, to compare against.
k::Tensor f64_tensor(const std::vector<double>& v, const k::Dims& shape) { return k::from_vector(v, shape, k::f64); }

// W5's oracle, written out on the host in f64 from layer_norm's definition (eps 1e-5) rather than
// derived by kiln's autodiff: got = {y, dx, dw, db} of x, w, b and the cotangent dy. y and
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w, on the first and last n rows (a row
// depends on its own row only); dw = sum over rows of dy * xhat and db = sum of dy, over all rows.
std::string layer_norm_vjp_mismatch(const std::vector<k::Tensor>& got, const k::Tensor& x, const k::Tensor& w,
                                    const k::Tensor& b, const k::Tensor& dy, std::int64_t n) {
  k::synchronize();
  const std::int64_t rows = x.shape()[0], cols = x.shape()[1];
  const std::vector<double> xv = k::to_vector<double>(x), dv = k::to_vector<double>(dy), wv = k::to_vector<double>(w),
                            bv = k::to_vector<double>(b);
  // Row r's mean and 1 / sqrt(var + eps), the biased variance as layer_norm's.
  auto stats = [&](std::int64_t r) {
    const double* xr = &xv[static_cast<std::size_t>(r * cols)];
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mean += xr[c];
    mean /= static_cast<double>(cols);
    for (std::int64_t c = 0; c < cols; ++c) var += (xr[c] - mean) * (xr[c] - mean);
    return std::make_pair(mean, 1 / std::sqrt(var / static_cast<double>(cols) + 1e-5));
  };
  std::vector<double> dw(static_cast<std::size_t>(cols), 0.0), db(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    auto [mean, rstd] = stats(r);
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::size_t i = static_cast<std::size_t>(r * cols + c);
      dw[static_cast<std::size_t>(c)] += dv[i] * (xv[i] - mean) * rstd;
      db[static_cast<std::size_t>(c)] += dv[i];
    }
  }
  std::vector<k::Tensor> have{got.at(2), got.at(3)}, want{f64_tensor(dw, {cols}), f64_tensor(db, {cols})};
  for (auto [lo, hi] : head_and_tail(rows, n)) {
    std::vector<double> y, dx;
    for (std::int64_t r = lo; r < hi; ++r) {
      auto [mean, rstd] = stats(r);
      const std::size_t row = static_cast<std::size_t>(r * cols);
      double mg = 0, mgx = 0;  // the row means of g and of g * xhat
      for (std::int64_t c = 0; c < cols; ++c) {
        const double xhat = (xv[row + c] - mean) * rstd, g = dv[row + c] * wv[static_cast<std::size_t>(c)];
        mg += g;
        mgx += g * xhat;
      }
      mg /= static_cast<double>(cols);
      mgx /= static_cast<double>(cols);
      for (std::int64_t c = 0; c < cols; ++c) {
        const double xhat = (xv[row + c] - mean) * rstd, g = dv[row + c] * wv[static_cast<std::size_t>(c)];
        y.push_back(xhat * wv[static_cast<std::size_t>(c)] + bv[static_cast<std::size_t>(c)]);
        dx.push_back(rstd * (g - mg - xhat * mgx));
      }
    }
    have.push_back(rows_of(got.at(0), lo, hi));
    want.push_back(f64_tensor(y, {hi - lo, cols}));
    have.push_back(rows_of(got.at(1), lo, hi));
    want.push_back(f64_tensor(dx, {hi - lo, cols}));
  }
  // (outputs 0, 1: dw, db; then y and dx of the head rows, then of the tail rows)
  return mismatch(have, want, {.rtol = 1e-4, .atol = 1e-4});
}

// W7's oracle on the host in f64 from cross_entropy's definition: got = {loss, dlogits}. The loss is
// the mean over rows of logsumexp(row) - row[target]; its gradient (softmax(row) - onehot(target)) /
// rows is compared on the first and last n rows. dlogits is tiny (1/rows at most) and every element
// counts, hence a relative tolerance with an absolute floor far below its typical element.
std::string cross_entropy_mismatch(const std::vector<k::Tensor>& got, const k::Tensor& logits, const k::Tensor& targets,
                                   std::int64_t n) {
  k::synchronize();
  const std::int64_t rows = logits.shape()[0], cols = logits.shape()[1];
  const std::vector<float> l = k::to_vector<float>(logits);
  const std::vector<std::int64_t> t = k::to_vector<std::int64_t>(targets);
  std::vector<double> lse(static_cast<std::size_t>(rows));
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* lr = &l[static_cast<std::size_t>(r * cols)];
    double mx = lr[0], s = 0;
    for (std::int64_t c = 1; c < cols; ++c) mx = std::max(mx, static_cast<double>(lr[c]));
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(lr[c] - mx);
    lse[static_cast<std::size_t>(r)] = mx + std::log(s);
    total += lse[static_cast<std::size_t>(r)] - lr[t[static_cast<std::size_t>(r)]];
  }
  std::vector<k::Tensor> have{got.at(0)}, want{f64_tensor({total / static_cast<double>(rows)}, got.at(0).shape())};
  for (auto [lo, hi] : head_and_tail(rows, n)) {
    std::vector<double> d;
    for (std::int64_t r = lo; r < hi; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        d.push_back((std::exp(l[static_cast<std::size_t>(r * cols + c)] - lse[static_cast<std::size_t>(r)]) -
                     (c == t[static_cast<std::size_t>(r)] ? 1.0 : 0.0)) /
                    static_cast<double>(rows));
    have.push_back(rows_of(got.at(1), lo, hi));
    want.push_back(f64_tensor(d, {hi - lo, cols}));
  }
  return mismatch(have, want, {.rtol = 1e-3, .atol = 1e-7});
}

// W8's AdamW hyperparameters (BENCHMARKS.md), shared by the kiln function and its oracle.
constexpr float kLr = 1e-3f, kBeta1 = 0.9f, kBeta2 = 0.999f, kEps = 1e-8f, kWd = 0.01f;

// W8's oracle on the host in f64: p, m, v and the step count after one AdamW step from `before`
// = {p, g, m, v, step} (the bias corrections 1 - beta^t of the new step count t).
std::vector<k::Tensor> adamw_oracle(const std::vector<k::Tensor>& before) {
  std::vector<double> p = k::to_vector<double>(before.at(0)), g = k::to_vector<double>(before.at(1)),
                      m = k::to_vector<double>(before.at(2)), v = k::to_vector<double>(before.at(3));
  const double t = k::to_vector<double>(before.at(4)).at(0) + 1;
  const double b1 = kBeta1, b2 = kBeta2, bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = b1 * m[i] + (1 - b1) * g[i];
    v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
    p[i] = p[i] * (1 - double{kLr} * double{kWd}) - double{kLr} * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + double{kEps});
  }
  const k::Dims shape = before.at(0).shape();
  return {f64_tensor(p, shape), f64_tensor(m, shape), f64_tensor(v, shape), f64_tensor({t}, before.at(4).shape())};
}

// Host microseconds per call of fn, called back to back: after 100 warm-up calls, the median of 5
// samples of 5000 calls each ending with one synchronisation (as torch_peer.py samples W9).
double host_us_per_call(const std::function<void()>& fn, CUstream s = nullptr) {
  auto sync = [&] {
    k::synchronize();
    k::driver::synchronize(s);
  };
  for (int i = 0; i < 100; ++i) fn();
  sync();
  const int calls = 5000;
  std::vector<double> samples;
  for (int sample = 0; sample < 5; ++sample) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    sync();
    samples.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// The kiln-autotune variant of a workload: call() runs the function compiled with .autotune, whose
// first call times each kernel's candidates (its wall time goes in the note); result() then gives
// that variant's outputs, which must match `expected` (the plain variant's, already checked against
// the oracle, on the same inputs) before the timing.
bool autotune = true;
void emit_autotuned(const std::string& id, const std::function<void()>& call,
                    const std::function<std::vector<k::Tensor>()>& result, const std::vector<k::Tensor>& expected,
                    Tol tol, double bytes, const std::string& note = "") {
  if (!autotune) return;
  double first = 0, ms = 0;
  try {  // a failure here is the autotuned variant's own, not the workload's
    k::synchronize();
    auto t0 = std::chrono::steady_clock::now();
    call();
    k::synchronize();
    first = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (std::string e = mismatch(result(), expected, tol); !e.empty())
      return fail(id, "wrong result: " + e, "kiln-autotune");
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

  // The forward workloads: the timed call runs once, its own output is checked against the oracle
  // on its first and last rows, then it is timed; the autotuned variant must match that output.
  const std::int64_t n26 = std::int64_t{1} << 26;
  run("W1", [&] {
    auto f = [](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); };
    std::vector<k::Tensor> v{k::randn({n26}, k::f32, k::cuda, 2)};
    k::Tensor out = k::empty({n26}, k::f32, k::cuda);
    auto timed = [&] { k::eval(out, f(v)); };
    timed();
    if (!check_rows("W1", out, f, v, {true}, 1 << 16, 1e-5)) return;
    emit("W1", time_ms(timed), 8.0 * n26);
    k::Tensor out2 = k::empty({n26}, k::f32, k::cuda);
    auto g = k::compile([](auto x, auto o) { return k::assign(o, k::relu(x * 2.0f + 1.0f)); }, {.autotune = true});
    emit_autotuned(
        "W1", [&] { g(v[0], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-6, .atol = 1e-6}, 8.0 * n26);
  });
  run("W1b", [&] {
    auto f = [](auto& v) { return k::sigmoid(k::tanh(v[0] * 0.5f + 0.1f) * v[0]) * k::exp(-v[0] * v[0]); };
    std::vector<k::Tensor> v{k::randn({n26}, k::f32, k::cuda, 2)};
    k::Tensor out = k::empty({n26}, k::f32, k::cuda);
    auto timed = [&] { k::eval(out, f(v)); };
    timed();
    if (!check_rows("W1b", out, f, v, {true}, 1 << 16, 1e-5)) return;
    emit("W1b", time_ms(timed), 8.0 * n26);
    k::Tensor out2 = k::empty({n26}, k::f32, k::cuda);
    auto g = k::compile(
        [](auto x, auto o) { return k::assign(o, k::sigmoid(k::tanh(x * 0.5f + 0.1f) * x) * k::exp(-x * x)); },
        {.autotune = true});
    emit_autotuned(
        "W1b", [&] { g(v[0], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-5, .atol = 1e-5}, 8.0 * n26);
  });
  run("W1c", [&] {
    auto f = [](auto& v) { return k::gelu(v[0] + v[1]); };
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::bf16, k::cuda, 3), k::randn({4096}, k::bf16, k::cuda, 4)};
    k::Tensor out = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto timed = [&] { k::eval(out, f(v)); };
    timed();
    if (!check_rows("W1c", out, f, v, {true, false}, 64, 2e-2)) return;
    emit("W1c", time_ms(timed), 2.0 * 2 * 16384 * 4096);
    k::Tensor out2 = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto g = k::compile([](auto x, auto b, auto o) { return k::assign(o, k::gelu(x + b)); }, {.autotune = true});
    emit_autotuned(
        "W1c", [&] { g(v[0], v[1], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-2, .atol = 1e-2},
        2.0 * 2 * 16384 * 4096);
  });
  auto softmax = [&](const std::string& id, std::int64_t rows, std::int64_t cols) {
    run(id, [&] {
      auto f = [](auto& v) { return k::softmax(v[0], -1); };
      std::vector<k::Tensor> v{k::randn({rows, cols}, k::f32, k::cuda, 2)};
      k::Tensor out = k::empty({rows, cols}, k::f32, k::cuda);
      // A function of its own: W3 and W3b share the expression type, and one eager cache would
      // see a changed row length and compile W3b for symbolic sizes (automatic mode), which
      // torch_peer.py avoids with torch._dynamo.reset() between workloads.
      auto g = k::compile([](auto x, auto o) { return k::assign(o, k::softmax(x, -1)); });
      g(v[0], out);
      if (!check_rows(id, out, f, v, {true}, 16, 1e-4)) return;
      emit(id, time_ms([&] { g(v[0], out); }), 8.0 * rows * cols);
      k::Tensor out2 = k::empty({rows, cols}, k::f32, k::cuda);
      auto t = k::compile([](auto x, auto o) { return k::assign(o, k::softmax(x, -1)); }, {.autotune = true});
      emit_autotuned(
          id, [&] { t(v[0], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-5, .atol = 1e-5},
          8.0 * rows * cols);
    });
  };
  softmax("W3", 16384, 4096);
  softmax("W3b", 4096, 32768);
  run("W4", [&] {
    auto f = [](auto& v) { return k::layer_norm(v[0], v[1], v[2]); };
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::f32, k::cuda, 4), k::randn({4096}, k::f32, k::cuda, 2),
                             k::randn({4096}, k::f32, k::cuda, 3)};
    k::Tensor out = k::empty({16384, 4096}, k::f32, k::cuda);
    auto timed = [&] { k::eval(out, f(v)); };
    timed();
    if (!check_rows("W4", out, f, v, {true, false, false}, 16, 1e-4)) return;
    emit("W4", time_ms(timed), 8.0 * 16384 * 4096);
    k::Tensor out2 = k::empty({16384, 4096}, k::f32, k::cuda);
    auto t = k::compile([](auto x, auto w, auto b, auto o) { return k::assign(o, k::layer_norm(x, w, b)); },
                        {.autotune = true});
    emit_autotuned(
        "W4", [&] { t(v[0], v[1], v[2], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-5, .atol = 1e-5},
        8.0 * 16384 * 4096);
    // The same kernel compiled for symbolic sizes (looped rows, as W10's dynamic mode runs).
    auto g = k::compile([](auto x, auto w, auto b, auto o) { return k::assign(o, k::layer_norm(x, w, b)); },
                        {.shapes = k::shapes::dynamic});
    k::Tensor out_d = k::empty({16384, 4096}, k::f32, k::cuda);
    g(v[0], v[1], v[2], out_d);
    if (std::string e = mismatch({out_d}, {out}, {.rtol = 1e-5, .atol = 1e-5}); !e.empty())
      return fail("W4", "wrong result: " + e, "kiln-dynamic");
    emit("W4", time_ms([&] { g(v[0], v[1], v[2], out_d); }), 8.0 * 16384 * 4096, "", "kiln-dynamic");
  });
  run("W6", [&] {
    // The weight is f32, as on the torch side (torch_peer.py's w6).
    auto f = [](auto& v) { return k::cast(k::rms_norm(k::cast(v[0], k::f32), v[1], 1e-6), k::bf16); };
    std::vector<k::Tensor> v{k::randn({16384, 4096}, k::bf16, k::cuda, 3), k::randn({4096}, k::f32, k::cuda, 2)};
    k::Tensor out = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto timed = [&] { k::eval(out, f(v)); };
    timed();
    if (!check_rows("W6", out, f, v, {true, false}, 16, 2e-2)) return;
    const double bytes = 4.0 * 16384 * 4096 + 4.0 * 4096;  // x read and y written in bf16, w read in f32
    emit("W6", time_ms(timed), bytes);
    k::Tensor out2 = k::empty({16384, 4096}, k::bf16, k::cuda);
    auto t = k::compile(
        [](auto x, auto w, auto o) { return k::assign(o, k::cast(k::rms_norm(k::cast(x, k::f32), w, 1e-6), k::bf16)); },
        {.autotune = true});
    emit_autotuned(
        "W6", [&] { t(v[0], v[1], out2); }, [&] { return tensors(out2); }, {out}, {.rtol = 1e-2, .atol = 1e-2}, bytes);
  });
  run("W8", [&] {
    // One AdamW step updating p, m, v and the step count in place (k::assign). As in torch's
    // compiled AdamW (a tensor step, torch_peer.py's w8), the step count lives on the device and
    // every call computes the bias corrections 1 - beta^t from it: t = step + 1, beta^t as
    // exp(t * log(beta)) (k::pow takes a scalar exponent only).
    const std::int64_t n = std::int64_t{1} << 24;
    auto adamw = [](auto p, auto g, auto m, auto v, auto step) {
      auto t = step + 1.0f;
      auto bc1 = 1.0f - k::exp(t * std::log(kBeta1)), bc2 = 1.0f - k::exp(t * std::log(kBeta2));
      auto m2 = m * kBeta1 + g * (1 - kBeta1);
      auto v2 = v * kBeta2 + g * g * (1 - kBeta2);
      auto p2 = p * (1 - kLr * kWd) - (m2 / bc1) / (k::sqrt(v2 / bc2) + kEps) * kLr;
      return std::make_tuple(k::assign(p, p2), k::assign(m, m2), k::assign(v, v2), k::assign(step, t));
    };
    // p, g, m, v and a step count of 0: the first step's bias corrections are the largest, so a
    // step count read after its own update would show in the check.
    auto state = [&] {
      return std::vector<k::Tensor>{k::randn({n}, k::f32, k::cuda, 1), k::randn({n}, k::f32, k::cuda, 2),
                                    k::randn({n}, k::f32, k::cuda, 3), k::rand({n}, k::f32, k::cuda, 4),
                                    k::zeros({1}, k::f32, k::cuda)};
    };
    auto updated = [](const std::vector<k::Tensor>& s) { return std::vector<k::Tensor>{s[0], s[2], s[3], s[4]}; };
    auto step = k::compile(adamw);
    std::vector<k::Tensor> s = state();
    std::vector<k::Tensor> want = adamw_oracle(s);
    step(s[0], s[1], s[2], s[3], s[4]);
    if (std::string e = mismatch(updated(s), want, {.rtol = 1e-3, .atol = 1e-5}); !e.empty())
      return fail("W8", "wrong result: " + e);
    std::vector<k::Tensor> one_step;  // for the autotuned variant, which starts from the same state
    for (const k::Tensor& t : updated(s)) one_step.push_back(t.to(k::cpu));
    auto r = k::explain(step, s[0], s[1], s[2], s[3], s[4]);
    emit("W8", time_ms([&] { step(s[0], s[1], s[2], s[3], s[4]); }), 4.0 * 7 * n,
         std::to_string(r.kernels.size()) + " kernel(s), in place");
    auto tuned = k::compile(adamw, {.autotune = true});  // (tests/test_autotune.cpp checks in-place updates)
    std::vector<k::Tensor> s2 = state();
    emit_autotuned(
        "W8", [&] { tuned(s2[0], s2[1], s2[2], s2[3], s2[4]); }, [&] { return updated(s2); }, one_step,
        {.rtol = 1e-4, .atol = 1e-6}, 4.0 * 7 * n, "in place");
  });
  run("W2", [&] {
    auto mlp = [](auto x, auto w, auto b) { return k::gelu(k::matmul(x, w) + b); };
    auto f = k::compile(mlp);
    auto x = k::randn({4096, 4096}, k::bf16, k::cuda, 1), b = k::randn({4096}, k::bf16, k::cuda, 3);
    k::Tensor W = k::randn({4096, 4096}, k::bf16, k::cuda, 2) * 0.02f;
    k::Tensor y = f(x, W, b);
    auto oracle = [](auto& v) { return k::gelu(k::matmul(v[0], v[1]) + v[2]); };
    if (!check_rows("W2", y, oracle, {x, W, b}, {true, false, false}, 16, 3e-2)) return;
    double ms = time_ms([&] { f(x, W, b); });
    std::printf("{\"id\": \"W2\", \"impl\": \"kiln\", \"ms\": %.5f, \"tflops\": %.1f}\n", ms,
                2.0 * 4096 * 4096 * 4096 / ms / 1e9);
    auto t = k::compile(mlp, {.autotune = true});
    emit_autotuned(
        "W2", [&] { t(x, W, b); }, [&] { return tensors(t(x, W, b)); }, {y}, {.rtol = 2e-2, .atol = 2e-2}, 0);
  });
  run("W5", [&] {
    // y, and dx, dw, db from a random dy: all four, as the torch side returns them (its autograd
    // forward writes y). k::vjp returns the gradients only, so y comes from a second program, and
    // kiln reads x and w once more than one program computing all four would.
    auto ln = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); };
    auto x = k::randn({16384, 4096}, k::f32, k::cuda, 1), w = k::randn({4096}, k::f32, k::cuda, 2),
         b = k::randn({4096}, k::f32, k::cuda, 3), dy = k::randn({16384, 4096}, k::f32, k::cuda, 4);
    auto xs = k::randn({8, 64}, k::f64, k::cpu, 5), ws = k::randn({64}, k::f64, k::cpu, 6),
         bs = k::randn({64}, k::f64, k::cpu, 7);
    if (!k::testing::gradcheck(ln, xs, ws, bs)) return fail("W5", "gradcheck failed");
    auto fwd = k::compile(ln);
    auto bwd = k::compile(k::vjp(ln, k::wrt<0, 1, 2>));
    auto all = [&](auto& fw, auto& bw) {
      std::vector<k::Tensor> out{fw(x, w, b)};
      for (const k::Tensor& g : tensors(bw(x, w, b, dy))) out.push_back(g);
      return out;
    };
    std::vector<k::Tensor> got = all(fwd, bwd);
    if (std::string e = layer_norm_vjp_mismatch(got, x, w, b, dy, 16); !e.empty())
      return fail("W5", "wrong result: " + e);
    const double bytes = 4.0 * (4.0 * 16384 * 4096 + 4 * 4096);  // x, dy read; y, dx written; w, b, dw, db
    std::string kernels = std::to_string(k::explain(fwd, x, w, b).kernels.size()) + " + " +
                          std::to_string(k::explain(bwd, x, w, b, dy).kernels.size()) +
                          " kernels (y, then dx, dw, db: two programs)";
    emit("W5", time_ms([&] {
           fwd(x, w, b);
           bwd(x, w, b, dy);
         }),
         bytes, kernels);
    auto tf = k::compile(ln, {.autotune = true});
    auto tb = k::compile(k::vjp(ln, k::wrt<0, 1, 2>), {.autotune = true});
    emit_autotuned(
        "W5",
        [&] {
          tf(x, w, b);
          tb(x, w, b, dy);
        },
        [&] { return all(tf, tb); }, got, {.rtol = 1e-4, .atol = 1e-4}, bytes);
  });
  run("W7", [&] {
    auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
    auto f = k::compile(k::value_and_grad(ce, k::wrt<0>));
    auto logits = k::randn({4096, 32000}, k::f32, k::cuda, 1);
    auto t = (k::Tensor(k::cast(k::rand({4096}, k::f32, k::cuda, 2) * 31999.0f, k::i64)));
    std::vector<k::Tensor> got = tensors(f(logits, t));  // the loss, dlogits
    if (std::string e = cross_entropy_mismatch(got, logits, t, 16); !e.empty()) return fail("W7", "wrong result: " + e);
    auto rep = k::explain(f, logits, t);
    emit("W7", time_ms([&] { f(logits, t); }), 4.0 * 2 * 4096 * 32000, std::to_string(rep.kernels.size()) + " kernels");
    auto tuned = k::compile(k::value_and_grad(ce, k::wrt<0>), {.autotune = true});
    emit_autotuned(
        "W7", [&] { tuned(logits, t); }, [&] { return tensors(tuned(logits, t)); }, got, {.rtol = 1e-4, .atol = 1e-7},
        4.0 * 2 * 4096 * 32000);
  });
  run("W12", [&] {
    auto block = [](auto x, auto w1, auto b1, auto w2, auto b2, auto g, auto be) {
      return k::layer_norm(x + k::linear(k::gelu(k::linear(x, w1, b1)), w2, b2), g, be);
    };
    // The derivation, against finite differences on small f64 inputs.
    auto small = [](const k::Dims& shape, int seed) { return k::randn(shape, k::f64, k::cpu, seed); };
    if (!k::testing::gradcheck(block, small({4, 8}, 11), small({16, 8}, 12), small({16}, 13), small({8, 16}, 14),
                               small({8}, 15), small({8}, 16), small({8}, 17)))
      return fail("W12", "gradcheck failed");
    // The inputs scaled as torch_peer.py's w12 scales them (weights by 1/sqrt(fan-in), biases 0.1).
    auto bf16 = [](auto e) { return k::Tensor(k::cast(e, k::bf16)); };
    auto x = k::randn({8192, 1024}, k::bf16, k::cuda, 1), g = k::randn({1024}, k::bf16, k::cuda, 6),
         be = k::randn({1024}, k::bf16, k::cuda, 7), dy = k::randn({8192, 1024}, k::bf16, k::cuda, 8);
    k::Tensor w1 = bf16(k::randn({4096, 1024}, k::bf16, k::cuda, 2) * 0.03125f),
              b1 = bf16(k::randn({4096}, k::bf16, k::cuda, 3) * 0.1f),
              w2 = bf16(k::randn({1024, 4096}, k::bf16, k::cuda, 4) * 0.015625f),
              b2 = bf16(k::randn({1024}, k::bf16, k::cuda, 5) * 0.1f);
    auto f = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>));
    std::vector<k::Tensor> got = tensors(f(x, w1, b1, w2, b2, g, be, dy));
    {
      // The timed bf16 gradients against the same ones computed in f32 on the GPU (a compile of
      // its own: other kernels, f32 GEMMs); bf16 rounding stays within a few percent of each
      // gradient's scale, a wrong kernel does not.
      auto f32 = [](const k::Tensor& t) { return k::Tensor(k::cast(t, k::f32)); };
      auto ref = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>));
      std::vector<k::Tensor> want = tensors(ref(f32(x), f32(w1), f32(b1), f32(w2), f32(b2), f32(g), f32(be), f32(dy)));
      if (std::string e = mismatch(got, want, {.rtol = 5e-2, .atol = 5e-2}); !e.empty())
        return fail("W12", "wrong result against f32: " + e);
    }
    auto rep = k::explain(f, x, w1, b1, w2, b2, g, be, dy);
    emit("W12", time_ms([&] { f(x, w1, b1, w2, b2, g, be, dy); }), 0, std::to_string(rep.kernels.size()) + " kernels");
    auto t = k::compile(k::vjp(block, k::wrt<0, 1, 2, 3, 4, 5, 6>), {.autotune = true});
    emit_autotuned(
        "W12", [&] { t(x, w1, b1, w2, b2, g, be, dy); }, [&] { return tensors(t(x, w1, b1, w2, b2, g, be, dy)); }, got,
        {.rtol = 5e-2, .atol = 5e-2}, 0);
  });
  run("W9", [&] {
    auto oracle = [](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); };
    auto x = k::randn({1024}, k::f32, k::cuda, 1);
    for (bool graphs : {false, true}) {
      const char* impl = graphs ? "kiln-cuda_graphs" : "kiln";
      auto f = k::compile([](auto x) { return k::relu(x * 2.0f + 1.0f); }, {.cuda_graphs = graphs});
      f(x);  // (with graphs: the capture; the check below sees a replay)
      if (!check_rows("W9", f(x), oracle, {x}, {true}, 1024, 1e-6, impl)) continue;
      double us = host_us_per_call([&] { f(x); });
      std::printf("{\"id\": \"W9\", \"impl\": \"%s\", \"ms\": %.5f, \"us\": %.2f}\n", impl, us / 1000, us);
    }
  });
  run("W9m", [&] {
    // A three-kernel program (a full mean, a row softmax, a column sum): plain launches, the
    // reduce-overhead mode, and the floor: the driver replaying the same launches as one graph.
    auto body = [](auto x) { return k::sum(k::softmax(x - k::mean(x), -1), 0); };
    auto oracle = [](auto& v) { return k::sum(k::softmax(v[0] - k::mean(v[0]), -1), 0); };
    auto x = k::randn({32, 32}, k::f32, k::cuda, 1);
    auto plain = k::compile(body);
    auto graphed = k::compile(body, {.cuda_graphs = true});
    int kernels = static_cast<int>(k::explain(plain, x).kernels.size());
    auto line = [&](const char* impl, double us) {
      std::printf("{\"id\": \"W9m\", \"impl\": \"%s\", \"ms\": %.5f, \"us\": %.2f, \"note\": \"%d kernels\"}\n", impl,
                  us / 1000, us, kernels);
    };
    // (the output is one row of 32 sums: checked whole)
    if (check_rows("W9m", plain(x), oracle, {x}, {false}, 32, 1e-5)) line("kiln", host_us_per_call([&] { plain(x); }));
    graphed(x);
    if (check_rows("W9m", graphed(x), oracle, {x}, {false}, 32, 1e-5, "kiln-cuda_graphs"))
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
    api.graph_launch(exec, s);
    k::Stream(s).synchronize();
    if (check_rows("W9m", out, oracle, {x}, {false}, 32, 1e-5, "driver-graph"))
      line("driver-graph", host_us_per_call([&] { api.graph_launch(exec, s); }, s));
    api.graph_exec_destroy(exec);
    api.graph_destroy(g);
  });
  run("W10", [&] {
    auto oracle = [](auto& v) { return k::layer_norm(v[0], v[1], v[2]); };
    for (auto mode : {k::shapes::static_, k::shapes::dynamic}) {
      const char* impl = mode == k::shapes::dynamic ? "kiln-dynamic" : "kiln";
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
      // Each size's result from the programs the sweep compiled (cache hits now), checked after the
      // sweep so that its time holds no oracle; a wrong result is reported instead of the time.
      bool ok = true;
      for (auto& x : xs)
        ok = ok && check_rows("W10", f(x, w, b), oracle, {x, w, b}, {true, false, false}, 8, 1e-4, impl);
      if (!ok) continue;
      std::printf("{\"id\": \"W10\", \"impl\": \"%s\", \"ms\": %.1f, \"s\": %.3f, \"note\": \"first call %.1f ms\"}\n",
                  impl, s * 1000, s, first);
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
    const char* t0_env = std::getenv("KILN_BENCH_T0");
    double total = 0;
    if (t0_env) {
      auto now =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch());
      total = (static_cast<double>(now.count()) - std::atof(t0_env)) / 1e6;
    }
    // The result, checked once the clock has stopped.
    if (!check_rows(
            t0_env ? "W11w" : "W11", y, [](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); }, {x}, {true}, 1024, 1e-6))
      return;
    if (t0_env) {
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
