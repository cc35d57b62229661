// Host pointwise kernels with an operand broadcast along the leading dims walk rows by column tiles
// (codegen/kernel_writer_columns.hpp). Values against the f64 oracle for biases over 2-D and 3-D
// domains (a bias [C], a row [1, C], a [B, 1, C] operand), f32 and bf16, in-place and chained
// with special functions, rows that do not fill the last program; which kernels take the form is
// checked on k::explain's sources (no broadcast, a last dim off the tile's lanes, or too few column
// tiles keep the flat walk).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;

namespace {

constexpr const char* marker = "KILN_COLUMN_TILES(xrow";

// Runs f compiled on the CPU, compares with the oracle, and says whether a kernel used column tiles.
template <class F, class... A>
bool run_and_check(F f, double tol, A... args) {
  auto g = k::compile(f);
  k::Tensor got = g(args...);
  k::Tensor want = k::reference::eval(f(k::Tensor(args.to(k::f64))...));
  auto r = k::testing::allclose(got, want, tol, tol);
  k::report e = k::explain(g, args...);
  INFO(r.str());
  INFO(e);
  CHECK(r);
  bool columns = false;
  for (const auto& ki : e.kernels)
    if (ki.source.find(marker) != std::string::npos) {
      columns = true;
      // One source, two targets: the host's form also compiles for a GPU (NVRTC needs no device).
      std::vector<char> bin;
      CHECK_NOTHROW(bin = k::cubin(ki, "sm_90a"));
      CHECK(bin.size() > 4);
    }
  return columns;
}

}  // namespace

TEST_CASE("column tiles: biases broadcast along the leading dims, against the oracle") {
  // 37 rows (a last program short of rows), 272 = 17 tiles of 16 columns.
  auto x = k::randn({37, 272}, k::f32, k::cpu, 1);
  auto b = k::randn({272}, k::f32, k::cpu, 2);
  CHECK(run_and_check([](auto a, auto c) { return a + c; }, 1e-6, x, b));
  CHECK(run_and_check([](auto a, auto c) { return k::gelu(a * 0.5f + c); }, 1e-5, x, b));
  auto row = k::randn({1, 272}, k::f32, k::cpu, 3);
  CHECK(run_and_check([](auto a, auto c, auto d) { return k::tanh(a - c) * d; }, 1e-5, x, row, b));
  // 3-D: [5, 7, 512] with a [5, 1, 512] operand and a bias.
  auto x3 = k::randn({5, 7, 512}, k::f32, k::cpu, 4);
  auto mid = k::randn({5, 1, 512}, k::f32, k::cpu, 5);
  auto b3 = k::randn({512}, k::f32, k::cpu, 6);
  CHECK(run_and_check([](auto a, auto m, auto c) { return k::sigmoid(a * m) + c; }, 1e-5, x3, mid, b3));
  // bf16 storage, f32 compute.
  auto xh = k::randn({33, 256}, k::bf16, k::cpu, 7);
  auto bh = k::randn({256}, k::bf16, k::cpu, 8);
  CHECK(run_and_check([](auto a, auto c) { return k::relu(a + c); }, 1e-2, xh, bh));
}

TEST_CASE("column tiles: kernels without a broadcast, or with short or ragged rows, keep the flat walk") {
  auto x = k::randn({37, 272}, k::f32, k::cpu, 11), y = k::randn({37, 272}, k::f32, k::cpu, 12);
  CHECK_FALSE(run_and_check([](auto a, auto c) { return a * c + 1.0f; }, 1e-6, x, y));
  auto ragged = k::randn({37, 270}, k::f32, k::cpu, 13);  // 270: not whole tiles of 16
  CHECK_FALSE(run_and_check([](auto a, auto c) { return a + c; }, 1e-6, ragged, k::randn({270}, k::f32, k::cpu, 14)));
  auto narrow = k::randn({300, 64}, k::f32, k::cpu, 15);  // 4 tiles a row: fewer than a vector's lanes
  CHECK_FALSE(run_and_check([](auto a, auto c) { return a + c; }, 1e-6, narrow, k::randn({64}, k::f32, k::cpu, 16)));
}
