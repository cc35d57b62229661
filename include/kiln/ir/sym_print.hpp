// Printing a Sym: str() for logs and c_expr() for generated C, C++ and CUDA, with sym_c_helpers,
// the definitions of the helpers c_expr() may call, for the preludes of generated kernels.
#pragma once
#include <cstdint>
#include <limits>
#include <string>

#include "sym.hpp"

namespace kiln {

namespace detail {

inline std::string c_literal(std::int64_t v, bool c_syntax = false) {
  // -9223372036854775808 is not a C literal: the minus applies to a number too big for long long.
  if (v == std::numeric_limits<std::int64_t>::min()) return c_syntax ? "(-9223372036854775807LL - 1)" : "(-9223372036854775807 - 1)";
  // In C, past int a long long by its suffix (unsuffixed it would be long, which the helpers' int
  // and long long overloads match equally well).
  if (c_syntax && (v > std::numeric_limits<int>::max() || v < std::numeric_limits<int>::min()))
    return std::to_string(v) + "LL";
  return std::to_string(v);
}

// C's / and % agree with floor division only for a nonnegative dividend and a positive divisor.
inline bool native_division(const Sym& s) { return node_of(s.args()[0]).lo >= 0 && node_of(s.args()[1]).lo >= 1; }

// How tightly a printed expression binds: 3 atom or call, 2 product or quotient, 1 sum or negation.
inline int print_precedence(const Sym& s, bool c_syntax) {
  switch (s.kind()) {
    case SymKind::constant:
    case SymKind::mul:
      return term_coef(s) < 0 ? 1 : s.is_constant() ? 3 : 2;
    case SymKind::add:
      return 1;
    case SymKind::floordiv:
    case SymKind::mod:
      return c_syntax && !native_division(s) ? 3 : 2;
    default:
      return 3;
  }
}

struct SymPrinter {
  bool c_syntax;
  std::string out;

  void operand(const Sym& s, int need) {
    bool paren = print_precedence(s, c_syntax) < need;
    if (paren) out += '(';
    print(s);
    if (paren) out += ')';
  }
  // A product with its coefficient times `sign`: sums print `x - 2*y`, not `x + -2*y`.
  void product(const Sym& s, std::int64_t sign) {
    auto f = s.args();
    std::int64_t k = term_coef(s) * sign;
    std::size_t i = f[0].is_constant() ? 1 : 0;
    if (k == -1) out += '-';
    if (k != 1 && k != -1) out += c_literal(k, c_syntax) + "*";
    for (std::size_t j = i; j < f.size(); ++j) {
      if (j > i) out += '*';
      operand(f[j], 3);
    }
  }
  void sum(const Sym& s) {
    for (std::size_t i = 0; i < s.args().size(); ++i) {
      const Sym& t = s.args()[i];
      bool negative = i > 0 && term_coef(t) < 0;
      if (i > 0) out += negative ? " - " : " + ";
      if (!negative)
        operand(t, 1);
      else if (t.is_constant())
        out += c_literal(-t.constant_value(), c_syntax);
      else
        product(t, -1);
    }
  }
  void division(const Sym& s) {
    const Sym& a = s.args()[0];
    const Sym& b = s.args()[1];
    bool div = s.kind() == SymKind::floordiv;
    if (c_syntax && !native_division(s)) {
      out += div ? "kiln_floordiv(" : "kiln_mod(";
      call_args(a, b);
      return;
    }
    bool nested = a.kind() == SymKind::floordiv || a.kind() == SymKind::mod;
    operand(a, nested ? 3 : 2);  // (x / 4) % 3 reads better than x / 4 % 3
    out += div ? (c_syntax ? " / " : " // ") : " % ";
    operand(b, 3);
  }
  void call_args(const Sym& a, const Sym& b) {
    print(a);
    out += ", ";
    print(b);
    out += ')';
  }
  void print(const Sym& s) {
    switch (s.kind()) {
      case SymKind::constant:
        out += c_literal(s.constant_value(), c_syntax);
        break;
      case SymKind::symbol:
        out += s.symbol_name();
        break;
      case SymKind::mul:
        product(s, 1);
        break;
      case SymKind::add:
        sum(s);
        break;
      case SymKind::floordiv:
      case SymKind::mod:
        division(s);
        break;
      case SymKind::min:
        out += c_syntax ? "kiln_min(" : "min(";
        call_args(s.args()[0], s.args()[1]);
        break;
      case SymKind::max:
        out += c_syntax ? "kiln_max(" : "max(";
        call_args(s.args()[0], s.args()[1]);
        break;
    }
  }
};

inline std::string sym_print(const Sym& s, bool c_syntax) {
  SymPrinter p{c_syntax, {}};
  p.print(s);
  return std::move(p.out);
}

}  // namespace detail

inline std::string Sym::str() const { return detail::sym_print(*this, false); }
inline std::string Sym::c_expr() const { return detail::sym_print(*this, true); }

// Definitions of the helpers c_expr() may call (Python-style floor division and modulo, min,
// max), for the preludes of generated kernels; valid C++, CUDA and NVRTC source.
inline constexpr const char* sym_c_helpers = R"(#ifndef KILN_SYM_HELPERS
#define KILN_SYM_HELPERS
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KILN_SYM_FN __host__ __device__ inline
#else
#define KILN_SYM_FN inline
#endif
KILN_SYM_FN long long kiln_floordiv(long long a, long long b) {
  long long q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
KILN_SYM_FN long long kiln_mod(long long a, long long b) {
  long long r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
KILN_SYM_FN long long kiln_min(long long a, long long b) { return a < b ? a : b; }
KILN_SYM_FN long long kiln_max(long long a, long long b) { return a < b ? b : a; }
// 32-bit operands stay 32-bit (kernels whose indices fit in an int, codegen's `ix`); a mix of the
// two widths takes the 64-bit helpers above.
KILN_SYM_FN int kiln_floordiv(int a, int b) {
  int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
KILN_SYM_FN int kiln_mod(int a, int b) {
  int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
KILN_SYM_FN int kiln_min(int a, int b) { return a < b ? a : b; }
KILN_SYM_FN int kiln_max(int a, int b) { return a < b ? b : a; }
KILN_SYM_FN long long kiln_floordiv(int a, long long b) { return kiln_floordiv((long long)a, b); }
KILN_SYM_FN long long kiln_floordiv(long long a, int b) { return kiln_floordiv(a, (long long)b); }
KILN_SYM_FN long long kiln_mod(int a, long long b) { return kiln_mod((long long)a, b); }
KILN_SYM_FN long long kiln_mod(long long a, int b) { return kiln_mod(a, (long long)b); }
KILN_SYM_FN long long kiln_min(int a, long long b) { return kiln_min((long long)a, b); }
KILN_SYM_FN long long kiln_min(long long a, int b) { return kiln_min(a, (long long)b); }
KILN_SYM_FN long long kiln_max(int a, long long b) { return kiln_max((long long)a, b); }
KILN_SYM_FN long long kiln_max(long long a, int b) { return kiln_max(a, (long long)b); }
#endif
)";

}  // namespace kiln
