// The symbolic integers of ir/sym.hpp: canonical forms, the floordiv/mod rules with and without
// bounds, unravel/ravel round trips, evaluation, substitution, hashing and the printed C.
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <unordered_set>
#include <vector>

#include "kiln/ir/sym.hpp"

#if __has_include(<dlfcn.h>) && __has_include(<unistd.h>)
#include <dlfcn.h>
#include <unistd.h>
#define KILN_TEST_DLOPEN 1
#endif

namespace {

using kiln::Sym;

// s0, s1, s2 (positive sizes), i and j (no facts), n (nonnegative), then index variables.
struct Syms {
  kiln::SymbolTable table;
  Sym s0 = table.new_size(), s1 = table.new_size(), s2 = table.new_size();
  Sym i = table.new_symbol("i"), j = table.new_symbol("j");
  Sym n = table.new_symbol("n", {.nonnegative = true});
};

// Checks a == b at many random values of their symbols: sizes in [1, 9], others in [-50, 50].
void check_same_values(const Sym& a, const Sym& b, const std::vector<Sym>& symbols, int trials = 200) {
  std::mt19937_64 rng(42);
  std::vector<std::int64_t> v(symbols.size() + 8);
  for (int t = 0; t < trials; ++t) {
    for (const Sym& s : symbols) {
      bool size = s.facts().positive;
      std::uniform_int_distribution<std::int64_t> d(size ? 1 : s.facts().nonnegative ? 0 : -50, size ? 9 : 50);
      v[static_cast<std::size_t>(s.symbol_id())] = d(rng);
    }
    CHECK_MESSAGE(a.eval(v) == b.eval(v), a.str(), " vs ", b.str());
  }
}

}  // namespace

TEST_CASE("constants fold, with floor semantics for floordiv and mod") {
  CHECK((Sym(2) + 3).constant_value() == 5);
  CHECK((Sym(7) * 6 - 2).constant_value() == 40);
  CHECK(floordiv(Sym(7), 2) == 3);
  CHECK(floordiv(Sym(-7), 2) == -4);
  CHECK(mod(Sym(-7), 2) == 1);
  CHECK(mod(Sym(7), -2) == -1);
  CHECK(min(Sym(3), 5) == 3);
  CHECK(max(Sym(3), 5) == 5);
  CHECK(Sym().is_constant());
  CHECK_THROWS_AS(floordiv(Sym(1), 0), kiln::error);
  CHECK_THROWS_AS((Sym(std::int64_t{1} << 62) * 4), kiln::error);
}

TEST_CASE("sums and products are canonical polynomials") {
  Syms x;
  CHECK(2 * x.s0 + 3 * x.s0 == 5 * x.s0);
  CHECK(x.s0 - x.s0 == 0);
  CHECK(x.s0 * 1 == x.s0);
  CHECK(x.s0 + 0 == x.s0);
  CHECK(x.s0 * 0 == 0);
  CHECK(x.s0 * x.s1 + x.s1 * x.s0 == 2 * x.s0 * x.s1);
  CHECK((x.s0 + 1) * 2 - 2 * x.s0 == 2);
  CHECK((x.s0 + x.i) * (x.s1 - 1) == x.s0 * x.s1 - x.s0 + x.i * x.s1 - x.i);
  CHECK((x.s1 + 2) + (x.s0 + 3) == x.s0 + x.s1 + 5);
  CHECK((x.s0 * x.s1 + 2).str() == "s0*s1 + 2");
  CHECK((x.s1 - 2 * x.s0 - 3).str() == "-2*s0 + s1 - 3");
  CHECK((x.s0 * x.s1 * 4).args().size() == 3);
  CHECK_FALSE((x.s0 + 1).is_constant());
  CHECK_THROWS_AS((x.s0 + 1).constant_value(), kiln::error);
}

TEST_CASE("floordiv and mod rules that hold without facts") {
  Syms x;
  CHECK(floordiv(x.i, 1) == x.i);
  CHECK(mod(x.i, 1) == 0);
  CHECK(floordiv(x.i * x.s1, x.s1) == x.i);
  CHECK(mod(x.i * x.s1, x.s1) == 0);
  CHECK(floordiv(x.i * 6, 3) == 2 * x.i);
  CHECK(mod(x.i * 6 + 3, 3) == 0);
  // (a*k + b) // k == a + b // k exactly, whatever the sign of b.
  CHECK(floordiv(x.i * x.s1 + x.j, x.s1) == x.i + floordiv(x.j, x.s1));
  CHECK(mod(x.i * x.s1 + x.j, x.s1) == mod(x.j, x.s1));
  CHECK(floordiv(4 * x.i + 2, 8) == floordiv(2 * x.i + 1, 4));
  CHECK(mod(4 * x.i, 8) == 4 * mod(x.i, 2));
  CHECK(mod(6 * x.i + 4, 4) == 2 * mod(x.i, 2));  // gcd 2, then 3*i % 2 == i % 2
  CHECK(mod(5 * x.i - 9, 4) == mod(x.i + 3, 4));
  check_same_values(mod(5 * x.i - 9, 4), mod(x.i + 3, 4), x.table.symbols());
  CHECK(floordiv(floordiv(x.n, 2), 3) == floordiv(x.n, 6));
  CHECK(floordiv(floordiv(x.i, x.s1), x.s2) == floordiv(x.i, x.s1 * x.s2));
  CHECK(mod(floordiv(x.n, 4), 3).kind() == kiln::SymKind::mod);  // left as is
  CHECK(floordiv(x.i, x.j).kind() == kiln::SymKind::floordiv);   // no sign known: kept
  check_same_values(floordiv(x.i * x.s1 + x.j, x.s1), x.i + floordiv(x.j, x.s1), x.table.symbols());
  check_same_values(floordiv(4 * x.i + 2, 8), floordiv(2 * x.i + 1, 4), x.table.symbols());
}

TEST_CASE("bounds drop floordiv and mod that cannot matter") {
  Syms x;
  Sym r = x.table.new_index("r", x.s1);  // 0 <= r < s1
  CHECK(mod(r, x.s1) == r);
  CHECK(floordiv(r, x.s1) == 0);
  CHECK(floordiv(x.i * x.s1 + r, x.s1) == x.i);
  CHECK(mod(x.i * x.s1 + r, x.s1) == r);
  CHECK(mod(x.i * x.s1 + mod(x.j, x.s1), x.s1) == mod(x.j, x.s1));
  CHECK(mod(mod(x.n, 7), 7) == mod(x.n, 7));
  CHECK(floordiv(mod(x.n, 7), 7) == 0);
  CHECK(mod(x.n, 7).upper_bound() == 6);
  // Without the bound the same expressions stay.
  CHECK(mod(x.n, x.s1).kind() == kiln::SymKind::mod);
  CHECK(floordiv(x.i * x.s1 + x.n, x.s1) == x.i + floordiv(x.n, x.s1));
  Sym c = x.table.new_index("c", 10);
  CHECK(mod(c, 16) == c);
  CHECK(mod(c, 10) == c);
  CHECK(mod(c, 9).kind() == kiln::SymKind::mod);
  CHECK(min(c, 20) == c);
  CHECK(max(x.s0, 0) == x.s0);
  CHECK(min(x.i, x.j) == min(x.j, x.i));
}

TEST_CASE("a flat index re-derived through a larger stride folds back (a norm backward's split sums)") {
  // A [98304] column offset and a row step over [64] read [8, 1024, 768] through the flat index
  // 768 * y + c, y = r + 64 * (col // 768), c = col % 768: d * W + r over d * n is W over n when 0 <= r < d.
  Syms x;
  Sym col = x.table.new_index("col", 98304), r = x.table.new_index("r", 64), r65 = x.table.new_index("r65", 65);
  Sym c = mod(col, 768), q = floordiv(col, 768);
  Sym flat = 768 * r + 49152 * q + c;
  CHECK(floordiv(flat, 786432) == floordiv(col, 12288));
  CHECK(mod(r + 64 * q, 1024) == r + 64 * mod(q, 16));
  CHECK(mod(flat, 786432) == 768 * r + 49152 * mod(q, 16) + c);
  // The generated kernel's two reads: the element, and its row's statistic.
  CHECK(786432 * floordiv(flat, 786432) + c + 768 * mod(r + 64 * q, 1024) == flat);
  CHECK(1024 * floordiv(flat, 786432) + mod(r + 64 * q, 1024) == r + 64 * q);
  // The low part must be provably below d: a row step up to 64 keeps the division by 1024.
  Sym wide = floordiv(768 * r65 + 49152 * q + c, 786432);
  CHECK(wide == floordiv(r65 + 64 * q, 1024));
  // With symbolic sizes: c < s2 below a stride of s2, over s1*s2.
  Sym cs = x.table.new_index("cs", x.s2);
  CHECK(floordiv(x.s2 * x.n + cs, x.s1 * x.s2) == floordiv(x.n, x.s1));
  CHECK(mod(x.s2 * x.n + cs, x.s1 * x.s2) == x.s2 * mod(x.n, x.s1) + cs);
  CHECK(x.s1 * x.s2 * floordiv(x.s2 * x.n + cs, x.s1 * x.s2) + x.s2 * mod(x.n, x.s1) + cs == x.s2 * x.n + cs);
  // ... at any sign of the whole part, against floor division computed here.
  const Sym sq = floordiv(x.s2 * x.i + mod(x.j, x.s2), x.s1 * x.s2), sm = mod(x.s2 * x.i + mod(x.j, x.s2), x.s1 * x.s2);
  auto floor_div = [](std::int64_t a, std::int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); };
  std::vector<std::int64_t> vals(static_cast<std::size_t>(x.table.count()));
  for (std::int64_t s1 = 1; s1 <= 5; ++s1)
    for (std::int64_t s2 = 1; s2 <= 6; ++s2)
      for (std::int64_t i = -20; i <= 20; i += 3)
        for (std::int64_t j = -9; j <= 9; j += 2) {
          vals[static_cast<std::size_t>(x.s1.symbol_id())] = s1;
          vals[static_cast<std::size_t>(x.s2.symbol_id())] = s2;
          vals[static_cast<std::size_t>(x.i.symbol_id())] = i;
          vals[static_cast<std::size_t>(x.j.symbol_id())] = j;
          const std::int64_t flat = s2 * i + (j - s2 * floor_div(j, s2));
          REQUIRE(sq.eval(vals) == floor_div(flat, s1 * s2));
          REQUIRE(sm.eval(vals) == flat - s1 * s2 * floor_div(flat, s1 * s2));
        }
  // Every value agrees with the unsimplified arithmetic.
  std::vector<std::int64_t> v(static_cast<std::size_t>(x.table.count()));
  for (std::int64_t cv = 0; cv < 98304; cv += 37)
    for (std::int64_t rv = 0; rv < 65; rv += 3) {
      v[static_cast<std::size_t>(col.symbol_id())] = cv;
      v[static_cast<std::size_t>(r.symbol_id())] = std::min<std::int64_t>(rv, 63);
      v[static_cast<std::size_t>(r65.symbol_id())] = rv;
      const std::int64_t fl = 768 * std::min<std::int64_t>(rv, 63) + 49152 * (cv / 768) + cv % 768;
      REQUIRE(floordiv(flat, 786432).eval(v) == fl / 786432);
      REQUIRE(mod(flat, 786432).eval(v) == fl % 786432);
      REQUIRE(wide.eval(v) == (768 * rv + 49152 * (cv / 768) + cv % 768) / 786432);
    }
}

TEST_CASE("range analysis") {
  Syms x;
  Sym r = x.table.new_index("r", 128);
  CHECK(x.s0.lower_bound() == 1);
  CHECK_FALSE(x.s0.upper_bound());
  CHECK_FALSE(x.i.lower_bound());
  CHECK(r.upper_bound() == 127);
  CHECK((2 * r + 1).upper_bound() == 255);
  CHECK((x.s0 * x.s1 - 1).lower_bound() == 0);
  CHECK(floordiv(r, 4).upper_bound() == 31);
  CHECK(mod(x.i, x.s1).lower_bound() == 0);
  CHECK((-r).lower_bound() == -127);
}

TEST_CASE("unravel over symbolic sizes and ravel back") {
  Syms x;
  std::vector<Sym> sizes{x.s0, x.s1, x.s2};
  Sym flat = x.table.new_index("xindex", kiln::product(sizes));
  std::vector<Sym> idx = kiln::unravel(flat, sizes);
  REQUIRE(idx.size() == 3);
  CHECK(idx[2] == mod(flat, x.s2));
  CHECK(idx[1] == mod(floordiv(flat, x.s2), x.s1));
  CHECK(idx[0] == floordiv(flat, x.s1 * x.s2));  // no mod: xindex < s0*s1*s2
  std::vector<Sym> strides = kiln::contiguous_strides(sizes);
  CHECK(strides[0] == x.s1 * x.s2);
  CHECK(strides[2] == 1);
  CHECK(kiln::ravel(idx, strides) == flat);
  CHECK(idx[0].str() == "xindex // (s1*s2)");
  CHECK(idx[0].c_expr() == "xindex / (s1*s2)");

  // Evaluate at random sizes and every in-range flat index.
  std::mt19937_64 rng(7);
  std::vector<std::int64_t> v(static_cast<std::size_t>(x.table.count()));
  for (int t = 0; t < 40; ++t) {
    for (int d = 0; d < 3; ++d) v[static_cast<std::size_t>(d)] = std::uniform_int_distribution<std::int64_t>(1, 6)(rng);
    for (std::int64_t f = 0; f < v[0] * v[1] * v[2]; ++f) {
      v[static_cast<std::size_t>(flat.symbol_id())] = f;
      CHECK(idx[0].eval(v) == f / (v[1] * v[2]));
      CHECK(idx[1].eval(v) == f / v[2] % v[1]);
      CHECK(idx[2].eval(v) == f % v[2]);
    }
  }
}

TEST_CASE("unravel without a bound keeps the first mod, and the round trip is a mod") {
  Syms x;
  std::vector<Sym> sizes{x.s0, x.s1, x.s2};
  std::vector<Sym> idx = kiln::unravel(x.n, sizes);
  CHECK(idx[0] == mod(floordiv(x.n, x.s1 * x.s2), x.s0));
  Sym back = kiln::ravel(idx, kiln::contiguous_strides(sizes));
  CHECK_FALSE(back == x.n);
  check_same_values(back, mod(x.n, x.s0 * x.s1 * x.s2), x.table.symbols());
}

TEST_CASE("unravel over constant sizes [37, 129]") {
  kiln::SymbolTable table;
  Sym flat = table.new_index("xindex", 37 * 129);
  std::vector<Sym> sizes{Sym(37), Sym(129)};
  std::vector<Sym> idx = kiln::unravel(flat, sizes);
  CHECK(idx[0] == floordiv(flat, 129));
  CHECK(idx[1] == mod(flat, 129));
  CHECK(idx[1].c_expr() == "xindex % 129");
  CHECK(kiln::ravel(idx, kiln::contiguous_strides(sizes)) == flat);
  // A permuted layout: strides (1, 37) are not contiguous, so no folding.
  std::vector<Sym> permuted{Sym(1), Sym(37)};
  CHECK(kiln::ravel(idx, permuted) == floordiv(flat, 129) + 37 * mod(flat, 129));
  for (std::int64_t f = 0; f < 37 * 129; ++f) {
    CHECK(idx[0].eval({f}) == f / 129);
    CHECK(idx[1].eval({f}) == f % 129);
  }
}

TEST_CASE("unravel with size-1 dims and a single dim") {
  Syms x;
  std::vector<Sym> sizes{Sym(1), x.s1, Sym(1)};
  Sym flat = x.table.new_index("x0", x.s1);
  std::vector<Sym> idx = kiln::unravel(flat, sizes);
  CHECK(idx[0] == 0);
  CHECK(idx[1] == flat);
  CHECK(idx[2] == 0);
  std::vector<Sym> one{x.s0};
  CHECK(kiln::unravel(x.n, one)[0] == mod(x.n, x.s0));
}

TEST_CASE("eval and substitute") {
  Syms x;
  Sym e = floordiv(x.s0 * x.s1 + x.i, 4) + mod(x.j, x.s2) - min(x.i, x.j);
  std::vector<std::int64_t> v{3, 5, 7, -9, 11, 0};
  std::int64_t expect = kiln::detail::floor_div(15 - 9, 4) + 11 % 7 - (-9);
  CHECK(e.eval(v) == expect);
  CHECK_THROWS_AS(e.eval({1, 2}), kiln::error);

  kiln::SymMap m{{x.s0, Sym(4)}, {x.s1, x.s2}};
  CHECK((x.s0 * x.s1 + 1).substitute(m) == 4 * x.s2 + 1);
  CHECK(floordiv(x.s0 * x.s1, x.s2).substitute(m) == 4);  // rules apply again after substitution
  Sym r = x.table.new_index("r", 8);
  kiln::SymMap shift{{r, r + 1}};
  CHECK((2 * r).substitute(shift) == 2 * r + 2);
  kiln::SymMap sub{{x.s0 * x.s1, Sym(6)}};
  CHECK((x.s0 * x.s1).substitute(sub) == 6);
  CHECK((x.s0 + 1).substitute({}) == x.s0 + 1);
}

TEST_CASE("equality, hashing and free symbols") {
  Syms x;
  Sym a = floordiv(x.s0 * x.s1 + x.n, x.s2);
  Sym b = floordiv(x.n + x.s1 * x.s0, x.s2);
  CHECK(a == b);
  CHECK(a.hash() == b.hash());
  CHECK(std::hash<Sym>{}(a) == a.hash());
  std::unordered_set<Sym, kiln::SymHash> set{a, b, x.s0, Sym(3), Sym(3)};
  CHECK(set.size() == 3);
  CHECK_FALSE(x.s0 == Sym::symbol("s0", 1));
  CHECK_FALSE(x.s0 == Sym(0));
  CHECK((x.s0 < x.s1) != (x.s1 < x.s0));
  std::vector<Sym> fs = a.free_symbols();
  REQUIRE(fs.size() == 4);
  CHECK(fs[0] == x.s0);
  CHECK(fs[3] == x.n);
  CHECK(x.n.symbol_name() == "n");
  CHECK(x.n.symbol_id() == 5);
}

TEST_CASE("c_expr uses / and % only where both operands are nonnegative") {
  Syms x;
  CHECK(floordiv(x.n, 4).c_expr() == "n / 4");
  CHECK(floordiv(x.i, 4).c_expr() == "kiln_floordiv(i, 4)");
  CHECK(mod(x.i, x.s1).c_expr() == "kiln_mod(i, s1)");
  CHECK(mod(floordiv(x.n, 4), 3).c_expr() == "(n / 4) % 3");
  CHECK(mod(floordiv(x.n, 4), 3).str() == "(n // 4) % 3");
  CHECK((x.s1 * floordiv(x.n, x.s0 + 1)).c_expr() == "s1*(n / (s0 + 1))");
  CHECK((x.n - 2 * floordiv(x.n, 3)).c_expr() == "n - 2*(n / 3)");
  CHECK(min(x.i, x.j).c_expr() == "kiln_min(i, j)");
  CHECK(floordiv(Sym(-3) - x.n, x.s0).c_expr() == "kiln_floordiv(-n - 3, s0)");
  std::ostringstream os;
  os << x.s0 * 2;
  CHECK(os.str() == "2*s0");
}

namespace {

// A random expression built through the simplifying constructors, beside a plain evaluation of
// the same construction: the oracle the simplified form must agree with.
struct RandomExpr {
  Sym sym;
  std::function<std::int64_t(const std::vector<std::int64_t>&)> value;
};

struct RandomExprs {
  std::mt19937_64 rng{11};
  std::vector<Sym> symbols;  // the first three are positive sizes
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); }

  RandomExpr leaf(bool positive) {
    int k = pick(positive ? 4 : static_cast<int>(symbols.size()) + 2);
    if (k >= (positive ? 3 : static_cast<int>(symbols.size()))) {
      std::int64_t c = positive ? pick(8) + 1 : pick(19) - 6;
      return {Sym(c), [c](const auto&) { return c; }};
    }
    auto id = static_cast<std::size_t>(symbols[static_cast<std::size_t>(k)].symbol_id());
    return {symbols[static_cast<std::size_t>(k)], [id](const auto& v) { return v[id]; }};
  }
  RandomExpr divisor() {
    RandomExpr a = leaf(true), b = leaf(true);
    return {a.sym * b.sym, [a, b](const auto& v) { return a.value(v) * b.value(v); }};
  }
  RandomExpr expr(int depth) {
    if (depth == 0) return leaf(false);
    RandomExpr a = expr(depth - 1), b = pick(2) ? divisor() : expr(depth - 1);
    bool div = b.sym.lower_bound().value_or(0) >= 1;  // only divide by what is known positive
    switch (pick(div ? 6 : 4)) {
      case 0:
        return {a.sym + b.sym, [a, b](const auto& v) { return a.value(v) + b.value(v); }};
      case 1:
        return {a.sym * b.sym, [a, b](const auto& v) { return a.value(v) * b.value(v); }};
      case 2:
        return {min(a.sym, b.sym), [a, b](const auto& v) { return std::min(a.value(v), b.value(v)); }};
      case 3:
        return {a.sym - b.sym, [a, b](const auto& v) { return a.value(v) - b.value(v); }};
      case 4:
        return {floordiv(a.sym, b.sym),
                [a, b](const auto& v) { return kiln::detail::floor_div(a.value(v), b.value(v)); }};
      default:
        return {mod(a.sym, b.sym), [a, b](const auto& v) { return kiln::detail::floor_mod(a.value(v), b.value(v)); }};
    }
  }
};

}  // namespace

TEST_CASE("random expressions: the simplified form evaluates like its construction") {
  Syms x;
  Sym flat = x.table.new_index("x", x.s0 * x.s1 * x.s2);
  Sym r = x.table.new_index("r", x.s1);
  RandomExprs gen;
  gen.symbols = {x.s0, x.s1, x.s2, x.i, x.n, flat, r};
  std::vector<std::int64_t> v(static_cast<std::size_t>(x.table.count()));
  auto draw = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen.rng);
  };
  for (int t = 0; t < 3000; ++t) {
    RandomExpr e = gen.expr(1 + gen.pick(4));
    for (int k = 0; k < 10; ++k) {
      for (int d = 0; d < 3; ++d) v[static_cast<std::size_t>(d)] = draw(1, 5);
      v[3] = draw(-30, 30);  // i, j
      v[4] = draw(-30, 30);
      v[5] = draw(0, 30);  // n
      v[6] = draw(0, v[0] * v[1] * v[2] - 1);
      v[7] = draw(0, v[1] - 1);
      std::int64_t want = e.value(v);
      REQUIRE_MESSAGE(e.sym.eval(v) == want, e.sym.str());
      REQUIRE_MESSAGE(e.sym.lower_bound().value_or(want) <= want, e.sym.str());
      REQUIRE_MESSAGE(e.sym.upper_bound().value_or(want) >= want, e.sym.str());
    }
  }
}

#ifdef KILN_TEST_DLOPEN
// The printed C compiles with the helpers and computes what eval() computes.
TEST_CASE("c_expr compiles and agrees with eval") {
  if (std::system("c++ --version > /dev/null 2>&1") != 0) {
    MESSAGE("no host compiler named c++: skipped");
    return;
  }
  Syms x;
  std::vector<Sym> exprs{
      floordiv(x.i * x.s1 + x.j, x.s2) - mod(x.i, 7) * x.s0,
      mod(floordiv(x.n, x.s1), x.s2) + max(x.i, x.j) * 3,
      x.s0 * x.s1 * x.s2 - floordiv(-x.n, x.s0 + 2) + min(x.i, Sym(-4)),
      kiln::ravel(kiln::unravel(x.n, std::vector<Sym>{x.s0, x.s1}), std::vector<Sym>{Sym(1), x.s0}),
  };
  std::string src = std::string(kiln::sym_c_helpers) +
                    "extern \"C\" long long kiln_test_sym(int e, const long long* v) {\n"
                    "  long long s0 = v[0], s1 = v[1], s2 = v[2], i = v[3], j = v[4], n = v[5];\n"
                    "  (void)s0; (void)s1; (void)s2; (void)i; (void)j; (void)n;\n";
  for (std::size_t e = 0; e < exprs.size(); ++e)
    src += "  if (e == " + std::to_string(e) + ") return " + exprs[e].c_expr() + ";\n";
  src += "  return 0;\n}\n";
  std::string base = "/tmp/kiln_test_ir_sym_" + std::to_string(::getpid());
  std::ofstream(base + ".cpp") << src;
  std::string cmd = "c++ -O1 -shared -fPIC -o " + base + ".so " + base + ".cpp";
  REQUIRE_MESSAGE(std::system(cmd.c_str()) == 0, src);
  void* lib = dlopen((base + ".so").c_str(), RTLD_NOW);
  REQUIRE(lib);
  auto fn = reinterpret_cast<long long (*)(int, const long long*)>(dlsym(lib, "kiln_test_sym"));
  REQUIRE(static_cast<bool>(fn));
  std::mt19937_64 rng(3);
  std::uniform_int_distribution<std::int64_t> size(1, 9), any(-50, 50), nonneg(0, 100);
  for (int t = 0; t < 500; ++t) {
    std::vector<std::int64_t> v{size(rng), size(rng), size(rng), any(rng), any(rng), nonneg(rng)};
    std::vector<long long> c(v.begin(), v.end());
    for (std::size_t e = 0; e < exprs.size(); ++e)
      CHECK_MESSAGE(fn(static_cast<int>(e), c.data()) == exprs[e].eval(v), exprs[e].c_expr());
  }
  dlclose(lib);
  std::remove((base + ".cpp").c_str());
  std::remove((base + ".so").c_str());
}
#endif
