// How generated kernels spell values and operations in C: the C type of a dtype in registers and in
// memory, literals, and the operator or prelude function of each primitive.
#pragma once
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../core/dtype.hpp"
#include "../expr/op.hpp"
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

}  // namespace detail

// True when n is a constant multiple of `block`.
inline bool divides(std::int64_t block, const Sym& n) {
  return block > 0 && n.is_constant() && n.constant_value() % block == 0;
}

}  // namespace kiln::codegen
