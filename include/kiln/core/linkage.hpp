// Header-only or compiled once: the runtime's entry points and how they are linked.
//
// By default kiln is header-only: every TU that calls k::compile emits the whole runtime pipeline
// (inference, rewrites, fusion, codegen, launch) again, about 17 s of g++ -O2 a TU. A program that
// defines KILN_SEPARATE_COMPILATION in every TU (the CMake target kiln::compiled does) and includes
// <kiln/src.hpp> in exactly one .cpp file compiles the pipeline there only, as Asio's
// ASIO_SEPARATE_COMPILATION does: the other TUs see the entry points as declarations.
//
// An entry point is a non-template function that user-facing templates call and behind which the
// pipeline sits: ProgramCache::lookup (the cache's hit and miss paths), lower_graph, run_entry,
// autodiff::differentiate_at_run_time, explain's make_report, the oracle's infer_and_eval, export's
// export_lowered, gradcheck's check_graph, k::cond's branch_spec_of and record_node, k::cubin,
// k::eval(out, expr)'s check_preset_output, and in separate mode k::save / k::load (<kiln/src.hpp>
// includes every header that has one). Each is written:
//   KILN_DECL void run_entry(...);          // the declaration every TU sees
//   #if KILN_DEFINITIONS
//   KILN_DECL void run_entry(...) { ... }   // the definition: header-only, or <kiln/src.hpp>
//   #endif
// The headers the definitions need (fusion, codegen, the lowering driver, launches, the JSON
// reader) are included under `#if KILN_DEFINITIONS` too, and types user templates only hold (a
// compiled Program) are declared, so a user TU in separate mode parses less than half of what a
// header-only one does. Code that reaches into the internals includes <kiln/pipeline.hpp>.
// Mixing the two modes in one program breaks the one-definition rule: define the macro everywhere.
#pragma once
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

#ifdef KILN_SEPARATE_COMPILATION
#define KILN_DECL
#ifdef KILN_SOURCE
#define KILN_DEFINITIONS 1
#else
#define KILN_DEFINITIONS 0
#endif
#else
#define KILN_DECL inline
#define KILN_DEFINITIONS 1
#endif

namespace kiln {

template <class Signature>
class FunctionRef;

// A non-owning reference to a callable, as C++26's std::function_ref: how the entry points take
// the callables of user-facing templates (a graph builder, an argument accessor) without being
// templates themselves. The callable must outlive the call it is passed to.
template <class R, class... A>
class FunctionRef<R(A...)> {
  // A callable returning a value where R is a reference would hand back a reference to a temporary.
  template <class F>
  static constexpr bool binds = !std::is_reference_v<R> || std::is_reference_v<std::invoke_result_t<F&, A...>>;

 public:
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, FunctionRef> && std::is_object_v<std::remove_reference_t<F>> &&
             std::is_invocable_r_v<R, F&, A...> && binds<F>)
  FunctionRef(F&& f) noexcept  // NOLINT: implicit, as a callable argument converts
      : object_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* o, A... a) -> R {
          return std::invoke(*static_cast<std::remove_reference_t<F>*>(o), std::forward<A>(a)...);
        }) {}
  R operator()(A... a) const { return call_(object_, std::forward<A>(a)...); }

 private:
  void* object_;
  R (*call_)(void*, A...);
};

}  // namespace kiln
