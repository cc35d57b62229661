// Tests of autodiff/structure.hpp: k::structure derives the primitive graph of a function type (and
// of its gradient) as a C++ constant expression, with the passes the runtime runs at the first call;
// the static_asserts are the compile-time half, the test cases compare with the run-time graph.
#include <doctest/doctest.h>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

#include <sstream>

namespace k = kiln;
using k::Op;

namespace {

// API.md's example, verbatim.
static_assert(k::structure<1>([](auto x) { return k::softmax(x, -1); }).count(k::Op::exp) == 1);

constexpr auto softmax_fn = [](auto x) { return k::softmax(x, -1); };
constexpr auto softmax_s = k::structure<1>(softmax_fn);
static_assert(softmax_s.count(Op::amax) == 1 && softmax_s.count(Op::sum) == 1 && softmax_s.count(Op::div) == 1);
static_assert(softmax_s.count(Op::softmax) == 0 && softmax_s.outputs().size() == 1);
static_assert(softmax_s[softmax_s.outputs()[0]].op == Op::div);

// log_softmax and logsumexp share one shift and one exp; layer_norm is two means and an rsqrt.
static_assert(k::structure<1>([](auto x) { return k::log_softmax(x, 1); }).count(Op::exp) == 1);
constexpr auto layer_norm_s = k::structure<3>([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); });
static_assert(layer_norm_s.count(Op::rsqrt) == 1 && layer_norm_s.count(Op::sum) == 2 &&
              layer_norm_s.count(Op::mul) == 2);

// The gradient of sum(sigmoid(x) * w): one sigmoid shared by value and gradient, its derivative
// y (1 - y), and the cotangent of w is sigmoid(x) times the seed.
constexpr auto sigmoid_fn = [](auto x, auto w) { return k::sum(k::sigmoid(x) * w); };
constexpr auto sigmoid_grad = k::structure<2>(k::grad(sigmoid_fn, k::wrt<0, 1>));
static_assert(sigmoid_grad.count(Op::sigmoid) == 1);
static_assert(sigmoid_grad.count(Op::sub) == 1 && sigmoid_grad.count(Op::mul) == 4);
static_assert(sigmoid_grad.count(Op::sum) == 0);  // the value is not an output of k::grad: dead code
// Whether sigmoid(x) and w were broadcast against each other only sizes say: each product's
// cotangent is summed back to its operand's shape by a sum_to_shape_of node, settled at run time.
static_assert(sigmoid_grad.count(Op::sum_to_shape_of) == 2);
static_assert(sigmoid_grad.outputs().size() == 2);
static_assert(sigmoid_grad[sigmoid_grad.outputs()[0]].op == Op::mul);
constexpr auto sigmoid_vag = k::structure<2>(k::value_and_grad(sigmoid_fn, k::wrt<0>));
static_assert(sigmoid_vag.outputs().size() == 2 && sigmoid_vag[sigmoid_vag.outputs()[0]].op == Op::sum);
// A broadcast bias: its gradient is the cotangent summed back to its shape, as one structural node.
constexpr auto bias_grad = k::structure<2>(k::grad([](auto x, auto b) { return k::sum(x * b); }, k::wrt<1>));
static_assert(bias_grad.count(Op::sum_to_shape_of) == 1 && bias_grad[bias_grad.outputs()[0]].op == Op::sum_to_shape_of);
// What needs no sizes is settled at compile time: gelu's pointwise ops and a product with a C++
// scalar keep x's shape, so no cotangent in its gradient needs summing.
constexpr auto gelu_grad = k::structure<1>(k::grad([](auto x) { return k::sum(k::gelu(x) * 3.0f); }, k::wrt<0>));
static_assert(gelu_grad.count(Op::sum_to_shape_of) == 0 && gelu_grad.count(Op::erf) == 1);
// k::vjp: N arguments besides the cotangent, which seeds the backward instead of ones.
constexpr auto exp_vjp = k::structure<1>(k::vjp([](auto x) { return k::exp(x); }, k::wrt<0>));
static_assert(exp_vjp.count(Op::exp) == 1 && exp_vjp.count(Op::iota) == 0 && exp_vjp.count(Op::mul) == 1);

// The MLP training step of test_train.cpp: its joint graph (value and six gradients) is a constant;
// five matmuls: two forward, three backward (x takes no gradient, so nothing computes dx).
constexpr auto mlp_loss = [](auto x, auto y, auto w1, auto b1, auto g, auto be, auto w2, auto b2) {
  return k::cross_entropy(k::linear(k::layer_norm(k::gelu(k::linear(x, w1, b1)), g, be), w2, b2), y);
};
constexpr auto mlp_step = k::structure<8>(k::value_and_grad(mlp_loss, k::wrt<2, 3, 4, 5, 6, 7>));
// (The one-hot's class indices are an iota_of op, reading the logits' shape, where an iota leaf was.)
// 16 sum_to_shape_of nodes: the biases, the norm's weights, its statistics and the loss's row terms.
static_assert(mlp_step.size() == 130 && mlp_step.count_ops() == 112 && mlp_step.count(Op::sum_to_shape_of) == 16);
static_assert(mlp_step.count(Op::matmul) == 5 && mlp_step.count(Op::exp) == 2 && mlp_step.count(Op::erf) == 1);
static_assert(mlp_step.outputs().size() == 7);

// No gradient through comparisons: d/dx sum(cast(x > 0) * x) is the mask times the seed.
constexpr auto mask_grad =
    k::structure<1>(k::grad([](auto x) { return k::sum(k::cast(x > 0, k::f32) * x); }, k::wrt<0>));
static_assert(mask_grad.count(Op::gt) == 1 && mask_grad.count(Op::where) == 0 && mask_grad.count(Op::mul) == 1);
// ... nor through argmax (an i64 result): only the `+ x` term has a gradient, argmax's graph is dead.
constexpr auto argmax_grad =
    k::structure<1>(k::grad([](auto x) { return k::sum(k::cast(k::argmax(x, 1), k::f32)) + k::sum(x); }, k::wrt<0>));
static_assert(argmax_grad.count(Op::amax) == 0 && argmax_grad.count(Op::amin) == 0);

template <class S>
std::string printed(const S& s) {
  std::ostringstream os;
  os << s;
  return os.str();
}

}  // namespace

TEST_CASE("structure: prints one node a line, like a graph") {
  const std::string p = printed(softmax_s);
  CHECK(p.find("exp(%2) : f32") != std::string::npos);
  CHECK(p.find("return %5") != std::string::npos);
}

TEST_CASE("structure: the same op count as the run-time graph of the same function") {
  auto x = k::randn({4, 8}, k::f32, k::cpu, 1), w = k::randn({4, 8}, k::f32, k::cpu, 2);
  CHECK(k::explain(k::compile(softmax_fn), x).ops_decomposed == softmax_s.count_ops());
  auto ln = [](auto x, auto w, auto b) { return k::layer_norm(x, w, b); };
  auto lw = k::randn({8}, k::f32, k::cpu, 3), lb = k::randn({8}, k::f32, k::cpu, 4);
  // The run time shares one numel for the two means (their inputs have one shape): one node fewer.
  CHECK(k::explain(k::compile(ln), x, lw, lb).ops_decomposed == layer_norm_s.count_ops() - 1);
  // Same-shape operands: no broadcast to reduce (the two sum_to_shape_of nodes settle to nothing).
  // The run time leaves the sum's cotangent, expanded to [4, 8], to the products' own broadcasting
  // (rewrite/simplify.hpp: sizes a program with symbolic sizes must not name): one node fewer.
  CHECK(k::explain(k::compile(k::grad(sigmoid_fn, k::wrt<0, 1>)), x, w).ops_decomposed ==
        sigmoid_grad.count_ops() - sigmoid_grad.count(Op::sum_to_shape_of) - 1);
  auto b = k::randn({8}, k::f32, k::cpu, 6);
  auto bias_fn = k::grad([](auto x, auto b) { return k::sum(x * b); }, k::wrt<1>);
  // A broadcast bias: the sum_to_shape_of settles to a sum over x's rows and a reshape to [8] (one
  // node more), and the seed's expand is left to the product's broadcasting as above (one fewer).
  CHECK(k::explain(k::compile(bias_fn), x, b).ops_decomposed == bias_grad.count_ops());
  const auto db = k::to_vector<float>(k::Tensor(bias_fn(x, b)));
  const auto xv = k::to_vector<float>(x);
  REQUIRE(db.size() == 8);
  for (std::size_t j = 0; j < 8; ++j) {
    float want = 0;
    for (std::size_t i = 0; i < 4; ++i) want += xv[i * 8 + j];
    CHECK(db[j] == doctest::Approx(want).epsilon(1e-5));
  }
}

TEST_CASE("structure: no gradient through comparisons, argmax and integer casts at run time") {
  auto x = k::randn({3, 5}, k::f32, k::cpu, 5);
  auto mask =
      k::to_vector<float>(k::Tensor(k::grad([](auto x) { return k::sum(k::cast(x > 0, k::f32) * x); }, k::wrt<0>)(x)));
  auto xv = k::to_vector<float>(x);
  for (std::size_t i = 0; i < xv.size(); ++i) CHECK(mask[i] == (xv[i] > 0 ? 1.0f : 0.0f));
  auto ones = k::to_vector<float>(k::Tensor(k::grad(
      [](auto x) {
        return k::sum(k::cast(k::cast(x * 3.0f, k::i32), k::f32) + x) + k::sum(k::cast(k::argmax(x, 1), k::f32));
      },
      k::wrt<0>)(x)));
  for (float v : ones) CHECK(v == 1.0f);
}
