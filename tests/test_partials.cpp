// Column partial sums inside row kernels (schedule/partials.hpp): a layer_norm or rms_norm
// backward computes dw and db in the kernel that computes dx, a partial sum per program, then two
// short reductions. Checked against sums and gradients computed here in double, on the CPU and on a
// GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <utility>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "cuda_plan.hpp"
#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;

namespace {

// dw = sum over rows of dy * (x - mean) * rstd, db = sum over rows of dy (layer_norm, eps 1e-5).
void expected_dw_db(const std::vector<float>& x, const std::vector<float>& dy, std::int64_t rows, std::int64_t cols,
                    std::vector<double>& dw, std::vector<double>& db) {
  dw.assign(cols, 0.0), db.assign(cols, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    for (std::int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    double rstd = 1 / std::sqrt(var / cols + 1e-5);
    for (std::int64_t c = 0; c < cols; ++c) {
      dw[c] += dy[r * cols + c] * (x[r * cols + c] - mean) * rstd;
      db[c] += dy[r * cols + c];
    }
  }
}

// dx of layer_norm (eps 1e-5) for rows [0, n): rstd * (g - mean(g) - xhat * mean(g * xhat)), where
// g = dy * w and xhat = (x - mean) * rstd.
std::vector<double> expected_dx(const std::vector<float>& x, const std::vector<float>& dy, const std::vector<float>& w,
                                std::int64_t n, std::int64_t cols) {
  std::vector<double> dx(n * cols), xhat(cols), g(cols);
  for (std::int64_t r = 0; r < n; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    for (std::int64_t c = 0; c < cols; ++c) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    double rstd = 1 / std::sqrt(var / cols + 1e-5), mean_g = 0, mean_gx = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      xhat[c] = (x[r * cols + c] - mean) * rstd;
      g[c] = double(dy[r * cols + c]) * w[c];
      mean_g += g[c] / cols;
      mean_gx += g[c] * xhat[c] / cols;
    }
    for (std::int64_t c = 0; c < cols; ++c) dx[r * cols + c] = rstd * (g[c] - mean_g - xhat[c] * mean_gx);
  }
  return dx;
}

void check_close(const k::Tensor& got, const std::vector<double>& want, double tol) {
  std::vector<float> g = k::to_vector<float>(got);
  REQUIRE(g.size() == want.size());
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    double err = std::abs(g[i] - want[i]) / (1 + std::abs(want[i]));
    if (err > worst) worst = err, at = i;
  }
  CHECK_MESSAGE(worst < tol, "column " << at << ": " << g[at] << " vs " << want[at]);
}

inline constexpr auto layer_norm_fn = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); };

// A layer_norm backward's dw, db and first n rows of dx (a row's dx depends on that row only)
// against values computed here from the host inputs x, dy and w.
void check_values(const k::Tensor& x, const k::Tensor& dy, const k::Tensor& w, const k::Tensor& dx, const k::Tensor& dw,
                  const k::Tensor& db, std::int64_t n) {
  const std::int64_t rows = x.shape()[0], cols = x.shape()[1];
  std::vector<double> want_dw, want_db;
  const std::vector<float> xv = k::to_vector<float>(x), dyv = k::to_vector<float>(dy);
  expected_dw_db(xv, dyv, rows, cols, want_dw, want_db);
  check_close(dw, want_dw, 1e-4);
  check_close(db, want_db, 1e-4);
  k::Tensor want_dx = k::from_vector(expected_dx(xv, dyv, k::to_vector<float>(w), n, cols), {n, cols});
  auto r = k::testing::allclose(k::Tensor(k::slice(dx, 0, 0, n)).to(k::cpu), want_dx, 1e-4, 1e-5);
  CHECK_MESSAGE(bool(r), r);
}

// rows: 256 chunks of 67 by default; cols: odd-sized.
void check_layer_norm_backward(k::Device dev, std::int64_t rows = 16384 + 256 * 3, std::int64_t cols = 2056) {
  auto x = k::randn({rows, cols}, k::f32, k::cpu, 1) * 2.0f + 0.5f;
  auto dy = k::randn({rows, cols}, k::f32, k::cpu, 2);
  auto w = k::randn({cols}, k::f32, k::cpu, 3), b = k::randn({cols}, k::f32, k::cpu, 4);
  k::Tensor xt = x, dyt = dy;
  auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>));
  auto args = std::make_tuple(xt.to(dev), w.to(dev), b.to(dev), dyt.to(dev));
  auto [dx, dw, db] = std::apply(f, args);
  // The row kernel computes the partial sums: no kernel re-reads x and dy for them.
  auto rep = std::apply([&](auto&... a) { return k::explain(f, a...); }, args);
  CHECK(rep.kernels.size() == 3);
  CHECK(rep.kernels.at(0).kind == "per");
  CHECK(rep.kernels.at(0).source.find("KILN_ROW_GROUP") != std::string::npos);
  check_values(xt, dyt, w, dx, dw, db, 37);
}

// The same over [batch, seq, cols] (GPT-2's activations): the dx kernel's rows are the leading
// dims' and it computes dw and db too; on a GPU rows of 768 columns run several to a block, whose
// row slots fold their sums (seq * batch rows in 256 groups of 33: the last rows of each group
// leave slots idle).
void check_layer_norm_backward_3d(k::Device dev, std::int64_t batch, std::int64_t seq, std::int64_t cols) {
  const std::int64_t rows = batch * seq;
  auto x = k::randn({rows, cols}, k::f32, k::cpu, 31) * 2.0f + 0.5f;
  auto dy = k::randn({rows, cols}, k::f32, k::cpu, 32);
  auto w = k::randn({cols}, k::f32, k::cpu, 33), b = k::randn({cols}, k::f32, k::cpu, 34);
  k::Tensor x3 = k::reshape(x, {batch, seq, cols}), dy3 = k::reshape(dy, {batch, seq, cols});
  auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>));
  auto args = std::make_tuple(x3.to(dev), w.to(dev), b.to(dev), dy3.to(dev));
  auto [dx, dw, db] = std::apply(f, args);
  auto rep = std::apply([&](auto&... a) { return k::explain(f, a...); }, args);
  CHECK(rep.kernels.at(0).kind == "per");
  CHECK(rep.kernels.at(0).source.find("KILN_ROW_GROUP") != std::string::npos);
  for (std::size_t i = 1; i < rep.kernels.size(); ++i)  // no other kernel re-reads x for x-hat
    CHECK(rep.kernels[i].source.find("rsqrt") == std::string::npos);
  check_values(x, dy, w, k::Tensor(k::reshape(dx, {rows, cols})), dw, db, 41);
}

}  // namespace

TEST_CASE("partials: a layer_norm backward over [batch, seq, cols] sums dw and db in its dx kernel (CPU)") {
  check_layer_norm_backward_3d(k::cpu, 4, 1056, 768);
}

TEST_CASE("partials: a layer_norm backward over [batch, seq, cols] sums dw and db in its dx kernel (GPU)" *
          needs_gpu()) {
  check_layer_norm_backward_3d(k::cuda, 8, 1056, 768);
  check_layer_norm_backward_3d(k::cuda, 2, 4224, 1000);
}

// An odd row count: the GPU's sums take zero-padded chunks (no rest re-read apart), which the row
// kernel's blocks cover by visiting every row.
TEST_CASE("partials: an odd row count keeps dw and db in the dx kernel (GPU)" * needs_gpu()) {
  check_layer_norm_backward(k::cuda, 16411, 1000);
  check_layer_norm_backward(k::cuda, 16411, 3072);
}

// A row kernel after the split may be moved before it to host its sums, but only where it reads
// nothing computed in between: here it reads v, a value stored for sharing (realize_shared) by a
// kernel between them (found by a review: r came out garbage when the move missed that store).
TEST_CASE("partials: a row kernel moved before its split still reads what the kernels between store") {
  const std::int64_t n = 8192, d = 768;
  auto x = k::randn({n, d}, k::f32, k::cpu, 61);
  std::vector<k::Tensor> y;
  for (std::uint64_t i = 0; i < 4; ++i) y.push_back(k::randn({n, 1}, k::f32, k::cpu, 62 + i));
  auto f = k::compile([](auto x, auto y1, auto y2, auto y3, auto y4) {
    auto v = y1 + y2 + y3 + y4;
    return std::tuple{k::sum(x, 0), v * 3.0f, k::sum(x * v, -1)};
  });
  auto [a, v3, r] = f(x, y[0], y[1], y[2], y[3]);
  const std::vector<float> xv = k::to_vector<float>(x);
  std::vector<std::vector<float>> yv;
  for (const auto& t : y) yv.push_back(k::to_vector<float>(t));
  std::vector<double> want_a(static_cast<std::size_t>(d), 0.0), want_r(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = double(yv[0][i]) + yv[1][i] + yv[2][i] + yv[3][i];
    for (std::int64_t j = 0; j < d; ++j) {
      want_a[j] += xv[i * d + j];
      want_r[i] += xv[i * d + j] * v;
    }
  }
  check_close(a, want_a, 1e-4);
  check_close(r, want_r, 1e-4);
}

TEST_CASE("partials: a layer_norm backward's dw and db come from its dx kernel (CPU)") {
  check_layer_norm_backward(k::cpu);
}

// A CPU program keeps its partials in arrays, so rows of any length it holds get
// them too (without, the first stage read down columns, a scalar load a lane: 3x slower).
TEST_CASE("partials: on the CPU, rows of 520 columns also get column partials") {
  check_layer_norm_backward(k::cpu, 16384 + 256 * 3, 520);
}

// A column sum that no row kernel hosts gets a row kernel of its own on the CPU: lanes along the
// columns, a loop over each group's rows (the split kernel read down columns: 14x slower).
TEST_CASE("partials: on the CPU, a column sum alone runs as a row kernel with partials") {
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{5000, 1003}, {4096, 1024}}) {
    CAPTURE(rows);
    auto x = k::randn({rows, cols}, k::f32, k::cpu, 12), y = k::randn({rows, cols}, k::f32, k::cpu, 13);
    auto f = k::compile([](auto a, auto b) { return k::sum(a * b, 0) + k::mean(a, 0); });
    k::Tensor got = f(x, y);
    bool row_groups = false;
    for (const auto& kern : k::explain(f, x, y).kernels) {
      CHECK(kern.kind != "split");
      row_groups = row_groups || kern.source.find("KILN_ROW_GROUP") != std::string::npos;
    }
    CHECK(row_groups);
    const std::vector<float> xv = k::to_vector<float>(x), yv = k::to_vector<float>(y);
    std::vector<double> want(static_cast<std::size_t>(cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        want[c] += double(xv[r * cols + c]) * yv[r * cols + c] + double(xv[r * cols + c]) / rows;
    check_close(got, want, 1e-4);
  }
}

TEST_CASE("partials: a layer_norm backward's dw and db come from its dx kernel (GPU)" * needs_gpu()) {
  check_layer_norm_backward(k::cuda);
}

// A call of f, a layer_norm backward, checked against values computed here, and that its dx kernel
// computed dw and db (no stage re-reads x and dy).
template <class F>
void check_dynamic_call(F& f, std::int64_t rows, std::int64_t cols) {
  CAPTURE(rows);
  CAPTURE(cols);
  k::Tensor x = k::randn({rows, cols}, k::f32, k::cpu, 21) * 2.0f + 0.5f,
            dy = k::randn({rows, cols}, k::f32, k::cpu, 22);
  k::Tensor w = k::randn({cols}, k::f32, k::cpu, 23), b = k::randn({cols}, k::f32, k::cpu, 24);
  auto args = std::make_tuple(x.to(k::cuda), w.to(k::cuda), b.to(k::cuda), dy.to(k::cuda));
  auto [dx, dw, db] = std::apply(f, args);
  auto rep = std::apply([&](auto&... a) { return k::explain(f, a...); }, args);
  CHECK(rep.kernels.at(0).source.find("KILN_ROW_GROUP") != std::string::npos);
  CHECK(rep.kernels.size() == 3);  // dx with the partials, then two short sums
  check_values(x, dy, w, dx, dw, db, 23);
}

// With the row length symbolic, the dx kernel still computes dw and db (partials in registers, the
// row held at the compiling call's length); one program over changing row counts.
TEST_CASE("partials: a dynamic layer_norm backward keeps dw and db in its dx kernel (GPU)" * needs_gpu()) {
  auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>), {.shapes = k::shapes::dynamic});
  for (std::int64_t rows : {17001, 16411, 20011}) check_dynamic_call(f, rows, 4096);
  CHECK(f.cache().compiles() == 1);
}

// The row length changes too: one program (the split's padded view takes its kept length from its
// input), its held kernel at 4096 and 2056 columns, its looped twin with the partials in memory at
// 6001 and 1001.
TEST_CASE("partials: a dynamic layer_norm backward over changing row lengths compiles once (GPU)" * needs_gpu()) {
  auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>), {.shapes = k::shapes::dynamic});
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{17001, 4096}, {16411, 2056}, {20011, 6001}, {17389, 1001}})
    check_dynamic_call(f, rows, cols);
  CHECK(f.cache().compiles() == 1);
}

// Looped rows (here forced by KILN_TUNE_ROW_ITERS=0; with symbolic sizes, the held kernel's twin at
// lengths it does not hold) keep the partials in their buffer: each group zeroes its row, then adds
// each row's tiles with a load and a store. Odd lengths put a row's last vector on one thread.
TEST_CASE("partials: looped rows keep dw and db in the partials buffer, static and dynamic (GPU)" * needs_gpu()) {
  ::setenv("KILN_TUNE_ROW_ITERS", "0", 1);
  for (auto mode : {k::shapes::static_, k::shapes::dynamic}) {
    auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>), {.shapes = mode});
    check_dynamic_call(f, 256 * 67, 4096);  // static programs host partials over whole chunks of rows
    check_dynamic_call(f, 256 * 71, 2057);
  }
  ::unsetenv("KILN_TUNE_ROW_ITERS");
}

TEST_CASE("partials: rms_norm's weight gradient on 16-bit rows, fused and against the reference" * needs_gpu()) {
  const std::int64_t rows = 16384, cols = 4096;
  auto x = k::randn({rows, cols}, k::bf16, k::cpu, 5), dy = k::randn({rows, cols}, k::bf16, k::cpu, 6);
  auto w = k::randn({cols}, k::f32, k::cpu, 7);
  auto rms = [](auto a, auto ww) { return k::rms_norm(k::cast(a, k::f32), ww); };
  auto f = k::compile(k::vjp(rms, k::wrt<1>));
  k::Tensor dw = f(x.to(k::cuda), w.to(k::cuda), dy.to(k::cuda).to(k::f32));
  CHECK(k::explain(f, x.to(k::cuda), w.to(k::cuda), dy.to(k::cuda).to(k::f32)).kernels.size() == 3);
  auto xv = k::to_vector<float>(x.to(k::f32)), dv = k::to_vector<float>(dy.to(k::f32));
  std::vector<double> want(cols, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (std::int64_t c = 0; c < cols; ++c) ms += double(xv[r * cols + c]) * xv[r * cols + c];
    double rstd = 1 / std::sqrt(ms / cols + 1e-6);
    for (std::int64_t c = 0; c < cols; ++c) want[c] += dv[r * cols + c] * xv[r * cols + c] * rstd;
  }
  check_close(dw, want, 1e-4);
}

TEST_CASE("partials: too few rows keep the separate column reduction, with the same results") {
  auto x = k::randn({300, 2048}, k::f32, k::cpu, 8), dy = k::randn({300, 2048}, k::f32, k::cpu, 9);
  auto w = k::randn({2048}, k::f32, k::cpu, 10), b = k::randn({2048}, k::f32, k::cpu, 11);
  auto f = k::compile(k::vjp(layer_norm_fn, k::wrt<1, 2>));
  auto [dw, db] = f(x, w, b, dy);
  for (const auto& kern : k::explain(f, x, w, b, dy).kernels)
    CHECK(kern.source.find("KILN_ROW_GROUP") == std::string::npos);
  std::vector<double> want_dw, want_db;
  expected_dw_db(k::to_vector<float>(x), k::to_vector<float>(dy), 300, 2048, want_dw, want_db);
  check_close(dw, want_dw, 1e-5);
  check_close(db, want_db, 1e-5);
}

// What a GPU would run, planned on the host (no GPU needed): GPT-2's norm backward over [8, 1024,
// 768] bf16 keeps dw and db in its dx kernel, several 768-column rows a block, its row slots
// folding their sums; the rule before (KILN_TUNE_PARTIALS=1) read x and dy again in a split
// kernel. The plan's CUDA unit compiles with NVRTC.
TEST_CASE("partials: a GPU plan hosts the sums of narrow rows, several to a block (host)") {
  namespace rt = k::runtime;
  auto x = k::randn({8, 1024, 768}, k::bf16, k::cpu, 51), dy = k::randn({8, 1024, 768}, k::bf16, k::cpu, 52);
  auto w = k::randn({768}, k::f32, k::cpu, 53), b = k::randn({768}, k::f32, k::cpu, 54);
  auto plan = [&] {
    return plan_for(k::Device(k::cuda), k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>)), x, w, b, dy);
  };
  auto p = plan();
  const rt::CompiledKernel& dx = p->kernels.at(0);
  CHECK(dx.src.partial_groups >= 256);
  CHECK(dx.src.config.rows > 1);
  CHECK(dx.src.config.threads == dx.src.config.rows * dx.src.config.row_threads);
  CHECK(dx.src.source.find("fold_row_slots") != std::string::npos);
  for (std::size_t i = 1; i < p->kernels.size(); ++i)
    CHECK(p->kernels[i].src.source.find("rsqrt") == std::string::npos);
  CHECK_FALSE(
      rt::compile_cubin(rt::cuda_translation_unit(*p, rt::program_body(*p)), "kiln_partials_test", "sm_90a").empty());
  // An odd row count (the sweep's 43690 rows of 3072 columns): padded chunks, hosted all the same.
  auto xo = k::randn({4099, 3072}, k::bf16, k::cpu, 55), dyo = k::randn({4099, 3072}, k::bf16, k::cpu, 56);
  auto wo = k::randn({3072}, k::f32, k::cpu, 57), bo = k::randn({3072}, k::f32, k::cpu, 58);
  auto odd = plan_for(k::Device(k::cuda), k::compile(k::vjp(layer_norm_fn, k::wrt<0, 1, 2>)), xo, wo, bo, dyo);
  CHECK(odd->kernels.at(0).src.partial_groups > 0);
  ScopedEnv rule_before("KILN_TUNE_PARTIALS", "1");
  CHECK(plan()->kernels.at(0).src.partial_groups == 0);
}
