// The shape environment: every dimension of every node as a Sym. In static mode each is a
// constant; in dynamic mode each size other than 0 and 1 is a symbol s0, s1, ... passed to the
// kernels, and equal sizes at the first call share one symbol (duck sizing). Automatic mode makes
// symbolic exactly the dimensions that changed since the previous compile. The guards of a
// compiled program are read off this table (guards/guards.hpp).
#pragma once
#include <map>
#include <vector>

#include "../graph/graph.hpp"
#include "sym.hpp"

namespace kiln::ir {

enum class ShapeMode { static_, dynamic, automatic };

struct ShapeEnv {
  std::vector<std::vector<Sym>> shapes;       // per node, per dim
  std::vector<std::pair<int, int>> source;    // symbol id -> (node, dim) whose size it is
  std::vector<std::int64_t> example;          // symbol id -> its value at the compiling call
  SymbolTable table;

  const std::vector<Sym>& operator[](int node) const { return shapes[node]; }
  int num_symbols() const { return static_cast<int>(source.size()); }
  bool is_dynamic() const { return !source.empty(); }

  // Values of every symbol for a call whose node shapes are `dims` (indexed by node).
  template <class ShapeOf>
  void bind(ShapeOf&& shape_of, std::int64_t* out) const {
    for (int s = 0; s < num_symbols(); ++s) out[s] = shape_of(source[s].first)[source[s].second];
  }
};

// Symbolises the node shapes of g. `symbolic(node, dim)` says whether a dimension may become a
// symbol (all of them in dynamic mode, the changed ones in automatic mode).
template <class Symbolic>
ShapeEnv make_shape_env(const graph::Graph& g, Symbolic&& symbolic) {
  ShapeEnv env;
  std::map<std::int64_t, Sym> by_value;  // duck sizing: one symbol per distinct size
  env.shapes.resize(g.size());
  for (int i = 0; i < g.size(); ++i) {
    const Dims& d = g[i].shape;
    for (int k = 0; k < d.size(); ++k) {
      std::int64_t v = d[k];
      if (v <= 1 || !symbolic(i, k)) {
        env.shapes[i].push_back(Sym(v));
        continue;
      }
      auto it = by_value.find(v);
      if (it == by_value.end()) {
        it = by_value.emplace(v, env.table.new_size()).first;
        env.source.emplace_back(i, k);
        env.example.push_back(v);
      }
      env.shapes[i].push_back(it->second);
    }
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
