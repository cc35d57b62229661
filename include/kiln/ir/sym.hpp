// Symbolic integers for sizes and index arithmetic in generated kernels (what Inductor uses SymPy
// for): a constant size is a Sym that is a number, so static and dynamic shapes share one path.
//
// A Sym is an immutable expression over int64 constants, symbols (sizes s0, s1, ... and index
// variables such as xindex, with facts: nonnegative, positive, an exclusive upper bound), +, *,
// floordiv, mod, min and max. Every constructor returns the canonical, simplified form (the rules
// are in sym_simplify.hpp), so structural equality is the equality the fuser needs.
// floordiv and mod round towards minus infinity (Python's // and %) in eval() and in the rules.
// c_expr() prints C's / and % only where the dividend is known nonnegative and the divisor
// positive; elsewhere it calls kiln_floordiv, kiln_mod (and kiln_min, kiln_max), which the
// generated source must define: prepend `sym_c_helpers`.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "../core/error.hpp"

namespace kiln {

// Node kinds; their order is also the canonical order of factors.
enum class SymKind : std::uint8_t { constant, symbol, mul, add, floordiv, mod, min, max };

class Sym;
struct SymNode;
struct SymFacts;
struct SymHash {
  std::size_t operator()(const Sym& s) const noexcept;
};
using SymMap = std::unordered_map<Sym, Sym, SymHash>;
// Symbol values indexed by symbol id (see SymbolTable), so evaluation never looks up a name.
using Bindings = std::span<const std::int64_t>;

namespace detail {
struct SymAccess;
inline Sym make_add(std::span<const Sym> terms);
inline Sym make_mul(std::span<const Sym> factors);
inline Sym make_floordiv(const Sym& a, const Sym& b);
inline Sym make_mod(const Sym& a, const Sym& b);
inline Sym make_min(const Sym& a, const Sym& b);
inline Sym make_max(const Sym& a, const Sym& b);
inline Sym sym_add(const Sym& a, const Sym& b);
inline Sym sym_mul(const Sym& a, const Sym& b);
inline bool sym_equal(const Sym& a, const Sym& b);
inline int sym_compare(const Sym& a, const Sym& b);
inline std::string sym_print(const Sym& s, bool c_syntax);
}  // namespace detail

// An immutable, canonical integer expression; copying one is a reference-count increment.
class Sym {
 public:
  Sym();
  Sym(std::int64_t value);  // implicit on purpose: `s0 + 1`, `floordiv(x, 4)`
  static Sym symbol(std::string name, int id);
  static Sym symbol(std::string name, int id, const SymFacts& facts);

  SymKind kind() const;
  bool is_constant() const { return kind() == SymKind::constant; }
  bool is_symbol() const { return kind() == SymKind::symbol; }
  std::int64_t constant_value() const;  // throws kiln::error unless is_constant()
  int symbol_id() const;                // symbols only
  const std::string& symbol_name() const;
  const SymFacts& facts() const;
  std::span<const Sym> args() const;  // operands in canonical order
  std::size_t hash() const;

  // Inclusive bounds from range analysis over the symbols' facts; nullopt when unbounded.
  std::optional<std::int64_t> lower_bound() const;
  std::optional<std::int64_t> upper_bound() const;
  std::vector<Sym> free_symbols() const;  // sorted by id
  std::string str() const;                // for logs: `s0*s1 + 2`, `(x // 4) % 3`
  std::string c_expr() const;             // valid C/C++/CUDA, see the file comment
  std::int64_t eval(Bindings values) const;
  std::int64_t eval(std::initializer_list<std::int64_t> values) const {
    return eval(Bindings(values.begin(), values.size()));
  }
  Sym substitute(const SymMap& replacements) const;  // replaces any matching subexpression

  friend bool operator==(const Sym& a, const Sym& b) { return detail::sym_equal(a, b); }
  // A total structural order, deterministic across runs (std::map keys, canonical sorting).
  friend bool operator<(const Sym& a, const Sym& b) { return detail::sym_compare(a, b) < 0; }
  friend Sym operator+(const Sym& a, const Sym& b) { return detail::sym_add(a, b); }
  friend Sym operator*(const Sym& a, const Sym& b) { return detail::sym_mul(a, b); }
  friend Sym operator-(const Sym& a) { return detail::sym_mul(Sym(-1), a); }
  friend Sym operator-(const Sym& a, const Sym& b) { return a + -b; }
  // Found by argument-dependent lookup only, so they never capture min/max calls on plain ints.
  friend Sym min(const Sym& a, const Sym& b) { return detail::make_min(a, b); }
  friend Sym max(const Sym& a, const Sym& b) { return detail::make_max(a, b); }
  friend std::ostream& operator<<(std::ostream& os, const Sym& s) { return os << s.str(); }

 private:
  friend struct detail::SymAccess;
  explicit Sym(std::shared_ptr<const SymNode> node) : node_(std::move(node)) {}
  std::shared_ptr<const SymNode> node_;
};

// What is known about a symbol: range analysis uses it to drop floordivs and mods that do nothing.
struct SymFacts {
  bool nonnegative = false;
  bool positive = false;                    // >= 1: sizes, once size 0 is specialised away
  std::optional<Sym> bound = std::nullopt;  // exclusive upper bound, e.g. xindex < xnumel
};

inline Sym floordiv(const Sym& a, const Sym& b) { return detail::make_floordiv(a, b); }
inline Sym mod(const Sym& a, const Sym& b) { return detail::make_mod(a, b); }

struct SymNode {
  SymKind kind = SymKind::constant;
  std::int64_t value = 0;       // the constant, or the symbol's id
  std::int64_t lo = 0, hi = 0;  // range analysis; +-detail::sym_inf means unbounded
  std::size_t hash = 0;
  std::vector<Sym> args;
  std::string name;  // symbols only
  SymFacts facts;    // symbols only
};

namespace detail {

// Range ends at or beyond +-2^61 count as infinite, so bound arithmetic cannot overflow int64.
inline constexpr std::int64_t sym_inf = std::int64_t{1} << 61;
struct SymRange {
  std::int64_t lo, hi;
};
inline SymRange op_range(SymKind kind, std::span<const Sym> args);

inline std::size_t hash_mix(std::size_t h, std::size_t v) {
  return h ^ (v + static_cast<std::size_t>(0x9e3779b97f4a7c15ull) + (h << 6) + (h >> 2));
}

inline std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  if (b == 0) throw error("kiln::Sym: floor division by zero");
  std::int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
inline std::int64_t floor_mod(std::int64_t a, std::int64_t b) {
  if (b == 0) throw error("kiln::Sym: modulo by zero");
  std::int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

struct SymAccess {
  static const SymNode& node(const Sym& s) { return *s.node_; }
  // An operator node over operands already in canonical order; callers are the rules.
  static Sym make(SymKind kind, std::vector<Sym> args) {
    auto n = std::make_shared<SymNode>();
    n->kind = kind;
    n->hash = static_cast<std::size_t>(kind);
    for (const Sym& a : args) n->hash = hash_mix(n->hash, a.hash());
    SymRange r = op_range(kind, args);
    n->lo = r.lo;
    n->hi = r.hi;
    n->args = std::move(args);
    return Sym(std::move(n));
  }
};

inline const SymNode& node_of(const Sym& s) { return SymAccess::node(s); }

inline int sym_compare(const Sym& a, const Sym& b) {
  const SymNode& x = node_of(a);
  const SymNode& y = node_of(b);
  if (&x == &y) return 0;
  if (x.kind != y.kind) return x.kind < y.kind ? -1 : 1;
  if (x.value != y.value) return x.value < y.value ? -1 : 1;
  if (int c = x.name.compare(y.name)) return c < 0 ? -1 : 1;
  if (x.args.size() != y.args.size()) return x.args.size() < y.args.size() ? -1 : 1;
  for (std::size_t i = 0; i < x.args.size(); ++i)
    if (int c = sym_compare(x.args[i], y.args[i])) return c;
  return 0;
}

inline bool sym_equal(const Sym& a, const Sym& b) {
  return &node_of(a) == &node_of(b) || (a.hash() == b.hash() && sym_compare(a, b) == 0);
}

inline Sym sym_add(const Sym& a, const Sym& b) {
  const Sym both[] = {a, b};
  return make_add(both);
}
inline Sym sym_mul(const Sym& a, const Sym& b) {
  const Sym both[] = {a, b};
  return make_mul(both);
}

// Rebuilds a node of `kind` from new operands through the simplifying constructors.
inline Sym rebuild(SymKind kind, std::span<const Sym> args) {
  switch (kind) {
    case SymKind::add:
      return make_add(args);
    case SymKind::mul:
      return make_mul(args);
    case SymKind::floordiv:
      return make_floordiv(args[0], args[1]);
    case SymKind::mod:
      return make_mod(args[0], args[1]);
    case SymKind::min:
      return make_min(args[0], args[1]);
    default:
      return make_max(args[0], args[1]);
  }
}

// The constant coefficient of a term, 1 if it has none.
inline std::int64_t term_coef(const Sym& t) {
  if (t.is_constant()) return t.constant_value();
  if (t.kind() == SymKind::mul && t.args()[0].is_constant()) return t.args()[0].constant_value();
  return 1;
}

}  // namespace detail

inline std::size_t SymHash::operator()(const Sym& s) const noexcept { return s.hash(); }

inline Sym::Sym() : Sym(std::int64_t{0}) {}

inline Sym::Sym(std::int64_t value) {
  auto n = std::make_shared<SymNode>();
  n->value = value;
  bool huge = value <= -detail::sym_inf || value >= detail::sym_inf;
  n->lo = huge ? -detail::sym_inf : value;
  n->hi = huge ? detail::sym_inf : value;
  n->hash = detail::hash_mix(0, std::hash<std::int64_t>{}(value));
  node_ = std::move(n);
}

inline Sym Sym::symbol(std::string name, int id) { return symbol(std::move(name), id, SymFacts{}); }

inline Sym Sym::symbol(std::string name, int id, const SymFacts& facts) {
  if (id < 0) throw error("kiln::Sym::symbol: negative id for symbol " + name);
  auto n = std::make_shared<SymNode>();
  n->kind = SymKind::symbol;
  n->value = id;
  n->name = std::move(name);
  n->facts = facts;
  n->lo = facts.positive ? 1 : facts.nonnegative ? 0 : -detail::sym_inf;
  n->hi = detail::sym_inf;
  if (facts.bound && detail::node_of(*facts.bound).hi < detail::sym_inf) n->hi = detail::node_of(*facts.bound).hi - 1;
  n->hash = detail::hash_mix(detail::hash_mix(1, static_cast<std::size_t>(id)), std::hash<std::string>{}(n->name));
  return Sym(std::shared_ptr<const SymNode>(std::move(n)));
}

inline SymKind Sym::kind() const { return node_->kind; }
inline std::span<const Sym> Sym::args() const { return node_->args; }
inline std::size_t Sym::hash() const { return node_->hash; }
inline const SymFacts& Sym::facts() const { return node_->facts; }
inline const std::string& Sym::symbol_name() const { return node_->name; }

inline std::int64_t Sym::constant_value() const {
  if (!is_constant()) throw error("kiln::Sym: " + str() + " is not a constant");
  return node_->value;
}
inline int Sym::symbol_id() const {
  if (!is_symbol()) throw error("kiln::Sym: " + str() + " is not a symbol");
  return static_cast<int>(node_->value);
}

inline std::optional<std::int64_t> Sym::lower_bound() const {
  if (node_->lo <= -detail::sym_inf) return std::nullopt;
  return node_->lo;
}
inline std::optional<std::int64_t> Sym::upper_bound() const {
  if (node_->hi >= detail::sym_inf) return std::nullopt;
  return node_->hi;
}

inline std::int64_t Sym::eval(Bindings values) const {
  const SymNode& n = *node_;
  const auto& a = n.args;
  switch (n.kind) {
    case SymKind::constant:
      return n.value;
    case SymKind::symbol:
      if (static_cast<std::size_t>(n.value) >= values.size())
        throw error("kiln::Sym::eval: no value bound for symbol " + n.name);
      return values[static_cast<std::size_t>(n.value)];
    case SymKind::add: {
      std::int64_t r = 0;
      for (const Sym& t : a) r += t.eval(values);
      return r;
    }
    case SymKind::mul: {
      std::int64_t r = 1;
      for (const Sym& f : a) r *= f.eval(values);
      return r;
    }
    case SymKind::floordiv:
      return detail::floor_div(a[0].eval(values), a[1].eval(values));
    case SymKind::mod:
      return detail::floor_mod(a[0].eval(values), a[1].eval(values));
    case SymKind::min:
      return std::min(a[0].eval(values), a[1].eval(values));
    case SymKind::max:
      return std::max(a[0].eval(values), a[1].eval(values));
  }
  return 0;
}

inline Sym Sym::substitute(const SymMap& replacements) const {
  if (replacements.empty()) return *this;
  if (auto it = replacements.find(*this); it != replacements.end()) return it->second;
  if (is_constant() || is_symbol()) return *this;
  std::vector<Sym> args;
  args.reserve(node_->args.size());
  for (const Sym& a : node_->args) args.push_back(a.substitute(replacements));
  return detail::rebuild(kind(), args);
}

inline std::vector<Sym> Sym::free_symbols() const {
  std::vector<Sym> out;
  std::vector<const Sym*> todo{this};
  while (!todo.empty()) {
    const Sym* s = todo.back();
    todo.pop_back();
    if (s->is_symbol()) out.push_back(*s);
    for (const Sym& a : s->args()) todo.push_back(&a);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// The product of sizes; 1 for none.
inline Sym product(std::span<const Sym> sizes) { return detail::make_mul(sizes); }

// Row-major strides of a contiguous tensor: (s0, s1, s2) -> (s1*s2, s2, 1).
inline std::vector<Sym> contiguous_strides(std::span<const Sym> sizes) {
  std::vector<Sym> strides(sizes.size(), Sym(1));
  for (std::size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * sizes[d];
  return strides;
}

// Row-major coordinates of a flat index: flat -> (i0, ..., in-1). Each is (flat // inner) % size;
// the simplifier drops the last floordiv and, when flat is known < product(sizes), the first mod.
// in_bounds: the caller knows 0 <= flat < product(sizes) where the simplifier may not (a reshape's
// flat index over symbolic sizes whose products agree: [s0, s1] as [s2, s3, s1] with s2*s3 == s0),
// so the first coordinate is flat // inner with no remainder. Sizes must be nonzero (size-0
// tensors launch no kernels).
inline std::vector<Sym> unravel(const Sym& flat, std::span<const Sym> sizes, bool in_bounds = false) {
  std::vector<Sym> idx(sizes.size());
  Sym inner = 1;
  for (std::size_t d = sizes.size(); d-- > 0;) {
    idx[d] = in_bounds && d == 0 ? floordiv(flat, inner) : mod(floordiv(flat, inner), sizes[d]);
    inner = inner * sizes[d];
  }
  return idx;
}

// The flat offset sum(idx[d] * strides[d]).
inline Sym ravel(std::span<const Sym> idx, std::span<const Sym> strides) {
  if (idx.size() != strides.size())
    throw shape_error("kiln::ravel: " + std::to_string(idx.size()) + " indices but " + std::to_string(strides.size()) +
                      " strides");
  std::vector<Sym> terms;
  for (std::size_t d = 0; d < idx.size(); ++d) terms.push_back(idx[d] * strides[d]);
  return detail::make_add(terms);
}

// Hands out symbol ids 0, 1, 2, ... so that a Bindings span indexed by id holds every value.
class SymbolTable {
 public:
  // The next size symbol s0, s1, ...; sizes are positive.
  Sym new_size() {
    std::string name = "s";  // appended, not "s" + ...: g++ 12 -O3 warns falsely on that (-Wrestrict, PR 105329)
    name += std::to_string(sizes_++);
    return new_symbol(std::move(name), {.positive = true});
  }
  // An index variable with 0 <= name < bound (the bound drives mod/floordiv elimination).
  Sym new_index(std::string name, Sym bound) {
    return new_symbol(std::move(name), {.nonnegative = true, .bound = std::move(bound)});
  }
  Sym new_symbol(std::string name, const SymFacts& facts = {}) {
    symbols_.push_back(Sym::symbol(std::move(name), static_cast<int>(symbols_.size()), facts));
    return symbols_.back();
  }
  int count() const { return static_cast<int>(symbols_.size()); }
  const std::vector<Sym>& symbols() const { return symbols_; }

 private:
  std::vector<Sym> symbols_;
  int sizes_ = 0;
};

}  // namespace kiln

template <>
struct std::hash<kiln::Sym> {
  std::size_t operator()(const kiln::Sym& s) const noexcept { return s.hash(); }
};

#include "sym_print.hpp"
#include "sym_simplify.hpp"
