// Dtype inference, PyTorch's promotion rules per op class: what a node's dtype and weakness are
// given its inputs'. It needs no sizes, so it runs both inside infer_node (with the shape rules and
// their checks) and in constant expressions over structural graphs (k::structure). Validation
// (bad dtypes are errors) stays with the shape rules in infer.hpp.
#pragma once
#include "graph.hpp"

namespace kiln::graph::detail {

constexpr kiln::dtype promote_nodes(const Node& a, const Node& b) {
  if (a.weak && !b.weak) return promote_with_scalar(b.dt, is_floating(a.dt));
  if (b.weak && !a.weak) return promote_with_scalar(a.dt, is_floating(b.dt));
  return promote(a.dt, b.dt);
}

// Ops whose result is floating even for integer inputs.
constexpr bool float_result_op(Op op) {
  switch (op) {
    case Op::exp:
    case Op::exp2:
    case Op::log:
    case Op::log2:
    case Op::log1p:
    case Op::expm1:
    case Op::sqrt:
    case Op::rsqrt:
    case Op::reciprocal:
    case Op::sin:
    case Op::cos:
    case Op::tanh:
    case Op::sigmoid:
    case Op::erf:
    case Op::silu:
    case Op::gelu:
    case Op::gelu_tanh:
    case Op::softmax:
    case Op::log_softmax:
    case Op::logsumexp:
    case Op::mean:
    case Op::var:
      return true;
    default:
      return false;
  }
}

// The dtype of a composite (before decomposition), from its inputs.
constexpr kiln::dtype composite_dtype(const Graph& g, const Node& n) {
  auto in = [&](int i) -> const Node& { return g.nodes[n.in[i]]; };
  const kiln::dtype first = in(0).dt;
  switch (n.op) {
    case Op::clamp:
      return promote(promote_nodes(in(0), in(1)), promote_nodes(in(0), in(2)));
    case Op::argmax:
    case Op::argmin:
      return kiln::dtype::i64;
    case Op::cat:
      return promote_nodes(in(0), in(1));
    case Op::cross_entropy:
      return is_floating(first) ? first : kiln::dtype::f32;
    case Op::mse_loss: {
      const kiln::dtype d = promote_nodes(in(0), in(1));
      return is_floating(d) ? d : kiln::dtype::f32;
    }
    case Op::linear:
      return promote(in(0).dt, in(1).dt);
    case Op::attention:
      return first;
    case Op::grad_of:  // a gradient has its argument's dtype
      return in(1).dt;
    case Op::score_arg:  // 0: the scaled scores (f32, or f64 for f64 inputs); 1..4: indices
      return n.attrs.a != 0 ? kiln::dtype::i64 : first == kiln::dtype::f64 ? kiln::dtype::f64 : kiln::dtype::f32;
    default:
      return float_result_op(n.op) && !is_floating(first) ? kiln::dtype::f32 : first;
  }
}

// Sets n.dt and n.weak (a value computed only from C++ scalars and constants is weak) from n's
// inputs in g. Leaves other than iota and custom ops (the user's rule decides) are left as they are.
constexpr void infer_dtype(const Graph& g, Node& n) {
  auto in = [&](int i) -> const Node& { return g.nodes[n.in[i]]; };
  bool all_weak = true;
  for (int i = 0; i < n.n_in; ++i) all_weak = all_weak && in(i).weak;
  n.weak = n.n_in > 0 && all_weak;
  switch (info(n.op).cls) {
    case OpClass::unary:
      n.dt = n.op == Op::cast                                  ? n.attrs.dt
             : n.op == Op::logical_not                         ? kiln::dtype::boolean
             : float_result_op(n.op) && !is_floating(in(0).dt) ? kiln::dtype::f32
                                                               : in(0).dt;
      return;
    case OpClass::binary:
      if (is_comparison(n.op)) {
        n.dt = kiln::dtype::boolean;
      } else {
        n.dt = promote_nodes(in(0), in(1));
        if (n.op == Op::div && !is_floating(n.dt)) n.dt = kiln::dtype::f32;
      }
      return;
    case OpClass::ternary:  // where(c, a, b)
      n.dt = promote_nodes(in(1), in(2));
      return;
    case OpClass::reduce:
      n.dt = n.op == Op::sum && !is_floating(in(0).dt) ? kiln::dtype::i64 : in(0).dt;
      return;
    case OpClass::meta:  // numel: an element count, as a number; iota_of: indices; shape_of: no value
      n.dt = n.op == Op::iota_of ? kiln::dtype::i64 : n.op == Op::shape_of ? in(0).dt : kiln::dtype::f64;
      n.weak = n.op == Op::numel;
      return;
    case OpClass::view:
      n.dt = in(0).dt;
      return;
    case OpClass::index:  // gather, embedding: the table's dtype; rand: f32
      n.weak = false;
      n.dt = n.op == Op::rand ? kiln::dtype::f32 : in(0).dt;
      return;
    case OpClass::extern_:
      if (is_custom(n.op)) {
        n.weak = false;
        if (n.op == Op::custom_backward) n.dt = in(static_cast<int>(n.attrs.a)).dt;
      } else if (n.op == Op::embedding_backward || n.op == Op::attention_flash || n.op == Op::attention_grad) {
        n.weak = false;
        n.dt = in(0).dt;
      } else if (n.op == Op::attention_lse) {
        n.weak = false;
        n.dt = kiln::dtype::f32;
      } else {  // matmul (attrs.a: written in attrs.dt, rewrite::widen_matmul_casts)
        n.dt = n.attrs.a ? n.attrs.dt : promote(in(0).dt, in(1).dt);
      }
      return;
    case OpClass::composite:
      n.dt = composite_dtype(g, n);
      return;
    case OpClass::leaf:
      if (n.op == Op::iota) n.dt = kiln::dtype::i64;
      return;
  }
}

}  // namespace kiln::graph::detail
