// k::cond(pred, true_fn, false_fn, operands...): a data-dependent branch kept inside one program, as
// torch.cond is. Both branches are traced from their types and compiled (each a program cache of
// its own, guarded and cached as any compiled function); the cond itself is one opaque node of the
// graph, built on the custom-op machinery: shape inference checks that the branches agree, the
// scheduler makes it an extern step and a fusion barrier, and the derivative is the taken branch's
// vjp. Only the taken branch runs.
//
// Under `.cuda_graphs` on CUDA the node is a conditional graph node (launch/cond_node.hpp): a kernel
// sets its handle from the predicate on the device, both branches are captured into its bodies, and
// the whole step stays one graph replay with no host synchronisation. Elsewhere the predicate is
// read on the host (one synchronisation, reported by k::explain as a graph break). Where conditional
// nodes are unavailable (driver older than 12.3, no nvJitLink or libcudadevrt.a) a `.cuda_graphs`
// program says why once on stderr and falls back to plain launches with the host read; a capture
// the caller records gets a k::error naming k::cond.
#pragma once
#include <array>
#include <cstddef>
#include <cstdio>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../autodiff/grad.hpp"
#include "../core/linkage.hpp"
#include "../expr/custom_op.hpp"
#include "../graph/infer.hpp"
#include "api.hpp"
#include "item.hpp"
#if KILN_DEFINITIONS  // conditional graph nodes: only where the runtime is compiled (core/linkage.hpp)
#include "launch/capture_keep.hpp"
#include "launch/cond_node.hpp"
#endif

namespace kiln {
namespace detail::cond {

// The captured graph of branch Fn over N operand placeholders (flattened once per branch type).
template <class Fn, int N>
const graph::Graph& branch_graph() {
  static const graph::Graph g = []<std::size_t... I>(std::index_sequence<I...>) {
    return graph::flatten_result(N, trace(Fn{}, expr::Arg<static_cast<int>(I)>{}...));
  }(std::make_index_sequence<N>{});
  return g;
}

// What a branch's graph `g`, over n operand placeholders, gives for operands of these shapes and
// dtypes. An entry point (core/linkage.hpp): shape inference is compiled where the runtime is.
KILN_DECL TensorSpec branch_spec_of(graph::Graph g, int n, const char* which, std::span<const TensorSpec> operands);
#if KILN_DEFINITIONS
KILN_DECL TensorSpec branch_spec_of(graph::Graph g, int n, const char* which, std::span<const TensorSpec> operands) {
  if (g.num_args > n)
    throw error(std::string("k::cond: the ") + which +
                " branch reads tensors that are not its operands; pass them to k::cond as operands");
  graph::infer_shapes_with(g, [&](graph::Node& node) {
    node.shape = operands[static_cast<std::size_t>(node.slot)].shape;
    node.dt = operands[static_cast<std::size_t>(node.slot)].dtype;
  });
  const graph::Node& out = g[g.outputs[0]];
  return {out.shape, out.dt};
}
#endif

// What branch Fn gives for operands of these shapes and dtypes.
template <class Fn, int N>
TensorSpec branch_spec(const char* which, std::span<const TensorSpec> operands) {
  return branch_spec_of(branch_graph<Fn, N>(), N, which, operands);
}

inline std::string spec_str(const TensorSpec& s) { return s.shape.str() + " " + std::string(name(s.dtype)); }

// The shape rule of the cond node: a one-element boolean predicate, branches that agree.
template <class TF, class FF, int N>
TensorSpec infer(std::span<const TensorSpec> in) {
  const TensorSpec& pred = in[0];
  if (pred.shape.product() != 1)
    throw shape_error("k::cond: the predicate has shape " + pred.shape.str() + "; it must hold one element");
  if (pred.dtype != kiln::dtype::boolean)
    throw dtype_error("k::cond: the predicate has dtype " + std::string(name(pred.dtype)) +
                      "; it must be bool (a comparison such as k::sum(x) > 0)");
  TensorSpec t = branch_spec<TF, N>("true", in.subspan(1)), f = branch_spec<FF, N>("false", in.subspan(1));
  if (!(t.shape == f.shape))
    throw shape_error("k::cond: the true branch gives " + spec_str(t) + " and the false branch " + spec_str(f) +
                      "; both branches must give the same shape");
  if (t.dtype != f.dtype)
    throw dtype_error("k::cond: the true branch gives " + spec_str(t) + " and the false branch " + spec_str(f) +
                      "; both branches must give the same dtype");
  return t;
}

// The predicate, read on the host after the work queued on s (one synchronisation).
inline bool read_predicate(const Tensor& pred, Stream s) {
  if (pred.device().is_cuda() && s.handle() && driver::is_capturing(s.handle()))
    throw error(
        "k::cond reads its predicate on the host, which a CUDA graph capture cannot record: run the "
        "function uncaptured (a .cuda_graphs program falls back to plain launches by itself)");
  runtime::note_graph_break("k::cond: the predicate is read on the host (one synchronisation)");
  Tensor host = pred.to(cpu, s);
  return load_as_double(host.data_ptr(), host.dtype(), 0) != 0;
}

// Runs compiled function f on `inputs`, writing its one output into `out` on stream s.
template <class F, std::size_t... I>
void run_into(const Function<F>& f, std::span<const Tensor> inputs, Tensor& out, Stream s,
              std::index_sequence<I...>) {
  auto e = f.trace_with(inputs[I]...);
  std::array<const Tensor*, sizeof...(I)> argv{&inputs[I]...};
  Tensor got = detail::evaluate<1>(f.cache(), f.fn(), e, argv, &out, s.handle())[0];
  if (got.data_ptr() == out.data_ptr()) return;
  // A result that is one of the inputs (a branch `return x;`, a gradient that is the cotangent)
  // or a view of one comes back as that tensor: copied into the node's buffer on s (a strided view
  // by a kernel that reads it in place: no temporary, which a graph capture would have to keep).
  if (got.is_contiguous())
    memory::copy(out.data_ptr(), out.device(), got.data_ptr(), got.device(), out.nbytes(), s.handle());
  else
    kiln::eval(out, expr::TensorLeaf{{}, got} * 1, s);
}

// Whether the node is recorded as a conditional graph node: s is being captured by kiln itself
// (GraphReplay) and the device can hold one. When it cannot, says why once. An entry point
// (core/linkage.hpp), as record_node is.
KILN_DECL bool record_as_node(const Tensor& pred, Stream s);
// Records the conditional node on s (launch/cond_node.hpp): if_true(stream) where pred holds,
// else if_false(stream), both captured now.
using BranchRef = FunctionRef<void(CUstream)>;
KILN_DECL void record_node(const Tensor& pred, CUstream s, BranchRef if_true, BranchRef if_false);
#if KILN_DEFINITIONS
KILN_DECL bool record_as_node(const Tensor& pred, Stream s) {
  if (!pred.device().is_cuda() || !s.handle() || !runtime::active_capture_keep() || !driver::is_capturing(s.handle()))
    return false;
  const std::string& why = runtime::cond_node::unavailable(pred.device().index);
  if (why.empty()) return true;
  static std::once_flag said;
  std::call_once(said, [&] {
    std::string line = "kiln: k::cond under .cuda_graphs runs as plain launches with a host read of the "
                       "predicate: no conditional graph nodes here (" + why + ")";
    std::fprintf(stderr, "%s\n", line.c_str());
    debug::log(debug::Channel::graph_breaks, line);
  });
  return false;
}
KILN_DECL void record_node(const Tensor& pred, CUstream s, BranchRef if_true, BranchRef if_false) {
  runtime::cond_node::record(pred, s, if_true, if_false);
}
#endif

template <class Fn>
const Function<Fn>& compiled() {
  static const Function<Fn> f = compile(Fn{});
  return f;
}

template <class TF, class FF, int N>
void forward(std::span<const Tensor> in, Tensor& out, Stream s) {
  auto branch = [&](const auto& f) {
    return [&, fn = &f](CUstream on) {
      run_into(*fn, in.subspan(1), out, Stream(on), std::make_index_sequence<N>{});
    };
  };
  if (record_as_node(in[0], s))
    record_node(in[0], s.handle(), branch(compiled<TF>()), branch(compiled<FF>()));
  else if (read_predicate(in[0], s))
    branch(compiled<TF>())(s.handle());
  else
    branch(compiled<FF>())(s.handle());
}

// The gradient of operand J: the taken branch's vjp, evaluated on the operands and the cotangent.
template <class TF, class FF, int N, int J>
void backward_of(bool taken, std::span<const Tensor> vjp_in, Tensor& grad, Stream s) {
  constexpr auto inputs = std::make_index_sequence<N + 1>{};
  if (taken)
    run_into(compiled<GradFn<TF, autodiff::Mode::vjp, J>>(), vjp_in, grad, s, inputs);
  else
    run_into(compiled<GradFn<FF, autodiff::Mode::vjp, J>>(), vjp_in, grad, s, inputs);
}

template <class TF, class FF, int N>
void backward(std::span<const Tensor> in, const Tensor& grad_out, std::span<Tensor> grad_in, Stream s) {
  std::array<Tensor, N + 1> vjp_in;  // the operands, then the cotangent
  for (int k = 0; k < N; ++k) vjp_in[static_cast<std::size_t>(k)] = in[static_cast<std::size_t>(k) + 1];
  vjp_in[N] = grad_out;
  auto grads = [&](bool taken) {  // the requested gradients through one branch
    return [&, taken](CUstream on) {
      [&]<int... J>(std::integer_sequence<int, J...>) {
        ((grad_in[J + 1].defined() ? backward_of<TF, FF, N, J>(taken, vjp_in, grad_in[J + 1], Stream(on)) : void()),
         ...);
      }(std::make_integer_sequence<int, N>{});
    };
  };
  if (record_as_node(in[0], s))
    record_node(in[0], s.handle(), grads(true), grads(false));
  else
    grads(read_predicate(in[0], s))(s.handle());
}

// The node kind of one (true_fn, false_fn, operand count): registered once, so that every call of
// one k::cond carries the same id and replays the same programs.
template <class TF, class FF, int N>
const CustomOp& op() {
  static const CustomOp o = custom_op("k::cond", {.inputs = N + 1,
                                                 .infer = &infer<TF, FF, N>,
                                                 .forward = &forward<TF, FF, N>,
                                                 .backward = &backward<TF, FF, N>,
                                                 .capturable = true});
  return o;
}

}  // namespace detail::cond

// The value of true_fn(operands...) where the one-element boolean `pred` holds, else of
// false_fn(operands...). Branches are capture-less lambdas (or empty function objects) of the
// operands returning one expression of the same shape and dtype; both are compiled, only the taken
// one runs, and gradients flow to the operands through the taken branch.
template <class P, class TF, class FF, class... X>
auto cond(const P& pred, TF, FF, const X&... operands) {
  constexpr bool stateless = std::is_empty_v<TF> && std::is_empty_v<FF> && std::is_default_constructible_v<TF> &&
                             std::is_default_constructible_v<FF>;
  constexpr bool counted = sizeof...(X) >= 1 && sizeof...(X) < custom_ops::max_inputs;
  constexpr bool tensors = (Expr<P> || std::is_same_v<P, Tensor>)&&((Expr<X> || std::is_same_v<X, Tensor>)&&...);
  static_assert(stateless, "k::cond's branches are capture-less lambdas: pass the tensors they need as operands");
  static_assert(!stateless || counted, "k::cond takes 1 to 6 operands after the two branches");
  static_assert(!stateless || !counted || tensors, "k::cond's predicate and operands are tensors or expressions");
  if constexpr (stateless && counted && tensors)
    return detail::cond::op<TF, FF, static_cast<int>(sizeof...(X))>()(pred, operands...);
  else
    return expr::Arg<0>{};  // after the assertion: no second error
}

}  // namespace kiln
