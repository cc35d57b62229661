// Tests of k::custom_op (expr/custom_op.hpp, runtime/extern/custom.hpp): a user's function as an opaque
// node — forward through k::compile and eager evaluation against values computed here and against
// the oracle, its place among fused kernels (explain lists it as an extern kernel), gradients through
// its backward against analytic values and gradcheck, the errors naming the op, several ops and
// repeated calls in one function, op identity in the program cache, dynamic shapes, strided
// arguments, kiln called from inside a forward, and the CUDA stream a forward is given.
#include <doctest/doctest.h>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

#include <atomic>
#include <cmath>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "have_gpu.hpp"

namespace k = kiln;

namespace {

// Random values in +-[0.2, 1.2]: never zero, so a dropped factor or term always shows.
k::Tensor nonzero(const k::Dims& shape, unsigned seed, k::dtype dt = k::f32) {
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.2, 1.2);
  for (std::int64_t i = 0; i < t.numel(); ++i) k::store_from_double(t.data_ptr(), dt, i, (rng() % 2 ? 1 : -1) * u(rng));
  return t;
}

std::vector<double> values(const k::Tensor& t) { return k::reference::read(t).data; }

double at(const k::Tensor& t, std::int64_t i) { return k::load_as_double(t.data_ptr(), t.dtype(), i); }
void put(const k::Tensor& t, std::int64_t i, double v) { k::store_from_double(t.data_ptr(), t.dtype(), i, v); }

void check_close(const k::Tensor& got, const std::vector<double>& want, double tol) {
  std::vector<double> g = values(got);
  REQUIRE(g.size() == want.size());
  for (std::size_t i = 0; i < g.size(); ++i)
    CHECK_MESSAGE(std::abs(g[i] - want[i]) <= tol * (1 + std::abs(want[i])), "element " << i);
}
void check_close(const k::Tensor& got, const k::Tensor& want, double tol) { check_close(got, values(want), tol); }

// The host code of the ops below works on CPU tensors of any dtype (gradcheck passes f64, users f32).
int calls_forward = 0, calls_backward = 0;

// scaled_tanh(x [R, C], w [C]) = tanh(x) * w, broadcast over rows.
k::CustomOp scaled_tanh = k::custom_op(
    "scaled_tanh",
    {
        .inputs = 2,
        .infer =
            [](std::span<const k::TensorSpec> in) {
              if (in[0].shape.size() != 2 || !(in[1].shape == k::Dims{in[0].shape[1]}))
                throw k::shape_error("w must be [C] for x [R, C], got x " + in[0].shape.str() + " and w " +
                                     in[1].shape.str());
              return k::TensorSpec{in[0].shape, in[0].dtype};
            },
        .forward =
            [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
              ++calls_forward;
              const std::int64_t C = in[0].shape()[1];
              for (std::int64_t i = 0; i < out.numel(); ++i) put(out, i, std::tanh(at(in[0], i)) * at(in[1], i % C));
            },
        .backward =
            [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream) {
              ++calls_backward;
              const std::int64_t C = in[0].shape()[1];
              if (grad_in[0].defined())
                for (std::int64_t i = 0; i < g.numel(); ++i) {
                  const double t = std::tanh(at(in[0], i));
                  put(grad_in[0], i, at(g, i) * (1 - t * t) * at(in[1], i % C));
                }
              if (grad_in[1].defined()) {
                std::vector<double> dw(static_cast<std::size_t>(C), 0.0);
                for (std::int64_t i = 0; i < g.numel(); ++i)
                  dw[static_cast<std::size_t>(i % C)] += at(g, i) * std::tanh(at(in[0], i));
                for (std::int64_t c = 0; c < C; ++c) put(grad_in[1], c, dw[static_cast<std::size_t>(c)]);
              }
            },
    });

// cube(x) = x^3, shape and dtype by default (no rule).
k::CustomOp cube = k::custom_op(
    "cube", {
                .forward =
                    [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                      for (std::int64_t i = 0; i < out.numel(); ++i) put(out, i, std::pow(at(in[0], i), 3));
                    },
                .backward =
                    [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream) {
                      for (std::int64_t i = 0; i < g.numel(); ++i)
                        put(grad_in[0], i, 3 * at(in[0], i) * at(in[0], i) * at(g, i));
                    },
            });

// affine(x) = 2x + 1, without a backward.
k::CustomOp affine = k::custom_op("affine", {
                                                .forward =
                                                    [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                                      for (std::int64_t i = 0; i < out.numel(); ++i)
                                                        put(out, i, 2 * at(in[0], i) + 1);
                                                    },
                                            });

// row_norm(x [R, C]) = sqrt(sum_c x^2), a new shape [R], with a backward.
k::CustomOp row_norm = k::custom_op(
    "row_norm", {
                    .infer =
                        [](std::span<const k::TensorSpec> in) {
                          return k::TensorSpec{k::Dims{in[0].shape[0]}, in[0].dtype};
                        },
                    .forward =
                        [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                          const std::int64_t R = in[0].shape()[0], C = in[0].shape()[1];
                          for (std::int64_t r = 0; r < R; ++r) {
                            double s = 0;
                            for (std::int64_t c = 0; c < C; ++c) s += at(in[0], r * C + c) * at(in[0], r * C + c);
                            put(out, r, std::sqrt(s));
                          }
                        },
                    .backward =
                        [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream) {
                          const std::int64_t R = in[0].shape()[0], C = in[0].shape()[1];
                          for (std::int64_t r = 0; r < R; ++r) {
                            double s = 0;
                            for (std::int64_t c = 0; c < C; ++c) s += at(in[0], r * C + c) * at(in[0], r * C + c);
                            for (std::int64_t c = 0; c < C; ++c)
                              put(grad_in[0], r * C + c, at(g, r) * at(in[0], r * C + c) / std::sqrt(s));
                          }
                        },
                });

// tanh(x) * w computed in the test, for [R, C] x and [C] w.
std::vector<double> scaled_tanh_of(const std::vector<double>& x, const std::vector<double>& w) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = std::tanh(x[i]) * w[i % w.size()];
  return out;
}

int count_kind(const k::report& r, const std::string& kind) {
  int n = 0;
  for (auto& kn : r.kernels) n += kn.kind == kind;
  return n;
}

}  // namespace

TEST_CASE("custom_op: forward through k::compile and eager evaluation") {
  auto x = nonzero({37, 13}, 1), w = nonzero({13}, 2);
  auto f = k::compile([&](auto a, auto b) { return scaled_tanh(a * 2, b) + 1; });
  std::vector<double> x2 = values(x);
  for (auto& v : x2) v *= 2;
  std::vector<double> want = scaled_tanh_of(x2, values(w));
  for (auto& v : want) v += 1;
  k::Tensor y = f(x, w);
  CHECK(y.shape() == k::Dims{37, 13});
  CHECK(y.dtype() == k::f32);
  check_close(y, want, 1e-6);
  check_close(f(x, w), want, 1e-6);  // the cached program
  CHECK(k::explain(f, x, w).recompiles == 0);

  k::Tensor eager = scaled_tanh(x, w);  // eager: the same op, evaluated at once
  check_close(eager, scaled_tanh_of(values(x), values(w)), 1e-6);
  check_close(k::eval(cube(x)), k::reference::eval(cube(x)), 1e-6);  // the oracle runs the op too
}

TEST_CASE("custom_op: a fusion barrier between generated kernels, listed by explain as extern") {
  auto x = nonzero({37, 13}, 3), w = nonzero({13}, 4);
  // relu(x) + 0.5 is materialised for the op; exp(..) * 2 and the row sum fuse after it.
  auto f = k::compile([&](auto a, auto b) { return k::sum(k::exp(scaled_tanh(k::relu(a) + 0.5f, b)) * 2, 1); });
  k::report r = k::explain(f, x, w);
  REQUIRE(r.kernels.size() == 3);
  CHECK(count_kind(r, "extern") == 1);
  CHECK(count_kind(r, "poi") == 1);
  CHECK(count_kind(r, "poi") + count_kind(r, "per") + count_kind(r, "red") == 2);
  const k::kernel_info& ext = r.kernels[1];
  CHECK(ext.kind == "extern");
  CHECK(ext.name == "kiln_extern_scaled_tanh_1");
  CHECK(ext.fused_ops == std::vector<std::string>{"scaled_tanh"});
  CHECK(ext.source.empty());
  CHECK_THROWS_AS(k::cubin(ext), k::error);  // a library call, not a generated kernel
  CHECK(r.kernels[0].name.find("relu") != std::string::npos);
  CHECK(r.kernels[2].name.find("exp") != std::string::npos);
  CHECK(r.ops_captured == 6);  // relu, add, custom, exp, mul, sum

  std::vector<double> xv = values(x);
  for (auto& v : xv) v = std::max(v, 0.0) + 0.5;
  std::vector<double> t = scaled_tanh_of(xv, values(w)), want(37, 0.0);
  for (std::size_t i = 0; i < t.size(); ++i) want[i / 13] += std::exp(t[i]) * 2;
  check_close(f(x, w), want, 1e-5);
  check_close(f(x, w), k::reference::eval(k::sum(k::exp(scaled_tanh(k::relu(x) + 0.5f, w)) * 2, 1)), 1e-5);

  // An op with a new output shape, between two reductions.
  auto g = k::compile([&](auto a) { return k::amax(row_norm(a - k::sum(a, 1, true)), 0); });
  k::report rg = k::explain(g, x);
  CHECK(count_kind(rg, "extern") == 1);
  CHECK(rg.kernels.size() == 3);
  check_close(g(x), k::reference::eval(k::amax(row_norm(x - k::sum(x, 1, true)), 0)), 1e-5);
}

TEST_CASE("custom_op: gradients through its backward, against analytic values and gradcheck") {
  auto x = nonzero({7, 5}, 5, k::f64), w = nonzero({5}, 6, k::f64);
  auto loss = [&](auto a, auto b) { return k::sum(scaled_tanh(a, b) * a); };
  auto [dx, dw] = k::grad(loss, k::wrt<0, 1>)(x, w);
  // d/dx sum(tanh(x) w x) = (1 - tanh^2) w x + tanh(x) w; d/dw_c = sum_r tanh(x_rc) x_rc
  std::vector<double> xv = values(x), wv = values(w), want_dx(35), want_dw(5, 0.0);
  for (std::size_t i = 0; i < 35; ++i) {
    const double t = std::tanh(xv[i]);
    want_dx[i] = (1 - t * t) * wv[i % 5] * xv[i] + t * wv[i % 5];
    want_dw[i % 5] += t * xv[i];
  }
  check_close(dx, want_dx, 1e-12);
  check_close(dw, want_dw, 1e-12);

  auto gc = k::testing::gradcheck(loss, x, w);
  CHECK_MESSAGE(bool(gc), gc);
  auto gc_shape = k::testing::gradcheck([&](auto a) { return row_norm(cube(a) * 0.5f); }, nonzero({4, 3}, 7, k::f64));
  CHECK_MESSAGE(bool(gc_shape), gc_shape);

  // Only the needed gradient is computed: one backward call for wrt<1>.
  calls_backward = 0;
  k::Tensor only_dw = k::grad(loss, k::wrt<1>)(x, w);
  CHECK(calls_backward == 1);
  check_close(only_dw, want_dw, 1e-12);

  // value_and_grad and vjp, compiled.
  auto vg = k::compile(k::value_and_grad(loss, k::wrt<0>));
  auto [value, dx2] = vg(x, w);
  double want_value = 0;
  std::vector<double> tv = scaled_tanh_of(xv, wv);
  for (std::size_t i = 0; i < 35; ++i) want_value += tv[i] * xv[i];
  check_close(value, std::vector<double>{want_value}, 1e-12);
  check_close(dx2, want_dx, 1e-12);
  auto cot = nonzero({7, 5}, 8, k::f64);
  k::Tensor vx = k::vjp([&](auto a, auto b) { return cube(a) * b; }, k::wrt<0>)(x, w, cot);
  std::vector<double> cv = values(cot), want_vx(35);
  for (std::size_t i = 0; i < 35; ++i) want_vx[i] = 3 * xv[i] * xv[i] * wv[i % 5] * cv[i];
  check_close(vx, want_vx, 1e-12);
}

// mix7(x0..x6) = sum_k (k + 1) * x_k * x_0: the most inputs an op takes (its backward node reads
// them and the cotangent: eight, a graph node's limit).
k::CustomOp mix7 = k::custom_op(
    "mix7", {
                .inputs = 7,
                .forward =
                    [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                      for (std::int64_t i = 0; i < out.numel(); ++i) {
                        double v = 0;
                        for (std::size_t k = 0; k < 7; ++k) v += double(k + 1) * at(in[k], i) * at(in[0], i);
                        put(out, i, v);
                      }
                    },
                .backward =
                    [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream) {
                      for (std::size_t k = 0; k < 7; ++k) {
                        if (!grad_in[k].defined()) continue;
                        for (std::int64_t i = 0; i < g.numel(); ++i) {
                          double d = double(k + 1) * at(in[0], i);  // d/dx_k of (k + 1) x_k x_0
                          if (k == 0)
                            for (std::size_t j = 0; j < 7; ++j) d += double(j + 1) * at(in[j], i);
                          put(grad_in[k], i, d * at(g, i));
                        }
                      }
                    },
            });

TEST_CASE("custom_op: seven inputs, the most a graph node leaves an op") {
  std::vector<k::Tensor> x;
  for (unsigned k = 0; k < 7; ++k) x.push_back(nonzero({3, 4}, 20 + k, k::f64));
  auto f = [](auto a, auto b, auto c, auto d, auto e, auto g, auto h) { return k::sum(mix7(a, b, c, d, e, g, h)); };
  auto grads = k::compile(k::grad(f, k::wrt<0, 1, 2, 3, 4, 5, 6>))(x[0], x[1], x[2], x[3], x[4], x[5], x[6]);
  std::vector<std::vector<double>> xv;
  for (const k::Tensor& t : x) xv.push_back(values(t));
  std::vector<std::vector<double>> want(7, std::vector<double>(12));
  for (std::size_t i = 0; i < 12; ++i) {
    double sum = 0;
    for (std::size_t j = 0; j < 7; ++j) sum += double(j + 1) * xv[j][i];
    want[0][i] = xv[0][i] + sum;
    for (std::size_t k = 1; k < 7; ++k) want[k][i] = double(k + 1) * xv[0][i];
  }
  std::apply(
      [&](const auto&... g) {
        int k = 0;
        (check_close(g, want[k++], 1e-12), ...);
      },
      grads);
  auto gc = k::testing::gradcheck(f, x[0], x[1], x[2], x[3], x[4], x[5], x[6]);
  CHECK_MESSAGE(bool(gc), gc);
}

TEST_CASE("custom_op: gradcheck catches a wrong backward") {
  k::CustomOp wrong = k::custom_op(
      "wrong_square",
      {
          .forward =
              [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                for (std::int64_t i = 0; i < out.numel(); ++i) put(out, i, at(in[0], i) * at(in[0], i));
              },
          .backward =
              [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream) {
                for (std::int64_t i = 0; i < g.numel(); ++i)
                  put(grad_in[0], i, at(in[0], i) * at(g, i));  // missing the 2
              },
      });
  auto gc = k::testing::gradcheck([&](auto a) { return k::sum(wrong(a)); }, nonzero({3, 5}, 9, k::f64));
  CHECK_FALSE(bool(gc));
}

TEST_CASE("custom_op: differentiating an op without backward is a k::error naming it") {
  auto x = nonzero({6, 5}, 10, k::f64);
  auto df = k::grad([&](auto a) { return k::sum(affine(a) * a); }, k::wrt<0>);
  CHECK_THROWS_WITH_AS(df(x), doctest::Contains("custom op 'affine'"), k::error);
  CHECK_THROWS_WITH_AS(df(x), doctest::Contains("no backward"), k::error);
  CHECK_THROWS_WITH_AS(k::testing::gradcheck([&](auto a) { return k::sum(affine(a)); }, x), doctest::Contains("affine"),
                       k::error);
  // ... but it is fine where no gradient flows through it.
  auto y = nonzero({6, 5}, 11, k::f64);
  k::Tensor dy = k::grad([&](auto a, auto b) { return k::sum(affine(a) * b); }, k::wrt<1>)(x, y);
  std::vector<double> xv = values(x), want(30);
  for (std::size_t i = 0; i < 30; ++i) want[i] = 2 * xv[i] + 1;
  check_close(dy, want, 1e-12);
}

TEST_CASE("custom_op: arity, shape-rule and function errors name the op") {
  auto x = nonzero({5, 3}, 12), w = nonzero({3}, 13), w4 = nonzero({4}, 14);
  CHECK_THROWS_WITH_AS(k::eval(scaled_tanh(x)), doctest::Contains("custom op 'scaled_tanh': takes 2 inputs, got 1"),
                       k::shape_error);
  CHECK_THROWS_WITH_AS(k::eval(scaled_tanh(x, w4)),
                       doctest::Contains("custom op 'scaled_tanh': shape rule: w must be [C]"), k::shape_error);
  CHECK_THROWS_WITH_AS(k::compile([&](auto a, auto b) { return scaled_tanh(a, b) + 1; })(x, w4),
                       doctest::Contains("scaled_tanh"), k::shape_error);

  k::CustomOp too_deep =
      k::custom_op("too_deep", {
                                   .infer =
                                       [](std::span<const k::TensorSpec>) {
                                         return k::TensorSpec{k::Dims{1, 1, 1, 1, 1, 1, 1, 1, 1}, k::f32};
                                       },
                                   .forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {},
                               });
  CHECK_THROWS_WITH_AS(k::eval(too_deep(x)),
                       doctest::Contains("custom op 'too_deep': shape rule: kiln supports tensors of at most 8"),
                       k::shape_error);
  k::CustomOp negative =
      k::custom_op("negative", {
                                   .infer =
                                       [](std::span<const k::TensorSpec>) {
                                         return k::TensorSpec{k::Dims{3, -2}, k::f32};
                                       },
                                   .forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {},
                               });
  CHECK_THROWS_WITH_AS(k::eval(negative(x)), doctest::Contains("custom op 'negative'"), k::shape_error);
  k::CustomOp odd_rule = k::custom_op(
      "odd_rule",
      {
          .infer = [](std::span<const k::TensorSpec>) -> k::TensorSpec { throw std::out_of_range("no such input"); },
          .forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {},
      });
  CHECK_THROWS_WITH_AS(k::eval(odd_rule(x)), doctest::Contains("custom op 'odd_rule': shape rule: no such input"),
                       k::error);

  // Forward failures: a k::error passes as it is; anything else becomes a k::error naming the op.
  k::CustomOp throws_std =
      k::custom_op("throws_std", {
                                     .forward = [](std::span<const k::Tensor>, k::Tensor&,
                                                   k::Stream) { throw std::runtime_error("device on fire"); },
                                 });
  k::CustomOp throws_kiln =
      k::custom_op("throws_kiln", {
                                      .forward = [](std::span<const k::Tensor>, k::Tensor&,
                                                    k::Stream) { throw k::dtype_error("my kernel wants f16"); },
                                  });
  CHECK_THROWS_WITH_AS(k::eval(throws_std(x)), doctest::Contains("custom op 'throws_std': forward: device on fire"),
                       k::error);
  CHECK_THROWS_WITH_AS(k::eval(throws_kiln(x)), "my kernel wants f16", k::dtype_error);
  // A failed evaluation leaves eval(out, expr)'s output untouched.
  k::Tensor out = k::full({5, 3}, 7.0, k::f32);
  CHECK_THROWS_AS(k::eval(out, throws_std(x) * 2), k::error);
  for (double v : values(out)) CHECK(v == 7.0);

  CHECK_THROWS_WITH_AS(k::custom_op("", {.forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {}}),
                       doctest::Contains("needs a name"), k::error);
  CHECK_THROWS_WITH_AS(k::custom_op("no_forward", {}), doctest::Contains("'no_forward' needs a .forward"), k::error);
  CHECK_THROWS_WITH_AS(
      k::custom_op("eight", {.inputs = 8, .forward = [](std::span<const k::Tensor>, k::Tensor&, k::Stream) {}}),
      doctest::Contains("custom ops take 1 to 7"), k::error);
  CHECK_THROWS_AS(k::CustomOp{}(x), k::error);  // never registered
}

TEST_CASE("custom_op: two different ops in one function, and one op called twice") {
  auto x = nonzero({9, 11}, 15), w = nonzero({11}, 16);
  auto f = k::compile([&](auto a, auto b) { return cube(scaled_tanh(a, b)) + affine(a); });
  k::report r = k::explain(f, x, w);
  CHECK(count_kind(r, "extern") == 3);
  std::vector<std::string> names;
  for (auto& kn : r.kernels)
    if (kn.kind == "extern") names.push_back(kn.fused_ops.at(0));
  CHECK(names == std::vector<std::string>{"scaled_tanh", "cube", "affine"});
  std::vector<double> t = scaled_tanh_of(values(x), values(w)), xv = values(x), want(99);
  for (std::size_t i = 0; i < 99; ++i) want[i] = t[i] * t[i] * t[i] + 2 * xv[i] + 1;
  check_close(f(x, w), want, 1e-5);

  // The same op on different inputs runs twice; on the same inputs once (CSE).
  auto twice = k::compile([&](auto a, auto b) { return scaled_tanh(a, b) - scaled_tanh(a * 3, b); });
  CHECK(count_kind(k::explain(twice, x, w), "extern") == 2);
  std::vector<double> x3 = xv;
  for (auto& v : x3) v *= 3;
  std::vector<double> t3 = scaled_tanh_of(x3, values(w)), want2(99);
  for (std::size_t i = 0; i < 99; ++i) want2[i] = t[i] - t3[i];
  calls_forward = 0;
  check_close(twice(x, w), want2, 1e-5);
  CHECK(calls_forward == 2);
  auto shared = k::compile([&](auto a, auto b) { return scaled_tanh(a, b) * scaled_tanh(a, b); });
  CHECK(count_kind(k::explain(shared, x, w), "extern") == 1);

  auto xd = nonzero({4, 3}, 17, k::f64), wd = nonzero({3}, 18, k::f64);
  auto gc = k::testing::gradcheck([&](auto a, auto b) { return k::sum(scaled_tanh(a, b) * scaled_tanh(cube(a), b)); },
                                  xd, wd);
  CHECK_MESSAGE(bool(gc), gc);
}

TEST_CASE("custom_op: another op in the same place never replays the wrong program") {
  auto x = nonzero({6, 7}, 19);
  std::vector<double> xv = values(x), cubed(42), affined(42);
  for (std::size_t i = 0; i < 42; ++i) cubed[i] = xv[i] * xv[i] * xv[i], affined[i] = 2 * xv[i] + 1;
  k::CustomOp current = cube;
  auto f = k::compile([&](auto a) { return current(a) + 0; });
  check_close(f(x), cubed, 1e-6);
  current = affine;
  check_close(f(x), affined, 1e-6);
  current = cube;
  check_close(f(x), cubed, 1e-6);
  k::report r = k::explain(f, x);
  CHECK(r.recompiles == 1);
  REQUIRE(r.recompile_reasons.size() == 1);
  CHECK(r.recompile_reasons[0].find("attributes") != std::string::npos);
  // Eager: both ops share one expression type (and so one cache).
  check_close(k::eval(cube(x)), cubed, 1e-6);
  check_close(k::eval(affine(x)), affined, 1e-6);
  // Many different ops in one place are different functions, not recompiles toward the limit.
  auto g = k::compile([&](auto a) { return current(a) * 1; }, {.recompile_limit = 2});
  for (int i = 0; i < 4; ++i) {
    current = k::custom_op("plus_" + std::to_string(i),
                           {
                               .forward =
                                   [i](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                     for (std::int64_t j = 0; j < out.numel(); ++j) put(out, j, at(in[0], j) + i);
                                   },
                           });
    k::Tensor y = g(x);
    CHECK(at(y, 5) == doctest::Approx(xv[5] + i));
  }
}

TEST_CASE("custom_op: dynamic shapes follow the op's shape rule") {
  auto f = k::compile([&](auto a) { return row_norm(a * 2) + 1; }, {.shapes = k::shapes::dynamic});
  for (std::int64_t rows : {5, 9, 17}) {
    auto x = nonzero({rows, 7}, static_cast<unsigned>(20 + rows));
    k::Tensor y = f(x);
    CHECK(y.shape() == k::Dims{rows});
    check_close(y, k::reference::eval(row_norm(x * 2) + 1), 1e-5);
  }
  CHECK(f.cache().recompiles() == 0);
}

TEST_CASE("custom_op: strided arguments arrive contiguous") {
  auto x = nonzero({5, 8}, 30);
  k::Tensor xt = x.as_strided({8, 5}, {1, 8}, 0);  // a transposed view
  REQUIRE_FALSE(xt.is_contiguous());
  static bool contiguous = false;
  k::CustomOp check =
      k::custom_op("check_layout", {
                                       .forward =
                                           [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                             contiguous = in[0].is_contiguous();
                                             for (std::int64_t i = 0; i < out.numel(); ++i) put(out, i, at(in[0], i));
                                           },
                                   });
  auto f = k::compile([&](auto a) { return check(a); });
  check_close(f(xt), k::reference::eval(xt), 0);
  CHECK(contiguous);
}

TEST_CASE("custom_op: a forward that evaluates kiln expressions itself") {
  // The inner evaluations have their own sizes, symbols and buffers, while the outer program holds
  // intermediates and symbolic sizes on both sides of the op: none of it may leak between them.
  k::CustomOp nested = k::custom_op(
      "nested",
      {
          .forward =
              [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream s) {
                static auto inner = k::compile([](auto t) { return k::softmax(k::exp(t) * 2, 0) + k::sum(t, 0, true); },
                                               {.shapes = k::shapes::dynamic});
                const std::int64_t rows = in[0].shape()[0] + 3;
                k::Tensor junk = inner(k::full({rows, 5}, 0.5, k::f32));  // column softmax of equal values: 1/rows
                CHECK(at(junk, 0) ==
                      doctest::Approx(1.0 / static_cast<double>(rows) + 0.5 * static_cast<double>(rows)));
                k::Tensor tmp = k::eval(k::tanh(in[0]) * 2.0f, s);
                k::eval(out, k::sum(tmp, 1, true) + tmp * in[0], s);
              },
      });
  auto expr = [&](auto a, auto c) {
    auto y = nested(k::exp(a) + c);
    return k::softmax(y * c, 1) + k::amax(a, 1, true) - k::sum(y, 0, true) * k::sigmoid(a);
  };
  auto f = k::compile(expr, {.shapes = k::shapes::dynamic});
  for (std::int64_t rows : {13, 29, 13}) {
    auto x = nonzero({rows, 21}, static_cast<unsigned>(31 + rows)), b = nonzero({21}, 32);
    auto want = k::reference::eval(expr(x, b));
    check_close(f(x, b), want, 1e-5);
    check_close(k::eval(expr(x, b)), want, 1e-5);
  }
}

TEST_CASE("custom_op: k::assign of an op that reads the argument it updates") {
  k::CustomOp reverse =
      k::custom_op("reverse", {
                                  .forward =
                                      [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                        const std::int64_t n = out.numel();
                                        for (std::int64_t i = 0; i < n; ++i)
                                          put(out, i, at(in[0], n - 1 - i));  // wrong if out aliases in[0]
                                      },
                              });
  auto x = nonzero({11}, 40);
  std::vector<double> xv = values(x), want(xv.rbegin(), xv.rend());
  auto f = k::compile([&](auto a) { return k::assign(a, reverse(a)); });
  f(x);
  check_close(x, want, 0);
}

TEST_CASE("custom_op: registering and calling from several threads") {
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t, &good] {
      k::CustomOp add_t = k::custom_op("add_" + std::to_string(t),
                                       {
                                           .forward =
                                               [t](std::span<const k::Tensor> in, k::Tensor& out, k::Stream) {
                                                 for (std::int64_t i = 0; i < out.numel(); ++i)
                                                   put(out, i, at(in[0], i) + t);
                                               },
                                       });
      auto x = nonzero({5, 3}, 50);
      auto f = k::compile([&](auto a) { return add_t(a) * 2; });
      bool ok = true;
      for (int rep = 0; rep < 3; ++rep) {
        k::Tensor y = f(x);
        k::Tensor z = add_t(x);  // the eager cache, shared by every thread
        for (std::int64_t i = 0; i < 15; ++i)
          ok = ok && std::abs(at(y, i) - 2 * (at(x, i) + t)) < 1e-5 && std::abs(at(z, i) - (at(x, i) + t)) < 1e-6;
      }
      good += ok;
    });
  for (auto& th : threads) th.join();
  CHECK(good == 4);
}

TEST_CASE("custom_op (cuda): the forward runs on the caller's stream" * needs_gpu()) {
  static CUstream seen = nullptr;
  k::CustomOp on_stream = k::custom_op(
      "on_stream",
      {
          .forward =
              [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream s) {
                seen = s.handle();
                k::eval(out, k::tanh(in[0]) * in[1], s);  // kiln itself, ordered on the given stream
              },
          .backward =
              [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream s) {
                if (grad_in[0].defined()) k::eval(grad_in[0], g * (1.0f - k::square(k::tanh(in[0]))) * in[1], s);
                if (grad_in[1].defined()) k::eval(grad_in[1], g * k::tanh(in[0]), s);
              },
      });
  CUstream s = nullptr;
  k::driver::make_current(0);  // a context for the raw driver call below
  k::driver::check(k::driver::api().stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  auto xc = nonzero({37, 129}, 33), wc = nonzero({37, 129}, 34);
  auto x = xc.to(k::cuda), w = wc.to(k::cuda);
  k::synchronize();  // the copies ran on the default stream, which does not order a non-blocking one
  auto f = k::compile([&](auto a, auto b) { return k::sum(on_stream(a * 2.0f, b) + 1.0f, 1); });
  k::Tensor y = f(k::Stream(s), x, w);
  k::Stream(s).synchronize();
  CHECK(seen == s);
  CHECK(y.device() == k::Device(k::cuda));
  auto r = k::testing::allclose(y, k::reference::eval(k::sum(on_stream(xc * 2.0f, wc) + 1.0f, 1)), 1e-5, 1e-5);
  CHECK_MESSAGE(bool(r), r);
  auto [dx, dw] = k::grad([&](auto a, auto b) { return k::sum(on_stream(a, b)); }, k::wrt<0, 1>)(x, w);
  auto rx = k::testing::allclose(dx, k::reference::eval((1.0f - k::square(k::tanh(xc))) * wc), 1e-5, 1e-5);
  auto rw = k::testing::allclose(dw, k::reference::eval(k::tanh(xc)), 1e-5, 1e-5);
  CHECK_MESSAGE(bool(rx), rx);
  CHECK_MESSAGE(bool(rw), rw);
  k::driver::check(k::driver::api().stream_destroy(s), "cuStreamDestroy");
}
