// How a program treats its arguments, as passes of the lowering (runtime/lower.hpp): values that
// k::assign stores into an argument in place (and what must then be copied or refused), arguments
// that custom ops and other extern steps read as whole contiguous buffers, and the check that no
// step reads an argument after the step that updates it.
#pragma once
#include <string>
#include <vector>

#include "../graph/graph.hpp"
#include "launch/program.hpp"

namespace kiln::runtime {

// How node `out` reads argument `slot` when its value is stored into that argument in place:
// 0 not at all or element by element (each element read before it is written: pointwise chains,
// reshapes, rows reduced by the kernel that stores them); 1 by an extern step storing `out` itself
// (a matmul or attention reading the argument while writing it); 2 at other positions in the
// kernel that stores it (through a permute, expand, slice or index). Reductions and earlier extern
// steps are boundaries: their values are complete before the storing kernel runs.
inline int assigned_read(const graph::Graph& g, int out, int slot) {
  auto moves = [](const graph::Node& n) {
    const OpClass c = info(n.op).cls;
    return (c == OpClass::view && n.op != Op::reshape) || c == OpClass::index;
  };
  std::vector<char> seen(static_cast<std::size_t>(g.size()) * 2, 0);
  std::vector<std::pair<int, bool>> stack{{out, false}};  // a node, reached through a moving op
  const bool extern_out = info(g[out].op).cls == OpClass::extern_;
  while (!stack.empty()) {
    auto [i, moved] = stack.back();
    stack.pop_back();
    if (std::exchange(seen[static_cast<std::size_t>(i) * 2 + moved], 1)) continue;
    const graph::Node& n = g[i];
    if (n.op == Op::arg) {
      if (n.slot == slot && (extern_out || moved)) return extern_out ? 1 : 2;
      continue;
    }
    if (i != out && (is_reduction(n.op) || info(n.op).cls == OpClass::extern_)) continue;
    if (info(n.op).cls == OpClass::meta) continue;  // reads a shape, not the values
    // An extern step reads its operands' buffers: what they were computed from is complete.
    if (extern_out && i != out && info(n.op).cls != OpClass::view) continue;
    for (int k = 0; k < n.n_in; ++k) stack.push_back({n.in[k], moved || moves(n)});
  }
  return 0;
}

// k::assign(a, expr): expr must have a's shape; its value is cast to a's dtype on store. A value an
// extern step computes while reading a goes through a copy; one a kernel computes from a's elements
// at other positions (a transpose of a) is an error: storing it in place would overwrite elements
// still to be read.
template <class ArgAt>
void write_into_arguments(graph::Graph& g, ArgAt&& arg) {
  for (std::size_t o = 0; o < g.outputs.size(); ++o) {
    int slot = g.output_into[o];
    if (slot < 0) continue;
    const Tensor& a = arg(slot);
    const graph::Node& n = g[g.outputs[o]];
    if (!(n.shape == a.shape()))
      throw shape_error("k::assign: the value has shape " + n.shape.str() + " but argument " + std::to_string(slot) +
                        " has shape " + a.shape().str());
    if (!a.is_contiguous()) throw shape_error("k::assign: argument " + std::to_string(slot) + " must be contiguous");
    const int reads = n.op == Op::arg ? 0 : assigned_read(g, g.outputs[o], slot);
    if (reads == 2)
      throw error("k::assign: the value written into argument " + std::to_string(slot) +
                  " reads that argument at other positions (through a transpose, slice, broadcast or gather), so "
                  "storing it in place would overwrite elements still to be read; return the value instead");
    // A custom op writes through its own pointers, maybe while reading the argument; an extern step
    // reading the argument it stores into: into a copy.
    if (n.dt != a.dtype() || n.op == Op::arg || is_custom(n.op) || reads == 1) {
      Attrs at;
      at.dt = a.dtype();
      graph::Node c;
      c.op = Op::cast;
      c.in[c.n_in++] = g.outputs[o];
      c.attrs = at;
      c.shape = n.shape;
      c.dt = a.dtype();
      g.nodes.push_back(c);  // not through add(): a same-dtype cast here is a real copy
      g.outputs[o] = g.size() - 1;
    }
  }
}

// A custom op reads whole contiguous buffers: each strided argument it reads is copied first (a cast
// to its own dtype, which the scheduler materialises like any input of a custom op). The guards
// pin every argument's layout, so the choice holds for the program's lifetime.
template <class ArgAt>
graph::Graph copy_strided_custom_inputs(const graph::Graph& g, ArgAt&& arg) {
  auto strided = [&](const graph::Node& x) { return x.op == Op::arg && !arg(x.slot).is_contiguous(); };
  bool any = false;
  auto whole = reads_whole_buffers;
  for (const auto& n : g.nodes)
    for (int k = 0; whole(n.op) && k < n.n_in; ++k) any = any || strided(g[n.in[k]]);
  if (!any) return g;
  return rewrite::rebuild_graph(g, [&](rewrite::Builder& b, const graph::Node& n, const int* in) {
    if (n.op == Op::constant) return b.constant(n.value);
    if (!whole(n.op)) return b.rebuild(n, in);
    std::array<int, graph::max_inputs> copied{};
    for (int k = 0; k < n.n_in; ++k) {
      Attrs same;
      same.dt = b.dt(in[k]);
      copied[k] = strided(b[in[k]]) ? b.op(Op::cast, {in[k]}, same) : in[k];
    }
    return b.rebuild(n, copied.data());
  });
}

// An argument updated by k::assign must not be read by a kernel that runs after the update.
// (Generated kernels read the arguments among their parameters; extern steps, such as a GEMM,
// their inputs' buffers, through views.)
inline void check_assign_order(const graph::Graph& g, const Program& p) {
  auto extern_reads = [&](int node, int slot) {
    const graph::Node& n = g[node];
    for (int k = 0; k < n.n_in; ++k) {
      int x = n.in[k];
      while (info(g[x].op).cls == OpClass::view) x = g[x].in[0];
      if (g[x].op == Op::arg && g[x].slot == slot) return true;
    }
    return false;
  };
  for (std::size_t o = 0; o < g.outputs.size(); ++o) {
    int slot = o < g.output_into.size() ? g.output_into[o] : -1;
    if (slot < 0) continue;
    int writer = p.sched.kernel_of[g.outputs[o]];
    for (int k = writer + 1; k < static_cast<int>(p.kernels.size()); ++k) {
      bool reads = p.kernels[k].extern_node >= 0 && extern_reads(p.kernels[k].extern_node, slot);
      for (const auto& prm : p.kernels[k].src.params)
        reads = reads || (prm.kind == codegen::Param::in_ptr && g[prm.ref].op == Op::arg && g[prm.ref].slot == slot);
      if (reads)
        throw error("k::assign: argument " + std::to_string(slot) + " is updated by " + p.kernels[writer].src.name +
                    " but read afterwards by " + p.kernels[k].src.name +
                    "; return the new value instead of assigning it");
    }
  }
}

}  // namespace kiln::runtime
