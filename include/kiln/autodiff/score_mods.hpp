// The score_mods that lowering inlines into the fused attention kernels (autodiff/score_mod.hpp
// finds them), by id: what the kernels' nodes name in attrs.custom and what the derivative rule,
// the kernel writer and the launch read.
#pragma once
#include <bit>
#include <cstdint>
#include <deque>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "../core/error.hpp"
#include "../graph/graph.hpp"

namespace kiln::autodiff {

// The mod of one score. Arguments of both graphs (rank 0): 0 the scaled score (f32), 1..4 its
// batch, head, query and key index (i64), 5 the cotangent of the mod's value (f32; only vjp reads
// it), 6.. the element at (b, h, i, j) of each tensor it reads (`captured`: their nodes in the
// attention's graph, each broadcast to the scores' [B, H, Tq, Tk]). `mod` gives the modded score
// (f32); `vjp` the cotangent of the score, then of each floating captured tensor (`grads`: which).
// Their scalar nodes keep the program's scalar slots; `slots` lists them in the order the kernels
// receive them.
struct ScoreMod {
  graph::Graph mod, vjp;
  std::vector<int> slots;
  std::vector<int> captured;  // node ids in the attention's graph (at most max_captured)
  std::vector<kiln::dtype> captured_dt;
  std::vector<int> grads;  // vjp's outputs after the first: the captured tensor of each
  std::string source;      // mod and vjp as C (codegen/score_mod_source.hpp), written when lowering registers it
  std::string tag;         // a hash of the source, for kernel names
  static constexpr int cotangent_arg = 5, first_captured_arg = 6;
  static constexpr int max_captured = graph::max_inputs - 6;  // attention_grad's inputs beside its six
};

// The score_mods lowering found, by id (Attrs::custom of the fused attention nodes). Entries live
// as long as the process (a cached program may name any id); equal mods share one id.
class ScoreMods {
 public:
  static ScoreMods& instance() {
    static ScoreMods r;
    return r;
  }
  std::int32_t add(ScoreMod m) {
    std::string key = m.mod.str() + m.vjp.str();  // (constants to 6 digits there: all their bits below)
    for (const graph::Graph* g : {&m.mod, &m.vjp})
      for (const graph::Node& n : g->nodes)
        if (n.op == Op::constant) key += " c" + std::to_string(std::bit_cast<std::uint64_t>(n.value));
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
