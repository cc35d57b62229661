// Pointwise kernels reading a transposed input on the GPU stage it through shared-memory tiles
// (codegen/kernel_writer_tiles.hpp): the staging pass reads it along its own contiguous dim, the
// computing pass stores along the output's. Values against the f64 oracle at odd sizes (tiles that
// overhang the domain), in f32 and bf16, batched and 4-D permutes, a strided argument, the same
// buffer read both ways, dynamic sizes and a gradient; the tiling decision itself is checked on
// exported sources, which need no GPU.
#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <unistd.h>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The generated CUDA source of f over args (CPU tensors are enough), through k::export_kernels.
template <class F, class... A>
std::string exported_source(F f, const A&... args) {
  fs::path dir = fs::temp_directory_path() / ("kiln-tiles-test-" + std::to_string(getpid()));
  fs::remove_all(dir);
  auto e = k::export_kernels(f, args..., dir, k::export_options{.arch = "sm_90"});
  std::ifstream in(e.source);
  std::stringstream ss;
  ss << in.rdbuf();
  fs::remove_all(dir);
  return ss.str();
}

// The text that marks a tiled kernel on each target.
std::string tiled_marker(const k::Tensor& t) { return t.device().is_cuda() ? "kiln::stage_put<" : "lanes of the last"; }

template <class F, class... A>
void check_against_oracle(F f, double tol, A... args) {
  auto g = k::compile(f);
  k::Tensor got = g(args...);
  k::Tensor want = k::reference::eval(f(args.to(k::cpu).to(k::f64)...));
  auto r = k::testing::allclose(got.to(k::cpu), want, tol, tol);
  k::report e = k::explain(g, args...);
  INFO(r.str());
  INFO(e);
  CHECK(r);
  const std::string marker = tiled_marker(std::get<0>(std::tuple<A...>(args...)));
  bool tiled = false;
  for (const auto& ki : e.kernels) tiled = tiled || contains(ki.source, marker);
  CHECK_MESSAGE(tiled, "no kernel was tiled for its transposed input");
}

}  // namespace

TEST_CASE("transpose tiles: a transposed input is staged, a contiguous one is not (exported source)") {
  auto x = k::randn({300, 200}, k::f32, k::cpu, 1);
  auto y = k::randn({200, 300}, k::f32, k::cpu, 2);
  std::string t = exported_source([](auto a, auto b) { return k::transpose(a, 0, 1) + b; }, x, y);
  CHECK(contains(t, "kiln::stage_put<TILE, TROWS>(stage0"));
  CHECK(contains(t, "tiles of dims (0, last)"));
  std::string plain = exported_source([](auto a, auto b) { return a * 2.0f + b; }, y, y);
  CHECK_FALSE(contains(plain, "kiln::stage_put<"));
  // A last dim of 3 leaves 29 of a tile's 32 lanes idle, fewer than the untiled f32 loads leave of
  // their sectors (4 of 32 bytes used): kernel_writer_tiles.hpp's rule keeps it untiled.
  auto thin = k::randn({3, 4096}, k::f32, k::cpu, 3);
  std::string narrow = exported_source([](auto a) { return k::transpose(a, 0, 1) * 3.0f; }, thin);
  CHECK_FALSE(contains(narrow, "kiln::stage_put<"));
  // Four transposed bf16 inputs staged as f32 in 64 x 64 tiles (16.3 KiB each) would need 65 KiB of
  // shared memory: two are staged (a third would pass a block's 48 KiB), the others read directly,
  // and the kernel compiles (export runs NVRTC and ptxas).
  auto h = k::randn({200, 300}, k::bf16, k::cpu, 4);
  std::string many = exported_source(
      [](auto a, auto b, auto c, auto d) {
        return k::transpose(a, 0, 1) + k::transpose(b, 0, 1) * k::transpose(c, 0, 1) - k::transpose(d, 0, 1);
      },
      h, k::Tensor(h * 2.0f), k::Tensor(h * 3.0f), k::Tensor(h * 4.0f));
  CHECK(contains(many, "kiln::stage_put<TILE, TROWS>(stage1"));
  CHECK_FALSE(contains(many, "kiln::stage_put<TILE, TROWS>(stage2"));
}

// On the CPU a kernel is tiled when a row of the last dim's lines overflows L1: rows of 1000 and more.
TEST_CASE("transpose tiles: values against the oracle (cpu)") {
  auto x = k::randn({1100, 77}, k::f32, k::cpu, 31);
  auto y = k::randn({77, 1100}, k::f32, k::cpu, 32);
  check_against_oracle([](auto a, auto b) { return k::transpose(a, 0, 1) * 2.0f + b; }, 1e-5, x, y);
  auto xh = x.to(k::bf16), yh = y.to(k::bf16);
  check_against_oracle([](auto a, auto b) { return k::transpose(a, 0, 1) + k::sigmoid(b); }, 1e-2, xh, yh);
  // Batched, dim 1 against the last, with a broadcast bias; an odd row count in every tile.
  auto bx = k::randn({3, 1050, 45}, k::f32, k::cpu, 33);
  auto by = k::randn({3, 45, 1050}, k::f32, k::cpu, 34);
  auto bias = k::randn({1050}, k::f32, k::cpu, 35);
  check_against_oracle([](auto a, auto b, auto c) { return k::permute(a, {0, 2, 1}) - b * c; }, 1e-5, bx, by, bias);
  // x + x^T, and a column-major view of caller-owned memory.
  auto sq = k::randn({1030, 1030}, k::f32, k::cpu, 36);
  check_against_oracle([](auto a) { return a + k::transpose(a, 0, 1); }, 1e-5, sq);
  std::vector<float> storage = k::to_vector<float>(k::randn({1200, 65}, k::f32, k::cpu, 37));
  k::Tensor cm = k::Tensor::wrap(storage.data(), {65, 1200}, k::f32, k::cpu, {1, 65});
  check_against_oracle([](auto a, auto b) { return a * b; }, 1e-5, cm, k::randn({65, 1200}, k::f32, k::cpu, 38));
  // Symbolic sizes, at two shapes.
  auto f = [](auto a, auto b) { return k::transpose(a, 0, 1) + b; };
  auto g = k::compile(f, k::options{.shapes = k::shapes::dynamic});
  for (std::int64_t n : {1025, 1100}) {
    auto a = k::randn({n, 70}, k::f32, k::cpu, 39 + n), b = k::randn({70, n}, k::f32, k::cpu, 40 + n);
    auto r = k::testing::allclose(g(a, b), k::reference::eval(f(a.to(k::f64), b.to(k::f64))), 1e-5, 1e-5);
    CHECK_MESSAGE(bool(r), r);
  }
}

TEST_CASE("transpose tiles: values against the oracle (cuda)" * needs_gpu()) {
  auto dev = k::cuda;
  // 2-D, odd sizes in both dims, f32 and bf16.
  auto x = k::randn({333, 517}, k::f32, k::cpu, 11).to(dev);
  auto y = k::randn({517, 333}, k::f32, k::cpu, 12).to(dev);
  check_against_oracle([](auto a, auto b) { return k::transpose(a, 0, 1) * 2.0f + b; }, 1e-5, x, y);
  auto xh = x.to(k::bf16), yh = y.to(k::bf16);
  check_against_oracle([](auto a, auto b) { return k::transpose(a, 0, 1) + k::sigmoid(b); }, 1e-2, xh, yh);
  // Batched: [3, 45, 70] read as [3, 70, 45], with a broadcast bias.
  auto bx = k::randn({3, 45, 70}, k::f32, k::cpu, 13).to(dev);
  auto by = k::randn({3, 70, 45}, k::f32, k::cpu, 14).to(dev);
  auto bias = k::randn({45}, k::f32, k::cpu, 15).to(dev);
  check_against_oracle([](auto a, auto b, auto c) { return k::permute(a, {0, 2, 1}) - b * c; }, 1e-5, bx, by, bias);
  // 4-D: the input's contiguous dim is the output's dim 1; the tiles' other dims come from zindex.
  auto qx = k::randn({2, 5, 37, 41}, k::f32, k::cpu, 16).to(dev);
  auto qy = k::randn({2, 41, 5, 37}, k::f32, k::cpu, 17).to(dev);
  check_against_oracle([](auto a, auto b) { return k::exp(k::permute(a, {0, 3, 1, 2})) + b; }, 1e-5, qx, qy);
  // The same buffer read both ways: x + x^T.
  auto sq = k::randn({129, 129}, k::f32, k::cpu, 18).to(dev);
  check_against_oracle([](auto a) { return a + k::transpose(a, 0, 1); }, 1e-5, sq);
}

TEST_CASE("transpose tiles: a column-major argument, dynamic sizes and a gradient (cuda)" * needs_gpu()) {
  // A column-major [rows, cols] view of caller-owned memory added to a row-major tensor.
  constexpr std::int64_t rows = 257, cols = 300;
  auto storage = k::randn({cols, rows}, k::f32, k::cpu, 21).to(k::cuda);
  k::Tensor cm = k::Tensor::wrap(storage.data_ptr(), {rows, cols}, k::f32, k::cuda, {1, rows});
  auto y = k::randn({rows, cols}, k::f32, k::cpu, 22).to(k::cuda);
  check_against_oracle([](auto a, auto b) { return a * b; }, 1e-5, cm, y);

  // Symbolic sizes: one kernel source for both shapes, right at each.
  auto f = [](auto a, auto b) { return k::transpose(a, 0, 1) + b; };
  auto g = k::compile(f, k::options{.shapes = k::shapes::dynamic});
  for (std::int64_t n : {97, 161}) {
    auto a = k::randn({n, n + 40}, k::f32, k::cpu, 23 + n).to(k::cuda);
    auto b = k::randn({n + 40, n}, k::f32, k::cpu, 24 + n).to(k::cuda);
    k::Tensor got = g(a, b);
    auto r = k::testing::allclose(got.to(k::cpu), k::reference::eval(f(a.to(k::cpu).to(k::f64), b.to(k::cpu).to(k::f64))),
                                  1e-5, 1e-5);
    INFO(k::explain(g, a, b));
    CHECK_MESSAGE(bool(r), r);
  }

  // d/dx sum(transpose(x) * w) = transpose(w): the backward reads w transposed.
  auto x = k::randn({211, 75}, k::f32, k::cpu, 25).to(k::cuda);
  auto w = k::randn({75, 211}, k::f32, k::cpu, 26).to(k::cuda);
  auto step = k::compile(k::grad([](auto a, auto b) { return k::sum(k::transpose(a, 0, 1) * b); }, k::wrt<0>));
  k::Tensor dx = step(x, w);
  k::Tensor want = k::reference::eval(k::transpose(w.to(k::cpu).to(k::f64), 0, 1));
  auto r = k::testing::allclose(dx.to(k::cpu), want, 1e-6, 1e-6);
  CHECK_MESSAGE(bool(r), r);
}
