// A k::attention score_mod as a function of one score: what the fused attention kernels inline
// (FlexAttention's score_mod, issue 20). The captured graph holds a score_mod as nodes over the
// attention's score_arg nodes, each [B, H, Tq, Tk]; when every node between them and the mod's
// result is pointwise (C++ scalars and constants aside: no tensor it reads, no reduction, no
// view), the same nodes over rank-0 arguments are the mod of one score, and its derivative with
// respect to the score comes from the derivative rules (autodiff/differentiate.hpp, vjp). Lowering
// (runtime/lower.hpp) registers such a mod and gives its id to the fused kernels' nodes
// (attrs.custom); codegen/score_mod_source.hpp writes both functions as C.
#pragma once
#include <array>
#include <deque>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "../rewrite/builder.hpp"
#include "../rewrite/decompose.hpp"
#include "../rewrite/simplify.hpp"
#include "differentiate.hpp"

namespace kiln::autodiff {

// The mod of one score. Arguments of both graphs (rank 0): 0 the scaled score (f32), 1..4 its
// batch, head, query and key index (i64), 5 the cotangent of the mod's value (f32; only vjp reads
// it). `mod` gives the modded score (f32), `vjp` the cotangent of the score. Their scalar nodes
// keep the program's scalar slots; `slots` lists them in the order the kernels receive them.
struct ScoreMod {
  graph::Graph mod, vjp;
  std::vector<int> slots;
  std::string source;  // both as C (codegen/score_mod_source.hpp), written when lowering registers it
  static constexpr int cotangent_arg = 5;
};

namespace detail {

// Pointwise composites a score_mod may use (decomposed in the mod's graph).
constexpr bool pointwise_composite(Op op) {
  return op == Op::silu || op == Op::gelu || op == Op::gelu_tanh || op == Op::clamp;
}

// The nodes the mod's result depends on, down to the score_arg nodes (inclusive), in id order.
inline std::vector<int> mod_nodes(const graph::Graph& g, int result) {
  std::vector<char> in(static_cast<std::size_t>(g.size()), 0);
  graph::walk_inputs(g, {result}, [&](int v) {
    in[v] = 1;
    return g[v].op != Op::score_arg;  // a score's q and k are the attention's, not the mod's
  });
  std::vector<int> ids;
  for (int i = 0; i < g.size(); ++i)
    if (in[i]) ids.push_back(i);
  return ids;
}

}  // namespace detail

// The score_mod of attention node `at` of g (shapes inferred) as a ScoreMod, or nothing where it is
// not one: no score_mod, a node that is not pointwise over the scores, their indices, scalars and
// constants (a tensor it reads, a reduction, a view), or scores that are not f32. The scores must be
// the attention's own: `same_tensor(x, y)` says whether nodes x and y hold one tensor (eager
// tensors captured twice are two argument nodes: lowering compares what is bound to them). Their
// scale is taken to be the attention's (k::attention builds both from one value).
template <class SameTensor>
std::optional<ScoreMod> extract_score_mod(const graph::Graph& g, int at, SameTensor&& same_tensor) {
  const graph::Node& a = g[at];
  if (a.op != Op::attention || !a.attrs.c) return std::nullopt;
  rewrite::Builder b;
  for (int slot = 0; slot <= ScoreMod::cotangent_arg; ++slot) {
    graph::Node arg;
    arg.op = Op::arg;
    arg.slot = slot;
    arg.dt = slot == 0 || slot == ScoreMod::cotangent_arg ? kiln::dtype::f32 : kiln::dtype::i64;
    b.node(arg);
  }
  ScoreMod m;
  std::vector<int> map(static_cast<std::size_t>(g.size()), -1);
  for (int i : detail::mod_nodes(g, a.in[4])) {
    const graph::Node& n = g[i];
    if (n.op == Op::score_arg) {
      const bool ours = same_tensor(n.in[0], a.in[0]) && same_tensor(n.in[1], a.in[1]) && n.attrs.b == a.attrs.b &&
                        g[n.in[2]].op == g[a.in[3]].op;
      if (!ours || (n.attrs.a == 0 && n.dt != kiln::dtype::f32)) return std::nullopt;
      map[i] = static_cast<int>(n.attrs.a);  // the argument of that slot (node id = slot)
    } else if (n.op == Op::constant) {
      map[i] = b.constant(n.value);
    } else if (n.op == Op::scalar) {
      graph::Node s = n;
      s.shape = {};
      map[i] = b.node(s);  // (scalars are never merged)
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
  mod.num_args = ScoreMod::cotangent_arg + 1;
  mod = rewrite::decompose(mod);
  graph::infer_shapes_with(mod, [](graph::Node&) {});        // (arguments keep their rank 0 and dtype)
  if (detail::find_arg(mod, ScoreMod::cotangent_arg) < 0) {  // (the rewrites keep only what the mod reads)
    graph::Node ct;
    ct.op = Op::arg;
    ct.slot = ScoreMod::cotangent_arg;
    ct.dt = kiln::dtype::f32;
    mod.nodes.push_back(ct);
  }
  if (detail::find_arg(mod, 0) < 0) {  // a mod that ignores the score: its derivative is 0
    graph::Node s;
    s.op = Op::arg;
    s.slot = 0;
    s.dt = kiln::dtype::f32;
    mod.nodes.push_back(s);
  }
  const int wrt[] = {0};
  m.vjp = rewrite::simplify(differentiate(mod, wrt, Mode::vjp, ScoreMod::cotangent_arg));
  m.mod = rewrite::simplify(mod);
  return m;
}
inline std::optional<ScoreMod> extract_score_mod(const graph::Graph& g, int at) {
  return extract_score_mod(g, at, [](int x, int y) { return x == y; });
}

// The score_mods lowering found, by id (Attrs::custom of the fused attention nodes). Entries live
// as long as the process (a cached program may name any id); equal mods share one id.
class ScoreMods {
 public:
  static ScoreMods& instance() {
    static ScoreMods r;
    return r;
  }
  std::int32_t add(ScoreMod m) {
    std::string key = m.mod.str() + m.vjp.str();
    for (int s : m.slots) key += " s" + std::to_string(s);
    std::unique_lock lock(mu_);
    for (std::size_t i = 0; i < keys_.size(); ++i)
      if (keys_[i] == key) return static_cast<std::int32_t>(i);
    keys_.push_back(std::move(key));
    mods_.push_back(std::move(m));
    return static_cast<std::int32_t>(mods_.size() - 1);
  }
  const ScoreMod& get(std::int64_t id) const {
    std::shared_lock lock(mu_);
    if (id < 0 || id >= static_cast<std::int64_t>(mods_.size()))
      throw error("attention: score_mod id " + std::to_string(id) + " was never registered");
    return mods_[static_cast<std::size_t>(id)];  // a deque: references stay valid as it grows
  }

 private:
  mutable std::shared_mutex mu_;
  std::deque<ScoreMod> mods_;
  std::vector<std::string> keys_;
};

}  // namespace kiln::autodiff
