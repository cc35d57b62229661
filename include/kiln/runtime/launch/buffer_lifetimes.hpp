// How long a program's intermediates live in a plain run. Each buffer is allocated just before the
// first step that reads or writes it and released right after the last one, so later steps reuse
// blocks that earlier ones released (the caching allocator hands a block back on the same stream,
// where stream order makes that safe): the run's peak is what is live at its busiest step, not
// every intermediate at once, as Inductor's buffer reuse. A joint forward and backward keeps an
// activation from the forward step that writes it to the backward step that last reads it. Runs
// recorded into a CUDA graph keep every buffer for the graph's lifetime instead, at offsets in one
// block where buffers whose lifetimes overlap never overlap in memory (pack_buffers).
#pragma once
#include <algorithm>
#include <cstddef>
#include <utility>
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

// Offsets in one block for intermediates that must all exist at once (a CUDA graph replays into
// fixed addresses) such that buffers live at the same step never share a byte: greedy by size, as
// TFLite's arena planner and XLA's heap simulator do it. Buffers in decreasing size (then in step
// order) each take the smallest gap that holds it between the buffers already placed whose
// lifetimes overlap its own, else the end. The block then comes out at or near the run's live peak
// (the most bytes live at one step), where a block a buffer, reused only whole (the rule before),
// kept small buffers in large blocks and grew blocks to fit (GPT-2's one-layer step: 2315 MiB
// against a live peak of 2283, which this packing meets; NOTES item 155). Sizes round up to
// `align` bytes (vector loads, TMA and cuBLASLt's operands want 16-256). offset_of: per node, its
// offset (-1: none); bytes: the block; live_peak: the most bytes live at one step (a lower bound
// on `bytes`).
struct PackedBuffers {
  std::vector<std::ptrdiff_t> offset_of;
  std::size_t bytes = 0, live_peak = 0;
};
template <class BytesOf>
PackedBuffers pack_buffers(const BufferLifetimes& life, std::size_t nodes, BytesOf&& bytes_of,
                           std::size_t align = 256) {
  struct Live {
    int node;
    std::size_t first, last, size;
    std::ptrdiff_t offset = -1;
  };
  std::vector<Live> all;
  std::vector<std::size_t> first(nodes, 0);
  for (std::size_t s = 0; s < life.allocate_before.size(); ++s)
    for (int b : life.allocate_before[s]) first[static_cast<std::size_t>(b)] = s;
  for (std::size_t s = 0; s < life.release_after.size(); ++s)
    for (int b : life.release_after[s]) {
      const std::size_t need = (bytes_of(b) + align - 1) / align * align;
      if (need > 0) all.push_back({b, first[static_cast<std::size_t>(b)], s, need});
    }
  PackedBuffers out;
  out.offset_of.assign(nodes, -1);
  std::vector<std::size_t> at_step(life.allocate_before.size() + 1, 0);  // live bytes a step
  for (const Live& l : all)
    for (std::size_t s = l.first; s <= l.last; ++s) at_step[s] += l.size;
  for (std::size_t v : at_step) out.live_peak = std::max(out.live_peak, v);
  std::vector<std::size_t> order(all.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return all[a].size > all[b].size; });
  std::vector<std::size_t> placed;                         // indices into `all`, in placing order
  std::vector<std::pair<std::size_t, std::size_t>> taken;  // [offset, end) of the overlapping ones
  for (std::size_t i : order) {
    Live& l = all[i];
    taken.clear();
    for (std::size_t j : placed)
      if (all[j].first <= l.last && l.first <= all[j].last)
        taken.emplace_back(static_cast<std::size_t>(all[j].offset),
                           static_cast<std::size_t>(all[j].offset) + all[j].size);
    std::sort(taken.begin(), taken.end());
    std::size_t at = 0, best = 0, best_gap = 0;
    bool found = false;
    for (const auto& [lo, hi] : taken) {
      if (lo >= at + l.size && (!found || lo - at < best_gap)) best = at, best_gap = lo - at, found = true;
      at = std::max(at, hi);
    }
    l.offset = static_cast<std::ptrdiff_t>(found ? best : at);
    out.offset_of[static_cast<std::size_t>(l.node)] = l.offset;
    out.bytes = std::max(out.bytes, static_cast<std::size_t>(l.offset) + l.size);
    placed.push_back(i);
  }
  return out;
}

}  // namespace kiln::runtime
