// The soak test of issue 16: ten thousand eager and compiled calls over more than a thousand
// distinct shapes, slice bounds, reshapes, strides, every dtype and (with a GPU) both devices, in
// phases as real programs run them. Nothing may throw, the caches never exceed their capacity, a
// sample of results matches the oracle, and resident memory stops growing after the warm-up.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

// Resident set size in bytes (Linux), 0 where unknown.
std::int64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long long pages = 0, resident = 0;
  int n = std::fscanf(f, "%lld %lld", &pages, &resident);
  std::fclose(f);
  return n == 2 ? resident * ::sysconf(_SC_PAGESIZE) : 0;
}

struct Soak {
  std::mt19937_64 rng{20261123};
  std::set<std::tuple<int, std::int64_t, std::int64_t, std::int64_t>> distinct;  // kind, sizes, bound
  int calls = 0, checked = 0;

  std::int64_t size() { return std::uniform_int_distribution<std::int64_t>(2, 41)(rng); }

  void check(const k::Tensor& got, const k::Tensor& want) {
    double tol = got.dtype() == k::bf16 || got.dtype() == k::f16 ? 2e-2 : 1e-5;
    auto r = k::testing::allclose(got.to(k::cpu), want, tol, tol);
    INFO(r.str());
    CHECK(r);
    ++checked;
  }

  // One call of one of five kinds on dtype d, device dev; every 37th is checked against the oracle.
  template <class F, class G>
  void call(int kind, k::dtype d, k::Device dev, F& compiled, G& compiled_slice) {
    bool sample = calls++ % 37 == 0;
    std::int64_t a = size(), b = size();
    k::Tensor x = k::randn({a, b}, k::f32, k::cpu, static_cast<std::uint64_t>(calls)).to(d).to(dev);
    switch (kind) {
      case 0: {  // one row of a matrix at a time
        std::int64_t i = std::uniform_int_distribution<std::int64_t>(0, a - 1)(rng);
        distinct.emplace(kind, a, b, i);
        k::Tensor r = k::sum(k::slice(x, 0, i, i + 1));
        if (sample) check(r, k::reference::eval(k::sum(k::slice(x.to(k::cpu), 0, i, i + 1))));
        break;
      }
      case 1: {  // a view of another shape
        std::int64_t n = a * b, c = n % 3 == 0 ? 3 : n % 2 == 0 ? 2 : 1;
        distinct.emplace(kind, a, b, c);
        k::Tensor r = k::reshape(x, {c, n / c}) + 1;
        if (sample) check(r, k::reference::eval(k::reshape(x.to(k::cpu), {c, n / c}) + 1));
        break;
      }
      case 2: {  // a strided (transposed) input cast for logging
        k::Tensor t = x.as_strided({b, a}, {1, b}, 0);
        distinct.emplace(kind, a, b, 0);
        k::Tensor r = k::cast(t, k::f32);
        if (sample) check(r, k::reference::eval(k::cast(t.to(k::cpu), k::f32)));
        break;
      }
      case 3: {  // a compiled function over changing sizes and dtypes
        distinct.emplace(kind, a, b, static_cast<std::int64_t>(d));
        k::Tensor r = compiled(x);
        if (sample) check(r, k::reference::eval(k::tanh(x.to(k::cpu)) * 2 + 1));
        break;
      }
      default: {  // a compiled function whose captured slice bounds cycle through a few values
        distinct.emplace(kind, a, b, calls % 4);
        k::Tensor r = compiled_slice(x);
        if (sample) check(r, k::reference::eval(k::slice(x.to(k::cpu), 1, calls % 4, b, 1 + calls % 2) * 2));
        break;
      }
    }
  }
};

}  // namespace

TEST_CASE("soak: 10,000 eager and compiled calls over shapes, bounds, views, dtypes and devices") {
  const k::dtype dtypes[] = {k::f32, k::bf16, k::i32, k::f64, k::f16, k::i64, k::boolean};
  std::vector<k::Device> devices = {k::cpu};
  if (k::driver::available()) devices.push_back(k::cuda);
  const int total = 10000;
  Soak s;
  auto compiled = k::compile([](auto x) { return k::tanh(x) * 2 + 1; }, {.recompile_limit = 8});
  auto compiled_slice =
      k::compile([&](auto x) { return k::slice(x, 1, s.calls % 4, 41, 1 + s.calls % 2) * 2; }, {.recompile_limit = 8});
  std::int64_t warm_rss = 0;
  int max_eager = 0;
  std::size_t max_compiled = 0;
  // Two passes over the dtypes (the second revisits programs the budget evicted); 64 calls a phase.
  for (int i = 0; i < total; ++i) {
    int phase = i / 64;
    k::dtype d = dtypes[phase % 7];
    k::Device dev = devices[(phase / 7) % devices.size()];
    int kind = static_cast<int>(s.rng() % 5);
    if (kind >= 3 && d == k::boolean) kind = 0;  // tanh and scaling of booleans promote: kept to the eager kinds
    s.call(kind, d, dev, compiled, compiled_slice);
    max_eager = std::max<int>(max_eager, static_cast<int>(k::runtime::eager_programs()));
    max_compiled = std::max({max_compiled, compiled.cache().size(), compiled_slice.cache().size()});
    if (i == total / 5) warm_rss = resident_bytes();
  }
  k::synchronize();
  std::int64_t growth = resident_bytes() - warm_rss;
  MESSAGE("soak: " << s.calls << " calls, " << s.distinct.size() << " distinct (kind, shape, bound) combinations, "
                   << s.checked << " checked against the oracle; at most " << max_eager << " eager programs (capacity "
                   << k::runtime::eager_capacity() << "), " << max_compiled << " per compiled function; compiles: "
                   << compiled.cache().compiles() << " and " << compiled_slice.cache().compiles()
                   << "; resident memory grew " << growth / (1 << 20) << " MiB after the warm-up");
  CHECK(s.calls == total);
  CHECK(s.distinct.size() >= 1000);
  CHECK(max_eager <= k::runtime::eager_capacity());
  CHECK(max_compiled <= 8);
  CHECK(growth <= 64ll << 20);
}
