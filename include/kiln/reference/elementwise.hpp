// The oracle's elementwise rules: each unary and binary op on one f64 value, straight from its
// definition, and `pointwise`, which applies such a rule over inputs broadcast to a node's shape.
#pragma once
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numbers>
#include <span>
#include <string>

#include "../graph/graph.hpp"
#include "value.hpp"

namespace kiln::reference {
namespace detail {

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

}  // namespace detail

}  // namespace kiln::reference
