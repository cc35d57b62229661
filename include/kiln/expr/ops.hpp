// The user-facing operations of API.md: each builds a lazy expression node; nothing runs here.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "node.hpp"

namespace kiln {

// A tensor-like operand: an expression or a k::Tensor (not a bare C++ number).
template <class T>
concept TensorLike = Expr<T> || std::is_same_v<std::remove_cvref_t<T>, Tensor>;

template <class A, class B>
concept BinaryOperands = Operand<A> && Operand<B> &&(TensorLike<A> || TensorLike<B>);

// A tensor-like operand next to something kiln cannot take (a std::vector, a pointer, a user type):
// one sentence from kiln instead of a page of unrelated operator candidates. The rejected type is
// the argument of `invalid_operand<...>` in the compiler's instantiation note.
template <class A, class B>
concept MisusedOperands = (TensorLike<A> && !Operand<B>) || (TensorLike<B> && !Operand<A>);
namespace detail {
template <class T>
inline constexpr bool always_false = false;
template <class T>
struct invalid_operand {
  static_assert(always_false<T>,
                "kiln: operands must be tensors, kiln expressions or arithmetic scalars (the type is invalid_operand's "
                "argument)");
  using type = T;
};
template <class A, class B>
using rejected_operand = typename invalid_operand<std::remove_cvref_t<std::conditional_t<Operand<A>, B, A>>>::type;
}  // namespace detail

// Reduction dims: an int, a braced list, a vector, or nothing (= all dims).
struct DimList {
  Dims dims;
  bool all = false;
  DimList() : all(true) {}
  DimList(int d) : dims{d} {}
  DimList(std::int64_t d) : dims{d} {}
  DimList(std::initializer_list<std::int64_t> l) : dims(l) {}
  DimList(const std::vector<std::int64_t>& v) : dims(v) {}
};

enum class approximate { none, tanh };

#define KILN_BINARY_OPERATOR(sym, op)                                                                        \
  template <class A, class B>                                                                                \
  requires BinaryOperands<A, B>                                                                              \
  auto operator sym(A&& a, B&& b) { return expr::make<Op::op>({}, std::forward<A>(a), std::forward<B>(b)); } \
  template <class A, class B>                                                                                \
  requires MisusedOperands<A, B> Tensor operator sym(A&&, B&&) {                                             \
    using rejected [[maybe_unused]] = detail::rejected_operand<A, B>;                                        \
    return {};                                                                                               \
  }
KILN_BINARY_OPERATOR(+, add)
KILN_BINARY_OPERATOR(-, sub)
KILN_BINARY_OPERATOR(*, mul)
KILN_BINARY_OPERATOR(/, div)
KILN_BINARY_OPERATOR(<, lt)
KILN_BINARY_OPERATOR(<=, le)
KILN_BINARY_OPERATOR(>, gt)
KILN_BINARY_OPERATOR(>=, ge)
KILN_BINARY_OPERATOR(==, eq)
KILN_BINARY_OPERATOR(!=, ne)
#undef KILN_BINARY_OPERATOR

#define KILN_BINARY_FUNCTION(fn, op)                                                               \
  template <class A, class B>                                                                      \
  requires BinaryOperands<A, B>                                                                    \
  auto fn(A&& a, B&& b) { return expr::make<Op::op>({}, std::forward<A>(a), std::forward<B>(b)); } \
  template <class A, class B>                                                                      \
  requires MisusedOperands<A, B> Tensor fn(A&&, B&&) {                                             \
    using rejected [[maybe_unused]] = detail::rejected_operand<A, B>;                              \
    return {};                                                                                     \
  }
KILN_BINARY_FUNCTION(maximum, maximum)
KILN_BINARY_FUNCTION(minimum, minimum)
#undef KILN_BINARY_FUNCTION

template <TensorLike A>
auto operator-(A&& a) {
  return expr::make<Op::neg>({}, std::forward<A>(a));
}

#define KILN_UNARY_FUNCTION(fn)                        \
  template <TensorLike A>                              \
  auto fn(A&& a) {                                     \
    return expr::make<Op::fn>({}, std::forward<A>(a)); \
  }
KILN_UNARY_FUNCTION(abs)
KILN_UNARY_FUNCTION(exp)
KILN_UNARY_FUNCTION(exp2)
KILN_UNARY_FUNCTION(log)
KILN_UNARY_FUNCTION(log2)
KILN_UNARY_FUNCTION(log1p)
KILN_UNARY_FUNCTION(expm1)
KILN_UNARY_FUNCTION(sqrt)
KILN_UNARY_FUNCTION(rsqrt)
KILN_UNARY_FUNCTION(square)
KILN_UNARY_FUNCTION(sin)
KILN_UNARY_FUNCTION(cos)
KILN_UNARY_FUNCTION(tanh)
KILN_UNARY_FUNCTION(sigmoid)
KILN_UNARY_FUNCTION(erf)
KILN_UNARY_FUNCTION(relu)
KILN_UNARY_FUNCTION(silu)
KILN_UNARY_FUNCTION(reciprocal)
KILN_UNARY_FUNCTION(sign)
KILN_UNARY_FUNCTION(logical_not)
#undef KILN_UNARY_FUNCTION

// The approximation is an attribute (guarded like dims), so both forms share one node type.
template <TensorLike A>
auto gelu(A&& a, approximate mode = approximate::none) {
  Attrs at;
  at.a = mode == approximate::tanh ? 1 : 0;
  return expr::make<Op::gelu>(at, std::forward<A>(a));
}

template <TensorLike A, class S>
requires std::is_arithmetic_v<S>
auto pow(A&& a, S exponent) { return expr::make<Op::pow>({}, std::forward<A>(a), exponent); }

template <class C, class A, class B>
requires Operand<C> && Operand<A> && Operand<B>
auto where(C&& c, A&& a, B&& b) {
  return expr::make<Op::where>({}, std::forward<C>(c), std::forward<A>(a), std::forward<B>(b));
}
template <TensorLike X, class L, class H>
requires Operand<L> && Operand<H>
auto clamp(X&& x, L&& lo, H&& hi) {
  return expr::make<Op::clamp>({}, std::forward<X>(x), std::forward<L>(lo), std::forward<H>(hi));
}
template <TensorLike X>
auto cast(X&& x, kiln::dtype d) {
  Attrs at;
  at.dt = d;
  return expr::make<Op::cast>(at, std::forward<X>(x));
}

// ---- reductions ----------------------------------------------------------------------------------
namespace detail {
inline Attrs reduce_attrs(const DimList& d, bool keepdim) {
  Attrs at;
  at.dims = d.dims;
  at.all = d.all;
  at.keepdim = keepdim;
  return at;
}
}  // namespace detail

// With no dims the result is typed as a full reduction (a single element), which k::grad checks.
#define KILN_REDUCTION(fn)                                                                          \
  template <TensorLike X>                                                                           \
  auto fn(X&& x, DimList dims, bool keepdim = false) {                                              \
    return expr::make<Op::fn>(detail::reduce_attrs(dims, keepdim), std::forward<X>(x));             \
  }                                                                                                 \
  template <TensorLike X>                                                                           \
  auto fn(X&& x) {                                                                                  \
    using N = decltype(expr::make<Op::fn>({}, std::forward<X>(x)));                                 \
    return expr::FullReduction<N>(detail::reduce_attrs({}, false), expr::lift(std::forward<X>(x))); \
  }
KILN_REDUCTION(sum)
KILN_REDUCTION(mean)
KILN_REDUCTION(amax)
KILN_REDUCTION(amin)
#undef KILN_REDUCTION

template <TensorLike X>
auto var(X&& x, DimList dims, double correction = 1, bool keepdim = false) {
  return expr::make<Op::var>(detail::reduce_attrs(dims, keepdim), std::forward<X>(x), correction);
}
template <TensorLike X>
auto var(X&& x) {
  using N = decltype(expr::make<Op::var>({}, std::forward<X>(x), 1.0));
  return expr::FullReduction<N>(detail::reduce_attrs({}, false), expr::lift(std::forward<X>(x)), expr::lift(1.0));
}
template <TensorLike X>
auto logsumexp(X&& x, std::int64_t dim, bool keepdim = false) {
  return expr::make<Op::logsumexp>(detail::reduce_attrs(DimList(dim), keepdim), std::forward<X>(x));
}

// The index (i64) of the largest / smallest element along `dim`: the first one where several are
// equal, and the first NaN where there is one (as PyTorch). No gradient flows through them.
template <TensorLike X>
auto argmax(X&& x, std::int64_t dim, bool keepdim = false) {
  return expr::make<Op::argmax>(detail::reduce_attrs(DimList(dim), keepdim), std::forward<X>(x));
}
template <TensorLike X>
auto argmin(X&& x, std::int64_t dim, bool keepdim = false) {
  return expr::make<Op::argmin>(detail::reduce_attrs(DimList(dim), keepdim), std::forward<X>(x));
}

// ---- composites ----------------------------------------------------------------------------------
template <TensorLike X>
auto softmax(X&& x, std::int64_t dim) {
  return expr::make<Op::softmax>(detail::reduce_attrs(DimList(dim), true), std::forward<X>(x));
}
template <TensorLike X>
auto log_softmax(X&& x, std::int64_t dim) {
  return expr::make<Op::log_softmax>(detail::reduce_attrs(DimList(dim), true), std::forward<X>(x));
}
template <TensorLike X, TensorLike W, TensorLike B>
auto layer_norm(X&& x, W&& w, B&& b, double eps = 1e-5) {
  return expr::make<Op::layer_norm>({}, std::forward<X>(x), std::forward<W>(w), std::forward<B>(b), eps);
}
template <TensorLike X, TensorLike W>
auto rms_norm(X&& x, W&& w, double eps = 1e-6) {
  return expr::make<Op::rms_norm>({}, std::forward<X>(x), std::forward<W>(w), eps);
}
template <TensorLike L, TensorLike T>
auto cross_entropy(L&& logits, T&& targets) {
  return expr::make<Op::cross_entropy>({}, std::forward<L>(logits), std::forward<T>(targets));
}
template <TensorLike A, TensorLike B>
auto mse_loss(A&& a, B&& b) {
  return expr::make<Op::mse_loss>({}, std::forward<A>(a), std::forward<B>(b));
}
template <TensorLike A, TensorLike B>
auto matmul(A&& a, B&& b) {
  return expr::make<Op::matmul>({}, std::forward<A>(a), std::forward<B>(b));
}
template <TensorLike X, TensorLike W, TensorLike B>
auto linear(X&& x, W&& w, B&& b) {
  return expr::make<Op::linear>({}, std::forward<X>(x), std::forward<W>(w), std::forward<B>(b));
}
template <TensorLike X, TensorLike W>
auto linear(X&& x, W&& w) {
  return expr::make<Op::linear>({}, std::forward<X>(x), std::forward<W>(w), 0.0);
}

// ---- views ----------------------------------------------------------------------------------------
template <TensorLike X>
auto reshape(X&& x, const Dims& shape) {
  for (auto s : shape)  // below -1 are the pipeline's own sizes (Attrs::input_dim)
    if (s < -1) throw shape_error("reshape: invalid size " + std::to_string(s) + " in " + shape.str());
  Attrs at;
  at.dims = shape;
  return expr::make<Op::reshape>(at, std::forward<X>(x));
}
template <TensorLike X>
auto permute(X&& x, const Dims& order) {
  Attrs at;
  at.dims = order;
  return expr::make<Op::permute>(at, std::forward<X>(x));
}
template <TensorLike X>
auto transpose(X&& x, std::int64_t d0, std::int64_t d1) {
  Attrs at;
  at.a = d0;
  at.b = d1;
  return expr::make<Op::transpose>(at, std::forward<X>(x));
}
template <TensorLike X>
auto slice(X&& x, std::int64_t dim, std::int64_t start, std::int64_t stop, std::int64_t step = 1) {
  Attrs at;
  at.a = dim;
  at.b = start;
  at.c = stop;
  at.d = step;
  return expr::make<Op::slice>(at, std::forward<X>(x));
}
template <TensorLike X>
auto expand(X&& x, const Dims& shape) {
  Attrs at;
  at.dims = shape;
  return expr::make<Op::expand>(at, std::forward<X>(x));
}
template <TensorLike X>
auto unsqueeze(X&& x, std::int64_t dim) {
  Attrs at;
  at.a = dim;
  return expr::make<Op::unsqueeze>(at, std::forward<X>(x));
}
// squeeze(x, dim) removes one size-1 dim; squeeze(x) removes all of them.
template <TensorLike X>
auto squeeze(X&& x, std::int64_t dim) {
  Attrs at;
  at.a = dim;
  return expr::make<Op::squeeze>(at, std::forward<X>(x));
}
template <TensorLike X>
auto squeeze(X&& x) {
  Attrs at;
  at.all = true;
  return expr::make<Op::squeeze>(at, std::forward<X>(x));
}

// ---- indexing ------------------------------------------------------------------------------------
// embedding(table [V, D], ids): the table's rows at the i64/i32 ids, of shape ids.shape + [D]. An id
// outside [0, V) reads zeros, never memory outside the table, and is reported as a k::error where
// indices are checked (CPU evaluation, or options.check_indices). The table's gradient is a
// deterministic scatter-add (the same bits every run); no gradient flows to the ids.
template <TensorLike T, TensorLike I>
auto embedding(T&& table, I&& ids) {
  return expr::make<Op::embedding>({}, std::forward<T>(table), std::forward<I>(ids));
}

// ---- attention ------------------------------------------------------------------------------------
struct attention_options {
  bool causal = false;                        // query i sees keys j <= i (aligned top-left, as torch's SDPA)
  std::optional<double> scale = std::nullopt;  // none: 1 / sqrt(head dim)
};
// attention(q [B, H, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, Dv]) -> [B, H, Tq, Dv]:
// softmax(q k^T * scale) v per head, each k/v head serving H / Hkv query heads (grouped-query
// attention). Differentiable in q, k and v. A row that a mask empties gives zeros. The scale is a
// run-time value. On a GPU over 16-bit operands with a head dim the kernels take, fused forward and
// backward kernels (runtime/extern/attention.hpp); else batched matmuls and a softmax
// (rewrite/decompose.hpp).
template <TensorLike Q, TensorLike K, TensorLike V>
auto attention(Q&& q, K&& k, V&& v, attention_options o = {}) {
  Attrs at;
  at.a = o.causal;
  at.b = o.scale.has_value();
  return expr::make<Op::attention>(at, std::forward<Q>(q), std::forward<K>(k), std::forward<V>(v),
                                   o.scale.value_or(0.0), 0.0);
}
// attention with a score_mod, as FlexAttention: a generic lambda (score, b, h, i, j) -> expression
// of the scaled score and its batch, head, query and key indices (i64), each [B, H, Tq, Tk]; it may
// read tensors it captures (a relative bias) and return -inf to mask. Applied before the causal mask
// and the softmax, and differentiated with the rest (the tensors it reads get gradients too).
template <TensorLike Q, TensorLike K, TensorLike V, class ScoreMod>
requires(!std::is_same_v<std::remove_cvref_t<ScoreMod>, attention_options>) auto attention(
    const Q& q, const K& k, const V& v, ScoreMod&& score_mod, attention_options o = {}) {
  const double scale = o.scale.value_or(0.0);
  auto arg = [&](int which) {
    Attrs at;
    at.a = which;
    at.b = o.scale.has_value();
    return expr::make<Op::score_arg>(at, q, k, scale);
  };
  auto modded = score_mod(arg(0), arg(1), arg(2), arg(3), arg(4));
  static_assert(Operand<decltype(modded)>, "k::attention: score_mod must return a kiln expression (or a number)");
  Attrs at;
  at.a = o.causal;
  at.b = o.scale.has_value();
  at.c = 1;
  return expr::make<Op::attention>(at, q, k, v, scale, std::move(modded));
}

// ---- randomness -----------------------------------------------------------------------------------
// Counter-based (Philox 4x32-10) uniform numbers in [0, 1): element i of the result is a function of
// (seed, offset, i) alone, so the CPU and the GPU give the same bits and a backward pass regenerates
// a mask instead of saving it. Seed and offset are run-time values: changing them never recompiles.
// Draws of one seed do not overlap when each call's offset advances by the previous call's numel.
template <TensorLike X>
auto rand_like(X&& x, std::uint64_t seed, std::uint64_t offset = 0) {
  auto word = [](std::uint64_t v, int half) { return static_cast<std::int64_t>((v >> (32 * half)) & 0xffffffffu); };
  return expr::make<Op::rand>({}, std::forward<X>(x), word(seed, 0), word(seed, 1), word(offset, 0), word(offset, 1));
}
// dropout(x, p, seed, offset): each element zeroed with probability p (where rand_like(x, seed,
// offset) < p), the rest scaled by 1 / (1 - p). p and the seed are run-time values.
template <TensorLike X>
auto dropout(X&& x, double p, std::uint64_t seed, std::uint64_t offset = 0) {
  if (!(p >= 0.0 && p <= 1.0)) throw error("dropout: p must be in [0, 1], got " + std::to_string(p));
  const double scale = p < 1.0 ? 1.0 / (1.0 - p) : 0.0;  // p = 1 drops everything (and its gradient)
  auto keep = rand_like(x, seed, offset) >= p;
  return where(std::move(keep), std::forward<X>(x) * scale, 0.0);
}

// ---- joining ---------------------------------------------------------------------------------------
// cat(dim, xs...): the operands one after another along `dim` (same rank, equal sizes elsewhere,
// dtypes promoted as arithmetic does); built as nested two-operand cats, each lowered to a select
// between the operands' zero-padded views, so a cat fuses into its consumer as any view does.
template <TensorLike X>
auto cat(std::int64_t, X&& x) {
  return expr::lift(std::forward<X>(x));
}
template <TensorLike X, TensorLike Y, TensorLike... Rest>
auto cat(std::int64_t dim, X&& x, Y&& y, Rest&&... rest) {
  Attrs at;
  at.a = dim;
  auto two = expr::make<Op::cat>(at, std::forward<X>(x), std::forward<Y>(y));
  if constexpr (sizeof...(Rest) == 0)
    return two;
  else
    return cat(dim, std::move(two), std::forward<Rest>(rest)...);
}
// stack(dim, xs...): the operands (all of one shape) along a new dim `dim`.
template <TensorLike... X>
requires(sizeof...(X) > 0) auto stack(std::int64_t dim, X&&... xs) {
  return cat(dim, unsqueeze(std::forward<X>(xs), dim)...);
}

}  // namespace kiln
