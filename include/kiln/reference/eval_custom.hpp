// The oracle's custom ops: the user's own functions on CPU tensors. Split from eval_node.hpp.
#pragma once
#include <array>
#include <span>

#include "../core/tensor.hpp"
#include "../expr/custom_op.hpp"
#include "../graph/graph.hpp"
#include "value.hpp"

namespace kiln::reference::detail {

// A custom op: the user's forward (or backward) on CPU tensors of the nodes' dtypes, read back into
// f64. The oracle trusts the user's function: it is the definition of the op.
inline Value eval_custom(const graph::Node& n, std::span<const Value* const> ins) {
  std::array<Tensor, graph::max_inputs> in;
  for (std::size_t k = 0; k < ins.size(); ++k) {
    in[k] = Tensor::empty(ins[k]->shape, ins[k]->dt, cpu);
    for (std::size_t j = 0; j < ins[k]->data.size(); ++j)
      store_from_double(in[k].data_ptr(), ins[k]->dt, static_cast<std::int64_t>(j), ins[k]->data[j]);
  }
  Tensor out = Tensor::empty(n.shape, n.dt, cpu);
  const custom_ops::Entry& e = custom_ops::entry(n.attrs.custom);
  if (n.op == Op::custom) {
    custom_ops::call_user(e, "forward", false,
                          [&] { e.fns.forward(std::span<const Tensor>(in.data(), ins.size()), out, Stream{}); });
  } else {
    const std::size_t m = ins.size() - 1;  // in[m]: the cotangent of the op's output
    if (!e.fns.backward) throw error(e.prefix() + "has no backward");
    std::array<Tensor, custom_ops::max_inputs> grads;
    grads[static_cast<std::size_t>(n.attrs.a)] = out;
    custom_ops::call_user(e, "backward", false, [&] {
      e.fns.backward(std::span<const Tensor>(in.data(), m), in[m], std::span<Tensor>(grads.data(), m), Stream{});
    });
  }
  Value v = make_value(n.shape, n.dt);
  v.data = read_values(out);
  return v;
}

}  // namespace kiln::reference::detail
