// Host reductions over outer dims (launch_config.hpp's x_lanes): a program's kept elements are one
// tile's lanes and the reduced elements a scalar loop, so a column sum reads whole cache lines
// instead of one element a line. Values against the f64 oracle: sums, means, maxima (NaN included)
// and minima over dim 0 and over middle dims of 3-D inputs, kept dims that are and are not whole
// tiles of 16 (the last program short of lanes), several reductions in one kernel with a full-size
// output (softmax over dim 0), bf16 and integer inputs, and layer_norm's weight and bias gradients
// over a few hundred rows; which kernels take the form is checked on k::explain's sources, and
// their sources also compile for a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

constexpr const char* marker = "KILN_COLUMN_PROGRAM(xoffset)";

// One source, two targets: a kernel written for the host also compiles for a GPU (NVRTC, which
// needs no device), once per distinct source.
void check_compiles_for_gpu(const k::kernel_info& ki) {
  static std::set<std::string> compiled;
  if (!compiled.insert(ki.source).second) return;
  INFO(ki.source);
  std::vector<char> bin;
  CHECK_NOTHROW(bin = k::cubin(ki, "sm_90a"));
  CHECK(bin.size() > 4);
}

bool uses_lanes(const k::report& e) {
  bool lanes = false;
  for (const auto& ki : e.kernels)
    if (ki.source.find(marker) != std::string::npos) lanes = true, check_compiles_for_gpu(ki);
  return lanes;
}

// Runs f compiled on the CPU, compares with the oracle, and says whether a kernel put its lanes
// along the kept elements.
template <class F, class... A>
bool run_and_check(F f, double tol, A... args) {
  auto g = k::compile(f);
  k::Tensor got = g(args...);
  k::Tensor want = k::reference::eval(f(k::Tensor(args.to(k::f64))...));
  auto r = k::testing::allclose(got.to(k::f64), want, tol, tol);
  k::report e = k::explain(g, args...);
  INFO(r.str());
  INFO(e);
  CHECK(r);
  return uses_lanes(e);
}

// got = amax(v, 0) + sum(v, 0) for v of `cols` columns, computed here in f64; NaN in nan_columns.
void check_max_plus_sum(const std::vector<float>& v, int cols, const std::vector<float>& got,
                        const std::set<int>& nan_columns) {
  const int rows = static_cast<int>(v.size()) / cols;
  REQUIRE(got.size() == static_cast<std::size_t>(cols));
  for (int c = 0; c < cols; ++c) {
    double mx = -INFINITY, sum = 0;
    for (int r = 0; r < rows; ++r) mx = std::max(mx, double(v[r * cols + c])), sum += v[r * cols + c];
    INFO("column " << c);
    if (nan_columns.count(c))
      CHECK(std::isnan(got[c]));
    else
      CHECK(std::abs(got[c] - (mx + sum)) < 1e-5 * (1 + std::abs(mx + sum)));
  }
}

}  // namespace

TEST_CASE("outer reductions on the CPU: column sums, means and extrema against the oracle") {
  auto x = k::randn({37, 272}, k::f32, k::cpu, 1);  // 272 = 17 tiles of 16 kept elements
  CHECK(run_and_check([](auto a) { return k::sum(a, 0); }, 1e-5, x));
  CHECK(run_and_check([](auto a) { return k::mean(a, 0, true); }, 1e-5, x));
  CHECK(run_and_check([](auto a) { return k::amax(a * 2.0f, 0); }, 0, x));
  CHECK(run_and_check([](auto a) { return k::amin(k::exp(a), 0); }, 1e-6, x));
  auto ragged = k::randn({29, 270}, k::f32, k::cpu, 2);  // the last program 14 lanes short
  CHECK(run_and_check([](auto a) { return k::sum(a * a, 0); }, 1e-5, ragged));
  // ... written twice: whole tiles unmasked (vectorised), the tile with the end masked (NOTES 111).
  auto split = k::compile([](auto a) { return k::sum(a * a, 0); });
  const std::string src = k::explain(split, ragged).kernels.at(0).source;
  CHECK(src.find("if (xoffset + XVEC <= xnumel) {") != std::string::npos);
  CHECK(src.find("auto xmask = xindex < xnumel;") != std::string::npos);
  // (A function of its own: a second shape would make the first's sizes symbolic.)
  const std::string whole = k::explain(k::compile([](auto a) { return k::sum(a * a, 0); }), x).kernels.at(0).source;
  CHECK(whole.find("if (xoffset + XVEC <= xnumel)") == std::string::npos);
  // 3-D: the middle dim reduced, kept [5, 48] (whole tiles) and [5, 20] (a tile spans two rows).
  auto x3 = k::randn({5, 19, 48}, k::f32, k::cpu, 3);
  CHECK(run_and_check([](auto a) { return k::mean(a, 1); }, 1e-5, x3));
  auto y3 = k::randn({5, 19, 20}, k::f32, k::cpu, 4);
  CHECK(run_and_check([](auto a) { return k::sum(k::tanh(a), 1); }, 1e-5, y3));
  // Two leading dims reduced at once.
  auto z3 = k::randn({3, 7, 40}, k::f32, k::cpu, 5);
  CHECK(run_and_check([](auto a) { return k::sum(a, std::vector<std::int64_t>{0, 1}); }, 1e-5, z3));
  // A reduction over the last dim keeps its lanes along the row.
  CHECK_FALSE(run_and_check([](auto a) { return k::sum(a, 1); }, 1e-5, x));
}

TEST_CASE("outer reductions on the CPU: NaN in a column, softmax over dim 0, bf16 and integers") {
  std::vector<float> v(23 * 48);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
  v[5 * 48 + 7] = std::numeric_limits<float>::quiet_NaN();  // column 7's max and sum are NaN
  auto x = k::from_vector(v, {23, 48});
  auto g = k::compile([](auto a) { return k::amax(a, 0) + k::sum(a, 0); });
  CHECK(uses_lanes(k::explain(g, x)));
  check_max_plus_sum(v, 48, k::to_vector<float>(g(x)), {7});
  // The same over a ragged width: NaN in a whole tile (column 7) and in the last, short one (49).
  std::vector<float> w(23 * 50);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = std::cos(0.29f * static_cast<float>(i)) * 2.0f;
  w[3 * 50 + 7] = w[11 * 50 + 49] = std::numeric_limits<float>::quiet_NaN();
  auto xr = k::from_vector(w, {23, 50});
  check_max_plus_sum(w, 50, k::to_vector<float>(g(xr)), {7, 49});
  // Two loops of reductions and a full-size output written in a last loop.
  auto s = k::randn({33, 100}, k::f32, k::cpu, 6);
  CHECK(run_and_check([](auto a) { return k::softmax(a, 0); }, 1e-5, s));
  auto h = k::randn({41, 64}, k::bf16, k::cpu, 7);
  CHECK(run_and_check([](auto a) { return k::sum(a, 0); }, 2e-2, h));
  auto hr = k::randn({41, 77}, k::bf16, k::cpu, 8);  // 16-bit, ragged
  CHECK(run_and_check([](auto a) { return k::sum(a, 0); }, 2e-2, hr));
  std::vector<std::int32_t> iv(31 * 32);
  for (std::size_t i = 0; i < iv.size(); ++i) iv[i] = static_cast<std::int32_t>((i * 7919) % 201) - 100;
  auto xi = k::from_vector(iv, {31, 32});
  CHECK(run_and_check([](auto a) { return k::amax(a, 0); }, 0, xi));
}

TEST_CASE("outer reductions on the CPU: layer_norm's weight and bias gradients over a few hundred rows") {
  // 300 rows: too few to split into row groups, so dw and db are column sums in a kernel of their own.
  const std::int64_t rows = 300, cols = 272;
  auto x = k::randn({rows, cols}, k::f32, k::cpu, 11), dy = k::randn({rows, cols}, k::f32, k::cpu, 14);
  auto w = k::randn({cols}, k::f32, k::cpu, 12), b = k::randn({cols}, k::f32, k::cpu, 13);
  auto f = k::compile(k::vjp([](auto a, auto g, auto be) { return k::layer_norm(a, g, be); }, k::wrt<0, 1, 2>));
  auto [dx, dw, db] = f(x, w, b, dy);
  CHECK(uses_lanes(k::explain(f, x, w, b, dy)));
  const std::vector<float> xv = k::to_vector<float>(x), dyv = k::to_vector<float>(dy);
  std::vector<double> want_dw(cols, 0.0), want_db(cols, 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mean += xv[r * cols + c];
    mean /= cols;
    for (std::int64_t c = 0; c < cols; ++c) var += (xv[r * cols + c] - mean) * (xv[r * cols + c] - mean);
    const double rstd = 1 / std::sqrt(var / cols + 1e-5);
    for (std::int64_t c = 0; c < cols; ++c) {
      want_dw[c] += dyv[r * cols + c] * (xv[r * cols + c] - mean) * rstd;
      want_db[c] += dyv[r * cols + c];
    }
  }
  auto r_dw = k::testing::allclose(dw, k::from_vector(want_dw, {cols}), 1e-4, 1e-4);
  auto r_db = k::testing::allclose(db, k::from_vector(want_db, {cols}), 1e-4, 1e-4);
  CHECK_MESSAGE(bool(r_dw), r_dw);
  CHECK_MESSAGE(bool(r_db), r_db);
}

// Kept elements over two or more dims whose last one is no whole number of tiles: a program is a
// column tile of one kept row (plan's col_tiles_), never straddling two rows. The first stage of a
// split column sum over 1024x4099 ([16, 4099] kept), softmax and a max over dim 1 of [5, 12, 37]
// (kept [5, 37]), a variance over dim 1 of [3, 40, 1001], bf16; and kept rows of whole tiles (a
// split sum over 1024x4096) or a single kept dim (sum over dim 0 of 33x1001), which keep the flat walk.
TEST_CASE("outer reductions on the CPU: kept rows of odd width walked by column tiles") {
  auto by_cols = [](auto f, auto... args) {
    k::report e = k::explain(k::compile(f), args...);
    bool any = false;
    for (const auto& ki : e.kernels)
      if (ki.source.find("as rows by column tiles, lanes along the kept elements") != std::string::npos) {
        any = true;
        check_compiles_for_gpu(ki);
      }
    return any;
  };
  auto sum0 = [](auto a) { return k::sum(a, 0); };
  auto x = k::randn({1024, 4099}, k::f32, k::cpu, 71);
  CHECK(run_and_check(sum0, 1e-4, x));
  CHECK(by_cols(sum0, x));
  auto sm1 = [](auto a) { return k::softmax(a, 1); };
  auto mx1 = [](auto a) { return k::amax(a, 1); };
  k::Tensor t = k::randn({5, 12, 37}, k::f32, k::cpu, 72) * 3.0f;
  CHECK(run_and_check(sm1, 1e-5, t));
  CHECK(run_and_check(mx1, 0.0, t));
  CHECK(by_cols(sm1, t));
  auto var1 = [](auto a) { return k::var(a, 1); };
  k::Tensor v = k::randn({3, 40, 1001}, k::f32, k::cpu, 73) + 2.0f;
  CHECK(run_and_check(var1, 1e-4, v));
  CHECK(by_cols(var1, v));
  CHECK(run_and_check(sm1, 2e-2, t.to(k::bf16)));
  // A value that varies along the kept row's leading dims only (s: [5, 12, 1]), read as one scalar.
  auto scaled = [](auto a, auto sc) { return k::sum(a * sc, 1); };
  k::Tensor s = k::randn({5, 12, 1}, k::f32, k::cpu, 76);
  CHECK(run_and_check(scaled, 1e-5, t, s));
  CHECK(by_cols(scaled, t, s));
  // Whole tiles, or one kept dim: the flat walk.
  auto whole = k::randn({1024, 4096}, k::f32, k::cpu, 74);
  CHECK(run_and_check(sum0, 1e-4, whole));
  CHECK_FALSE(by_cols(sum0, whole));
  auto one = k::randn({33, 1001}, k::f32, k::cpu, 75);
  CHECK(run_and_check(sum0, 1e-5, one));
  CHECK_FALSE(by_cols(sum0, one));
}
