// k::compile and eager evaluation: a per-function cache of compiled programs keyed by guards.
// A call gathers the tensors, scalars and attributes of the freshly built expression, finds the
// program whose guards hold (the hit path: comparisons only), or compiles a new one once, even
// when many threads ask at the same time, up to the recompile limit.
#pragma once
#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <tuple>
#include <utility>

#include "../autodiff/grad.hpp"
#include "../graph/flatten.hpp"
#include "../guards/guards.hpp"
#include "compile.hpp"
#include "cuda_graph.hpp"

namespace kiln {

enum class shapes { automatic, static_, dynamic };

struct options {
  ::kiln::shapes shapes = ::kiln::shapes::automatic;
  bool cuda_graphs = false;
  bool autotune = false;
  int recompile_limit = 8;
};


namespace runtime {

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

class ProgramCache {
 public:
  explicit ProgramCache(options o = {}) : opt_(o) {}

  // Finds or compiles the program for these inputs. `build` returns the lowered graph (it is
  // only called on a miss); attrs are the captured attributes, compared against each entry.
  // A miss while the caller is recording a CUDA graph on `stream` is an error: compiling (and the
  // allocation and synchronisation it needs) cannot be captured.
  template <class Build>
  std::shared_ptr<const Entry> get(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                   Build&& build, CallShapes& shapes_out, CUstream stream = nullptr) {
    {
      std::shared_lock lock(mu_);
      if (auto e = find(args, nargs, attrs, nattrs, shapes_out, nullptr)) return e;
    }
    std::unique_lock lock(mu_);
    if (auto e = find(args, nargs, attrs, nattrs, shapes_out, &last_failure_)) return e;  // another thread compiled it
    refuse_during_capture(args, nargs, stream);
    return compile(args, nargs, attrs, nattrs, build, shapes_out);
  }

  int recompiles() const { return std::max(0, static_cast<int>(entries_.size()) - 1); }
  std::vector<std::string> recompile_reasons() const {
    std::shared_lock lock(mu_);
    return reasons_;
  }
  std::vector<std::shared_ptr<const Entry>> entries() const {
    std::shared_lock lock(mu_);
    return {entries_.begin(), entries_.end()};
  }
  const options& opts() const { return opt_; }

 private:
  static void refuse_during_capture(const Tensor* const* args, int nargs, CUstream stream) {
    if (!stream) return;  // the legacy default stream cannot be captured
    bool cuda = false;
    for (int i = 0; i < nargs; ++i) cuda = cuda || args[i]->device().is_cuda();
    if (cuda && driver::is_capturing(stream))
      throw cuda_error("k::compile: a CUDA graph capture is in progress on " + Stream(stream).str() +
                       " and this call needs a new compiled program (first call, or a guard failed); "
                       "call the function once with the same shapes and dtypes before capturing (warm it first)");
  }

  static bool attrs_match(const Entry& e, const Attrs* const* attrs, int nattrs) {
    if (static_cast<int>(e.guards.attrs.size()) != nattrs) return false;
    for (int i = 0; i < nattrs; ++i)
      if (!(*attrs[i] == e.guards.attrs[i])) return false;
    return true;
  }

  // Entries for the same custom ops as these attributes: calling another k::custom_op is calling
  // another function (as another lambda would be), not a recompile of this one.
  int same_custom_ops_count(const Attrs* const* attrs, int nattrs) const {
    int count = 0;
    for (auto& e : entries_) {
      bool same = static_cast<int>(e->guards.attrs.size()) == nattrs;
      for (int i = 0; same && i < nattrs; ++i) same = e->guards.attrs[i].custom == attrs[i]->custom;
      count += same;
    }
    return count;
  }

  // Re-infers the program's graph for this call's inputs (dynamic programs only).
  static bool infer_call_shapes(const Program& p, const Tensor* const* args, CallShapes& out) {
    graph::Graph& scratch = scratch_graph();
    scratch.nodes = p.graph.nodes;
    scratch.outputs = p.graph.outputs;
    try {
      graph::infer_shapes(scratch, [&](int slot) -> const Tensor& { return *args[slot]; });
    } catch (const error&) {
      return false;
    }
    out.nodes.swap(scratch.nodes);  // no second copy of the node table on the hit path
    return true;
  }
  static graph::Graph& scratch_graph() {
    thread_local graph::Graph g;
    return g;
  }

  std::shared_ptr<const Entry> find(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                    CallShapes& shapes, std::string* why) const {
    for (auto& e : entries_) {
      if (!attrs_match(*e, attrs, nattrs)) {
        if (why) *why = "attributes (dims or view sizes) changed";
        continue;
      }
      int failed = guards::check_args(e->guards, args, static_cast<std::size_t>(nargs));
      if (failed >= 0) {
        if (why) *why = e->guards.describe_failure(failed);
        continue;
      }
      if (e->guards.dynamic) {
        if (!infer_call_shapes(*e->program, args, shapes)) continue;
        thread_local std::vector<std::int64_t> sym;
        sym.resize(std::max<std::size_t>(sym.size(), static_cast<std::size_t>(e->program->env.num_symbols()) + 1));
        int node = guards::check_shapes(e->guards, [&](int n) -> const Dims& { return shapes.nodes[n].shape; }, sym.data(),
                                        e->program->env.num_symbols());
        if (node >= 0) {
          if (why) *why = "symbolic size of node %" + std::to_string(node) + " " + e->program->graph[node].shape.str();
          continue;
        }
      } else {
        shapes.nodes.clear();
      }
      return e;
    }
    return nullptr;
  }

  template <class Build>
  std::shared_ptr<const Entry> compile(const Tensor* const* args, int nargs, const Attrs* const* attrs, int nattrs,
                                       Build& build, CallShapes& shapes) {
    if (!entries_.empty()) {
      std::string reason = last_failure_.empty() ? "no compiled program matched" : last_failure_;
      if (same_custom_ops_count(attrs, nattrs) >= opt_.recompile_limit)
        throw recompile_limit_error("k::compile: recompile limit of " + std::to_string(opt_.recompile_limit) +
                                    " reached; the last failed guard was: " + reason +
                                    " (use .shapes = k::shapes::dynamic for changing sizes)");
      reasons_.push_back(reason);
      if (debug::log_enabled(debug::Channel::recompiles)) debug::log(debug::Channel::recompiles, "recompiling: " + reason);
    }
    Device device = cpu;
    for (int i = 0; i < nargs; ++i) {
      if (i > 0 && !(args[i]->device() == device))
        throw device_error("k::compile: arguments on different devices: " + device.str() + " and " + args[i]->device().str() +
                           " (args[0] and args[" + std::to_string(i) + "])");
      device = args[i]->device();
    }
    auto arg = [&](int slot) -> const Tensor& { return *args[slot]; };
    auto e = std::make_shared<Entry>();
    graph::Graph g = build(arg, e->stats);
    ir::ShapeEnv env = make_env(g);
    std::vector<const Tensor*> argv(args, args + nargs);
    std::vector<Attrs> av;
    for (int i = 0; i < nattrs; ++i) av.push_back(*attrs[i]);
    e->guards = guards::make_guards(g, env, argv, std::move(av));
    if (debug::log_enabled(debug::Channel::guards)) {
      std::string s;
      for (auto& line : e->guards.describe()) s += "  " + line + "\n";
      debug::log(debug::Channel::guards, "guards:\n" + s);
    }
    remember_shapes(g);
    e->program = build_program(std::move(g), std::move(env), device, arg, opt_.autotune);
    e->tune = !e->program->candidates.empty();
    // Custom ops are host code: a replay would not run them again, so their programs launch plainly.
    bool custom = false;
    for (auto& k : e->program->kernels) custom = custom || (k.extern_node >= 0 && is_custom(e->program->graph[k.extern_node].op));
    if (opt_.cuda_graphs && device.is_cuda() && !custom) e->graphs = std::make_shared<GraphReplay>(*e->program);
    if (device.is_cuda()) e->pins = std::make_shared<CapturePins>();
    entries_.push_back(e);
    shapes.nodes.clear();
    if (e->guards.dynamic) infer_call_shapes(*e->program, args, shapes);
    return e;
  }

  // Static: constants. Dynamic: every size a symbol. Automatic: exact first, then the dims that
  // changed since the last compile become symbols.
  ir::ShapeEnv make_env(const graph::Graph& g) const {
    switch (opt_.shapes) {
      case shapes::static_: return ir::make_static_shape_env(g);
      case shapes::dynamic: return ir::make_shape_env(g, [](int, int) { return true; });
      case shapes::automatic: break;
    }
    if (entries_.empty() || last_shapes_.size() != static_cast<std::size_t>(g.size())) return ir::make_static_shape_env(g);
    return ir::make_shape_env(g, [&](int n, int k) {
      const Dims& before = last_shapes_[n];
      return before.size() != g[n].shape.size() || before[k] != g[n].shape[k] || changed_[n] & (1u << k);
    });
  }

  // Remembers this compile's shapes and which dims have ever changed (automatic mode).
  void remember_shapes(const graph::Graph& g) {
    bool comparable = last_shapes_.size() == static_cast<std::size_t>(g.size());
    changed_.resize(g.size(), 0);
    for (int n = 0; n < g.size(); ++n)
      for (int k = 0; comparable && k < g[n].shape.size(); ++k)
        if (last_shapes_[n].size() != g[n].shape.size() || last_shapes_[n][k] != g[n].shape[k]) changed_[n] |= 1u << k;
    last_shapes_.clear();
    for (auto& n : g.nodes) last_shapes_.push_back(n.shape);
  }

  options opt_;
  mutable std::shared_mutex mu_;
  std::vector<std::shared_ptr<const Entry>> entries_;
  std::vector<std::string> reasons_;
  std::vector<Dims> last_shapes_;
  std::vector<unsigned> changed_;
  std::string last_failure_;
};

// Runs an entry's program for one call and returns its outputs.
// With .cuda_graphs the launches replay as one CUDA graph, unless the caller is capturing the
// stream themselves: then the plain launches become part of the caller's graph.
inline void run_entry(const Entry& e, const Tensor* const* args, const double* scalars, Tensor* outputs,
                      const CallShapes& shapes, CUstream stream) {
  const Program& p = *e.program;
  const std::vector<graph::Node>& nodes = shapes.nodes.empty() ? p.graph.nodes : shapes.nodes;
  auto shape_of = [&](int n) -> const Dims& { return nodes[n].shape; };
  // Tuning times and synchronises: not inside a capture the caller is recording (a later call tunes).
  if (e.tune && !e.tuning_done.load(std::memory_order_acquire) && !(stream && driver::is_capturing(stream)))
    std::call_once(e.tuned, [&] {
      tune_program(*e.program, args, scalars, shape_of, stream);
      e.tuning_done.store(true, std::memory_order_release);
    });
  bool captured = e.pins && stream && driver::is_capturing(stream);
  if (captured) {  // recorded into the caller's graph: its intermediates must outlive this call
    std::vector<Tensor> keep;
    p.run(args, scalars, outputs, shape_of, stream, &keep);
    e.pins->add(std::move(keep));
  } else if (e.graphs && !e.graphs->disabled()) {
    e.graphs->run(args, static_cast<int>(e.guards.args.size()), scalars, outputs, shape_of, stream);
  } else {
    p.run(args, scalars, outputs, shape_of, stream);
  }
}

}  // namespace runtime
}  // namespace kiln

namespace kiln::runtime {

// Runs a hand-built graph (tests and tools that make graphs at run time, such as the random-graph
// differential test): lowers, compiles and runs it once through a private cache.
inline std::vector<Tensor> run_graph(const graph::Graph& g, const std::vector<Tensor>& args,
                                     const std::vector<double>& scalars, options o = {}, LoweringStats* stats = nullptr) {
  ProgramCache cache(o);
  std::vector<const Tensor*> argv;
  for (auto& t : args) argv.push_back(&t);
  CallShapes shapes;
  auto build = [&](auto& arg, LoweringStats& st) {
    return lower_graph(g, arg, [](graph::Graph x) { return x; }, st);
  };
  auto entry = cache.get(argv.data(), static_cast<int>(argv.size()), nullptr, 0, build, shapes);
  if (stats) *stats = entry->stats;
  std::vector<Tensor> out(g.outputs.size());
  run_entry(*entry, argv.data(), scalars.data(), out.data(), shapes, nullptr);
  return out;
}

}  // namespace kiln::runtime
