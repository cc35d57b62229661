// How long a program's intermediates live in a plain run. Each buffer is allocated just before the
// first step that reads or writes it and released right after the last one, so later steps reuse
// blocks that earlier ones released (the caching allocator hands a block back on the same stream,
// where stream order makes that safe): the run's peak is what is live at its busiest step, not
// every intermediate at once, as Inductor's buffer reuse. A joint forward and backward keeps an
// activation from the forward step that writes it to the backward step that last reads it. Runs
// recorded into a CUDA graph keep every buffer for the graph's lifetime instead, but buffers whose
// lifetimes do not overlap share a block there (share_blocks).
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

#include "step_observer.hpp"

namespace kiln::runtime {

struct BufferLifetimes {
  // Per step: the buffers to allocate before it and to release after it (outputs are the caller's).
  std::vector<std::vector<int>> allocate_before, release_after;
};

// From the nodes each step touches (step_observer.hpp's nodes_touched) and the embedding id checks
// that read a buffer before a step (index_checks.hpp). A buffer no step touches lives for the run.
template <class ProgramT>
BufferLifetimes plan_lifetimes(const ProgramT& p) {
  const std::size_t steps = p.kernels.size(), nodes = p.graph.nodes.size();
  BufferLifetimes life;
  if (steps == 0) return life;
  life.allocate_before.resize(steps);
  life.release_after.resize(steps);
  std::vector<bool> intermediate(nodes, false);
  for (int b : p.buffers) intermediate[static_cast<std::size_t>(b)] = true;
  for (int o : p.graph.outputs) intermediate[static_cast<std::size_t>(o)] = false;
  std::vector<std::ptrdiff_t> first(nodes, -1), last(nodes, -1);
  auto touch = [&](int node, std::size_t step) {
    const auto n = static_cast<std::size_t>(node);
    if (node < 0 || n >= nodes || !intermediate[n]) return;
    const auto s = static_cast<std::ptrdiff_t>(step);
    if (first[n] < 0 || s < first[n]) first[n] = s;
    last[n] = std::max(last[n], s);
  };
  for (std::size_t k = 0; k < steps; ++k)
    for (int node : nodes_touched(p, k)) touch(node, k);
  for (const auto& c : p.index_checks)  // checked just before step after_kernel + 1
    touch(c.ids, std::min<std::size_t>(static_cast<std::size_t>(c.after_kernel + 1), steps - 1));
  for (int b : p.buffers) {
    const auto n = static_cast<std::size_t>(b);
    if (!intermediate[n]) continue;
    const bool touched = first[n] >= 0;
    life.allocate_before[touched ? static_cast<std::size_t>(first[n]) : 0].push_back(b);
    life.release_after[touched ? static_cast<std::size_t>(last[n]) : steps - 1].push_back(b);
  }
  return life;
}

// Blocks for intermediates that must all exist at once (a CUDA graph replays into fixed addresses):
// a buffer takes a block no live buffer holds, the smallest that fits, else the largest free one
// (grown to fit), else a new one, in step order. slot_of: per node, its block (-1: none); bytes:
// each block's size. bytes_of(node) gives a buffer's size this call.
struct SharedBlocks {
  std::vector<int> slot_of;
  std::vector<std::size_t> bytes;
};
template <class BytesOf>
SharedBlocks share_blocks(const BufferLifetimes& life, std::size_t nodes, BytesOf&& bytes_of) {
  SharedBlocks out;
  out.slot_of.assign(nodes, -1);
  std::vector<bool> busy;
  for (std::size_t s = 0; s < life.allocate_before.size(); ++s) {
    for (int b : life.allocate_before[s]) {
      const std::size_t need = bytes_of(b);
      if (need == 0) continue;
      int fit = -1, largest = -1;
      for (std::size_t i = 0; i < out.bytes.size(); ++i) {
        if (busy[i]) continue;
        const int j = static_cast<int>(i);
        if (out.bytes[i] >= need && (fit < 0 || out.bytes[i] < out.bytes[static_cast<std::size_t>(fit)])) fit = j;
        if (largest < 0 || out.bytes[i] > out.bytes[static_cast<std::size_t>(largest)]) largest = j;
      }
      int slot = fit >= 0 ? fit : largest;
      if (slot < 0) {
        slot = static_cast<int>(out.bytes.size());
        out.bytes.push_back(0);
        busy.push_back(false);
      }
      const auto i = static_cast<std::size_t>(slot);
      out.bytes[i] = std::max(out.bytes[i], need);
      busy[i] = true;
      out.slot_of[static_cast<std::size_t>(b)] = slot;
    }
    for (int b : life.release_after[s])
      if (out.slot_of[static_cast<std::size_t>(b)] >= 0) busy[static_cast<std::size_t>(out.slot_of[static_cast<std::size_t>(b)])] = false;
  }
  return out;
}

}  // namespace kiln::runtime
