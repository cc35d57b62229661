// k::embedding, k::rand_like and k::dropout (API.md "indexing and joining", "randomness"): rows
// read at the ids against values computed here and the oracle, fused into their consumer; the
// table's gradient as a scatter-add computed here, deterministic (the same bits twice, and the same
// bits on the CPU and the GPU), through duplicate ids and sizes that exercise the GPU sort's global
// steps; index checks (a shape_error naming the id and its position, outputs untouched); Philox
// numbers equal to the host's copy, the same on both devices, seeds and offsets as run-time values;
// dropout's mask, scale and gradient (which regenerates the mask).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

// Ids in [0, V), drawn with many repeats of a few hot ids (as tokens are).
std::vector<std::int64_t> random_ids(std::int64_t n, std::int64_t V, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::int64_t> any(0, V - 1), hot(0, 3);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = gen() % 3 == 0 ? hot(gen) : any(gen);
  return ids;
}

// table[ids] computed here, for a row-major [V, D] table.
std::vector<double> rows_at(const std::vector<double>& table, const std::vector<std::int64_t>& ids, std::int64_t D) {
  std::vector<double> out;
  for (auto id : ids)
    for (std::int64_t d = 0; d < D; ++d) out.push_back(table[static_cast<std::size_t>(id * D + d)]);
  return out;
}

void check_embedding_forward(k::Device dev) {
  const std::int64_t V = 97, D = 37;
  k::Tensor table = k::randn({V, D}, k::f32, dev, 11);
  const auto ids = random_ids(3 * 41, V, 5);
  const auto tv = values(table);
  for (k::dtype idt : {k::i64, k::i32}) {
    INFO("ids " << k::name(idt) << " on " << dev);
    k::Tensor id = k::from_vector(ids, {3, 41}, dev).to(idt);
    k::Tensor got = k::embedding(table, id);
    CHECK(got.shape() == std::vector<std::int64_t>{3, 41, D});
    CHECK(got.dtype() == k::f32);
    CHECK(values(got) == rows_at(tv, ids, D));
  }
  // Fused with its consumer (one kernel), a bf16 table, a position table added: against the oracle.
  k::Tensor id = k::from_vector(ids, {3, 41}, dev);
  k::Tensor pos = k::randn({41, D}, k::f32, dev, 12);
  auto fused = k::gelu(k::embedding(table, id) * 2.0f + pos);
  CHECK(k::explain(fused).kernels.size() == 1);
  auto r = k::testing::allclose(k::Tensor(fused), k::reference::eval(fused), 1e-5, 1e-6);
  CHECK_MESSAGE(r, r);
  k::Tensor half = table.to(k::bf16);
  k::Tensor hg = k::embedding(half, id);
  CHECK(hg.dtype() == k::bf16);
  CHECK(values(hg) == rows_at(values(half), ids, D));
  // A transposed table (strided argument) reads the same rows.
  k::Tensor tt = k::Tensor(k::transpose(table, 0, 1)).contiguous();
  CHECK(values(k::Tensor(k::embedding(k::transpose(tt, 0, 1), id))) == rows_at(tv, ids, D));
}

// The table's gradient of sum(embedding(table, ids) * w), computed here in f64.
std::vector<double> scatter_add(const std::vector<std::int64_t>& ids, const std::vector<double>& w, std::int64_t V,
                                std::int64_t D) {
  std::vector<double> out(static_cast<std::size_t>(V * D), 0.0);
  for (std::size_t p = 0; p < ids.size(); ++p)
    for (std::int64_t d = 0; d < D; ++d)
      out[static_cast<std::size_t>(ids[p] * D + d)] += w[p * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)];
  return out;
}

// Gradients of the table for P positions, on dev, twice: returns the first, checks the second is
// the same bits and both are close to the sum computed here.
k::Tensor check_embedding_grad(k::Device dev, std::int64_t P, std::int64_t V, std::int64_t D, k::dtype dt) {
  INFO("P " << P << " V " << V << " D " << D << " " << k::name(dt) << " on " << dev);
  const auto ids = random_ids(P, V, static_cast<unsigned>(P + V));
  k::Tensor id = k::from_vector(ids, {P}, dev);
  k::Tensor table = k::randn({V, D}, k::f32, dev, 21).to(dt);
  k::Tensor w = k::randn({P, D}, k::f32, dev, 22).to(dt);
  auto loss = [](auto t, auto i, auto w) { return k::sum(k::embedding(t, i) * w); };
  auto grad = k::compile(k::grad(loss, k::wrt<0>));
  k::Tensor g1 = grad(table, id, w), g2 = grad(table, id, w);
  CHECK(g1.shape() == std::vector<std::int64_t>{V, D});
  CHECK(g1.dtype() == dt);
  CHECK(values(g1) == values(g2));  // deterministic: the same bits
  auto want = scatter_add(ids, values(w), V, D);
  k::Tensor wt = k::from_vector(want, {V, D}, k::cpu);
  const double tol = dt == k::f32 ? 1e-4 : 2e-2;
  auto r = k::testing::allclose(g1.to(k::cpu).to(k::f64), wt, tol, tol);
  CHECK_MESSAGE(r, r);
  return g1;
}

void check_rand(k::Device dev) {
  k::Tensor x = k::randn({5, 33, 17}, k::f32, dev, 31);
  const std::uint64_t seed = 0xfeedbeef12345ull, offset = 4000000000ull;  // an offset past 2^31
  std::vector<double> r = values(k::Tensor(k::rand_like(x, seed, offset)));
  REQUIRE(r.size() == 5u * 33 * 17);
  for (std::size_t i = 0; i < r.size(); ++i) {
    CHECK(r[i] == k::philox::uniform(seed, offset, i));
    CHECK((r[i] >= 0 && r[i] < 1));
  }
  // An offset shifts the draw; another seed draws other numbers; a large draw is uniform.
  std::vector<double> shifted = values(k::Tensor(k::rand_like(x, seed, offset + 7)));
  for (std::size_t i = 0; i + 7 < r.size(); ++i) CHECK(shifted[i] == r[i + 7]);
  std::vector<double> other = values(k::Tensor(k::rand_like(x, seed + 1, offset)));
  int same = 0;
  for (std::size_t i = 0; i < r.size(); ++i) same += other[i] == r[i];
  CHECK(same < 5);
  k::Tensor big = k::randn({1 << 20}, k::bf16, dev, 32);
  double mean = k::to_vector<float>(k::Tensor(k::mean(k::rand_like(big, 3))))[0];
  CHECK(std::abs(mean - 0.5) < 2e-3);
  // Seeds and offsets are run-time values: a compiled function does not recompile for new ones.
  std::uint64_t s = 1;
  auto f = k::compile([&s](auto t) { return k::rand_like(t, s, s * 1000); },
                      {.recompile_limit = 1, .on_limit = k::on_limit::raise});
  for (s = 1; s < 5; ++s) CHECK(values(f(x))[3] == k::philox::uniform(s, s * 1000, 3));
}

void check_dropout(k::Device dev) {
  const double p = 0.3;
  k::Tensor x = k::randn({61, 129}, k::f32, dev, 41);
  const std::uint64_t seed = 77, offset = 1234;
  std::vector<double> xv = values(x), y = values(k::Tensor(k::dropout(x, p, seed, offset)));
  std::size_t kept = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const bool keep = k::philox::uniform(seed, offset, i) >= p;
    kept += keep;
    CHECK(y[i] == (keep ? static_cast<double>(static_cast<float>(xv[i] * static_cast<float>(1 / (1 - p)))) : 0.0));
  }
  CHECK(std::abs(double(kept) / xv.size() - (1 - p)) < 0.02);
  // The gradient regenerates the mask: d sum(dropout(x) * w) / dx = mask * w / (1 - p).
  k::Tensor w = k::randn({61, 129}, k::f32, dev, 42);
  auto grad = k::compile(k::grad([](auto x, auto w) { return k::sum(k::dropout(x, 0.3, 77, 1234) * w); }, k::wrt<0>));
  std::vector<double> gx = values(grad(x, w)), wv = values(w);
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const bool keep = k::philox::uniform(seed, offset, i) >= p;
    CHECK(gx[i] == doctest::Approx(keep ? wv[i] / (1 - p) : 0.0).epsilon(1e-6));
  }
  // p = 0 is the identity; p = 1 drops everything.
  CHECK(values(k::Tensor(k::dropout(x, 0.0, seed))) == xv);
  for (double v : values(k::Tensor(k::dropout(x, 1.0, seed)))) CHECK(v == 0.0);
}

}  // namespace

TEST_CASE("embedding: rows at i64/i32 ids, fused into its consumer, bf16 and strided tables (cpu)") {
  check_embedding_forward(k::cpu);
}
TEST_CASE("embedding: rows at i64/i32 ids, fused into its consumer, bf16 and strided tables (cuda)" * needs_gpu()) {
  check_embedding_forward(k::cuda);
}

TEST_CASE("embedding: the table's gradient is a deterministic scatter-add (cpu); gradcheck") {
  check_embedding_grad(k::cpu, 300, 13, 7, k::f32);
  check_embedding_grad(k::cpu, 77, 50, 9, k::bf16);
  k::Tensor table = k::randn({6, 4}, k::f64, k::cpu, 51), w = k::randn({2, 5, 4}, k::f64, k::cpu, 52);
  k::Tensor id = k::from_vector(std::vector<std::int64_t>{5, 0, 5, 2, 2, 2, 1, 0, 5, 3}, {2, 5}, k::cpu);
  CHECK(k::testing::gradcheck([](auto t, auto i, auto w) { return k::sum(k::tanh(k::embedding(t, i)) * w); }, table, id,
                              w));
}

TEST_CASE("embedding: the GPU's gradient has the CPU's bits, through the sort's global steps" * needs_gpu()) {
  // P = 5000 pads to 8192 keys: two sort stages cross the 2048-key chunks.
  for (auto [P, V, D] : {std::tuple{300, 13, 7}, std::tuple{5000, 50, 33}, std::tuple{2048, 3000, 64}}) {
    k::Tensor gpu = check_embedding_grad(k::cuda, P, V, D, k::f32);
    k::Tensor cpu = check_embedding_grad(k::cpu, P, V, D, k::f32);
    CHECK(values(gpu) == values(cpu));
  }
  k::Tensor gpu = check_embedding_grad(k::cuda, 777, 41, 19, k::bf16);
  CHECK(values(gpu) == values(check_embedding_grad(k::cpu, 777, 41, 19, k::bf16)));
}

TEST_CASE("embedding: errors name the op, shapes and dtypes; a bad id on the CPU names it and writes nothing") {
  k::Tensor table = k::randn({10, 4}, k::f32, k::cpu, 61);
  CHECK_THROWS_WITH_AS(k::Tensor(k::embedding(table, k::randn({3}, k::f32, k::cpu, 1))),
                       doctest::Contains("embedding: ids must be i64 or i32, got f32"), k::dtype_error);
  CHECK_THROWS_WITH_AS(k::Tensor(k::embedding(k::randn({2, 3, 4}), k::from_vector(std::vector<std::int64_t>{1}, {1}))),
                       doctest::Contains("table must be [V, D], got [2, 3, 4]"), k::shape_error);
  k::Tensor bad = k::from_vector(std::vector<std::int64_t>{1, 2, 3, 10, 4, -1}, {2, 3});
  k::Tensor out = k::full({2, 3, 4}, 7.0, k::f32, k::cpu);
  CHECK_THROWS_WITH_AS(k::eval(out, k::embedding(table, bad) + 1.0f),
                       doctest::Contains("embedding: id 10 at position [1, 0] of ids [2, 3]"), k::shape_error);
  for (double v : values(out)) CHECK(v == 7.0);
  // Ids computed in the same program are checked once they exist.
  auto shifted = k::compile([](auto t, auto i) { return k::embedding(t, i * 2); });
  CHECK_THROWS_WITH_AS(shifted(table, k::from_vector(std::vector<std::int64_t>{1, 5}, {2})),
                       doctest::Contains("id 10 at position [1]"), k::shape_error);
  // Without checks a bad id reads zeros.
  auto unchecked = k::compile([](auto t, auto i) { return k::embedding(t, i); }, {.check_indices = false});
  std::vector<double> got = values(unchecked(table, bad));
  for (int d = 0; d < 4; ++d) CHECK(got[3 * 4 + d] == 0.0);
  CHECK(got[0] == values(table)[4]);
}

TEST_CASE("embedding: on CUDA a bad id reads zeros, or is an error with .check_indices" * needs_gpu()) {
  k::Tensor table = k::randn({10, 4}, k::f32, k::cuda, 62);
  k::Tensor bad = k::from_vector(std::vector<std::int64_t>{1, 2, 3, 10, 4, -1}, {2, 3}, k::cuda);
  std::vector<double> got = values(k::Tensor(k::embedding(table, bad)));
  for (int d = 0; d < 4; ++d) CHECK(got[3 * 4 + d] == 0.0);
  for (int d = 0; d < 4; ++d) CHECK(got[5 * 4 + d] == 0.0);
  auto checked = k::compile([](auto t, auto i) { return k::embedding(t, i); }, {.check_indices = true});
  CHECK_THROWS_WITH_AS(checked(table, bad), doctest::Contains("id 10 at position [1, 0]"), k::shape_error);
}

TEST_CASE("rand_like: Philox numbers of the host's copy, offsets, seeds as run-time values (cpu)") {
  check_rand(k::cpu);
}
TEST_CASE("rand_like: the GPU draws the CPU's numbers (cuda)" * needs_gpu()) { check_rand(k::cuda); }

TEST_CASE("dropout: mask, scale and a gradient that regenerates the mask (cpu)") { check_dropout(k::cpu); }
TEST_CASE("dropout: the GPU's mask is the CPU's (cuda)" * needs_gpu()) {
  check_dropout(k::cuda);
  k::Tensor x = k::randn({1000, 37}, k::bf16, k::cuda, 43);
  CHECK(values(k::Tensor(k::dropout(x, 0.1, 9, 99))) == values(k::Tensor(k::dropout(x.to(k::cpu), 0.1, 9, 99))));
}

TEST_CASE("dropout: p outside [0, 1] is an error naming it") {
  k::Tensor x = k::randn({4}, k::f32, k::cpu, 1);
  CHECK_THROWS_WITH_AS(k::Tensor(k::dropout(x, 1.5, 1)), doctest::Contains("dropout: p must be in [0, 1]"), k::error);
}
