// Programs in bounded caches (issue 16, API.md "Evaluating"): eager expressions never throw for
// variety (loops over slices and reshapes compile at most twice, casts across dtypes and ranks keep
// working), views of eager tensors are read in place, compiled functions past their recompile limit
// warn once and generalise, and the process-wide eager budget holds.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

void check_close(const k::Tensor& got, const k::Tensor& want, double rtol = 1e-5, double atol = 1e-6) {
  auto r = k::testing::allclose(got, want, rtol, atol);
  INFO(r.str());
  CHECK(r);
}

// The eager cache of expressions of e's type (one per expression type).
template <class E>
k::runtime::ProgramCache& cache_of(const E&) {
  return k::detail::eager_cache<E>();
}

// Collects the recompiles log while alive.
struct LogCapture {
  static inline std::string text;
  k::debug::LogSink old;
  explicit LogCapture(std::string_view channels) {
    text.clear();
    k::debug::set_log_channels(channels);
    old = k::debug::set_log_sink([](k::debug::Channel, std::string_view s) { text += s; });
  }
  ~LogCapture() {
    k::debug::set_log_sink(old);
    k::debug::set_log_channels("");
  }
};

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("program cache: an eager loop over row slices compiles once and never throws") {
  k::Tensor m = k::randn({20, 37}, k::f32, k::cpu, 1);
  auto& cache = cache_of(k::sum(k::slice(m, 0, 0, 1)));
  int before = cache.compiles();
  for (std::int64_t i = 0; i < 20; ++i) {
    k::Tensor r = k::sum(k::slice(m, 0, i, i + 1));
    check_close(r, k::reference::eval(k::sum(k::slice(m, 0, i, i + 1))));
  }
  // The slice is a view of m at another offset: the same program every time.
  CHECK(cache.compiles() - before <= 1);
  // Column slices with a step, negative bounds and an empty slice read through strides.
  for (std::int64_t j = -5; j < 7; ++j) {
    auto e = k::slice(m, 1, j, j + 9, 2) * 2.0f;
    k::Tensor got = e;
    check_close(got, k::reference::eval(e));
  }
  k::Tensor empty = k::slice(m, 0, 7, 3) + 1;
  CHECK(empty.shape() == k::Dims{0, 37});
}

TEST_CASE("program cache: reshapes to twelve views compile at most twice") {
  k::Tensor m = k::randn({12, 60}, k::f32, k::cpu, 2);
  const std::vector<k::Dims> views = {{720},    {360, 2}, {2, 360}, {240, 3}, {3, 240}, {180, 4},
                                      {4, 180}, {120, 6}, {6, 120}, {90, 8},  {8, 90},  {72, 10}};
  auto& cache = cache_of(k::reshape(m, {720}) + 1);
  int compiles_before = cache.compiles();
  for (const auto& v : views) {
    auto e = k::reshape(m, v) + 1;
    k::Tensor y = e;
    REQUIRE(y.shape() == (v.size() == 1 ? k::Dims{720} : v));
    check_close(y, k::reference::eval(e));
  }
  int compiles = cache.compiles() - compiles_before;
  CHECK(compiles <= 3);  // rank 1 once; rank 2 exact, then symbolic
}

TEST_CASE("program cache: views of eager tensors match the oracle (which keeps them as nodes)") {
  k::Tensor x = k::randn({4, 5, 6}, k::f32, k::cpu, 3);
  k::Tensor b = k::randn({6}, k::f32, k::cpu, 4);
  k::Tensor t = k::randn({6, 4}, k::f32, k::cpu, 5).as_strided({4, 6}, {1, 4}, 0);  // transposed storage
  check_close(k::eval(k::permute(x, {2, 0, 1}) * 3), k::reference::eval(k::permute(x, {2, 0, 1}) * 3));
  check_close(k::eval(k::transpose(x, 0, -1) - 1), k::reference::eval(k::transpose(x, 0, -1) - 1));
  check_close(k::eval(k::expand(b, {4, 5, 6}) + x), k::reference::eval(k::expand(b, {4, 5, 6}) + x));
  check_close(k::eval(k::unsqueeze(b, 0) * 2), k::reference::eval(k::unsqueeze(b, 0) * 2));
  check_close(k::eval(k::squeeze(k::slice(x, 1, 2, 3)) + 0.5f),
              k::reference::eval(k::squeeze(k::slice(x, 1, 2, 3)) + 0.5f));
  // A reshape of a strided tensor reads a contiguous copy, as torch.reshape does.
  check_close(k::eval(k::reshape(t, {24}) * 2), k::reference::eval(k::reshape(t, {24}) * 2));
  // Chains: a slice of a transpose of an expand.
  auto chain = k::slice(k::transpose(k::expand(k::unsqueeze(b, 1), {6, 3}), 0, 1), 1, 1, 6, 2) + 1;
  check_close(k::eval(chain), k::reference::eval(chain));
  // Bad views keep inference's typed errors, naming the op and the shapes.
  CHECK_THROWS_AS(k::eval(k::reshape(x, {7, 7}) + 1), k::shape_error);
  CHECK_THROWS_WITH_AS(k::eval(k::expand(b, {4, 5}) + 1), doctest::Contains("expand"), k::shape_error);
  CHECK_THROWS_AS(k::eval(k::slice(x, 3, 0, 1) + 1), k::shape_error);
}

TEST_CASE("program cache: a cast helper across every dtype and three ranks never throws") {
  const k::dtype dtypes[] = {k::f64, k::f32, k::f16, k::bf16, k::i64, k::i32, k::boolean};
  const std::vector<k::Dims> shapes = {{17}, {5, 7}, {3, 4, 5}};
  auto to_f32 = [](const k::Tensor& t) { return k::Tensor(k::cast(t, k::f32)); };
  int calls = 0;
  for (int round = 0; round < 2; ++round)
    for (auto d : dtypes)
      for (const auto& s : shapes) {
        k::Tensor x = k::randn(s, k::f32, k::cpu, static_cast<std::uint64_t>(calls)).to(d);
        k::Tensor y = to_f32(x);
        CHECK(y.dtype() == k::f32);
        check_close(y, k::reference::eval(k::cast(x, k::f32)));
        ++calls;
      }
  CHECK(calls == 42);
  // Twenty differently shaped results through the same helper.
  for (std::int64_t n = 1; n <= 20; ++n) {
    k::Tensor x = k::randn({n, 21 - n}, k::bf16, k::cpu, static_cast<std::uint64_t>(n));
    check_close(to_f32(x), k::reference::eval(k::cast(x, k::f32)));
  }
}

TEST_CASE("program cache: a compiled function past its limit warns once, generalises and keeps working") {
  auto fn = [](auto x) { return k::tanh(x) * 2 + 1; };
  auto f = k::compile(fn, {.shapes = k::shapes::static_, .recompile_limit = 3});
  LogCapture log("recompiles");
  for (std::int64_t n = 2; n < 14; ++n) {
    k::Tensor x = k::randn({n, 9}, k::f32, k::cpu, static_cast<std::uint64_t>(n));
    check_close(f(x), k::reference::eval(fn(x)));
    CHECK(f.cache().size() <= 3);
  }
  CHECK(f.cache().generalized());
  CHECK(count(LogCapture::text, "recompile limit of 3 reached") == 1);
  // Past the limit every size is symbolic: new sizes of the same rank need no new program.
  int recompiles = f.cache().recompiles();
  for (std::int64_t n : {31, 47, 5}) {
    k::Tensor x = k::randn({n, 9 + n}, k::f32, k::cpu, static_cast<std::uint64_t>(n));
    check_close(f(x), k::reference::eval(fn(x)));
  }
  CHECK(f.cache().recompiles() == recompiles);
  // New dtypes and ranks still get programs, the least recently used one making room.
  for (auto d : {k::f64, k::bf16, k::i32, k::f16}) {
    k::Tensor x = k::randn({6, 4, 3}, k::f32, k::cpu, 9).to(d);
    check_close(f(x), k::reference::eval(fn(x)), 2e-2, 2e-2);
    CHECK(f.cache().size() <= 3);
  }
  CHECK(count(LogCapture::text, "recompile limit of 3 reached") == 1);
}

TEST_CASE("program cache: the eager budget evicts the least recently used programs across expressions") {
  std::int64_t saved = k::runtime::eager_capacity();
  k::runtime::set_eager_capacity(4);
  CHECK(k::runtime::eager_programs() <= 4);
  LogCapture log("cache");
  k::Tensor x = k::randn({33}, k::f32, k::cpu, 6);
  for (int round = 0; round < 2; ++round) {
    for (auto d : {k::f64, k::f32, k::bf16, k::i32, k::i64, k::f16}) {
      k::Tensor xd = x.to(d);
      check_close(k::eval(k::abs(xd) + 1), k::reference::eval(k::abs(xd) + 1), 1e-2, 1e-2);
      check_close(k::eval(k::maximum(xd, 0) * 3), k::reference::eval(k::maximum(xd, 0) * 3), 1e-2, 1e-2);
      CHECK(k::runtime::eager_programs() <= 4);
    }
  }
  CHECK(count(LogCapture::text, "evicted") >= 8);
  k::runtime::set_eager_capacity(saved);
}

TEST_CASE("program cache: slice bounds that change become kernel arguments in compiled functions") {
  k::Tensor m = k::randn({20, 37}, k::f32, k::cpu, 7);
  std::int64_t i = 0;
  auto row_sum = k::compile([&](auto x) { return k::sum(k::slice(x, 0, i, i + 1)); });
  for (i = 0; i < 20; ++i) check_close(row_sum(m), k::reference::eval(k::sum(k::slice(m, 0, i, i + 1))));
  CHECK(row_sum.cache().compiles() == 2);  // exact first, then the start is a kernel argument
  k::report r = k::explain(row_sum, m);
  bool symbolic = false;
  for (const auto& g : r.guards) symbolic = symbolic || g.find("symbolic attributes") != std::string::npos;
  CHECK(symbolic);

  // Start, stop and step all changing, on a slice of an expression (eager and compiled).
  std::int64_t lo = 0, hi = 0, step = 1;
  auto part = k::compile([&](auto x) { return k::slice(k::exp(x) * 0.5f, 1, lo, hi, step) + 1; });
  int calls = 0;
  for (lo = -3; lo < 6; lo += 2)
    for (step = 1; step <= 3; ++step) {
      hi = lo + 20 + step;
      check_close(part(m), k::reference::eval(k::slice(k::exp(m) * 0.5f, 1, lo, hi, step) + 1));
      k::Tensor eager = k::slice(k::exp(m) * 0.5f, 1, lo, hi, step) + 1;
      check_close(eager, k::reference::eval(k::slice(k::exp(m) * 0.5f, 1, lo, hi, step) + 1));
      ++calls;
    }
  CHECK(calls == 15);
  CHECK(part.cache().compiles() <= 4);
}

TEST_CASE("program cache: reshape and expand sizes that change become symbolic") {
  k::Tensor x = k::randn({12, 60}, k::f32, k::cpu, 8);
  k::Dims view = {720};
  auto f = k::compile([&](auto a) { return k::reshape(a, view) * 2 - 1; });
  for (auto v : std::vector<k::Dims>{{360, 2}, {2, 360}, {240, 3}, {3, 240}, {180, 4}, {4, 180}, {90, 8}, {8, 90}}) {
    view = v;
    k::Tensor y = f(x);
    REQUIRE(y.shape() == v);
    check_close(y, k::reference::eval(k::reshape(x, v) * 2 - 1));
  }
  CHECK(f.cache().compiles() <= 3);

  k::Tensor b = k::randn({1, 9}, k::f32, k::cpu, 9);
  std::int64_t rows = 2;
  auto g = k::compile([&](auto a) { return k::expand(a, {rows, 9}) * 3; });
  for (rows = 2; rows < 12; ++rows) check_close(g(b), k::reference::eval(k::expand(b, {rows, 9}) * 3));
  CHECK(g.cache().compiles() <= 2);
}

TEST_CASE("program cache: gradients through a slice with changing bounds") {
  k::Tensor x = k::randn({10, 6}, k::f64, k::cpu, 10);
  std::int64_t i = 0;
  auto loss = [&](auto a) { return k::sum(k::square(k::slice(a, 0, i, i + 2, 1))); };
  auto dloss = k::compile(k::grad(loss, k::wrt<0>));
  auto xs = k::to_vector<double>(x);
  for (i = 0; i < 9; ++i) {
    k::Tensor g = dloss(x);
    auto gv = k::to_vector<double>(g);
    REQUIRE(gv.size() == xs.size());
    for (std::size_t j = 0; j < gv.size(); ++j) {
      std::int64_t row = static_cast<std::int64_t>(j) / 6;
      double want = row >= i && row < i + 2 ? 2 * xs[j] : 0.0;
      CHECK(gv[j] == doctest::Approx(want).epsilon(1e-12));
    }
  }
  CHECK(dloss.cache().compiles() == 2);
}
