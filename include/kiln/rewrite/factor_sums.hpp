// factor_sums: a sum over dims D of a linear combination whose factors are constant along D is
// rewritten as the combination of the terms' sums, the factors applied afterwards:
//
//   sum_D(-(u * c1 + v * c2 * 2))  ->  -(sum_D(u) * c1 + sum_D(v) * c2 * 2)     (c1, c2 constant along D)
//
// when that lets the sum run earlier: a row kernel computes reductions over its rows in passes,
// each pass after the reductions it reads, so a sum whose operand reads a row statistic only
// through such factors waited for them. A layer_norm backward's mean term (the sum of dx's first
// two parts, scaled by rstd and by the variance's gradient) was a fourth pass over x and dy; its
// terms' sums (dy * w, x - mean) join the second pass. A looped row reads its inputs once more a
// pass (NOTES item 132). Applied only where the sums' reduction depth drops (a chain of
// reductions over the same tensor), so nothing else changes, and only to f32 and f64 sums (integer
// and boolean + and * are not a ring: a bool's add is an or, an i32 product wraps before its i64
// sum; a 16-bit sum of the terms could overflow where the scaled sum would not). A term that is a
// value less its own mean along the summed dims sums to 0 and is dropped (PyTorch's layer_norm
// backward formula has no such term). The results move as a reassociation moves them: by rounding,
// by more where terms cancel, and an infinite factor times a sum that holds a 0 gives inf, not NaN.
#pragma once
#include <algorithm>
#include <vector>

#include "builder.hpp"

namespace kiln::rewrite {

namespace detail {
// Whether the pass applies to sums of this dtype (see the comment at the top).
constexpr bool wide_float(kiln::dtype d) { return d == kiln::dtype::f32 || d == kiln::dtype::f64; }

// Terms a sum is split into at most (each one more reduction in its row kernel).
inline constexpr std::size_t max_sum_terms = 4;

// One term of a sum's operand: sign * u * factors[0] * ... / divisors[0] / ...
struct SumTerm {
  int u = -1;
  bool negative = false;
  std::vector<int> factors, divisors;
};

// The chain length of reductions below each node (0: no reduction below). A count (numel) and
// meta nodes read only their input's shape.
inline std::vector<int> reduction_depths(const graph::Graph& g) {
  std::vector<int> depth(static_cast<std::size_t>(g.size()), 0);
  for (int i = 0; i < g.size(); ++i) {
    if (g[i].op == Op::numel || info(g[i].op).cls == OpClass::meta) continue;
    int d = 0;
    for (int k = 0; k < g[i].n_in; ++k) d = std::max(d, depth[g[i].in[k]]);
    depth[i] = d + (is_reduction(g[i].op) ? 1 : 0);
  }
  return depth;
}

// Splits the operand `e` of a sum over the dims marked in `reduced` into terms, or leaves it one
// term. A factor is constant along the reduced dims (rank 0, or the operand's rank with 1 there
// and nothing wider than the operand elsewhere); a term's u has the operand's shape and dtype.
class SumTerms {
 public:
  SumTerms(const graph::Graph& g, int e, const std::vector<bool>& reduced) : g_(g), e_(e), reduced_(reduced) {}
  std::vector<SumTerm> split() {
    std::vector<SumTerm> out;
    SumTerm t;
    add(e_, t, out);
    return out;
  }

 private:
  bool constant_along(int c) const {
    const Dims& s = g_[c].shape;
    const Dims& full = g_[e_].shape;
    if (s.size() == 0) return true;
    if (s.size() != full.size()) return false;
    for (int i = 0; i < s.size(); ++i)
      if ((reduced_[i] && s[i] != 1) || (s[i] != 1 && s[i] != full[i])) return false;
    return true;
  }
  bool whole(int u) const { return g_[u].shape == g_[e_].shape && g_[u].dt == g_[e_].dt; }

  void add(int x, SumTerm t, std::vector<SumTerm>& out) {
    const graph::Node& n = g_[x];
    const int a = n.n_in > 0 ? n.in[0] : -1, b = n.n_in > 1 ? n.in[1] : -1;
    switch (n.op) {
      case Op::add:
      case Op::sub:
        if (whole(a) && whole(b)) {
          add(a, t, out);
          if (n.op == Op::sub) t.negative = !t.negative;
          return add(b, t, out);
        }
        break;
      case Op::neg:
        if (whole(a)) {
          t.negative = !t.negative;
          return add(a, t, out);
        }
        break;
      case Op::mul:
        if (constant_along(a) && whole(b)) {
          t.factors.push_back(a);
          return add(b, t, out);
        }
        if (constant_along(b) && whole(a)) {
          t.factors.push_back(b);
          return add(a, t, out);
        }
        break;
      case Op::div:
        if (constant_along(b) && whole(a)) {
          t.divisors.push_back(b);
          return add(a, t, out);
        }
        break;
      default:
        break;
    }
    t.u = x;
    out.push_back(t);
  }

  const graph::Graph& g_;
  int e_;
  const std::vector<bool>& reduced_;
};

// Whether u is a - mean(a) along exactly the reduced dims (a - sum(a, D, keepdim) / numel(a, D)):
// its sum there is 0 in exact arithmetic, and left to rounding otherwise (a layer_norm backward's
// sum of x - mean, scaled by the variance's gradient), so such a term is dropped, as PyTorch's
// layer_norm backward formula has no such term.
inline bool centred(const graph::Graph& g, int u, const Attrs& reduce) {
  const graph::Node& n = g[u];
  if (n.op != Op::sub) return false;
  const int a = n.in[0];
  const graph::Node& m = g[n.in[1]];
  if (m.op != Op::div) return false;
  const graph::Node& s = g[m.in[0]];
  const graph::Node& c = g[m.in[1]];
  auto same = [&](const Attrs& at) { return at.dims == reduce.dims && at.all == reduce.all; };
  return s.op == Op::sum && s.in[0] == a && s.attrs.keepdim && same(s.attrs) && c.op == Op::numel &&
         g[c.in[0]].shape == g[a].shape && same(c.attrs) && g[u].shape == g[a].shape && wide_float(g[m.in[0]].dt) &&
         wide_float(g[n.in[1]].dt);
}

// Sum node n of g rebuilt into b as its terms' sums (map: g's ids to b's so far), or -1 where
// the rule does not apply or gains nothing. A rejected attempt may leave dead nodes in b.
inline int factor_sum(Builder& b, const graph::Graph& g, const graph::Node& n, const std::vector<int>& map,
                      const std::vector<int>& depth) {
  if (n.op != Op::sum || n.n_in != 1 || n.sym_attrs != 0 || !wide_float(n.dt) || !wide_float(g[n.in[0]].dt)) return -1;
  const int e = n.in[0];
  const int rank = g[e].shape.size();
  std::vector<bool> reduced(static_cast<std::size_t>(rank), n.attrs.all);
  for (auto d : n.attrs.dims)
    if (d >= -rank && d < rank) reduced[static_cast<std::size_t>(d < 0 ? d + rank : d)] = true;
  std::vector<SumTerm> terms = SumTerms(g, e, reduced).split();
  const std::size_t split = terms.size();
  if (split > 1)
    terms.erase(std::remove_if(terms.begin(), terms.end(), [&](const SumTerm& t) { return centred(g, t.u, n.attrs); }),
                terms.end());
  if (terms.empty() || terms.size() > max_sum_terms || (split == 1 && terms[0].u == e)) return -1;
  int deepest = 0;
  for (const auto& t : terms) {
    deepest = std::max(deepest, depth[t.u]);
    // Without keepdim the sum has lost the reduced dims and a factor of the operand's rank
    // would broadcast against it wrongly ([N] times [N, 1]): only rank-0 factors then.
    for (const std::vector<int>* fs : {&t.factors, &t.divisors})
      for (int f : *fs)
        if (!n.attrs.keepdim && g[f].shape.size() != 0) return -1;
  }
  if (deepest >= depth[e]) return -1;  // the terms' sums would wait as long as the whole
  int total = -1;
  for (const auto& t : terms) {
    int s = b.op(Op::sum, {map[t.u]}, n.attrs);
    for (int f : t.factors) s = b.mul(s, map[f]);
    for (int d : t.divisors) s = b.div(s, map[d]);
    total = total < 0 ? (t.negative ? b.neg(s) : s) : (t.negative ? b.sub(total, s) : b.add(total, s));
  }
  return b.shape(total) == n.shape && b.dt(total) == n.dt ? total : -1;
}

}  // namespace detail

// Rewrites the sums of g as described above where that shortens their chain of reductions;
// `changed` says whether any was attempted (the caller then removes what no output reads).
inline graph::Graph factor_sums(const graph::Graph& g, bool* changed = nullptr) {
  if (changed) *changed = false;
  if (g.structural) return g;
  const std::vector<int> depth = detail::reduction_depths(g);
  return rebuild_graph(g, [&](Builder& b, const graph::Node& n, const int* in, const std::vector<int>& map) {
    const int before = b.size();
    const int id = detail::factor_sum(b, g, n, map, depth);
    if (changed && (id >= 0 || b.size() != before)) *changed = true;
    return id >= 0 ? id : b.rebuild(n, in);
  });
}

}  // namespace kiln::rewrite
