// Differential testing of the whole pipeline (issue 4): random expression graphs, built at run time
// as graph::Graph node tables, go through decomposition, fusion, code generation, the host compiler
// and the CPU run time, and every output is compared with the f64 oracle (reference::eval_graph).
//
// The expressions mix unary math, broadcasting binary ops, comparisons feeding where, views
// (permute, reshape, slice with steps, expand, transpose, unsqueeze, squeeze), reductions over one,
// two or all dims with pointwise consumers, casts between f32/f64/f16/bf16 over inputs of mixed
// dtypes (some of them strided), and composites (softmax, log_softmax, layer_norm, mean, var,
// logsumexp, gelu, silu, clamp) that decomposition lowers. Many independent expressions share one
// program (one graph with many outputs), so the host compiler runs a few dozen times for hundreds
// of expressions; every third program is compiled with dynamic shapes.
//
// Values stay finite and moderate by construction: logs, square roots and divisions are guarded
// (log(|x| + 1), x / (|x| + 1)), large values are squashed before they can overflow, and the
// generator tracks for every node an interval of its values and a bound on the absolute error that
// f32 arithmetic (and f16/bf16 storage) may legitimately add, so that the tolerance of an output is
// the one of its dtype (f32 rtol 1e-4 atol 1e-5, f16 1e-2, bf16 2e-2) plus that propagated bound.
// Comparisons only read values that both sides compute exactly, so a where never flips.
//
// Environment: KILN_DIFF_GRAPHS (expressions, default 500), KILN_DIFF_SEED (default 1),
// KILN_DIFF_PER_PROGRAM (expressions per program, default 25), KILN_DIFF_PROGRAM (run only that
// program, to reproduce a failure), KILN_DIFF_JOBS (threads generating and compiling programs,
// default: the number of cores). A failure prints the expression's graph (Graph::str()), the
// smallest failing subexpression found by shrinking, and the generated kernels.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/testing.hpp>

namespace k = kiln;
using k::Dims;
using k::Op;
using k::graph::Graph;
using k::graph::Node;

namespace {

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

// ---- tolerances and error model ---------------------------------------------------------------------

struct Tolerance {
  double rtol, atol;
};
Tolerance tolerance(k::dtype d) {
  switch (d) {
    case k::dtype::f64: return {1e-7, 1e-9};
    case k::dtype::f16: return {1e-2, 1e-2};
    case k::dtype::bf16: return {2e-2, 2e-2};
    default: return {1e-4, 1e-5};
  }
}

// Unit roundoff of the arithmetic kiln uses for a node of dtype d (f16/bf16 compute in f32).
double eps_compute(k::dtype d) { return d == k::dtype::f64 ? 1.2e-16 : 6e-8; }
// Rounding when a node's value is stored in its own dtype (f16/bf16 buffers at fusion boundaries).
double eps_store(k::dtype d) {
  switch (d) {
    case k::dtype::f16: return 4.9e-4;
    case k::dtype::bf16: return 3.9e-3;
    case k::dtype::f32: return 6e-8;
    default: return 0;
  }
}

struct Interval {
  double lo = 0, hi = 0;
  double maxabs() const { return std::max(std::abs(lo), std::abs(hi)); }
};

// What the generator knows about a node: where its values lie, and how far kiln's value may
// legitimately be from the f64 oracle's.
struct Meta {
  Interval v;
  double err = 0;
};

// ---- the random graph builder ---------------------------------------------------------------------------

class Generator {
 public:
  Generator(std::uint64_t seed) : rng_(seed) {
    a_ = pick<std::int64_t>({3, 5, 7});
    b_ = pick<std::int64_t>({13, 17, 33, 129, 1025});  // 1025: rows longer than a tile, several programs
    c_ = pick<std::int64_t>({2, 3, 5});
    // The program's starting inputs; more are made on demand (weights, bias, broadcast partners).
    for (Dims s : {Dims{a_, b_}, Dims{b_}, Dims{a_, 1}, Dims{1, b_}, Dims{c_, a_, b_}, Dims{c_, 1, b_}, Dims{c_, a_, 1},
                   Dims{a_, b_}, Dims{1}})
      new_arg(s);
  }

  Graph g;
  std::vector<Meta> meta;
  std::vector<k::Tensor> args;
  std::vector<double> scalars;

  // One random expression, returned as a non-leaf node not already an output.
  int expression(int depth) {
    int root = gen(depth);
    if (root < 0) root = leaf();
    while (k::info(g[root].op).cls == k::OpClass::leaf || std::count(g.outputs.begin(), g.outputs.end(), root) ||
           g[root].dt == k::dtype::boolean) {
      int r = unary(root);
      if (r < 0 || r == root) r = add(mk(Op::neg, {squash(root, 8)}));
      root = r;
    }
    return root;
  }

 private:
  std::mt19937_64 rng_;
  std::int64_t a_, b_, c_;
  static constexpr int max_args = 28;
  static constexpr double squash_above = 40;

  // -- randomness
  double real(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng_); }
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return real(0, 1) < p; }
  template <class T>
  T pick(std::initializer_list<T> l) {
    return *(l.begin() + uniform(0, static_cast<int>(l.size()) - 1));
  }
  // Scalars are multiples of 1/8: exact in every float dtype, so comparisons and clamps agree.
  double nice_value(double lo, double hi) { return std::round(real(lo, hi) * 8) / 8; }

  const Dims& shape(int id) const { return g[id].shape; }
  int rank(int id) const { return g[id].shape.size(); }
  const Meta& m(int id) const { return meta[id]; }

  // -- nodes
  static Node mk(Op op, std::initializer_list<int> in, k::Attrs at = {}) {
    Node n;
    n.op = op;
    for (int i : in) n.in[n.n_in++] = i;
    n.attrs = at;
    return n;
  }

  // Adds a node (or finds its twin), infers its shape and dtype and analyses it; -1 when the
  // node is invalid (the generator then falls back to something else).
  int add(Node n) {
    for (int i = 0; i < n.n_in; ++i)
      if (n.in[i] < 0) return -1;
    const int before = g.size();
    const int id = g.add(n);
    if (id != before) return id;
    Node& nn = g.nodes[id];
    try {
      if (nn.op == Op::arg) {
        nn.shape = args[nn.slot].shape();
        nn.dt = args[nn.slot].dtype();
        nn.weak = false;
      } else if (nn.op == Op::constant || nn.op == Op::scalar) {
        nn.shape = {};
        nn.dt = nn.op == Op::scalar && !nn.floating ? k::dtype::i64 : k::dtype::f64;
        nn.weak = true;
      } else {
        k::graph::detail::infer_node(g, nn);
      }
    } catch (const k::error&) {
      g.nodes.pop_back();
      return -1;
    }
    meta.push_back(analyze(id));
    return id;
  }

  int constant(double v) {
    Node n;
    n.op = Op::constant;
    n.value = v;
    return add(n);
  }
  int scalar(double v, bool floating = true) {
    Node n;
    n.op = Op::scalar;
    n.slot = static_cast<int>(scalars.size());
    n.floating = floating;
    scalars.push_back(v);
    g.num_scalars = static_cast<int>(scalars.size());
    return add(n);
  }
  // A run-time scalar or a constant of that value.
  int number(double v) { return chance(0.5) ? scalar(v) : constant(v); }

  // A new input of this shape: randn or uniform values, a random dtype, sometimes strided.
  int new_arg(const Dims& s, bool force_f32 = false) {
    k::dtype dt = force_f32 ? k::f32 : pick({k::f32, k::f32, k::f32, k::f64, k::f16, k::bf16});
    std::uint64_t seed = rng_();
    bool uniform01 = chance(0.15);
    auto make = [&](const Dims& shape) {
      return uniform01 ? k::rand(shape, dt, k::cpu, seed) : k::randn(shape, dt, k::cpu, seed);
    };
    k::Tensor t;
    const int r = s.size();
    if (r >= 2 && chance(0.2)) {  // a transposed view of the last two dims
      Dims base = s;
      std::swap(base[r - 1], base[r - 2]);
      Dims st = k::contiguous_strides(base);
      std::swap(st[r - 1], st[r - 2]);
      t = make(base).as_strided(s, st, 0);
    } else if (r >= 1 && chance(0.15)) {  // every other element of a wider tensor, offset by one
      Dims base = s;
      base[r - 1] = 2 * s[r - 1] + 1;
      Dims st = k::contiguous_strides(base);
      st[r - 1] = 2;
      t = make(base).as_strided(s, st, 1);
    } else {
      t = make(s);
    }
    args.push_back(t);
    g.num_args = static_cast<int>(args.size());
    Node n;
    n.op = Op::arg;
    n.slot = static_cast<int>(args.size()) - 1;
    return add(n);
  }

  int arg_node(int slot) {
    Node n;
    n.op = Op::arg;
    n.slot = slot;
    return add(n);
  }

  // A random input tensor.
  int leaf() { return arg_node(uniform(0, static_cast<int>(args.size()) - 1)); }

  static bool compatible(const Dims& a, const Dims& b) {
    try {
      Dims r = k::broadcast_shapes(a, b, "test");
      return r.product() <= 40000;
    } catch (const k::error&) {
      return false;
    }
  }

  // An operand that broadcasts with shape s: generated, an existing input, a new input whose shape
  // is s with some dims set to 1 or dropped, or a number.
  int operand_for(Dims s, int depth, bool exact_only = false) {  // s by value: gen() grows g.nodes
    if (!exact_only && depth > 0 && chance(0.6)) {
      int b = gen(depth);
      if (b >= 0 && compatible(s, shape(b))) return b;
    }
    if (exact_only && depth > 0 && chance(0.5)) {
      int b = gen_exact(depth);
      if (b >= 0 && compatible(s, shape(b))) return b;
    }
    std::vector<int> fits;
    for (int i = 0; i < static_cast<int>(args.size()); ++i)
      if (compatible(s, args[i].shape()) && k::broadcast_shapes(s, args[i].shape(), "t") == s) fits.push_back(i);
    if (!fits.empty() && chance(0.6)) return arg_node(fits[uniform(0, static_cast<int>(fits.size()) - 1)]);
    if (static_cast<int>(args.size()) < max_args && !s.empty()) {
      Dims t;
      int drop = chance(0.3) ? uniform(0, s.size() - 1) : 0;
      for (int i = drop; i < s.size(); ++i) t.push_back(chance(0.3) ? 1 : s[i]);
      return new_arg(t);
    }
    if (!fits.empty()) return arg_node(fits[uniform(0, static_cast<int>(fits.size()) - 1)]);
    return number(nice_value(-2, 2));
  }

  // Brings a value into [-limit, limit] when it may be larger: a scale by a constant, tanh or
  // sigmoid.
  int squash(int x, double limit = squash_above) {
    if (x < 0 || m(x).v.maxabs() <= limit) return x;
    double r = real(0, 1);
    if (r < 0.6) return add(mk(Op::mul, {x, constant(limit / 4 / m(x).v.maxabs())}));
    if (r < 0.8) return add(mk(Op::tanh, {x}));
    return add(mk(Op::sigmoid, {x}));
  }

  int gen(int depth) {
    if (depth <= 0 || chance(0.12)) return chance(0.3) ? view(leaf()) : leaf();
    double r = real(0, 1);
    if (r < 0.22) return unary(gen(depth - 1));
    if (r < 0.44) return binary(gen(depth - 1), depth - 1);
    if (r < 0.50) return where(depth - 1);
    if (r < 0.60) return view(gen(depth - 1));
    if (r < 0.74) return reduction(gen(depth - 1), depth - 1);
    if (r < 0.80) return cast(gen(depth - 1));
    if (r < 0.94) return composite(gen(depth - 1));
    return scaled(gen(depth - 1));
  }

  // A value that the oracle and kiln compute exactly alike (no rounding anywhere): inputs, views,
  // neg/abs/relu, maximum/minimum, amax/amin and casts of such values. Comparisons read these.
  int gen_exact(int depth) {
    if (depth <= 0 || chance(0.3)) return chance(0.3) ? view(leaf()) : leaf();
    int x = gen_exact(depth - 1);
    double r = real(0, 1);
    if (r < 0.25) return add(mk(pick({Op::neg, Op::abs, Op::relu}), {x}));
    if (r < 0.45) return view(x);
    if (r < 0.65) return add(mk(pick({Op::maximum, Op::minimum}), {x, operand_for(shape(x), depth - 1, true)}));
    if (r < 0.85 && rank(x) > 0) {
      k::Attrs at;
      at.dims = {uniform(0, rank(x) - 1)};
      at.keepdim = chance(0.5);
      return add(mk(pick({Op::amax, Op::amin}), {x}, at));
    }
    k::Attrs at;
    at.dt = pick({k::f32, k::f64, k::f16, k::bf16});
    return add(mk(Op::cast, {x}, at));
  }

  int unary(int x) {
    if (x < 0) return -1;
    x = squash(x);
    const Meta mx = m(x);
    auto plus_one = [&](int v) { return add(mk(Op::add, {add(mk(Op::abs, {v})), constant(1)})); };
    switch (uniform(0, 19)) {
      case 0: return mx.v.maxabs() <= 6 ? add(mk(Op::exp, {x})) : add(mk(Op::exp, {add(mk(Op::neg, {add(mk(Op::abs, {x}))}))}));
      case 1: return add(mk(Op::log, {plus_one(x)}));
      case 2: return mx.err == 0 ? add(mk(Op::sqrt, {add(mk(Op::abs, {x}))})) : add(mk(Op::sqrt, {plus_one(x)}));
      case 3: return add(mk(Op::tanh, {x}));
      case 4: return add(mk(Op::sigmoid, {x}));
      case 5: return add(mk(Op::erf, {x}));
      case 6: return add(mk(Op::sin, {x}));
      case 7: return add(mk(Op::relu, {x}));
      case 8: return add(mk(Op::neg, {x}));
      case 9: return add(mk(Op::square, {squash(x, 30)}));
      case 10: return add(mk(Op::abs, {x}));
      case 11: return add(mk(Op::reciprocal, {plus_one(x)}));
      case 12: return add(mk(Op::cos, {x}));
      case 13: return add(mk(Op::log1p, {add(mk(Op::abs, {x}))}));
      case 14: return add(mk(Op::rsqrt, {plus_one(x)}));
      case 15: return add(mk(Op::expm1, {squash(x, 5)}));
      case 16: return add(mk(Op::exp2, {squash(x, 6)}));
      case 17: return add(mk(Op::log2, {plus_one(x)}));
      case 18: return add(mk(Op::pow, {plus_one(squash(x, 3)), number(pick({0.5, 2.0, 3.0, -1.0, 1.5, -0.5}))}));
      default: return add(mk(Op::tanh, {add(mk(Op::mul, {x, number(nice_value(-2, 2))}))}));
    }
  }

  int binary(int a, int depth) {
    if (a < 0) return -1;
    a = squash(a);
    int b = squash(operand_for(shape(a), depth));
    switch (uniform(0, 5)) {
      case 0: return add(mk(Op::add, {a, b}));
      case 1: return add(mk(Op::sub, {a, b}));
      case 2: return add(mk(Op::mul, {a, b}));
      case 3: return add(mk(Op::div, {a, add(mk(Op::add, {add(mk(Op::abs, {b})), constant(1)}))}));
      case 4: return add(mk(Op::maximum, {a, b}));
      default: return add(mk(Op::minimum, {a, b}));
    }
  }

  int where(int depth) {
    int a = squash(gen(depth));
    if (a < 0) return -1;
    int b = squash(operand_for(shape(a), depth));
    Dims ab = shape(b) == Dims{} ? shape(a) : k::broadcast_shapes(shape(a), shape(b), "where");
    int p = operand_for(ab, depth, true);
    int q = chance(0.5) ? number(nice_value(-1.5, 1.5)) : operand_for(shape(p), depth, true);
    Op cmp = pick({Op::lt, Op::le, Op::gt, Op::ge, Op::ne, Op::eq});
    int c = add(mk(cmp, {p, q}));
    if (c < 0 || !compatible(shape(c), ab)) c = add(mk(Op::gt, {p, constant(0)}));
    return chance(0.5) ? add(mk(Op::where, {c, a, b})) : add(mk(Op::where, {c, b, a}));
  }

  int scaled(int x) {
    if (x < 0) return -1;
    x = squash(x);
    return add(mk(pick({Op::add, Op::mul, Op::sub}), {add(mk(Op::mul, {x, number(nice_value(-2, 2))})), number(nice_value(-2, 2))}));
  }

  int cast(int x) {
    if (x < 0) return -1;
    k::Attrs at;
    at.dt = pick({k::f32, k::f64, k::f16, k::bf16});
    if (at.dt == g[x].dt) at.dt = at.dt == k::f32 ? k::f16 : k::f32;
    return add(mk(Op::cast, {squash(x, 1000)}, at));
  }

  int view(int x) {
    if (x < 0) return -1;
    const Dims s = shape(x);
    const int r = s.size();
    k::Attrs at;
    switch (uniform(0, 7)) {
      case 0:  // permute
        if (r >= 2) {
          std::vector<std::int64_t> order(r);
          for (int i = 0; i < r; ++i) order[i] = i;
          std::shuffle(order.begin(), order.end(), rng_);
          if (chance(0.3)) order[0] -= r;  // a negative dim
          at.dims = Dims(order);
          return add(mk(Op::permute, {x}, at));
        }
        break;
      case 1:  // transpose (a composite, decomposed to a permute)
        if (r >= 2) {
          at.a = uniform(0, r - 1);
          at.b = uniform(0, r - 1) - (chance(0.5) ? r : 0);
          return add(mk(Op::transpose, {x}, at));
        }
        break;
      case 2: {  // reshape: flatten, merge two dims, split one, insert a 1
        if (r == 0) break;
        Dims t;
        double c = real(0, 1);
        if (c < 0.25) {
          t = {chance(0.5) ? -1 : s.product()};
        } else if (c < 0.5 && r >= 2) {
          int d = uniform(0, r - 2);
          for (int i = 0; i < r; ++i) {
            if (i == d) t.push_back(s[i] * s[i + 1]);
            else if (i != d + 1) t.push_back(s[i]);
          }
        } else if (c < 0.75 && r < 4) {
          int d = uniform(0, r);
          t = s;
          t.insert(d, 1);
        } else {
          // split the first dim that has a proper divisor
          bool split = false;
          for (int i = 0; i < r && !split; ++i)
            for (std::int64_t f = 2; f < s[i] && !split; ++f)
              if (s[i] % f == 0 && r < 4) {
                t = s;
                t[i] = s[i] / f;
                t.insert(i, f);
                split = true;
              }
          if (!split) t = {s.product()};
        }
        at.dims = t;
        return add(mk(Op::reshape, {x}, at));
      }
      case 3:
      case 4: {  // slice with a step; bounds sometimes negative or past the end
        if (r == 0) break;
        int d = uniform(0, r - 1);
        std::int64_t n = s[d];
        if (n < 2) break;
        at.a = chance(0.3) ? d - r : d;
        at.d = pick<std::int64_t>({1, 2, 3});
        std::int64_t start = uniform(0, static_cast<int>(n / 2));
        at.b = chance(0.25) ? start - n : start;
        at.c = pick<std::int64_t>({n, n - 1, -1, 10000});
        if ((at.c == n - 1 || at.c == -1) && start >= n - 1) at.c = n;
        return add(mk(Op::slice, {x}, at));
      }
      case 5: {  // expand a size-1 dim, or add a leading dim
        Dims t = s;
        bool any = false;
        for (int i = 0; i < r; ++i)
          if (s[i] == 1 && chance(0.7)) {
            t[i] = pick<std::int64_t>({2, 3, a_, b_});
            any = true;
          }
        if (!any || (r < 3 && chance(0.3))) t.insert(0, pick<std::int64_t>({2, 3}));
        if (t.product() > 40000) break;
        if (chance(0.3))
          for (int i = t.size() - r; i < t.size(); ++i)
            if (t[i] == s[i - (t.size() - r)]) t[i] = -1;
        at.dims = t;
        return add(mk(Op::expand, {x}, at));
      }
      case 6:  // unsqueeze
        if (r < 4) {
          at.a = uniform(0, r) - (chance(0.3) ? r + 1 : 0);
          return add(mk(Op::unsqueeze, {x}, at));
        }
        break;
      default:  // squeeze one size-1 dim or all of them
        for (int i = 0; i < r; ++i)
          if (s[i] == 1) {
            if (chance(0.5)) at.all = true;
            else at.a = i;
            return add(mk(Op::squeeze, {x}, at));
          }
        break;
    }
    return x;
  }

  // Reduced dims for a value of rank r: one, two, or all of them.
  k::Attrs reduce_attrs(int r) {
    k::Attrs at;
    double c = real(0, 1);
    if (c < 0.1) {
      at.all = true;
    } else if (c < 0.35 && r >= 2) {
      int d0 = uniform(0, r - 1), d1 = uniform(0, r - 2);
      if (d1 >= d0) ++d1;
      at.dims = {d0, d1 - (chance(0.3) ? r : 0)};
    } else {
      int d = uniform(0, r - 1);
      at.dims = {chance(0.3) ? d - r : d};
    }
    at.keepdim = chance(0.5);
    return at;
  }
  std::int64_t reduced_count(int x, const k::Attrs& at, Op op) const {
    Dims rd = k::graph::detail::reduced_dims(at, rank(x), op);
    std::int64_t n = 1;
    for (auto d : rd) n *= shape(x)[static_cast<int>(d)];
    return n;
  }

  int reduction(int x, int depth) {
    if (x < 0) return -1;
    if (rank(x) == 0) return unary(x);
    x = squash(x);
    k::Attrs at = reduce_attrs(rank(x));
    Op op = pick({Op::sum, Op::sum, Op::amax, Op::amin});
    if (op == Op::sum) {
      // keep sums of f16 well inside its range
      std::int64_t n = reduced_count(x, at, op);
      if (n * m(x).v.maxabs() > 20000) x = add(mk(Op::mul, {x, constant(1.0 / n)}));
    }
    int red = add(mk(op, {x}, at));
    if (red < 0) return -1;
    // Often a pointwise consumer that broadcasts the result back over its input, as softmax and
    // normalisations do (the reduction's epilogue on the full rows).
    double c = real(0, 1);
    if (at.keepdim && c < 0.4) {
      red = squash(red);
      Op op2 = pick({Op::sub, Op::mul, Op::add, Op::div});
      if (op2 == Op::div) return add(mk(Op::div, {x, add(mk(Op::add, {add(mk(Op::abs, {red})), constant(1)}))}));
      return add(mk(op2, {x, red}));
    }
    if (c < 0.7) return chance(0.5) ? unary(red) : binary(red, depth);
    return red;
  }

  int composite(int x) {
    if (x < 0) return -1;
    x = squash(x);
    const int r = rank(x);
    k::Attrs at;
    double c = real(0, 1);
    if (r == 0 || c < 0.12) {
      if (chance(0.5)) {
        at.a = chance(0.5);  // gelu, exact or tanh
        return add(mk(Op::gelu, {x}, at));
      }
      if (chance(0.5)) return add(mk(Op::silu, {x}));
      double lo = nice_value(-1.5, 0.5), hi = lo + 0.125 + nice_value(0, 1.5);
      return add(mk(Op::clamp, {x, number(lo), number(hi)}));
    }
    if (c < 0.32) {
      at.dims = {uniform(0, r - 1) - (chance(0.3) ? r : 0)};
      at.keepdim = true;
      return add(mk(chance(0.5) ? Op::softmax : Op::log_softmax, {x}, at));
    }
    if (c < 0.5 && shape(x).back() >= 2) {
      // layer_norm(x * s + r, w, b): r varies along the normalised dim, so rows never collapse to a
      // constant and the row std stays well away from 0.
      std::int64_t d = shape(x).back();
      int xs = add(mk(Op::mul, {x, constant(0.1 / std::max(1.0, m(x).v.maxabs()))}));
      int rr = new_or_existing({d}, true);
      int w = new_or_existing({d}, false), b = new_or_existing({d}, false);
      int eps = chance(0.5) ? scalar(pick({1e-5, 1e-3})) : constant(1e-5);
      return add(mk(Op::layer_norm, {add(mk(Op::add, {xs, rr})), w, b, eps}));
    }
    if (c < 0.65) {
      at = reduce_attrs(r);
      return add(mk(Op::mean, {x}, at));
    }
    if (c < 0.8) {
      at = reduce_attrs(r);
      std::int64_t n = reduced_count(x, at, Op::var);
      if (n < 3) return add(mk(Op::mean, {x}, at));
      int corr = chance(0.5) ? constant(pick({0.0, 1.0})) : scalar(pick({0.0, 1.0}));
      return add(mk(Op::var, {x, corr}, at));
    }
    at.dims = {uniform(0, r - 1)};
    at.keepdim = chance(0.5);
    return add(mk(Op::logsumexp, {x}, at));
  }

  // An input of exactly this shape. For layer_norm's row offsets (spread): f32 randn with a row
  // std of at least 0.5 (known exactly, since the values are known).
  int new_or_existing(const Dims& s, bool spread) {
    for (int i = 0; i < static_cast<int>(args.size()); ++i) {
      if (!(args[i].shape() == s)) continue;
      if (spread && !(args[i].dtype() == k::f32 && row_std(args[i]) >= 0.5)) continue;
      if (chance(0.7)) return arg_node(i);
    }
    for (int tries = 0; tries < 20; ++tries) {
      int id = new_arg(s, spread);
      if (!spread || row_std(args[g[id].slot]) >= 0.5) return id;
    }
    return new_arg(s, spread);
  }
  static double row_std(const k::Tensor& t) {
    std::vector<double> v = k::reference::read(t).data;
    double mean = 0, ss = 0;
    for (double e : v) mean += e;
    mean /= static_cast<double>(v.size());
    for (double e : v) ss += (e - mean) * (e - mean);
    return std::sqrt(ss / static_cast<double>(v.size()));
  }

  // Once the oracle has computed every node: the error model again, over the values' actual
  // ranges (tighter than the generator's intervals, a sum of n values being ~sqrt(n), not n, times
  // their size). Counts the non-finite values, which the generator promises never to make.
 public:
  int nonfinite = 0;
  void refine(const std::vector<k::reference::Value>& vals) {
    actual.assign(g.size(), {});
    ln_min_std_.assign(g.size(), 0);
    for (int i = 0; i < g.size(); ++i) {
      double lo = INFINITY, hi = -INFINITY;
      for (double v : vals[i].data) {
        if (!std::isfinite(v)) {
          ++nonfinite;
          continue;
        }
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      actual[i] = lo <= hi ? Interval{lo, hi} : Interval{0, 0};
      if (g[i].op == Op::layer_norm) {
        const auto& x = vals[g[i].in[0]];
        const std::size_t d = static_cast<std::size_t>(x.shape.back());
        double smin = INFINITY;
        for (std::size_t r = 0; d > 0 && r < x.data.size() / d; ++r) {
          double mean = 0, ss = 0;
          for (std::size_t j = 0; j < d; ++j) mean += x.data[r * d + j];
          mean /= static_cast<double>(d);
          for (std::size_t j = 0; j < d; ++j) ss += (x.data[r * d + j] - mean) * (x.data[r * d + j] - mean);
          smin = std::min(smin, std::sqrt(ss / static_cast<double>(d)));
        }
        ln_min_std_[i] = smin;
      }
    }
    refining_ = true;
    for (int i = 0; i < g.size(); ++i) meta[i] = {actual[i], analyze(i).err};
  }

 private:
  std::vector<Interval> actual;
  std::vector<double> ln_min_std_;
  bool refining_ = false;

  // ---- the error model: an interval of values and an absolute error bound per node ------------
  // |t| for the t of [lo - e, hi + e] nearest 0.
  static double nearest_zero(Interval v, double e) {
    if (v.lo - e <= 0 && v.hi + e >= 0) return 0;
    return v.lo - e > 0 ? v.lo - e : -(v.hi + e);
  }

  Meta analyze(int id) {
    const Node& n = g[id];
    auto in = [&](int i) -> const Meta& { return meta[n.in[i]]; };
    const double ec = eps_compute(n.dt), es = n.dt == k::dtype::f16 || n.dt == k::dtype::bf16 ? eps_store(n.dt) : 0;
    Meta out;
    // The rounding a computing (non-exact) op adds: a few ulps of its result, and its storage.
    auto rounded = [&](Interval v, double err, double ulps = 4) {
      Meta r;
      r.v = v;
      r.err = err + (ulps * ec + es) * ((refining_ ? actual[id] : v).maxabs() + 1);
      return r;
    };
    auto mono = [](double lo, double hi, auto f) {
      double a = f(lo), b = f(hi);
      return Interval{std::min(a, b), std::max(a, b)};
    };
    switch (n.op) {
      case Op::arg: {
        std::vector<double> v = k::reference::read(args[n.slot]).data;
        out.v = {*std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end())};
        return out;
      }
      case Op::scalar: out.v = {scalars[n.slot], scalars[n.slot]}; return out;
      case Op::constant: out.v = {n.value, n.value}; return out;
      default: break;
    }
    const Interval x = in(0).v;
    const double e = in(0).err;
    switch (n.op) {
      case Op::neg: out.v = {-x.hi, -x.lo}; out.err = e; return out;
      case Op::abs: out.v = {x.lo <= 0 && x.hi >= 0 ? 0 : std::min(std::abs(x.lo), std::abs(x.hi)), x.maxabs()}; out.err = e; return out;
      case Op::relu: out.v = {std::max(x.lo, 0.0), std::max(x.hi, 0.0)}; out.err = e; return out;
      case Op::exp: return rounded(mono(x.lo, x.hi, [](double t) { return std::exp(t); }), std::exp(x.hi) * e);
      case Op::exp2: return rounded(mono(x.lo, x.hi, [](double t) { return std::exp2(t); }), std::exp2(x.hi) * 0.7 * e);
      case Op::expm1: return rounded(mono(x.lo, x.hi, [](double t) { return std::expm1(t); }), std::exp(x.hi) * e);
      case Op::log: return rounded(mono(x.lo, x.hi, [](double t) { return std::log(t); }), e / x.lo);
      case Op::log2: return rounded(mono(x.lo, x.hi, [](double t) { return std::log2(t); }), 1.5 * e / x.lo);
      case Op::log1p: return rounded(mono(x.lo, x.hi, [](double t) { return std::log1p(t); }), e / (1 + x.lo));
      case Op::sqrt:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::sqrt(t); }), x.lo > 0 ? e / (2 * std::sqrt(x.lo)) : std::sqrt(e));
      case Op::rsqrt: return rounded(mono(x.lo, x.hi, [](double t) { return 1 / std::sqrt(t); }), 0.5 * e / (x.lo * std::sqrt(x.lo)));
      case Op::reciprocal: return rounded(mono(x.lo, x.hi, [](double t) { return 1 / t; }), e / (x.lo * x.lo));
      case Op::square: {
        Interval v{x.lo <= 0 && x.hi >= 0 ? 0 : std::min(x.lo * x.lo, x.hi * x.hi), x.maxabs() * x.maxabs()};
        return rounded(v, 2 * x.maxabs() * e + e * e);
      }
      case Op::sin: case Op::cos: return rounded({-1, 1}, e);
      // Their slope is largest at 0: bound it by its value at the point nearest 0 that kiln's
      // input (within e of the oracle's) may take.
      case Op::tanh: {
        double t = std::tanh(nearest_zero(x, e));
        return rounded(mono(x.lo, x.hi, [](double u) { return std::tanh(u); }), (1 - t * t) * e);
      }
      case Op::sigmoid: {
        double sg = 1 / (1 + std::exp(-nearest_zero(x, e)));
        return rounded(mono(x.lo, x.hi, [](double u) { return 1 / (1 + std::exp(-u)); }), sg * (1 - sg) * e);
      }
      case Op::erf: {
        double z = nearest_zero(x, e);
        return rounded(mono(x.lo, x.hi, [](double u) { return std::erf(u); }), 1.13 * std::exp(-z * z) * e);
      }
      case Op::cast: {
        out.v = x;
        // Rounding an exact value is deterministic on both sides; an inexact one may round apart.
        out.err = e == 0 ? 0 : e + eps_store(n.dt) * x.maxabs();
        return out;
      }
      case Op::add: case Op::sub: case Op::mul: case Op::div: case Op::maximum: case Op::minimum: case Op::pow: {
        const Interval y = in(1).v;
        const double f = in(1).err;
        switch (n.op) {
          case Op::add: return rounded({x.lo + y.lo, x.hi + y.hi}, e + f);
          case Op::sub: return rounded({x.lo - y.hi, x.hi - y.lo}, e + f);
          case Op::mul: {
            double c[] = {x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi};
            return rounded({*std::min_element(c, c + 4), *std::max_element(c, c + 4)},
                           y.maxabs() * e + x.maxabs() * f + e * f);
          }
          case Op::div: {  // the denominator is |b| + 1 >= 1
            double ymin = std::min(std::abs(y.lo), std::abs(y.hi));
            double c[] = {x.lo / y.lo, x.lo / y.hi, x.hi / y.lo, x.hi / y.hi};
            return rounded({*std::min_element(c, c + 4), *std::max_element(c, c + 4)}, e / ymin + x.maxabs() / (ymin * ymin) * f);
          }
          case Op::maximum: out.v = {std::max(x.lo, y.lo), std::max(x.hi, y.hi)}; out.err = std::max(e, f); return out;
          case Op::minimum: out.v = {std::min(x.lo, y.lo), std::min(x.hi, y.hi)}; out.err = std::max(e, f); return out;
          default: {  // pow(base >= 1, exponent)
            double p = y.lo;
            Interval v = mono(x.lo, x.hi, [p](double t) { return std::pow(t, p); });
            double slope = std::abs(p) * std::max(std::pow(x.lo, p - 1), std::pow(x.hi, p - 1));
            return rounded(v, slope * e + v.maxabs() * std::log(x.hi) * f);
          }
        }
      }
      case Op::lt: case Op::le: case Op::gt: case Op::ge: case Op::eq: case Op::ne:
        out.v = {0, 1};
        return out;
      case Op::where:
        out.v = {std::min(in(1).v.lo, in(2).v.lo), std::max(in(1).v.hi, in(2).v.hi)};
        out.err = std::max(in(1).err, in(2).err);
        return out;
      case Op::reshape: case Op::permute: case Op::slice: case Op::expand: case Op::transpose: case Op::unsqueeze:
      case Op::squeeze:
        return in(0);
      case Op::amax: case Op::amin:
        return in(0);
      default: break;
    }
    // Reductions and composites: nr is the number of reduced elements.
    const double nr = n.op == Op::layer_norm ? static_cast<double>(shape(n.in[0]).back())
                      : n.op == Op::softmax || n.op == Op::log_softmax || n.op == Op::logsumexp || n.op == Op::sum ||
                              n.op == Op::mean || n.op == Op::var
                          ? static_cast<double>(reduced_count(n.in[0], n.attrs, n.op))
                          : 1;
    const double acc = 8 * nr * ec;  // accumulation over nr elements, relative to their magnitude
    switch (n.op) {
      case Op::sum: return rounded({nr * x.lo, nr * x.hi}, nr * e + acc * x.maxabs());
      case Op::mean: return rounded(x, e + acc * x.maxabs());
      case Op::var: {
        double corr = in(1).v.lo, d = x.hi - x.lo, scale = nr / std::max(nr - corr, 1.0);
        return rounded({0, d * d * scale}, 4 * d * e * scale + acc * d * d * scale);
      }
      case Op::softmax: return rounded({0, 1}, 2 * e + acc);
      case Op::log_softmax: return rounded({x.lo - x.hi - std::log(nr), 0}, 2 * e + acc * (1 + x.maxabs()));
      case Op::logsumexp: return rounded({x.lo, x.hi + std::log(nr)}, e + acc * (1 + x.maxabs()));
      case Op::layer_norm: {
        // Rows are x * s + r with std(r) >= 0.5 and |x * s| <= 0.1: the row std is >= 0.4 (and
        // known exactly once the oracle has run).
        const Meta &w = in(1), &b = in(2);
        const double sd = refining_ ? std::max(ln_min_std_[id], 1e-3) : 0.4;
        double bound = w.v.maxabs() * std::sqrt(nr) + b.v.maxabs();
        return rounded({-bound, bound}, e * w.v.maxabs() * 3 / sd + w.err * std::sqrt(nr) + b.err + acc * bound);
      }
      case Op::gelu: return rounded({std::min(x.lo, -0.2), std::max(x.hi, 0.0)}, 1.13 * e);
      case Op::silu: return rounded({std::min(x.lo, -0.3), std::max(x.hi, 0.0)}, 1.1 * e);
      case Op::clamp: {
        double lo = in(1).v.lo, hi = in(2).v.lo;
        out.v = {std::clamp(x.lo, lo, hi), std::clamp(x.hi, lo, hi)};
        out.err = e;
        return out;
      }
      default:
        throw k::error("the differential test has no error model for op " + std::string(k::name(n.op)));
    }
  }
};

// ---- running a graph ----------------------------------------------------------------------------------------

struct Run {
  std::shared_ptr<const k::runtime::Entry> entry;
  std::vector<k::Tensor> outputs;
};

// runtime::run_graph, keeping the compiled program so that failures can print its kernels.
// KILN_DIFF_DEVICE=cuda runs the generated kernels on the GPU (scripts/gpu-check does).
bool on_cuda() {
  static const bool cuda = std::getenv("KILN_DIFF_DEVICE") && std::string(std::getenv("KILN_DIFF_DEVICE")) == "cuda";
  return cuda;
}

Run run_kiln(const Graph& g, const std::vector<k::Tensor>& host_args, const std::vector<double>& scalars, k::options o) {
  k::runtime::ProgramCache cache(o);
  std::vector<k::Tensor> args = host_args;
  if (on_cuda())
    for (auto& t : args) t = t.to(k::cuda);
  std::vector<const k::Tensor*> argv;
  for (auto& t : args) argv.push_back(&t);
  k::runtime::CallShapes shapes;
  auto build = [&](auto& arg, k::runtime::LoweringStats& st) {
    return k::runtime::lower_graph(g, arg, [](Graph x) { return x; }, st);
  };
  Run r;
  r.entry = cache.get(argv.data(), static_cast<int>(argv.size()), nullptr, 0, build, shapes);
  r.outputs.resize(g.outputs.size());
  std::vector<double> sc = scalars;
  sc.push_back(0);  // never an empty array
  k::runtime::run_entry(*r.entry, argv.data(), sc.data(), r.outputs.data(), shapes, nullptr);
  return r;
}

std::string kernels_str(const Run& r) {
  std::string s;
  if (!r.entry) return s;
  for (const auto& kern : r.entry->program->kernels) s += kern.src.source + "\n";
  return s;
}

// How one output compares with the oracle: ok, or a line about its worst element.
struct Verdict {
  bool ok = true;
  std::string why;
};

Verdict compare(const k::Tensor& got, const k::reference::Value& want, const Node& n, double err) {
  Verdict v;
  if (!(got.shape() == n.shape) || got.dtype() != n.dt) {
    v.ok = false;
    v.why = "got " + got.str() + ", expected " + std::string(k::name(n.dt)) + n.shape.str();
    return v;
  }
  std::vector<double> a = k::reference::read(got).data;
  Tolerance t = tolerance(n.dt);
  double worst = -1;
  std::size_t at = 0, bad = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double x = a[i], y = want.data[i];
    double allowed = t.atol + t.rtol * std::abs(y) + 2 * err;
    double ratio = std::isnan(x) || std::isnan(y) ? (std::isnan(x) && std::isnan(y) ? 0 : INFINITY)
                   : std::isinf(x) || std::isinf(y) ? (x == y ? 0 : INFINITY)
                                                    : std::abs(x - y) / allowed;
    if (ratio > 1) ++bad;
    if (ratio > worst) {
      worst = ratio;
      at = i;
    }
  }
  if (bad) {
    std::ostringstream os;
    os.precision(10);
    os << bad << " of " << a.size() << " elements differ; worst at flat index " << at << ": kiln " << a[at] << ", oracle "
       << want.data[at] << ", allowed " << t.atol + t.rtol * std::abs(want.data[at]) + 2 * err << " (error bound " << err << ")";
    v.ok = false;
    v.why = os.str();
  }
  return v;
}

// The subgraph computing node `root` alone (its ancestors, in order), for printing and rerunning.
Graph extract(const Graph& g, int root) {
  std::vector<bool> need(g.size(), false);
  need[root] = true;
  for (int i = root; i >= 0; --i)
    if (need[i])
      for (int c = 0; c < g[i].n_in; ++c) need[g[i].in[c]] = true;
  Graph out;
  std::vector<int> map(g.size(), -1);
  for (int i = 0; i < g.size(); ++i) {
    if (!need[i]) continue;
    Node n = g[i];
    for (int c = 0; c < n.n_in; ++c) n.in[c] = map[n.in[c]];
    out.nodes.push_back(n);
    map[i] = out.size() - 1;
  }
  out.outputs = {map[root]};
  out.num_args = g.num_args;
  out.num_scalars = g.num_scalars;
  return out;
}

// Runs a single-output graph through kiln and the oracle: "" when they agree, else why not.
std::string check_alone(const Graph& g, const Generator& gen, const std::vector<Meta>& meta_of, int orig_root,
                        k::options o, Run* run_out) {
  try {
    Run r = run_kiln(g, gen.args, gen.scalars, o);
    if (run_out) *run_out = r;
    auto want = k::reference::eval_graph(g, gen.args, gen.scalars);
    Verdict v = compare(r.outputs[0], want[0], g[g.outputs[0]], meta_of[orig_root].err);
    return v.ok ? "" : v.why;
  } catch (const std::exception& e) {
    return std::string("exception: ") + e.what();
  }
}

// Shrinks a failing expression: descends to an input that fails by itself while it can, so the
// report shows the smallest failing subexpression (its inputs pass).
void report_failure(const Graph& g, const Generator& gen, int root, const std::string& why, k::options o,
                    const Run* program_run, const std::string& where) {
  std::ostringstream os;
  os << where << ": " << why << "\n--- the expression (output %" << root << " of the program) ---\n"
     << extract(g, root).str();
  int cur = root;
  std::string cur_why;
  Run alone;
  cur_why = check_alone(extract(g, cur), gen, gen.meta, cur, o, &alone);
  if (cur_why.empty()) {
    os << "--- alone it passes: the failure comes from sharing a program with other outputs ---\n";
    if (program_run) os << "--- the program's kernels ---\n" << kernels_str(*program_run);
    MESSAGE(os.str());
    return;
  }
  for (int budget = 12; budget > 0;) {
    bool descended = false;
    const Node& n = g[cur];
    for (int c = 0; c < n.n_in && budget > 0; ++c) {
      int child = n.in[c];
      if (k::info(g[child].op).cls == k::OpClass::leaf) continue;
      --budget;
      Run rc;
      std::string w = check_alone(extract(g, child), gen, gen.meta, child, o, &rc);
      if (!w.empty()) {
        cur = child;
        cur_why = w;
        alone = rc;
        descended = true;
        break;
      }
    }
    if (!descended) break;
  }
  os << "--- smallest failing subexpression (%" << cur << "): " << cur_why << " ---\n" << extract(g, cur).str();
  os << "--- its inputs ---\n";
  for (int i = 0; i < static_cast<int>(gen.args.size()); ++i)
    os << "  arg" << i << ": " << gen.args[i].str() << " strides " << gen.args[i].strides().str() << "\n";
  for (int i = 0; i < static_cast<int>(gen.scalars.size()); ++i) os << "  s" << i << " = " << gen.scalars[i] << "\n";
  os << "--- its kernels ---\n" << kernels_str(alone);
  MESSAGE(os.str());
}

}  // namespace

TEST_CASE("differential: random expression graphs through generated kernels agree with the f64 oracle") {
  const long total = env_long("KILN_DIFF_GRAPHS", 500);
  const long per_program = std::max(1L, env_long("KILN_DIFF_PER_PROGRAM", 25));
  const std::uint64_t seed = static_cast<std::uint64_t>(env_long("KILN_DIFF_SEED", 1));
  const long only = env_long("KILN_DIFF_PROGRAM", -1);
  const long programs = (total + per_program - 1) / per_program;
  const auto t0 = std::chrono::steady_clock::now();

  long expressions = 0, failures = 0, kernels = 0, compiles_before = static_cast<long>(k::runtime::host_compile_count());
  std::map<std::string, long> kinds, ops;
  double loosest = 0;  // the largest error bound relative to the output's magnitude
  long loose = 0;      // outputs whose error bound exceeds 1% of their magnitude
  long nonfinite = 0;  // NaN or infinite values anywhere in the oracle's evaluation
  int detailed = 0;    // failing programs reported in detail (shrunk, kernels printed)

  // Phase 1, on KILN_DIFF_JOBS threads (the host compiler is the cost): generate each program,
  // evaluate it with the oracle and with kiln. Phase 2, on this thread: compare and report.
  struct Result {
    std::unique_ptr<Generator> gen;
    k::options o;
    std::string where, oracle_error, kiln_error;
    std::vector<k::reference::Value> want;
    Run run;
    long count = 0;
  };
  std::vector<Result> results(static_cast<std::size_t>(programs));
  std::atomic<long> next{0};
  auto work = [&] {
    for (long p; (p = next++) < programs;) {
      if (only >= 0 && p != only) continue;
      Result& r = results[static_cast<std::size_t>(p)];
      r.count = std::min(per_program, total - p * per_program);
      r.o.shapes = p % 3 == 2 ? k::shapes::dynamic : k::shapes::static_;
      r.where = "KILN_DIFF_SEED=" + std::to_string(seed) + " KILN_DIFF_PROGRAM=" + std::to_string(p) +
                (r.o.shapes == k::shapes::dynamic ? " (dynamic shapes)" : " (static shapes)");
      try {
        r.gen = std::make_unique<Generator>(seed * 1000003u + static_cast<std::uint64_t>(p));
        for (long e = 0; e < r.count; ++e) {
          int depth = 2 + static_cast<int>((e * 7 + p) % 4);
          r.gen->g.outputs.push_back(r.gen->expression(depth));
        }
        Graph all = r.gen->g;  // the oracle's value of every node, for the error model
        all.outputs.clear();
        for (int i = 0; i < all.size(); ++i) all.outputs.push_back(i);
        std::vector<k::reference::Value> vals = k::reference::eval_graph(all, r.gen->args, r.gen->scalars);
        r.gen->refine(vals);
        for (int out : r.gen->g.outputs) r.want.push_back(vals[static_cast<std::size_t>(out)]);
      } catch (const std::exception& ex) {
        r.oracle_error = ex.what();
        continue;
      }
      try {
        r.run = run_kiln(r.gen->g, r.gen->args, r.gen->scalars, r.o);
      } catch (const std::exception& ex) {
        r.kiln_error = ex.what();
      }
    }
  };
  const long jobs = std::clamp(env_long("KILN_DIFF_JOBS", static_cast<long>(std::thread::hardware_concurrency())), 1L, 8L);
  {
    std::vector<std::thread> pool;
    for (long j = 0; j < jobs; ++j) pool.emplace_back(work);
    for (auto& t : pool) t.join();
  }

  for (long p = 0; p < programs; ++p) {
    if (only >= 0 && p != only) continue;
    Result& r = results[static_cast<std::size_t>(p)];
    const std::string& where = r.where;
    INFO(where);
    if (!r.oracle_error.empty() || !r.gen) {
      FAIL_CHECK("generating or evaluating with the oracle failed (a bug in the test?): " << r.oracle_error << "\n"
                                                                                       << (r.gen ? r.gen->g.str() : ""));
      ++failures;
      continue;
    }
    const Generator& gen = *r.gen;
    const Graph& g = gen.g;
    const k::options o = r.o;
    for (const auto& n : g.nodes) ++ops[std::string(k::name(n.op))];
    expressions += r.count;
    nonfinite += gen.nonfinite;
    if (!r.kiln_error.empty()) {
      // Find the expressions that fail on their own.
      FAIL_CHECK(where << ": the program failed: " << r.kiln_error);
      ++failures;
      if (detailed++ >= 3) continue;  // shrinking compiles a lot: the first few programs only
      int reported = 0;
      for (int out : g.outputs) {
        std::string why = check_alone(extract(g, out), gen, gen.meta, out, o, nullptr);
        if (!why.empty() && reported++ < 3) report_failure(g, gen, out, why, o, nullptr, where);
      }
      continue;
    }
    const Run& run = r.run;
    const auto& want = r.want;
    kernels += static_cast<long>(run.entry->program->kernels.size());
    for (const auto& kern : run.entry->program->kernels) ++kinds[k::schedule::kind_name(kern.src.kind)];
    int reported = 0;
    const long failures_before = failures;
    for (std::size_t i = 0; i < g.outputs.size(); ++i) {
      const int out = g.outputs[i];
      const Meta& mo = gen.meta[out];
      const double rel = mo.err / std::max(mo.v.maxabs(), 1e-3);
      loosest = std::max(loosest, rel);
      loose += rel > 0.01;
      if (rel > 0.01 && std::getenv("KILN_DIFF_SHOW_LOOSE")) MESSAGE("loose bound " << rel << ":\n" << extract(g, out).str());
      Verdict v = compare(run.outputs[i], want[i], g[out], mo.err);
      if (v.ok) continue;
      ++failures;
      FAIL_CHECK(where << " output " << i << " (%" << out << ", " << k::name(g[out].dt) << g[out].shape.str()
                       << "): " << v.why);
      if (reported++ < 3 && detailed < 3) report_failure(g, gen, out, v.why, o, &run, where + " output " + std::to_string(i));
    }
    detailed += failures > failures_before;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::ostringstream os;
  os << expressions << " random expressions in " << (only >= 0 ? 1 : programs) << " programs (seed " << seed << "): "
     << failures << " failing, " << kernels << " kernels (";
  for (auto& [kind, n] : kinds) os << kind << " " << n << " ";
  os << "), " << (static_cast<long>(k::runtime::host_compile_count()) - compiles_before) << " host compiles, " << seconds
     << " s; error bounds above 1% of the output's magnitude: " << loose << " (loosest " << loosest
     << "), non-finite values " << nonfinite << "\n  nodes by op:";
  for (auto& [op, n] : ops) os << " " << op << " " << n;
  MESSAGE(os.str());
  CHECK(failures == 0);
  CHECK_MESSAGE(nonfinite == 0, "the generator made non-finite values: it should guard them");
  if (only < 0) CHECK(expressions >= std::min(total, 500L));
}
