// Tests of rewrite/: every decomposition's structure (op counts of the decomposed graph) and values
// (the oracle on the composite versus on its primitives), and every simplification.
#include <doctest/doctest.h>

#include <kiln/graph/flatten.hpp>
#include <kiln/reference/eval.hpp>
#include <kiln/rewrite/decompose.hpp>
#include <kiln/rewrite/factor_sums.hpp>
#include <kiln/rewrite/simplify.hpp>

#include <cmath>
#include <map>
#include <random>

namespace k = kiln;
using k::Op;

namespace {

k::Tensor uniform(const k::Dims& shape, unsigned seed, double lo = -1, double hi = 1, k::dtype dt = k::f64) {
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::int64_t i = 0; i < t.numel(); ++i) k::store_from_double(t.data_ptr(), dt, i, u(rng));
  return t;
}
k::Tensor values(const k::Dims& shape, const std::vector<double>& v, k::dtype dt = k::f64) {
  k::Tensor t = k::Tensor::empty(shape, dt, k::cpu);
  for (std::size_t i = 0; i < v.size(); ++i) k::store_from_double(t.data_ptr(), dt, static_cast<std::int64_t>(i), v[i]);
  return t;
}

// A function's graph over argument placeholders bound to ts, with shapes, and its scalar values.
struct Captured {
  k::graph::Graph g;
  std::vector<k::Tensor> args;
  std::vector<double> scalars;
};
template <class F, class... T>
Captured capture(const F& fn, const T&... ts) {
  Captured c{{}, {ts...}, {}};
  [&]<std::size_t... K>(std::index_sequence<K...>) {
    auto e = fn(k::expr::Arg<static_cast<int>(K)>{{}, &c.args[K]}...);
    c.g = k::graph::flatten(e);
    k::graph::Captured cap;
    k::graph::gather(e, cap);
    c.scalars.assign(cap.scalars.begin(), cap.scalars.begin() + cap.ns);
  }
  (std::index_sequence_for<T...>{});
  k::graph::infer_shapes(c.g, [&](int s) -> const k::Tensor& { return c.args[static_cast<std::size_t>(s)]; });
  return c;
}

std::map<Op, int> op_counts(const k::graph::Graph& g) {
  std::map<Op, int> m;
  for (auto& n : g.nodes)
    if (k::info(n.op).cls != k::OpClass::leaf) ++m[n.op];
  return m;
}
int count(const k::graph::Graph& g, Op op) { return op_counts(g)[op]; }
bool has_composite(const k::graph::Graph& g) {
  for (auto& n : g.nodes)
    if (k::is_composite(n.op)) return true;
  return false;
}

// Max |a - b| over the outputs of two graphs evaluated on the same arguments.
double max_diff(const Captured& c, const k::graph::Graph& other) {
  auto a = k::reference::eval_graph(c.g, c.args, c.scalars);
  auto b = k::reference::eval_graph(other, c.args, c.scalars);
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t o = 0; o < a.size(); ++o) {
    REQUIRE(a[o].shape == b[o].shape);
    for (std::size_t i = 0; i < a[o].data.size(); ++i) {
      double x = a[o].data[i], y = b[o].data[i];
      if (std::isinf(x) && x == y) continue;
      worst = std::max(worst, std::isnan(x - y) ? 1e300 : std::abs(x - y));
    }
  }
  return worst;
}

// Decomposes (and simplifies) fn's graph and checks it against the composite on the oracle.
template <class F, class... T>
k::graph::Graph decomposed(const F& fn, const T&... ts) {
  Captured c = capture(fn, ts...);
  k::graph::Graph d = k::rewrite::decompose(c.g);
  CHECK_FALSE(has_composite(d));
  CHECK(max_diff(c, d) < 1e-12);
  k::graph::Graph s = k::rewrite::simplify(d);
  CHECK(max_diff(c, s) < 1e-12);
  for (std::size_t o = 0; o < c.g.outputs.size(); ++o) {
    CHECK(d[d.outputs[o]].dt == c.g[c.g.outputs[o]].dt);
    CHECK(d[d.outputs[o]].shape == c.g[c.g.outputs[o]].shape);
  }
  return d;
}

const k::Tensor X = uniform({4, 6}, 1, -3, 3);

}  // namespace

TEST_CASE("decompose: softmax is exactly amax, sub, exp, sum, div") {
  auto d = decomposed([](auto x) { return k::softmax(x, 1); }, X);
  CHECK(op_counts(d) == std::map<Op, int>{{Op::amax, 1}, {Op::sub, 1}, {Op::exp, 1}, {Op::sum, 1}, {Op::div, 1}});
  decomposed([](auto x) { return k::softmax(x, 0); }, X);
  decomposed([](auto x) { return k::softmax(x, -1); }, uniform({2, 3, 5}, 2));
}

TEST_CASE("decompose: log_softmax and logsumexp are max-subtracted") {
  auto d = decomposed([](auto x) { return k::log_softmax(x, -1); }, X);
  CHECK(op_counts(d) == std::map<Op, int>{{Op::amax, 1}, {Op::sub, 2}, {Op::exp, 1}, {Op::sum, 1}, {Op::log, 1}});
  auto l = decomposed([](auto x) { return k::logsumexp(x, 1); }, X);
  CHECK(count(l, Op::amax) == 1);
  CHECK(count(l, Op::where) == 1);  // the shift of an all -inf (or +inf) row is 0
  CHECK(count(l, Op::log) == 1);
  decomposed([](auto x) { return k::logsumexp(x, 0, true); }, X);
  // A row of -inf gives -inf (not NaN), as PyTorch does.
  double inf = std::numeric_limits<double>::infinity();
  Captured c = capture([](auto x) { return k::logsumexp(x, 1); }, values({2, 2}, {-inf, -inf, 1, 2}));
  auto v = k::reference::eval_graph(k::rewrite::decompose(c.g), c.args, c.scalars)[0];
  CHECK(v.data[0] == -inf);
  CHECK(v.data[1] == doctest::Approx(std::log(std::exp(1.0) + std::exp(2.0))));
}

TEST_CASE("decompose: sum_to_shape_of is settled by sizes: a sum and a reshape, or nothing") {
  // The node k::structure leaves where a cotangent may need summing back to a broadcast operand.
  using k::expr::make;
  const k::Tensor g = uniform({2, 4, 6}, 7, -3, 3), b = uniform({4, 1}, 8, -3, 3), same = uniform({2, 4, 6}, 9, -3, 3);
  auto summed = decomposed([](auto g, auto b) { return make<Op::sum_to_shape_of>(k::Attrs{}, g, b); }, g, b);
  CHECK(op_counts(summed) == std::map<Op, int>{{Op::sum, 1}, {Op::reshape, 1}});
  auto kept = decomposed([](auto g, auto s) { return make<Op::sum_to_shape_of>(k::Attrs{}, g, s); }, g, same);
  CHECK(op_counts(kept).empty());
  // Leading dims only ([2, 4, 6] to [6]), and a 0-dim target.
  auto lead = decomposed([](auto g, auto r) { return make<Op::sum_to_shape_of>(k::Attrs{}, g, r); }, g,
                         uniform({6}, 10, -3, 3));
  CHECK(count(lead, Op::sum) == 1);
  auto all =
      decomposed([](auto g, auto r) { return make<Op::sum_to_shape_of>(k::Attrs{}, g, r); }, g, uniform({}, 11, -3, 3));
  CHECK(count(all, Op::sum) == 1);
}

TEST_CASE("decompose: mean and var") {
  auto m = decomposed([](auto x) { return k::mean(x, 1); }, X);
  CHECK(op_counts(m) == std::map<Op, int>{{Op::sum, 1}, {Op::numel, 1}, {Op::div, 1}});
  decomposed([](auto x) { return k::mean(x); }, X);
  decomposed([](auto x) { return k::mean(x, {0, 1}, true); }, X);
  auto v = decomposed([](auto x) { return k::var(x, 1); }, X);
  CHECK(count(v, Op::sum) == 2);
  CHECK(count(v, Op::square) == 1);
  decomposed([](auto x) { return k::var(x, 0, 0.0, true); }, X);
  decomposed([](auto x) { return k::var(x); }, X);
  // The correction is a run-time scalar, never folded.
  CHECK(count(k::rewrite::simplify(v), Op::sub) == 2);
}

TEST_CASE("decompose: pointwise composites") {
  auto s = decomposed([](auto x) { return k::silu(x); }, X);
  CHECK(op_counts(s) == std::map<Op, int>{{Op::sigmoid, 1}, {Op::mul, 1}});
  auto g = decomposed([](auto x) { return k::gelu(x); }, X);
  CHECK(count(g, Op::erf) == 1);
  CHECK(count(g, Op::tanh) == 0);
  auto t = decomposed([](auto x) { return k::gelu(x, k::approximate::tanh); }, X);
  CHECK(count(t, Op::tanh) == 1);
  CHECK(count(t, Op::erf) == 0);
  auto c = decomposed([](auto x) { return k::clamp(x, -0.5, 0.5); }, X);
  CHECK(op_counts(c) == std::map<Op, int>{{Op::maximum, 1}, {Op::minimum, 1}});
  decomposed([](auto x, auto lo) { return k::clamp(x, lo, 1.0); }, X, uniform({6}, 3));
}

TEST_CASE("decompose: layer_norm and rms_norm") {
  const k::Tensor w = uniform({6}, 4), b = uniform({6}, 5);
  auto l = decomposed([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, X, w, b);
  CHECK(count(l, Op::sum) == 2);
  CHECK(count(l, Op::rsqrt) == 1);
  CHECK(count(l, Op::numel) == 1);  // numel depends on the shape only: shared by both means
  CHECK(count(l, Op::amax) == 0);
  decomposed([](auto x, auto w, auto b) { return k::layer_norm(x, w, b, 1e-3); }, uniform({2, 3, 6}, 6), w, b);
  auto r = decomposed([](auto x, auto w) { return k::rms_norm(x, w); }, X, w);
  CHECK(op_counts(r) ==
        std::map<Op, int>{
            {Op::square, 1}, {Op::sum, 1}, {Op::numel, 1}, {Op::div, 1}, {Op::add, 1}, {Op::rsqrt, 1}, {Op::mul, 2}});
}

TEST_CASE("decompose: losses") {
  const k::Tensor t = values({4}, {0, 5, 2, 3}, k::i64);
  auto ce = decomposed([](auto x, auto t) { return k::cross_entropy(x, t); }, X, t);
  CHECK(count(ce, Op::gather) == 1);
  CHECK(count(ce, Op::amax) == 1);
  CHECK(count(ce, Op::exp) == 1);
  auto m = decomposed([](auto a, auto b) { return k::mse_loss(a, b); }, X, uniform({6}, 7));
  CHECK(op_counts(m) == std::map<Op, int>{{Op::sub, 1}, {Op::square, 1}, {Op::sum, 1}, {Op::numel, 1}, {Op::div, 1}});
}

TEST_CASE("decompose: linear and views") {
  const k::Tensor w = uniform({5, 6}, 8), b = uniform({5}, 9);
  auto l = decomposed([](auto x, auto w, auto b) { return k::linear(x, w, b); }, X, w, b);
  CHECK(op_counts(l) == std::map<Op, int>{{Op::permute, 1}, {Op::matmul, 1}, {Op::add, 1}});
  auto nb = decomposed([](auto x, auto w) { return k::linear(x, w); }, X, w);
  CHECK(op_counts(nb) == std::map<Op, int>{{Op::permute, 1}, {Op::matmul, 1}});
  decomposed([](auto x, auto w, auto b) { return k::linear(x, w, b); }, uniform({6}, 10), w, b);
  decomposed([](auto x, auto w, auto b) { return k::linear(x, w, b); }, uniform({2, 3, 6}, 11), w, b);
  decomposed([](auto x, auto w, auto b) { return k::linear(x, w, b); }, uniform({2, 2, 3, 6}, 12), w, b);
  auto t = decomposed([](auto x) { return k::transpose(x, -1, 0); }, X);
  CHECK(op_counts(t) == std::map<Op, int>{{Op::permute, 1}});
  auto u = decomposed([](auto x) { return k::squeeze(k::unsqueeze(x, 1), 1) * 2.0; }, X);
  CHECK(op_counts(u) == std::map<Op, int>{{Op::mul, 1}});  // reshape(reshape(x)) to x's shape is x
  auto un = decomposed([](auto x) { return k::unsqueeze(x, 1); }, X);
  CHECK(op_counts(un) == std::map<Op, int>{{Op::reshape, 1}});
  decomposed([](auto x) { return k::squeeze(k::unsqueeze(x, -1)); }, X);
}

TEST_CASE("decompose: f16 composites compute in f32 and round once") {
  const k::Tensor x = uniform({4, 6}, 13, -2, 2, k::f16), w = uniform({6}, 14, -1, 1, k::f16),
                  b = uniform({6}, 15, -1, 1, k::f16);
  Captured c = capture([](auto x, auto w, auto b) { return k::layer_norm(x, w, b); }, x, w, b);
  k::graph::Graph d = k::rewrite::decompose(c.g);
  CHECK(d[d.outputs[0]].op == Op::cast);
  CHECK(d[d.outputs[0]].dt == k::f16);
  for (auto& n : d.nodes)
    if (n.op == Op::sum) CHECK(n.dt == k::f32);
  CHECK(count(d, Op::cast) == 4);  // x, w, b up; the result down
  // Views and linear are not upcast.
  Captured l = capture([](auto x, auto w) { return k::linear(x, w); }, x, uniform({3, 6}, 16, -1, 1, k::f16));
  CHECK(count(k::rewrite::decompose(l.g), Op::cast) == 0);
}

// ---- simplify -----------------------------------------------------------------------------------

namespace {
k::graph::Node arg_node(int slot, k::Dims shape, k::dtype dt = k::f32) {
  k::graph::Node n;
  n.op = Op::arg;
  n.slot = slot;
  n.shape = shape;
  n.dt = dt;
  return n;
}
// Simplifies a one-output graph built by fn(builder, x) over an f32 [2, 3] argument x.
template <class F>
k::graph::Graph simplified(F&& fn, k::dtype dt = k::f32) {
  k::rewrite::Builder b;
  int x = b.node(arg_node(0, {2, 3}, dt));
  b.graph().outputs = {fn(b, x)};
  b.graph().num_args = 1;
  return k::rewrite::simplify(b.graph());
}
bool is_arg(const k::graph::Graph& g) { return g.count_ops() == 0 && g[g.outputs[0]].op == Op::arg; }
}  // namespace

TEST_CASE("simplify: identity operands") {
  using B = k::rewrite::Builder;
  CHECK(is_arg(simplified([](B& b, int x) { return b.mul(x, 1.0); })));
  CHECK(is_arg(simplified([](B& b, int x) { return b.mul(b.constant(1), x); })));
  CHECK(is_arg(simplified([](B& b, int x) { return b.add(x, 0.0); })));
  CHECK(is_arg(simplified([](B& b, int x) { return b.add(b.constant(0), x); })));
  CHECK(is_arg(simplified([](B& b, int x) { return b.sub(x, b.constant(0)); })));
  CHECK(is_arg(simplified([](B& b, int x) { return b.div(x, b.constant(1)); })));
  // 0 - x and 1 / x are not identities; an integer x * 1.0 changes dtype and stays.
  CHECK(simplified([](B& b, int x) { return b.sub(0.0, x); }).count_ops() == 1);
  CHECK(simplified([](B& b, int x) { return b.div(b.constant(1), x); }).count_ops() == 1);
  CHECK(simplified([](B& b, int x) { return b.mul(x, 1.0); }, k::i64).count_ops() == 1);
}

TEST_CASE("simplify: user scalars are run-time slots, never folded") {
  Captured c = capture([](auto x) { return x * 1.0 + 0.0; }, X);
  k::graph::Graph s = k::rewrite::simplify(c.g);
  CHECK(count(s, Op::mul) == 1);
  CHECK(count(s, Op::add) == 1);
}

TEST_CASE("simplify: double negation, constants, casts and views") {
  Captured n = capture([](auto x) { return -(-x); }, X);
  CHECK(is_arg(k::rewrite::simplify(n.g)));
  using B = k::rewrite::Builder;
  auto folded =
      simplified([](B& b, int x) { return b.add(x, b.mul(b.constant(2), b.add(b.constant(1), b.constant(2)))); });
  CHECK(folded.count_ops() == 1);
  int constants = 0;
  for (auto& nd : folded.nodes) {
    if (nd.op != Op::constant) continue;
    CHECK(nd.value == 6);
    ++constants;
  }
  CHECK(constants == 1);
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::cast(x, k::f64); }, X).g)));
  CHECK(count(k::rewrite::simplify(capture([](auto x) { return k::cast(x, k::f32); }, X).g), Op::cast) == 1);
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::reshape(x, {4, 6}); }, X).g)));
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::reshape(x, {-1, 6}); }, X).g)));
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::permute(x, {0, 1}); }, X).g)));
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::permute(k::permute(x, {1, 0}), {1, 0}); }, X).g)));
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::expand(x, {4, 6}); }, X).g)));
  CHECK(is_arg(k::rewrite::simplify(capture([](auto x) { return k::slice(x, 1, 0, 100); }, X).g)));
  auto rr = k::rewrite::simplify(capture([](auto x) { return k::reshape(k::reshape(x, {24}), {6, 4}); }, X).g);
  CHECK(op_counts(rr) == std::map<Op, int>{{Op::reshape, 1}});
  auto pp = k::rewrite::simplify(capture(
                                     [](auto x) {
                                       return k::permute(k::permute(x, {1, 2, 0}), {1, 2, 0});
                                     },
                                     uniform({2, 3, 4}, 17))
                                     .g);
  CHECK(op_counts(pp) == std::map<Op, int>{{Op::permute, 1}});
}

TEST_CASE("simplify: shares identical subtrees, drops dead nodes, keeps outputs") {
  k::graph::Graph g;
  g.nodes.push_back(arg_node(0, {2, 3}));
  for (int i = 0; i < 2; ++i) {  // two copies of exp(x), pushed without CSE
    k::graph::Node e;
    e.op = Op::exp;
    e.in[e.n_in++] = 0;
    g.nodes.push_back(e);
  }
  k::graph::Node dead;
  dead.op = Op::sin;
  dead.in[dead.n_in++] = 0;
  g.nodes.push_back(dead);
  k::graph::Node add;
  add.op = Op::add;
  add.in[add.n_in++] = 1;
  add.in[add.n_in++] = 2;
  g.nodes.push_back(add);
  g.outputs = {4, 1, 2};
  g.num_args = 1;
  k::Tensor x = uniform({2, 3}, 18, -1, 1, k::f32);
  k::graph::infer_shapes(g, [&](int) -> const k::Tensor& { return x; });
  k::graph::Graph s = k::rewrite::simplify(g);
  CHECK(op_counts(s) == std::map<Op, int>{{Op::exp, 1}, {Op::add, 1}});
  REQUIRE(s.outputs.size() == 3);
  CHECK(s[s.outputs[0]].op == Op::add);
  CHECK(s.outputs[1] == s.outputs[2]);
  CHECK(s[s.outputs[1]].op == Op::exp);
  std::vector<k::Tensor> args{x};
  auto a = k::reference::eval_graph(g, args, {});
  auto b = k::reference::eval_graph(s, args, {});
  CHECK(a[0].data == b[0].data);
}

// A sum whose operand reads row statistics only through factors constant along its dim (a
// layer_norm backward's mean term) becomes the factors applied to its terms' sums: the chain of
// reductions before it shortens (a row kernel's passes) and the values stay (to rounding).
TEST_CASE("factor_sums: sums of row-constant multiples no longer wait for the statistics") {
  const k::Tensor Y = uniform({4, 6}, 2, -2, 2);
  auto deepest = [](const k::graph::Graph& g) {
    auto d = k::rewrite::detail::reduction_depths(g);
    int m = 0;
    for (int o : g.outputs) m = std::max(m, d[o]);
    return m;
  };
  auto mean_term = [](auto x, auto y) {
    auto xc = x - k::mean(x, 1, true);
    auto rstd = k::rsqrt(k::mean(xc * xc, 1, true) + 1e-5);
    auto c = k::sum(y * xc, 1, true) * rstd;
    return k::sum(-(y * rstd + c * (xc * 2.0)), 1, true);
  };
  Captured c = capture(mean_term, X, Y);
  k::graph::Graph d = k::rewrite::simplify(k::rewrite::decompose(c.g));
  bool changed = false;
  k::graph::Graph f = k::rewrite::simplify(k::rewrite::factor_sums(d, &changed));
  CHECK(changed);
  CHECK(deepest(d) == 3);  // the mean, then the variance and c, then the sum
  CHECK(deepest(f) == 2);  // sum(y) and sum(x - mean) beside the variance
  CHECK(max_diff(c, f) < 1e-12);
  CHECK(f[f.outputs[0]].shape == k::Dims{4, 1});

  // Not constant along the summed dim, or nothing gained: unchanged.
  for (auto g : {capture([](auto x, auto y) { return k::sum(y * k::mean(x, 0, true), 1, true); }, X, Y).g,
                 capture([](auto x, auto y) { return k::sum(y * k::mean(x, 1, true), 0, true); }, X, Y).g,
                 capture([](auto x, auto y) { return k::sum(y * x * 3.0, 1); }, X, Y).g}) {
    k::graph::Graph dg = k::rewrite::simplify(k::rewrite::decompose(g));
    k::rewrite::factor_sums(dg, &changed);
    CHECK_FALSE(changed);
  }

  // Left alone (a review's cases): a sum without keepdim whose factor keeps the operand's rank (the
  // factor would broadcast against the smaller sum: [2, 3] by [2, 3, 1] threw), and integer and
  // boolean sums (a bool's add is an or; an i32 product wraps before its i64 sum).
  const k::Tensor X3 = uniform({2, 3, 4}, 3, -2, 2);
  const k::Tensor I = uniform({4, 6}, 4, -50, 50, k::i32);
  for (auto g :
       {capture([](auto x) { return k::sum(x * k::amax(x, -1, true), -1); }, X3).g,
        capture([](auto x) { return k::sum((x > 0.0) * (k::sum(x, 1, true) > 0.0) + (x > 0.5), 1, true); }, X).g,
        capture([](auto i) { return k::sum(i * k::sum(i, 1, true), 1, true); }, I).g}) {
    k::graph::Graph dg = k::rewrite::simplify(k::rewrite::decompose(g));
    k::graph::Graph fg = k::rewrite::factor_sums(dg, &changed);
    CHECK_FALSE(changed);
    CHECK(fg.size() == dg.size());  // nothing built and left dead
  }
}
