// Fusion, seen through k::explain: how many kernels the fuser makes and of which kind for the
// patterns of issue 4 (pointwise chains, softmax, layer_norm, bias + gelu, a reduction with a
// pointwise epilogue, horizontal fusion of independent outputs), what their block programs look
// like, that each one also compiles for the GPU with NVRTC (no GPU needed), and that every one of
// them computes the values of the f64 oracle (k::reference::eval) in f32, f16 and bf16.
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "gradient_oracle.hpp"

namespace k = kiln;

namespace {

const k::dtype float_types[] = {k::f32, k::f16, k::bf16};

struct Tolerance {
  double rtol, atol;
};
// f16 and bf16 results are computed in f32 and rounded once on store: a few of their ulps.
Tolerance tolerance(k::dtype d) {
  switch (d) {
    case k::dtype::f64:
      return {1e-9, 1e-12};
    case k::dtype::f16:
      return {1e-2, 1e-2};
    case k::dtype::bf16:
      return {2e-2, 2e-2};
    default:
      return {1e-4, 1e-5};
  }
}

// The result of kiln against the oracle's f64 value of the same expression.
void check_values(const k::Tensor& got, const k::Tensor& want, k::dtype d) {
  Tolerance t = tolerance(d);
  auto r = k::testing::allclose(got, want, t.rtol, t.atol);
  INFO(r.str());
  CHECK(r);
}

bool is_elf(const std::vector<char>& b) {
  return b.size() > 4 && b[0] == '\x7f' && b[1] == 'E' && b[2] == 'L' && b[3] == 'F';
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

bool has_op(const k::kernel_info& ki, const std::string& op) {
  return std::find(ki.fused_ops.begin(), ki.fused_ops.end(), op) != ki.fused_ops.end();
}

// What every generated kernel must look like: its name says its kind, its block program uses the
// tile vocabulary of its kind, and its CUDA translation unit compiles with NVRTC to a CUBIN.
void check_kernel(const k::kernel_info& ki) {
  INFO("kernel " << ki.name << " [" << ki.kind << "]\n" << ki.source);
  CHECK(ki.name.rfind("kiln_" + ki.kind + "_fused_", 0) == 0);
  CHECK_FALSE(ki.fused_ops.empty());
  if (ki.kind == "poi") {
    CHECK(contains(ki.source, "xindex"));
    CHECK(contains(ki.source, "xmask"));
  } else {
    REQUIRE((ki.kind == "per" || ki.kind == "red" || ki.kind == "split"));
    CHECK(contains(ki.source, "rindex"));
    CHECK(contains(ki.source, "rmask"));
  }
  // NVRTC once per distinct source: the same kernel in two tests is one compile.
  static std::set<std::string> compiled;
  if (!compiled.insert(ki.source).second) return;
  std::vector<char> bin;
  try {
    bin = k::cubin(ki, "sm_90a");
  } catch (const k::error& e) {
    FAIL_CHECK("k::cubin(" << ki.name << ", sm_90a) threw: " << std::string(e.what()));
    return;
  }
  CHECK(is_elf(bin));
}

void check_kernels(const k::report& r) {
  INFO(r);
  for (const auto& ki : r.kernels) check_kernel(ki);
}

// Runs fn in a child process, so that a crash fails one check instead of ending the test binary.
// Returns "" when fn returned true, else what happened.
template <class F>
std::string in_child_process(F&& fn) {
  pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    // The default actions, not doctest's handlers (which would report a crashed test from here).
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, SIG_DFL);
    bool ok = false;
    try {
      ok = fn();
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) < 0) return "waitpid failed";
  if (WIFSIGNALED(status)) return "the child process was killed by signal " + std::to_string(WTERMSIG(status));
  if (!WIFEXITED(status)) return "the child process did not exit normally";
  switch (WEXITSTATUS(status)) {
    case 0:
      return "";
    case 1:
      return "wrong values";
    case 2:
      return "an exception";
    default:
      return "exit status " + std::to_string(WEXITSTATUS(status));
  }
}

// (x * 1, x * 2, ..., x * N): N independent same-shape outputs, each with its own scalar.
template <std::size_t... I>
auto scaled_copies(auto x, std::index_sequence<I...>) {
  return std::make_tuple((x * static_cast<float>(I + 1))...);
}

}  // namespace

TEST_CASE("fusion: an 8-op pointwise chain is one poi kernel") {
  // mul, add, tanh, sigmoid, sub, relu, mul, add: eight ops, two of them with C++ scalars.
  auto chain = [](auto x, auto y) { return k::relu(k::tanh(x * y + x) - k::sigmoid(y)) * 2.0f + 1.0f; };
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 11), y = k::randn({37, 129}, d, k::cpu, 12);
    auto f = k::compile(chain);
    k::report r = k::explain(f, x, y);
    INFO(r);
    CHECK(r.ops_captured == 8);
    CHECK(r.ops_decomposed == 8);  // nothing to decompose; scalars are never folded
    REQUIRE(r.kernels.size() == 1);
    CHECK(r.kernels[0].kind == "poi");
    CHECK(r.kernels[0].name.rfind("kiln_poi_fused_", 0) == 0);
    for (const char* op : {"mul", "add", "tanh", "sigmoid", "sub", "relu"}) {
      INFO("op " << std::string(op));
      CHECK(has_op(r.kernels[0], op));
    }
    CHECK(r.recompiles == 0);
    check_kernels(r);
    k::Tensor out = f(x, y);
    CHECK(out.dtype() == d);
    CHECK(out.shape() == std::vector<std::int64_t>{37, 129});
    check_values(out, k::reference::eval(chain(x, y)), d);
  }
}

TEST_CASE("fusion: softmax is one persistent-reduction kernel, over the last dim and over dim 0") {
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 21) * 3;
    for (int dim : {1, 0, -1}) {
      CAPTURE(dim);
      auto f = k::compile([dim](auto a) { return k::softmax(a, dim); });
      k::report r = k::explain(f, x);
      INFO(r);
      CHECK(r.ops_captured == 1);
      if (d == k::f32)
        CHECK(r.ops_decomposed == 5);  // amax, sub, exp, sum, div
      else
        CHECK(r.ops_decomposed == 7);  // the same between a cast to f32 and one back
      REQUIRE(r.kernels.size() == 1);
      // A row of 129 in the last dim is one persistent program per row; over dim 0 the fuser may
      // choose a looped reduction as well.
      if (dim == 0)
        CHECK((r.kernels[0].kind == "per" || r.kernels[0].kind == "red"));
      else
        CHECK(r.kernels[0].kind == "per");
      for (const char* op : {"amax", "sub", "exp", "sum", "div"}) {
        INFO("op " << std::string(op));
        CHECK(has_op(r.kernels[0], op));
      }
      check_kernels(r);
      k::Tensor out = f(x);
      CHECK(out.dtype() == d);
      check_values(out, k::reference::eval(k::softmax(x, dim)), d);
    }
  }
}

TEST_CASE("fusion: log_softmax is one kernel") {
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 22);
    auto f = k::compile([](auto a) { return k::log_softmax(a, -1); });
    k::report r = k::explain(f, x);
    INFO(r);
    REQUIRE(r.kernels.size() == 1);
    CHECK(r.kernels[0].kind == "per");
    check_kernels(r);
    check_values(f(x), k::reference::eval(k::log_softmax(x, -1)), d);
  }
}

TEST_CASE("fusion: layer_norm forward is one kernel") {
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 31) * 2 + 1;
    k::Tensor w = k::randn({129}, d, k::cpu, 32), b = k::randn({129}, d, k::cpu, 33);
    auto f = k::compile([](auto a, auto wt, auto bs) { return k::layer_norm(a, wt, bs); });
    k::report r = k::explain(f, x, w, b);
    INFO(r);
    CHECK(r.ops_captured == 1);
    CHECK(r.ops_decomposed > 5);
    REQUIRE(r.kernels.size() == 1);
    CHECK(r.kernels[0].kind == "per");
    CHECK(has_op(r.kernels[0], "rsqrt"));
    CHECK(has_op(r.kernels[0], "sum"));
    check_kernels(r);
    k::Tensor out = f(x, w, b);
    CHECK(out.dtype() == d);
    check_values(out, k::reference::eval(k::layer_norm(x, w, b)), d);
  }
}

TEST_CASE("fusion: a 3-D layer_norm and rms_norm are one kernel each") {
  k::Tensor x = k::randn({5, 7, 33}, k::f32, k::cpu, 34), w = k::randn({33}, k::f32, k::cpu, 35),
            b = k::randn({33}, k::f32, k::cpu, 36);
  auto ln = k::compile([](auto a, auto wt, auto bs) { return k::layer_norm(a, wt, bs, 1e-3); });
  k::report r = k::explain(ln, x, w, b);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  check_values(ln(x, w, b), k::reference::eval(k::layer_norm(x, w, b, 1e-3)), k::f32);
  auto rms = k::compile([](auto a, auto wt) { return k::rms_norm(a, wt); });
  r = k::explain(rms, x, w);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  check_values(rms(x, w), k::reference::eval(k::rms_norm(x, w)), k::f32);
}

TEST_CASE("fusion: a broadcast bias and gelu are one poi kernel") {
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    SUBCASE("[37, 129] + [129]") {
      k::Tensor x = k::randn({37, 129}, d, k::cpu, 41), b = k::randn({129}, d, k::cpu, 42);
      for (auto mode : {k::approximate::none, k::approximate::tanh}) {
        auto f = k::compile([mode](auto a, auto bias) { return k::gelu(a + bias, mode); });
        k::report r = k::explain(f, x, b);
        INFO(r);
        REQUIRE(r.kernels.size() == 1);
        CHECK(r.kernels[0].kind == "poi");
        CHECK(has_op(r.kernels[0], mode == k::approximate::none ? "erf" : "tanh"));
        check_kernels(r);
        k::Tensor out = f(x, b);
        CHECK(out.shape() == std::vector<std::int64_t>{37, 129});
        check_values(out, k::reference::eval(k::gelu(x + b, mode)), d);
      }
    }
    SUBCASE("[5, 1, 3] + [7, 1] broadcast to [5, 7, 3]") {
      k::Tensor x = k::randn({5, 1, 3}, d, k::cpu, 43), b = k::randn({7, 1}, d, k::cpu, 44);
      auto f = k::compile([](auto a, auto bias) { return k::gelu(a + bias); });
      k::report r = k::explain(f, x, b);
      INFO(r);
      REQUIRE(r.kernels.size() == 1);
      CHECK(r.kernels[0].kind == "poi");
      check_kernels(r);
      k::Tensor out = f(x, b);
      CHECK(out.shape() == std::vector<std::int64_t>{5, 7, 3});
      check_values(out, k::reference::eval(k::gelu(x + b)), d);
    }
  }
}

TEST_CASE("fusion: a reduction then pointwise ops on the reduced shape are one row kernel") {
  // The epilogue (* 2 + 1, on the reduced shape [37]) runs in the kernel that reduces: no buffer
  // for the sum, one kernel of kind per.
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 51);
    auto f = k::compile([](auto a) { return k::sum(a, 1) * 2 + 1; });
    k::report r = k::explain(f, x);
    INFO(r);
    CHECK(r.ops_captured == 3);
    REQUIRE(r.kernels.size() == 1);
    CHECK(r.kernels[0].kind == "per");
    CHECK(has_op(r.kernels[0], "sum"));
    CHECK(has_op(r.kernels[0], "mul"));
    CHECK(has_op(r.kernels[0], "add"));
    check_kernels(r);
    k::Tensor out = f(x);
    CHECK(out.shape() == std::vector<std::int64_t>{37});
    // A sum of 129 values: its error scales with the sum of their magnitudes.
    Tolerance t = tolerance(d);
    auto res = k::testing::allclose(out, k::reference::eval(k::sum(x, 1) * 2 + 1), t.rtol, t.atol * 20);
    INFO(res.str());
    CHECK(res);
  }
}

TEST_CASE("fusion: a pointwise prologue, a keepdim reduction and a broadcast epilogue are one kernel") {
  // x - amax(exp(x) * y, 1, keepdim) uses the row result on the full row: one per kernel.
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 52), y = k::randn({37, 129}, k::f32, k::cpu, 53);
  auto fn = [](auto a, auto b) { return a - k::amax(k::exp(a) * b, 1, true); };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x, y);
  INFO(r);
  REQUIRE(r.kernels.size() == 1);
  CHECK(r.kernels[0].kind == "per");
  check_kernels(r);
  check_values(f(x, y), k::reference::eval(fn(x, y)), k::f32);
}

TEST_CASE("fusion: mean and var over the last dim are one kernel each") {
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 54);
  auto m = k::compile([](auto a) { return k::mean(a, -1); });
  k::report r = k::explain(m, x);
  INFO(r);
  CHECK(r.ops_captured == 1);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  check_values(m(x), k::reference::eval(k::mean(x, -1)), k::f32);
  auto v = k::compile([](auto a) { return k::var(a, 1); });
  r = k::explain(v, x);
  INFO(r);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  check_values(v(x), k::reference::eval(k::var(x, 1)), k::f32);
}

TEST_CASE("fusion: long rows and long full reductions") {
  // Rows longer than any tile: softmax stays one kernel (a looped or persistent row kernel).
  k::Tensor x = k::randn({3, 20011}, k::f32, k::cpu, 55);
  auto sm = k::compile([](auto a) { return k::softmax(a, 1); });
  k::report r = k::explain(sm, x);
  INFO(r);
  REQUIRE(r.kernels.size() == 1);
  CHECK((r.kernels[0].kind == "per" || r.kernels[0].kind == "red"));
  check_kernels(r);
  auto res = k::testing::allclose(sm(x), k::reference::eval(k::softmax(x, 1)), 1e-4, 1e-8);
  INFO(res.str());
  CHECK(res);

  // A full reduction of 10^6 elements and a pointwise use of it. 1000003 is prime: split.hpp sums
  // 8192 chunks of 122 (a middle step folds them by 16) and the 579 elements left over apart, so at
  // most first stage, middle step, second stage, remainder and the pointwise kernel.
  k::Tensor big = k::randn({1000003}, k::f32, k::cpu, 56);
  auto total = k::compile([](auto a) { return k::amax(a, 0) - k::mean(a); });
  r = k::explain(total, big);
  INFO(r);
  CHECK(r.kernels.size() <= 5);
  check_kernels(r);
  res = k::testing::allclose(total(big), k::reference::eval(k::amax(big, 0) - k::mean(big)), 1e-5, 1e-5);
  INFO(res.str());
  CHECK(res);
}

TEST_CASE("fusion: host rows of odd length take their whole vectors unmasked, then the end") {
  // A masked host access is a branch a lane (3-5x on rows of 1000 against 1008: NOTES 102); such rows
  // are written as their whole vectors and the vector holding their end. Held and looped rows,
  // rows shorter than a vector, a gradient (column partials), a bias (column tiles), both modes.
  for (std::int64_t cols : {7, 1000, 5003, 40009}) {
    CAPTURE(cols);
    k::Tensor x = k::randn({37, cols}, k::f32, k::cpu, 81), w = k::randn({cols}, k::f32, k::cpu, 82);
    auto ln = [](auto a, auto ww) { return k::layer_norm(a, ww, ww); };
    auto sm = [](auto a) { return k::softmax(a * 3.0f, 1); };
    auto bias = [](auto a, auto ww) { return k::gelu(a * 2.0f + ww); };
    for (k::shapes mode : {k::shapes::static_, k::shapes::dynamic}) {
      CAPTURE(static_cast<int>(mode));
      auto f = k::compile(ln, {.shapes = mode});
      if (cols > 16) {
        std::string src = k::explain(f, x, w).kernels.at(0).source;
        CHECK((contains(src, "KILN_R_LOOP_FULL") || contains(src, "KILN_R_TILES_FULL")));
      }
      check_values(f(x, w), k::reference::eval(ln(x, w)), k::f32);
      check_values(k::compile(sm, {.shapes = mode})(x), k::reference::eval(sm(x)), k::f32);
      auto fb = k::compile(bias, {.shapes = mode});
      if (cols >= 1000 && mode == k::shapes::static_) {
        k::report r = k::explain(fb, x, w);
        CHECK(contains(r.kernels.at(0).source, "KILN_COLUMNS_FULL"));
        CHECK(is_elf(k::cubin(r.kernels.at(0), "sm_90a")));  // (host sources compile for the GPU too)
        check_kernels(k::explain(f, x, w));
      }
      check_values(fb(x, w), k::reference::eval(bias(x, w)), k::f32);
      auto g = k::compile(k::value_and_grad([](auto a, auto ww) { return k::sum(k::layer_norm(a, ww, ww) * a); },
                                            k::wrt<0, 1>), {.shapes = mode});
      auto [v, dx, dw] = g(x, w);
      auto want = k::reference::eval(k::layer_norm(x, w, w) * x);
      auto close = k::testing::allclose(v, k::reference::eval(k::sum(want)), 1e-4, 1e-3);
      CHECK_MESSAGE(bool(close), close);
      // d/dw of sum((xhat w + w) x) = the column sums of xhat x + x (column partials)
      k::Tensor ones = k::full({cols}, 1.0, k::f32, k::cpu), zeros = k::full({cols}, 0.0, k::f32, k::cpu);
      auto want_dw = k::reference::eval(k::sum(k::layer_norm(x, ones, zeros) * x + x, 0));
      close = k::testing::allclose(dw, want_dw, 1e-4, 1e-3);
      CHECK_MESSAGE(bool(close), close);
      CHECK(dx.shape() == x.shape());
    }
  }
}

TEST_CASE("fusion: looped rows carry a dependent sum in one pass (Welford's variance, online softmax)") {
  // The GPU's rule (codegen's one_pass_form), written on the host too by KILN_TUNE_ONE_PASS=1: rows
  // far from zero (Welford's lanes against cancellation), -inf scores that empty whole lanes, scores
  // spread over hundreds (the running max moves), bf16 rows, and both shape modes.
  struct OnePass {
    OnePass() { ::setenv("KILN_TUNE_ONE_PASS", "1", 1); }
    ~OnePass() { ::unsetenv("KILN_TUNE_ONE_PASS"); }
  } on;
  const std::int64_t n = 40009;  // longer than a held host row: looped
  // var over rows 1e5 of their spread from zero (a two-pass f32 mean of them is itself off by
  // about 1% of the spread, so layer_norm's output could not be checked there: it gets rows 30 off)
  k::Tensor far = k::randn({3, n}, k::f32, k::cpu, 71) * 0.01f + 1000.0f;
  k::Tensor off = k::randn({3, n}, k::f32, k::cpu, 76) + 30.0f;
  k::Tensor w = k::randn({n}, k::f32, k::cpu, 72), b = k::randn({n}, k::f32, k::cpu, 73);
  k::Tensor spread = k::randn({4, n}, k::f32, k::cpu, 74) * 60.0f;
  // every 7th score -inf, and the whole last row but one value
  k::Tensor cut = k::randn({4, n}, k::f32, k::cpu, 75);
  {
    auto v = k::to_vector<float>(cut);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (i % 7 == 3 || (i >= 3 * static_cast<std::size_t>(n) && i != 3 * static_cast<std::size_t>(n) + 11))
        v[i] = -INFINITY;
    cut = k::from_vector(v, {4, n}, k::cpu);
  }
  auto ln = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b, 1e-5); };
  auto var = [](auto x) { return k::var(x, 1); };
  auto sm = [](auto x) { return k::softmax(x, 1); };
  auto lsm = [](auto x) { return k::log_softmax(x, 1); };
  auto lse = [](auto x) { return k::logsumexp(x, 1); };
  for (k::shapes mode : {k::shapes::static_, k::shapes::dynamic}) {
    CAPTURE(static_cast<int>(mode));
    auto f = k::compile(ln, {.shapes = mode});
    k::report r = k::explain(f, off, w, b);
    INFO(r);
    REQUIRE(r.kernels.size() == 1);
    CHECK(contains(r.kernels[0].source, "welford_step"));
    // (an f32 mean over 40009 values of 30 is off by ~4e-5 in either pass count: absolute error)
    auto near = k::testing::allclose(f(off, w, b), k::reference::eval(ln(off, w, b)), 1e-4, 2e-4);
    INFO(near.str());
    CHECK(near);
    auto fv = k::compile(var, {.shapes = mode});
    auto got = fv(far), want = k::reference::eval(var(far));
    auto res = k::testing::allclose(got, want, 1e-3, 1e-7);  // a variance of 1e-4 about 1000
    INFO(res.str());
    CHECK(res);
    auto fs = k::compile(sm, {.shapes = mode});
    r = k::explain(fs, spread);
    CHECK(contains(r.kernels[0].source, "online_exp_step"));
    check_values(fs(spread), k::reference::eval(sm(spread)), k::f32);
    check_values(fs(cut), k::reference::eval(sm(cut)), k::f32);
    auto fl = k::compile(lsm, {.shapes = mode});
    check_values(fl(spread), k::reference::eval(lsm(spread)), k::f32);
    auto fe = k::compile(lse, {.shapes = mode});
    check_values(fe(cut), k::reference::eval(lse(cut)), k::f32);
    k::Tensor h = k::cast(spread, k::bf16);
    check_values(fs(h), k::reference::eval(sm(h)), k::bf16);
    // Squares about a row value that is not the mean stay two passes (an infinity would come out
    // NaN through Welford's lanes, +inf through two passes).
    auto about_max = [](auto x) { return k::sum(k::square(x - k::amax(x, 1, true)), 1); };
    auto fm = k::compile(about_max, {.shapes = mode});
    CHECK_FALSE(contains(k::explain(fm, spread).kernels.at(0).source, "welford_step"));
    check_values(fm(spread), k::reference::eval(about_max(spread)), k::f32);
    check_values(f(k::cast(off, k::bf16), w, b), k::reference::eval(ln(k::cast(off, k::bf16), w, b)), k::bf16);
  }
}

TEST_CASE("fusion: a select on a broadcast comparison in a held host row (GCC's loop if-conversion)") {
  // g++ 12.2 at -O3 -march=native (AVX2) wrote zeros in 15 of every 16 lanes of this kernel's output
  // until host row kernels were compiled without GCC's loop if-conversion (NOTES items 102 and 135:
  // runtime/compile/kernel_units.hpp's host_row_options; removing it fails this case). Found by
  // test_differential (seed 1, program 13) on branch cpu-pending/odd-rows, which vectorises more loops.
  k::Tensor a = k::cast(k::randn({6, 4, 128}, k::f32, k::cpu, 62) * 100.0f, k::i64);
  k::Tensor b = k::randn({1}, k::f32, k::cpu, 63), c = k::randn({1}, k::f32, k::cpu, 64);
  k::Tensor h = k::full({1}, 0.5, k::bf16, k::cpu);
  auto fn = [](auto x, auto y, auto z, auto w) {
    auto t = (k::reshape(x, {-1}) - y) * 0.000322997;
    return k::where(w <= -0.875, z, t - k::sum(t, 0, true)) * 1.375;
  };
  auto f = k::compile(fn);
  check_values(f(a, b, c, h), k::reference::eval(fn(a, b, c, h)), k::f32);
}

TEST_CASE("fusion: independent same-shape outputs returned as a tuple share one kernel") {
  for (k::dtype d : float_types) {
    INFO("dtype " << k::name(d));
    k::Tensor x = k::randn({37, 129}, d, k::cpu, 61), y = k::randn({37, 129}, d, k::cpu, 62);
    auto fn = [](auto a, auto b) { return std::make_tuple(k::exp(a) + 1, a * b, k::relu(b) - a); };
    auto f = k::compile(fn);
    k::report r = k::explain(f, x, y);
    INFO(r);
    CHECK(r.ops_captured == 5);
    REQUIRE(r.kernels.size() == 1);
    CHECK(r.kernels[0].kind == "poi");
    for (const char* op : {"exp", "add", "mul", "relu", "sub"}) {
      INFO("op " << std::string(op));
      CHECK(has_op(r.kernels[0], op));
    }
    check_kernels(r);
    auto [o0, o1, o2] = f(x, y);
    auto [r0, r1, r2] = k::reference::eval(fn(x, y));
    check_values(o0, r0, d);
    check_values(o1, r1, d);
    check_values(o2, r2, d);
  }
}

TEST_CASE("fusion: a reduction and an elementwise output of its input share one row kernel") {
  // Multi-output: the normalised rows and their sums come from one kernel.
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 63);
  auto fn = [](auto a) { return std::make_tuple(k::sum(a, 1), k::softmax(a, 1)); };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x);
  INFO(r);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  auto [s, p] = f(x);
  auto [rs, rp] = k::reference::eval(fn(x));
  auto res = k::testing::allclose(s, rs, 1e-4, 1e-4);
  INFO(res.str());
  CHECK(res);
  check_values(p, rp, k::f32);
}

// A pre-norm transformer's residual stream: x1 = x + y is returned (the next layer reads it),
// layer_norm(x1) is viewed as [B * T, d] for a matmul. The add opens a pointwise kernel that the
// norm's reduction turns into its row kernel, and the matmul reads the normalised rows' buffer
// through the view: one row kernel and the matmul (the add, the statistics and the normalised
// rows were three kernels). Its gradient too: the norm's dx row kernel casts the gradient a
// 16-bit matmul reads, viewed as [B * T, d], where it was a pointwise kernel of its own.
TEST_CASE("fusion: a residual add, the layer_norm after it and the rows a matmul reads through a view are one kernel") {
  const std::int64_t B = 3, T = 5, d = 16;
  k::Tensor x = k::randn({B, T, d}, k::f32, k::cpu, 71), y = k::randn({B, T, d}, k::f32, k::cpu, 72);
  k::Tensor w = k::randn({d}, k::f32, k::cpu, 73), b = k::randn({d}, k::f32, k::cpu, 74);
  k::Tensor W = k::randn({d, 7}, k::f32, k::cpu, 75);
  auto fn = [=](auto x, auto y, auto w, auto b, auto W) {
    auto x1 = x + y;
    return std::make_tuple(x1, k::matmul(k::reshape(k::layer_norm(x1, w, b), {B * T, d}), W));
  };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x, y, w, b, W);
  INFO(r);
  REQUIRE(r.kernels.size() == 2);
  CHECK(r.kernels[0].kind == "per");
  CHECK(has_op(r.kernels[0], "add"));
  CHECK(has_op(r.kernels[0], "rsqrt"));
  CHECK(r.kernels[1].kind == "extern");
  check_kernel(r.kernels[0]);
  auto [x1, out] = f(x, y, w, b, W);
  auto [rx1, rout] = k::reference::eval(fn(x, y, w, b, W));
  check_values(x1, rx1, k::f32);
  check_values(out, rout, k::f32);
  // The gradient: the cotangent reaches the norm through the matmul and the view; dx, the cast
  // and the residual's own gradient are the norm's row kernel, not pointwise kernels after it.
  auto loss = [=](auto x, auto y, auto w, auto b, auto W) {
    auto h = k::cast(k::reshape(k::layer_norm(x + y, w, b), {B * T, d}), k::bf16);
    auto o = k::cast(k::matmul(h, k::cast(W, k::bf16)), k::f32);
    return k::sum(o * o);
  };
  auto vg = k::value_and_grad(loss, k::wrt<0, 2, 4>);
  k::report rg = k::explain(vg, x, y, w, b, W);
  INFO(rg);
  int poi = 0;
  for (const auto& ki : rg.kernels)
    poi += ki.kind == "poi" && ki.source.find(std::to_string(B * T * d)) != std::string::npos;
  CHECK(poi == 0);  // (none for the norm's gradient: its row kernel writes it)
  auto got = vg(x, y, w, b, W);
  const auto want = oracle_outputs(vg, x, y, w, b, W);  // the unfused f64 oracle, bf16 casts rounded as kiln's
  const k::Tensor values[4] = {std::get<0>(got), std::get<1>(got), std::get<2>(got), std::get<3>(got)};
  for (int i = 0; i < 4; ++i) {  // (dx divides bf16 roundings by each row's deviation: 5e-2)
    auto res = k::testing::allclose(values[i], k::reference::to_tensor(want[static_cast<std::size_t>(i)]), 5e-2, 5e-2);
    CHECK_MESSAGE(bool(res), "output " << i << ": " << res);
  }
}

// cross_entropy over `cast(reshape(logits, {B * T, V}), f32)` of bf16 logits: the cast sinks below
// the view (rewrite::sink_reshape) and the target's gather still picks from the bf16 logits
// (gather_before_pointwise through the reshape), so no kernel writes an f32 copy of them: the row
// kernels widen bf16 values as they load them (the gather's source is a bf16 copy of the view).
TEST_CASE("fusion: cross_entropy over a reshaped f32 cast of bf16 logits reads the bf16 logits") {
  const std::int64_t B = 3, T = 7, V = 301;
  k::Tensor x = k::randn({B, T, V}, k::bf16, k::cpu, 81);
  k::Tensor t = k::cast(k::rand({B * T}, k::f32, k::cpu, 82) * static_cast<float>(V - 1), k::i64);
  auto fn = [=](auto x, auto t) { return k::cross_entropy(k::cast(k::reshape(x, {B * T, V}), k::f32), t); };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x, t);
  INFO(r);
  int widening = 0;
  for (const auto& ki : r.kernels) {
    CHECK_MESSAGE(!(ki.kind == "poi" && has_op(ki, "cast")), ki.name);  // (an f32 copy of the logits)
    widening += ki.kind == "per" && has_op(ki, "cast");
  }
  CHECK(widening == 2);
  check_values(f(x, t), k::reference::eval(fn(x, t)), k::f32);
}

TEST_CASE("fusion: eager expressions report through k::explain(expr)") {
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 71), b = k::randn({129}, k::f32, k::cpu, 72);
  auto e = k::relu(x * 0.5f + b);
  k::report r = k::explain(e);
  INFO(r);
  CHECK(r.ops_captured == 3);
  REQUIRE(r.kernels.size() == 1);
  CHECK(r.kernels[0].kind == "poi");
  check_kernels(r);
  k::Tensor out = e;
  check_values(out, k::reference::eval(e), k::f32);
}

TEST_CASE("fusion: views and casts inline into the consumer's kernel") {
  // permute, slice with a step, reshape and a cast feed a pointwise op: still one kernel.
  k::Tensor x = k::randn({5, 7, 13}, k::f32, k::cpu, 81), y = k::randn({13, 7}, k::f16, k::cpu, 82);
  auto fn = [](auto a, auto b) {
    auto at = k::permute(k::slice(a, 0, 1, 5, 2), {0, 2, 1});  // [2, 13, 7]
    return k::cast(k::tanh(at * k::cast(b, k::f32)), k::bf16);
  };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x, y);
  INFO(r);
  REQUIRE(r.kernels.size() == 1);
  CHECK(r.kernels[0].kind == "poi");
  check_kernels(r);
  k::Tensor out = f(x, y);
  CHECK(out.dtype() == k::bf16);
  CHECK(out.shape() == std::vector<std::int64_t>{2, 13, 7});
  check_values(out, k::reference::eval(fn(x, y)), k::bf16);
}

TEST_CASE("fusion: f64 stays f64 through a fused softmax and a chain") {
  k::Tensor x = k::randn({37, 129}, k::f64, k::cpu, 91);
  auto fn = [](auto a) { return k::softmax(a, 1) * k::sigmoid(a) + k::exp(-k::abs(a)); };
  auto f = k::compile(fn);
  k::report r = k::explain(f, x);
  INFO(r);
  CHECK(r.kernels.size() == 1);
  check_kernels(r);
  k::Tensor out = f(x);
  CHECK(out.dtype() == k::f64);
  check_values(out, k::reference::eval(fn(x)), k::f64);
}

TEST_CASE("fusion: horizontal fusion of many outputs (more kernel parameters than 64)") {
  // 40 outputs x * 1 ... x * 40 fuse into one poi kernel with 1 input, 40 outputs and 40 scalars:
  // 81 parameters. Run in a child process, so that a regression (this once overflowed a fixed
  // array of 64 parameter slots in runtime::Program::run) fails a check instead of crashing.
  k::Tensor x = k::randn({5, 7}, k::f32, k::cpu, 99);
  std::string what = in_child_process([&] {
    auto f = k::compile([](auto a) { return scaled_copies(a, std::make_index_sequence<40>{}); });
    auto outs = f(x);
    bool ok = true;
    std::apply(
        [&](const auto&... t) {
          int i = 0;
          ((ok = ok && k::testing::allclose(t, k::reference::eval(x * static_cast<float>(++i)), 1e-6, 1e-6)), ...);
        },
        outs);
    return ok;
  });
  CHECK_MESSAGE(what.empty(), "40 horizontally fused outputs: " << what);
  // One kernel for all of them (explain runs the function too, so it is in a child as well).
  std::string kernels = in_child_process([&] {
    auto f = k::compile([](auto a) { return scaled_copies(a, std::make_index_sequence<40>{}); });
    k::report r = k::explain(f, x);
    return r.kernels.size() == 1 && r.kernels[0].kind == "poi";
  });
  CHECK_MESSAGE(kernels.empty(), "40 outputs as one poi kernel: " << kernels);
}

TEST_CASE("fusion: a row kernel hands its reduction only to readers indexing it along the rows") {
  // A row kernel computes a reduction once a row and gives that value to its readers in the kernel.
  // amax(x, 1) of x [3, 3, 129] is [3, 129]; x - it broadcasts it along dims 1 and 2 of x, not
  // along the rows (dims 0 and 2): that reader needs the reduction's buffer. Square sizes make the
  // wrong pairing shape-correct, so only the values tell.
  k::Tensor x3 = k::randn({3, 3, 129}, k::f32, k::cpu, 61), x2 = k::randn({33, 33}, k::f32, k::cpu, 62);
  auto across3 = [](auto a) { return a - k::amax(a, 1); };                 // [3,129] on dims 1, 2
  auto across2 = [](auto a) { return a * k::sum(a, 1); };                  // row sums on the columns
  auto rows3 = [](auto a) { return a - k::unsqueeze(k::amax(a, 1), 1); };  // along the rows
  auto rows2 = [](auto a) { return a * k::sum(a, 0); };                    // column sums on the columns
  auto nested = [](auto a) { return k::sum(a * k::sum(a, 1), 1); };        // a second reduction reads it
  auto value = [&](auto fn, const k::Tensor& x) {
    auto f = k::compile(fn);
    k::report r = k::explain(f, x);
    INFO(r);
    check_kernels(r);
    Tolerance t = tolerance(k::f32);
    auto res = k::testing::allclose(f(x), k::reference::eval(fn(x)), t.rtol, t.atol * 40);
    INFO(res.str());
    CHECK(res);
    return r.kernels.size();
  };
  CHECK(value(across3, x3) == 2);
  CHECK(value(across2, x2) == 2);
  CHECK(value(nested, x2) == 2);
  CHECK(value(rows3, x3) == 1);  // still one kernel where the index agrees
  CHECK(value(rows2, x2) == 1);
}

// A load the same for every lane of a row's tile (cross_entropy's target class in its gradient, a
// per-row scale) is one scalar under the row's mask with KILN_TUNE_ROW_SCALARS=1 (off by default),
// also where a special function of it is kept across the row's loops (the host's kept values take
// it broadcast; the differential test's random graphs found that case). Rows of 1000 (a split row)
// and 1024, the knob 1 and 0.
TEST_CASE("fusion: row-uniform loads are one scalar a row") {
  k::Tensor x = k::randn({37, 1000}, k::f32, k::cpu, 61), s = k::rand({37, 1}, k::f32, k::cpu, 62) + 0.5f;
  auto y = k::randn({29, 1024}, k::f32, k::cpu, 63);
  k::Tensor t = k::cast(k::rand({37}, k::f32, k::cpu, 64) * 999.0f, k::i64);
  auto ce_grad = k::value_and_grad([](auto l, auto tt) { return k::cross_entropy(l, tt); }, k::wrt<0>);
  auto scaled = [](auto a, auto r) { return k::softmax(a * r, -1) + k::exp(r); };
  for (const char* knob : {"1", "0"}) {
    CAPTURE(knob);
    ::setenv("KILN_TUNE_ROW_SCALARS", knob, 1);
    auto f = k::compile(ce_grad);
    auto [loss, dx] = f(x, t);
    check_values(dx, k::reference::eval((k::softmax(x, -1) - k::cast(k::unsqueeze(t, 1) == k::arange(1000), k::f32)) /
                                        37.0f),
                 k::f32);
    check_values(loss, k::reference::eval(k::cross_entropy(x, t)), k::f32);
    const std::string src = k::explain(f, x, t).kernels.at(0).source;
    CHECK(contains(src, ", xindex, xmask)") == (std::string(knob) == "1"));
    auto g = k::compile(scaled);
    check_values(g(x, s), k::reference::eval(scaled(x, s)), k::f32);
    k::Tensor sy = k::rand({29, 1}, k::f32, k::cpu, 65) + 0.5f;
    check_values(g(y, sy), k::reference::eval(scaled(y, sy)), k::f32);
  }
  ::unsetenv("KILN_TUNE_ROW_SCALARS");
}

// The rule by which a compiled held-row GPU kernel is written again looped (runtime/refit_held_rows.hpp's
// loop_spilled_rows): its stack frame against the two passes over its held tiles that holding
// saves, with a floor for ptxas's own small arrays. The numbers are ptxas's for the kernels of
// benchmarks/NOTES.md item 78 (RITERS 13: 1,008 bytes for cross_entropy, 224 for softmax).
TEST_CASE("launch rules: a held row whose function spills more than holding saves is looped") {
  namespace cg = k::codegen;
  CHECK(cg::held_row_saves(13) == 416);
  CHECK(cg::held_row_spills(1008, 13, 512));  // cross_entropy over 50257 bf16 columns
  CHECK(!cg::held_row_spills(224, 13, 512));  // softmax at the same shape
  CHECK(!cg::held_row_spills(40, 1, 256));    // sin's argument reduction in a short f64 row
  CHECK(!cg::held_row_spills(256, 1, 256));   // the floor itself
  CHECK(cg::held_row_spills(304, 13, 512, 1));   // a spilling row that leaves one block an SM
  CHECK(!cg::held_row_spills(304, 13, 512, 2));  // ... that leaves two
  CHECK(!cg::held_row_spills(224, 13, 512, 1));  // under the floor: ptxas's own small arrays
  CHECK(!cg::held_row_spills(256, 13, 512, 1));  // at the floor, one block an SM: held (NOTES 174)
  CHECK(cg::held_row_spills(256, 13, 512, 1, 64));   // under a lower floor (KILN_TUNE_SPILL_FLOOR)
  CHECK(!cg::held_row_spills(256, 13, 512, 2, 64));  // two blocks an SM, under what the row saves
  CHECK(cg::held_row_spills(257, 1, 256));
  CHECK(!cg::held_row_spills(0, 13, 512));      // nothing spilled
  CHECK(!cg::held_row_spills(100000, 0, 512));  // a looped row has nothing to give up
  // 1024 threads a row over 50257 f32 columns (NOTES item 106): softmax's 376 bytes a thread are
  // under what holding saves, but 385 KB a block leave the L1; layer_norm's 88 stay.
  CHECK(cg::held_row_spills(376, 13, 1024));
  CHECK(!cg::held_row_spills(88, 13, 1024));  // (under the floor)
  CHECK(!cg::held_row_spills(300, 13, 512));  // 150 KB a block: in the L1
  CHECK(cg::held_row_spills(300, 13, 1024));  // 300 KB: past it
}

// With KILN_TUNE_WIDE_ROWS=1, static rows too long for 512 threads to hold are held by 1024 when
// their tiles fit 56 of 64 registers a thread (codegen's wide_rows), never under the knobs that set
// a row's threads or tiles.
TEST_CASE("launch rules: long static rows held by 1024 threads") {
  namespace cg = k::codegen;
  cg::RowCaches one;  // one streamed array (softmax's x)
  CHECK(!cg::wide_rows(1335, 50257, 4, one, {}, true).has_value());  // off by default
  k::Tuning on;
  on.wide_rows = 1;
  auto w = cg::wide_rows(1335, 50257, 4, one, on, true);
  REQUIRE(w.has_value());
  CHECK(w->row_threads == 1024);
  CHECK(w->threads == 1024);
  CHECK(w->riters == 13);
  CHECK(!cg::wide_rows(1335, 262144, 4, one, on, false).has_value());  // 64 tiles a thread: looped
  k::Tuning knob = on;
  knob.row_threads = 512;
  CHECK(!cg::wide_rows(1335, 50257, 4, one, knob, true).has_value());
  knob = on;
  knob.row_iters = 0;  // loop_spilled_rows' looped form
  CHECK(!cg::wide_rows(1335, 50257, 4, one, knob, true).has_value());
}
