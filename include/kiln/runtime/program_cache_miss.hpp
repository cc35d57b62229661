// ProgramCache's miss path and what the hit path calls out of line: matching guards, re-inferring
// a dynamic program's shapes, compiling under the recompile limit, evicting, and the sizes that
// become symbolic. It builds and launches programs (the whole pipeline), so it is parsed only where
// the runtime is compiled (core/linkage.hpp); program_cache.hpp includes it at its end.
#pragma once
#include "launch/capture_keep.hpp"
#include "launch/cuda_graph.hpp"
#include "lower.hpp"
#include "program_cache.hpp"

namespace kiln::runtime {

KILN_DECL void ProgramCache::refuse_during_capture(const Tensor* const* args, int nargs, CUstream stream) {
  if (!stream) return;  // the legacy default stream cannot be captured
  bool cuda = false;
  for (int i = 0; i < nargs; ++i) cuda = cuda || args[i]->device().is_cuda();
  // kiln's own capture (a k::cond branch recorded into a conditional node) may compile: it is
  // relaxed, and what the program allocates is kept for the graph (launch/capture_keep.hpp).
  if (cuda && !active_capture_keep() && driver::is_capturing(stream))
    throw cuda_error("k::compile: a CUDA graph capture is in progress on " + Stream(stream).str() +
                     " and this call needs a new compiled program (first call, or a guard failed); "
                     "call the function once with the same shapes and dtypes before capturing (warm it first)");
}

KILN_DECL bool ProgramCache::infer_call_shapes(const Program& p, const Tensor* const* args, const Attrs* const* attrs,
                                               int nattrs, CallShapes& out) {
  graph::Graph& scratch = scratch_graph();
  scratch.nodes = p.graph.nodes;
  scratch.outputs = p.graph.outputs;
  for (auto& n : scratch.nodes)
    if (n.sym_attrs) {
      if (n.capture < 0 || n.capture >= nattrs) return false;
      graph::apply_symbolic(n.op, *attrs[n.capture], n.attrs);
    }
  try {
    graph::infer_shapes(scratch, [&](int slot) -> const Tensor& { return *args[slot]; });
  } catch (const error&) {
    return false;
  }
  out.nodes.swap(scratch.nodes);  // no second copy of the node table on the hit path
  return true;
}

template <class Rebuild>
void ProgramCache::guard_index_limit(Entry& e, Rebuild&& rebuild) {
  auto fill = [&] {
    auto& gs = e.guards;
    gs.index_limit = 0, gs.index_nodes.clear(), gs.index_args.clear(), gs.index_spans.clear();
    const Program& p = *e.program;
    for (const auto& k : p.kernels) {
      if (k.extern_node >= 0 || !k.src.index_bound) continue;
      gs.index_limit = codegen::index32_limit;
      for (int n : k.src.index_nodes) {
        gs.index_nodes.push_back(n);
        if (p.graph[n].op == Op::arg) gs.index_args.push_back(p.graph[n].slot);
      }
      each_twin(k, [&](const CompiledKernel& t) {
        if (t.src.index_bound) gs.index_spans.push_back(t.src.index_span);
      });
    }
    auto unique = [](std::vector<int>& v) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    };
    unique(gs.index_nodes), unique(gs.index_args);
  };
  fill();
  if (e.guards.index_limit <= 0) return;
  const auto& ex = e.program->env.example;
  for (const auto& [x, r] : e.guards.index_spans) {
    const std::int64_t xs = x.eval(ex), rs = r.eval(ex);
    if (rs > 0 && xs > (std::int64_t{1} << 31) / rs) {
      rebuild();
      fill();
      return;
    }
  }
}

KILN_DECL bool ProgramCache::matches(const Entry& e, const Tensor* const* args, int nargs, const Attrs* const* attrs,
                                     int nattrs, CallShapes& shapes, std::string* why) {
  if (!attrs_match(e, attrs, nattrs)) {
    if (why) *why = "attributes (dims or view sizes) changed";
    return false;
  }
  int failed = guards::check_args(e.guards, args, static_cast<std::size_t>(nargs));
  if (failed >= 0) {
    if (why) *why = e.guards.describe_failure(failed);
    return false;
  }
  if (e.guards.dynamic) {
    if (!infer_call_shapes(*e.program, args, attrs, nattrs, shapes)) return false;
    thread_local std::vector<std::int64_t> sym;
    sym.resize(std::max<std::size_t>(sym.size(), static_cast<std::size_t>(e.program->env.num_symbols()) + 1));
    int node = guards::check_shapes(
        e.guards, [&](int n) -> const Dims& { return shapes.nodes[n].shape; }, sym.data(),
        e.program->env.num_symbols());
    if (node >= 0) {
      if (why) *why = "symbolic size of node %" + std::to_string(node) + " " + e.program->graph[node].shape.str();
      return false;
    }
    if (!guards::within_index_limit(
            e.guards, args, static_cast<std::size_t>(nargs),
            [&](int n) -> const Dims& { return shapes.nodes[n].shape; },
            Bindings(sym.data(), static_cast<std::size_t>(e.program->env.num_symbols())))) {
      if (why) *why = "sizes past " + std::to_string(e.guards.index_limit) + " elements (kernels index in 32 bits)";
      return false;
    }
  } else {
    shapes.nodes.clear();
  }
  return true;
}

KILN_DECL std::shared_ptr<const Entry> ProgramCache::find(const Tensor* const* args, int nargs,
                                                          const Attrs* const* attrs, int nattrs,
                                                          CallShapes& shapes) const {
  // One hash of the call serves both maps unless some attributes are symbolic (then the bucket
  // key leaves their values out).
  const std::uint64_t whole = guards::call_key(args, nargs, attrs, nattrs);
  for (const auto* map : {&exact_, &buckets_}) {
    if (map->empty()) continue;
    const bool sym = map == &buckets_ && any_symbolic_ && static_cast<int>(symbolic_.size()) == nattrs;
    auto it = map->find(map == &exact_ ? guards::exact_call_key(whole, args, nargs)
                        : sym          ? key_of(args, nargs, attrs, nattrs)
                                       : whole);
    if (it == map->end()) continue;
    for (auto& e : it->second)
      if (matches(*e, args, nargs, attrs, nattrs, shapes, nullptr)) return e;
  }
  return nullptr;
}

KILN_DECL std::string ProgramCache::miss_reason(const Tensor* const* args, int nargs, const Attrs* const* attrs,
                                                int nattrs) const {
  std::string why = "no compiled program matched";
  CallShapes scratch;
  for (auto& e : entries_) matches(*e, args, nargs, attrs, nattrs, scratch, &why);
  return why;
}

KILN_DECL void ProgramCache::evict(std::size_t index) {
  std::shared_ptr<const Entry> e = entries_[index];
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(index));
  Buckets& map = map_of(*e);
  auto& bucket = map[e->key];
  bucket.erase(std::find(bucket.begin(), bucket.end(), e));
  if (bucket.empty()) map.erase(e->key);
  if (eager_) ProgramBudget::eager().removed();
  debug::log_lazy(debug::Channel::cache, [&] {
    std::string name = e->program->kernels.empty() ? "a program" : e->program->kernels.front().src.name;
    return "evicted " + name + " (least recently used of " + std::to_string(entries_.size() + 1) + " programs)";
  });
}

KILN_DECL void ProgramCache::apply_limit(const Attrs* const* attrs, int nattrs, const std::string& reason) {
  if (eager_ || same_custom_ops_count(attrs, nattrs) < opt_.recompile_limit) return;
  if (opt_.on_limit == on_limit::raise)
    throw recompile_limit_error("k::compile: recompile limit of " + std::to_string(opt_.recompile_limit) +
                                " reached; the last failed guard was: " + reason +
                                " (use .shapes = k::shapes::dynamic for changing sizes)");
  if (!generalized_) {
    generalized_ = true;
    std::string msg = "k::compile: recompile limit of " + std::to_string(opt_.recompile_limit) +
                      " reached (last failed guard: " + reason +
                      "); from now on every size is symbolic and the least recently used program is evicted "
                      "(.on_limit = k::on_limit::raise to throw instead)";
    std::fprintf(stderr, "[kiln] warning: %s\n", msg.c_str());
    debug::log_lazy(debug::Channel::recompiles, [&] { return msg; });
  }
  while (same_custom_ops_count(attrs, nattrs) >= std::max(1, opt_.recompile_limit)) evict(lru_index(nattrs, attrs));
}

KILN_DECL void ProgramCache::generalize_attrs(const Attrs* const* attrs, int nattrs, const Op* ops) {
  if (!ops || (opt_.shapes == shapes::static_ && !generalized_)) return;
  bool comparable = static_cast<int>(last_attrs_.size()) == nattrs;
  if (static_cast<int>(symbolic_.size()) != nattrs) symbolic_.assign(static_cast<std::size_t>(nattrs), 0);
  slot_ops_.assign(ops, ops + nattrs);
  bool grew = false;
  for (int i = 0; comparable && i < nattrs; ++i) {
    if (!graph::has_symbolic_attrs(ops[i])) continue;
    std::uint8_t d = graph::symbolic_difference(ops[i], last_attrs_[static_cast<std::size_t>(i)], *attrs[i]);
    if (d == 0xff || (d & ~symbolic_[static_cast<std::size_t>(i)]) == 0) continue;
    symbolic_[static_cast<std::size_t>(i)] |= d;
    grew = any_symbolic_ = true;
  }
  if (!grew) return;
  debug::log_lazy(debug::Channel::recompiles, [&] {
    int n = 0;
    for (auto b : symbolic_) n += b != 0;
    return "view attributes changed: the bounds or sizes of " + std::to_string(n) + " views are now kernel arguments";
  });
  Buckets rebuilt;  // programs with symbolic sizes, under the new mask (exact ones keep their keys)
  for (auto& e : entries_)
    if (!exact(*e)) {
      e->key = key_of(*e);
      rebuilt[e->key].push_back(e);
    }
  buckets_.swap(rebuilt);
}

KILN_DECL std::shared_ptr<const Entry> ProgramCache::compile(const Tensor* const* args, int nargs,
                                                             const Attrs* const* attrs, int nattrs, const Op* ops,
                                                             BuildRef build, CallShapes& shapes) {
  if (compiles_.load(std::memory_order_relaxed) > 0) {
    std::string reason = miss_reason(args, nargs, attrs, nattrs);
    apply_limit(attrs, nattrs, reason);
    generalize_attrs(attrs, nattrs, ops);
    reasons_.push_back(reason);
    if (reasons_.size() > 64) reasons_.pop_front();
    debug::log_lazy(debug::Channel::recompiles, [&] { return "recompiling: " + reason; });
  }
  Device device = cpu;
  for (int i = 0; i < nargs; ++i) {
    if (i > 0 && !(args[i]->device() == device))
      throw device_error("k::compile: arguments on different devices: " + device.str() + " and " +
                         args[i]->device().str() + " (args[0] and args[" + std::to_string(i) + "])");
    device = args[i]->device();
  }
  auto arg = [&](int slot) -> const Tensor& { return *args[slot]; };
  auto e = std::make_shared<Entry>();
  bool sym = static_cast<int>(symbolic_.size()) == nattrs &&
             std::any_of(symbolic_.begin(), symbolic_.end(), [](std::uint8_t b) { return b != 0; });
  e->stats.symbolic = may_be_symbolic(args, nargs);
  graph::Graph g = build(arg, e->stats, sym ? &symbolic_ : nullptr);
  ir::ShapeEnv env = make_env(g);
  std::vector<const Tensor*> argv(args, args + nargs);
  std::vector<Attrs> av;
  for (int i = 0; i < nattrs; ++i) av.push_back(*attrs[i]);
  e->guards = guards::make_guards(g, env, argv, std::move(av));
  if (sym) e->guards.symbolic = symbolic_, e->guards.ops = slot_ops_;
  e->key = file_key(*e);
  if (ops) last_attrs_.assign(e->guards.attrs.begin(), e->guards.attrs.end());
  remember_shapes(g);
  // Symbolic sizes on a GPU: kernels may index in int under a guard (guard_index_limit), or be
  // rebuilt without it from these copies.
  const bool may_bound = device.is_cuda() && env.num_symbols() > 0;
  std::optional<std::pair<graph::Graph, ir::ShapeEnv>> copy;
  if (may_bound) copy.emplace(g, env);
  e->program = build_program(std::move(g), std::move(env), device, arg, opt_.autotune, e->stats.tuning);
  guard_index_limit(*e, [&] {
    auto t = e->stats.tuning;
    t.index32 = 1;
    e->program = build_program(std::move(copy->first), std::move(copy->second), device, arg, opt_.autotune, t);
  });
  if (debug::log_enabled(debug::Channel::guards)) {
    std::string s;
    for (auto& line : e->guards.describe()) s += "  " + line + "\n";
    debug::log(debug::Channel::guards, "guards:\n" + s);
  }
  if (opt_.check_indices) e->program->check_indices = *opt_.check_indices;
  e->tune = !e->program->candidates.empty();
  // Custom ops are host code: a replay would not run them again, so their programs launch plainly,
  // unless the op declares its work capturable (k::cond: a conditional graph node).
  bool custom = false;
  for (auto& k : e->program->kernels) {
    const graph::Node* n = k.extern_node >= 0 ? &e->program->graph[k.extern_node] : nullptr;
    custom = custom || (n && is_custom(n->op) && !custom_ops::entry(n->attrs.custom).fns.capturable);
  }
  if (opt_.cuda_graphs && device.is_cuda() && !custom) e->graphs = std::make_shared<GraphReplay>(*e->program);
  if (device.is_cuda()) e->pins = std::make_shared<CapturePins>();
  e->last_used.store(lru_tick(), std::memory_order_relaxed);
  entries_.push_back(e);
  map_of(*e)[e->key].push_back(e);
  compiles_.fetch_add(1, std::memory_order_relaxed);
  if (eager_) ProgramBudget::eager().added();
  debug::log_lazy(debug::Channel::cache, [&] {
    return "compiled " +
           (e->program->kernels.empty() ? std::string("a program") : e->program->kernels.front().src.name) + " (" +
           std::to_string(entries_.size()) + " programs in this cache" +
           (eager_ ? ", " + std::to_string(ProgramBudget::eager().entries()) + " eager in all)" : ")");
  });
  shapes.nodes.clear();
  if (e->guards.dynamic) infer_call_shapes(*e->program, args, attrs, nattrs, shapes);
  return e;
}

// Whether make_env may give the next program symbolic sizes (before its graph is lowered): in the
// automatic mode, once an argument's size has changed between compiles or changes now (a dtype
// change alone keeps static sizes, and static lowering).
KILN_DECL bool ProgramCache::may_be_symbolic(const Tensor* const* args, int nargs) const {
  if (generalized_ || opt_.shapes == shapes::dynamic) return true;
  if (opt_.shapes != shapes::automatic || compiles_.load(std::memory_order_relaxed) == 0) return false;
  for (int i = 0; i < nargs && i < static_cast<int>(last_args_.size()); ++i) {
    const Dims& now = args[i]->shape();
    if (args_changed_[i] || !(now == last_args_[i])) return true;
  }
  return false;
}

KILN_DECL ir::ShapeEnv ProgramCache::make_env(const graph::Graph& g) const {
  const std::vector<std::uint32_t> chunks = schedule::chunk_count_dims(g);  // constants of the schedule
  auto all = [&](int n, int k) { return !(chunks[n] >> k & 1u); };
  if (generalized_) return ir::make_shape_env(g, all);
  switch (opt_.shapes) {
    case shapes::static_:
      return ir::make_static_shape_env(g);
    case shapes::dynamic:
      return ir::make_shape_env(g, all);
    case shapes::automatic:
      break;
  }
  if (compiles_.load(std::memory_order_relaxed) == 0) return ir::make_static_shape_env(g);
  if (last_shapes_.size() != static_cast<std::size_t>(g.size())) {
    // Another graph than the last compile's (lowered for symbolic sizes, or split otherwise): the
    // sizes of the arguments' dims that changed are symbolic wherever they occur.
    std::vector<std::int64_t> sizes;
    for (const auto& n : g.nodes) {
      if (n.op != Op::arg || n.slot < 0 || n.slot >= static_cast<int>(last_args_.size())) continue;
      const Dims& before = last_args_[static_cast<std::size_t>(n.slot)];
      for (int k = 0; k < n.shape.size(); ++k)
        if (before.size() != n.shape.size() || before[k] != n.shape[k] || args_changed_[n.slot] & (1u << k))
          sizes.push_back(n.shape[k]);
    }
    return ir::make_shape_env(g, [&](int n, int k) {
      return !(chunks[n] >> k & 1u) && std::find(sizes.begin(), sizes.end(), g[n].shape[k]) != sizes.end();
    });
  }
  return ir::make_shape_env(g, [&](int n, int k) {
    if (chunks[n] >> k & 1u) return false;
    const Dims& before = last_shapes_[n];
    return before.size() != g[n].shape.size() || before[k] != g[n].shape[k] || changed_[n] & (1u << k);
  });
}

KILN_DECL void ProgramCache::remember_shapes(const graph::Graph& g) {
  bool comparable = last_shapes_.size() == static_cast<std::size_t>(g.size());
  changed_.resize(g.size(), 0);
  for (int n = 0; n < g.size(); ++n)
    for (int k = 0; comparable && k < g[n].shape.size(); ++k)
      if (last_shapes_[n].size() != g[n].shape.size() || last_shapes_[n][k] != g[n].shape[k]) changed_[n] |= 1u << k;
  last_shapes_.clear();
  for (auto& n : g.nodes) last_shapes_.push_back(n.shape);
  for (const auto& n : g.nodes) {  // the arguments' shapes, by slot
    if (n.op != Op::arg || n.slot < 0) continue;
    const auto slot = static_cast<std::size_t>(n.slot);
    if (slot >= last_args_.size()) last_args_.resize(slot + 1), args_changed_.resize(slot + 1, 0);
    const Dims& before = last_args_[slot];
    for (int k = 0; k < n.shape.size() && before.size() == n.shape.size(); ++k)
      if (before[k] != n.shape[k]) args_changed_[slot] |= 1u << k;
    last_args_[slot] = n.shape;
  }
}

KILN_DECL std::shared_ptr<const Entry> ProgramCache::lookup(const Tensor* const* args, int nargs,
                                                            const Attrs* const* attrs, int nattrs, BuildRef build,
                                                            CallShapes& shapes_out, CUstream stream, const Op* ops) {
  {
    std::shared_lock lock(mu_);
    if (auto e = find(args, nargs, attrs, nattrs, shapes_out)) return touch(e);
  }
  std::shared_ptr<const Entry> e;
  {
    std::unique_lock lock(mu_);
    if ((e = find(args, nargs, attrs, nattrs, shapes_out))) return touch(e);  // another thread compiled it
    refuse_during_capture(args, nargs, stream);
    e = compile(args, nargs, attrs, nattrs, ops, build, shapes_out);
  }
  if (eager_) ProgramBudget::eager().trim();
  return e;
}

}  // namespace kiln::runtime
