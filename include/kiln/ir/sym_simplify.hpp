// The simplification rules behind every Sym constructor, and the range analysis that drives them:
// sums and products are kept as sorted polynomials with folded constants, and floordiv/mod terms
// are cancelled or dropped where the symbols' facts prove them redundant.
#pragma once
#include <numeric>

#include "sym.hpp"

namespace kiln::detail {

// ---- range analysis: [lo, hi] per node, cached in the node at construction ----

inline std::int64_t clamp_inf(std::int64_t v) { return std::clamp(v, -sym_inf, sym_inf); }
inline std::int64_t add_lo(std::int64_t a, std::int64_t b) {
  return (a <= -sym_inf || b <= -sym_inf) ? -sym_inf : clamp_inf(a + b);
}
inline std::int64_t add_hi(std::int64_t a, std::int64_t b) {
  return (a >= sym_inf || b >= sym_inf) ? sym_inf : clamp_inf(a + b);
}
// Saturating product of range ends (0 * inf is 0: a factor pinned to 0 pins the product).
inline std::int64_t mul_sat(std::int64_t a, std::int64_t b) {
  if (a == 0 || b == 0) return 0;
  bool negative = (a < 0) != (b < 0);
  std::int64_t ua = a < 0 ? -a : a, ub = b < 0 ? -b : b;
  if (ua >= sym_inf || ub >= sym_inf || ua > sym_inf / ub) return negative ? -sym_inf : sym_inf;
  return negative ? -(ua * ub) : ua * ub;
}

inline SymRange range_of(const Sym& s) { return {node_of(s).lo, node_of(s).hi}; }

inline SymRange product_range(std::span<const Sym> factors) {
  SymRange r{1, 1};
  for (const Sym& f : factors) {
    SymRange x = range_of(f);
    std::int64_t c[] = {mul_sat(r.lo, x.lo), mul_sat(r.lo, x.hi), mul_sat(r.hi, x.lo), mul_sat(r.hi, x.hi)};
    r = {*std::min_element(c, c + 4), *std::max_element(c, c + 4)};
  }
  return r;
}

// floor(a / b) is monotone in a, and in b for a fixed sign of a, so the ends come from corners.
inline SymRange floordiv_range(SymRange a, SymRange b) {
  if (b.lo < 1) return {-sym_inf, sym_inf};
  std::int64_t lo = a.lo <= -sym_inf ? -sym_inf
                    : a.lo >= 0      ? (b.hi >= sym_inf ? 0 : a.lo / b.hi)
                                     : floor_div(a.lo, b.lo);
  std::int64_t hi = a.hi >= sym_inf ? sym_inf
                    : a.hi >= 0     ? a.hi / b.lo
                                    : (b.hi >= sym_inf ? -1 : floor_div(a.hi, b.hi));
  return {lo, hi};
}

inline SymRange mod_range(SymRange a, SymRange b) {
  if (b.lo < 1) return {-sym_inf, sym_inf};
  std::int64_t hi = b.hi >= sym_inf ? sym_inf : b.hi - 1;
  return {0, a.lo >= 0 ? std::min(hi, a.hi) : hi};
}

inline SymRange min_range(SymRange a, SymRange b) { return {std::min(a.lo, b.lo), std::min(a.hi, b.hi)}; }
inline SymRange max_range(SymRange a, SymRange b) { return {std::max(a.lo, b.lo), std::max(a.hi, b.hi)}; }

inline SymRange op_range(SymKind kind, std::span<const Sym> args) {
  switch (kind) {
    case SymKind::add: {
      SymRange r{0, 0};
      for (const Sym& t : args) r = {add_lo(r.lo, range_of(t).lo), add_hi(r.hi, range_of(t).hi)};
      return r;
    }
    case SymKind::mul:
      return product_range(args);
    case SymKind::floordiv:
      return floordiv_range(range_of(args[0]), range_of(args[1]));
    case SymKind::mod:
      return mod_range(range_of(args[0]), range_of(args[1]));
    case SymKind::min:
      return min_range(range_of(args[0]), range_of(args[1]));
    case SymKind::max:
      return max_range(range_of(args[0]), range_of(args[1]));
    default:
      return {-sym_inf, sym_inf};
  }
}

// ---- terms: a sum is a list of coef * monomial ----

inline std::int64_t checked_add(std::int64_t a, std::int64_t b) {
  constexpr std::int64_t hi = std::numeric_limits<std::int64_t>::max();
  constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min();
  if ((b > 0 && a > hi - b) || (b < 0 && a < lo - b)) throw error("kiln::Sym: int64 overflow in a constant");
  return a + b;
}
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b) {
  constexpr std::int64_t lo = std::numeric_limits<std::int64_t>::min();
  if (a == 0 || b == 0) return 0;
  bool overflow = (a == -1 && b == lo) || (b == -1 && a == lo);
  // Wrapping unsigned multiplication is defined; dividing back detects the overflow.
  auto r = static_cast<std::int64_t>(static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b));
  if (overflow || r / b != a) throw error("kiln::Sym: int64 overflow in a constant");
  return r;
}

struct SymTerm {
  std::int64_t coef;
  Sym mono;  // a product of non-constant factors, or 1 for the constant term
};

// The non-constant factors of a monomial, in canonical order.
inline std::vector<Sym> factors_of(const Sym& mono) {
  if (mono.is_constant()) return {};
  if (mono.kind() != SymKind::mul) return {mono};
  auto f = mono.args();
  return {f.begin() + (f[0].is_constant() ? 1 : 0), f.end()};
}

// coef * factors, where the factors are sorted and contain no constant or sum.
inline Sym join_term(std::int64_t coef, std::vector<Sym> factors) {
  if (factors.empty() || coef == 0) return Sym(coef);
  if (coef == 1 && factors.size() == 1) return factors[0];
  if (coef != 1) factors.insert(factors.begin(), Sym(coef));
  return SymAccess::make(SymKind::mul, std::move(factors));
}
inline Sym join_term(const SymTerm& t) { return join_term(t.coef, factors_of(t.mono)); }

inline SymTerm split_term(const Sym& t) {
  std::int64_t k = term_coef(t);
  if (t.is_constant()) return {k, Sym(1)};
  if (k == 1 && !(t.kind() == SymKind::mul && t.args()[0].is_constant())) return {1, t};
  return {k, join_term(1, factors_of(t))};
}

// The terms of a sum (or of a single term); a zero constant is left out.
inline std::vector<SymTerm> terms_of(const Sym& s) {
  std::vector<SymTerm> out;
  if (s.kind() != SymKind::add) {
    if (!(s.is_constant() && s.constant_value() == 0)) out.push_back(split_term(s));
    return out;
  }
  for (const Sym& t : s.args()) out.push_back(split_term(t));
  return out;
}

// Higher-degree monomials first (`s1*s2*x0 + s2*x1 + x2`), then the structural order.
inline bool term_before(const SymTerm& a, const SymTerm& b) {
  std::size_t da = factors_of(a.mono).size(), db = factors_of(b.mono).size();
  return da != db ? da > db : sym_compare(a.mono, b.mono) < 0;
}

// ---- proofs over ranges and symbolic bounds ----

inline std::optional<Sym> exact_div(const Sym& a, const Sym& d);
inline bool prove_lt(const Sym& a, const Sym& b);
inline std::optional<Sym> sym_max(const Sym& s);

inline std::optional<Sym> floordiv_max(const Sym& a, const Sym& d) {
  std::optional<Sym> m = range_of(d).lo >= 1 ? sym_max(a) : std::nullopt;
  if (!m) return std::nullopt;
  if (auto q = exact_div(*m + 1, d)) return *q - 1;  // a < q*d  =>  a // d < q
  return exact_div(*m, d);                           // a <= q*d =>  a // d <= q
}

// For a positive coefficient and nonnegative factors, the product of the factors' maxima.
inline std::optional<Sym> product_max(const Sym& s) {
  SymTerm t = split_term(s);
  if (t.coef <= 0) return std::nullopt;
  std::vector<Sym> parts{Sym(t.coef)};
  for (const Sym& f : factors_of(t.mono)) {
    std::optional<Sym> m = range_of(f).lo >= 0 ? sym_max(f) : std::nullopt;
    if (!m) return std::nullopt;
    parts.push_back(*m);
  }
  return make_mul(parts);
}

inline std::optional<Sym> symbolic_max(const Sym& s) {
  auto a = s.args();
  switch (s.kind()) {
    case SymKind::symbol:
      if (s.facts().bound) return *s.facts().bound - 1;
      return std::nullopt;
    case SymKind::mod:
      if (range_of(a[1]).lo >= 1) return a[1] - 1;
      return std::nullopt;
    case SymKind::floordiv:
      return floordiv_max(a[0], a[1]);
    case SymKind::mul:
      return product_max(s);
    case SymKind::add: {
      std::vector<Sym> parts;
      for (const Sym& t : a) {
        std::optional<Sym> m = sym_max(t);
        if (!m) return std::nullopt;
        parts.push_back(*m);
      }
      return make_add(parts);
    }
    default:
      return std::nullopt;
  }
}

// An inclusive upper bound as an expression: symbolic where the facts give one, else numeric.
inline std::optional<Sym> sym_max(const Sym& s) {
  if (std::optional<Sym> m = symbolic_max(s)) return m;
  if (range_of(s).hi < sym_inf) return Sym(range_of(s).hi);
  return std::nullopt;
}

// a < b, from numeric ranges, from b - a, or from b minus a symbolic maximum of a.
inline bool prove_lt(const Sym& a, const Sym& b) {
  if (range_of(a).hi < range_of(b).lo) return true;
  if (range_of(b - a).lo >= 1) return true;
  std::optional<Sym> m = symbolic_max(a);
  return m && range_of(b - *m).lo >= 1;
}
inline bool prove_le(const Sym& a, const Sym& b) { return a == b || prove_lt(a, b + 1); }
inline bool is_positive(const Sym& s) { return range_of(s).lo >= 1; }

// ---- division helpers ----

// Removes the multiset `part` from the sorted `from`; nullopt if some factor is missing.
inline std::optional<std::vector<Sym>> remove_factors(std::vector<Sym> from, const std::vector<Sym>& part) {
  for (const Sym& p : part) {
    auto it = std::find(from.begin(), from.end(), p);
    if (it == from.end()) return std::nullopt;
    from.erase(it);
  }
  return from;
}

// q with a == q * d, when every term of a contains d's coefficient and factors; else nullopt.
inline std::optional<Sym> exact_div(const Sym& a, const Sym& d) {
  if (a == d) return Sym(1);
  if (d.kind() == SymKind::add || (d.is_constant() && d.constant_value() == 0)) return std::nullopt;
  SymTerm dt = split_term(d);
  std::vector<Sym> dfactors = factors_of(dt.mono), q;
  for (const SymTerm& t : terms_of(a)) {
    std::optional<std::vector<Sym>> rest = remove_factors(factors_of(t.mono), dfactors);
    if (t.coef % dt.coef != 0 || !rest) return std::nullopt;
    q.push_back(join_term(t.coef / dt.coef, std::move(*rest)));
  }
  return make_add(q);
}

// a == whole * b + rest, where whole collects the terms of a that b divides exactly.
inline std::pair<Sym, Sym> split_divisible(const Sym& a, const Sym& b) {
  std::vector<Sym> whole, rest;
  for (const SymTerm& t : terms_of(a)) {
    Sym term = join_term(t);
    if (std::optional<Sym> q = exact_div(term, b))
      whole.push_back(*q);
    else
      rest.push_back(term);
  }
  return {make_add(whole), make_add(rest)};
}

// The gcd of all coefficients of a and b (0 when both are 0).
inline std::int64_t coef_gcd(const Sym& a, const Sym& b) {
  std::int64_t g = 0;
  for (const SymTerm& t : terms_of(a)) g = std::gcd(g, t.coef);
  for (const SymTerm& t : terms_of(b)) g = std::gcd(g, t.coef);
  return g;
}
inline Sym divide_coefs(const Sym& s, std::int64_t g) {
  std::vector<Sym> out;
  for (const SymTerm& t : terms_of(s)) out.push_back(join_term(t.coef / g, factors_of(t.mono)));
  return make_add(out);
}

// ---- the constructors ----

// c*M*(Y % K) + c*M*K*(Y // K) == c*M*Y: what makes ravel(unravel(x)) fold back to x.
inline std::optional<Sym> recombine_div_mod(const std::vector<SymTerm>& terms, std::int64_t constant) {
  for (std::size_t i = 0; i < terms.size(); ++i) {
    std::vector<Sym> fs = factors_of(terms[i].mono);
    for (std::size_t f = 0; f < fs.size(); ++f) {
      if (fs[f].kind() != SymKind::mod) continue;
      Sym y = fs[f].args()[0], k = fs[f].args()[1];
      std::vector<Sym> rest = fs;
      rest.erase(rest.begin() + static_cast<std::ptrdiff_t>(f));
      Sym m = join_term(terms[i].coef, rest);
      SymTerm want = split_term(m * k * make_floordiv(y, k));
      for (std::size_t j = 0; j < terms.size(); ++j) {
        if (j == i || terms[j].coef != want.coef || !(terms[j].mono == want.mono)) continue;
        std::vector<Sym> out{m * y, Sym(constant)};
        for (std::size_t l = 0; l < terms.size(); ++l)
          if (l != i && l != j) out.push_back(join_term(terms[l]));
        return make_add(out);
      }
    }
  }
  return std::nullopt;
}

inline void collect_terms(const Sym& s, std::vector<SymTerm>& terms, std::int64_t& constant) {
  if (s.kind() == SymKind::add) {
    for (const Sym& t : s.args()) collect_terms(t, terms, constant);
  } else if (s.is_constant()) {
    constant = checked_add(constant, s.constant_value());
  } else {
    terms.push_back(split_term(s));
  }
}

// Flatten, sort, collect like terms (2*s0 + 3*s0 -> 5*s0), fold constants, recombine div/mod.
inline Sym make_add(std::span<const Sym> operands) {
  std::vector<SymTerm> terms, merged;
  std::int64_t constant = 0;
  for (const Sym& s : operands) collect_terms(s, terms, constant);
  std::sort(terms.begin(), terms.end(), term_before);
  for (SymTerm& t : terms) {
    if (!merged.empty() && merged.back().mono == t.mono)
      merged.back().coef = checked_add(merged.back().coef, t.coef);
    else
      merged.push_back(std::move(t));
  }
  std::erase_if(merged, [](const SymTerm& t) { return t.coef == 0; });
  if (std::optional<Sym> r = recombine_div_mod(merged, constant)) return *r;
  std::vector<Sym> args;
  for (const SymTerm& t : merged) args.push_back(join_term(t));
  if (constant != 0 || args.empty()) args.push_back(Sym(constant));
  if (args.size() == 1) return args[0];
  return SymAccess::make(SymKind::add, std::move(args));
}

// Multiplies out a sum among the factors, so that every polynomial has one normal form.
inline Sym distribute(std::int64_t coef, std::vector<Sym> factors, std::size_t sum_at) {
  Sym sum = factors[sum_at];
  factors.erase(factors.begin() + static_cast<std::ptrdiff_t>(sum_at));
  factors.push_back(Sym(coef));
  std::vector<Sym> parts;
  for (const Sym& t : sum.args()) {
    factors.push_back(t);
    parts.push_back(make_mul(factors));
    factors.pop_back();
  }
  return make_add(parts);
}

inline Sym make_mul(std::span<const Sym> operands) {
  std::int64_t coef = 1;
  std::vector<Sym> factors;
  for (const Sym& s : operands) {
    for (const Sym& f : s.kind() == SymKind::mul ? s.args() : std::span<const Sym>(&s, 1)) {
      if (f.is_constant())
        coef = checked_mul(coef, f.constant_value());
      else
        factors.push_back(f);
    }
  }
  if (coef == 0) return Sym(0);
  for (std::size_t i = 0; i < factors.size(); ++i)
    if (factors[i].kind() == SymKind::add) return distribute(coef, std::move(factors), i);
  std::sort(factors.begin(), factors.end());
  return join_term(coef, std::move(factors));
}

// a == d*whole + low with 0 <= low < d, where d >= 1 divides the divisor b (a monomial known to be
// positive) and is not b itself (split_divisible covers that): d*W + r over d*n is W over n, and
// (d*W + r) % (d*n) is d*(W % n) + r, exactly for floor division at any sign of W. Each candidate
// d is a term's common part with b (the gcd of the coefficients times the shared factors); the terms
// d divides make `whole`, the others (and a constant d does not divide) `low`, which must be provably
// in [0, d). Candidates of higher degree and larger coefficient are tried first. This is how a flat
// index split into (y // n, y % n) and re-derived through a larger stride folds back: a norm
// backward's split sums read [8, 1024, 768] through `(768*r + 49152*(x // 768) + x % 768) //
// 786432`, and with symbolic sizes `(s2*y + c) // (s1*s2)` with c < s2.
struct LowSplit {
  Sym whole, low, d;
};
inline std::optional<LowSplit> split_low(const Sym& a, const Sym& b) {
  if (b.kind() == SymKind::add || !is_positive(b)) return std::nullopt;
  const SymTerm bt = split_term(b);
  const std::vector<Sym> bf = factors_of(bt.mono);
  std::vector<SymTerm> terms;
  std::int64_t constant = 0;
  collect_terms(a, terms, constant);
  std::vector<Sym> ds;
  for (const SymTerm& t : terms) {
    std::vector<Sym> common, rest = bf;
    for (const Sym& f : factors_of(t.mono))
      if (auto it = std::find(rest.begin(), rest.end(), f); it != rest.end()) common.push_back(f), rest.erase(it);
    const Sym d = join_term(std::gcd(bt.coef, t.coef), std::move(common));
    if (d == 1 || d == b || !is_positive(d) || std::find(ds.begin(), ds.end(), d) != ds.end()) continue;
    ds.push_back(d);
  }
  std::sort(ds.begin(), ds.end(), [](const Sym& x, const Sym& y) {
    const SymTerm tx = split_term(x), ty = split_term(y);
    const std::size_t fx = factors_of(tx.mono).size(), fy = factors_of(ty.mono).size();
    return fx != fy ? fx > fy : tx.coef > ty.coef;
  });
  for (const Sym& d : ds) {
    std::vector<Sym> whole, low;
    for (const SymTerm& t : terms) {
      const Sym term = join_term(t);
      if (std::optional<Sym> q = exact_div(term, d))
        whole.push_back(*q);
      else
        low.push_back(term);
    }
    if (d.is_constant() && constant % d.constant_value() == 0)
      whole.push_back(Sym(constant / d.constant_value()));
    else
      low.push_back(Sym(constant));
    const Sym r = make_add(low);
    if (range_of(r).lo >= 0 && prove_lt(r, d)) return LowSplit{make_add(whole), r, d};
  }
  return std::nullopt;
}

inline void check_divisor(const Sym& b) {
  if (b.is_constant() && b.constant_value() == 0) throw error("kiln::Sym: floordiv or mod by zero");
}

inline Sym make_floordiv(const Sym& a, const Sym& b) {
  check_divisor(b);
  if (a.is_constant() && b.is_constant()) return floor_div(a.constant_value(), b.constant_value());
  if (a == b) return Sym(1);
  if (a.is_constant() && a.constant_value() == 0) return Sym(0);
  if (std::int64_t g = coef_gcd(a, b); g > 1) return make_floordiv(divide_coefs(a, g), divide_coefs(b, g));
  // (w*b + r) // b == w + r // b holds exactly for floor division, whatever the sign of r.
  if (auto [whole, rest] = split_divisible(a, b); !(whole == 0)) return whole + make_floordiv(rest, b);
  if (std::optional<LowSplit> s = split_low(a, b)) return make_floordiv(s->whole, *exact_div(b, s->d));
  if (a.kind() == SymKind::floordiv && is_positive(a.args()[1]) && is_positive(b))
    return make_floordiv(a.args()[0], a.args()[1] * b);
  if (range_of(a).lo >= 0 && prove_lt(a, b)) return Sym(0);
  return SymAccess::make(SymKind::floordiv, {a, b});
}

// (5*x + 7) % 4 == (x + 3) % 4: multiples of a constant divisor drop out of every coefficient.
inline std::optional<Sym> reduce_coefs(const Sym& a, std::int64_t k) {
  std::vector<Sym> out;
  bool changed = false;
  for (const SymTerm& t : terms_of(a)) {
    std::int64_t c = t.coef >= k || -t.coef >= k ? floor_mod(t.coef, k) : t.coef;
    changed = changed || c != t.coef;
    out.push_back(join_term(c, factors_of(t.mono)));
  }
  return changed ? std::optional<Sym>(make_add(out)) : std::nullopt;
}

inline Sym make_mod(const Sym& a, const Sym& b) {
  check_divisor(b);
  if (a.is_constant() && b.is_constant()) return floor_mod(a.constant_value(), b.constant_value());
  if (a == b || b == 1 || b == -1 || a == 0) return Sym(0);
  if (std::int64_t g = coef_gcd(a, b); g > 1) return g * make_mod(divide_coefs(a, g), divide_coefs(b, g));
  if (b.is_constant() && b.constant_value() > 0)
    if (std::optional<Sym> r = reduce_coefs(a, b.constant_value())) return make_mod(*r, b);
  if (auto [whole, rest] = split_divisible(a, b); !(whole == 0)) return make_mod(rest, b);
  if (std::optional<LowSplit> s = split_low(a, b)) return s->d * make_mod(s->whole, *exact_div(b, s->d)) + s->low;
  if (range_of(a).lo >= 0 && prove_lt(a, b)) return a;
  return SymAccess::make(SymKind::mod, {a, b});
}

inline Sym make_min(const Sym& a, const Sym& b) {
  if (a.is_constant() && b.is_constant()) return std::min(a.constant_value(), b.constant_value());
  if (prove_le(a, b)) return a;
  if (prove_le(b, a)) return b;
  return SymAccess::make(SymKind::min, b < a ? std::vector<Sym>{b, a} : std::vector<Sym>{a, b});
}

inline Sym make_max(const Sym& a, const Sym& b) {
  if (a.is_constant() && b.is_constant()) return std::max(a.constant_value(), b.constant_value());
  if (prove_le(a, b)) return b;
  if (prove_le(b, a)) return a;
  return SymAccess::make(SymKind::max, b < a ? std::vector<Sym>{b, a} : std::vector<Sym>{a, b});
}

}  // namespace kiln::detail
