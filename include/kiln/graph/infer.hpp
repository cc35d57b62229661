// Shape and dtype inference over the node table, with PyTorch's broadcasting and promotion rules
// (and the user's own rule for a custom op). Every bad input becomes a typed error naming the op and
// the shapes or dtypes involved.
#pragma once
#include <algorithm>
#include <array>
#include <span>
#include <string>

#include "graph.hpp"
#include "infer_attention.hpp"
#include "infer_dtype.hpp"
#include "infer_index.hpp"
#include "infer_views.hpp"

namespace kiln::graph {

namespace detail {

// The dims a reduction-like node works on, normalised and sorted; all dims when attrs.all.
inline Dims reduced_dims(const Attrs& at, int rank, Op op) {
  Dims out;
  if (at.all) {
    for (int i = 0; i < rank; ++i) out.push_back(i);
    return out;
  }
  for (auto d : at.dims) {
    int nd = normalize_dim(d, rank, std::string(name(op)).c_str());
    if (std::find(out.begin(), out.end(), nd) != out.end())
      throw shape_error(op_str(op) + ": dimension " + std::to_string(d) + " appears twice in " + at.dims.str());
    out.push_back(nd);
  }
  std::sort(out.begin(), out.end());
  return out;
}

inline Dims reduced_shape(const Dims& in, const Dims& dims, bool keepdim) {
  Dims out;
  for (int i = 0; i < in.size(); ++i) {
    bool r = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!r)
      out.push_back(in[i]);
    else if (keepdim)
      out.push_back(1);
  }
  return out;
}

inline Dims infer_matmul(const Dims& a, const Dims& b) {
  bool ok = (a.size() == 2 && b.size() == 2) || (a.size() == 3 && (b.size() == 3 || b.size() == 2));
  if (!ok || a.back() != b[b.size() - 2] || (a.size() == 3 && b.size() == 3 && a[0] != b[0]))
    throw shape_error("matmul: cannot multiply shapes " + a.str() + " and " + b.str() +
                      " (2-D by 2-D, or batched 3-D by 3-D or 2-D, with matching inner sizes)");
  Dims out = a;
  out[out.size() - 1] = b.back();
  return out;
}

void infer_node(Graph& g, Node& n);

// A custom op: the user's shape rule. Its backward node (inputs x0..xn-1, the output's cotangent)
// gives the gradient of input attrs.a, which has that input's shape and dtype.
inline void infer_custom(const Graph& g, Node& n) {
  n.weak = false;
  if (n.op == Op::custom_backward) {
    const Node& x = g.nodes[n.in[n.attrs.a]];
    n.shape = x.shape;
    n.dt = x.dt;
    return;
  }
  std::array<TensorSpec, custom_ops::max_inputs> specs;
  for (int k = 0; k < n.n_in; ++k) specs[k] = {g.nodes[n.in[k]].shape, g.nodes[n.in[k]].dt};
  TensorSpec out = custom_ops::infer(n.attrs.custom, std::span<const TensorSpec>(specs.data(), n.n_in));
  n.shape = out.shape;
  n.dt = out.dtype;
}

}  // namespace detail

// Fills shape and dtype of every node; set_arg(node) fills those of an argument node.
template <class SetArg>
void infer_shapes_with(Graph& g, SetArg&& set_arg) {
  for (auto& n : g.nodes) {
    if (n.op == Op::arg) {
      set_arg(n);
    } else if (n.op == Op::constant) {
      n.shape = {};
      n.dt = kiln::dtype::f64;
      n.weak = true;
    } else if (n.op == Op::scalar) {
      n.shape = {};
      n.dt = n.floating ? kiln::dtype::f64 : kiln::dtype::i64;
      n.weak = true;
    } else {
      detail::infer_node(g, n);
    }
  }
}

// Fills shape and dtype of every node, given the argument tensors (indexed by arg slot).
template <class TensorAt>
void infer_shapes(Graph& g, TensorAt&& arg) {
  infer_shapes_with(g, [&](Node& n) {
    const Tensor& t = arg(n.slot);
    n.shape = t.shape();
    n.dt = t.dtype();
  });
}

namespace detail {

inline void infer_node(Graph& g, Node& n) {
  auto in = [&](int i) -> const Node& { return g.nodes[n.in[i]]; };
  const std::string op = op_str(n.op);
  infer_dtype(g, n);  // dtype and weakness; below: shapes, and the checks of both
  switch (info(n.op).cls) {
    case OpClass::unary: {
      n.shape = in(0).shape;
      if (n.op == Op::neg && n.dt == kiln::dtype::boolean)
        throw dtype_error("neg: negation of a boolean tensor is not supported; use k::logical_not");
      return;
    }
    case OpClass::binary: {
      n.shape = broadcast_shapes(in(0).shape, in(1).shape, op.c_str());
      return;
    }
    case OpClass::ternary: {  // where(c, a, b)
      if (in(0).dt != kiln::dtype::boolean && !in(0).weak)
        throw dtype_error("where: the condition must be boolean, got " + std::string(name(in(0).dt)));
      n.shape = broadcast_shapes(broadcast_shapes(in(0).shape, in(1).shape, op.c_str()), in(2).shape, op.c_str());
      return;
    }
    case OpClass::reduce: {
      Dims rd = reduced_dims(n.attrs, in(0).shape.size(), n.op);
      n.shape = reduced_shape(in(0).shape, rd, n.attrs.keepdim);
      for (int d : rd)
        if (in(0).shape[d] == 0 && n.op != Op::sum && !(n.op == Op::amax && n.attrs.d == Attrs::shift_flag))
          throw shape_error(op + ": cannot reduce over dimension " + std::to_string(d) + " of size 0 in shape " +
                            in(0).shape.str());
      return;
    }
    case OpClass::meta: {
      if (n.op == Op::iota_of) {  // x's size along attrs.b, at attrs.a of the shape attrs.dims
        const int rank = n.attrs.dims.size(), from = in(0).shape.size();
        if (n.attrs.a < 0 || n.attrs.a >= rank || n.attrs.b < 0 || n.attrs.b >= from)
          throw shape_error("iota_of: dim " + std::to_string(n.attrs.a) + " of rank " + std::to_string(rank) +
                            ", sized from dim " + std::to_string(n.attrs.b) + " of shape " + in(0).shape.str());
        n.shape = n.attrs.dims;
        n.shape[static_cast<int>(n.attrs.a)] = in(0).shape[static_cast<int>(n.attrs.b)];
        return;
      }
      if (n.op == Op::shape_of) {  // x's shape, or x and y joined along attrs.a (a cat's)
        n.shape = n.n_in < 2 ? in(0).shape : joined_shape("shape_of", in(0).shape, in(1).shape, n.attrs.a);
        return;
      }
      // numel(x, dims): the element count of the reduced dims, as a number
      reduced_dims(n.attrs, in(0).shape.size(), n.op);  // validates the dims
      n.shape = {};
      return;
    }
    case OpClass::view:
      break;
    case OpClass::index:
      return infer_index(g, n);
    case OpClass::extern_: {
      if (is_custom(n.op)) return infer_custom(g, n);
      if (n.op == Op::embedding_backward) return infer_index(g, n);
      if (n.op == Op::attention_flash) return infer_attention(g, n);  // lowering made it: attrs.c is 0
      if (n.op == Op::attention_lse) {                                // [B, H, Tq]: each query row's log-sum-exp
        const Dims& qs = in(0).shape;
        n.shape = Dims{qs[0], qs[1], qs[2]};
        return;
      }
      if (n.op == Op::attention_grad) {  // the gradient of q, k or v (attrs.c): that input's shape
        // dk and dv together: [2, B, Hkv, Tk, D]; dq too: [5, ...] (dk, dv, dq, and dq's f32 sums)
        if (n.attrs.c == 3 || n.attrs.c == 4) {
          if (n.attrs.c == 4 && !(in(0).shape == in(1).shape && in(0).shape == in(2).shape))
            throw shape_error("attention: dq, dk and dv from one kernel need q, k and v of one shape (q " +
                              in(0).shape.str() + ", k " + in(1).shape.str() + ", v " + in(2).shape.str() + ")");
          n.shape = Dims{n.attrs.c == 4 ? 5 : 2};
          for (auto d : in(1).shape) n.shape.push_back(d);
          return;
        }
        n.shape = in(static_cast<int>(n.attrs.c)).shape;
        return;
      }
      n.shape = infer_matmul(in(0).shape, in(1).shape);
      if (!is_floating(n.dt))
        throw dtype_error("matmul: integer matmul is not supported (" + std::string(name(in(0).dt)) + " x " +
                          std::string(name(in(1).dt)) + ")");
      return;
    }
    case OpClass::composite:
      break;
    case OpClass::leaf:
      if (n.op == Op::iota) n.shape = n.attrs.dims;
      return;
  }
  const Dims& xs = in(0).shape;
  const int rank = xs.size();
  switch (n.op) {
    case Op::reshape:
    case Op::permute:
    case Op::transpose:
    case Op::slice:
    case Op::slice_backward:
    case Op::expand:
    case Op::unsqueeze:
    case Op::squeeze:
      n.shape = n.n_in == 2 ? sized_view_shape(n.op, xs, in(1).shape, n.attrs) : view_shape(n.op, xs, n.attrs);
      break;
    case Op::silu:
    case Op::gelu:
    case Op::gelu_tanh:
      n.shape = xs;
      break;
    case Op::clamp:
      n.shape = broadcast_shapes(broadcast_shapes(xs, in(1).shape, "clamp"), in(2).shape, "clamp");
      return;
    case Op::mean:
    case Op::var:
    case Op::logsumexp: {
      Dims rd = reduced_dims(n.attrs, rank, n.op);
      n.shape = reduced_shape(xs, rd, n.attrs.keepdim);
      for (int d : rd)
        if (xs[d] == 0 && n.op == Op::logsumexp)
          throw shape_error("logsumexp: cannot reduce over dimension of size 0 in shape " + xs.str());
      break;
    }
    case Op::softmax:
    case Op::log_softmax:
      reduced_dims(n.attrs, rank, n.op);
      n.shape = xs;
      break;
    case Op::argmax:
    case Op::argmin: {
      const Dims rd = reduced_dims(n.attrs, rank, n.op);  // one dim
      if (rank && xs[static_cast<int>(rd[0])] == 0)
        throw shape_error(op + ": cannot take the index over a dimension of size 0 in shape " + xs.str());
      n.shape = reduced_shape(xs, rd, n.attrs.keepdim);
      return;
    }
    case Op::attention:
      return infer_attention(g, n);
    case Op::score_arg:
      return infer_score_arg(g, n);
    case Op::cat:
      n.shape = joined_shape("cat", xs, in(1).shape, n.attrs.a);
      return;
    case Op::sum_to_shape_of:  // g summed back to x's shape: x must broadcast to g's
      if (!(broadcast_shapes(in(1).shape, xs, op.c_str()) == xs))
        throw shape_error(op + ": " + in(1).shape.str() + " does not broadcast to " + xs.str());
      n.shape = in(1).shape;
      return;
    case Op::grad_leaf:
      n.shape = xs;
      return;
    case Op::grad_of:  // (value, grad_leaf(x)[, cotangent]): x's shape
      if (!is_floating(in(1).dt) || !is_floating(in(0).dt))
        throw dtype_error(std::string(n.n_in > 2 ? "k::vjp" : "k::grad") +
                          " inside a compiled function: the value is " + std::string(name(in(0).dt)) +
                          " and the argument " + std::string(name(in(1).dt)) +
                          "; only floating-point values and arguments have gradients");
      if (n.n_in > 2 && !(in(2).shape == xs))
        throw shape_error("k::vjp inside a compiled function: the cotangent has shape " + in(2).shape.str() +
                          " but the function's value has shape " + xs.str());
      if (n.n_in == 2 && xs.product() != 1)
        throw shape_error("k::grad inside a compiled function: the function's value has shape " + xs.str() +
                          ", not a single element: reduce it with k::sum or k::mean, or use k::vjp");
      n.shape = in(1).shape;
      return;
    case Op::layer_norm:
    case Op::rms_norm: {
      if (rank == 0) throw shape_error(op + ": input must have at least one dimension");
      std::int64_t d = xs.back();
      for (int i = 1; i < (n.op == Op::layer_norm ? 3 : 2); ++i)
        if (!(in(i).shape == Dims{d}))
          throw shape_error(op + ": weight/bias of shape " + in(i).shape.str() +
                            " do not match the last dimension of input " + xs.str());
      n.shape = xs;
      break;
    }
    case Op::cross_entropy: {
      const Dims& ts = in(1).shape;
      if (in(1).dt != kiln::dtype::i64 && in(1).dt != kiln::dtype::i32)
        throw dtype_error("cross_entropy: targets must be i64 class indices, got " + std::string(name(in(1).dt)));
      if (rank != 2 || ts.size() != 1 || ts[0] != xs[0])
        throw shape_error("cross_entropy: logits " + xs.str() + " and targets " + ts.str() + " must be [N, C] and [N]");
      n.shape = {};
      return;
    }
    case Op::mse_loss:
      broadcast_shapes(xs, in(1).shape, "mse_loss");
      n.shape = {};
      return;
    case Op::linear: {
      const Dims& ws = in(1).shape;
      if (ws.size() != 2 || rank < 1 || xs.back() != ws[1])
        throw shape_error("linear: input " + xs.str() + " and weight " + ws.str() +
                          " do not match (weight is [out, in])");
      if (!in(2).weak && !(in(2).shape == Dims{ws[0]}))
        throw shape_error("linear: bias " + in(2).shape.str() + " does not match weight " + ws.str());
      n.shape = xs;
      n.shape[rank - 1] = ws[0];
      return;
    }
    default:
      throw error("infer_shapes: no rule for op " + op);
  }
}

}  // namespace detail
}  // namespace kiln::graph
