// A k::grad / value_and_grad / vjp called inside another function (API.md "Models": a compiled
// function callable inside another): a training step, gradient and update, as one program. Checked
// against the same gradients computed by a call of their own (two programs), against the f64
// oracle, through finite differences of a function that takes a gradient inside, and for the
// semantics a user expects: a wrt argument is an independent input (nothing flows into what the
// caller computed it from), an argument the value does not read gets zeros, a gradient of a
// gradient is the second derivative.
#include <doctest/doctest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

#include "cuda_plan.hpp"
#include "have_gpu.hpp"

namespace k = kiln;

namespace {

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

auto mlp_loss = [](auto p, auto x) {
  auto h = k::gelu(k::matmul(x, p[0]) + p[1]);
  return k::mean(k::square(k::matmul(h, p[2]) + p[3]));
};

std::vector<k::Tensor> mlp_params(k::Device dev) {
  return {k::randn({13, 37}, k::f32, dev, 1), k::randn({37}, k::f32, dev, 2), k::randn({37, 5}, k::f32, dev, 3),
          k::randn({5}, k::f32, dev, 4)};
}

std::vector<k::Tensor> copies(const std::vector<k::Tensor>& ts) {
  std::vector<k::Tensor> out;
  for (const auto& t : ts) out.push_back(k::from_vector(values(t), t.shape(), t.dtype(), t.device()));
  return out;
}

// Three SGD steps as one program (the gradient inside) and as two (gradient, then update): the
// parameters and losses agree at every step.
void check_sgd(k::Device dev) {
  auto ps = mlp_params(dev), ref = copies(ps);
  k::Tensor x = k::randn({29, 13}, k::f32, dev, 5);
  const float lr = 0.1f;
  auto vg = k::compile(k::value_and_grad(mlp_loss, k::wrt<0>));
  auto sgd = [lr](const auto& p, const auto& g) {
    auto one = [&](std::size_t i) { return k::assign(p[i], p[i] - lr * g[i]); };
    std::vector<decltype(one(0))> out;
    for (std::size_t i = 0; i < p.size(); ++i) out.push_back(one(i));
    return out;
  };
  auto step = k::compile([&vg, sgd](auto p, auto x) {
    auto [loss, g] = vg(p, x);
    static_assert(std::is_same_v<decltype(g), std::vector<k::expression>>);
    return std::make_tuple(loss, sgd(p, g));
  });
  auto update = k::compile([sgd](auto p, auto g) { return sgd(p, g); });
  for (int s = 0; s < 3; ++s) {
    INFO("step " << s << " on " << dev);
    std::vector<k::Tensor> out = step(ps, x);
    REQUIRE(out.size() == 5);
    auto [loss_ref, g_ref] = vg(ref, x);
    update(ref, g_ref);
    CHECK(values(out[0])[0] == doctest::Approx(values(loss_ref)[0]).epsilon(1e-5));
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto close = k::testing::allclose(ps[i], ref[i], 1e-5, 1e-6);
      CHECK_MESSAGE(close, "parameter " << i << ": " << close);
    }
  }
  CHECK(step.cache().size() == 1);  // one program for every step
}

}  // namespace

TEST_CASE("inner gradients: an SGD step with its gradient inside is one program and matches two") { check_sgd(k::cpu); }
TEST_CASE("inner gradients: the same on the GPU (cuda)" * needs_gpu()) { check_sgd(k::cuda); }

TEST_CASE("inner gradients: value_and_grad as expressions equals a call with tensors and the f64 oracle") {
  k::Tensor w = k::randn({7, 3}, k::f32, k::cpu, 11), x = k::randn({5, 7}, k::f32, k::cpu, 12);
  auto f = [](auto w, auto x) { return k::sum(k::tanh(k::matmul(x, w)) * k::matmul(x, w)); };
  auto vg = k::value_and_grad(f, k::wrt<0, 1>);
  auto [v, gw, gx] = vg(w, x);  // tensors: a program of its own
  // The same function called with expressions: the value and gradients are expressions.
  auto [ve, gwe, gxe] = vg(k::expression(w), k::expression(x));
  static_assert(std::is_same_v<decltype(gwe), k::expression>);
  for (auto [a, e] : {std::pair{v, ve}, std::pair{gw, gwe}, std::pair{gx, gxe}}) {
    auto oracle = k::testing::allclose(a, e, 1e-4, 1e-5);  // the expression through the oracle
    CHECK_MESSAGE(oracle, oracle);
    k::Tensor fused = e;  // and fused, in one program
    auto same = k::testing::allclose(fused, a, 1e-5, 1e-6);
    CHECK_MESSAGE(same, same);
  }
  // Analytic: d/dw sum(tanh(z) z) = x^T (tanh(z) + z (1 - tanh(z)^2)), z = x w.
  auto z = k::matmul(x, w);
  auto expected = k::matmul(k::transpose(x, 0, 1), k::tanh(z) + z * (1.0 - k::square(k::tanh(z))));
  auto analytic = k::testing::allclose(gw, expected, 1e-4, 1e-5);
  CHECK_MESSAGE(analytic, analytic);
  auto expected_x = k::matmul(k::tanh(z) + z * (1.0 - k::square(k::tanh(z))), k::transpose(w, 0, 1));
  auto analytic_x = k::testing::allclose(gx, expected_x, 1e-4, 1e-5);
  CHECK_MESSAGE(analytic_x, analytic_x);
}

TEST_CASE("inner gradients: a wrt argument is an independent input, an unread one gets zeros") {
  k::Tensor x = k::randn({6, 5}, k::f32, k::cpu, 21), y = k::randn({6, 5}, k::f32, k::cpu, 22);
  auto g = k::grad([](auto a, auto b, auto) { return k::sum(a * b); }, k::wrt<0, 2>);
  // b = x * x is computed by the caller from x: the gradient with respect to a is b, not 3 x^2.
  auto fn = k::compile([&g](auto x, auto y) {
    auto [ga, gc] = g(x, x * x, y);
    return std::make_tuple(ga, gc);
  });
  auto [ga, gc] = fn(x, y);
  auto partial = k::testing::allclose(ga, x * x, 1e-6, 1e-7);
  CHECK_MESSAGE(partial, partial);
  for (double v : values(gc)) CHECK(v == 0.0);  // the value does not read c
}

TEST_CASE("inner gradients: one expression as two wrt arguments, or in two calls, is two independent inputs") {
  k::Tensor x = k::randn({4, 3}, k::f32, k::cpu, 23);
  auto g = k::grad([](auto a, auto b) { return k::sum(a * k::exp(b)); }, k::wrt<0, 1>);
  auto both = k::compile([&g](auto x) {
    auto [ga, gb] = g(x, x);
    return std::make_tuple(ga, gb);
  });
  auto [ga, gb] = both(x);
  auto da = k::testing::allclose(ga, k::exp(x), 1e-6, 1e-7), db = k::testing::allclose(gb, x * k::exp(x), 1e-6, 1e-7);
  CHECK_MESSAGE(da, da);
  CHECK_MESSAGE(db, db);
  // A second call over the same wrt expression, its other argument the first call's gradient.
  auto g1 = k::grad([](auto w) { return k::sum(w * w); }, k::wrt<0>);
  auto g2 = k::grad([](auto w, auto v) { return k::sum(w * v); }, k::wrt<0>);
  auto chained = k::compile([&](auto w) { return g2(w, g1(w)); });
  auto dv = k::testing::allclose(chained(x), x * 2.0, 1e-6, 1e-7);  // v = 2w, not 4w
  CHECK_MESSAGE(dv, dv);
}

TEST_CASE("inner gradients: a std::vector of tensors as the wrt argument of a gradient called with expressions") {
  auto ps = mlp_params(k::cpu);
  k::Tensor x = k::randn({29, 13}, k::f32, k::cpu, 24);
  auto vg = k::value_and_grad(mlp_loss, k::wrt<0>);
  auto [loss, grads] = vg(ps, x);  // tensors: a program of its own
  auto [loss_e, grads_e] = vg(ps, k::expression(x));
  static_assert(std::is_same_v<decltype(grads_e), std::vector<k::expression>>);
  REQUIRE(grads_e.size() == grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    auto same = k::testing::allclose(grads[i], grads_e[i], 1e-4, 1e-6);
    CHECK_MESSAGE(same, "gradient " << i << ": " << same);
  }
}

TEST_CASE("inner gradients: vjp inside, with the cotangent an expression of the caller") {
  k::Tensor x = k::randn({4, 9}, k::f32, k::cpu, 31), c = k::randn({4, 9}, k::f32, k::cpu, 32);
  auto pullback = k::vjp([](auto x) { return k::sin(x) * x; }, k::wrt<0>);
  auto fn = k::compile([&pullback](auto x, auto c) { return pullback(x, c * 2.0f); });
  k::Tensor got = fn(x, c);
  auto expected = k::testing::allclose(got, (k::cos(x) * x + k::sin(x)) * c * 2.0, 1e-5, 1e-6);
  CHECK_MESSAGE(expected, expected);
}

TEST_CASE("inner gradients: a gradient of a gradient is the second derivative, and passes gradcheck") {
  k::Tensor x = k::randn({3, 8}, k::f32, k::cpu, 41);
  auto inner = k::grad([](auto x) { return k::sum(x * x * x + k::sin(x)); }, k::wrt<0>);  // 3x^2 + cos x
  auto outer = k::compile(k::grad([&inner](auto x) { return k::sum(inner(x)); }, k::wrt<0>));
  k::Tensor got = outer(x);  // d/dx sum(3x^2 + cos x) = 6x - sin x
  auto second = k::testing::allclose(got, x * 6.0 - k::sin(x), 1e-5, 1e-5);
  CHECK_MESSAGE(second, second);
  k::Tensor x64 = k::randn({2, 5}, k::f64, k::cpu, 42), w64 = k::randn({2, 5}, k::f64, k::cpu, 43);
  auto result = k::testing::gradcheck([&inner](auto x, auto w) { return k::sum(k::tanh(inner(x)) * w); }, x64, w64);
  CHECK_MESSAGE(result, result);
}

TEST_CASE("inner gradients: a value of several elements, and integer arguments, are typed errors") {
  k::Tensor x = k::randn({4, 3}, k::f32, k::cpu, 51);
  k::Tensor ids = k::arange(4, k::i64, k::cpu);
  auto rows = k::grad([](auto x) { return k::sum(x, {1}); }, k::wrt<0>);  // a value per row
  auto fn = k::compile([&rows](auto x) { return rows(x); });
  CHECK_THROWS_AS(fn(x), k::shape_error);
  try {
    fn(x);
  } catch (const k::shape_error& e) {
    CHECK(std::string(e.what()).find("k::grad inside a compiled function") != std::string::npos);
    CHECK(std::string(e.what()).find("[4]") != std::string::npos);
  }
  auto by_ids = k::grad([](auto x, auto i) { return k::sum(k::cast(i, k::f32) * k::sum(x)); }, k::wrt<1>);
  auto fi = k::compile([&by_ids](auto x, auto i) { return by_ids(x, i); });
  CHECK_THROWS_AS(fi(x, ids), k::dtype_error);
}

TEST_CASE("inner gradients: the CUDA plan of a bf16 training step with its gradient inside compiles (host)") {
  namespace rt = k::runtime;
  // GPT-2's MLP block in bf16 over f32 master weights: tanh-gelu, whose backward GEMM may take
  // gelu's derivative as its epilogue; SGD on every weight in the same program.
  auto loss = [](auto w1, auto b1, auto w2, auto x) {
    auto h = k::gelu(k::matmul(x, k::cast(w1, k::bf16)) + k::cast(b1, k::bf16), k::approximate::tanh);
    return k::mean(k::square(k::cast(k::matmul(h, k::cast(w2, k::bf16)), k::f32)));
  };
  auto vg = k::value_and_grad(loss, k::wrt<0, 1, 2>);
  auto step = k::compile([vg](auto w1, auto b1, auto w2, auto x) {
    auto [l, g1, gb, g2] = vg(w1, b1, w2, x);
    return std::make_tuple(l, k::assign(w1, w1 - 0.01f * g1), k::assign(b1, b1 - 0.01f * gb),
                           k::assign(w2, w2 - 0.01f * g2));
  });
  auto w1 = k::randn({256, 1024}, k::f32, k::cpu, 61), b1 = k::randn({1024}, k::f32, k::cpu, 62);
  auto w2 = k::randn({1024, 256}, k::f32, k::cpu, 63), x = k::randn({512, 256}, k::bf16, k::cpu, 64);
  auto p = plan_for(k::Device(k::cuda), step, w1, b1, w2, x);
  // Fewer kernels than the gradient's program and the update's together: nothing stores a gradient
  // for another program to read back.
  auto grads = plan_for(k::Device(k::cuda), k::compile(vg), w1, b1, w2, x);
  auto update = k::compile([](auto w1, auto b1, auto w2, auto g1, auto gb, auto g2) {
    return std::make_tuple(k::assign(w1, w1 - 0.01f * g1), k::assign(b1, b1 - 0.01f * gb),
                           k::assign(w2, w2 - 0.01f * g2));
  });
  auto updates = plan_for(k::Device(k::cuda), update, w1, b1, w2, w1, b1, w2);
  CHECK(p->kernels.size() < grads->kernels.size() + updates->kernels.size());
  CHECK_FALSE(
      rt::compile_cubin(rt::cuda_translation_unit(*p, rt::program_body(*p)), "kiln_inner_grad_test", "sm_90a").empty());
}

TEST_CASE("inner gradients: an update stored in place waits for the kernels that still read its argument") {
  // GPT-2's shape in small: embeddings, a pre-norm MLP block, a final norm and the tied head, with
  // SGD in the same program. The first norm's bias update would join the kernel of its gradient's
  // column sum, ahead of the backward's row kernel that still reads the norm's parameters: the
  // program was refused (k::assign: argument ... read afterwards) without the fuser's rule.
  const std::int64_t B = 4, T = 32, d = 32, V = 97;
  auto loss = [=](auto p, auto tokens, auto targets) {
    k::expression x = k::embedding(p[0], tokens) + p[1];
    auto h = k::reshape(k::layer_norm(x, p[2], p[3]), {B * T, d});
    x = x + k::reshape(k::matmul(k::gelu(k::matmul(h, p[4])), p[5]), {B, T, d});
    auto hf = k::reshape(k::layer_norm(x, p[6], p[7]), {B * T, d});
    return k::expression(k::cross_entropy(k::matmul(hf, k::transpose(p[0], 0, 1)), targets));
  };
  std::vector<k::Tensor> ps;
  int seed = 71;
  for (k::Dims s :
       {k::Dims{V, d}, k::Dims{T, d}, k::Dims{d}, k::Dims{d}, k::Dims{d, 64}, k::Dims{64, d}, k::Dims{d}, k::Dims{d}})
    ps.push_back(k::Tensor(k::randn(s, k::f32, k::cpu, seed++) * 0.2f));
  auto ref = copies(ps);
  std::vector<std::int64_t> ids(B * T), next(B * T);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = (i * 31 + 7) % V, next[i] = (i * 17 + 3) % V;
  k::Tensor tokens = k::from_vector(ids, {B, T}), targets = k::from_vector(next, {B * T});
  auto vg = k::value_and_grad(loss, k::wrt<0>);
  auto sgd = [](const auto& p, const auto& g) {
    auto one = [&](std::size_t i) { return k::assign(p[i], p[i] - 0.05f * g[i]); };
    std::vector<decltype(one(0))> out;
    for (std::size_t i = 0; i < p.size(); ++i) out.push_back(one(i));
    return out;
  };
  auto step = k::compile([vg, sgd](auto p, auto tokens, auto targets) {
    auto [l, g] = vg(p, tokens, targets);
    return std::make_tuple(l, sgd(p, g));
  });
  auto update = k::compile([sgd](auto p, auto g) { return sgd(p, g); });
  auto two = k::compile(vg);
  for (int s = 0; s < 2; ++s) {
    REQUIRE_NOTHROW(step(ps, tokens, targets));
    update(ref, std::get<1>(two(ref, tokens, targets)));
  }
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto close = k::testing::allclose(ps[i], ref[i], 1e-5, 1e-6);
    CHECK_MESSAGE(close, "parameter " << i << ": " << close);
  }
  // Where no kernel after it reads the argument, the update still joins the kernel before: a sum
  // over p moved ahead, then one pointwise kernel storing m and p.
  auto fused = k::compile([](auto p, auto m, auto g) {
    auto m2 = m * 0.9f + g;
    auto s = k::sum(k::transpose(p, 0, 1) * g);
    return std::make_tuple(k::assign(m, m2), k::assign(p, p - 0.1f * s * m2));
  });
  k::Tensor p = k::randn({64, 64}, k::f32, k::cpu, 78), m = k::randn({64, 64}, k::f32, k::cpu, 79),
            g = k::randn({64, 64}, k::f32, k::cpu, 80);
  CHECK(k::explain(fused, p, m, g).kernels.size() == 2);
}
