// Views of eager tensors, applied to the tensor itself as PyTorch's eager views are: a slice,
// permute, expand or reshape of a k::Tensor inside an expression becomes a strided view of the same
// storage (shape, strides, offset), so the kernel reads it in place and the view's attributes are
// values of that call, not part of the program. A loop over `k::slice(m, 0, i, i + 1)` or over many
// `k::reshape(m, {a, b})` then reuses one compiled program instead of compiling one per value.
// Views of expressions and of a compiled function's arguments stay graph nodes (their gradients
// flow through them).
#pragma once
#include <type_traits>

#include "../expr/node.hpp"
#include "infer.hpp"

namespace kiln::graph {

constexpr bool is_folded_view_op(Op op) {
  switch (op) {
    case Op::reshape:
    case Op::permute:
    case Op::transpose:
    case Op::slice:
    case Op::expand:
    case Op::unsqueeze:
    case Op::squeeze:
      return true;
    default:
      return false;
  }
}

// A chain of views ending in an eager tensor.
template <class E>
struct is_leaf_view : std::false_type {};
template <Op O, class C>
requires(is_folded_view_op(O)) struct is_leaf_view<expr::Node<O, C>>
    : std::bool_constant<std::is_same_v<C, expr::TensorLeaf> || is_leaf_view<C>::value> {
};

// The view `op` (with its attributes) of t, sharing t's storage. Shapes and errors are inference's
// own (graph::detail::view_shape); a reshape of a tensor whose strides cannot express the new shape
// reads a contiguous copy, as torch.reshape does.
inline Tensor view_of(const Tensor& t, Op op, Attrs at) {
  const Dims& xs = t.shape();
  const Dims& st = t.strides();
  Dims shape = detail::view_shape(op, xs, at);  // validates, and normalises a permutation
  const int rank = xs.size();
  Dims strides;
  std::int64_t offset = t.offset();
  switch (op) {
    case Op::reshape: {
      if (!t.is_contiguous()) return view_of(t.contiguous(), op, at);
      return t.as_strided(shape, contiguous_strides(shape), offset);
    }
    case Op::permute:
      for (auto d : at.dims) strides.push_back(st[static_cast<int>(d)]);
      break;
    case Op::transpose: {
      strides = st;
      if (rank > 0)
        std::swap(strides[normalize_dim(at.a, rank, "transpose")], strides[normalize_dim(at.b, rank, "transpose")]);
      break;
    }
    case Op::slice: {
      int d = normalize_dim(at.a, rank, "slice");
      std::int64_t start = std::clamp<std::int64_t>(at.b < 0 ? at.b + xs[d] : at.b, 0, xs[d]);
      strides = st;
      if (shape[d] > 0) offset += start * st[d];
      strides[d] = st[d] * at.d;
      break;
    }
    case Op::expand:  // new leading dims and size-1 dims that grow read one element: stride 0
      for (int i = 0; i < shape.size(); ++i) {
        int j = i - (shape.size() - rank);
        strides.push_back(j < 0 || (xs[j] == 1 && shape[i] != 1) ? 0 : st[j]);
      }
      break;
    case Op::unsqueeze: {
      int d = normalize_dim(at.a, rank + 1, "unsqueeze");
      strides = st;
      strides.insert(d, d < rank ? st[d] * xs[d] : 1);
      break;
    }
    case Op::squeeze:
      for (int i = 0; i < rank; ++i) {
        bool drop = xs[i] == 1 && (at.all || i == normalize_dim(at.a, rank, "squeeze"));
        if (!drop) strides.push_back(st[i]);
      }
      break;
    default:
      throw error("view_of: " + std::string(name(op)) + " is not a view");
  }
  return t.as_strided(shape, strides, offset);
}

// The tensor a chain of views of an eager tensor denotes.
inline const Tensor& leaf_tensor(const expr::TensorLeaf& e) { return e.t; }
template <Op O, class C>
Tensor leaf_tensor(const expr::Node<O, C>& e) {
  return view_of(leaf_tensor(std::get<0>(e.in())), O, e.attrs());
}

}  // namespace kiln::graph
