// The oracle's per-op evaluation: eval_node computes one node of a flattened graph from its
// inputs' Values (reductions by groups, views, indexing, matmul, composites, custom ops).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "../core/tensor.hpp"
#include "../graph/graph.hpp"
#include "../graph/infer.hpp"
#include "elementwise.hpp"
#include "eval_attention.hpp"
#include "eval_custom.hpp"
#include "eval_index.hpp"
#include "value.hpp"

namespace kiln::reference {
namespace detail {

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

inline std::int64_t rows_of(const Dims& shape) {  // product of all dims but the last
  std::int64_t r = 1;
  for (int i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
  return r;
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
    case Op::iota_of: {
      const int d = static_cast<int>(n.attrs.a);
      for_each_index(out.shape, [&](std::int64_t lin, const Dims& idx) { out.data[lin] = static_cast<double>(idx[d]); });
      return out;
    }
    case Op::shape_of:  // a shape and no value: only views sized from it read it, for its shape
      out.data.clear();
      return out;
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
      if (n.op == Op::reshape && n.attrs.keepdim) out.data.resize(static_cast<std::size_t>(n.shape.product()), 0.0);
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
      const Dims& full = n.op == Op::slice ? in(0).shape : n.shape;  // slice_backward's, inferred
      const int rank = full.size();
      const int d = normalize_dim(n.attrs.a, rank, name(n.op).data());
      const std::int64_t step = n.attrs.d;
      if (step <= 0)
        throw shape_error(std::string(name(n.op)) + ": step must be positive, got " + std::to_string(step));
      const std::int64_t size = rank ? full[d] : 1;
      auto clampi = [&](std::int64_t v) { return std::clamp<std::int64_t>(v < 0 ? v + size : v, 0, size); };
      // A view sized from a second input (graph/infer_views.hpp's sized_view_shape): the part is that
      // size, at the end with attrs.keepdim.
      const Dims sized_part = n.n_in == 2 ? (n.op == Op::slice ? n.shape : in(0).shape) : Dims{};
      const std::int64_t start = n.n_in == 2 && n.attrs.keepdim ? size - sized_part[d] : clampi(n.attrs.b),
                         stop = clampi(n.attrs.c);
      Dims part = full;
      if (n.n_in == 2)
        part = sized_part;
      else if (rank)
        part[d] = stop > start ? (stop - start + step - 1) / step : 0;
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
    case Op::embedding:
      eval_embedding(in(0), in(1), out);
      return out;
    case Op::embedding_backward:
      eval_embedding_backward(in(0), in(1), out);
      return out;
    case Op::rand: {
      const Value* words[4] = {&in(1), &in(2), &in(3), &in(4)};
      eval_rand(words, out);
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
    case Op::attention:
      eval_attention(n, in(0), in(1), in(2), in(3).data[0], n.attrs.c ? &in(4) : nullptr, out);
      return out;
    case Op::attention_flash:  // the fused kernels' nodes (reference/eval_attention.hpp)
    case Op::attention_lse:
    case Op::attention_grad: {
      std::vector<const Value*> ins;
      for (int k = 0; k < n.n_in; ++k) ins.push_back(&in(k));
      eval_fused_attention(
          n, ins, out, [&](const graph::Graph& f, int i, const std::vector<Value>& vals, std::span<const Tensor> a) {
            return eval_node(f, i, vals, a, scalars);
          });
      return out;
    }
    case Op::score_arg:
      eval_score_arg(n, in(0), in(1), in(2).data[0], out);
      return out;
    case Op::sum_to_shape_of: {  // g summed over the dims x was broadcast along, in x's order
      const Value& g = in(0);
      const int lead = g.shape.size() - n.shape.size();
      Dims rd;
      for (int d = 0; d < g.shape.size(); ++d)
        if (d < lead || n.shape[d - lead] == 1) rd.push_back(d);
      const Groups gr = make_groups(g.shape, rd);
      std::vector<double> acc(static_cast<std::size_t>(gr.groups), 0.0);
      for (std::size_t k = 0; k < g.data.size(); ++k) acc[gr.of[k]] += g.data[k];
      for (std::size_t i = 0; i < acc.size(); ++i) out.data[i] = round_to(n.dt, acc[i]);
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
    case Op::argmax:
    case Op::argmin: {  // the first index of the extremum of each group, or of its first NaN
      const Value& x = in(0);
      const Dims rd = reduce_dims(n, x.shape.size());
      Groups gr = make_groups(x.shape, rd);
      std::vector<double> best(static_cast<std::size_t>(gr.groups), nan);
      std::vector<bool> seen(best.size(), false);
      const bool max = n.op == Op::argmax;
      for_each_index(x.shape, [&](std::int64_t lin, const Dims& idx) {
        const std::size_t k = static_cast<std::size_t>(gr.of[lin]);
        const double v = x.data[static_cast<std::size_t>(lin)];
        if (!seen[k] || (!std::isnan(best[k]) && (std::isnan(v) || (max ? v > best[k] : v < best[k])))) {
          best[k] = v, seen[k] = true;
          out.data[k] = static_cast<double>(idx[static_cast<int>(rd[0])]);
        }
      });
      return out;
    }
    case Op::cat: {  // a's elements, then b's, along the joined dim
      const Value &a = in(0), &b = in(1);
      const int d = normalize_dim(n.attrs.a, n.shape.size(), "cat");
      const std::int64_t na = a.shape[d];
      const Dims as = contiguous_strides(a.shape), bs = contiguous_strides(b.shape);
      for_each_index(out.shape, [&](std::int64_t lin, const Dims& idx) {
        Dims at = idx;
        const bool first = idx[d] < na;
        if (!first) at[d] -= na;
        const double v = first ? a.data[dot_strides(at, as)] : b.data[dot_strides(at, bs)];
        out.data[static_cast<std::size_t>(lin)] = round_to(n.dt, v);
      });
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
    case Op::grad_leaf:  // the value of its input (the gradients that stop at it are expanded first)
      out.data = in(0).data;
      return out;
    case Op::grad_of:
      throw error(
          "reference: grad_of is expanded before evaluation (autodiff::expand_gradients; reference::eval "
          "does so)");
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

}  // namespace kiln::reference
