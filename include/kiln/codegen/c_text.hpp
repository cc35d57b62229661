// How generated kernels spell values and operations in C: the C type of a dtype in registers and in
// memory, literals, and the operator or prelude function of each primitive.
#pragma once
#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../core/dtype.hpp"
#include "../expr/op.hpp"
#include "../graph/graph.hpp"
#include "../ir/sym.hpp"

namespace kiln::codegen {

namespace detail {

inline std::string c_type(kiln::dtype d) {
  switch (compute_dtype(d)) {
    case kiln::dtype::f64:
      return "double";
    case kiln::dtype::i64:
      return "i64";
    case kiln::dtype::i32:
      return "int";
    case kiln::dtype::boolean:
      return "bool";
    default:
      return "float";
  }
}
inline std::string storage_c_type(kiln::dtype d) {
  switch (d) {
    case kiln::dtype::f16:
      return "f16";
    case kiln::dtype::bf16:
      return "bf16";
    default:
      return c_type(d);
  }
}

inline std::string literal(double v, kiln::dtype ct) {
  if (std::isnan(v)) return ct == kiln::dtype::f64 ? "(0.0 / 0.0)" : "(0.0f / 0.0f)";
  if (std::isinf(v)) return std::string(v < 0 ? "-" : "") + (ct == kiln::dtype::f64 ? "(double)KILN_INF" : "KILN_INF");
  char buf[64];
  switch (compute_dtype(ct)) {
    case kiln::dtype::f64:
      std::snprintf(buf, sizeof buf, "%.17g", v);
      break;
    case kiln::dtype::f32:
      std::snprintf(buf, sizeof buf, "%.9gf", v);
      break;
    case kiln::dtype::boolean:
      return v != 0 ? "true" : "false";
    case kiln::dtype::i32:
      std::snprintf(buf, sizeof buf, "%d", static_cast<int>(v));
      return buf;
    default:
      std::snprintf(buf, sizeof buf, "%lldLL", static_cast<long long>(v));
      return buf;
  }
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s.insert(s.size() - (compute_dtype(ct) == kiln::dtype::f32), ".0");
  return s;
}

// Sizes for unravelling an index: a size-0 dim launches nothing, so any nonzero stand-in works.
inline std::vector<Sym> nonzero(const std::vector<Sym>& sizes) {
  std::vector<Sym> out = sizes;
  for (auto& s : out)
    if (s.is_constant() && s.constant_value() == 0) s = Sym(1);
  return out;
}

// The C++ operator or prelude function of each primitive.
inline std::string pointwise_expr(Op op, const std::vector<std::string>& a) {
  switch (op) {
    case Op::add:
      return a[0] + " + " + a[1];
    case Op::sub:
      return a[0] + " - " + a[1];
    case Op::mul:
      return a[0] + " * " + a[1];
    case Op::div:
      return a[0] + " / " + a[1];
    case Op::lt:
      return a[0] + " < " + a[1];
    case Op::le:
      return a[0] + " <= " + a[1];
    case Op::gt:
      return a[0] + " > " + a[1];
    case Op::ge:
      return a[0] + " >= " + a[1];
    case Op::eq:
      return a[0] + " == " + a[1];
    case Op::ne:
      return a[0] + " != " + a[1];
    case Op::where:
      return "kiln::where(" + a[0] + ", " + a[1] + ", " + a[2] + ")";
    default:
      break;
  }
  std::string s = "kiln::" + std::string(name(op)) + "(";
  for (std::size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + a[i];
  return s + ")";
}

// A value being written: its C text and compute dtype; constants stay literals, so that each use
// spells them in the dtype it needs.
struct CValue {
  std::string code;
  kiln::dtype ct = kiln::dtype::f32;
  bool literal = false;
  double value = 0;
};
inline CValue cast_value(const CValue& v, kiln::dtype to) {
  const kiln::dtype ct = compute_dtype(to);
  if (v.literal) return {literal(v.value, ct), ct, true, v.value};
  if (compute_dtype(v.ct) == ct && to != kiln::dtype::f16 && to != kiln::dtype::bf16) return {v.code, ct};
  return {"kiln::cast<" + c_type(ct) + ">(" + v.code + ")", ct};
}

// The C expression of pointwise node n of g (unary, binary or ternary, casts included) over its
// operands' values `in`; nothing where its value is its operand's (a cast within a compute dtype).
// Comparisons compare in their operands' promoted dtype (a C++ scalar takes the other side's), a
// where's condition is a bool, arithmetic on booleans gives a boolean (nonzero is true).
inline std::optional<std::string> pointwise_code(const graph::Graph& g, const graph::Node& n,
                                                 const std::vector<CValue>& in) {
  const kiln::dtype ct = compute_dtype(n.dt);
  if (n.op == Op::cast) {
    const CValue& a = in[0];
    if (n.attrs.dt == kiln::dtype::f16 || n.attrs.dt == kiln::dtype::bf16)
      return "kiln::round_to<" + storage_c_type(n.attrs.dt) + ">(" + cast_value(a, kiln::dtype::f32).code + ")";
    if (n.attrs.dt == kiln::dtype::boolean) return a.code + " != " + literal(0, a.ct);
    if (compute_dtype(a.ct) == ct) return std::nullopt;
    return cast_value(a, n.attrs.dt).code;
  }
  if (n.op == Op::logical_not) return "kiln::logical_not(" + cast_value(in[0], kiln::dtype::boolean).code + ")";
  kiln::dtype operand = ct;
  if (is_comparison(n.op)) {
    const graph::Node &a = g[n.in[0]], &b = g[n.in[1]];
    operand = compute_dtype(a.weak && !b.weak   ? promote_with_scalar(b.dt, is_floating(a.dt))
                            : b.weak && !a.weak ? promote_with_scalar(a.dt, is_floating(b.dt))
                                                : promote(a.dt, b.dt));
  }
  std::vector<std::string> args;
  for (int i = 0; i < n.n_in; ++i)
    args.push_back(
        cast_value(in[static_cast<std::size_t>(i)], n.op == Op::where && i == 0 ? kiln::dtype::boolean : operand).code);
  if (n.dt == kiln::dtype::boolean && (n.op == Op::add || n.op == Op::sub || n.op == Op::mul))
    return "(" + pointwise_expr(n.op, args) + " != 0)";
  return pointwise_expr(n.op, args);
}

}  // namespace detail

// True when n is a constant multiple of `block`.
inline bool divides(std::int64_t block, const Sym& n) {
  return block > 0 && n.is_constant() && n.constant_value() % block == 0;
}

}  // namespace kiln::codegen
