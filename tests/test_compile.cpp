// k::compile's behaviour (API.md "Evaluating", issue 4 "runtime/"): captured scalars are kernel
// arguments, the three shape modes and their recompiles, the recompile limit, one compile under
// concurrent calls, the disk cache surviving a truncated entry, and the typed errors.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <latch>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include "cross_entropy_oracle.hpp"
#include "gradient_oracle.hpp"
#include "scoped_env.hpp"

namespace k = kiln;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

void check_close(const k::Tensor& got, const k::Tensor& want, double rtol = 1e-4, double atol = 1e-5) {
  auto r = k::testing::allclose(got, want, rtol, atol);
  INFO(r.str());
  CHECK(r);
}

std::size_t entries(const auto& f) { return f.cache().entries().size(); }

}  // namespace

// ---- scalars -------------------------------------------------------------------------------------

TEST_CASE("compile: captured scalars change the result without recompiling") {
  double scale = 2.0;
  int shift = 1;
  float floor_at = -0.5f;
  auto f = k::compile([&](auto x) { return k::maximum(x * scale + shift, floor_at); });
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 1);
  check_close(f(x), k::reference::eval(k::maximum(x * 2.0 + 1, -0.5f)));
  std::size_t compiles = k::runtime::host_compile_count();
  scale = -3.5;
  shift = 7;
  floor_at = 4.0f;
  check_close(f(x), k::reference::eval(k::maximum(x * -3.5 + 7, 4.0f)));
  scale = 0.25;
  check_close(f(x), k::reference::eval(k::maximum(x * 0.25 + 7, 4.0f)));
  CHECK(k::runtime::host_compile_count() == compiles);
  k::report r = k::explain(f, x);
  INFO(r);
  CHECK(r.recompiles == 0);
  CHECK(r.recompile_reasons.empty());
  CHECK(entries(f) == 1);
  REQUIRE(r.kernels.size() == 1);
  // The scalars are parameters of the kernel, not literals in its source.
  CHECK_FALSE(contains(r.kernels[0].source, "0.25"));
}

TEST_CASE("compile: eager expressions with different scalar values share one program") {
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 2);
  auto run = [&](float a) {
    k::Tensor y = k::tanh(x) * a;
    return y;
  };
  check_close(run(1.5f), k::reference::eval(k::tanh(x) * 1.5f));
  std::size_t compiles = k::runtime::host_compile_count();
  check_close(run(-4.0f), k::reference::eval(k::tanh(x) * -4.0f));
  check_close(run(0.0f), k::reference::eval(k::tanh(x) * 0.0f));
  CHECK(k::runtime::host_compile_count() == compiles);
  CHECK(k::explain(k::tanh(x) * 2.0f).recompiles == 0);
}

// ---- shape modes -----------------------------------------------------------------------------------

TEST_CASE("compile: shapes::dynamic compiles once for 10 batch sizes") {
  auto fn = [](auto x, auto b) { return k::relu(x * 2 + b) - k::sigmoid(x); };
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
  k::Tensor b = k::randn({129}, k::f32, k::cpu, 3);
  const std::int64_t batches[] = {37, 5, 2, 64, 3, 100, 17, 8, 250, 11};
  k::Tensor x;
  for (std::int64_t n : batches) {
    CAPTURE(n);
    x = k::randn({n, 129}, k::f32, k::cpu, 100 + static_cast<std::uint64_t>(n));
    k::Tensor y = f(x, b);
    CHECK(y.shape() == std::vector<std::int64_t>{n, 129});
    check_close(y, k::reference::eval(fn(x, b)));
  }
  k::report r = k::explain(f, x, b);
  INFO(r);
  CHECK(r.recompiles == 0);
  CHECK(entries(f) == 1);
  REQUIRE(r.kernels.size() == 1);
  // Sizes are kernel arguments s0, s1, ...: the batch is not a literal of the source.
  CHECK(contains(r.kernels[0].source, "s0"));
}

TEST_CASE("compile: shapes::dynamic reductions: changing rows and changing row lengths") {
  auto fn = [](auto x) { return k::softmax(x, -1) + k::sum(x, 1, true); };
  SUBCASE("rows change") {
    auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
    k::Tensor x;
    for (std::int64_t n : {37, 3, 12, 64, 5}) {
      CAPTURE(n);
      x = k::randn({n, 129}, k::f32, k::cpu, 200 + static_cast<std::uint64_t>(n));
      check_close(f(x), k::reference::eval(fn(x)), 1e-4, 1e-4);
    }
    CHECK(k::explain(f, x).recompiles == 0);
  }
  SUBCASE("row length changes") {
    auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
    k::Tensor x;
    for (std::int64_t n : {129, 7, 1000, 33, 2}) {
      CAPTURE(n);
      x = k::randn({37, n}, k::f32, k::cpu, 300 + static_cast<std::uint64_t>(n));
      check_close(f(x), k::reference::eval(fn(x)), 1e-4, 1e-4);
    }
    CHECK(k::explain(f, x).recompiles == 0);
  }
}

// Gradients as a training loop meets them, the batch changing: a mean's or a sum's derivative
// broadcast to the input's shape, a cross_entropy's [N, 1] views and one-hot, the split sums of a
// bias's gradient. Each once named the compiling call's batch, so every new batch compiled again.
TEST_CASE("compile: shapes::dynamic gradients compile once as the batch changes") {
  auto mlp = [](auto x, auto w, auto b) { return k::mean(k::gelu(k::matmul(x, w) + b)); };
  auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
  auto sm = [](auto x) { return k::softmax(x, -1); };
  auto g = k::compile(k::grad(mlp, k::wrt<1, 2>), {.shapes = k::shapes::dynamic});
  auto h = k::compile(k::value_and_grad(ce, k::wrt<0>), {.shapes = k::shapes::dynamic});
  auto v = k::compile(k::vjp(sm, k::wrt<0>), {.shapes = k::shapes::dynamic});  // a sum's expand in its derivative
  // The oracles: each derivative written out by hand, interpreted in f64.
  auto f64 = [](const k::Tensor& t) { return k::Tensor(k::cast(t, k::f64)); };
  auto ev = [](const auto& e) { return k::reference::eval(e); };
  k::Tensor w = k::randn({24, 40}, k::f32, k::cpu, 5), b = k::randn({40}, k::f32, k::cpu, 6);
  for (std::int64_t n : {3000, 37, 5001, 2048, 9}) {
    CAPTURE(n);
    k::Tensor x = k::randn({n, 24}, k::f32, k::cpu, 400 + static_cast<std::uint64_t>(n));
    k::Tensor logits = k::randn({n, 77}, k::f32, k::cpu, 500 + static_cast<std::uint64_t>(n));
    k::Tensor t = k::cast(k::rand({n}, k::f32, k::cpu, 600 + static_cast<std::uint64_t>(n)) * 76.0f, k::i64);
    // mean(gelu(z)), z = x w + b: dz = gelu'(z) / (n * 40), gelu'(z) = Phi(z) + z phi(z).
    k::Tensor z = ev(k::matmul(f64(x), f64(w)) + f64(b));
    k::Tensor dz =
        ev((0.5 * (1.0 + k::erf(z * M_SQRT1_2)) + z * k::exp(-0.5 * z * z) * (0.5 * M_2_SQRTPI * M_SQRT1_2)) /
           static_cast<double>(n * 40));
    auto [dw, db] = g(x, w, b);
    check_close(dw, ev(k::matmul(k::transpose(f64(x), 0, 1), dz)), 1e-4, 1e-5);
    check_close(db, ev(k::sum(dz, 0)), 1e-4, 1e-5);
    // cross_entropy: the mean of logsumexp - the target's logit; d logits = (softmax - one-hot) / n.
    auto [want_loss, want_dl] = cross_entropy_oracle(logits, t);
    auto [loss, dl] = h(logits, t);
    check_close(loss, want_loss, 1e-4, 1e-5);
    check_close(dl, want_dl, 1e-4, 1e-6);
    k::Tensor l64 = f64(logits);
    // softmax's vjp: y (dy - sum(dy y)).
    k::Tensor dy = k::randn({n, 77}, k::f32, k::cpu, 700 + static_cast<std::uint64_t>(n));
    k::Tensor y = ev(k::softmax(l64, 1));
    check_close(v(logits, dy), ev(y * (f64(dy) - k::sum(f64(dy) * y, 1, true))), 1e-4, 1e-6);
  }
  CHECK(g.cache().compiles() == 1);
  CHECK(h.cache().compiles() == 1);
  CHECK(v.cache().compiles() == 1);
}

// The other sizes a gradient or a decomposition names: a cross_entropy's one-hot compares each
// target with the classes' indices, and an argmax takes the least index of a row's maximum; both
// named the compiling call's class count (an iota of it, and the [N, C] view of the summed one-hot),
// so each new vocabulary compiled again and a ninth hit the recompile limit; a var's gradient named
// its row count likewise.
TEST_CASE("compile: shapes::dynamic gradients, argmax, cat and attention compile once as sizes change") {
  auto ce = [](auto logits, auto t) { return k::cross_entropy(logits, t); };
  auto am = [](auto x) { return k::argmax(x, 1); };
  auto h = k::compile(k::value_and_grad(ce, k::wrt<0>), {.shapes = k::shapes::dynamic});
  auto a = k::compile(am, {.shapes = k::shapes::dynamic});
  auto ev = [](const auto& e) { return k::reference::eval(e); };
  for (std::int64_t c : {77, 13, 1000, 250, 3, 4099, 2, 50}) {
    const std::int64_t n = 5 + c % 17;
    CAPTURE(c);
    CAPTURE(n);
    k::Tensor logits = k::randn({n, c}, k::f32, k::cpu, 800 + static_cast<std::uint64_t>(c));
    k::Tensor t =
        k::cast(k::rand({n}, k::f32, k::cpu, 900 + static_cast<std::uint64_t>(c)) * static_cast<float>(c - 1), k::i64);
    auto [want_loss, want_dl] = cross_entropy_oracle(logits, t);
    auto [loss, dl] = h(logits, t);
    check_close(loss, want_loss, 1e-4, 1e-5);
    check_close(dl, want_dl, 1e-4, 1e-6);
    // argmax: the first index of each row's largest value, found by hand.
    const auto lv = k::to_vector<double>(k::Tensor(k::cast(logits, k::f64)));
    std::vector<std::int64_t> want;
    for (std::int64_t r = 0; r < n; ++r) {
      std::int64_t best = 0;
      for (std::int64_t j = 1; j < c; ++j)
        if (lv[r * c + j] > lv[r * c + best]) best = j;
      want.push_back(best);
    }
    CHECK(k::to_vector<std::int64_t>(a(logits)) == want);
  }
  CHECK(h.cache().compiles() == 1);
  CHECK(a.cache().compiles() == 1);
  // A var's gradient broadcast the sum's cotangent to [N] through a division by the degrees of
  // freedom and a view: d/dx sum(var(x, 1)) = 2 (x - mean) / (C - 1), at changing N and C.
  auto v = k::compile(k::grad([](auto x) { return k::sum(k::var(x, 1)); }, k::wrt<0>), {.shapes = k::shapes::dynamic});
  for (auto [n, c] : std::vector<std::pair<std::int64_t, std::int64_t>>{{37, 11}, {5, 18}, {130, 301}, {2, 7}}) {
    CAPTURE(n);
    CAPTURE(c);
    k::Tensor x = k::randn({n, c}, k::f32, k::cpu, 40 + static_cast<std::uint64_t>(n));
    k::Tensor x64 = k::cast(x, k::f64);
    check_close(v(x), ev(2.0 * (x64 - k::mean(x64, 1, true)) / static_cast<double>(c - 1)), 1e-4, 1e-6);
  }
  CHECK(v.cache().compiles() == 1);
  // A cat's padded parts and a slice's gradient are views sized from shape_of nodes: the batch, the
  // joined dim (a growing cache) and the sliced dim all change and one program serves them.
  auto cat = [](auto p, auto q) { return k::cat(1, p, q) * 2.0f; };
  auto c = k::compile(cat, {.shapes = k::shapes::dynamic});
  auto cg = k::compile(
      k::grad([](auto p, auto q) { return k::sum(k::exp(k::cat(1, p, q)) * k::cat(1, p, q)); }, k::wrt<0, 1>),
      {.shapes = k::shapes::dynamic});
  auto sg = k::compile(k::grad([](auto p) { return k::sum(k::exp(k::slice(p, 1, 1, 9, 2))); }, k::wrt<0>),
                       {.shapes = k::shapes::dynamic});
  auto tail = k::compile(k::grad([](auto p) { return k::sum(k::exp(k::slice(p, 1, -4, 1000))); }, k::wrt<0>),
                         {.shapes = k::shapes::dynamic});
  using Sizes = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  for (auto [n, cp, cq] : std::vector<Sizes>{{37, 11, 4}, {5, 12, 7}, {130, 20, 3}, {64, 9, 30}}) {
    CAPTURE(n);
    CAPTURE(cp);
    CAPTURE(cq);
    k::Tensor p = k::randn({n, cp}, k::f32, k::cpu, 50 + static_cast<std::uint64_t>(n));
    k::Tensor q = k::randn({n, cq}, k::f32, k::cpu, 60 + static_cast<std::uint64_t>(n));
    k::Tensor p64 = k::cast(p, k::f64), q64 = k::cast(q, k::f64);
    check_close(c(p, q), ev(k::cat(1, p64, q64) * 2.0), 1e-6, 1e-6);
    auto [dp, dq] = cg(p, q);  // d/dx sum(exp(x) x) = exp(x) (x + 1)
    check_close(dp, ev(k::exp(p64) * (p64 + 1.0)), 1e-5, 1e-6);
    check_close(dq, ev(k::exp(q64) * (q64 + 1.0)), 1e-5, 1e-6);
    // d/dp sum(exp(p[:, 1:9:2])): exp(p) at columns 1, 3, 5, 7, zero elsewhere; of p[:, -4:], at the
    // last four columns.
    std::vector<double> want = k::to_vector<double>(ev(k::exp(p64))), want_tail = want;
    for (std::int64_t i = 0; i < n * cp; ++i) {
      const std::int64_t j = i % cp;
      if (j < 1 || j > 7 || j % 2 == 0) want[static_cast<std::size_t>(i)] = 0;
      if (j < cp - 4) want_tail[static_cast<std::size_t>(i)] = 0;
    }
    check_close(sg(p), k::from_vector(want, {n, cp}), 1e-5, 1e-6);
    check_close(tail(p), k::from_vector(want_tail, {n, cp}), 1e-5, 1e-6);
  }
  CHECK(c.cache().compiles() == 1);
  CHECK(cg.cache().compiles() == 1);
  CHECK(sg.cache().compiles() == 1);
  CHECK(tail.cache().compiles() == 1);
  // An embedding's gradient has the table's rows, read through a shape_of node: the vocabulary and
  // the sequence change, one program. Oracle: each row sums exp of its rows of the output, by hand.
  auto eg = k::compile(k::grad([](auto w, auto t) { return k::sum(k::exp(k::embedding(w, t))); }, k::wrt<0>),
                       {.shapes = k::shapes::dynamic});
  for (auto [v, t] : std::vector<std::pair<std::int64_t, std::int64_t>>{{14, 9}, {32, 17}, {10, 5}, {67, 36}}) {
    CAPTURE(v);
    CAPTURE(t);
    k::Tensor w = k::randn({v, 6}, k::f32, k::cpu, 80 + static_cast<std::uint64_t>(v));
    k::Tensor ids = k::cast(
        k::rand({2, t}, k::f32, k::cpu, 81 + static_cast<std::uint64_t>(t)) * static_cast<float>(v - 1), k::i64);
    const auto wv = k::to_vector<double>(k::Tensor(k::cast(w, k::f64)));
    const auto iv = k::to_vector<std::int64_t>(ids);
    std::vector<double> want(static_cast<std::size_t>(v * 6), 0.0);
    for (std::int64_t id : iv)
      for (std::int64_t d = 0; d < 6; ++d)
        want[static_cast<std::size_t>(id * 6 + d)] += std::exp(wv[static_cast<std::size_t>(id * 6 + d)]);
    check_close(eg(w, ids), k::from_vector(want, {v, 6}), 1e-5, 1e-6);
  }
  CHECK(eg.cache().compiles() == 1);
  // Attention over a changing sequence length (decomposed on the CPU): its [B * H, T, D] views and
  // the causal mask's indices follow the inputs.
  auto att = [](auto q, auto kk, auto vv) { return k::attention(q, kk, vv, {.causal = true}); };
  auto at = k::compile(att, {.shapes = k::shapes::dynamic});
  for (std::int64_t t : {17, 9, 33, 24}) {
    CAPTURE(t);
    auto q = k::randn({2, 3, t, 8}, k::f32, k::cpu, 70 + static_cast<std::uint64_t>(t));
    auto kk = k::randn({2, 3, t, 8}, k::f32, k::cpu, 71 + static_cast<std::uint64_t>(t));
    auto vv = k::randn({2, 3, t, 8}, k::f32, k::cpu, 72 + static_cast<std::uint64_t>(t));
    check_close(at(q, kk, vv), ev(att(q, kk, vv)), 1e-4, 1e-5);
  }
  CHECK(at.cache().compiles() == 1);
  // Its gradient: a full sum's cotangent spread over the [B * H, T, D] products is an expand sized
  // from them. Oracle: the derived gradient evaluated unfused in f64.
  auto loss = [](auto q, auto kk, auto vv) {
    auto o = k::attention(q, kk, vv, {.causal = true});
    return k::sum(o * o);
  };
  auto lg = k::compile(k::grad(loss, k::wrt<0, 1, 2>), {.shapes = k::shapes::dynamic});
  for (std::int64_t t : {17, 9, 33}) {
    CAPTURE(t);
    auto q = k::randn({2, 3, t, 8}, k::f32, k::cpu, 73 + static_cast<std::uint64_t>(t));
    auto kk = k::randn({2, 3, t, 8}, k::f32, k::cpu, 74 + static_cast<std::uint64_t>(t));
    auto vv = k::randn({2, 3, t, 8}, k::f32, k::cpu, 75 + static_cast<std::uint64_t>(t));
    auto [dq, dk, dv] = lg(q, kk, vv);
    auto f64 = [](const k::Tensor& x) { return k::Tensor(k::cast(x, k::f64)); };
    const auto want = oracle_outputs(k::grad(loss, k::wrt<0, 1, 2>), f64(q), f64(kk), f64(vv));  // unfused f64
    const k::Tensor wq = k::reference::to_tensor(want[0]), wk = k::reference::to_tensor(want[1]),
                    wv = k::reference::to_tensor(want[2]);
    check_close(dq, wq, 1e-4, 1e-5);
    check_close(dk, wk, 1e-4, 1e-5);
    check_close(dv, wv, 1e-4, 1e-5);
  }
  CHECK(lg.cache().compiles() == 1);
  // The pipeline's reshapes that take a size from their input (Attrs::input_dim) are negative
  // numbers below -1: a user's reshape may not name one.
  k::Tensor x = k::randn({4, 6}, k::f32, k::cpu, 12);
  CHECK_THROWS_AS(k::reshape(x, {-2, 6}), k::shape_error);
  CHECK_THROWS_WITH(k::reshape(x, {4, -3}), doctest::Contains("reshape: invalid size -3 in [4, -3]"));
}

// numel and iota_of read only their input's shape, so the fuser gives their input no buffer for
// them; a library step (a matmul) writes its result all the same, and needs one. The gradient of a
// mean of a product reads the product only for its count.
TEST_CASE("compile: a gradient that reads a matmul only for its size") {
  auto f = [](auto h, auto w) { return k::mean(k::matmul(h, w)); };
  k::Tensor h = k::randn({6, 5}, k::f32, k::cpu, 1), w = k::randn({5, 7}, k::f32, k::cpu, 2);
  // d/dh mean(h w) = (1 / 42) 1 w^T: each row is w's row sums over 42.
  std::vector<double> want;
  auto wv = k::to_vector<double>(k::Tensor(k::cast(w, k::f64)));
  for (int i = 0; i < 6; ++i)
    for (int r = 0; r < 5; ++r) {
      double s = 0;
      for (int c = 0; c < 7; ++c) s += wv[static_cast<std::size_t>(r * 7 + c)];
      want.push_back(s / 42);
    }
  check_close(k::compile(k::grad(f, k::wrt<0>))(h, w), k::from_vector(want, {6, 5}), 1e-5, 1e-6);
}

// What the run time's clean-up of those sizes must leave alone (rewrite/simplify.hpp, builder.hpp):
// two expands read by one op (each is the other's broadcast), a gradient that adds two broadcast
// cotangents, views of tensors with a zero-sized dim, and an automatic-mode program whose first
// row count is no multiple of its split's chunks.
TEST_CASE("compile: broadcasts kept where an op needs them, zero-sized views, odd first row counts") {
  k::Tensor a = k::randn({4, 1}, k::f32, k::cpu, 7), b = k::randn({4, 1}, k::f32, k::cpu, 8);
  auto two = [](auto p, auto q) { return k::expand(p, {4, 5}) + k::expand(q, {4, 5}); };
  k::Tensor y = k::compile(two)(a, b);
  CHECK(y.shape() == std::vector<std::int64_t>{4, 5});
  check_close(y, k::reference::eval(two(a, b)));
  k::Tensor x = k::randn({8, 5}, k::f32, k::cpu, 9);
  for (auto grad : {k::Tensor(k::compile(k::grad([](auto v) { return k::mean(v) + k::sum(v) * 0.5f; }, k::wrt<0>))(x)),
                    k::Tensor(k::compile(k::grad([](auto v) { return k::sum(v) * k::mean(v); }, k::wrt<0>))(x))})
    CHECK(grad.shape() == std::vector<std::int64_t>{8, 5});
  k::Tensor g1 = k::compile(k::grad([](auto v) { return k::sum(v) * k::mean(v); }, k::wrt<0>))(x);
  const double s = k::to_vector<double>(k::Tensor(k::sum(k::cast(x, k::f64))))[0];
  for (double v : k::to_vector<double>(g1)) CHECK(v == doctest::Approx(2 * s / 40).epsilon(1e-5));
  k::Tensor z = k::randn({4, 0, 3}, k::f32, k::cpu, 10);
  CHECK(k::Tensor(k::compile([](auto v) {
          return k::reshape(v, {4, 0});
        })(z))
            .shape() == std::vector<std::int64_t>{4, 0});
  CHECK(k::Tensor(k::compile([](auto v) {
          return k::unsqueeze(k::reshape(v, {4, 0}), 1);
        })(z))
            .shape() == std::vector<std::int64_t>{4, 1, 0});
  auto colsum = [](auto v) { return k::sum(v, 0); };
  auto f = k::compile(colsum);  // automatic: static, then the row count symbolic
  for (std::int64_t n : {3001, 5000, 6007, 9000}) {
    CAPTURE(n);
    k::Tensor r = k::randn({n, 40}, k::f32, k::cpu, 11 + static_cast<std::uint64_t>(n));
    check_close(f(r), k::reference::eval(colsum(k::cast(r, k::f64))), 1e-4, 1e-3);
  }
  CHECK(f.cache().compiles() == 2);
}

TEST_CASE("compile: shapes::automatic recompiles once at the second shape, then never") {
  auto fn = [](auto x, auto b) { return k::gelu(x + b) * 0.5f; };
  auto f = k::compile(fn);  // automatic is the default
  k::Tensor b = k::randn({129}, k::f32, k::cpu, 4);
  k::Tensor x8 = k::randn({8, 129}, k::f32, k::cpu, 5), x16 = k::randn({16, 129}, k::f32, k::cpu, 6),
            x24 = k::randn({24, 129}, k::f32, k::cpu, 7), x3 = k::randn({3, 129}, k::f32, k::cpu, 8);
  check_close(f(x8, b), k::reference::eval(fn(x8, b)));
  k::report r = k::explain(f, x8, b);
  CHECK(r.recompiles == 0);
  // The first compile is static: the batch is a literal.
  REQUIRE(r.kernels.size() == 1);
  CHECK_FALSE(contains(r.kernels[0].source, "s0"));

  check_close(f(x16, b), k::reference::eval(fn(x16, b)));
  r = k::explain(f, x16, b);
  INFO(r);
  CHECK(r.recompiles == 1);
  REQUIRE(r.recompile_reasons.size() == 1);
  // The reason names the guard that failed: the first argument's shape.
  CHECK(contains(r.recompile_reasons[0], "args[0].shape"));
  CHECK(contains(r.recompile_reasons[0], "8"));

  check_close(f(x24, b), k::reference::eval(fn(x24, b)));
  check_close(f(x3, b), k::reference::eval(fn(x3, b)));
  check_close(f(x8, b), k::reference::eval(fn(x8, b)));
  r = k::explain(f, x24, b);
  CHECK(r.recompiles == 1);
  CHECK(r.recompile_reasons.size() == 1);
  CHECK(entries(f) == 2);
}

TEST_CASE("compile: a changed dtype recompiles and says so") {
  auto f = k::compile([](auto x) { return k::exp(x) - 1; });
  k::Tensor a = k::randn({37, 129}, k::f32, k::cpu, 9), h = k::randn({37, 129}, k::f16, k::cpu, 9);
  check_close(f(a), k::reference::eval(k::exp(a) - 1));
  k::Tensor y = f(h);
  CHECK(y.dtype() == k::f16);
  check_close(y, k::reference::eval(k::exp(h) - 1), 1e-2, 1e-2);
  k::report r = k::explain(f, h);
  CHECK(r.recompiles == 1);
  REQUIRE(r.recompile_reasons.size() == 1);
  CHECK(contains(r.recompile_reasons[0], "args[0].dtype"));
}

TEST_CASE("compile: on_limit::raise throws recompile_limit_error at the limit, naming the guard") {
  auto fn = [](auto x) { return k::tanh(x) + 1; };
  auto f = k::compile(fn, {.shapes = k::shapes::static_, .recompile_limit = 3, .on_limit = k::on_limit::raise});
  for (std::int64_t n : {5, 6, 7}) {
    k::Tensor x = k::randn({n, 13}, k::f32, k::cpu, 10);
    check_close(f(x), k::reference::eval(fn(x)));
  }
  CHECK(entries(f) == 3);
  k::Tensor x8 = k::randn({8, 13}, k::f32, k::cpu, 11);
  CHECK_THROWS_AS(f(x8), k::recompile_limit_error);
  try {
    f(x8);
    FAIL("expected a recompile_limit_error");
  } catch (const k::recompile_limit_error& e) {
    std::string what = e.what();
    INFO(what);
    CHECK(contains(what, "3"));
    CHECK(contains(what, "args[0].shape"));
  }
  // Nothing was half-compiled, and the shapes seen before still replay.
  CHECK(entries(f) == 3);
  k::Tensor x6 = k::randn({6, 13}, k::f32, k::cpu, 12);
  check_close(f(x6), k::reference::eval(fn(x6)));
  // A recompile_limit_error is a k::error.
  CHECK_THROWS_AS(f(x8), k::error);
}

TEST_CASE("compile: shapes::dynamic with views, broadcasting and reductions over the changing dim") {
  // The batch is a symbol s0 in slices, permutes, broadcasts and in the length of reduced rows.
  auto fn = [](auto x, auto w) {
    auto xs = k::slice(x, 1, 1, 12, 2);                // [n, 6]
    auto col = k::softmax(k::permute(xs, {1, 0}), 1);  // [6, n], rows of the changing length n
    auto row = k::sum(xs * w, 1, true);                // [n, 1]
    return k::permute(col, {1, 0}) * k::sigmoid(row) + k::amax(xs, 0);
  };
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
  k::Tensor w = k::randn({6}, k::f32, k::cpu, 20);
  k::Tensor x;
  for (std::int64_t n : {9, 4, 31, 2, 130}) {
    CAPTURE(n);
    x = k::randn({n, 13}, k::f32, k::cpu, 500 + static_cast<std::uint64_t>(n));
    k::Tensor y = f(x, w);
    CHECK(y.shape() == std::vector<std::int64_t>{n, 6});
    check_close(y, k::reference::eval(fn(x, w)), 1e-4, 1e-5);
  }
  k::report r = k::explain(f, x, w);
  INFO(r);
  CHECK(r.recompiles == 0);
}

// A start counted from the end (x[:, -3:]) moves with the row's length: with that length symbolic
// it is a kernel argument of each call, not the compiling call's position.
TEST_CASE("compile: a slice from the end serves rows of every length") {
  auto fn = [](auto x) { return k::slice(x, 1, -3, 1000) * 2.0f + k::slice(x, 1, 0, 3); };
  for (auto mode : {k::shapes::dynamic, k::shapes::automatic}) {
    auto f = k::compile(fn, {.shapes = mode});
    for (std::int64_t n : {7, 11, 20, 6}) {
      CAPTURE(n);
      k::Tensor x = k::randn({3, n}, k::f32, k::cpu, 30 + static_cast<std::uint64_t>(n));
      std::vector<double> xv = k::to_vector<double>(k::Tensor(k::cast(x, k::f64))), want;
      for (std::int64_t i = 0; i < 3; ++i)
        for (std::int64_t j = 0; j < 3; ++j)
          want.push_back(2 * xv[static_cast<std::size_t>(i * n + n - 3 + j)] + xv[static_cast<std::size_t>(i * n + j)]);
      check_close(f(x), k::from_vector(want, {3, 3}), 1e-6, 1e-6);
    }
    CHECK(f.cache().compiles() == (mode == k::shapes::dynamic ? 1 : 2));
  }
}

TEST_CASE("compile: shapes::dynamic specialises size 1 with its own program, and comes back") {
  auto fn = [](auto x) { return k::softmax(x, -1) * 2; };
  auto f = k::compile(fn, {.shapes = k::shapes::dynamic});
  for (std::int64_t n : {4, 1, 9, 1, 30}) {
    CAPTURE(n);
    k::Tensor x = k::randn({n, 33}, k::f32, k::cpu, 400 + static_cast<std::uint64_t>(n));
    check_close(f(x), k::reference::eval(fn(x)));
  }
  // One program for the symbolic batch, one for the batch of 1.
  k::report r = k::explain(f, k::randn({12, 33}, k::f32, k::cpu, 1));
  INFO(r);
  CHECK(r.recompiles == 1);
  CHECK(entries(f) == 2);
}

TEST_CASE("compile: empty tensors and rank-0 tensors") {
  // PyTorch evaluates these: ops on a [0, 5] tensor give empty results, a sum over an empty dim
  // gives zeros, and rank-0 tensors behave like any other.
  k::Tensor z = k::randn({0, 5}, k::f32, k::cpu, 1);
  auto no_throw = [](const char* what, auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      FAIL_CHECK(std::string(what) << " threw: " << std::string(e.what()));
    }
  };
  no_throw("exp of a [0, 5] tensor", [&] {
    k::Tensor y = k::exp(z);
    CHECK(y.shape() == std::vector<std::int64_t>{0, 5});
  });
  no_throw("sum over dim 1 of a [0, 5] tensor", [&] {
    k::Tensor y = k::sum(z, 1);
    CHECK(y.shape() == std::vector<std::int64_t>{0});
  });
  no_throw("sum over dim 0 of a [0, 5] tensor", [&] {
    k::Tensor y = k::sum(z, 0);
    CHECK(k::to_vector<float>(y) == std::vector<float>(5, 0.0f));
  });
  no_throw("a compiled function called with a batch of 0", [&] {
    auto f = k::compile([](auto a) { return a * 2 + 1; });
    CHECK(f(z).shape() == std::vector<std::int64_t>{0, 5});
  });
  no_throw("softmax and log_softmax over an empty dim", [&] {  // their shifting amax reads no element
    k::Tensor y = k::softmax(z, 0) + k::log_softmax(z, 0);
    CHECK(y.shape() == std::vector<std::int64_t>{0, 5});
    k::Tensor w = k::randn({3, 0, 2}, k::f32, k::cpu, 3);
    CHECK(k::Tensor(k::softmax(w, 1) * 2).shape() == std::vector<std::int64_t>{3, 0, 2});
  });
  CHECK_THROWS_AS(k::Tensor(k::amax(z, 0)), k::shape_error);  // as torch.amax: no identity to return
  k::Tensor s = k::full({}, 3.0, k::f32);
  k::Tensor x = k::randn({7, 13}, k::f32, k::cpu, 2);
  no_throw("rank-0 tensors", [&] {
    k::Tensor y = s * 2 + 1;
    CHECK(y.shape() == std::vector<std::int64_t>{});
    CHECK(k::to_vector<float>(y) == std::vector<float>{7.0f});
    check_close(k::Tensor(x * s), k::reference::eval(x * 3.0f));
    check_close(k::Tensor(k::sum(x) + s), k::reference::eval(k::sum(x) + 3.0f), 1e-5, 1e-5);
  });
}

// ---- concurrency ------------------------------------------------------------------------------------

TEST_CASE("compile: 8 threads x 1000 calls of one compiled function compile once") {
  auto fn = [](auto x, auto y) { return k::sigmoid(x * y) - k::abs(y) * 0.125f; };
  auto f = k::compile(fn);
  k::Tensor x = k::randn({7, 13}, k::f32, k::cpu, 13), y = k::randn({7, 13}, k::f32, k::cpu, 14);
  const std::vector<double> want = k::reference::read(k::reference::eval(fn(x, y))).data;
  constexpr int threads = 8, calls = 1000;
  std::latch start(threads);
  std::atomic<int> wrong{0}, failures{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      start.arrive_and_wait();  // all threads ask for the first compile together
      for (int i = 0; i < calls; ++i) {
        try {
          k::Tensor out = f(x, y);
          std::vector<float> got = k::to_vector<float>(out);
          for (std::size_t j = 0; j < want.size(); ++j)
            if (!(std::abs(got[j] - want[j]) <= 1e-5 + 1e-4 * std::abs(want[j]))) {
              ++wrong;
              break;
            }
        } catch (...) {
          ++failures;
        }
      }
    });
  for (auto& th : pool) th.join();
  CHECK(failures == 0);
  CHECK(wrong == 0);
  CHECK(entries(f) == 1);
  CHECK(k::explain(f, x, y).recompiles == 0);
}

// ---- the disk cache ------------------------------------------------------------------------------------

TEST_CASE("compile: a truncated disk-cache entry is a miss: rebuilt, stored again, and correct") {
  auto& disk = k::runtime::default_disk_cache();
  if (!disk.enabled()) {
    MESSAGE("no disk cache directory (KILN_CACHE_DIR, XDG_CACHE_HOME and HOME unset): skipped");
    return;
  }
  // A size unique to this process: a static source that earlier runs are unlikely to have cached.
  const std::int64_t n = 5000 + ::getpid() % 50000;
  auto fn = [](auto x) { return k::sigmoid(x) * x; };  // no scalars: run below binds only x
  auto f = k::compile(fn, {.shapes = k::shapes::static_});
  k::Tensor x = k::randn({n}, k::f32, k::cpu, 15);
  check_close(f(x), k::reference::eval(fn(x)));
  auto entry = f.cache().entries().at(0);
  const k::runtime::Program& p = *entry->program;
  REQUIRE(p.device.is_cpu());

  // The translation unit exactly as runtime::compile_program builds it, and its cache entry.
  REQUIRE(p.kernels.size() == 1);
  const k::runtime::KernelUnit unit = k::runtime::kernel_unit(p.kernels[0].src, true);
  const std::string& tu = unit.source;
  const std::string& name = unit.name;
  const std::string key = k::runtime::hex(k::runtime::detail::shared_object_key(tu));
  const fs::path path = disk.entry_path(key, "so");
  INFO("cache entry " << path);
  // If this fails, compile_program changed how it assembles the TU: update the lines above.
  REQUIRE(fs::exists(path));
  const auto size = fs::file_size(path);
  REQUIRE(size > 100);
  fs::resize_file(path, size / 2);

  std::size_t compiles = k::runtime::host_compile_count();
  std::vector<char> bytes = k::runtime::build_shared_object(tu, name);
  CHECK(k::runtime::host_compile_count() == compiles + 1);  // the truncated entry was a miss
  auto stored = disk.load(key, "so");
  REQUIRE(stored.has_value());  // and a whole entry replaced it
  CHECK(*stored == bytes);
  compiles = k::runtime::host_compile_count();
  CHECK(k::runtime::build_shared_object(tu, name) == bytes);  // a hit now
  CHECK(k::runtime::host_compile_count() == compiles);

  // The rebuilt object runs the program and gives the right values.
  k::runtime::Program again = p;
  again.objects = {k::runtime::load_shared_object(bytes, name)};
  again.kernels[0].cpu =
      reinterpret_cast<void (*)(void**, std::int64_t)>(again.objects[0]->symbol((name + "_cpu").c_str()));
  const k::Tensor* args[] = {&x};
  double scalars[1] = {0};
  k::Tensor out[1];
  again.run(
      args, scalars, out, [&](int node) -> const k::Dims& { return again.graph[node].shape; }, nullptr);
  REQUIRE(out[0].defined());
  check_close(out[0], k::reference::eval(fn(x)));
}

// ---- the host compiler ------------------------------------------------------------------------------------

TEST_CASE("compile: the libmvec probe: glibc's level where it builds and computes right, none with KILN_LIBMVEC=0") {
  const auto& t = k::runtime::detail::toolchain();
  std::vector<std::string> argv = t.cxx;
  for (const std::string& f : t.flags)  // the kernels' flags before the probe's decision
    if (f.rfind("-DKILN_LIBMVEC", 0) != 0) argv.push_back(f);
  const k::runtime::Digest key = k::runtime::hash128("test_compile libmvec probe");
  const int offered = k::runtime::detail::libmvec_offered();
  MESSAGE("glibc offers libmvec level " << offered << "; the toolchain took " << t.libmvec);
  CHECK(k::runtime::detail::probe_libmvec(argv, key, t.gcc) == (t.gcc ? offered : 0));
  CHECK(k::runtime::detail::probe_libmvec(argv, key, false) == 0);  // GCC's attribute syntax only
  {
    ScopedEnv off("KILN_LIBMVEC", "0");
    CHECK(k::runtime::detail::libmvec_offered() == 0);
    CHECK(k::runtime::detail::probe_libmvec(argv, key, t.gcc) == 0);
  }
  {
    ScopedEnv cap("KILN_LIBMVEC", "1");  // glibc 2.22's functions only
    CHECK(k::runtime::detail::libmvec_offered() == std::min(offered, 1));
    CHECK(k::runtime::detail::probe_libmvec(argv, key, t.gcc) == (t.gcc ? std::min(offered, 1) : 0));
  }
  if (offered > 0) {  // a probe that does not build (here: does not link) gives 0, not an error
    std::vector<std::string> bad = argv;
    bad.push_back("-lkiln_no_such_library");
    CHECK(k::runtime::detail::probe_libmvec(bad, k::runtime::hash128("test_compile broken libmvec probe"), t.gcc) == 0);
  }
}

TEST_CASE("compile: host row kernels are built without GCC's loop if-conversion, pointwise ones with it") {
  // Row kernels carry the option in their own text (so it is part of their cache key); pointwise
  // kernels need the pass to vectorise a select (relu), NOTES items 102 and 135.
  auto unit_of = [](auto fn, const k::Tensor& x) {
    auto f = k::compile(fn, {.shapes = k::shapes::static_});
    check_close(f(x), k::reference::eval(fn(x)));
    const k::runtime::Program& p = *f.cache().entries().at(0)->program;
    REQUIRE(p.kernels.size() == 1);
    return k::runtime::kernel_unit(p.kernels[0].src, true).source;
  };
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 16);
  const std::string row = unit_of([](auto v) { return k::softmax(v, -1); }, x);
  const std::string poi = unit_of([](auto v) { return k::relu(v * 2.0f + 1.0f); }, x);
  CHECK(row.rfind(std::string(k::runtime::host_row_options), 0) == 0);  // first, before the prelude
  CHECK(poi.find("#pragma GCC optimize") == std::string::npos);
}


TEST_CASE("compile: a bad host compiler or bad generated code is a compile_error") {
  SUBCASE("KILN_CXX naming no executable") {
    // The toolchain is found once per process (the first compile), so the search itself is
    // tested: what a process started with this KILN_CXX meets at its first compile.
    ScopedEnv cxx("KILN_CXX", "/nonexistent/kiln-c++");
    try {
      k::runtime::detail::find_host_compiler();
      FAIL("expected a compile_error");
    } catch (const k::compile_error& e) {
      CHECK(contains(e.what(), "KILN_CXX"));
      CHECK(contains(e.what(), "/nonexistent/kiln-c++"));
    }
  }
  SUBCASE("source that does not compile: the command, the log and the source path") {
    k::runtime::DiskCache no_cache;  // disabled: always a real compile
    const std::string source =
        "// kiln test " + std::to_string(::getpid()) + "\nextern \"C\" void kiln_broken( { return }\n";
    try {
      k::runtime::build_shared_object(source, "kiln_broken", no_cache);
      FAIL("expected a compile_error");
    } catch (const k::compile_error& e) {
      INFO(std::string(e.what()));
      CHECK(contains(e.what(), k::runtime::host_compiler_command()));
      CHECK_FALSE(e.log.empty());
      CHECK(contains(e.what(), e.log));
      CHECK_FALSE(e.source_path.empty());
      CHECK(contains(e.what(), e.source_path));
      std::error_code ec;
      if (fs::exists(e.source_path) && fs::path(e.source_path).parent_path().filename().string().rfind("kiln-", 0) == 0)
        fs::remove_all(fs::path(e.source_path).parent_path(), ec);
    }
  }
}

// ---- errors ------------------------------------------------------------------------------------------------

TEST_CASE("errors: a shape mismatch is a shape_error naming both shapes, and out is left untouched") {
  k::Tensor x = k::randn({37, 129}, k::f32, k::cpu, 16), y = k::randn({37, 128}, k::f32, k::cpu, 17);
  k::Tensor out = k::full({37, 129}, 7.25, k::f32);
  auto untouched = [&] {
    std::vector<float> v = k::to_vector<float>(out);
    return std::all_of(v.begin(), v.end(), [](float e) { return e == 7.25f; });
  };
  try {
    k::eval(out, x + y);
    FAIL("expected a shape_error");
  } catch (const k::shape_error& e) {
    INFO(std::string(e.what()));
    CHECK(contains(e.what(), "[37, 129]"));
    CHECK(contains(e.what(), "[37, 128]"));
  }
  CHECK(untouched());

  // out of the wrong shape for a valid expression
  k::Tensor small = k::full({37, 128}, 7.25, k::f32);
  try {
    k::eval(small, x * 2);
    FAIL("expected a shape_error");
  } catch (const k::shape_error& e) {
    INFO(std::string(e.what()));
    CHECK(contains(e.what(), "[37, 129]"));
    CHECK(contains(e.what(), "[37, 128]"));
  }
  std::vector<float> s = k::to_vector<float>(small);
  CHECK(std::all_of(s.begin(), s.end(), [](float e) { return e == 7.25f; }));

  // A reduction over a dim that does not exist.
  CHECK_THROWS_AS(k::eval(out, k::sum(x, 2, true) + x), k::shape_error);
  CHECK(untouched());

  // The same through k::compile and through `Tensor y = expr`.
  auto f = k::compile([](auto a, auto b) { return a * b; });
  CHECK_THROWS_AS(f(x, y), k::shape_error);
  CHECK_THROWS_AS(k::Tensor(x - y), k::shape_error);

  // And a good evaluation into out afterwards still works (nothing cached in a bad state).
  k::eval(out, x * 2);
  check_close(out, k::reference::eval(x * 2));
}

TEST_CASE("errors: a dtype_error for a non-boolean condition") {
  k::Tensor x = k::randn({7, 13}, k::f32, k::cpu, 18);
  k::Tensor out = k::full({7, 13}, -1.0, k::f32);
  CHECK_THROWS_AS(k::eval(out, k::where(x, x, 0.0f)), k::dtype_error);
  std::vector<float> v = k::to_vector<float>(out);
  CHECK(std::all_of(v.begin(), v.end(), [](float e) { return e == -1.0f; }));
}

TEST_CASE("errors: devices") {
  if (!k::driver::available()) {
    // Without a GPU (CI) a CUDA tensor cannot even be made: that is the device_error.
    CHECK_THROWS_AS(k::randn({7, 13}, k::f32, k::cuda, 1), k::device_error);
    CHECK_THROWS_AS(k::zeros({7, 13}, k::f32, k::cuda(1)), k::device_error);
    CHECK_THROWS_AS(k::randn({7, 13}, k::f32, k::cpu, 1).to(k::cuda), k::device_error);
    MESSAGE("no CUDA device: mixing CPU and CUDA tensors is tested on GPU machines only");
    return;
  }
  k::Tensor a = k::randn({7, 13}, k::f32, k::cpu, 1);
  k::Tensor b = k::randn({7, 13}, k::f32, k::cuda, 2);
  try {
    k::Tensor c = a + b;
    FAIL("expected a device_error");
  } catch (const k::device_error& e) {
    INFO(std::string(e.what()));
    CHECK(contains(e.what(), "cpu"));
    CHECK(contains(e.what(), "cuda:0"));
  }
  auto f = k::compile([](auto x, auto y) { return x * y; });
  CHECK_THROWS_AS(f(a, b), k::device_error);
}
