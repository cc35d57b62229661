// The shape environment: every dimension of every node as a Sym. In static mode each is a
// constant; in dynamic mode each size other than 0 and 1 is a symbol s0, s1, ... passed to the
// kernels, and equal sizes at the first call share one symbol (duck sizing). Automatic mode makes
// symbolic exactly the dimensions that changed since the previous compile. The guards of a
// compiled program are read off this table (guards/guards.hpp).
#pragma once
#include <algorithm>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include "../graph/graph.hpp"
#include "sym.hpp"

namespace kiln::ir {

// What an attribute symbol stands for: a slice's start (clamped into the sliced dim, as inference
// does) or its step.
enum class AttrField : std::int8_t { none = -1, start, step };

struct ShapeEnv {
  std::vector<std::vector<Sym>> shapes;     // per node, per dim
  std::vector<std::pair<int, int>> source;  // symbol id -> (node, dim) whose size it is; for an
                                            // attribute: (node, the node whose size clamps it)
  std::vector<AttrField> field;             // symbol id -> none for sizes, else the attribute
  std::vector<std::int64_t> example;        // symbol id -> its value at the compiling call
  SymbolTable table;

  const std::vector<Sym>& operator[](int node) const { return shapes[node]; }
  int num_symbols() const { return static_cast<int>(source.size()); }
  bool is_dynamic() const { return !source.empty(); }

  // The symbol of a node's attribute, if it is symbolic.
  std::optional<Sym> attr_symbol(int node, AttrField f) const {
    for (int s = 0; s < num_symbols(); ++s)
      if (field[s] == f && source[s].first == node) return table.symbols()[static_cast<std::size_t>(s)];
    return std::nullopt;
  }

  // Values of every symbol for a call: `call` gives each node's shape (call(n)) and attributes
  // (call.attrs(n)) this call.
  template <class Call>
  void bind(const Call& call, std::int64_t* out) const {
    for (int s = 0; s < num_symbols(); ++s) {
      auto [node, dim] = source[s];
      if (field[s] == AttrField::none)
        out[s] = call(node)[dim];
      else
        out[s] = attr_value(field[s], call.attrs(node), call(dim));
    }
  }
  // A slice's start clamped into the sliced dim of `sliced` (its input's shape, or a
  // slice_backward's own), or its step.
  static std::int64_t attr_value(AttrField f, const Attrs& at, const Dims& sliced) {
    if (f == AttrField::step) return at.d;
    int rank = sliced.size();
    std::int64_t size = sliced[static_cast<int>(at.a < 0 ? at.a + rank : at.a)];
    return std::clamp<std::int64_t>(at.b < 0 ? at.b + size : at.b, 0, size);
  }
};

// A zero-padded reshape's leading positions (graph/infer_views.hpp's infer_padded_reshape): the input's
// elements over the output's trailing dims (out[2:]).
inline Sym padded_positions(std::span<const Sym> in, std::span<const Sym> out) {
  Sym numel(1), trailing(1);
  for (const Sym& x : in) numel = numel * x;
  for (std::size_t t = 2; t < out.size(); ++t) trailing = trailing * out[t];
  return floordiv(numel, trailing);
}

// Symbolises the node shapes of g. `symbolic(node, dim)` says whether a dimension may become a
// symbol (all of them in dynamic mode, the changed ones in automatic mode).
template <class Symbolic>
ShapeEnv make_shape_env(const graph::Graph& g, Symbolic&& symbolic) {
  ShapeEnv env;
  std::map<std::int64_t, Sym> by_value;  // duck sizing: one symbol per distinct size
  env.shapes.resize(g.size());
  // A zero-padded reshape's chunk length (graph/infer_views.hpp) follows from its input: never a symbol
  // of its own (as one it would share a symbol with any equal size, and fail at the next length).
  auto chunk_length = [&](int i, int k) { return g[i].op == Op::reshape && g[i].attrs.keepdim && k == 1; };
  for (int i = 0; i < g.size(); ++i) {
    const Dims& d = g[i].shape;
    for (int k = 0; k < d.size(); ++k) {
      std::int64_t v = d[k];
      if (chunk_length(i, k)) {  // set below, from the node's other dims
        env.shapes[i].push_back(Sym(v));
        continue;
      }
      if (v <= 1 || !symbolic(i, k)) {
        env.shapes[i].push_back(Sym(v));
        continue;
      }
      auto it = by_value.find(v);
      if (it == by_value.end()) {
        it = by_value.emplace(v, env.table.new_size()).first;
        env.source.emplace_back(i, k);
        env.field.push_back(AttrField::none);
        env.example.push_back(v);
      }
      env.shapes[i].push_back(it->second);
    }
    if (d.size() >= 2 && chunk_length(i, 1)) {  // ceil(leading positions / chunks)
      std::vector<Sym>& out = env.shapes[i];
      out[1] = floordiv(padded_positions(env.shapes[g[i].in[0]], out) + out[0] - Sym(1), out[0]);
    }
  }
  // Symbolic slice bounds: a kernel argument o<k> (start, >= 0) and t<k> (step, > 0) each. A start
  // that the sliced dim's size decides (counted from the end, or clamped to the size) is one too when
  // that size is a symbol: x[:, -3:] of a row of changing length starts elsewhere at each call.
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    if (n.op != Op::slice && n.op != Op::slice_backward) continue;
    int sliced = n.op == Op::slice ? n.in[0] : i;
    const Dims& full = g[sliced].shape;
    const int d = static_cast<int>(n.attrs.a < 0 ? n.attrs.a + full.size() : n.attrs.a);
    const bool from_end = n.n_in == 2 && n.attrs.keepdim;  // the whole's size less the part's (codegen)
    const bool sized_start = !from_end && d >= 0 && d < full.size() && (n.attrs.b < 0 || n.attrs.b >= full[d]) &&
                             !env.shapes[sliced][static_cast<std::size_t>(d)].is_constant();
    if (!(n.sym_attrs & (graph::sym_bits::start | graph::sym_bits::step)) && !sized_start) continue;
    auto add = [&](AttrField f, const char* prefix, const SymFacts& facts) {
      env.table.new_symbol(prefix + std::to_string(env.num_symbols()), facts);
      env.source.emplace_back(i, sliced);
      env.field.push_back(f);
      env.example.push_back(ShapeEnv::attr_value(f, n.attrs, g[sliced].shape));
    };
    if ((n.sym_attrs & graph::sym_bits::start) || sized_start) add(AttrField::start, "o", {.nonnegative = true});
    if (n.sym_attrs & graph::sym_bits::step) add(AttrField::step, "t", {.positive = true});
  }
  return env;
}

inline ShapeEnv make_static_shape_env(const graph::Graph& g) {
  return make_shape_env(g, [](int, int) { return false; });
}

// Converts a vector of Syms to its values under a binding (for launch grids and buffer sizes).
inline std::int64_t eval_product(const std::vector<Sym>& dims, Bindings b) {
  std::int64_t p = 1;
  for (auto& s : dims) p *= s.eval(b);
  return p;
}

}  // namespace kiln::ir
