// A k::attention score_mod as a function of one score: what the fused attention kernels inline
// (FlexAttention's score_mod, issue 20). The captured graph holds a score_mod as nodes over the
// attention's score_arg nodes, each [B, H, Tq, Tk]; when every node between them and the mod's
// result is pointwise (no reduction or view of the scores), the same nodes over rank-0 arguments
// are the mod of one score. What it computes without the scores, C++ scalars aside (a bias, a
// document mask), is a tensor it reads, an argument of its own loaded at each score. Its
// derivative with respect to the score and to those tensors comes from the derivative rules
// (autodiff/differentiate.hpp, vjp). Lowering (runtime/lower.hpp) registers such a mod
// (autodiff/score_mods.hpp) and gives its id to the fused kernels' nodes (attrs.custom);
// codegen/score_mod_source.hpp writes the mod and the score's cotangent as C.
#pragma once
#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "../rewrite/builder.hpp"
#include "../rewrite/decompose.hpp"
#include "../rewrite/simplify.hpp"
#include "differentiate.hpp"
#include "score_mods.hpp"

namespace kiln::autodiff {

namespace detail {

// Pointwise composites a score_mod may use (decomposed in the mod's graph).
constexpr bool pointwise_composite(Op op) {
  return op == Op::silu || op == Op::gelu || op == Op::gelu_tanh || op == Op::clamp;
}

// The mod's nodes, walked down from its result: each node is a score_arg (a leaf here), a tensor it
// reads (a node that depends on no score and is not a scalar computation: a leaf too), or one it
// computes from those. kind[i]: 0 not part of it, 1 computed, 2 score_arg, 3 captured tensor.
inline std::vector<char> mod_nodes(const graph::Graph& g, int result) {
  std::vector<char> scored(static_cast<std::size_t>(g.size()), 0), scalar(scored);
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    scalar[i] = n.op == Op::constant || n.op == Op::scalar;
    scored[i] = n.op == Op::score_arg;
    bool all_scalar = is_pointwise(n.op) && n.shape.size() == 0;
    for (int k = 0; k < n.n_in; ++k) {
      scored[i] = scored[i] || (n.op != Op::score_arg && scored[n.in[k]]);
      all_scalar = all_scalar && scalar[n.in[k]];
    }
    scalar[i] = scalar[i] || all_scalar;
  }
  std::vector<char> kind(static_cast<std::size_t>(g.size()), 0);
  graph::walk_inputs(g, {result}, [&](int v) {
    kind[v] = g[v].op == Op::score_arg ? 2 : !scored[v] && !scalar[v] ? 3 : 1;
    return kind[v] == 1;  // a score's q and k are the attention's; a captured tensor is read whole
  });
  return kind;
}

inline graph::Node arg_node(int slot, kiln::dtype dt) {
  graph::Node arg;
  arg.op = Op::arg;
  arg.slot = slot;
  arg.dt = dt;
  return arg;
}

}  // namespace detail

// The score_mod of attention node `at` of g (shapes inferred) as a ScoreMod, or nothing where it is
// not one: no score_mod, a node between the scores and the result that is not pointwise (a
// reduction or a view of the scores), more than max_captured tensors read, one that does not
// broadcast to the scores, or scores that are not f32. The scores must be the attention's own:
// `same_tensor(x, y)` says whether nodes x and y hold one tensor (eager tensors captured twice are
// two argument nodes: lowering compares what is bound to them). Their scale is taken to be the
// attention's (k::attention builds both from one value).
template <class SameTensor>
std::optional<ScoreMod> extract_score_mod(const graph::Graph& g, int at, SameTensor&& same_tensor) {
  const graph::Node& a = g[at];
  if (a.op != Op::attention || !a.attrs.c) return std::nullopt;
  const std::vector<char> kind = detail::mod_nodes(g, a.in[4]);
  ScoreMod m;
  for (int i = 0; i < g.size(); ++i)
    if (kind[i] == 3) {  // (it broadcasts to the scores: the mod's result does, inference checked)
      m.captured.push_back(i);
      m.captured_dt.push_back(g[i].dt);
    }
  if (static_cast<int>(m.captured.size()) > ScoreMod::max_captured) return std::nullopt;
  std::vector<graph::Node> args;
  for (int slot = 0; slot <= ScoreMod::cotangent_arg; ++slot)
    args.push_back(
        detail::arg_node(slot, slot == 0 || slot == ScoreMod::cotangent_arg ? kiln::dtype::f32 : kiln::dtype::i64));
  for (std::size_t c = 0; c < m.captured.size(); ++c)
    args.push_back(detail::arg_node(ScoreMod::first_captured_arg + static_cast<int>(c), m.captured_dt[c]));
  rewrite::Builder b;
  for (const graph::Node& arg : args) b.node(arg);  // node id = slot
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  for (std::size_t c = 0; c < m.captured.size(); ++c)
    map[static_cast<std::size_t>(m.captured[c])] = ScoreMod::first_captured_arg + static_cast<int>(c);
  for (int i = 0; i < g.size(); ++i) {
    const graph::Node& n = g[i];
    if (kind[i] == 2) {
      const bool ours = same_tensor(n.in[0], a.in[0]) && same_tensor(n.in[1], a.in[1]) && n.attrs.b == a.attrs.b &&
                        g[n.in[2]].op == g[a.in[3]].op;
      if (!ours || (n.attrs.a == 0 && n.dt != kiln::dtype::f32)) return std::nullopt;
      map[i] = static_cast<int>(n.attrs.a);  // the argument of that slot (node id = slot)
    } else if (kind[i] != 1) {
      continue;
    } else if (n.op == Op::constant) {
      map[i] = b.constant(n.value);
    } else if (n.op == Op::scalar) {
      graph::Node sc = n;
      sc.shape = {};
      map[i] = b.node(sc);  // (scalars are never merged)
      if (std::find(m.slots.begin(), m.slots.end(), n.slot) == m.slots.end()) m.slots.push_back(n.slot);
    } else if (is_pointwise(n.op) || detail::pointwise_composite(n.op)) {
      std::array<int, graph::max_inputs> in{};
      for (int k = 0; k < n.n_in; ++k) in[k] = map[n.in[k]];
      map[i] = b.rebuild(n, in.data());
    } else {
      return std::nullopt;
    }
  }
  const int out = b.cast(map[a.in[4]], kiln::dtype::f32);  // the decomposition casts it so too
  graph::Graph mod = std::move(b.graph());
  mod.outputs = {out};
  mod.num_args = ScoreMod::first_captured_arg + static_cast<int>(m.captured.size());
  mod = rewrite::decompose(mod);
  graph::infer_shapes_with(mod, [](graph::Node&) {});  // (arguments keep their rank 0 and dtype)
  // The rewrites keep only the arguments the mod reads; the derivative needs the score's and the
  // cotangent's nodes (an unread one gets a zero cotangent).
  std::vector<int> wrt{0};
  for (std::size_t c = 0; c < m.captured.size(); ++c)
    if (is_floating(m.captured_dt[c])) {
      wrt.push_back(ScoreMod::first_captured_arg + static_cast<int>(c));
      m.grads.push_back(static_cast<int>(c));
    }
  wrt.push_back(ScoreMod::cotangent_arg);
  for (int slot : wrt)
    if (detail::find_arg(mod, slot) < 0) mod.nodes.push_back(args[static_cast<std::size_t>(slot)]);
  wrt.pop_back();
  m.vjp = rewrite::simplify(differentiate(mod, wrt, Mode::vjp, ScoreMod::cotangent_arg));
  m.mod = rewrite::simplify(mod);
  return m;
}
inline std::optional<ScoreMod> extract_score_mod(const graph::Graph& g, int at) {
  return extract_score_mod(g, at, [](int x, int y) { return x == y; });
}

}  // namespace kiln::autodiff
