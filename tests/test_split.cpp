// Two-stage reductions (schedule/split.hpp) over reduced lengths that no power of two divides: the
// chunks cover the first S * floor(R / S) positions and the rest is reduced apart, so an odd row
// count still gets a split (an unsplit column sum of 87381 rows ran 100x slower on an H200). Values
// against the f64 oracle on the CPU and the GPU; explain shows the split happened.
#include <doctest/doctest.h>
#include <algorithm>
#include <cstdlib>

#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"
#include "scoped_env.hpp"

namespace k = kiln;

namespace {

// Whether the program reduces in two stages: a split kernel, or (column sums on the CPU,
// schedule/partials.hpp) a row kernel writing one partial sum a group of rows.
bool two_stage(const k::report& e) {
  for (const auto& ki : e.kernels)
    if (ki.kind == "split" || ki.source.find("KILN_ROW_GROUP") != std::string::npos) return true;
  return false;
}

// split: whether the program must have a two-stage reduction.
template <class F, class... A>
void check_against_oracle(F f, double tol, bool split, A... args) {
  auto g = k::compile(f);
  k::Tensor got = g(args...);
  k::Tensor want = k::reference::eval(f(args.to(k::cpu).to(k::f64)...));
  auto r = k::testing::allclose(got.to(k::cpu), want, tol, tol * 10);
  INFO(r.str());
  INFO(k::explain(g, args...));
  CHECK(r);
  CHECK(two_stage(k::explain(g, args...)) == split);
}

void column_reductions(k::Device dev) {
  // 20001 rows (3 x 59 x 113): 256 chunks of 78 rows and 33 rows left over.
  auto x = k::randn({20001, 48}, k::f32, k::cpu, 3).to(dev);
  check_against_oracle([](auto a) { return k::sum(a, 0); }, 1e-4, true, x);
  check_against_oracle([](auto a) { return k::amax(a, 0); }, 0, true, x);
  check_against_oracle([](auto a) { return k::amin(a * 2.0f, 0); }, 0, true, x);
  // 16-bit input summed in f32 over an odd row count.
  auto h = k::randn({4099, 96}, k::bf16, k::cpu, 4).to(dev);
  check_against_oracle([](auto a) { return k::sum(a, 0); }, 2e-2, true, h);
}

void row_reductions(k::Device dev) {
  // A full sum over 300009 elements is split with a remainder; sums over three long rows of a prime
  // length stay one row kernel (a row has up to 512 threads; only a divisor splits rows).
  auto x = k::randn({3, 100003}, k::f32, k::cpu, 5).to(dev);
  check_against_oracle([](auto a) { return k::sum(a); }, 1e-4, true, x);
  check_against_oracle([](auto a) { return k::sum(a, 1); }, 1e-4, false, x);
  check_against_oracle([](auto a) { return k::amax(a + 1.0f, 1); }, 0, false, x);
  // ... and a mean over an even count with no larger power-of-two factor: [2, 87381] would be two
  // chunks, a thread each; it gets many chunks and a remainder instead.
  auto y = k::randn({174762}, k::f32, k::cpu, 10).to(dev);
  check_against_oracle([](auto a) { return k::mean(a); }, 1e-4, true, y);
  // A split 1-D sum with symbolic sizes serves every length: its chunks are zero-padded past the
  // input's end (a program whose chunks covered the compiling call's elements would have summed
  // the others wrong, or compiled again at each length).
  auto total = k::compile([](auto a) { return k::sum(a); }, {.shapes = k::shapes::dynamic});
  int call = 0;
  for (std::int64_t n : {174762, 1000003, 174762, 4096, 5003}) {
    CAPTURE(n);
    auto z = k::randn({n}, k::f32, k::cpu, 11);
    const int before = total.cache().compiles();
    auto close =
        k::testing::allclose(total(z.to(dev)).to(k::cpu), k::reference::eval(k::sum(k::cast(z, k::f64))), 1e-6, 1e-2);
    CHECK_MESSAGE(bool(close), close);
    CHECK(total.cache().compiles() - before == (call++ == 0 ? 1 : 0));
  }
}

// A layer_norm backward (dx, and dw and db: split column sums) at changing row counts, which a
// model meets as its batch or sequence length changes: with shapes::dynamic one program serves
// them all, in the automatic mode the second (its row count symbolic) serves the rest. Before,
// every new row count compiled again: the chunks of the split sums, and the expand in the mean's
// derivative, named the compiling call's row count. cols: the row length; hosted: whether a GPU
// row kernel must compute dw and db as column partials at a symbolic row count (the automatic mode,
// its row length static).
void norm_backward_at_changing_rows(k::Device dev, std::int64_t cols, std::vector<std::int64_t> row_counts,
                                    bool hosted = false) {
  auto ln = [](auto a, auto ww, auto bb) { return k::layer_norm(a, ww, bb); };
  // The oracle, written out from layer_norm's definition (eps 1e-5) and interpreted in f64: no
  // program compiled a row count (a compiled oracle made the GPU case run minutes on a fresh cache).
  auto oracle = [](const k::Tensor& x32, const k::Tensor& w32, const k::Tensor& dy32) {
    k::Tensor x = k::cast(x32, k::f64), w = k::cast(w32, k::f64), dy = k::cast(dy32, k::f64);
    k::Tensor mu = k::reference::eval(k::mean(x, 1, true));
    k::Tensor rstd = k::reference::eval(k::rsqrt(k::mean(k::square(x - mu), 1, true) + 1e-5));
    k::Tensor xhat = k::reference::eval((x - mu) * rstd), g = k::reference::eval(dy * w);
    k::Tensor dx = k::reference::eval(rstd * (g - k::mean(g, 1, true) - xhat * k::mean(g * xhat, 1, true)));
    return std::tuple{dx, k::reference::eval(k::sum(dy * xhat, 0)), k::reference::eval(k::sum(dy, 0))};
  };
  for (k::shapes mode : {k::shapes::dynamic, k::shapes::automatic}) {
    CAPTURE(static_cast<int>(mode));
    auto f = k::compile(k::vjp(ln, k::wrt<0, 1, 2>), {.shapes = mode});
    auto w = k::randn({cols}, k::f32, k::cpu, 30), b = k::randn({cols}, k::f32, k::cpu, 31);
    int call = 0;
    for (std::int64_t rows : row_counts) {
      CAPTURE(rows);
      auto x = k::randn({rows, cols}, k::f32, k::cpu, 32 + static_cast<std::uint64_t>(rows));
      auto dy = k::randn({rows, cols}, k::f32, k::cpu, 33 + static_cast<std::uint64_t>(rows));
      const int before = f.cache().compiles();
      auto [dx, dw, db] = f(x.to(dev), w.to(dev), b.to(dev), dy.to(dev));
      auto [ox, ow, ob] = oracle(x, w, dy);
      auto rx = k::testing::allclose(dx.to(k::cpu), ox, 1e-4, 1e-3),
           rw = k::testing::allclose(dw.to(k::cpu), ow, 1e-4, 1e-2),
           rb = k::testing::allclose(db.to(k::cpu), ob, 1e-4, 1e-2);
      INFO(rx.str() << "\n" << rw.str() << "\n" << rb.str());
      CHECK(rx);
      CHECK(rw);
      CHECK(rb);
      // Sizes 1 stay specialised (a row count of 1 compiles its own program, as in torch.compile;
      // so does one below the split's chunk count, its chunks one row long).
      const int want = rows == 1 ? 1 : mode == k::shapes::dynamic ? (call == 0) : (call <= 1);
      CHECK(f.cache().compiles() - before == want);
      if (hosted && mode == k::shapes::automatic && call >= 1 && rows > 1) {
        auto rep = k::explain(f, x.to(dev), w.to(dev), b.to(dev), dy.to(dev));
        bool partials = false;
        for (const auto& ki : rep.kernels) partials = partials || ki.source.find("KILN_ROW_GROUP") != std::string::npos;
        INFO(rep);
        CHECK(partials);
      }
      ++call;
    }
  }
}

// dw and db of a layer_norm (the column sums of its backward) over inputs of dtype dt, against the
// f64 oracle of the same rounded inputs; split: whether they must reduce in two stages.
void layer_norm_weight_gradients(k::Device dev, std::int64_t rows, std::int64_t cols, k::dtype dt, double tol,
                                 bool split, std::uint64_t seed) {
  auto x = k::randn({rows, cols}, k::f32, k::cpu, seed), dy = k::randn({rows, cols}, k::f32, k::cpu, seed + 1);
  auto w = k::randn({cols}, k::f32, k::cpu, seed + 2), b = k::randn({cols}, k::f32, k::cpu, seed + 3);
  auto ln = [](auto a, auto ww, auto bb) { return k::layer_norm(a, ww, bb); };
  auto f = k::compile(k::vjp(ln, k::wrt<1, 2>));
  auto in = [&](const k::Tensor& t) { return k::Tensor(k::cast(t, dt)).to(dev); };
  auto [dw, db] = f(in(x), in(w), in(b), in(dy));
  CHECK(two_stage(k::explain(f, in(x), in(w), in(b), in(dy))) == split);
  auto wide = [&](const k::Tensor& t) { return k::Tensor(k::cast(k::cast(t, dt), k::f64)); };
  auto oracle = k::compile(k::vjp(ln, k::wrt<1, 2>));
  auto [ow, ob] = oracle(wide(x), wide(w), wide(b), wide(dy));
  auto rw = k::testing::allclose(dw.to(k::cpu), ow, tol, tol * (dt == k::f32 ? 10 : 1)),
       rb = k::testing::allclose(db.to(k::cpu), ob, tol, tol * (dt == k::f32 ? 10 : 1));
  INFO(rw.str() << "\n" << rb.str());
  CHECK(rw);
  CHECK(rb);
}

// Column sums over more columns than the old 32768-column rule split: on a GPU still two stages
// while the columns give fewer threads than about 256K (schedule/split.hpp's column_threads;
// NOTES item 110), on the host one stage (its split first stage walks down columns).
void wide_columns(k::Device dev) {
  auto x = k::randn({1025, 40009}, k::f32, k::cpu, 11).to(dev);  // 1025 rows: chunks and a remainder
  check_against_oracle([](auto a) { return k::sum(a, 0); }, 1e-4, dev.is_cuda(), x);
}

// A split program reused at other row counts (shapes::dynamic, and automatic after a change): its
// chunks cover the compiling call's first S * floor(R / S) rows and the rest slice runs to the end
// of the rows, so more rows go to the rest and fewer recompile; never a sum that skips rows (the
// rest slice once ended at the compiling call's R: later rows were dropped). cols: on the host
// split below 32768 columns, on a GPU below ~256K.
void changing_row_counts(k::Device dev, std::int64_t cols) {
  for (k::shapes mode : {k::shapes::dynamic, k::shapes::automatic}) {
    auto fn = [](auto a) { return k::sum(a, 0); };
    auto f = k::compile(fn, {.shapes = mode});
    for (std::int64_t rows : {1025, 1030, 2049, 3000, 1500, 1025, 1024}) {
      CAPTURE(rows);
      auto x = k::randn({rows, cols}, k::f32, k::cpu, 20 + static_cast<std::uint64_t>(rows));
      k::Tensor got = f(x.to(dev));
      auto r = k::testing::allclose(got.to(k::cpu), k::reference::eval(fn(x.to(k::f64))), 1e-4, 1e-3);
      INFO(r.str());
      CHECK(r);
    }
  }
}

// One dynamic program over kept rows of changing odd widths (and two of whole vectors). With by_rows
// (the default; KILN_TUNE_COLUMN_ROWS=0 the flat walk) its split column kernel on a GPU walks a kept
// row's column tiles by blocks (codegen/kernel_writer_plan.hpp), planned at the first width and
// right at widths far below it (a row's last block then mostly idle lanes). With
// KILN_TUNE_ALIGNED_SIZES=1 the kernel tests the width once for whole vectors and runs a body
// without per-access alignment tests: element by element at odd widths, by vectors at 4096 and 50264.
// (What the kernel should show follows the two variables as the run has them.)
void changing_odd_widths(k::Device dev) {
  auto set_to = [](const char* name, const char* value) {
    const char* v = std::getenv(name);
    return v && std::string(v) == value;
  };
  const bool by_rows = !set_to("KILN_TUNE_COLUMN_ROWS", "0"), sizes_tested = set_to("KILN_TUNE_ALIGNED_SIZES", "1");
  auto fn = [](auto a) { return k::sum(a, 0); };
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
  k::Tensor last;
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{2049, 40009},
                            {3001, 33},
                            {2051, 4096},
                            {1025, 1001},
                            {515, 50264},
                            {4097, 50257}}) {
    CAPTURE(rows);
    CAPTURE(cols);
    auto x = k::randn({rows, cols}, k::f32, k::cpu, 40 + static_cast<std::uint64_t>(cols));
    last = x.to(dev);
    k::Tensor got = f(last);
    auto r = k::testing::allclose(got.to(k::cpu), k::reference::eval(fn(x.to(k::f64))), 1e-4, 1e-3);
    INFO(r.str());
    CHECK(r);
    if (dev.is_cuda() && cols == 40009) {  // the first width plans the program: its first stage by kept rows
      auto rep = k::explain(f, x.to(dev));
      CHECK(by_rows == std::any_of(rep.kernels.begin(), rep.kernels.end(), [](const auto& kk) {
              return kk.source.find("one row a block") != std::string::npos;
            }));
      if (by_rows)  // (the flat walk's lanes cross rows: a division by the width, tested each access)
        CHECK(sizes_tested == std::any_of(rep.kernels.begin(), rep.kernels.end(), [](const auto& kk) {
                return kk.source.find(" == 0) kiln_body(") != std::string::npos;  // a size tested once
              }));
    }
  }
  CHECK(k::explain(f, last).recompiles == 0);  // one program served every width
}

}  // namespace

TEST_CASE("split: split column sums at changing row counts (CPU)") { changing_row_counts(k::cpu, 1000); }
TEST_CASE("split: split column sums at changing row counts (GPU)" * needs_gpu()) {
  changing_row_counts(k::cuda, 1000);
  changing_row_counts(k::cuda, 40009);
}

TEST_CASE("split: dynamic column sums over changing odd widths (CPU)") { changing_odd_widths(k::cpu); }
TEST_CASE("split: dynamic column sums over changing odd widths (GPU)" * needs_gpu()) {
  changing_odd_widths(k::cuda);
  {
    ScopedEnv sizes("KILN_TUNE_ALIGNED_SIZES", "1");
    changing_odd_widths(k::cuda);
  }
  ScopedEnv flat("KILN_TUNE_COLUMN_ROWS", "0");
  changing_odd_widths(k::cuda);
}
TEST_CASE("split: column sums over wide columns, two stages on a GPU only (CPU)") { wide_columns(k::cpu); }
TEST_CASE("split: column sums over wide columns, two stages on a GPU only (GPU)" * needs_gpu()) {
  wide_columns(k::cuda);
}
// A bf16 layer_norm's dw and db over wide rows: the column sums split on a GPU (1.60 -> 1.04 ms at
// 2670x50257 on an H200); sums of 1029 products rounded to bf16 at the end: a few bf16 ulps.
TEST_CASE("split: a bf16 layer_norm's dw and db over wide rows (GPU)" * needs_gpu()) {
  layer_norm_weight_gradients(k::cuda, 1029, 33001, k::bf16, 2e-2, true, 12);
}

TEST_CASE("split: a layer_norm backward at changing row counts compiles once (CPU)") {
  norm_backward_at_changing_rows(k::cpu, 256, {4096, 3001, 500, 16384, 20001, 4096, 1});
}
TEST_CASE("split: a layer_norm backward at changing row counts compiles once (GPU)" * needs_gpu()) {
  norm_backward_at_changing_rows(k::cuda, 256, {4096, 3001, 500, 16384, 20001, 4096, 1});
  // dw and db as column partials of the dx kernel (256 groups from 16384 rows on), also at fewer
  // rows than groups
  norm_backward_at_changing_rows(k::cuda, 2048, {16384, 20001, 3001, 200, 1}, true);
}

TEST_CASE("split: column reductions over odd row counts (CPU)") { column_reductions(k::cpu); }
TEST_CASE("split: full reductions split, rows of prime length not (CPU)") { row_reductions(k::cpu); }
TEST_CASE("split: layer_norm dw and db over an odd row count (CPU)") {
  layer_norm_weight_gradients(k::cpu, 6003, 80, k::f32, 1e-4, true, 6);
}

TEST_CASE("split: column reductions over odd row counts (GPU)" * needs_gpu()) { column_reductions(k::cuda); }
TEST_CASE("split: full reductions split, rows of prime length not (GPU)" * needs_gpu()) { row_reductions(k::cuda); }
TEST_CASE("split: layer_norm dw and db over an odd row count (GPU)" * needs_gpu()) {
  layer_norm_weight_gradients(k::cuda, 6003, 80, k::f32, 1e-4, true, 6);
}
