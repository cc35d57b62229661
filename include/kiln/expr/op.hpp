// The operation vocabulary: one enum for every node kind, and one table row per op giving its
// printed name, its class (what later stages may do with it) and its arity.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace kiln {

// X(enum name, printed name, class, arity). Classes: leaf, unary, binary, ternary, reduce, view,
// index (a value read or computed at a position known only at run time: gather, embedding, and
// rand, a counter-based random number of the element's position; their first operand is not read
// pointwise), meta (a value computed from a shape: numel, iota_of; shape_of is a shape and no value,
// the second input of a view sized from other nodes: graph/infer_views.hpp), extern (library calls and
// users' custom ops, whose arity is a maximum), composite (lowered to primitives by rewrite/decompose.hpp
// before fusion). sum_to_shape_of(g, x) is g summed over the dims x was broadcast along, reshaped to
// x's shape: a derivative rule's sum that only sizes can settle, so it exists in structural graphs
// (k::structure) and is settled at once where sizes are known (rewrite::Builder::sum_to_shape_of).
// grad_of(v, grad_leaf(x)[, cotangent]) is the gradient of value v with respect to x, x taken as
// an independent input (grad_leaf marks where a compiled k::grad called inside another function
// receives its argument): autodiff/expand_gradients.hpp replaces both after decomposition.
#define KILN_OPS(X)                                       \
  X(arg, "arg", leaf, 0)                                  \
  X(scalar, "scalar", leaf, 0)                            \
  X(constant, "constant", leaf, 0)                        \
  X(iota, "iota", leaf, 0)                                \
  X(numel, "numel", meta, 1)                              \
  X(iota_of, "iota_of", meta, 1)                          \
  X(shape_of, "shape_of", meta, 2)                        \
  X(neg, "neg", unary, 1)                                 \
  X(abs, "abs", unary, 1)                                 \
  X(sign, "sign", unary, 1)                               \
  X(exp, "exp", unary, 1)                                 \
  X(exp2, "exp2", unary, 1)                               \
  X(log, "log", unary, 1)                                 \
  X(log2, "log2", unary, 1)                               \
  X(log1p, "log1p", unary, 1)                             \
  X(expm1, "expm1", unary, 1)                             \
  X(sqrt, "sqrt", unary, 1)                               \
  X(rsqrt, "rsqrt", unary, 1)                             \
  X(reciprocal, "reciprocal", unary, 1)                   \
  X(square, "square", unary, 1)                           \
  X(sin, "sin", unary, 1)                                 \
  X(cos, "cos", unary, 1)                                 \
  X(tanh, "tanh", unary, 1)                               \
  X(sigmoid, "sigmoid", unary, 1)                         \
  X(erf, "erf", unary, 1)                                 \
  X(relu, "relu", unary, 1)                               \
  X(logical_not, "logical_not", unary, 1)                 \
  X(cast, "cast", unary, 1)                               \
  X(add, "add", binary, 2)                                \
  X(sub, "sub", binary, 2)                                \
  X(mul, "mul", binary, 2)                                \
  X(div, "div", binary, 2)                                \
  X(maximum, "maximum", binary, 2)                        \
  X(minimum, "minimum", binary, 2)                        \
  X(pow, "pow", binary, 2)                                \
  X(lt, "lt", binary, 2)                                  \
  X(le, "le", binary, 2)                                  \
  X(gt, "gt", binary, 2)                                  \
  X(ge, "ge", binary, 2)                                  \
  X(eq, "eq", binary, 2)                                  \
  X(ne, "ne", binary, 2)                                  \
  X(where, "where", ternary, 3)                           \
  X(sum, "sum", reduce, 1)                                \
  X(amax, "amax", reduce, 1)                              \
  X(amin, "amin", reduce, 1)                              \
  X(reshape, "reshape", view, 1)                          \
  X(permute, "permute", view, 1)                          \
  X(slice, "slice", view, 1)                              \
  X(expand, "expand", view, 1)                            \
  X(slice_backward, "slice_backward", view, 1)            \
  X(gather, "gather", index, 2)                           \
  X(matmul, "matmul", extern_, 2)                         \
  X(custom, "custom", extern_, 4)                         \
  X(custom_backward, "custom_backward", extern_, 5)       \
  X(silu, "silu", composite, 1)                           \
  X(gelu, "gelu", composite, 1)                           \
  X(gelu_tanh, "gelu_tanh", composite, 1)                 \
  X(clamp, "clamp", composite, 3)                         \
  X(mean, "mean", composite, 1)                           \
  X(var, "var", composite, 2)                             \
  X(logsumexp, "logsumexp", composite, 1)                 \
  X(softmax, "softmax", composite, 1)                     \
  X(log_softmax, "log_softmax", composite, 1)             \
  X(layer_norm, "layer_norm", composite, 4)               \
  X(rms_norm, "rms_norm", composite, 3)                   \
  X(cross_entropy, "cross_entropy", composite, 2)         \
  X(mse_loss, "mse_loss", composite, 2)                   \
  X(linear, "linear", composite, 3)                       \
  X(transpose, "transpose", composite, 1)                 \
  X(unsqueeze, "unsqueeze", composite, 1)                 \
  X(squeeze, "squeeze", composite, 1)                     \
  X(argmax, "argmax", composite, 1)                       \
  X(argmin, "argmin", composite, 1)                       \
  X(cat, "cat", composite, 2)                             \
  X(embedding, "embedding", index, 2)                     \
  X(embedding_backward, "embedding_backward", extern_, 3) \
  X(rand, "rand", index, 5)                               \
  X(attention, "attention", composite, 5)                 \
  X(attention_flash, "attention_flash", extern_, 4)       \
  X(attention_lse, "attention_lse", extern_, 3)           \
  X(attention_grad, "attention_grad", extern_, 6)         \
  X(score_arg, "score_arg", composite, 3)                 \
  X(sum_to_shape_of, "sum_to_shape_of", composite, 2)     \
  X(grad_leaf, "grad_leaf", composite, 1)                 \
  X(grad_of, "grad_of", composite, 3)

enum class Op : std::uint8_t {
#define KILN_OP_ENUM(e, s, c, n) e,
  KILN_OPS(KILN_OP_ENUM)
#undef KILN_OP_ENUM
};

enum class OpClass : std::uint8_t { leaf, meta, unary, binary, ternary, reduce, view, index, extern_, composite };

struct OpInfo {
  std::string_view name;
  OpClass cls;
  int arity;
};

inline constexpr std::array op_table = {
#define KILN_OP_ROW(e, s, c, n) OpInfo{s, OpClass::c, n},
    KILN_OPS(KILN_OP_ROW)
#undef KILN_OP_ROW
};

constexpr const OpInfo& info(Op op) { return op_table[static_cast<int>(op)]; }
constexpr std::string_view name(Op op) { return info(op).name; }
constexpr bool is_pointwise(Op op) {
  auto c = info(op).cls;
  return c == OpClass::unary || c == OpClass::binary || c == OpClass::ternary;
}
constexpr bool is_comparison(Op op) { return op >= Op::lt && op <= Op::ne; }
constexpr bool is_reduction(Op op) { return info(op).cls == OpClass::reduce; }
constexpr bool is_view(Op op) { return info(op).cls == OpClass::view; }
constexpr bool is_composite(Op op) { return info(op).cls == OpClass::composite; }
// Evaluated by the GPU's special function unit or a long polynomial (block shapes weigh them).
constexpr bool is_transcendental(Op op) {
  switch (op) {
    case Op::exp:
    case Op::exp2:
    case Op::log:
    case Op::log2:
    case Op::log1p:
    case Op::expm1:
    case Op::sin:
    case Op::cos:
    case Op::tanh:
    case Op::sigmoid:
    case Op::erf:
    case Op::pow:
      return true;
    default:
      return false;
  }
}
// A user's op (k::custom_op) or the gradient of one of its inputs: opaque calls, never fused.
constexpr bool is_custom(Op op) { return op == Op::custom || op == Op::custom_backward; }
// The fused attention kernels' nodes (lowering makes them; the scale is the input after q, k, v and
// the backward's cotangent and statistics, then the tensors a score_mod reads).
constexpr bool is_fused_attention(Op op) {
  return op == Op::attention_flash || op == Op::attention_lse || op == Op::attention_grad;
}
// Extern steps that read their inputs as whole contiguous buffers (no views, no strides): lowering
// copies strided arguments for them and the scheduler gives every input a buffer.
constexpr bool reads_whole_buffers(Op op) {
  return is_custom(op) || op == Op::embedding_backward || is_fused_attention(op);
}

}  // namespace kiln
