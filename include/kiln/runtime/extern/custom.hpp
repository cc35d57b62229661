// The extern step of a custom op inside a compiled program: its inputs as contiguous buffers (a
// strided argument it reads is copied first, at lowering), its preallocated output, the program's stream, and the
// user's forward (or, for a custom_backward node, the user's backward with only the requested gradient allocated). A
// custom op's function may itself evaluate kiln expressions on the same thread, so the per-call scratch that a run
// reuses to keep the hit path allocation-free is kept per nesting level (level_local) rather than per thread.
#pragma once
#include <array>
#include <deque>
#include <span>
#include <string>

#include "../../core/stream.hpp"
#include "../../core/tensor.hpp"
#include "../../graph/graph.hpp"

namespace kiln::runtime {

// How many custom-op calls are running on this thread (0 outside any).
inline int& nesting_depth() {
  thread_local int depth = 0;
  return depth;
}

// A thread-local T for the current nesting level; Tag tells apart two scratch objects of one type.
// A deque keeps outer levels' objects in place while inner levels are added.
template <class T, int Tag = 0>
T& level_local() {
  const auto depth = static_cast<std::size_t>(nesting_depth());
  if (depth == 0) {  // the common case, on every call's hit path
    thread_local T top;
    return top;
  }
  thread_local std::deque<T> levels;  // levels 1, 2, ...
  while (levels.size() < depth) levels.emplace_back();
  return levels[depth - 1];
}

namespace detail {
struct NestedCall {
  NestedCall() { ++nesting_depth(); }
  ~NestedCall() { --nesting_depth(); }
  NestedCall(const NestedCall&) = delete;
  NestedCall& operator=(const NestedCall&) = delete;
};
}  // namespace detail

// Runs custom node n, writing `out`; buffer(node) gives the tensor of an input node.
template <class BufferOf>
void run_custom(const graph::Node& n, BufferOf&& buffer, Tensor& out, CUstream stream) {
  const custom_ops::Entry& e = custom_ops::entry(n.attrs.custom);
  std::array<Tensor, graph::max_inputs> in;
  for (int k = 0; k < n.n_in; ++k) {
    in[k] = buffer(n.in[k]);
    if (!in[k].is_contiguous())  // lowering copies strided arguments (copy_strided_custom_inputs)
      throw error(e.prefix() + "input " + std::to_string(k) + " is not contiguous");
  }
  detail::NestedCall nested;
  if (n.op == Op::custom) {
    custom_ops::call_user(e, "forward", false,
                          [&] { e.fns.forward(std::span<const Tensor>(in.data(), n.n_in), out, Stream(stream)); });
    return;
  }
  const int m = n.n_in - 1;  // the op's inputs; in[m] is the cotangent of its output
  if (!e.fns.backward) throw error(e.prefix() + "has no backward");
  std::array<Tensor, custom_ops::max_inputs> grads;
  grads[n.attrs.a] = out;
  custom_ops::call_user(e, "backward", false, [&] {
    e.fns.backward(std::span<const Tensor>(in.data(), m), in[m], std::span<Tensor>(grads.data(), m), Stream(stream));
  });
}

}  // namespace kiln::runtime
