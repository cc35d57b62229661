// k::explain: what kiln made of a function or an expression — op counts before and after
// decomposition, the kernels with their kinds, fused ops and block programs, the guards and the
// recompiles — and k::cubin, which compiles one kernel with NVRTC (no GPU needed).
#pragma once
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/item.hpp"

namespace kiln {

struct kernel_info {
  std::string name;
  std::string kind;  // "poi" "per" "red" "split" "extern"
  std::vector<std::string> fused_ops;
  std::string source;  // the block program; for a matmul step, the library call it makes
};

struct report {
  int ops_captured = 0;
  int ops_decomposed = 0;
  std::vector<kernel_info> kernels;
  std::vector<std::string> guards;
  int recompiles = 0;
  std::vector<std::string> recompile_reasons;
  int graphs = 1;                         // compiled segments: 1 without graph breaks
  std::vector<std::string> graph_breaks;  // a reason each (the k::item and where it is)

  friend std::ostream& operator<<(std::ostream& os, const report& r) {
    os << "kiln report: " << r.ops_captured << " ops captured, " << r.ops_decomposed << " after decomposition, "
       << r.kernels.size() << " kernel" << (r.kernels.size() == 1 ? "" : "s") << ", " << r.recompiles << " recompile"
       << (r.recompiles == 1 ? "" : "s") << "\n";
    for (const auto& k : r.kernels) {
      os << "  " << k.name << " [" << k.kind << "]:";
      for (const auto& op : k.fused_ops) os << " " << op;
      if (k.kind == "extern" && !k.source.empty()) os << " -- " << k.source;
      os << "\n";
    }
    os << "  guards:\n";
    for (const auto& g : r.guards) os << "    " << g << "\n";
    for (const auto& why : r.recompile_reasons) os << "  recompiled because: " << why << "\n";
    if (!r.graph_breaks.empty()) os << "  " << r.graphs << " graphs; graph breaks:\n";
    for (const auto& why : r.graph_breaks) os << "    " << why << "\n";
    return os;
  }
};

namespace detail {
// An entry point (core/linkage.hpp).
KILN_DECL report make_report(const runtime::Entry& e, const runtime::ProgramCache& cache);
#if KILN_DEFINITIONS
KILN_DECL report make_report(const runtime::Entry& e, const runtime::ProgramCache& cache) {
  report r;
  r.ops_captured = e.stats.ops_captured;
  r.ops_decomposed = e.stats.ops_decomposed;
  const runtime::Program& p = *e.program;
  for (const auto& k : p.kernels) {
    kernel_info ki{k.src.name, schedule::kind_name(k.src.kind), {}, k.src.source};
    if (k.extern_node >= 0 && p.graph[k.extern_node].op == Op::matmul)
      ki.source = runtime::describe_matmul_step(p.graph, p.env, k.extern_node,
                                                k.epilogue >= 0 ? &p.sched.epilogues[k.epilogue] : nullptr);
    if (k.extern_node >= 0 && (p.graph[k.extern_node].op == Op::attention_flash ||
                               p.graph[k.extern_node].op == Op::attention_lse ||
                               p.graph[k.extern_node].op == Op::attention_grad))
      ki.source = runtime::describe_attention_step(p.graph, k.extern_node);
    for (const auto& op : k.src.fused_ops)
      if (std::find(ki.fused_ops.begin(), ki.fused_ops.end(), op) == ki.fused_ops.end()) ki.fused_ops.push_back(op);
    r.kernels.push_back(std::move(ki));
  }
  r.guards = e.guards.describe();
  r.recompiles = cache.recompiles();
  r.recompile_reasons = cache.recompile_reasons();
  return r;
}
#endif
}  // namespace detail

// Runs a compiled function on these arguments (compiling if needed) and reports on its program.
// Its graph breaks (k::item) are those of this call: each is a segment of its own.
template <class F, class... T>
report explain(const Function<F>& f, const T&... args) {
  std::shared_ptr<const runtime::Entry> used;
  std::vector<std::string> breaks;
  auto* outer = std::exchange(runtime::graph_break_listener(), &breaks);
  try {
    f.call_reporting(Stream{}, &used, args...);
  } catch (...) {
    runtime::graph_break_listener() = outer;
    throw;
  }
  runtime::graph_break_listener() = outer;
  report r = detail::make_report(*used, f.cache());
  r.graphs = 1 + static_cast<int>(breaks.size());
  r.graph_breaks = std::move(breaks);
  return r;
}

// A plain function object: compiled for the occasion.
template <class F, class... T>
requires(!Expr<F>) report explain(const F& fn, const T&... args) { return explain(compile(fn), args...); }

// An eager expression.
template <Expr E>
report explain(const E& e) {
  std::shared_ptr<const runtime::Entry> used;
  detail::evaluate<1>(detail::eager_cache<E>(), detail::Identity{}, e, std::array<const Tensor*, 0>{}, nullptr, nullptr,
                      &used);
  return detail::make_report(*used, detail::eager_cache<E>());
}

// Compiles one kernel's CUDA translation unit with NVRTC and returns the binary (no GPU needed).
// An entry point (core/linkage.hpp).
KILN_DECL std::vector<char> cubin(const kernel_info& k, const std::string& arch = "sm_90a");
#if KILN_DEFINITIONS
KILN_DECL std::vector<char> cubin(const kernel_info& k, const std::string& arch) {
  if (k.kind == "extern") throw error("k::cubin: " + k.name + " is a library call (extern), not a generated kernel");
  std::string tu = "#define KILN_HALF 1\n" + std::string(codegen::prelude) + sym_c_helpers + "\n" + k.source;
  return runtime::compile_cubin(tu, k.name, arch);
}
#endif

}  // namespace kiln
