// The random graph generator of the differential test (tests/test_differential.cpp): expression
// graphs built at run time as graph::Graph node tables, their inputs, and for every node an interval
// of its values and a bound on the absolute error that kiln may legitimately add (the error model).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>
#include <kiln/testing.hpp>

namespace kiln_diff {

namespace k = kiln;
using k::Dims;
using k::Op;
using k::graph::Graph;
using k::graph::Node;

inline long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtol(v, nullptr, 10) : fallback;
}

// ---- tolerances and error model ---------------------------------------------------------------------

struct Tolerance {
  double rtol, atol;
};
inline Tolerance tolerance(k::dtype d) {
  switch (d) {
    case k::dtype::f64:
      return {1e-7, 1e-9};
    case k::dtype::f16:
      return {1e-2, 1e-2};
    case k::dtype::bf16:
      return {2e-2, 2e-2};
    default:
      return {1e-4, 1e-5};
  }
}

// Unit roundoff of the arithmetic kiln uses for a node of dtype d (f16/bf16 compute in f32).
inline double eps_compute(k::dtype d) { return d == k::dtype::f64 ? 1.2e-16 : 6e-8; }
// Rounding when a node's value is stored in its own dtype (f16/bf16 buffers at fusion boundaries).
inline double eps_store(k::dtype d) {
  switch (d) {
    case k::dtype::f16:
      return 4.9e-4;
    case k::dtype::bf16:
      return 3.9e-3;
    case k::dtype::f32:
      return 6e-8;
    default:
      return 0;
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

// What kind of program a generator makes (the test picks one per program).
struct Profile {
  bool special = false;    // NaN and +-inf in some float inputs: their positions must match exactly
  bool empty = false;      // a dim of size 0 (c), and size-1 dims
  bool resizable = false;  // no size-dependent attributes: the program runs again at two larger sizes
  bool gradient = false;   // small f64 inputs, differentiable ops only: checked by finite differences
  bool integers = true;    // i32, i64 and boolean inputs among the float ones
  bool strided = true;     // transposed and stepped views among the inputs
};

// The custom ops the generator uses (registered once): host loops over CPU tensors, as a user's
// function would be; on CUDA the inputs are copied to the host and the result back.
namespace ops {
inline k::Tensor host(const k::Tensor& t) { return t.device().is_cpu() ? t : t.to(k::cpu); }
inline void put_back(const k::Tensor& h, k::Tensor& out, k::Stream s) {
  if (out.device().is_cpu()) return;
  k::memory::copy(out.data_ptr(), out.device(), h.data_ptr(), k::cpu, out.nbytes(), s.handle());
  k::memory::synchronize(s.handle(), out.device());
}
inline double at(const k::Tensor& t, std::int64_t i) { return k::load_as_double(t.data_ptr(), t.dtype(), i); }
inline void put(const k::Tensor& t, std::int64_t i, double v) { k::store_from_double(t.data_ptr(), t.dtype(), i, v); }
// cube(x) = x^3
inline const k::CustomOp& cube() {
  static k::CustomOp op = k::custom_op(
      "diff_cube",
      {
          .inputs = 1,
          .forward =
              [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream s) {
                k::Tensor x = host(in[0]),
                          o = out.device().is_cpu() ? out : k::Tensor::empty(out.shape(), out.dtype(), k::cpu);
                for (std::int64_t i = 0; i < o.numel(); ++i) put(o, i, at(x, i) * at(x, i) * at(x, i));
                put_back(o, out, s);
              },
          .backward =
              [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream s) {
                k::Tensor x = host(in[0]), gh = host(g);
                k::Tensor o = grad_in[0].device().is_cpu()
                                  ? grad_in[0]
                                  : k::Tensor::empty(grad_in[0].shape(), grad_in[0].dtype(), k::cpu);
                for (std::int64_t i = 0; i < o.numel(); ++i) put(o, i, 3 * at(x, i) * at(x, i) * at(gh, i));
                put_back(o, grad_in[0], s);
              },
      });
  return op;
}
// scaled_tanh(x [..., C], w [C]) = tanh(x) * w
inline const k::CustomOp& scaled_tanh() {
  static k::CustomOp op = k::custom_op(
      "diff_scaled_tanh",
      {
          .inputs = 2,
          .infer =
              [](std::span<const k::TensorSpec> in) {
                if (in[0].shape.size() == 0 || !(in[1].shape == Dims{in[0].shape.back()}))
                  throw k::shape_error("diff_scaled_tanh: w must be [C] for x [..., C], got x " + in[0].shape.str() +
                                       " and w " + in[1].shape.str());
                return k::TensorSpec{in[0].shape, k::promote(in[0].dtype, in[1].dtype)};
              },
          .forward =
              [](std::span<const k::Tensor> in, k::Tensor& out, k::Stream s) {
                k::Tensor x = host(in[0]), w = host(in[1]);
                k::Tensor o = out.device().is_cpu() ? out : k::Tensor::empty(out.shape(), out.dtype(), k::cpu);
                const std::int64_t C = w.numel();
                for (std::int64_t i = 0; i < o.numel(); ++i) put(o, i, std::tanh(at(x, i)) * at(w, i % C));
                put_back(o, out, s);
              },
          .backward =
              [](std::span<const k::Tensor> in, const k::Tensor& g, std::span<k::Tensor> grad_in, k::Stream s) {
                k::Tensor x = host(in[0]), w = host(in[1]), gh = host(g);
                const std::int64_t C = w.numel();
                if (grad_in[0].defined()) {
                  k::Tensor o = grad_in[0].device().is_cpu()
                                    ? grad_in[0]
                                    : k::Tensor::empty(grad_in[0].shape(), grad_in[0].dtype(), k::cpu);
                  for (std::int64_t i = 0; i < o.numel(); ++i) {
                    const double t = std::tanh(at(x, i));
                    put(o, i, at(gh, i) * (1 - t * t) * at(w, i % C));
                  }
                  put_back(o, grad_in[0], s);
                }
                if (grad_in[1].defined()) {
                  k::Tensor o = grad_in[1].device().is_cpu()
                                    ? grad_in[1]
                                    : k::Tensor::empty(grad_in[1].shape(), grad_in[1].dtype(), k::cpu);
                  std::vector<double> dw(static_cast<std::size_t>(C), 0.0);
                  for (std::int64_t i = 0; i < gh.numel(); ++i)
                    dw[static_cast<std::size_t>(i % C)] += at(gh, i) * std::tanh(at(x, i));
                  for (std::int64_t c = 0; c < C; ++c) put(o, c, dw[static_cast<std::size_t>(c)]);
                  put_back(o, grad_in[1], s);
                }
              },
      });
  return op;
}
}  // namespace ops

// How an input is made, so that a resizable program can make it again at other sizes: its shape
// in terms of the program's sizes (0: a literal), dtype, values and layout.
struct ArgRecipe {
  Dims shape;
  std::vector<int> sym;  // per dim: 0 literal, 1 a, 2 b, 3 c
  k::dtype dt = k::f32;
  enum Values { randn, uniform01, ints, booleans, indices } values = randn;
  std::int64_t bound = 0;  // indices: values in [0, bound)
  enum Layout { contiguous, transposed, stepped, wrapped } layout = contiguous;
  std::int64_t wrap_offset = 0;
  bool special = false;  // a few NaN and +-inf
  std::uint64_t seed = 0;
};

class Generator {
 public:
  Generator(std::uint64_t seed, Profile pr = {}) : profile(pr), rng_(seed) {
    if (pr.gradient) {
      a_ = pick<std::int64_t>({2, 3});
      b_ = pick<std::int64_t>({4, 5, 7});
      c_ = 2;
    } else if (pr.resizable) {  // distinct, and none of the literals 1, 2, 3 that views use
      a_ = pick<std::int64_t>({4, 5, 7});
      b_ = pick<std::int64_t>({13, 17, 33, 129});
      c_ = pick<std::int64_t>({6, 9});
    } else {
      a_ = pick<std::int64_t>({1, 3, 5, 7});
      b_ = pick<std::int64_t>({13, 17, 33, 129, 1025});  // 1025: rows longer than a tile, several programs
      c_ = pick<std::int64_t>({1, 2, 3, 5});
      if (pr.empty) c_ = 0;
    }
    // The program's starting inputs; more are made on demand (weights, bias, broadcast partners).
    for (Dims s : {Dims{a_, b_}, Dims{b_}, Dims{a_, 1}, Dims{1, b_}, Dims{c_, a_, b_}, Dims{c_, 1, b_}, Dims{c_, a_, 1},
                   Dims{a_, b_}, Dims{1}})
      new_arg(s);
    if (pr.integers && !pr.gradient) {
      new_typed_arg({a_, b_}, pick({k::i32, k::i64}), ArgRecipe::ints);
      new_typed_arg(pick({Dims{a_, b_}, Dims{a_, 1}, Dims{c_, 1, b_}}), k::boolean, ArgRecipe::booleans);
      if (chance(0.5)) new_typed_arg({b_}, pick({k::i32, k::i64}), ArgRecipe::ints);
    }
  }

  Profile profile;
  std::vector<ArgRecipe> recipes;
  std::int64_t size_a() const { return a_; }
  std::int64_t size_b() const { return b_; }
  std::int64_t size_c() const { return c_; }

  // The inputs again at other sizes (a resizable program): same dtypes, layouts, kinds of values.
  std::vector<k::Tensor> args_at(std::int64_t a, std::int64_t b, std::int64_t c) const {
    std::vector<k::Tensor> out;
    for (const ArgRecipe& r : recipes) {
      ArgRecipe q = r;
      for (int d = 0; d < q.shape.size(); ++d)
        if (q.sym[static_cast<std::size_t>(d)])
          q.shape[d] = q.sym[static_cast<std::size_t>(d)] == 1 ? a : q.sym[static_cast<std::size_t>(d)] == 2 ? b : c;
      out.push_back(make_arg(q, buffers_));
    }
    return out;
  }

  // A tensor as a recipe says. Wrapped inputs live in `keep` (memory the caller owns).
  static k::Tensor make_arg(const ArgRecipe& r, std::vector<std::shared_ptr<std::vector<double>>>& keep) {
    const Dims& s = r.shape;
    const int rk = s.size();
    Dims base = s, st;
    std::int64_t offset = 0;
    switch (r.layout) {
      case ArgRecipe::transposed:  // a transposed view of the last two dims
        std::swap(base[rk - 1], base[rk - 2]);
        st = k::contiguous_strides(base);
        std::swap(st[rk - 1], st[rk - 2]);
        break;
      case ArgRecipe::stepped:  // every other element of a wider tensor, offset by one
        base[rk - 1] = 2 * s[rk - 1] + 1;
        st = k::contiguous_strides(base);
        st[rk - 1] = 2;
        offset = 1;
        break;
      case ArgRecipe::wrapped:  // the caller's memory, at an element offset (not 16-byte aligned)
        st = k::contiguous_strides(s);
        offset = r.wrap_offset;
        break;
      default:
        st = k::contiguous_strides(s);
    }
    const std::int64_t n = base.product();
    k::Tensor t = k::Tensor::empty({n + offset}, r.dt, k::cpu);
    std::mt19937_64 rng(r.seed);
    std::normal_distribution<double> normal;
    std::uniform_real_distribution<double> unit;
    for (std::int64_t i = 0; i < n + offset; ++i) {
      double v = 0;
      switch (r.values) {
        case ArgRecipe::randn:
          v = normal(rng);
          break;
        case ArgRecipe::uniform01:
          v = unit(rng);
          break;
        case ArgRecipe::ints:
          v = std::floor(unit(rng) * 17) - 8;
          break;
        case ArgRecipe::booleans:
          v = unit(rng) < 0.5;
          break;
        case ArgRecipe::indices:
          v = std::min<double>(std::floor(unit(rng) * static_cast<double>(r.bound)), static_cast<double>(r.bound - 1));
          break;
      }
      if (r.special && unit(rng) < 0.04) v = std::array<double, 3>{NAN, INFINITY, -INFINITY}[rng() % 3];
      k::store_from_double(t.data_ptr(), r.dt, i, v);
    }
    if (r.layout == ArgRecipe::wrapped) {
      auto buf = std::make_shared<std::vector<double>>(
          static_cast<std::size_t>(n + offset) * k::itemsize(r.dt) / sizeof(double) + 2);
      std::memcpy(buf->data(), t.data_ptr(), static_cast<std::size_t>(n + offset) * k::itemsize(r.dt));
      keep.push_back(buf);
      char* p = reinterpret_cast<char*>(buf->data()) + offset * static_cast<std::int64_t>(k::itemsize(r.dt));
      return k::Tensor::wrap(p, s, r.dt, k::cpu, st);
    }
    return t.as_strided(s, st, offset);
  }

  Graph g;
  k::graph::CseIndex cse;  // g's nodes by structure (nodes the generator added)
  std::vector<Meta> meta;
  std::vector<k::Tensor> args;
  std::vector<double> scalars;

  // A scalar-valued graph for gradient checks: the sum of several random expressions' sums or means.
  int scalar_value(int count, int depth) {
    int total = -1;
    for (int i = 0; i < count; ++i) {
      int e = expression(depth);
      if (e >= 0 && g[e].dt != k::f64) e = add(mk(Op::cast, {e}, dt_attrs(k::f64)));
      k::Attrs at;
      at.all = true;
      int s = add(mk(chance(0.5) ? Op::sum : Op::mean, {e}, at));
      if (s < 0) continue;
      total = total < 0 ? s : add(mk(Op::add, {total, s}));
    }
    return total;
  }

  // One random expression, returned as a non-leaf node not already an output; -1 when a few tries
  // find none (an unbounded retry hung, and a failed add() gave -1, read as a node).
  int expression(int depth) {
    int root = gen(depth);
    if (root < 0) root = leaf();
    auto unusable = [&](int r) {
      return r < 0 || k::info(g[r].op).cls == k::OpClass::leaf || std::count(g.outputs.begin(), g.outputs.end(), r) ||
             g[r].dt == k::dtype::boolean;
    };
    for (int tries = 0; tries < 32 && unusable(root); ++tries) {
      const int base = root < 0 ? leaf() : root;
      int r = unary(base);
      if (r < 0 || r == base) r = add(mk(Op::neg, {squash(base, 8)}));
      root = r;
    }
    return unusable(root) ? -1 : root;
  }

 private:
  std::mt19937_64 rng_;
  std::int64_t a_, b_, c_;
  mutable std::vector<std::shared_ptr<std::vector<double>>> buffers_;  // wrapped inputs' memory
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

  // Checked: a generator bug reading node -1 is a reported failure, not a crash of the whole run.
  const Dims& shape(int id) const {
    if (id < 0 || id >= g.size()) throw std::logic_error("differential generator: no node " + std::to_string(id));
    return g[id].shape;
  }
  int rank(int id) const { return shape(id).size(); }
  const Meta& m(int id) const { return meta[id]; }

  // -- nodes
  static k::Attrs dt_attrs(k::dtype d) {
    k::Attrs at;
    at.dt = d;
    return at;
  }
  static k::Attrs ab_attrs(std::int64_t a, std::int64_t b) {
    k::Attrs at;
    at.a = a;
    at.b = b;
    return at;
  }
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
    const std::uint64_t key = k::graph::structure_key(n);
    if (int twin = cse.find(g, n, key); twin >= 0) return twin;
    g.nodes.push_back(n);
    const int id = g.size() - 1;
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
    cse.insert(key, id);
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
  // Which of the program's sizes each dim is (0: a literal), by value.
  std::vector<int> symbols_of(const Dims& s) const {
    std::vector<int> sym;
    for (auto d : s) sym.push_back(!profile.resizable ? 0 : d == a_ ? 1 : d == b_ ? 2 : d == c_ ? 3 : 0);
    return sym;
  }
  // A resizable program's new inputs may only have dims that are its sizes or 1 (broadcast).
  bool resizable_ok(const Dims& s) const {
    if (!profile.resizable) return true;
    auto sym = symbols_of(s);
    for (int i = 0; i < s.size(); ++i)
      if (!sym[static_cast<std::size_t>(i)] && s[i] != 1) return false;
    return true;
  }

  int push_arg(ArgRecipe r) {
    r.sym = symbols_of(r.shape);
    args.push_back(make_arg(r, buffers_));
    recipes.push_back(r);
    g.num_args = static_cast<int>(args.size());
    Node n;
    n.op = Op::arg;
    n.slot = static_cast<int>(args.size()) - 1;
    return add(n);
  }

  // A new input of this shape: randn or uniform values, a random float dtype (f64 in gradient
  // programs), sometimes strided, at a storage offset, or the caller's wrapped memory; in special
  // programs sometimes with NaN and infinities.
  int new_arg(const Dims& s, bool force_f32 = false) {
    if (!resizable_ok(s)) return -1;
    ArgRecipe r;
    r.shape = s;
    r.dt = profile.gradient ? k::f64 : force_f32 ? k::f32 : pick({k::f32, k::f32, k::f32, k::f64, k::f16, k::bf16});
    r.seed = rng_();
    r.values = chance(0.15) ? ArgRecipe::uniform01 : ArgRecipe::randn;
    const int rk = s.size();
    if (rk >= 2 && chance(0.2) && profile.strided)
      r.layout = ArgRecipe::transposed;
    else if (rk >= 1 && chance(0.15) && profile.strided)
      r.layout = ArgRecipe::stepped;
    else if (chance(0.1)) {
      r.layout = ArgRecipe::wrapped;
      r.wrap_offset = pick<std::int64_t>({1, 3, 5});
    }
    r.special = profile.special && !force_f32 && chance(0.5);
    return push_arg(r);
  }
  // An integer, boolean or index input.
  int new_typed_arg(const Dims& s, k::dtype dt, ArgRecipe::Values values, std::int64_t bound = 0) {
    if (!resizable_ok(s)) return -1;
    ArgRecipe r;
    r.shape = s;
    r.dt = dt;
    r.values = values;
    r.bound = bound;
    r.seed = rng_();
    if (s.size() >= 2 && chance(0.2) && profile.strided)
      r.layout = ArgRecipe::transposed;
    else if (s.size() >= 1 && chance(0.15) && profile.strided)
      r.layout = ArgRecipe::stepped;
    return push_arg(r);
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
      for (int i = drop; i < s.size(); ++i) t.push_back(chance(0.3) || !resizable_ok({s[i]}) ? 1 : s[i]);
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
    if (r < 0.78) return cast(gen(depth - 1));
    if (r < 0.88) return composite(gen(depth - 1));
    if (r < 0.95) return extra(gen(depth - 1), depth - 1);
    if (r < 0.97 && profile.integers && !profile.gradient) return integral(depth - 1);
    return scaled(gen(depth - 1));
  }

  // ---- integer and boolean values: exact on both sides (small values, no overflow) -------------
  int int_leaf() {
    std::vector<int> ints;
    for (int i = 0; i < static_cast<int>(args.size()); ++i)
      if (args[i].dtype() == k::i32 || args[i].dtype() == k::i64) ints.push_back(i);
    if (ints.empty() || chance(0.2)) {
      Dims s = pick({Dims{a_, b_}, Dims{a_, 1}, Dims{b_}, Dims{c_, a_, b_}});
      int id = new_typed_arg(s, pick({k::i32, k::i64}), ArgRecipe::ints);
      if (id >= 0) return id;
    }
    if (ints.empty()) return -1;
    return arg_node(ints[uniform(0, static_cast<int>(ints.size()) - 1)]);
  }
  int bool_leaf(const Dims& s) {
    std::vector<int> fits;
    for (int i = 0; i < static_cast<int>(args.size()); ++i)
      if (args[i].dtype() == k::boolean && compatible(s, args[i].shape()) &&
          k::broadcast_shapes(s, args[i].shape(), "t") == s)
        fits.push_back(i);
    if (!fits.empty() && chance(0.7)) return arg_node(fits[uniform(0, static_cast<int>(fits.size()) - 1)]);
    Dims t;
    for (int i = 0; i < s.size(); ++i) t.push_back(chance(0.3) || !resizable_ok({s[i]}) ? 1 : s[i]);
    return new_typed_arg(t, k::boolean, ArgRecipe::booleans);
  }
  bool small_int(int id, double limit = 1e6) const { return id >= 0 && m(id).v.maxabs() <= limit; }
  // An i32/i64 expression: inputs, views, + - * max min neg abs, sums (i64), where over a boolean
  // input, casts of exact float values (not in special programs: NaN to int is undefined in C++).
  int integral(int depth) {
    if (depth <= 0 || chance(0.25)) return chance(0.3) ? view(int_leaf()) : int_leaf();
    int x = integral(depth - 1);
    if (x < 0 || k::is_floating(g[x].dt)) return x;
    double r = real(0, 1);
    if (r < 0.15) return add(mk(pick({Op::neg, Op::abs}), {x}));
    if (r < 0.45) {
      int y = chance(0.6) ? integral(depth - 1) : int_leaf();
      if (y < 0 || !compatible(shape(x), shape(y))) return x;
      Op op = pick({Op::add, Op::sub, Op::mul, Op::maximum, Op::minimum});
      if (op == Op::mul && m(x).v.maxabs() * m(y).v.maxabs() > 3e4) op = Op::add;
      return add(mk(op, {x, y}));
    }
    if (r < 0.6 && rank(x) > 0) {
      k::Attrs at = reduce_attrs(rank(x));
      Op op = pick({Op::sum, Op::amax, Op::amin});
      if (op == Op::sum && reduced_count(x, at, op) * m(x).v.maxabs() > 3e4) op = Op::amax;
      int red = add(mk(op, {x}, at));
      return red < 0 ? x : red;
    }
    if (r < 0.72) {
      int c = bool_leaf(shape(x));
      int y = int_leaf();
      if (c < 0 || y < 0 || !compatible(shape(x), shape(y))) return x;
      return add(mk(Op::where, {c, x, y}));
    }
    if (r < 0.84 && !profile.special) {
      k::Attrs at;
      at.dt = pick({k::i32, k::i64});
      int e = gen_exact(depth - 1);
      if (e < 0 || !k::is_floating(g[e].dt) || m(e).v.maxabs() > 3e4) return x;
      return add(mk(Op::cast, {e}, at));
    }
    if (r < 0.92) {  // a sum over booleans (i64) or a boolean cast to a number
      int c = bool_leaf(shape(x));
      if (c < 0) return x;
      if (chance(0.5)) {
        k::Attrs at;
        at.dt = pick({k::i32, k::i64, k::f32, k::f16});
        return add(mk(Op::cast, {c}, at));
      }
      return rank(c) > 0 ? add(mk(Op::sum, {c}, reduce_attrs(rank(c)))) : x;
    }
    return view(x);
  }

  // ---- matmul, rms_norm, cross_entropy, gather and custom ops ---------------------------------
  int extra(int x, int depth) {
    if (x < 0) return -1;
    if (!k::is_floating(g[x].dt)) x = add(mk(Op::cast, {x}, dt_attrs(profile.gradient ? k::f64 : k::f32)));
    if (x < 0) return -1;
    const int r = rank(x);
    switch (uniform(0, 5)) {
      case 0:
        return matmul(x);
      case 1: {  // rms_norm(x * s + r, w): rows of r have an rms of at least 0.5
        if (r == 0 || shape(x).back() < 2) return unary(x);
        std::int64_t d = shape(x).back();
        int xs = add(mk(Op::mul, {x, constant(0.1 / std::max(1.0, m(x).v.maxabs()))}));
        int rr = new_or_existing({d}, true);
        int w = new_or_existing({d}, false);
        int eps = chance(0.5) ? scalar(pick({1e-6, 1e-3})) : constant(1e-6);
        return add(mk(Op::rms_norm, {add(mk(Op::add, {xs, rr})), w, eps}));
      }
      case 2: {  // cross_entropy(logits [N, C], targets [N])
        if (r != 2 || shape(x)[1] == 0) return matmul(x);
        x = squash(x, 20);
        int t = new_typed_arg({shape(x)[0]}, k::i64, ArgRecipe::indices, shape(x)[1]);
        return add(mk(Op::cross_entropy, {x, t}));
      }
      case 3: {  // gather along the last dim
        if (r == 0 || shape(x).back() == 0) return unary(x);
        Dims is = shape(x);
        const std::int64_t C = is.back();
        is[is.size() - 1] = pick<std::int64_t>({1, 3, C});
        if (profile.resizable && is[is.size() - 1] == 3) is[is.size() - 1] = 1;
        int idx = new_typed_arg(is, pick({k::i32, k::i64}), ArgRecipe::indices, C);
        return add(mk(Op::gather, {x, idx}));
      }
      case 4: {  // custom ops: opaque extern steps between fused kernels
        k::Attrs at;
        if (chance(0.5) || r == 0) {
          at.custom = ops::cube().id();
          return add(mk(Op::custom, {squash(x, 3)}, at));
        }
        at.custom = ops::scaled_tanh().id();
        int w = new_or_existing({shape(x).back()}, false);
        return add(mk(Op::custom, {x, w}, at));
      }
      default:
        return binary(x, depth);
    }
  }

  int matmul(int x) {
    if (x < 0) return -1;
    x = squash(x, 4);
    const int r = rank(x);
    if (r == 1) x = add(mk(Op::unsqueeze, {x}, ab_attrs(0, 0)));
    if (x < 0 || r == 0 || r > 3) return unary(x);
    const Dims s = shape(x);
    const std::int64_t K = s.back();
    std::int64_t N = b_ <= 129 ? pick<std::int64_t>({a_, b_, 1, 3}) : pick<std::int64_t>({a_, 1, 3});
    if (profile.resizable && N == 3) N = a_;
    if (s.product() / std::max<std::int64_t>(K, 1) * N > 40000) N = 1;
    int w;
    if (rank(x) == 3 && chance(0.4)) {
      w = new_or_existing({s[0], K, N}, false);
    } else if (chance(0.3)) {  // B^T: a transposed view of an [N, K] input
      int t = new_or_existing({N, K}, false);
      w = add(mk(Op::transpose, {t}, ab_attrs(0, 1)));
    } else {
      w = new_or_existing({K, N}, false);
    }
    if (w >= 0 && m(w).v.maxabs() > 4) w = squash(w, 4);
    return add(mk(Op::matmul, {x, w}));
  }

  // A value that the oracle and kiln compute exactly alike (no rounding anywhere): inputs, views,
  // neg/abs/relu, maximum/minimum, amax/amin and casts of such values. Comparisons read these.
  int gen_exact(int depth) {
    if (depth <= 0 || chance(0.3)) return chance(0.3) ? view(leaf()) : leaf();
    int x = gen_exact(depth - 1);
    if (x < 0) return -1;  // (shape(-1) read before the node table: a fresh seed crashed here)
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
    at.dt = profile.gradient ? k::f64 : pick({k::f32, k::f64, k::f16, k::bf16});
    return add(mk(Op::cast, {x}, at));
  }

  int unary(int x) {
    if (x < 0) return -1;
    x = squash(x);
    const Meta mx = m(x);
    auto plus_one = [&](int v) { return add(mk(Op::add, {add(mk(Op::abs, {v})), constant(1)})); };
    switch (uniform(0, 19)) {
      case 0:
        return mx.v.maxabs() <= 6 ? add(mk(Op::exp, {x}))
                                  : add(mk(Op::exp, {add(mk(Op::neg, {add(mk(Op::abs, {x}))}))}));
      case 1:
        return add(mk(Op::log, {plus_one(x)}));
      case 2:
        return mx.err == 0 ? add(mk(Op::sqrt, {add(mk(Op::abs, {x}))})) : add(mk(Op::sqrt, {plus_one(x)}));
      case 3:
        return add(mk(Op::tanh, {x}));
      case 4:
        return add(mk(Op::sigmoid, {x}));
      case 5:
        return add(mk(Op::erf, {x}));
      case 6:
        return add(mk(Op::sin, {x}));
      case 7:
        return add(mk(Op::relu, {x}));
      case 8:
        return add(mk(Op::neg, {x}));
      case 9:
        return add(mk(Op::square, {squash(x, 30)}));
      case 10:
        return add(mk(Op::abs, {x}));
      case 11:
        return add(mk(Op::reciprocal, {plus_one(x)}));
      case 12:
        return add(mk(Op::cos, {x}));
      case 13:
        return add(mk(Op::log1p, {add(mk(Op::abs, {x}))}));
      case 14:
        return add(mk(Op::rsqrt, {plus_one(x)}));
      case 15:
        return add(mk(Op::expm1, {squash(x, 5)}));
      case 16:
        return add(mk(Op::exp2, {squash(x, 6)}));
      case 17:
        return add(mk(Op::log2, {plus_one(x)}));
      case 18:
        return add(mk(Op::pow, {plus_one(squash(x, 3)), number(pick({0.5, 2.0, 3.0, -1.0, 1.5, -0.5}))}));
      default:
        return add(mk(Op::tanh, {add(mk(Op::mul, {x, number(nice_value(-2, 2))}))}));
    }
  }

  int binary(int a, int depth) {
    if (a < 0) return -1;
    a = squash(a);
    int b = squash(operand_for(shape(a), depth));
    switch (uniform(0, 5)) {
      case 0:
        return add(mk(Op::add, {a, b}));
      case 1:
        return add(mk(Op::sub, {a, b}));
      case 2:
        return add(mk(Op::mul, {a, b}));
      case 3:
        return add(mk(Op::div, {a, add(mk(Op::add, {add(mk(Op::abs, {b})), constant(1)}))}));
      case 4:
        return add(mk(Op::maximum, {a, b}));
      default:
        return add(mk(Op::minimum, {a, b}));
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
    int c = profile.integers && chance(0.2) ? bool_leaf(ab) : add(mk(cmp, {p, q}));
    if (c < 0 || !compatible(shape(c), ab)) c = add(mk(Op::gt, {p, constant(0)}));
    return chance(0.5) ? add(mk(Op::where, {c, a, b})) : add(mk(Op::where, {c, b, a}));
  }

  int scaled(int x) {
    if (x < 0) return -1;
    x = squash(x);
    return add(mk(pick({Op::add, Op::mul, Op::sub}),
                  {add(mk(Op::mul, {x, number(nice_value(-2, 2))})), number(nice_value(-2, 2))}));
  }

  int cast(int x) {
    if (x < 0) return -1;
    k::Attrs at;
    at.dt = pick({k::f32, k::f64, k::f16, k::bf16});
    if (at.dt == g[x].dt) at.dt = at.dt == k::f32 ? k::f16 : k::f32;
    if (profile.gradient) {  // rounding would swamp the finite differences
      if (g[x].dt == k::f64) return unary(x);
      at.dt = k::f64;
    }
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
        if (c < 0.25 || profile.resizable) {  // (resizable: only a flatten, whatever the sizes)
          t = {chance(0.5) || profile.resizable ? -1 : s.product()};
        } else if (c < 0.5 && r >= 2) {
          int d = uniform(0, r - 2);
          for (int i = 0; i < r; ++i) {
            if (i == d)
              t.push_back(s[i] * s[i + 1]);
            else if (i != d + 1)
              t.push_back(s[i]);
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
        if (profile.resizable) {  // bounds that mean the same at every size
          at.b = std::min<std::int64_t>(start, 1);
          at.c = pick<std::int64_t>({-1, 10000});
        }
        return add(mk(Op::slice, {x}, at));
      }
      case 5: {  // expand a size-1 dim, or add a leading dim
        Dims t = s;
        bool any = false;
        for (int i = 0; i < r; ++i)
          if (s[i] == 1 && chance(0.7)) {
            t[i] = profile.resizable ? pick<std::int64_t>({2, 3}) : pick<std::int64_t>({2, 3, a_, b_});
            any = true;
          }
        if (!any || (r < 3 && chance(0.3))) t.insert(0, pick<std::int64_t>({2, 3}));
        if (t.product() > 40000) break;
        if (chance(0.3) || profile.resizable)  // (resizable: kept sizes as -1, whatever they are)
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
            if (chance(0.5))
              at.all = true;
            else
              at.a = i;
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
      const bool log = chance(0.5);
      return add(mk(log ? Op::log_softmax : Op::softmax, {x}, at));
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
      if (spread && !(args[i].dtype() == (profile.gradient ? k::f64 : k::f32) &&
                      !recipes[static_cast<std::size_t>(i)].special && row_std(args[i]) >= 0.5))
        continue;
      if (!k::is_floating(args[i].dtype()) ||
          (!spread && recipes[static_cast<std::size_t>(i)].values == ArgRecipe::indices))
        continue;
      if (chance(0.7)) return arg_node(i);
    }
    for (int tries = 0; tries < 20; ++tries) {
      int id = new_arg(s, spread);
      if (id < 0 || !spread || row_std(args[g[id].slot]) >= 0.5) return id;
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
          nonfinite += !profile.special && !profile.empty;  // those programs make them on purpose
          continue;
        }
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
      actual[i] = lo <= hi ? Interval{lo, hi} : Interval{0, 0};
      if (g[i].op == Op::layer_norm || g[i].op == Op::rms_norm) {
        const bool rms = g[i].op == Op::rms_norm;
        const auto& x = vals[g[i].in[0]];
        const std::size_t d = static_cast<std::size_t>(x.shape.back());
        double smin = INFINITY;
        for (std::size_t r = 0; d > 0 && r < x.data.size() / d; ++r) {
          double mean = 0, ss = 0;
          for (std::size_t j = 0; j < d; ++j) mean += x.data[r * d + j];
          mean = rms ? 0 : mean / static_cast<double>(d);
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

  // Integer and boolean values are exact on both sides (the generator keeps them small).
  Meta analyze(int id) {
    Meta r = analyze_value(id);
    if (!k::is_floating(g[id].dt)) r.err = 0;
    return r;
  }
  Meta analyze_value(int id) {
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
        double lo = INFINITY, hi = -INFINITY;
        for (double v : k::reference::read(args[n.slot]).data)
          if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
        out.v = lo <= hi ? Interval{lo, hi} : Interval{0, 0};
        return out;
      }
      case Op::scalar:
        out.v = {scalars[n.slot], scalars[n.slot]};
        return out;
      case Op::constant:
        out.v = {n.value, n.value};
        return out;
      default:
        break;
    }
    const Interval x = in(0).v;
    const double e = in(0).err;
    switch (n.op) {
      case Op::neg:
        out.v = {-x.hi, -x.lo};
        out.err = e;
        return out;
      case Op::abs:
        out.v = {x.lo <= 0 && x.hi >= 0 ? 0 : std::min(std::abs(x.lo), std::abs(x.hi)), x.maxabs()};
        out.err = e;
        return out;
      case Op::relu:
        out.v = {std::max(x.lo, 0.0), std::max(x.hi, 0.0)};
        out.err = e;
        return out;
      case Op::exp:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::exp(t); }), std::exp(x.hi) * e);
      case Op::exp2:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::exp2(t); }), std::exp2(x.hi) * 0.7 * e);
      case Op::expm1:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::expm1(t); }), std::exp(x.hi) * e);
      case Op::log:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::log(t); }), e / x.lo);
      case Op::log2:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::log2(t); }), 1.5 * e / x.lo);
      case Op::log1p:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::log1p(t); }), e / (1 + x.lo));
      case Op::sqrt:
        return rounded(mono(x.lo, x.hi, [](double t) { return std::sqrt(t); }),
                       x.lo > 0 ? e / (2 * std::sqrt(x.lo)) : std::sqrt(e));
      case Op::rsqrt:
        return rounded(mono(x.lo, x.hi, [](double t) { return 1 / std::sqrt(t); }), 0.5 * e / (x.lo * std::sqrt(x.lo)));
      case Op::reciprocal:
        return rounded(mono(x.lo, x.hi, [](double t) { return 1 / t; }), e / (x.lo * x.lo));
      case Op::square: {
        Interval v{x.lo <= 0 && x.hi >= 0 ? 0 : std::min(x.lo * x.lo, x.hi * x.hi), x.maxabs() * x.maxabs()};
        return rounded(v, 2 * x.maxabs() * e + e * e);
      }
      case Op::sin:
      case Op::cos:
        return rounded({-1, 1}, e);
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
      case Op::add:
      case Op::sub:
      case Op::mul:
      case Op::div:
      case Op::maximum:
      case Op::minimum:
      case Op::pow: {
        const Interval y = in(1).v;
        const double f = in(1).err;
        switch (n.op) {
          case Op::add:
            return rounded({x.lo + y.lo, x.hi + y.hi}, e + f);
          case Op::sub:
            return rounded({x.lo - y.hi, x.hi - y.lo}, e + f);
          case Op::mul: {
            double c[] = {x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi};
            return rounded({*std::min_element(c, c + 4), *std::max_element(c, c + 4)},
                           y.maxabs() * e + x.maxabs() * f + e * f);
          }
          case Op::div: {  // the denominator is |b| + 1 >= 1
            double ymin = std::min(std::abs(y.lo), std::abs(y.hi));
            double c[] = {x.lo / y.lo, x.lo / y.hi, x.hi / y.lo, x.hi / y.hi};
            return rounded({*std::min_element(c, c + 4), *std::max_element(c, c + 4)},
                           e / ymin + x.maxabs() / (ymin * ymin) * f);
          }
          case Op::maximum:
            out.v = {std::max(x.lo, y.lo), std::max(x.hi, y.hi)};
            out.err = std::max(e, f);
            return out;
          case Op::minimum:
            out.v = {std::min(x.lo, y.lo), std::min(x.hi, y.hi)};
            out.err = std::max(e, f);
            return out;
          default: {  // pow(base >= 1, exponent)
            double p = y.lo;
            Interval v = mono(x.lo, x.hi, [p](double t) { return std::pow(t, p); });
            double slope = std::abs(p) * std::max(std::pow(x.lo, p - 1), std::pow(x.hi, p - 1));
            return rounded(v, slope * e + v.maxabs() * std::log(x.hi) * f);
          }
        }
      }
      case Op::lt:
      case Op::le:
      case Op::gt:
      case Op::ge:
      case Op::eq:
      case Op::ne:
        out.v = {0, 1};
        return out;
      case Op::where:
        out.v = {std::min(in(1).v.lo, in(2).v.lo), std::max(in(1).v.hi, in(2).v.hi)};
        out.err = std::max(in(1).err, in(2).err);
        return out;
      case Op::reshape:
      case Op::permute:
      case Op::slice:
      case Op::expand:
      case Op::transpose:
      case Op::unsqueeze:
      case Op::squeeze:
        return in(0);
      case Op::amax:
      case Op::amin:
        return in(0);
      default:
        break;
    }
    // Reductions and composites: nr is the number of reduced elements.
    const double nr = n.op == Op::layer_norm || n.op == Op::rms_norm || n.op == Op::cross_entropy || n.op == Op::matmul
                          ? static_cast<double>(shape(n.in[0]).size() ? shape(n.in[0]).back() : 1)
                      : n.op == Op::softmax || n.op == Op::log_softmax || n.op == Op::logsumexp || n.op == Op::sum ||
                              n.op == Op::mean || n.op == Op::var
                          ? static_cast<double>(reduced_count(n.in[0], n.attrs, n.op))
                          : 1;
    const double acc = 8 * nr * ec;  // accumulation over nr elements, relative to their magnitude
    switch (n.op) {
      case Op::sum:
        return rounded({nr * x.lo, nr * x.hi}, nr * e + acc * x.maxabs());
      case Op::mean:
        return rounded(x, e + acc * x.maxabs());
      case Op::var: {
        double corr = in(1).v.lo, d = x.hi - x.lo, scale = nr / std::max(nr - corr, 1.0);
        return rounded({0, d * d * scale}, 4 * d * e * scale + acc * d * d * scale);
      }
      case Op::softmax:
        return rounded({0, 1}, 2 * e + acc);
      case Op::log_softmax:
        return rounded({x.lo - x.hi - std::log(nr), 0}, 2 * e + acc * (1 + x.maxabs()));
      case Op::logsumexp:
        return rounded({x.lo, x.hi + std::log(nr)}, e + acc * (1 + x.maxabs()));
      case Op::rms_norm: {  // rows x * s + r with rms(r) >= 0.5 (known exactly once the oracle has run)
        const Meta& w = in(1);
        const double sd = refining_ ? std::max(ln_min_std_[id], 1e-3) : 0.4;
        double bound = w.v.maxabs() * std::sqrt(nr);
        return rounded({-bound, bound}, e * w.v.maxabs() * 3 / sd + w.err * std::sqrt(nr) + acc * bound);
      }
      case Op::matmul: {  // a sum of nr products
        const Meta& w = in(1);
        const double xm = x.maxabs(), wm = w.v.maxabs(), bound = nr * xm * wm;
        return rounded({-bound, bound}, nr * (xm * w.err + wm * e + e * w.err) + acc * xm * wm);
      }
      case Op::cross_entropy:  // the mean of logsumexp(row) - row[target]
        return rounded({0, x.hi - x.lo + std::log(std::max(nr, 1.0))},
                       2 * e + acc * (1 + x.maxabs()) + 8 * ec * (1 + x.maxabs()) * nr);
      case Op::gather:
        return in(0);
      case Op::custom: {
        if (n.attrs.custom == ops::cube().id()) {
          const double xm = x.maxabs();
          return rounded({-xm * xm * xm, xm * xm * xm}, 3 * xm * xm * e + 3 * xm * e * e + e * e * e);
        }
        const Meta& w = in(1);
        return rounded({-w.v.maxabs(), w.v.maxabs()}, e * w.v.maxabs() + w.err);
      }
      case Op::layer_norm: {
        // Rows are x * s + r with std(r) >= 0.5 and |x * s| <= 0.1: the row std is >= 0.4 (and
        // known exactly once the oracle has run).
        const Meta &w = in(1), &b = in(2);
        const double sd = refining_ ? std::max(ln_min_std_[id], 1e-3) : 0.4;
        double bound = w.v.maxabs() * std::sqrt(nr) + b.v.maxabs();
        return rounded({-bound, bound}, e * w.v.maxabs() * 3 / sd + w.err * std::sqrt(nr) + b.err + acc * bound);
      }
      case Op::gelu:
        return rounded({std::min(x.lo, -0.2), std::max(x.hi, 0.0)}, 1.13 * e);
      case Op::silu:
        return rounded({std::min(x.lo, -0.3), std::max(x.hi, 0.0)}, 1.1 * e);
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

}  // namespace kiln_diff
