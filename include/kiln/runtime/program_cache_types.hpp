// The types of a program cache: an Entry (a compiled program, the guards it assumed, its CUDA-graph
// replays and capture pins), the Buckets that file entries by key, a dynamic call's scratch shapes
// (CallShapes) and the kind of cache (CacheKind).
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../core/linkage.hpp"
#include "../graph/graph.hpp"
#include "../guards/guards.hpp"
#include "lowering.hpp"
// The program and its CUDA-graph replays are complete types only where the runtime is compiled
// (core/linkage.hpp): a TU built with KILN_SEPARATE_COMPILATION holds them by pointer.
#if KILN_DEFINITIONS
#include "launch/cuda_graph.hpp"
#include "launch/program.hpp"
#endif

namespace kiln::runtime {

struct Program;
class GraphReplay;

// Intermediates of runs recorded into a CUDA graph the caller is capturing: the caller's graph keeps
// their addresses, so they are never returned to the allocator (they live as long as the function).
struct CapturePins {
  std::mutex mu;
  std::vector<std::vector<Tensor>> kept;
  void add(std::vector<Tensor> temps) {
    std::lock_guard lock(mu);
    kept.push_back(std::move(temps));
  }
};

// One compiled program and what it assumed.
struct Entry {
  guards::GuardSet guards;
  mutable std::uint64_t key = 0;                    // guards::guard_key(guards): its bucket (under the cache's lock)
  mutable std::atomic<std::uint64_t> last_used{0};  // lru_tick() of its latest call
  std::shared_ptr<Program> program;
  LoweringStats stats;
  std::shared_ptr<GraphReplay> graphs;  // .cuda_graphs on a CUDA device; after program: destroyed first
  std::shared_ptr<CapturePins> pins;    // CUDA: intermediates of runs recorded in a caller's capture
  bool tune = false;                    // options.autotune: the first call times the candidates
  mutable std::once_flag tuned;
  mutable std::atomic<bool> tuning_done{false};
};

// The scratch shapes of a dynamic call: the program's graph re-inferred for this call's inputs.
struct CallShapes {
  std::vector<graph::Node> nodes;
};

// Eager caches pass `eager`: no recompile limit, and their programs count against the process-wide
// budget of eager programs.
enum class CacheKind { function, eager };

using Buckets = std::unordered_map<std::uint64_t, std::vector<std::shared_ptr<const Entry>>>;

}  // namespace kiln::runtime
