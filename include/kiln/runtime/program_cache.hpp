// The program cache of a compiled function or an eager expression type: compiled programs keyed
// by guards. A call finds its bucket by a compact key in constant time (exact shapes for static
// programs, the rest for programs with symbolic sizes) and the program whose guards hold (the hit
// path: comparisons only), or compiles a new one once, even when many threads ask at the same time.
// Caches are bounded: a compiled function past its recompile limit warns once, makes every size
// symbolic and evicts its least recently used program (or throws, with on_limit::raise); eager
// expressions have no limit and share a process-wide budget of programs (program_budget.hpp).
// Slice bounds and view sizes that change between calls become symbolic at the first change.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>

#include "../core/linkage.hpp"
#include "../debug/log.hpp"
#include "../graph/flatten.hpp"
#include "../guards/guards.hpp"
#include "lowering.hpp"
#include "options.hpp"
#include "program_budget.hpp"
#include "program_cache_types.hpp"
// The miss path (lookup and what it calls: program_cache_miss.hpp, included at the end) builds and
// launches programs: the whole pipeline, parsed only where the runtime is compiled (core/linkage.hpp).

namespace kiln::runtime {

class ProgramCache final : public Evictable {
 public:
  explicit ProgramCache(options o = {}, CacheKind kind = CacheKind::function)
      : opt_(o), eager_(kind == CacheKind::eager) {
    if (eager_) ProgramBudget::eager().add(this);
  }
  ~ProgramCache() override {
    if (!eager_) return;
    ProgramBudget::eager().remove(this);
    for (std::size_t i = 0; i < entries_.size(); ++i) ProgramBudget::eager().removed();
  }
  ProgramCache(const ProgramCache&) = delete;
  ProgramCache& operator=(const ProgramCache&) = delete;

  // Finds or compiles the program for these inputs. `build` returns the lowered graph (it is
  // only called on a miss); attrs are the captured attributes, compared against each entry.
  // A miss while the caller is recording a CUDA graph on `stream` is an error: compiling (and the
  // allocation and synchronisation it needs) cannot be captured.
  // `ops` (the op of each attribute, may be null) lets attributes that change between calls become
  // symbolic: slice bounds and view sizes (automatic and dynamic shapes, or past the limit).
  // `build` is called as build(arg, stats, symbolic) or, for a graph built at run time (no captured
  // attributes), build(arg, stats).
  template <class Build>
  std::shared_ptr<const Entry> get(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                   Build&& build, CallShapes& shapes_out, CUstream stream = nullptr,
                                   const Op* ops = nullptr) {
    auto erased = [&build](ArgRef arg, LoweringStats& stats, const std::vector<std::uint8_t>* symbolic) {
      if constexpr (std::is_invocable_v<Build&, ArgRef&, LoweringStats&, const std::vector<std::uint8_t>*>)
        return graph::Graph(build(arg, stats, symbolic));
      else
        return graph::Graph(build(arg, stats));
    };
    return lookup(args, nargs, attrs, nattrs, erased, shapes_out, stream, ops);
  }
  using BuildRef = FunctionRef<graph::Graph(ArgRef, LoweringStats&, const std::vector<std::uint8_t>*)>;
  // get's work: an entry point (core/linkage.hpp), defined below.
  KILN_DECL std::shared_ptr<const Entry> lookup(const Tensor* const* args, int nargs, const Attrs* const* attrs,
                                                int nattrs, BuildRef build, CallShapes& shapes_out, CUstream stream,
                                                const Op* ops);

  // Programs compiled after the first (evicted ones included), and why each was needed (the
  // latest 64).
  int recompiles() const { return std::max(0, compiles() - 1); }
  int compiles() const { return compiles_.load(std::memory_order_relaxed); }
  std::vector<std::string> recompile_reasons() const {
    std::shared_lock lock(mu_);
    return {reasons_.begin(), reasons_.end()};
  }
  std::vector<std::shared_ptr<const Entry>> entries() const {
    std::shared_lock lock(mu_);
    return {entries_.begin(), entries_.end()};
  }
  std::size_t size() const {
    std::shared_lock lock(mu_);
    return entries_.size();
  }
  // Whether the function went past its recompile limit and now compiles every size symbolically.
  bool generalized() const {
    std::shared_lock lock(mu_);
    return generalized_;
  }
  const options& opts() const { return opt_; }

  // Files an entry compiled elsewhere under its own guards, evicting as a compile would (tools and
  // benchmarks, e.g. to fill a cache with many programs without compiling each). The caller vouches
  // that the entry's program computes every call its guards admit.
  void adopt(std::shared_ptr<Entry> e) {
    std::unique_lock lock(mu_);
    e->key = file_key(*e);
    e->last_used.store(lru_tick(), std::memory_order_relaxed);
    entries_.push_back(e);
    map_of(*e)[e->key].push_back(std::move(e));
    if (eager_) ProgramBudget::eager().added();
  }

  bool oldest_tick(std::uint64_t& tick) const override {
    std::shared_lock lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || entries_.empty()) return false;
    tick = entries_[lru_index(-1)]->last_used.load(std::memory_order_relaxed);
    return true;
  }
  bool evict_oldest() override {
    std::unique_lock lock(mu_, std::try_to_lock);
    if (!lock.owns_lock() || entries_.empty()) return false;
    evict(lru_index(-1));
    return true;
  }

 private:
  static std::shared_ptr<const Entry> touch(std::shared_ptr<const Entry> e) {
    e->last_used.store(lru_tick(), std::memory_order_relaxed);
    return e;
  }

  static void refuse_during_capture(const Tensor* const* args, int nargs, CUstream stream);

  // The bucket of a call under this cache's symbolic attributes.
  std::uint64_t key_of(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs) const {
    bool sym = static_cast<int>(symbolic_.size()) == nattrs;
    return guards::call_key(args, nargs, attrs, nattrs, sym ? symbolic_.data() : nullptr,
                            sym ? slot_ops_.data() : nullptr);
  }

  std::uint64_t key_of(const Entry& e) const {
    bool sym = symbolic_.size() == e.guards.attrs.size();
    return guards::guard_key(e.guards, sym ? symbolic_.data() : nullptr, sym ? slot_ops_.data() : nullptr);
  }

  // Every attribute equal, but for the fields the entry's program takes as each call's values.
  static bool attrs_match(const Entry& e, const Attrs* const* attrs, int nattrs) {
    if (static_cast<int>(e.guards.attrs.size()) != nattrs) return false;
    const auto& sym = e.guards.symbolic;
    for (int i = 0; i < nattrs; ++i) {
      if (sym.empty() || !sym[i]) {
        if (!(*attrs[i] == e.guards.attrs[i])) return false;
      } else if (!graph::attrs_match(e.guards.ops[i], sym[i], e.guards.attrs[i], *attrs[i])) {
        return false;
      }
    }
    return true;
  }

  // Whether an entry was compiled for the same custom ops as these attributes: calling another
  // k::custom_op is calling another function (as another lambda would be), not a recompile of this one.
  static bool same_custom_ops(const Entry& e, const Attrs* const* attrs, int nattrs) {
    bool same = static_cast<int>(e.guards.attrs.size()) == nattrs;
    for (int i = 0; same && i < nattrs; ++i) same = e.guards.attrs[i].custom == attrs[i]->custom;
    return same;
  }

  int same_custom_ops_count(const Attrs* const* attrs, int nattrs) const {
    int count = 0;
    for (auto& e : entries_) count += same_custom_ops(*e, attrs, nattrs);
    return count;
  }

  // Re-infers the program's graph for this call's inputs and symbolic attributes (dynamic programs
  // only).
  static bool infer_call_shapes(const Program& p, const Tensor* const* args, const Attrs* const* attrs, int nattrs,
                                CallShapes& out);

  static graph::Graph& scratch_graph() {
    thread_local graph::Graph g;
    return g;
  }

  // Kernels indexing in int at this call's symbolic sizes (codegen's narrow_indices): the nodes and
  // arguments they touch and their index spans are guarded (guards::within_index_limit). A kernel
  // whose span already fails at these sizes would fail its own guard: the program is rebuilt with
  // int indices for static sizes only.
  template <class Rebuild>
  static void guard_index_limit(Entry& e, Rebuild&& rebuild);

  // Whether entry e's guards hold for this call; `why` (miss path only) names the failed one.
  static bool matches(const Entry& e, const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                      CallShapes& shapes, std::string* why);

  // The hit path: a program with exact shapes under this call's exact key, else the programs with
  // symbolic sizes under its key, in the order they were compiled.
  std::shared_ptr<const Entry> find(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                    CallShapes& shapes) const;

  // Where an entry is filed: programs with exact shapes by their shapes, the others (symbolic
  // sizes, or an argument they never read) by the rest.
  static bool exact(const Entry& e) {
    return !e.guards.dynamic &&
           std::all_of(e.guards.args.begin(), e.guards.args.end(), [](const auto& a) { return a.read; });
  }

  Buckets& map_of(const Entry& e) { return exact(e) ? exact_ : buckets_; }

  std::uint64_t file_key(const Entry& e) const { return exact(e) ? guards::exact_guard_key(e.guards) : key_of(e); }

  // The miss path: which guard of which program failed last (for logs and explain).
  std::string miss_reason(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs) const;

  // The entry used least recently (among those for the same custom ops as `like`, when given).
  std::size_t lru_index(int like_count, const Attrs* const* like = nullptr) const {
    std::size_t best = 0;
    std::uint64_t oldest = ~std::uint64_t{0};
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (like && !same_custom_ops(*entries_[i], like, like_count)) continue;
      std::uint64_t t = entries_[i]->last_used.load(std::memory_order_relaxed);
      if (t < oldest) oldest = t, best = i;
    }
    return best;
  }

  void evict(std::size_t index);

  // Past the recompile limit: warn once, compile every size symbolically from now on, and make
  // room for the new program by evicting the least recently used one (or throw, on_limit::raise).
  void apply_limit(const Attrs* const* attrs, int nattrs, const std::string& reason);

  // Automatic and dynamic shapes (or past the limit): the slice bounds and view sizes that differ
  // from the last compile's become symbolic, for this and every later program of this cache.
  void generalize_attrs(const Attrs* const* attrs, int nattrs, const Op* ops);

  std::shared_ptr<const Entry> compile(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                       const Op* ops, BuildRef build, CallShapes& shapes);

  // Static: constants. Dynamic, or past the recompile limit: every size a symbol. Automatic: exact
  // first, then the dims that changed since the last compile become symbols.
  ir::ShapeEnv make_env(const graph::Graph& g) const;
  bool may_be_symbolic(const Tensor* const* args, int nargs) const;

  // Remembers this compile's shapes and which dims have ever changed (automatic mode).
  void remember_shapes(const graph::Graph& g);

  options opt_;
  bool eager_ = false;
  mutable std::shared_mutex mu_;
  std::vector<std::shared_ptr<const Entry>> entries_;  // in compile order
  Buckets exact_;                                      // programs with exact shapes, by guards::exact_guard_key
  Buckets buckets_;                                    // programs with symbolic sizes or attributes, by guard key
  std::atomic<int> compiles_{0};
  bool generalized_ = false;
  std::vector<std::uint8_t> symbolic_;  // per captured attribute: its symbolic fields (all programs from now on)
  bool any_symbolic_ = false;           // some field of symbolic_ is set
  std::vector<Op> slot_ops_;            // the op of each captured attribute
  std::vector<Attrs> last_attrs_;       // the attributes of the last compile (automatic mode)
  std::deque<std::string> reasons_;
  std::vector<Dims> last_shapes_;
  std::vector<unsigned> changed_;
  std::vector<Dims> last_args_;          // argument shapes of the last compile, by slot (automatic mode)
  std::vector<unsigned> args_changed_;  // argument dims that have changed between compiles, by slot
};

}  // namespace kiln::runtime

#if KILN_DEFINITIONS
#include "program_cache_miss.hpp"
#endif
