// k::item<T>(expr): a host value read from inside a compiled function — a graph break, as Dynamo
// has them. The expression is evaluated as a segment of its own (its own program cache, guarded and
// cached like any eager expression), read back with one synchronisation, and the function goes on
// with a C++ number: typically a scalar of the expression it returns, a run-time value of that
// program, so the function still compiles once. k::explain counts the segments and names each
// break (the k::item and its source location); KILN_LOGS=graph_breaks logs each site once.
#pragma once
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "../core/source_location.hpp"
#include "api.hpp"

namespace kiln {
namespace runtime {

// Where the breaks of the calls on this thread are recorded while someone listens (k::explain).
inline std::vector<std::string>*& graph_break_listener() {
  thread_local std::vector<std::string>* listener = nullptr;
  return listener;
}

// Records a graph break: for a listener, and once per site in the graph_breaks log.
inline void note_graph_break(const std::string& reason) {
  if (auto* l = graph_break_listener()) l->push_back(reason);
  if (!debug::log_enabled(debug::Channel::graph_breaks)) return;
  static std::mutex m;
  static std::set<std::string> logged;
  {
    std::lock_guard lock(m);
    if (!logged.insert(reason).second) return;
  }
  debug::log(debug::Channel::graph_breaks, "graph break: " + reason);
}

inline std::string source_site(const kiln::source_location& at) {
  std::string file = at.file_name();
  if (auto slash = file.find_last_of('/'); slash != std::string::npos) file = file.substr(slash + 1);
  return file + ":" + std::to_string(at.line());
}

}  // namespace runtime

namespace detail {
// The program cache of one k::item expression type.
template <class E>
runtime::ProgramCache& item_cache() {
  static runtime::ProgramCache cache({}, runtime::CacheKind::eager);
  return cache;
}
}  // namespace detail

// The one element of `e` as a T (bool, an integer or a floating type), read on the host. Inside a
// compiled function, `e` may use the function's arguments.
template <class T, class E>
requires Expr<E> || std::is_same_v<std::remove_cvref_t<E>, Tensor> T
item(const E& e, kiln::source_location at = kiln::source_location::current()) {
  static_assert(std::is_arithmetic_v<T>, "k::item<T>: T must be bool, an integer or a floating-point type");
  Tensor value;
  if constexpr (std::is_same_v<std::remove_cvref_t<E>, Tensor>) {
    value = e;
  } else {
    static_assert(graph::Counts<E>::max_arg < expr::structure_arg_base,  // k::structure's placeholders
                  "k::structure: the function reads a host value with k::item, so it has no single structure (it "
                  "runs as several compiled segments, which k::explain shows)");
    // The function's tensors that the expression uses, by argument index.
    constexpr int nargs = graph::Counts<E>::max_arg + 1;
    graph::Captured bound;
    graph::gather(e, bound);
    // Arguments the expression does not use have no node; a used one stands in for them (same
    // device, and a key that changes only when that argument does).
    std::array<const Tensor*, static_cast<std::size_t>(nargs)> args{};
    const Tensor* some = nullptr;
    for (const Tensor* t : bound.bound) some = some ? some : t;
    for (int i = 0; i < nargs; ++i) {
      const std::size_t s = static_cast<std::size_t>(i);
      args[s] = s < bound.bound.size() && bound.bound[s] ? bound.bound[s] : some;
      if (!args[s])
        throw error("k::item: the expression's arguments are not bound to tensors (" + runtime::source_site(at) + ")");
    }
    value = detail::evaluate<1>(detail::item_cache<E>(), detail::Identity{}, e, args, nullptr, nullptr)[0];
  }
  if (value.numel() != 1)
    throw shape_error("k::item: the expression has shape " + value.shape().str() + " (" +
                      std::to_string(value.numel()) + " elements); k::item reads one (" + runtime::source_site(at) +
                      ")");
  runtime::note_graph_break("k::item<" + std::string(name(value.dtype())) + "> at " + runtime::source_site(at) +
                            " (in " + at.function_name() + ")");
  Tensor host = value.to(cpu);
  double v = load_as_double(host.data_ptr(), host.dtype(), 0);
  if constexpr (std::is_same_v<T, bool>)
    return v != 0;
  else
    return static_cast<T>(v);
}

}  // namespace kiln
