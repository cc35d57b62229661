// The oracle: an unfused, obviously-correct evaluator of a flattened graph, in f64 on the host.
// Every op of expr/op.hpp is computed straight from its definition (composites included: they are
// NOT decomposed here, so that comparing against the oracle checks the decomposition rules too;
// custom ops through the user's own functions on CPU tensors).
// Values stay in f64 whatever the node's floating dtype; integral and boolean nodes are rounded
// to their dtype after each node so integer arithmetic is exact. Casts to f32/f16/bf16 round
// through the target type. Speed is not a goal; clarity is.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numbers>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../core/tensor.hpp"
#include "../expr/assign.hpp"
#include "../expr/ops.hpp"
#include "../graph/flatten.hpp"
#include "../graph/graph.hpp"
#include "../graph/infer.hpp"

namespace kiln::reference {

// One evaluated node: a contiguous row-major buffer of doubles with its shape and (logical) dtype.
struct Value {
  Dims shape;
  std::vector<double> data;
  kiln::dtype dt = kiln::dtype::f64;

  std::int64_t numel() const { return shape.product(); }
};

namespace detail {

inline constexpr double nan = std::numeric_limits<double>::quiet_NaN();
inline constexpr double inf = std::numeric_limits<double>::infinity();

// Rounds an integral or boolean value to its dtype (floating dtypes are left in f64).
inline double round_integral(kiln::dtype d, double v) {
  switch (d) {
    case kiln::dtype::boolean:
      return v != 0 ? 1.0 : 0.0;
    case kiln::dtype::i64: {
      if (std::isnan(v)) return 0;
      v = std::trunc(v);
      constexpr double lim = 9223372036854775808.0;  // 2^63
      return std::clamp(v, -lim, std::nextafter(lim, 0.0));
    }
    case kiln::dtype::i32: {
      if (std::isnan(v)) return 0;
      v = std::trunc(v);
      if (std::abs(v) >= 9223372036854775808.0) return v < 0 ? -2147483648.0 : 2147483647.0;
      // Two's-complement wrap-around, as 32-bit integer arithmetic does.
      auto w = static_cast<std::uint32_t>(static_cast<std::uint64_t>(static_cast<std::int64_t>(v)));
      return static_cast<double>(static_cast<std::int32_t>(w));
    }
    default:
      return v;
  }
}

// Rounds a value through a dtype (a cast): floating types round once, integers truncate.
inline double round_to(kiln::dtype d, double v) {
  switch (d) {
    case kiln::dtype::f64:
      return v;
    case kiln::dtype::f32:
      return static_cast<double>(static_cast<float>(v));
    case kiln::dtype::f16:
      return static_cast<double>(static_cast<float>(kiln::half(static_cast<float>(v))));
    case kiln::dtype::bf16:
      return static_cast<double>(static_cast<float>(kiln::bfloat16(static_cast<float>(v))));
    default:
      return round_integral(d, v);
  }
}

// PyTorch's maximum/minimum: NaN in either operand gives NaN.
inline double nan_max(double a, double b) { return std::isnan(a) || std::isnan(b) ? nan : (a > b ? a : b); }
inline double nan_min(double a, double b) { return std::isnan(a) || std::isnan(b) ? nan : (a < b ? a : b); }

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double gelu_exact(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }
inline double gelu_tanh(double x) {
  const double k = std::sqrt(2.0 / std::numbers::pi);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

// Strides (in elements of a contiguous `in`) that read `in` broadcast to `out` (NumPy rules).
inline Dims broadcast_strides(const Dims& in, const Dims& out) {
  Dims cs = contiguous_strides(in);
  Dims s;
  s.resize(out.size());
  const int off = out.size() - in.size();
  for (int i = 0; i < out.size(); ++i) {
    int j = i - off;
    s[i] = (j < 0 || in[j] == 1) ? 0 : cs[j];
  }
  return s;
}

// Reduction dims of a node, normalised and sorted (dims of a rank-0 input are dropped).
inline Dims reduce_dims(const graph::Node& n, int rank) {
  Dims rd = graph::detail::reduced_dims(n.attrs, rank, n.op);
  Dims out;
  for (auto d : rd)
    if (d < rank) out.push_back(d);
  return out;
}

// For each element of a tensor of `shape`, the row-major index of its group (the output element of
// a reduction over `rd`); `groups` is the number of groups.
struct Groups {
  std::vector<std::int64_t> of;
  std::int64_t groups = 1;
  std::int64_t per_group = 1;
};
inline Groups make_groups(const Dims& shape, const Dims& rd) {
  Dims kept = shape;
  for (auto d : rd) kept[static_cast<int>(d)] = 1;
  Dims ks = contiguous_strides(kept);
  for (auto d : rd) ks[static_cast<int>(d)] = 0;
  Groups g;
  g.groups = kept.product();
  g.per_group = 1;
  for (auto d : rd) g.per_group *= shape[static_cast<int>(d)];
  g.of.resize(static_cast<std::size_t>(shape.product()));
  for_each_index(shape, [&](std::int64_t lin, const Dims& idx) { g.of[lin] = dot_strides(idx, ks); });
  return g;
}

// Max-shifted log-sum-exp of each group.
inline std::vector<double> group_logsumexp(const Value& x, const Groups& g) {
  std::vector<double> mx(g.groups, -inf), s(g.groups, 0.0), out(g.groups);
  for (std::size_t i = 0; i < x.data.size(); ++i) mx[g.of[i]] = nan_max(mx[g.of[i]], x.data[i]);
  for (std::size_t i = 0; i < x.data.size(); ++i) {
    double m = mx[g.of[i]];
    double shift = std::isinf(m) ? 0.0 : m;
    s[g.of[i]] += std::exp(x.data[i] - shift);
  }
  for (std::int64_t k = 0; k < g.groups; ++k) {
    double m = mx[k];
    if (std::isnan(m))
      out[k] = nan;
    else if (m == -inf)
      out[k] = -inf;  // every element is -inf (or the group is empty)
    else if (m == inf)
      out[k] = inf;
    else
      out[k] = m + std::log(s[k]);
  }
  return out;
}

// Reads any tensor (any dtype, strides, offset, device) into row-major doubles.
inline std::vector<double> read_values(const Tensor& t) {
  const std::int64_t n = t.numel();
  std::vector<double> out(static_cast<std::size_t>(n));
  if (n == 0) return out;
  if (!t.defined() || !t.storage()->data) throw error("reference: cannot read an undefined tensor " + t.str());
  const kiln::dtype dt = t.dtype();
  std::int64_t lo = t.offset(), hi = t.offset();
  for (int i = 0; i < t.dim(); ++i) {
    std::int64_t span = (t.shape()[i] - 1) * t.strides()[i];
    (span < 0 ? lo : hi) += span;
  }
  const void* base = t.storage()->data;
  std::int64_t shift = 0;
  std::vector<double> staging;  // double-typed so that any element type is suitably aligned
  if (t.device().is_cuda()) {
    // Copy just the span of memory the view touches, then read it through the strides on the host.
    const std::size_t isz = itemsize(dt);
    const std::size_t bytes = static_cast<std::size_t>(hi - lo + 1) * isz;
    staging.resize((bytes + sizeof(double) - 1) / sizeof(double));
    Stream s{};
    memory::copy(staging.data(), kiln::cpu, static_cast<const char*>(base) + lo * static_cast<std::int64_t>(isz),
                 t.device(), bytes, s.handle());
    memory::synchronize(s.handle(), t.device());
    base = staging.data();
    shift = -lo;
  }
  for_each_index(t.shape(), [&](std::int64_t lin, const Dims& idx) {
    out[lin] = load_as_double(base, dt, shift + t.offset() + dot_strides(idx, t.strides()));
  });
  return out;
}

inline Value make_value(const Dims& shape, kiln::dtype dt) {
  Value v;
  v.shape = shape;
  v.dt = dt;
  v.data.assign(static_cast<std::size_t>(shape.product()), 0.0);
  return v;
}

// Applies f elementwise over inputs broadcast to the node's shape.
template <class F>
void pointwise(Value& out, std::span<const Value* const> ins, F&& f) {
  std::array<Dims, 3> bs;
  for (std::size_t k = 0; k < ins.size(); ++k) bs[k] = broadcast_strides(ins[k]->shape, out.shape);
  std::array<double, 3> v{};
  for_each_index(out.shape, [&](std::int64_t lin, const Dims& idx) {
    for (std::size_t k = 0; k < ins.size(); ++k) v[k] = ins[k]->data[dot_strides(idx, bs[k])];
    out.data[lin] = f(v);
  });
}

inline double unary(const graph::Node& n, double x) {
  switch (n.op) {
    case Op::neg:
      return -x;
    case Op::abs:
      return std::abs(x);
    case Op::sign:
      return x > 0 ? 1.0 : x < 0 ? -1.0 : x;  // keeps 0 (and its sign) and NaN
    case Op::exp:
      return std::exp(x);
    case Op::exp2:
      return std::exp2(x);
    case Op::log:
      return std::log(x);
    case Op::log2:
      return std::log2(x);
    case Op::log1p:
      return std::log1p(x);
    case Op::expm1:
      return std::expm1(x);
    case Op::sqrt:
      return std::sqrt(x);
    case Op::rsqrt:
      return 1.0 / std::sqrt(x);
    case Op::reciprocal:
      return 1.0 / x;
    case Op::square:
      return x * x;
    case Op::sin:
      return std::sin(x);
    case Op::cos:
      return std::cos(x);
    case Op::tanh:
      return std::tanh(x);
    case Op::sigmoid:
      return sigmoid(x);
    case Op::erf:
      return std::erf(x);
    case Op::relu:
      return std::isnan(x) ? x : (x > 0 ? x : 0.0);
    case Op::logical_not:
      return x == 0 ? 1.0 : 0.0;
    case Op::cast:
      return round_to(n.attrs.dt, x);
    case Op::silu:
      return x * sigmoid(x);
    case Op::gelu:
      return n.attrs.a == 1 ? gelu_tanh(x) : gelu_exact(x);
    case Op::gelu_tanh:
      return gelu_tanh(x);
    default:
      throw error("reference: " + std::string(name(n.op)) + " is not a unary op");
  }
}

inline double binary(Op op, double a, double b) {
  switch (op) {
    case Op::add:
      return a + b;
    case Op::sub:
      return a - b;
    case Op::mul:
      return a * b;
    case Op::div:
      return a / b;
    case Op::maximum:
      return nan_max(a, b);
    case Op::minimum:
      return nan_min(a, b);
    case Op::pow:
      return std::pow(a, b);
    case Op::lt:
      return a < b;
    case Op::le:
      return a <= b;
    case Op::gt:
      return a > b;
    case Op::ge:
      return a >= b;
    case Op::eq:
      return a == b;
    case Op::ne:
      return a != b;
    default:
      throw error("reference: " + std::string(name(op)) + " is not a binary op");
  }
}

inline std::int64_t rows_of(const Dims& shape) {  // product of all dims but the last
  std::int64_t r = 1;
  for (int i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return r;
}

inline void check_index(double v, std::int64_t size, const char* op) {
  if (!(v >= 0 && v < static_cast<double>(size)))
    throw shape_error(std::string(op) + ": index " + std::to_string(static_cast<std::int64_t>(v)) +
                      " is out of range for a dimension of size " + std::to_string(size));
}

// A custom op: the user's forward (or backward) on CPU tensors of the nodes' dtypes, read back into
// f64. The oracle trusts the user's function: it is the definition of the op.
inline Value eval_custom(const graph::Node& n, std::span<const Value* const> ins) {
  std::array<Tensor, graph::max_inputs> in;
  for (std::size_t k = 0; k < ins.size(); ++k) {
    in[k] = Tensor::empty(ins[k]->shape, ins[k]->dt, cpu);
    for (std::size_t j = 0; j < ins[k]->data.size(); ++j)
      store_from_double(in[k].data_ptr(), ins[k]->dt, static_cast<std::int64_t>(j), ins[k]->data[j]);
  }
  Tensor out = Tensor::empty(n.shape, n.dt, cpu);
  const custom_ops::Entry& e = custom_ops::entry(n.attrs.custom);
  if (n.op == Op::custom) {
    custom_ops::call_user(e, "forward", false,
                          [&] { e.fns.forward(std::span<const Tensor>(in.data(), ins.size()), out, Stream{}); });
  } else {
    const std::size_t m = ins.size() - 1;  // in[m]: the cotangent of the op's output
    if (!e.fns.backward) throw error(e.prefix() + "has no backward");
    std::array<Tensor, custom_ops::max_inputs> grads;
    grads[static_cast<std::size_t>(n.attrs.a)] = out;
    custom_ops::call_user(e, "backward", false, [&] {
      e.fns.backward(std::span<const Tensor>(in.data(), m), in[m], std::span<Tensor>(grads.data(), m), Stream{});
    });
  }
  Value v = make_value(n.shape, n.dt);
  v.data = read_values(out);
  return v;
}

// Evaluates node i, whose inputs are already in `vals`.
inline Value eval_node(const graph::Graph& g, int i, const std::vector<Value>& vals, std::span<const Tensor> args,
                       std::span<const double> scalars) {
  const graph::Node& n = g.nodes[static_cast<std::size_t>(i)];
  auto in = [&](int k) -> const Value& { return vals[static_cast<std::size_t>(n.in[k])]; };
  Value out = make_value(n.shape, n.dt);

  switch (n.op) {
    // ---- leaves ------------------------------------------------------------------------------
    case Op::arg: {
      if (n.slot < 0 || static_cast<std::size_t>(n.slot) >= args.size())
        throw error("reference: argument " + std::to_string(n.slot) + " was not given (" + std::to_string(args.size()) +
                    " tensors passed)");
      const Tensor& t = args[static_cast<std::size_t>(n.slot)];
      out.shape = t.shape();
      out.data = read_values(t);
      return out;
    }
    case Op::scalar:
      if (n.slot < 0 || static_cast<std::size_t>(n.slot) >= scalars.size())
        throw error("reference: scalar " + std::to_string(n.slot) + " was not given (" +
                    std::to_string(scalars.size()) + " scalars passed)");
      out.shape = {};
      out.data = {scalars[static_cast<std::size_t>(n.slot)]};
      return out;
    case Op::constant:
      out.shape = {};
      out.data = {n.value};
      return out;
    case Op::iota: {
      int d = normalize_dim(n.attrs.a, n.attrs.dims.size(), "iota");
      for_each_index(out.shape, [&](std::int64_t lin, const Dims& idx) {
        out.data[lin] = out.shape.size() ? static_cast<double>(idx[d]) : 0.0;
      });
      return out;
    }
    case Op::numel: {
      Dims rd = reduce_dims(n, in(0).shape.size());
      double c = 1;
      for (auto d : rd) c *= static_cast<double>(in(0).shape[static_cast<int>(d)]);
      out.data = {c};
      return out;
    }

    // ---- pointwise -------------------------------------------------------------------------------
    case Op::where: {
      const Value* ins[] = {&in(0), &in(1), &in(2)};
      pointwise(out, ins, [](const auto& v) { return v[0] != 0 ? v[1] : v[2]; });
      return out;
    }
    case Op::clamp: {  // min(max(x, lo), hi), NaN-propagating like PyTorch
      const Value* ins[] = {&in(0), &in(1), &in(2)};
      pointwise(out, ins, [](const auto& v) { return nan_min(nan_max(v[0], v[1]), v[2]); });
      return out;
    }

    // ---- reductions ------------------------------------------------------------------------------
    case Op::sum:
    case Op::amax:
    case Op::amin:
    case Op::mean:
    case Op::var:
    case Op::logsumexp: {
      const Value& x = in(0);
      Groups gr = make_groups(x.shape, reduce_dims(n, x.shape.size()));
      if (n.op == Op::logsumexp) {
        out.data = group_logsumexp(x, gr);
        return out;
      }
      const double init = n.op == Op::amax ? -inf : n.op == Op::amin ? inf : 0.0;
      std::vector<double> acc(static_cast<std::size_t>(gr.groups), init);
      for (std::size_t k = 0; k < x.data.size(); ++k) {
        double& a = acc[gr.of[k]];
        a = n.op == Op::amax ? nan_max(a, x.data[k]) : n.op == Op::amin ? nan_min(a, x.data[k]) : a + x.data[k];
      }
      const double count = static_cast<double>(gr.per_group);
      if (n.op == Op::mean || n.op == Op::var)
        for (auto& a : acc) a /= count;
      if (n.op == Op::var) {
        const double correction = in(1).data.at(0);
        std::vector<double> ss(acc.size(), 0.0);
        for (std::size_t k = 0; k < x.data.size(); ++k) {
          double d = x.data[k] - acc[gr.of[k]];
          ss[gr.of[k]] += d * d;
        }
        for (std::size_t k = 0; k < acc.size(); ++k) acc[k] = ss[k] / std::max(0.0, count - correction);
      }
      out.data = std::move(acc);
      for (auto& v : out.data) v = round_integral(n.dt, v);
      return out;
    }
    case Op::softmax:
    case Op::log_softmax: {
      const Value& x = in(0);
      Groups gr = make_groups(x.shape, reduce_dims(n, x.shape.size()));
      std::vector<double> lse = group_logsumexp(x, gr);
      if (n.op == Op::log_softmax) {
        // As PyTorch's x - max - log(sum(exp(x - max))): a group whose max is +inf is NaN throughout
        // (inf - inf), though its logsumexp is +inf; one of -inf only is NaN too (-inf - -inf).
        for (std::size_t k = 0; k < x.data.size(); ++k)
          out.data[k] = lse[gr.of[k]] == inf ? nan : x.data[k] - lse[gr.of[k]];
      } else {  // exp(x - max) / sum(exp(x - max))
        std::vector<double> mx(static_cast<std::size_t>(gr.groups), -inf), s(mx.size(), 0.0);
        for (std::size_t k = 0; k < x.data.size(); ++k) mx[gr.of[k]] = nan_max(mx[gr.of[k]], x.data[k]);
        // As PyTorch: a group whose max is +inf is NaN throughout (inf - inf); one of -inf only is
        // NaN too (0 / 0), computed without the shift.
        auto shift = [&](std::int64_t grp) { return mx[grp] == -inf ? 0.0 : mx[grp]; };
        for (std::size_t k = 0; k < x.data.size(); ++k) s[gr.of[k]] += std::exp(x.data[k] - shift(gr.of[k]));
        for (std::size_t k = 0; k < x.data.size(); ++k)
          out.data[k] = std::exp(x.data[k] - shift(gr.of[k])) / s[gr.of[k]];
      }
      return out;
    }

    // ---- views -----------------------------------------------------------------------------------
    case Op::reshape:
    case Op::unsqueeze:
    case Op::squeeze:
      out.data = in(0).data;
      return out;
    case Op::expand: {
      const Value* ins[] = {&in(0)};
      pointwise(out, ins, [](const auto& v) { return v[0]; });
      return out;
    }
    case Op::permute:
    case Op::transpose: {
      const Value& x = in(0);
      const int rank = x.shape.size();
      Dims perm;
      if (n.op == Op::permute) {
        for (auto d : n.attrs.dims) perm.push_back(normalize_dim(d, rank, "permute"));
      } else {
        for (int k = 0; k < rank; ++k) perm.push_back(k);
        if (rank > 0) {
          int a = normalize_dim(n.attrs.a, rank, "transpose"), b = normalize_dim(n.attrs.b, rank, "transpose");
          std::swap(perm[a], perm[b]);
        }
      }
      Dims cs = contiguous_strides(x.shape), st;
      for (int k = 0; k < perm.size(); ++k) st.push_back(cs[static_cast<int>(perm[k])]);
      for_each_index(out.shape,
                     [&](std::int64_t lin, const Dims& idx) { out.data[lin] = x.data[dot_strides(idx, st)]; });
      return out;
    }
    case Op::slice:
    case Op::slice_backward: {
      // slice: out[..., j, ...] = x[..., start + j*step, ...]; slice_backward scatters the other way
      // into zeros of shape attrs.dims. Bounds are normalised and clamped exactly as infer.hpp does.
      const Dims& full = n.op == Op::slice ? in(0).shape : n.attrs.dims;
      const int rank = full.size();
      const int d = normalize_dim(n.attrs.a, rank, name(n.op).data());
      const std::int64_t step = n.attrs.d;
      if (step <= 0)
        throw shape_error(std::string(name(n.op)) + ": step must be positive, got " + std::to_string(step));
      const std::int64_t size = rank ? full[d] : 1;
      auto clampi = [&](std::int64_t v) { return std::clamp<std::int64_t>(v < 0 ? v + size : v, 0, size); };
      const std::int64_t start = clampi(n.attrs.b), stop = clampi(n.attrs.c);
      Dims part = full;
      if (rank) part[d] = stop > start ? (stop - start + step - 1) / step : 0;
      Dims fs = contiguous_strides(full), ps = fs;
      std::int64_t base = 0;
      if (rank) {
        ps[d] = fs[d] * step;
        base = start * fs[d];
      }
      if (n.op == Op::slice) {
        for_each_index(out.shape, [&](std::int64_t lin, const Dims& idx) {
          out.data[lin] = in(0).data[base + dot_strides(idx, ps)];
        });
      } else {
        if (!(in(0).shape == part))
          throw shape_error("slice_backward: gradient of shape " + in(0).shape.str() + " does not match the slice " +
                            part.str() + " of " + full.str());
        for_each_index(
            part, [&](std::int64_t lin, const Dims& idx) { out.data[base + dot_strides(idx, ps)] = in(0).data[lin]; });
      }
      return out;
    }

    case Op::custom:
    case Op::custom_backward: {
      std::array<const Value*, graph::max_inputs> ins{};
      for (int k = 0; k < n.n_in; ++k) ins[static_cast<std::size_t>(k)] = &in(k);
      return eval_custom(n, std::span<const Value* const>(ins.data(), static_cast<std::size_t>(n.n_in)));
    }

    // ---- indexing and matmul ---------------------------------------------------------------------
    case Op::gather: {  // out[..., k] = x[..., idx[..., k]]
      const Value &x = in(0), &ix = in(1);
      const std::int64_t rows = rows_of(ix.shape), K = ix.shape.size() ? ix.shape.back() : 1;
      const std::int64_t C = x.shape.size() ? x.shape.back() : 1;
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t k = 0; k < K; ++k) {
          double j = ix.data[r * K + k];
          check_index(j, C, "gather");
          out.data[r * K + k] = x.data[r * C + static_cast<std::int64_t>(j)];
        }
      return out;
    }
    case Op::matmul: {
      const Value &a = in(0), &b = in(1);
      const bool batched = a.shape.size() == 3, b_batched = b.shape.size() == 3;
      const std::int64_t B = batched ? a.shape[0] : 1;
      const std::int64_t M = a.shape[a.shape.size() - 2], K = a.shape.back(), N = b.shape.back();
      for (std::int64_t bt = 0; bt < B; ++bt)
        for (std::int64_t r = 0; r < M; ++r)
          for (std::int64_t c = 0; c < N; ++c) {
            double s = 0;
            for (std::int64_t k = 0; k < K; ++k)
              s += a.data[(bt * M + r) * K + k] * b.data[(b_batched ? bt * K * N : 0) + k * N + c];
            out.data[(bt * M + r) * N + c] = s;
          }
      return out;
    }

    // ---- composites, straight from their definitions ----------------------------------------------
    case Op::layer_norm:
    case Op::rms_norm: {
      const Value &x = in(0), &w = in(1);
      const double eps = in(n.op == Op::layer_norm ? 3 : 2).data.at(0);
      const std::int64_t D = x.shape.back(), rows = rows_of(x.shape);
      for (std::int64_t r = 0; r < rows; ++r) {
        const double* row = x.data.data() + r * D;
        if (n.op == Op::layer_norm) {
          double mu = 0, var = 0;
          for (std::int64_t j = 0; j < D; ++j) mu += row[j];
          mu /= static_cast<double>(D);
          for (std::int64_t j = 0; j < D; ++j) var += (row[j] - mu) * (row[j] - mu);
          var /= static_cast<double>(D);
          for (std::int64_t j = 0; j < D; ++j)
            out.data[r * D + j] = (row[j] - mu) / std::sqrt(var + eps) * w.data[j] + in(2).data[j];
        } else {
          double ms = 0;
          for (std::int64_t j = 0; j < D; ++j) ms += row[j] * row[j];
          ms /= static_cast<double>(D);
          for (std::int64_t j = 0; j < D; ++j) out.data[r * D + j] = row[j] / std::sqrt(ms + eps) * w.data[j];
        }
      }
      return out;
    }
    case Op::cross_entropy: {  // mean over rows of logsumexp(logits[n]) - logits[n, target[n]]
      const Value &x = in(0), &t = in(1);
      const std::int64_t N = x.shape[0], C = x.shape[1];
      double total = 0;
      for (std::int64_t r = 0; r < N; ++r) {
        const double* row = x.data.data() + r * C;
        double m = -inf;
        for (std::int64_t j = 0; j < C; ++j) m = nan_max(m, row[j]);
        double shift = std::isinf(m) ? 0.0 : m, s = 0;
        for (std::int64_t j = 0; j < C; ++j) s += std::exp(row[j] - shift);
        double tj = t.data[r];
        check_index(tj, C, "cross_entropy");
        total += (shift + std::log(s)) - row[static_cast<std::int64_t>(tj)];
      }
      out.data = {total / static_cast<double>(N)};
      return out;
    }
    case Op::mse_loss: {
      Dims shape = broadcast_shapes(in(0).shape, in(1).shape, "mse_loss");
      Dims sa = broadcast_strides(in(0).shape, shape), sb = broadcast_strides(in(1).shape, shape);
      double total = 0;
      for_each_index(shape, [&](std::int64_t, const Dims& idx) {
        double d = in(0).data[dot_strides(idx, sa)] - in(1).data[dot_strides(idx, sb)];
        total += d * d;
      });
      out.data = {total / static_cast<double>(shape.product())};
      return out;
    }
    case Op::linear: {  // y[..., o] = sum_i x[..., i] * w[o, i] + b[o]
      const Value &x = in(0), &w = in(1), &b = in(2);
      const std::int64_t I = x.shape.back(), O = w.shape[0], rows = rows_of(x.shape);
      const bool bias_scalar = b.shape.size() == 0;
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t o = 0; o < O; ++o) {
          double s = 0;
          for (std::int64_t k = 0; k < I; ++k) s += x.data[r * I + k] * w.data[o * I + k];
          out.data[r * O + o] = s + (bias_scalar ? b.data[0] : b.data[o]);
        }
      for (auto& v : out.data) v = round_integral(n.dt, v);
      return out;
    }
    default:
      break;
  }

  const OpClass cls = info(n.op).cls;
  if (cls == OpClass::unary || n.op == Op::silu || n.op == Op::gelu || n.op == Op::gelu_tanh) {
    const Value* ins[] = {&in(0)};
    pointwise(out, ins, [&](const auto& v) { return round_integral(n.dt, unary(n, v[0])); });
    return out;
  }
  if (cls == OpClass::binary) {
    const Value* ins[] = {&in(0), &in(1)};
    pointwise(out, ins, [&](const auto& v) { return round_integral(n.dt, binary(n.op, v[0], v[1])); });
    return out;
  }
  throw error("reference: no evaluation rule for op " + std::string(name(n.op)));
}

}  // namespace detail

// Reads a tensor (any dtype, layout or device) into a Value: row-major doubles.
inline Value read(const Tensor& t) {
  Value v;
  v.shape = t.shape();
  v.dt = t.dtype();
  v.data = detail::read_values(t);
  return v;
}

// A contiguous CPU f64 tensor holding a Value.
inline Tensor to_tensor(const Value& v) {
  Tensor t = Tensor::empty(v.shape, kiln::dtype::f64, kiln::cpu);
  if (!v.data.empty()) std::memcpy(t.data_ptr(), v.data.data(), v.data.size() * sizeof(double));
  return t;
}

// Evaluates every node of g (after graph::infer_shapes) and returns the values of its outputs.
// args are indexed by arg slot, scalars by scalar slot.
inline std::vector<Value> eval_graph(const graph::Graph& g, std::span<const Tensor> args,
                                     std::span<const double> scalars) {
  std::vector<Value> vals(static_cast<std::size_t>(g.size()));
  std::vector<char> state(vals.size(), 0);  // 0 = not yet, 1 = in progress, 2 = done
  // Nodes are normally in topological order; evaluate inputs first anyway, so graphs edited by
  // rewrite passes (new nodes appended, then referenced) are handled too.
  auto visit = [&](auto& self, int i) -> void {
    if (i < 0 || i >= g.size()) throw error("reference: node id " + std::to_string(i) + " is out of range");
    auto& st = state[static_cast<std::size_t>(i)];
    if (st == 2) return;
    if (st == 1) throw error("reference: the graph has a cycle through node %" + std::to_string(i));
    st = 1;
    const graph::Node& n = g.nodes[static_cast<std::size_t>(i)];
    for (int k = 0; k < n.n_in; ++k) self(self, n.in[k]);
    vals[static_cast<std::size_t>(i)] = detail::eval_node(g, i, vals, args, scalars);
    st = 2;
  };
  for (int i = 0; i < g.size(); ++i) visit(visit, i);
  std::vector<Value> outs;
  for (int o : g.outputs) outs.push_back(vals[static_cast<std::size_t>(o)]);
  return outs;
}

namespace detail {

template <class T>
decltype(auto) as_expr(const T& x) {
  if constexpr (std::is_same_v<T, Tensor>)
    return expr::TensorLeaf{{}, x};
  else
    return (x);
}

}  // namespace detail

// Flattens and evaluates one or several expressions as one graph (shared subexpressions are
// evaluated once), returning each output's Value: its shape, the node's dtype and f64 data.
template <class... E>
requires(Expr<E>&&...) std::vector<Value> eval_values(const E&... e) {
  graph::Graph g = graph::flatten(e...);
  std::vector<const Tensor*> ptrs(static_cast<std::size_t>(g.num_args), nullptr);
  std::size_t next = static_cast<std::size_t>(std::max({-1, graph::Counts<E>::max_arg...}) + 1);
  graph::Captured cap;  // one walk over all outputs, as flatten: a subexpression they share is met once
  graph::gather(std::tuple<const E&...>(e...), cap);
  for (std::size_t k = 0; k < cap.bound.size() && k < ptrs.size(); ++k) ptrs[k] = cap.bound[k];
  for (int k = 0; k < cap.nt; ++k) ptrs[next++] = cap.tensors[static_cast<std::size_t>(k)];
  std::vector<double> scalars(cap.scalars.begin(), cap.scalars.end());
  std::vector<Tensor> args(ptrs.size());
  for (std::size_t k = 0; k < ptrs.size(); ++k)
    if (ptrs[k]) args[k] = *ptrs[k];
  graph::infer_shapes(g, [&](int slot) -> const Tensor& {  // only the slots the graph reads must be bound
    if (slot < 0 || static_cast<std::size_t>(slot) >= ptrs.size() || !ptrs[static_cast<std::size_t>(slot)])
      throw error("reference::eval: argument " + std::to_string(slot) + " of the expression is not bound to a tensor");
    return args[static_cast<std::size_t>(slot)];
  });
  return eval_graph(g, args, scalars);
}

// The oracle's value of an expression: a contiguous CPU tensor of dtype f64.
template <class E>
requires Expr<E> Tensor eval(const E& e) { return to_tensor(eval_values(e).at(0)); }

// A plain tensor: its values as a contiguous CPU f64 tensor.
inline Tensor eval(const Tensor& t) { return to_tensor(read(t)); }

// Several outputs (a tuple of expressions or tensors), evaluated as one graph.
template <class... E>
requires((Expr<E> || std::is_same_v<E, Tensor>)&&...) auto eval(const std::tuple<E...>& t) {
  std::vector<Value> vs = std::apply([](const auto&... e) { return eval_values(detail::as_expr(e)...); }, t);
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple{(static_cast<void>(I), to_tensor(vs[I]))...};
  }
  (std::index_sequence_for<E...>{});
}

}  // namespace kiln::reference
