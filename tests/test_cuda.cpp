// The CUDA target end to end: the same expressions on the GPU as on the CPU, against the f64
// reference. Skipped, visibly, on machines without a CUDA device.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "cross_entropy_oracle.hpp"
#include "gradient_oracle.hpp"
#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;

namespace {

// Evaluates on the GPU and checks against the oracle built from the same CPU inputs.
template <class MakeExpr>
void check_on_gpu(MakeExpr make, std::vector<k::Tensor> cpu_inputs, double rtol, double atol) {
  std::vector<k::Tensor> gpu;
  for (auto& t : cpu_inputs) gpu.push_back(t.to(k::cuda));
  auto expected = k::reference::eval(make(cpu_inputs));
  k::Tensor got = make(gpu);
  CHECK(got.device() == k::Device(k::cuda));
  auto r = k::testing::allclose(got, expected, rtol, atol);
  CHECK_MESSAGE(bool(r), r);
}

// A compiled function on the GPU against the oracle of the same expression over the CPU inputs.
template <class F, class... T>
void check_compiled(F fn, double rtol, double atol, const T&... cpu) {
  auto f = k::compile(fn);
  k::Tensor got = f(cpu.to(k::cuda)...);
  auto r = k::testing::allclose(got, k::reference::eval(fn(cpu...)), rtol, atol);
  CHECK_MESSAGE(bool(r), r);
}

// The vjp of layer_norm(x, w, b) (eps 1e-5, over the last dim of [rows, cols]) at cotangent dy,
// written out and interpreted (k::reference::eval): dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
// with g = dy * w, dw = the column sums of dy * xhat, db = those of dy.
std::array<k::Tensor, 3> layer_norm_vjp_oracle(const k::Tensor& x, const k::Tensor& w, const k::Tensor& dy) {
  auto xc = x - k::mean(x, {1}, true);
  auto rstd = k::rsqrt(k::mean(xc * xc, {1}, true) + 1e-5f);
  auto xhat = xc * rstd;
  auto g = dy * w;
  return {k::reference::eval(rstd * (g - k::mean(g, {1}, true) - xhat * k::mean(g * xhat, {1}, true))),
          k::reference::eval(k::sum(dy * xhat, {0})), k::reference::eval(k::sum(dy, {0}))};
}

}  // namespace

TEST_CASE("cuda: pointwise chains, broadcasting and dtypes" * needs_gpu()) {
  auto x = k::randn({37, 129}, k::f32, k::cpu, 1), b = k::randn({129}, k::f32, k::cpu, 2);
  check_on_gpu([](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); }, {x}, 1e-6, 1e-6);
  check_on_gpu([](auto& v) { return k::sigmoid(k::tanh(v[0] * 0.5f + 0.1f) * v[0]) * k::exp(-v[0] * v[0]); }, {x}, 1e-5,
               1e-6);
  check_on_gpu([](auto& v) { return k::gelu(v[0] + v[1]); }, {x, b}, 1e-5, 1e-6);
  check_on_gpu([](auto& v) { return k::gelu(v[0] + v[1], k::approximate::tanh); }, {x, b}, 1e-5, 1e-6);
  // sigmoid's tails: saturation, both infinities and NaN. Results below the smallest normal f32
  // (x < -87.3) come out as 0, as with Triton's div.full: the tolerance allows that and no more.
  std::vector<double> edges{-1e30, -200, -103.5, -88.7, -87.3,    -30,       -1e-30, 0,
                            1e-30, 17,   88.7,   1e30,  INFINITY, -INFINITY, NAN};
  auto wide = k::from_vector(edges, {static_cast<std::int64_t>(edges.size())}, k::f32);
  check_on_gpu([](auto& v) { return k::sigmoid(v[0]); }, {wide}, 1e-5, 1.2e-38);
  check_on_gpu([](auto& v) { return k::sigmoid(v[0] * 40.0f); }, {x}, 1e-5, 1.2e-38);
  auto xh = x.to(k::f16), bb = b.to(k::bf16);
  check_on_gpu([](auto& v) { return k::gelu(v[0] + v[1]); }, {xh, bb}, 1e-2, 1e-2);
  check_on_gpu([](auto& v) { return k::where(v[0] > 0.0f, v[0], v[1] * 3.0f); }, {x, b}, 1e-6, 1e-6);
  auto big = k::randn({1 << 20}, k::f32, k::cpu, 3);
  check_on_gpu([](auto& v) { return k::relu(v[0] * 2.0f + 1.0f); }, {big}, 1e-6, 1e-6);
  auto odd = k::randn({(1 << 16) + 3}, k::bf16, k::cpu, 4);
  check_on_gpu([](auto& v) { return v[0] * 2.0f + 1.0f; }, {odd}, 1e-2, 1e-2);
  // 16-bit rounding inside a kernel whose loads and stores are all f32 (the kernel still needs the
  // 16-bit types: without them the prelude's stand-ins gave zeros).
  check_on_gpu([](auto& v) { return k::maximum(k::cast(v[0], k::bf16), v[1]); }, {x, b}, 1e-2, 1e-2);
  check_on_gpu([](auto& v) { return k::cast(k::cast(v[0], k::f16), k::f32) * 3.0f; }, {x}, 1e-2, 1e-2);
}

TEST_CASE("cuda: reductions, softmax and norms" * needs_gpu()) {
  for (auto shape : {k::Dims{37, 129}, k::Dims{64, 4096}, k::Dims{3, 40000}, k::Dims{257, 33}}) {
    auto x = k::randn(shape, k::f32, k::cpu, 5), w = k::randn({shape[1]}, k::f32, k::cpu, 6);
    check_on_gpu([](auto& v) { return k::softmax(v[0], -1); }, {x}, 1e-5, 1e-7);
    check_on_gpu([](auto& v) { return k::log_softmax(v[0], 1); }, {x}, 1e-5, 1e-5);
    check_on_gpu([](auto& v) { return k::layer_norm(v[0], v[1], v[1]); }, {x, w}, 1e-4, 1e-4);
    check_on_gpu([](auto& v) { return k::rms_norm(v[0], v[1]); }, {x, w}, 1e-4, 1e-4);
    check_on_gpu([](auto& v) { return k::sum(v[0], 0); }, {x}, 1e-4, 1e-3);
    check_on_gpu([](auto& v) { return k::amax(v[0], 1, true) - k::amin(v[0], 1, true); }, {x}, 1e-6, 1e-6);
    check_on_gpu([](auto& v) { return k::var(v[0], 1); }, {x}, 1e-4, 1e-5);
  }
  auto x = k::randn({1 << 18}, k::f32, k::cpu, 7);
  check_on_gpu([](auto& v) { return k::sum(v[0]); }, {x}, 1e-4, 1e-2);
  auto h = k::randn({128, 1000}, k::bf16, k::cpu, 8);
  check_on_gpu([](auto& v) { return k::softmax(v[0], -1); }, {h}, 2e-2, 1e-3);
}

// Rows of 256 threads or more with two reductions each (a shared slot per reduction, one barrier
// each) and blocks of two rows (two barriers). scripts/gpu-check also runs this file with
// KILN_TUNE_ROW_WAVES=1, where each block loops over several rows: the slots' reuse across rows.
TEST_CASE("cuda: long rows, several reductions a row" * needs_gpu()) {
  auto x = k::randn({1100, 8192}, k::f32, k::cpu, 9), w = k::randn({8192}, k::f32, k::cpu, 10);
  k::Tensor t = k::cast(k::rand({1100}, k::f32, k::cpu, 11) * 8191.0f, k::i64);
  check_on_gpu([](auto& v) { return k::softmax(v[0] * 3.0f, -1); }, {x}, 1e-5, 1e-8);
  check_on_gpu([](auto& v) { return k::layer_norm(v[0], v[1], v[1]); }, {x, w}, 1e-4, 1e-4);
  check_on_gpu([](auto& v) { return k::cross_entropy(v[0], v[1]); }, {x, t}, 1e-5, 1e-5);
  auto xh = k::randn({1500, 4096}, k::bf16, k::cpu, 12), wh = k::randn({4096}, k::f32, k::cpu, 13);
  check_on_gpu([](auto& v) { return k::layer_norm(k::cast(v[0], k::f32), v[1], v[1]); }, {xh, wh}, 1e-4, 1e-4);
  auto xs = k::randn({3000, 4096}, k::f32, k::cpu, 14);
  check_on_gpu([](auto& v) { return k::log_softmax(v[0], 1); }, {xs}, 1e-5, 1e-5);
}

// Looped rows carry a sum that reads the row's earlier reduction through a row value in the same
// pass (codegen's one_pass_form): Welford's lanes for sum((x - mean)^2), the online softmax for
// sum(exp(x - max)). Rows far from zero, -inf scores (a row of one finite value), spread scores,
// bf16, odd lengths (shifted tiles), a gradient, and the kernel written both ways.
TEST_CASE("cuda: looped rows, two dependent reductions in one pass" * needs_gpu()) {
  const std::int64_t n = 131101;  // longer than a held row: looped
  k::Tensor off = k::randn({37, n}, k::f32, k::cpu, 41) + 30.0f, w = k::randn({n}, k::f32, k::cpu, 42);
  k::Tensor far = k::randn({5, n}, k::f32, k::cpu, 43) * 0.01f + 1000.0f;
  k::Tensor spread = k::randn({37, n}, k::f32, k::cpu, 44) * 60.0f;
  k::Tensor cut = k::randn({6, n}, k::f32, k::cpu, 45);
  {
    auto v = k::to_vector<float>(cut);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (i % 7 == 3 || (i >= 5 * static_cast<std::size_t>(n) && i != 5 * static_cast<std::size_t>(n) + 11))
        v[i] = -INFINITY;
    cut = k::from_vector(v, {6, n}, k::cpu);
  }
  k::Tensor t = k::cast(k::rand({37}, k::f32, k::cpu, 46) * float(n - 1), k::i64);
  k::Tensor h = k::cast(off, k::bf16), sh = k::cast(spread, k::bf16);
  auto ln = [](auto x, auto ww) { return k::layer_norm(x, ww, ww); };
  auto ln16 = [](auto x, auto ww) { return k::layer_norm(k::cast(x, k::f32), ww, ww); };
  auto var = [](auto x) { return k::var(x, 1); };
  auto sm = [](auto x) { return k::softmax(x, -1); };
  auto lsm = [](auto x) { return k::log_softmax(x, 1); };
  auto lse = [](auto x) { return k::logsumexp(x, 1); };
  auto ce = [](auto x, auto tt) { return k::cross_entropy(x, tt); };
  // Compiled afresh under each setting (KILN_TUNE_* are read at each compile; eager caches would
  // keep the first setting's programs).
  for (const char* one_pass : {"1", "0"}) {
    CAPTURE(one_pass);
    ::setenv("KILN_TUNE_ONE_PASS", one_pass, 1);
    check_compiled(ln, 1e-4, 2e-4, off, w);
    check_compiled(var, 1e-3, 1e-9, far);
    check_compiled(sm, 1e-4, 1e-9, spread);
    check_compiled(sm, 1e-4, 1e-9, cut);
    check_compiled(lse, 1e-5, 1e-5, cut);
    check_compiled(lsm, 1e-5, 1e-3, spread);
    check_compiled(ce, 1e-5, 1e-4, spread, t);
    check_compiled(ln16, 1e-4, 3e-4, h, w);
    check_compiled(sm, 2e-2, 1e-6, sh);
    auto dyn = k::compile(ln, {.shapes = k::shapes::dynamic});
    auto close = k::testing::allclose(dyn(off.to(k::cuda), w.to(k::cuda)), k::reference::eval(ln(off, w)), 1e-4, 2e-4);
    CHECK_MESSAGE(bool(close), close);
    std::string src = k::explain(dyn, off.to(k::cuda), w.to(k::cuda)).kernels.at(0).source;
    CHECK((std::string(one_pass) == "1") == (src.find("welford_step") != std::string::npos));
  }
  ::unsetenv("KILN_TUNE_ONE_PASS");
}

// Looped rows of static length that later loops read again keep their tiles in shared memory
// (codegen's kept_row_load): the first loop stores them, later loops read them there; a row past
// the budget keeps its first tiles and reads the rest again. f32 rows of 50257 (201 KB a row, tiles
// shifted or not: layer_norm's weight keeps them unshifted), bf16 rows of 99991 kept 16-bit, two
// arrays a row (a layer_norm backward), a row of 603 KB, a cross_entropy over 50257 bf16 columns
// (looped because its held kernel spills; 100 KB, kept whole), several rows a block's loop
// (KILN_TUNE_ROW_WAVES=1); KILN_TUNE_ROW_SMEM=1 (half an SM's, rows kept in part too), 150000 bytes
// (one block an SM; within an A100's limit too), 0 and the default (whole rows of half an SM's).
TEST_CASE("cuda: looped rows kept in shared memory" * needs_gpu()) {
  const std::int64_t n = 50257;
  k::Tensor x = k::randn({37, n}, k::f32, k::cpu, 51) * 3.0f + 2.0f, w = k::randn({n}, k::f32, k::cpu, 52);
  k::Tensor dy = k::randn({37, n}, k::f32, k::cpu, 53);
  k::Tensor h = k::cast(k::randn({23, 99991}, k::f32, k::cpu, 54) * 4.0f, k::bf16);
  k::Tensor t = k::cast(k::rand({37}, k::f32, k::cpu, 55) * float(n - 1), k::i64);
  k::Tensor past = k::randn({5, 3 * n}, k::f32, k::cpu, 56);  // 603 KB a row: past any device's budget
  k::Tensor xh = k::cast(x, k::bf16);
  auto ln = [](auto a, auto ww) { return k::layer_norm(a, ww, ww); };
  auto sm = [](auto a) { return k::softmax(a, -1); };
  auto lsm = [](auto a) { return k::log_softmax(a, 1); };
  auto ce = [](auto a, auto tt) { return k::cross_entropy(a, tt); };
  auto ce16 = [](auto a, auto tt) { return k::cross_entropy(k::cast(a, k::f32), tt); };
  auto ln_vjp = [](auto a, auto ww, auto g) { return k::sum(k::layer_norm(a, ww, ww) * g); };
  for (std::string waves : {"", "1"}) {
    for (std::string smem : {"1", "150000", "0", ""}) {  // "": the default, whole rows of half an SM
      CAPTURE(waves);
      CAPTURE(smem);
      if (!waves.empty()) ::setenv("KILN_TUNE_ROW_WAVES", waves.c_str(), 1);
      if (!smem.empty()) ::setenv("KILN_TUNE_ROW_SMEM", smem.c_str(), 1);
      check_compiled(ln, 1e-4, 2e-4, x, w);
      check_compiled(sm, 1e-4, 1e-9, x);
      check_compiled(lsm, 1e-5, 1e-4, x);
      check_compiled(ce, 1e-5, 1e-5, x, t);
      check_compiled(ce16, 1e-5, 1e-5, xh, t);
      check_compiled(sm, 2e-2, 1e-6, h);
      check_compiled(sm, 1e-4, 1e-9, past);
      // A backward whose row kernel reads x and dy in several loops; its dx against the oracle of
      // the formula rstd * (gw - mean(gw) - xhat * mean(gw * xhat)), gw = dy * w.
      auto dx = k::grad(ln_vjp, k::wrt<0>)(x.to(k::cuda), w.to(k::cuda), dy.to(k::cuda));
      auto close = k::testing::allclose(dx, layer_norm_vjp_oracle(x, w, dy)[0], 1e-3, 1e-3);
      CHECK_MESSAGE(bool(close), close);
      // (A function of its own for each shape: a second shape would make its sizes symbolic.)
      const bool on = smem != "0" && !smem.empty();  // 201 KB rows: kept whole or in part
      std::string src = k::explain(k::compile(sm), x.to(k::cuda)).kernels.at(0).source;
      CHECK(on == (src.find("kiln::keep_tile") != std::string::npos));
      CHECK(on == (src.find("kiln::kept_tile") != std::string::npos));
      // 100 KB rows (50257 bf16) fit half an SM's: kept whole by default too.
      std::string half = k::explain(k::compile(sm), xh.to(k::cuda)).kernels.at(0).source;
      CHECK((smem != "0") == (half.find("kiln::kept_tile") != std::string::npos));
      // cross_entropy's forward is one loop (online max and sum): nothing to keep.
      std::string one = k::explain(k::compile(ce), x.to(k::cuda), t.to(k::cuda)).kernels.at(0).source;
      CHECK(one.find("kiln::keep_tile") == std::string::npos);
      std::string far = k::explain(k::compile(sm), past.to(k::cuda)).kernels.at(0).source;  // its first tiles kept
      CHECK(on == (far.find("kiln::keep_tile") != std::string::npos));
      ::unsetenv("KILN_TUNE_ROW_SMEM");
      ::unsetenv("KILN_TUNE_ROW_WAVES");
    }
  }
  // Looped rows several to a block (rows of 1000 looped by KILN_TUNE_ROW_ITERS=0: two 32-thread
  // rows a block), each row its own cells.
  ::setenv("KILN_TUNE_ROW_SMEM", "1", 1);
  ::setenv("KILN_TUNE_ROW_ITERS", "0", 1);
  k::Tensor r = k::randn({4095, 1000}, k::f32, k::cpu, 57);
  check_compiled(sm, 1e-4, 1e-9, r);
  k::Tensor rw = k::randn({1000}, k::f32, k::cpu, 58);
  check_compiled(ln, 1e-4, 2e-4, r, rw);
  k::Tensor rh = k::cast(r, k::bf16);
  check_compiled(sm, 2e-2, 1e-6, rh);
  std::string several = k::explain(k::compile(sm), r.to(k::cuda)).kernels.at(0).source;
  CHECK(several.find("kiln::kept_tile") != std::string::npos);
  CHECK(several.find("ROWS = 1,") == std::string::npos);
  ::unsetenv("KILN_TUNE_ROW_ITERS");
  ::unsetenv("KILN_TUNE_ROW_SMEM");
}

// GPU column reductions held in registers (read once) and looped ones, against the oracle: softmax
// and log_softmax over a middle dim of 12 and 16 (a thread holds its whole column), 32 (a column
// block's threads hold four steps each), 130 (past 16 steps: looped); a column variance (two loops)
// over 7 rows; bf16; and KILN_TUNE_ROW_ITERS=0 (looped).
TEST_CASE("cuda: short columns held in registers" * needs_gpu()) {
  auto sm1 = [](auto a) { return k::softmax(a, 1); };
  auto lsm1 = [](auto a) { return k::log_softmax(a, 1); };
  auto var0 = [](auto a) { return k::var(a, 0); };
  for (std::string iters : {"", "0"}) {
    CAPTURE(iters);
    if (!iters.empty()) ::setenv("KILN_TUNE_ROW_ITERS", iters.c_str(), 1);
    for (auto shape : {k::Dims{29, 12, 197}, k::Dims{33, 16, 64}, k::Dims{31, 32, 65}, k::Dims{3, 130, 33}}) {
      CAPTURE(shape);
      k::Tensor x = k::randn(shape, k::f32, k::cpu, 61) * 3.0f;
      check_compiled(sm1, 1e-5, 1e-7, x);
      check_compiled(lsm1, 1e-5, 1e-5, x);
      check_compiled(sm1, 2e-2, 1e-4, x.to(k::bf16));
    }
    k::Tensor y = k::randn({7, 1001}, k::f32, k::cpu, 62) + 5.0f;
    check_compiled(var0, 1e-4, 1e-5, y);
    // (A function of its own for each shape: a second shape would make its sizes symbolic.) Columns
    // of 12 are held by a thread alone, columns of 32 by a column block's threads.
    k::Tensor x = k::randn({29, 12, 197}, k::f32, k::cuda, 63);
    std::string src = k::explain(k::compile(sm1), x).kernels.at(0).source;
    CHECK((iters != "0") == (src.find("ROW_THREADS = 1, RITERS = 12,") != std::string::npos));
    x = k::randn({29, 32, 197}, k::f32, k::cuda, 64);
    src = k::explain(k::compile(sm1), x).kernels.at(0).source;
    CHECK((iters != "0") == (src.find("KILN_R_COLUMN_TILES") != std::string::npos));
    ::unsetenv("KILN_TUNE_ROW_ITERS");
  }
  // A scalar a thread's tile (s, one a group of 64 columns) in the last column block, whose threads
  // past the kept elements loop too (its load is tested there: compute-sanitizer saw s[5] read), and
  // columns of 12 forced into blocks (KILN_TUNE_COLUMN_LANES=2, autotuning's alternative).
  auto scaled0 = [](auto a, auto sc) { return k::softmax(a * sc, 0); };
  k::Tensor xs = k::randn({50, 5, 64}, k::f32, k::cpu, 65), s = k::rand({1, 5, 1}, k::f32, k::cpu, 66) + 0.5f;
  check_compiled(scaled0, 1e-5, 1e-7, xs, s);
  ::setenv("KILN_TUNE_COLUMN_LANES", "2", 1);
  k::Tensor x = k::randn({29, 12, 197}, k::f32, k::cpu, 67) * 3.0f;
  check_compiled(sm1, 1e-5, 1e-7, x);
  check_compiled(sm1, 2e-2, 1e-4, x.to(k::bf16));
  CHECK(k::explain(k::compile(sm1), x.to(k::cuda)).kernels.at(0).source.find("KILN_R_COLUMN_TILES") !=
        std::string::npos);
  ::unsetenv("KILN_TUNE_COLUMN_LANES");
}

// Row-uniform loads as one scalar a row (KILN_TUNE_ROW_SCALARS=1, off by default; not yet run on
// a GPU when written): cross_entropy's gradient reads its target class in the row's loop; a per-row scale
// inside a softmax; held rows (1000 columns) and looped ones (70001).
TEST_CASE("cuda: row-uniform loads as one scalar a row" * needs_gpu()) {
  auto ce_grad = k::value_and_grad([](auto l, auto tt) { return k::cross_entropy(l, tt); }, k::wrt<0>);
  auto scaled = [](auto a, auto r) { return k::softmax(a * r, -1) + k::exp(r); };
  for (std::int64_t n : {1000, 70001}) {
    CAPTURE(n);
    k::Tensor x = k::randn({37, n}, k::f32, k::cpu, 71), s = k::rand({37, 1}, k::f32, k::cpu, 72) + 0.5f;
    k::Tensor t = k::cast(k::rand({37}, k::f32, k::cpu, 73) * float(n - 1), k::i64);
    for (const char* knob : {"1", "0"}) {
      CAPTURE(knob);
      ::setenv("KILN_TUNE_ROW_SCALARS", knob, 1);
      auto f = k::compile(ce_grad);
      auto [loss, dx] = f(x.to(k::cuda), t.to(k::cuda));
      auto want = k::reference::eval((k::softmax(x, -1) - k::cast(k::unsqueeze(t, 1) == k::arange(n), k::f32)) / 37.0f);
      auto close = k::testing::allclose(dx, want, 1e-4, 1e-7);
      CHECK_MESSAGE(bool(close), close);
      close = k::testing::allclose(loss, k::reference::eval(k::cross_entropy(x, t)), 1e-5, 1e-5);
      CHECK_MESSAGE(bool(close), close);
      std::string src = k::explain(f, x.to(k::cuda), t.to(k::cuda)).kernels.at(0).source;
      CHECK((src.find(", xindex, xmask)") != std::string::npos) == (std::string(knob) == "1"));
      check_compiled(scaled, 1e-4, 1e-6, x, s);
    }
  }
  ::unsetenv("KILN_TUNE_ROW_SCALARS");
}

// Rows whose length is no whole number of 16-byte vectors start their tiles on the vector before
// the row (codegen's row shift): held and looped rows, bf16 and f32, a gradient, a 3-d input, inputs
// the same for every row read through views, and an offset view (not shifted: tested accesses).
TEST_CASE("cuda: rows of odd length, tiles from the vector before the row" * needs_gpu()) {
  auto h = k::randn({67, 50257}, k::bf16, k::cpu, 21);
  check_on_gpu([](auto& v) { return k::softmax(v[0], -1); }, {h}, 2e-2, 1e-4);
  check_on_gpu([](auto& v) { return k::log_softmax(v[0], -1); }, {h}, 2e-2, 2e-2);
  auto x = k::randn({41, 1001}, k::f32, k::cpu, 22);
  k::Tensor t = k::cast(k::rand({41}, k::f32, k::cpu, 23) * 1000.0f, k::i64);
  check_on_gpu([](auto& v) { return k::cross_entropy(v[0], v[1]); }, {x, t}, 1e-5, 1e-5);
  // Its gradient against the oracle of the formula (softmax(x) - one_hot(t)) / rows.
  auto dx = std::get<1>(k::value_and_grad([](auto a, auto b) { return k::cross_entropy(a, b); }, k::wrt<0>)(
      x.to(k::cuda), t.to(k::cuda)));
  auto want = k::reference::eval((k::softmax(x, -1) - k::cast(k::unsqueeze(t, 1) == k::arange(1001), k::f32)) / 41.0f);
  auto close = k::testing::allclose(dx, want, 1e-4, 1e-7);
  CHECK_MESSAGE(bool(close), close);
  auto x3 = k::randn({5, 7, 197}, k::bf16, k::cpu, 24);
  check_on_gpu([](auto& v) { return k::softmax(v[0], -1); }, {x3}, 2e-2, 1e-3);
  auto looped = k::randn({3, 300007}, k::f32, k::cpu, 25);
  check_on_gpu([](auto& v) { return k::softmax(v[0], -1); }, {looped}, 1e-5, 1e-9);
  // The same for every row but no weight's shape: a column read through a transpose, a row of a
  // stacked tensor, a reshape (loaded in each row, as the shifted tiles want: not hoisted).
  auto xr = k::randn({64, 1001}, k::f32, k::cpu, 27), wc = k::randn({1001, 1}, k::f32, k::cpu, 28);
  auto stacked = k::randn({4, 1001}, k::f32, k::cpu, 29), w3 = k::randn({1, 1, 1001}, k::f32, k::cpu, 30);
  check_on_gpu([](auto& v) { return k::softmax(v[0] + k::transpose(v[1], 0, 1), -1); }, {xr, wc}, 1e-5, 1e-8);
  check_on_gpu([](auto& v) { return k::softmax(v[0] + k::squeeze(k::slice(v[1], 0, 2, 3), 0), -1); }, {xr, stacked},
               1e-5, 1e-8);
  check_on_gpu([](auto& v) { return k::softmax(v[0] + k::reshape(v[1], k::Dims{1001}), -1); }, {xr, w3}, 1e-5, 1e-8);
  auto wide = k::randn({9, 1003}, k::f32, k::cpu, 26);
  check_on_gpu([](auto& v) { return k::softmax(k::slice(v[0], 1, 1, 1002), -1); }, {wide}, 1e-5, 1e-8);
  // Rows with weights: rms_norm's held 16-bit rows are shifted too (NOTES 118), the weight's tiles
  // then starting anywhere (tested accesses, not hoisted across rows); held rows several to a block
  // and one a block, a looped row, both dtypes, layer_norm (unshifted) beside it, its backward;
  // KILN_TUNE_ROW_SHIFT=1 keeps every row with weights unshifted (the rule before), 2 shifts every
  // held row with weights (layer_norm and the norm backwards too); weights sliced at an offset of a
  // whole vector and of less.
  auto ln = [](auto a, auto w, auto b) { return k::layer_norm(a, w, b); };
  auto rms = [](auto a, auto w) { return k::rms_norm(a, w); };
  auto rms_at3 = [](auto a, auto w) { return k::rms_norm(a, k::slice(w, 0, 3, 200)); };
  auto ln_at8 = [](auto a, auto w, auto b) { return k::layer_norm(a, k::slice(w, 0, 8, 205), k::slice(b, 0, 3, 200)); };
  auto ln_bwd = k::vjp([](auto a, auto w, auto b) { return k::layer_norm(a, w, b); }, k::wrt<0, 1, 2>);
  for (const char* shift : {"", "1", "2"}) {
    CAPTURE(shift);
    if (*shift) ::setenv("KILN_TUNE_ROW_SHIFT", shift, 1);
    for (std::int64_t n : {197, 1001, 30011}) {
      CAPTURE(n);
      k::Tensor a = k::randn({37, n}, k::f32, k::cpu, 36), w = k::randn({n}, k::f32, k::cpu, 37) + 1.0f,
                b = k::randn({n}, k::f32, k::cpu, 38);
      check_compiled(ln, 1e-4, 1e-5, a, w, b);
      check_compiled(rms, 1e-4, 1e-5, a, w);
      check_compiled(ln, 2e-2, 2e-2, a.to(k::bf16), w.to(k::bf16), b.to(k::bf16));
      check_compiled(rms, 2e-2, 2e-2, a.to(k::bf16), w.to(k::bf16));
      // The backward's dw and db sum over rows: tolerances of a sum of 37 products.
      k::Tensor dy = k::randn({37, n}, k::f32, k::cpu, 41);
      auto [dx, dw, db] = ln_bwd(a.to(k::cuda), w.to(k::cuda), b.to(k::cuda), dy.to(k::cuda));
      const std::array<k::Tensor, 3> got{dx, dw, db}, want = layer_norm_vjp_oracle(a, w, dy);
      for (int i = 0; i < 3; ++i) {
        auto close = k::testing::allclose(got[i], want[i], 1e-3, 1e-4);
        CHECK_MESSAGE(bool(close), close);
      }
    }
    k::Tensor wide_w = k::randn({211}, k::f32, k::cpu, 42) + 1.0f, wide_b = k::randn({211}, k::f32, k::cpu, 43);
    k::Tensor a197 = k::randn({37, 197}, k::f32, k::cpu, 44);
    check_compiled(rms_at3, 1e-4, 1e-5, a197, wide_w);
    check_compiled(ln_at8, 1e-4, 1e-5, a197, wide_w, wide_b);
    check_compiled(rms_at3, 2e-2, 2e-2, a197.to(k::bf16), wide_w.to(k::bf16));
    check_compiled(ln_at8, 2e-2, 2e-2, a197.to(k::bf16), wide_w.to(k::bf16), wide_b.to(k::bf16));
    k::Tensor a = k::randn({37, 197}, k::bf16, k::cuda, 39), w = k::randn({197}, k::bf16, k::cuda, 40);
    std::string src = k::explain(k::compile(rms), a, w).kernels.at(0).source;
    const bool shifted = std::string(shift) != "1";
    CHECK(shifted == (src.find("KILN_R_TILES_SHIFTED(roffset, kiln_shift)") != std::string::npos));
    ::unsetenv("KILN_TUNE_ROW_SHIFT");
  }
}

// cross_entropy's fused forward and backward over rows of n bf16 values, by `step` (a compiled
// value_and_grad), against the oracle; the kernels are printed.
template <class Step>
static void check_cross_entropy(k::Device dev, Step& step, std::int64_t n) {
  CAPTURE(n);
  k::Tensor x = k::randn({67, n}, k::bf16, k::cpu, 31);
  k::Tensor t = k::cast(k::rand({67}, k::f32, k::cpu, 32) * static_cast<float>(n), k::i64);
  auto [loss, dx] = step(x.to(dev), t.to(dev));
  CHECK(dx.dtype() == k::bf16);
  auto xf = k::cast(x, k::f32);
  auto want_loss = k::reference::eval(k::cross_entropy(xf, t));
  auto want_dx = k::reference::eval((k::softmax(xf, -1) - k::cast(k::unsqueeze(t, 1) == k::arange(n), k::f32)) / 67.0f);
  auto close = k::testing::allclose(loss, want_loss, 1e-5, 1e-5);
  CHECK_MESSAGE(bool(close), close);
  close = k::testing::allclose(dx, want_dx, 1e-2, 1e-9);  // one bf16 rounding of each gradient
  CHECK_MESSAGE(bool(close), close);
  std::string names;
  for (const auto& kern : k::explain(step, x.to(dev), t.to(dev)).kernels) names += " " + kern.name;
  MESSAGE("kernels:" << names);
}

static auto cross_entropy_step(k::options opts = {}) {
  return k::compile(
      k::value_and_grad([](auto a, auto b) { return k::cross_entropy(k::cast(a, k::f32), b); }, k::wrt<0>), opts);
}

// Over GPT-2's vocabulary: the held row spilled (ptxas gave it 64 registers), so the program writes
// it again looped (runtime/refit_held_rows.hpp's loop_spilled_rows). Values whichever kernel ptxas's
// registers led to.
TEST_CASE("cuda: cross_entropy over 50257 bf16 columns, forward and backward" * needs_gpu()) {
  auto step = cross_entropy_step();
  check_cross_entropy(k::cuda, step, 50257);
}

// Rows of symbolic length compiled at 50257 and 32003: each held kernel of the chain of twins (NOTES
// item 175) that spills is looped or leaves the chain (loop_spilled_rows); lengths for the compiled
// kernel, the middle range and the looped twin, against the oracle.
TEST_CASE("cuda: cross_entropy over bf16 rows of symbolic length, spilling twins" * needs_gpu()) {
  for (std::int64_t first : {50257, 32003}) {
    CAPTURE(first);
    auto step = cross_entropy_step({.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise});
    for (std::int64_t n : {first, first - first / 5, first / 2 + 1, first / 3}) check_cross_entropy(k::cuda, step, n);
    CHECK(step.cache().compiles() == 1);
  }
}

TEST_CASE("cuda: views and compiled functions with dynamic shapes" * needs_gpu()) {
  auto x = k::randn({6, 7, 9}, k::f32, k::cpu, 9);
  check_on_gpu([](auto& v) { return k::permute(v[0], {2, 0, 1}) * 2.0f; }, {x}, 1e-6, 1e-6);
  check_on_gpu([](auto& v) { return k::slice(v[0], 2, 1, 8, 3) + 1.0f; }, {x}, 1e-6, 1e-6);
  check_on_gpu([](auto& v) { return k::reshape(k::transpose(v[0], 0, 1), {7, -1}) - 1.0f; }, {x}, 1e-6, 1e-6);

  auto f = k::compile([](auto a, auto w) { return k::layer_norm(a, w, w) * 2.0f; }, {.shapes = k::shapes::dynamic});
  auto w = k::randn({256}, k::f32, k::cuda, 10);
  for (int rows : {3, 17, 64, 129}) {
    auto a = k::randn({rows, 256}, k::f32, k::cuda, 11 + rows);
    k::Tensor y = f(a, w);
    auto ref = k::reference::eval(k::layer_norm(a, w, w) * 2.0f);
    auto r = k::testing::allclose(y, ref, 1e-4, 1e-4);
    CHECK_MESSAGE(bool(r), r);
  }
  CHECK(k::explain(f, k::randn({5, 256}, k::f32, k::cuda, 1), w).recompiles == 0);
}

TEST_CASE("cuda: dynamic kernels index in int under a guard on their sizes" * needs_gpu()) {
  // A transpose's index divides by a symbolic size: int arithmetic while the program's sizes stay
  // within 2^30 elements, a program with i64 indices past that.
  auto fn = [](auto a) { return k::transpose(a, 0, 1) * 2.0f; };
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
  auto has = [](const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; };
  for (auto shape : {k::Dims{37, 1000}, k::Dims{129, 65}}) {
    auto a = k::randn(shape, k::bf16, k::cpu, 21);
    auto r = k::testing::allclose(f(a.to(k::cuda)), k::reference::eval(fn(a)), 1e-2, 1e-2);
    CHECK_MESSAGE(bool(r), r);
  }
  k::report rep = k::explain(f, k::randn({5, 7}, k::bf16, k::cuda, 22));
  INFO(rep);
  CHECK(rep.recompiles == 0);
  REQUIRE_FALSE(rep.kernels.empty());
  CHECK(has(rep.kernels[0].source, "typedef int ix"));
  CHECK(std::any_of(rep.guards.begin(), rep.guards.end(), [&](const std::string& g) { return has(g, "32 bits"); }));
  // [46341, 46341] bf16: past 2^31 elements (4 GiB), where int indices would wrap: past the guard.
  const std::int64_t rows = 46341, cols = 46341;
  auto big = k::randn({rows, cols}, k::bf16, k::cuda, 23);
  k::Tensor out = f(big);
  rep = k::explain(f, big);
  CHECK(rep.recompiles == 1);
  REQUIRE_FALSE(rep.kernels.empty());
  CHECK(has(rep.kernels[0].source, "typedef i64 ix"));
  // The last columns of the input are the last rows of the output, doubled.
  k::Tensor in_tail = k::Tensor(k::slice(big, 1, cols - 3, cols)).to(k::cpu);
  k::Tensor out_tail = k::Tensor(k::slice(out, 0, cols - 3, cols)).to(k::cpu);
  auto r = k::testing::allclose(out_tail, k::reference::eval(fn(in_tail)), 1e-2, 1e-2);
  CHECK_MESSAGE(bool(r), r);
}

TEST_CASE("cuda: dynamic rows held at the compiling call's length, looped at other lengths" * needs_gpu()) {
  // The first call's rows (3000) are held in registers; lengths past the tiles, or under half of
  // them, launch the same kernel written looped: one program, every length right.
  auto sm = [](auto a) { return k::softmax(a, -1) * 3.0f; };
  auto ln = [](auto a, auto w) { return k::layer_norm(a, w, w); };
  auto f = k::compile(sm, {.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise});
  auto g = k::compile(ln, {.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise});
  // Served by the held kernel: 3000, 2000, 1540, 3072 (its whole tiles); by the looped one: the rest.
  for (std::int64_t cols : {3000, 1537, 4096, 2049, 100, 5001, 2999, 2000, 1540, 3072}) {
    CAPTURE(cols);
    auto a = k::randn({37, cols}, k::f32, k::cpu, 31 + static_cast<int>(cols));
    auto w = k::randn({cols}, k::f32, k::cpu, 32);
    auto r = k::testing::allclose(f(a.to(k::cuda)), k::reference::eval(sm(a)), 1e-5, 1e-6);
    CHECK_MESSAGE(bool(r), r);
    r = k::testing::allclose(g(a.to(k::cuda), w.to(k::cuda)), k::reference::eval(ln(a, w)), 1e-4, 1e-4);
    CHECK_MESSAGE(bool(r), r);
  }
  // A served length through a pointer one element past a 16-byte boundary: the unaligned body.
  auto flat = k::randn({37 * 3000 + 1}, k::f32, k::cpu, 36);
  auto view = flat.as_strided({37, 3000}, {3000, 1}, 1);
  auto r = k::testing::allclose(f(flat.to(k::cuda).as_strided({37, 3000}, {3000, 1}, 1)), k::reference::eval(sm(view)),
                                1e-5, 1e-6);
  CHECK_MESSAGE(bool(r), r);
  k::report rep = k::explain(f, k::randn({5, 3000}, k::f32, k::cuda, 33));
  INFO(rep);
  CHECK(rep.recompiles == 0);
  REQUIRE_FALSE(rep.kernels.empty());
  CHECK(rep.kernels[0].source.find("KILN_R_TILES") != std::string::npos);
  CHECK(k::explain(g, k::randn({5, 3000}, k::f32, k::cuda, 34), k::randn({3000}, k::f32, k::cuda, 35)).recompiles == 0);
}

TEST_CASE("cuda: dynamic rows of odd length, shifted to whole vectors" * needs_gpu()) {
  // Rows of symbolic length whose first call's length is no whole number of vectors: each row's
  // tiles start on the vector before it (its shift computed as the row starts), held at the first
  // length and serving any length the tiles hold, looped (shifted too) past them; an attention
  // softmax whose sequence length changes, both dtypes, one program throughout.
  auto sm = [](auto a) { return k::softmax(a, -1); };
  auto lsm = [](auto a) { return k::log_softmax(a, -1) * 0.5f; };
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  for (k::dtype dt : {k::bf16, k::f32}) {
    CAPTURE(dt);
    const double tol = dt == k::bf16 ? 2e-2 : 1e-5;
    auto f = k::compile(sm, dyn);
    auto g = k::compile(lsm, dyn);
    for (std::int64_t cols : {197, 251, 8, 64, 256, 249, 250, 1001, 3073, 200, 5}) {
      CAPTURE(cols);
      auto a = k::randn({37, cols}, k::f32, k::cpu, 50 + static_cast<int>(cols)).to(dt);
      auto r = k::testing::allclose(f(a.to(k::cuda)), k::reference::eval(sm(a)), tol, tol * 0.1);
      CHECK_MESSAGE(bool(r), r);
      r = k::testing::allclose(g(a.to(k::cuda)), k::reference::eval(lsm(a)), tol, tol);
      CHECK_MESSAGE(bool(r), r);
    }
    // A length served by the held kernel through a pointer one element past a 16-byte boundary.
    auto flat = k::randn({37 * 197 + 1}, k::f32, k::cpu, 52).to(dt);
    auto r = k::testing::allclose(f(flat.to(k::cuda).as_strided({37, 197}, {197, 1}, 1)),
                                  k::reference::eval(sm(flat.as_strided({37, 197}, {197, 1}, 1))), tol, tol * 0.1);
    CHECK_MESSAGE(bool(r), r);
    k::report rep = k::explain(f, k::randn({5, 199}, k::f32, k::cuda, 53).to(dt));
    INFO(rep);
    CHECK(rep.recompiles == 0);
    REQUIRE_FALSE(rep.kernels.empty());
    CHECK(rep.kernels[0].source.find("KILN_R_TILES_SHIFTED(roffset, kiln_shift)") != std::string::npos);
    // Scores [B, H, T, T] over a changing sequence length.
    auto att = k::compile(sm, dyn);
    for (std::int64_t T : {37, 45, 64, 129, 8}) {
      CAPTURE(T);
      auto s4 = k::randn({2, 3, T, T}, k::f32, k::cpu, 54 + static_cast<int>(T)).to(dt);
      r = k::testing::allclose(att(s4.to(k::cuda)), k::reference::eval(sm(s4)), tol, tol * 0.1);
      CHECK_MESSAGE(bool(r), r);
    }
    CHECK(k::explain(att, k::randn({2, 3, 51, 51}, k::f32, k::cuda, 55).to(dt)).recompiles == 0);
  }
}

TEST_CASE("cuda: dynamic rows of odd length with a weight, shifted as static ones are" * needs_gpu()) {
  // rms_norm's 16-bit rows with their weight, the row length symbolic (NOTES item 167): shifted
  // and held at the first call's length, serving the lengths its tiles hold; the looped twin
  // (unshifted: a looped row with weights) past them; one program throughout. f32 rows stay
  // unshifted, as static ones do; layer_norm (as many weights as full-size arrays) too.
  auto rms = [](auto a, auto w) { return k::rms_norm(a, w); };
  auto ln = [](auto a, auto w, auto b) { return k::layer_norm(a, w, b); };
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  for (k::dtype dt : {k::bf16, k::f32}) {
    CAPTURE(dt);
    const double tol = dt == k::bf16 ? 2e-2 : 1e-4;
    auto f = k::compile(rms, dyn);
    auto g = k::compile(ln, dyn);
    for (std::int64_t cols : {197, 251, 8, 64, 249, 1001, 3073, 200, 5, 30011}) {
      CAPTURE(cols);
      const int seed = 70 + static_cast<int>(cols % 1000);
      k::Tensor a = k::randn({37, cols}, k::f32, k::cpu, seed).to(dt);
      k::Tensor w = k::Tensor(k::randn({cols}, k::f32, k::cpu, seed + 1) + 1.0f).to(dt);
      k::Tensor b = k::randn({cols}, k::f32, k::cpu, seed + 2).to(dt);
      auto r = k::testing::allclose(f(a.to(k::cuda), w.to(k::cuda)), k::reference::eval(rms(a, w)), tol, tol);
      CHECK_MESSAGE(bool(r), r);
      r = k::testing::allclose(g(a.to(k::cuda), w.to(k::cuda), b.to(k::cuda)), k::reference::eval(ln(a, w, b)), tol,
                               tol);
      CHECK_MESSAGE(bool(r), r);
    }
    CHECK(f.cache().compiles() == 1);
    CHECK(g.cache().compiles() == 1);
    // A length the held kernel serves, its weight one element past a 16-byte boundary.
    k::Tensor a = k::randn({37, 211}, k::f32, k::cpu, 94).to(dt);
    k::Tensor flat = k::Tensor(k::randn({212}, k::f32, k::cpu, 95) + 1.0f).to(dt);
    auto r = k::testing::allclose(f(a.to(k::cuda), flat.to(k::cuda).as_strided({211}, {1}, 1)),
                                  k::reference::eval(rms(a, flat.as_strided({211}, {1}, 1))), tol, tol);
    CHECK_MESSAGE(bool(r), r);
    k::report rep =
        k::explain(f, k::randn({5, 199}, k::f32, k::cuda, 92).to(dt), k::randn({199}, k::f32, k::cuda, 93).to(dt));
    INFO(rep);
    REQUIRE_FALSE(rep.kernels.empty());
    const bool shifted = rep.kernels[0].source.find("KILN_R_TILES_SHIFTED(roffset, kiln_shift)") != std::string::npos;
    CHECK(shifted == (dt == k::bf16));
  }
}

// Unshifted rows of symbolic length at an odd first length (layer_norm's weight and bias, and its
// backward's column partials: NOTES item 169): held in registers as the static kernel at that
// length is, a mask test a lane, serving the lengths its tiles hold; the looped twin past them.
// dx, dw and db against the f64 oracle at changing lengths, one program.
TEST_CASE("cuda: dynamic unshifted rows of odd length held, forward and backward" * needs_gpu()) {
  auto loss = [](auto a, auto w, auto b, auto g) { return k::sum(k::layer_norm(a, w, b) * g); };
  auto ln = [](auto a, auto w, auto b) { return k::layer_norm(a, w, b); };
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  for (k::dtype dt : {k::f32, k::bf16}) {
    CAPTURE(dt);
    const double tol = dt == k::bf16 ? 5e-2 : 1e-3;
    auto grad = k::compile(k::grad(loss, k::wrt<0, 1, 2>), dyn);
    auto fwd = k::compile(ln, dyn);
    for (std::int64_t cols : {197, 203, 131, 1001, 64, 7, 4099}) {
      CAPTURE(cols);
      const int seed = 300 + static_cast<int>(cols % 1000);
      auto in = [&](std::vector<std::int64_t> shape, int s, float shift) {
        return k::Tensor(k::randn(shape, k::f32, k::cpu, seed + s) + shift).to(dt);
      };
      k::Tensor a = in({53, cols}, 0, 0.5f), w = in({cols}, 1, 1.0f), b = in({cols}, 2, 0.0f),
                g = in({53, cols}, 3, 0.0f);
      auto [da, dw, db] = grad(a.to(k::cuda), w.to(k::cuda), b.to(k::cuda), g.to(k::cuda));
      auto f64 = [](const k::Tensor& x) { return k::Tensor(k::cast(x, k::f64)); };
      const auto want = oracle_outputs(k::grad(loss, k::wrt<0, 1, 2>), f64(a), f64(w), f64(b), f64(g));
      int i = 0;
      for (const k::Tensor& got : {da, dw, db}) {
        CAPTURE(i);
        // dw and db sum 53 rows of 16-bit products: a looser bound in bf16.
        auto r = k::testing::allclose(got.to(k::f64), k::reference::to_tensor(want[i++]), tol, tol);
        CHECK_MESSAGE(bool(r), r);
      }
      auto r = k::testing::allclose(fwd(a.to(k::cuda), w.to(k::cuda), b.to(k::cuda)), k::reference::eval(ln(a, w, b)),
                                    dt == k::bf16 ? 2e-2 : 1e-4, dt == k::bf16 ? 2e-2 : 1e-4);
      CHECK_MESSAGE(bool(r), r);
    }
    CHECK(grad.cache().compiles() == 1);
    CHECK(fwd.cache().compiles() == 1);
    // A fresh program at an odd length: its row kernel holds the row (register tiles, lane masks).
    auto fresh = k::compile(ln, dyn);
    k::report rep =
        k::explain(fresh, k::randn({5, 199}, k::f32, k::cuda, 96).to(dt), k::randn({199}, k::f32, k::cuda, 97).to(dt),
                   k::randn({199}, k::f32, k::cuda, 98).to(dt));
    INFO(rep);
    REQUIRE_FALSE(rep.kernels.empty());
    const std::string& src = rep.kernels[0].source;
    CHECK(src.find("KILN_R_TILES(roffset)") != std::string::npos);
    CHECK(src.find("(rindex < rnumel) & xmask;") != std::string::npos);
    // 16-bit rows store a tile off a vector with every lane live without a test a lane (NOTES 172).
    CHECK((src.find("kiln::align::tile") != std::string::npos) == (dt == k::bf16));
  }
}

// sum(rms_norm(a, w) * g) and its gradients dx and dw by `grad` (a compiled k::grad of it) on the
// GPU, against the f64 oracle's.
static constexpr auto rms_norm_loss = [](auto a, auto w, auto g) { return k::sum(k::rms_norm(a, w, 1e-6) * g); };
template <class Grad>
static void check_rms_norm_grads(Grad& grad, const k::Tensor& a, const k::Tensor& w, const k::Tensor& g, double tol) {
  auto [da, dw] = grad(a.to(k::cuda), w.to(k::cuda), g.to(k::cuda));
  auto f64 = [](const k::Tensor& x) { return k::Tensor(k::cast(x, k::f64)); };
  const auto want = oracle_outputs(k::grad(rms_norm_loss, k::wrt<0, 1>), f64(a), f64(w), f64(g));
  int i = 0;
  for (const k::Tensor& got : {da, dw}) {
    CAPTURE(i);
    auto r = k::testing::allclose(got.to(k::f64), k::reference::to_tensor(want[i++]), tol, tol);
    CHECK_MESSAGE(bool(r), r);
  }
}

// NOTES 175: a held row of symbolic length whose live tiles were counted from the compiling call's
// length (3073 bf16, shifted rows) serves lengths from those tiles' end up; the held kernel of the
// rule before (KILN_TUNE_LIVE_TILES=4) serves the lengths between, the looped twin the rest. Values
// and gradients against the f64 oracle at lengths each of the three kernels launches for.
TEST_CASE("cuda: live tiles from the compiling length, the chain of held and looped twins" * needs_gpu()) {
  auto sm = [](auto a) { return k::softmax(a, -1); };
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  auto grad = k::compile(k::grad(rms_norm_loss, k::wrt<0, 1>), dyn);
  auto fwd = k::compile(sm, dyn);
  // 3073 first (the compiling length); 3080 the same kernel; 2500 and 1900 the middle held
  // kernel; 1001 and 4099 the looped twin.
  for (std::int64_t cols : {3073, 3080, 2500, 1900, 1001, 4099}) {
    CAPTURE(cols);
    const int seed = 500 + static_cast<int>(cols % 1000);
    auto in = [&](std::vector<std::int64_t> shape, int s, float shift) {
      return k::Tensor(k::randn(shape, k::f32, k::cpu, seed + s) + shift).to(k::bf16);
    };
    k::Tensor a = in({41, cols}, 0, 0.5f), w = in({cols}, 1, 1.0f), g = in({41, cols}, 2, 0.0f);
    check_rms_norm_grads(grad, a, w, g, 5e-2);
    auto r = k::testing::allclose(fwd(a.to(k::cuda)), k::reference::eval(sm(a)), 2e-2, 2e-2);
    CHECK_MESSAGE(bool(r), r);
  }
  CHECK(grad.cache().compiles() == 1);
  CHECK(fwd.cache().compiles() == 1);
}

// A held row of symbolic length whose hoisted weights cost it blocks an SM (rms_norm's backward over
// 1024 rows of 3073 f32 columns: two rows a block, 156 registers, one block where its bound asked
// for two): written again with the weights in shared memory (runtime/refit_held_rows.hpp's
// share_held_weights, NOTES item 170), its dx and dw against the f64 oracle at the compiling length,
// others the held kernel serves (3001, 2049) and lengths its looped twin serves (4097, 1001), both
// rules.
TEST_CASE("cuda: held dynamic rows whose weights cost blocks an SM, weights in shared memory" * needs_gpu()) {
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  for (const char* rule : {static_cast<const char*>("0"), static_cast<const char*>(nullptr)}) {
    ScopedEnv held_weights("KILN_TUNE_HELD_WEIGHTS", rule);
    const std::string rule_name = rule ? rule : "default";  // (a const char* would print as its address)
    CAPTURE(rule_name);
    auto grad = k::compile(k::grad(rms_norm_loss, k::wrt<0, 1>), dyn);
    for (std::int64_t cols : {3073, 3001, 2049, 4097, 1001}) {
      CAPTURE(cols);
      const int seed = 700 + static_cast<int>(cols % 1000);
      k::Tensor a = k::randn({1024, cols}, k::f32, k::cpu, seed) + 0.5f,
                w = k::randn({cols}, k::f32, k::cpu, seed + 1) + 1.0f,
                g = k::randn({1024, cols}, k::f32, k::cpu, seed + 2);
      check_rms_norm_grads(grad, a, w, g, 1e-3);
    }
    CHECK(grad.cache().compiles() == 1);
    k::report rep = k::explain(grad, k::randn({1024, 3073}, k::f32, k::cuda, 90), k::randn({3073}, k::f32, k::cuda, 91),
                               k::randn({1024, 3073}, k::f32, k::cuda, 92));
    REQUIRE_FALSE(rep.kernels.empty());
    const bool shared = rep.kernels[0].source.find("weights0_rows") != std::string::npos;
    const std::string weights = shared ? "shared memory" : "registers";  // (not a const char*: its address)
    MESSAGE("rms_norm backward over 3073 f32 columns, dynamic, " << rule_name << ": weights in " << weights);
    // ptxas's registers decide (NVRTC 13 on an H100: 156 alone, so the weights move); the rule
    // before never moves them.
    CHECK(shared == !rule);
  }
}

// A training loss whose vocabulary changes (its one-hot's indices and views are sized from the
// logits, not named: NOTES 124): one program serves every class count, rows of odd length and
// whole vectors, both dtypes.
TEST_CASE("cuda: a cross_entropy's gradient at changing class counts, one program" * needs_gpu()) {
  auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  for (k::dtype dt : {k::bf16, k::f32}) {
    CAPTURE(dt);
    const double tol = dt == k::bf16 ? 2e-2 : 1e-5;
    auto h = k::compile(k::value_and_grad(ce, k::wrt<0>), dyn);
    for (std::int64_t c : {197, 1001, 8, 64, 50257, 13, 4096, 3, 250, 2}) {
      const std::int64_t n = 3 + c % 29;
      CAPTURE(c);
      CAPTURE(n);
      k::Tensor logits = k::randn({n, c}, k::f32, k::cpu, 60 + static_cast<int>(c)).to(dt);
      k::Tensor t = k::cast(k::rand({n}, k::f32, k::cpu, 61 + static_cast<int>(c)) * static_cast<float>(c - 1), k::i64);
      auto [want_loss, want_dl] = cross_entropy_oracle(logits, t);
      auto [loss, dl] = h(logits.to(k::cuda), t.to(k::cuda));
      auto r = k::testing::allclose(loss, want_loss, tol, tol);
      CHECK_MESSAGE(bool(r), r);
      r = k::testing::allclose(dl, want_dl, tol, tol / static_cast<double>(n));
      CHECK_MESSAGE(bool(r), r);
    }
    CHECK(h.cache().compiles() == 1);
  }
}

// A cache that grows by k::cat along its sequence dim and attention's gradient over changing lengths:
// the cat's parts and the full sum's spread cotangent are views sized from shape_of nodes, so one
// dynamic program serves every length (each compiled again before). The gradient runs the fused
// kernels; its oracle is the derived gradient evaluated unfused in f64 from the same bf16 values.
TEST_CASE("cuda: a growing cache and attention's gradient at changing lengths, one program each" * needs_gpu()) {
  const k::options dyn{.shapes = k::shapes::dynamic, .on_limit = k::on_limit::raise};
  auto grow = k::compile([](auto cache, auto fresh) { return k::cat(2, cache, fresh); }, dyn);
  k::Tensor cache = k::randn({2, 3, 5, 64}, k::bf16, k::cpu, 90);
  for (int step = 0; step < 6; ++step) {
    CAPTURE(step);
    // (No size equal to another dim at the first call: duck sizing would share their symbol.)
    k::Tensor fresh = k::randn({2, 3, 4 + step, 64}, k::bf16, k::cpu, 91 + step);
    k::Tensor want = k::reference::eval(k::cat(2, k::cast(cache, k::f64), k::cast(fresh, k::f64)));
    k::Tensor got = grow(cache.to(k::cuda), fresh.to(k::cuda));
    auto r = k::testing::allclose(got, want, 0, 0);  // a copy: exact
    CHECK_MESSAGE(bool(r), r);
    cache = got.to(k::cpu);
  }
  CHECK(grow.cache().compiles() == 1);
  auto loss = [](auto q, auto kk, auto v) {
    auto o = k::cast(k::attention(q, kk, v, {.causal = true}), k::f32);
    return k::sum(o * o);
  };
  auto g = k::compile(k::grad(loss, k::wrt<0, 1, 2>), dyn);
  for (std::int64_t t : {100, 37, 256, 129}) {
    CAPTURE(t);
    auto q = k::randn({2, 4, t, 64}, k::bf16, k::cpu, 92 + static_cast<int>(t));
    auto kk = k::randn({2, 4, t, 64}, k::bf16, k::cpu, 93 + static_cast<int>(t));
    auto v = k::randn({2, 4, t, 64}, k::bf16, k::cpu, 94 + static_cast<int>(t));
    auto [dq, dk, dv] = g(q.to(k::cuda), kk.to(k::cuda), v.to(k::cuda));
    auto f64 = [](const k::Tensor& x) { return k::Tensor(k::cast(x, k::f64)); };
    const auto want = oracle_outputs(k::grad(loss, k::wrt<0, 1, 2>), f64(q), f64(kk), f64(v));  // unfused f64
    const k::Tensor wq = k::reference::to_tensor(want[0]), wk = k::reference::to_tensor(want[1]),
                    wv = k::reference::to_tensor(want[2]);
    for (auto [got, want] : {std::pair{dq, wq}, std::pair{dk, wk}, std::pair{dv, wv}}) {
      auto r = k::testing::allclose(got.to(k::f64), want, 5e-2, 5e-2);
      CHECK_MESSAGE(bool(r), r);
    }
  }
  CHECK(g.cache().compiles() == 1);
}

TEST_CASE("cuda: raw device buffers and a user stream" * needs_gpu()) {
  auto x = k::randn({1000}, k::f32, k::cuda, 12);
  CUstream s = nullptr;
  k::driver::check(k::driver::api().stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  k::Tensor out = k::Tensor::wrap(k::driver::allocate(4000, 0, s), {1000}, k::f32, k::cuda);
  k::eval(out, x * 3.0f, k::Stream(s));
  k::Stream(s).synchronize();
  auto got = k::to_vector<float>(out), xs = k::to_vector<float>(x);
  for (int i = 0; i < 1000; ++i) CHECK(got[i] == doctest::Approx(xs[i] * 3.0f));
  k::driver::deallocate(out.data_ptr(), 4000, 0, s);
}

TEST_CASE("cuda: mixing devices is a device_error naming both" * needs_gpu()) {
  auto a = k::randn({4}, k::f32, k::cuda, 1), b = k::randn({4}, k::f32, k::cpu, 2);
  CHECK_THROWS_AS(k::eval(a + b), k::device_error);
}
