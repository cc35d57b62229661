// Fusion: decides which nodes get a buffer and groups the rest into kernels. Pointwise ops and
// views are inlined into their consumers; reductions over the same rows share one row kernel with
// their pointwise prologues and epilogues (softmax and layer_norm forward become one kernel);
// independent outputs of one shape share one pointwise kernel; matmul and custom ops are extern
// calls (fusion barriers) that read and write buffers. A matmul whose bias and activation were
// chosen as a library epilogue (schedule/epilogue.hpp chooses them) is one extern step with them.
#pragma once
#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "../graph/infer.hpp"
#include "attention_lse.hpp"
#include "epilogue.hpp"
#include "plan.hpp"
#include "reorder.hpp"
#include "row_reads.hpp"

namespace kiln::schedule {

namespace detail {

inline Dims reduce_dims_of(const graph::Node& n, int rank) {
  // Marked then listed: ascending and without repeats, with no sort over the fixed-capacity Dims.
  std::vector<bool> reduced(rank, n.attrs.all);
  for (auto d : n.attrs.dims) reduced[d < 0 ? d + rank : d] = true;
  Dims out;
  for (int i = 0; i < rank; ++i)
    if (reduced[i]) out.push_back(i);
  return out;
}

// The kept shape of a row domain, without and with the reduced dims kept as 1.
inline Dims kept_shape(const Dims& p, const Dims& rd, bool keepdim) {
  return graph::detail::reduced_shape(p, rd, keepdim);
}

// The buffer a matmul reads for an operand: a transpose is read through its strides (the library
// takes transposed operands), a reshape of a computed value as a view of its (contiguous) buffer —
// so that `reshape(layer_norm(x), {B * T, d})` is stored by the norm's own kernel —, and a
// transpose of such a reshape both ways; anything else is materialised first. (An argument may be
// strided: its reshape is not always a view.)
inline int matmul_operand(const graph::Graph& g, int node) {
  const auto& n = g[node];
  if (n.op == Op::permute && n.shape.size() >= 2 && n.attrs.dims[n.shape.size() - 1] == n.shape.size() - 2)
    node = n.in[0];
  if (g[node].op == Op::reshape && !g[node].attrs.keepdim && g[g[node].in[0]].op != Op::arg) node = g[node].in[0];
  return node;
}

// Leaves, and the values computed from a shape alone (numel, iota_of): nothing they read is loaded.
inline bool is_leaf(const graph::Node& n) { return info(n.op).cls == OpClass::leaf || info(n.op).cls == OpClass::meta; }

inline bool is_extern(Op op) { return info(op).cls == OpClass::extern_; }

// Nodes whose value must live in memory: outputs, reductions, extern calls and their operands;
// with a matmul epilogue, what the step stores and its bias instead of the product.
inline std::vector<bool> find_anchors(const graph::Graph& g, const std::vector<MatmulEpilogue>& epilogues = {}) {
  std::vector<bool> anchor(g.size(), false);
  for (int o : g.outputs) anchor[o] = g[o].op != Op::arg;
  for (int i = 0; i < g.size(); ++i) {
    const auto& n = g[i];
    if (is_reduction(n.op) || is_extern(n.op)) anchor[i] = true;
    // (a shape_of input is read for its shape: embedding_backward's rows; a fused attention's scale
    // is a launch argument taken from the call's scalars, not a buffer)
    for (int k = 0; reads_whole_buffers(n.op) && k < n.n_in; ++k) {
      const Op in = g[n.in[k]].op;
      const bool scale = is_fused_attention(n.op) && (in == Op::scalar || in == Op::constant);
      anchor[n.in[k]] = anchor[n.in[k]] || (in != Op::arg && info(in).cls != OpClass::meta && !scale);
    }
    // A gather's or embedding's source is indexed by loaded values; an embedding's ids live in
    // memory too, so that they can be checked (runtime/launch/index_checks.hpp).
    if ((n.op == Op::gather || n.op == Op::embedding) && g[n.in[0]].op != Op::arg) anchor[n.in[0]] = true;
    if (n.op == Op::embedding && g[n.in[1]].op != Op::arg) anchor[n.in[1]] = true;
    if (n.op == Op::matmul)
      for (int k = 0; k < 2; ++k) {
        int src = matmul_operand(g, n.in[k]);
        if (g[src].op != Op::arg) anchor[src] = true;
      }
  }
  for (const auto& e : epilogues) {
    anchor[e.matmul] = false;
    anchor[e.out] = true;
    if (e.aux) anchor[e.pre] = true;
    if (e.aux_in >= 0) anchor[e.aux_in] = true;
    if (e.bias >= 0 && g[e.bias].op != Op::arg) anchor[e.bias] = true;
  }
  return anchor;
}

}  // namespace detail

namespace detail {

// The argument slot node i is written into by k::assign, or -1.
inline int assigned_slot(const graph::Graph& g, int i) {
  for (std::size_t o = 0; o < g.outputs.size() && o < g.output_into.size(); ++o)
    if (g.outputs[o] == i && g.output_into[o] >= 0) return g.output_into[o];
  return -1;
}

// Whether a reduction of row kernel k reads argument `slot` through a view or an index (at other
// positions than the row's own): a store into that argument in the same kernel would overwrite
// values later rows still read (a sum over the transposed argument).
inline bool rows_read_argument_elsewhere(const graph::Graph& g, const std::vector<bool>& anchor,
                                         const std::vector<int>& kernel_of, const KernelPlan& k, int ki, int slot) {
  std::vector<std::pair<int, bool>> stack;  // (node, reached through a view or an index)
  for (int r : k.reductions) stack.push_back({r, false});
  std::set<std::pair<int, bool>> seen;
  while (!stack.empty()) {
    auto [v, moved] = stack.back();
    stack.pop_back();
    if (!seen.insert({v, moved}).second) continue;
    const auto& n = g[v];
    if (n.op == Op::arg) {
      if (moved && n.slot == slot) return true;
      continue;
    }
    if (anchor[v] && kernel_of[v] >= 0 && kernel_of[v] != ki) continue;  // another kernel's buffer
    const auto cls = info(n.op).cls;
    if (cls == OpClass::leaf || cls == OpClass::meta || is_extern(n.op)) continue;
    const bool through = moved || cls == OpClass::view || cls == OpClass::index;
    for (int c = 0; c < n.n_in; ++c) stack.push_back({n.in[c], through});
  }
  return false;
}

// Whether anchor node i can be computed inside kernel `ki` (same iteration domain, and every
// reduction of the kernel it reads is read at the row's own index).
inline bool joins(const graph::Graph& g, const std::vector<bool>& anchor, const std::vector<int>& kernel_of,
                  const KernelPlan& k, int ki, int i) {
  const auto& n = g[i];
  if (k.closed || k.kind == Kind::extern_ || is_extern(n.op)) return false;
  bool rows = k.kind != Kind::poi;
  const Dims& domain = g[k.domain].shape;
  if (is_reduction(n.op)) {
    const Dims& p = g[n.in[0]].shape;
    return rows && domain == p && k.rdims == reduce_dims_of(n, p.size()) &&
           (n.attrs.c == 1) == (k.kind == Kind::split) &&
           reads_rows(g, anchor, kernel_of, k, ki, n.in[0], row_map(domain, {}, domain));
  }
  if (!rows) return domain == n.shape;
  bool row_shaped = domain == n.shape || kept_shape(domain, k.rdims, true) == n.shape ||
                    kept_shape(domain, k.rdims, false) == n.shape;
  if (const int slot = assigned_slot(g, i);
      row_shaped && slot >= 0 && rows_read_argument_elsewhere(g, anchor, kernel_of, k, ki, slot))
    return false;
  return row_shaped && reads_rows(g, anchor, kernel_of, k, ki, i, row_map(domain, k.rdims, n.shape));
}

// Whether pointwise kernel k may become the row kernel of reduction i: it iterates over i's input
// shape and stores nothing of another shape (every store becomes a row-shaped store), and none of
// its stores is written into an argument (k::assign): a row kernel's reduction may read that
// argument at other rows' positions (a sum over a transpose), which earlier rows have then
// overwritten; apart, the lowering refuses such a program (check_assign_order).
inline bool takes_rows(const graph::Graph& g, const KernelPlan& k, int i) {
  if (k.kind != Kind::poi || k.closed || k.stores.empty()) return false;
  const Dims& p = g[g[i].in[0]].shape;
  if (g[k.domain].shape != p) return false;
  return std::all_of(k.stores.begin(), k.stores.end(),
                     [&](int v) { return g[v].shape == p && assigned_slot(g, v) < 0; });
}

// The latest kernel that an anchor reads from: it cannot join any kernel before that one.
inline int first_possible_kernel(const graph::Graph& g, const std::vector<bool>& anchor,
                                 const std::vector<int>& kernel_of, int i) {
  int latest = 0;
  graph::walk_inputs(g, graph::inputs_of(g, {i}), [&](int v) {
    if (anchor[v]) latest = std::max(latest, kernel_of[v]);
    return !anchor[v];
  });
  return latest;
}

}  // namespace detail


// Groups the graph's anchors into kernels in topological order: an anchor joins the latest kernel
// that iterates over its domain and runs after everything it reads; otherwise it opens a kernel.
// `anchor`: the nodes that get buffers (find_anchors' and any a later pass adds). A matmul with an
// epilogue opens its step at its pre-activation, the first node by which its operands and bias
// are all computed; the activation's nodes before `out` are computed by nothing else.
inline Schedule fuse(const graph::Graph& g, const std::vector<bool>& anchor,
                     const std::vector<MatmulEpilogue>& epilogues = {}, bool move_kernels = true) {
  Schedule s;
  bool moved = false;
  s.epilogues = epilogues;
  std::vector<int> step_at(g.size(), -1);
  std::vector<bool> in_step(g.size(), false);
  for (int e = 0; e < static_cast<int>(epilogues.size()); ++e) {
    step_at[epilogues[e].pre] = e;
    for (int v : {epilogues[e].matmul, epilogues[e].pre, epilogues[e].out}) in_step[v] = true;
    for (int v : epilogues[e].bias_sums) in_step[v] = true;
  }
  const std::vector<int> lse_of = detail::lse_written_by_forward(g);
  for (int f = 0; f < g.size(); ++f)
    if (lse_of[f] >= 0) in_step[lse_of[f]] = true;
  std::vector<bool> gather_source(g.size(), false);
  for (auto& n : g.nodes)
    if (n.op == Op::gather || n.op == Op::embedding) gather_source[n.in[0]] = true;
  for (auto& n : g.nodes)  // an embedding's ids are checked before any kernel reads them
    if (n.op == Op::embedding) gather_source[n.in[1]] = true;
  s.kernel_of.assign(g.size(), -1);
  s.realized.assign(g.size(), false);
  for (int i = 0; i < g.size(); ++i) s.realized[i] = g[i].op == Op::arg;

  for (int i = 0; i < g.size(); ++i) {
    if (step_at[i] >= 0) {
      const MatmulEpilogue& e = epilogues[step_at[i]];
      KernelPlan k;
      k.kind = Kind::extern_;
      k.domain = e.matmul;
      k.epilogue = step_at[i];
      k.stores = {e.out};
      if (e.aux && e.pre != e.out) k.stores.insert(k.stores.begin(), e.pre);
      if (e.bias_grad() >= 0) k.stores.push_back(e.bias_grad());
      s.kernels.push_back(k);
      for (int v : {e.matmul, e.pre, e.out}) s.kernel_of[v] = static_cast<int>(s.kernels.size()) - 1;
      for (int v : e.bias_sums) s.kernel_of[v] = static_cast<int>(s.kernels.size()) - 1;
      continue;
    }
    if (!anchor[i] || in_step[i]) continue;
    const auto& n = g[i];
    const int first = detail::first_possible_kernel(g, anchor, s.kernel_of, i);
    // Stored in place (k::assign): in no kernel before one that still reads that argument.
    const int slot = detail::assigned_slot(g, i);
    auto reader_after = [&](int k) { return slot >= 0 && detail::last_reader(g, anchor, s, slot, k + 1) >= 0; };
    const int floor = slot >= 0 ? std::max(first, detail::last_reader(g, anchor, s, slot, first)) : first;
    int chosen = -1;
    for (int k = static_cast<int>(s.kernels.size()) - 1; k >= floor && chosen < 0; --k)
      if (detail::joins(g, anchor, s.kernel_of, s.kernels[k], k, i)) chosen = k;
    // A kernel it could join that runs before kernels it reads: join it there when those kernels may
    // run before that one instead (detail::may_run_before), moved in their order.
    for (int j = first - 1; move_kernels && j >= 0 && chosen < 0 && !detail::is_extern(n.op); --j) {
      if (!detail::joins(g, anchor, s.kernel_of, s.kernels[j], j, i)) continue;
      std::vector<int> later;
      for (int k : detail::kernels_read(g, anchor, s.kernel_of, {i}, -1))
        if (k > j) later.push_back(k);
      std::sort(later.begin(), later.end());
      if (later.empty() || !std::all_of(later.begin(), later.end(),
                                        [&](int k) { return detail::may_run_before(g, anchor, s, k, j); }))
        continue;
      for (std::size_t m = 0; m < later.size(); ++m) detail::move_kernel(s, later[m], j + static_cast<int>(m));
      moved = true;
      const int moved_j = j + static_cast<int>(later.size());
      if (detail::joins(g, anchor, s.kernel_of, s.kernels[moved_j], moved_j, i) && !reader_after(moved_j))
        chosen = moved_j;
      break;  // (the order stays valid either way)
    }
    // A row reduction over a pointwise kernel's domain whose stores all have that shape (a
    // residual sum the norm after it reads): that kernel becomes the row kernel and stores them as
    // it walks the row (Inductor's add + layer_norm in one kernel).
    if (chosen < 0 && is_reduction(n.op) && n.attrs.c != 1)
      for (int k = static_cast<int>(s.kernels.size()) - 1; k >= floor && chosen < 0; --k)
        if (detail::takes_rows(g, s.kernels[k], i)) {
          KernelPlan& plan = s.kernels[k];
          plan.kind = Kind::per;
          plan.domain = n.in[0];
          plan.rdims = detail::reduce_dims_of(n, g[n.in[0]].shape.size());
          if (detail::joins(g, anchor, s.kernel_of, plan, k, i))
            chosen = k;
          else {  // (not reached: no reduction of its own to read at another index)
            plan.kind = Kind::poi;
            plan.domain = plan.stores.front();
            plan.rdims = {};
          }
        }
    if (chosen < 0) {
      KernelPlan k;
      if (detail::is_extern(n.op)) {
        k.kind = Kind::extern_;
        k.domain = i;
      } else if (is_reduction(n.op)) {
        k.kind = n.attrs.c == 1 ? Kind::split : Kind::per;  // split.hpp marks first stages
        k.domain = n.in[0];
        k.rdims = detail::reduce_dims_of(n, g[n.in[0]].shape.size());
      } else {
        k.kind = Kind::poi;
        k.domain = i;
      }
      s.kernels.push_back(k);
      chosen = static_cast<int>(s.kernels.size()) - 1;
    }
    KernelPlan& plan = s.kernels[chosen];
    (is_reduction(n.op) ? plan.reductions : plan.stores).push_back(i);
    s.kernel_of[i] = chosen;
    if (lse_of[i] >= 0) {  // the forward attention kernel stores its rows' log-sum-exp too
      plan.stores.push_back(lse_of[i]);
      plan.attention_lse = lse_of[i];
      s.kernel_of[lse_of[i]] = chosen;
    }
    if (gather_source[i]) plan.closed = true;
  }
  // A kernel moved ahead writes an argument in place that a kernel after it reads (an anchor that
  // joined a kernel it passed, later): the order without moves, whose reads the lowering checks.
  if (moved && detail::reads_after_assign(g, anchor, s)) return fuse(g, anchor, epilogues, false);
  return s;
}
inline Schedule fuse(const graph::Graph& g, const std::vector<MatmulEpilogue>& epilogues = {}) {
  return fuse(g, detail::find_anchors(g, epilogues), epilogues);
}

// A reduction needs a buffer only when something outside its kernel (or the caller) reads it.
inline void plan_buffers(const graph::Graph& g, Schedule& s) {
  std::vector<bool> needed(g.size(), false);
  for (int o : g.outputs) needed[o] = true;
  // A node read by a kernel other than its own: walk each kernel's inlined trees.
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    auto& plan = s.kernels[k];
    if (plan.epilogue >= 0) {  // a matmul step and its epilogue: reads its operands and bias, writes out (and pre)
      const MatmulEpilogue& e = s.epilogues[plan.epilogue];
      plan.members = {e.matmul, e.pre, e.out};
      plan.members.insert(plan.members.end(), e.bias_sums.begin(), e.bias_sums.end());
      std::sort(plan.members.begin(), plan.members.end());
      plan.members.erase(std::unique(plan.members.begin(), plan.members.end()), plan.members.end());
      for (int c = 0; c < 2; ++c) {
        int src = detail::matmul_operand(g, g[e.matmul].in[c]);
        needed[src] = needed[src] || g[src].op != Op::arg;
      }
      if (e.bias >= 0) needed[e.bias] = needed[e.bias] || g[e.bias].op != Op::arg;
      if (e.aux_in >= 0) needed[e.aux_in] = true;
      for (int v : plan.stores) needed[v] = true;
      continue;
    }
    std::vector<int> roots = plan.stores;
    roots.insert(roots.end(), plan.reductions.begin(), plan.reductions.end());
    roots.insert(roots.end(), plan.partials.begin(), plan.partials.end());
    std::vector<bool> seen(g.size(), false);
    while (!roots.empty()) {
      int v = roots.back();
      roots.pop_back();
      if (seen[v]) continue;
      seen[v] = true;
      bool own = s.kernel_of[v] == k;
      if (s.kernel_of[v] >= 0 && !own) {
        needed[v] = true;  // produced by another kernel: read from its buffer
        continue;
      }
      if (g[v].op == Op::arg) continue;
      plan.members.push_back(v);
      if (plan.kind == Kind::extern_ && v == plan.domain) {
        for (int c = 0; c < g[v].n_in; ++c) {
          int src = g[v].op == Op::matmul ? detail::matmul_operand(g, g[v].in[c]) : g[v].in[c];
          needed[src] = needed[src] || g[src].op != Op::arg;
        }
        continue;
      }
      if (info(g[v].op).cls == OpClass::meta) {  // reads only its inputs' shapes: no buffer for them,
        for (int c = 0; c < g[v].n_in; ++c)      // but an extern step writes its result wherever it
          if (detail::is_extern(g[g[v].in[c]].op)) needed[g[v].in[c]] = true;  // is read from (a mean's
        continue;                                                              // count of a matmul)
      }
      for (int c = 0; c < g[v].n_in; ++c) roots.push_back(g[v].in[c]);
    }
    std::sort(plan.members.begin(), plan.members.end());
  }
  for (int i = 0; i < g.size(); ++i) {
    if (g[i].op == Op::arg) continue;
    s.realized[i] = needed[i] && s.kernel_of[i] >= 0;
  }
  // Row kernels store the reductions that others read; a pointwise anchor that only its own kernel
  // reads (one that realize_shared marked and regrouping put beside all its readers) is not stored.
  for (auto& plan : s.kernels) {
    if (plan.kind != Kind::extern_)
      std::erase_if(plan.stores, [&](int v) { return !s.realized[v] && is_pointwise(g[v].op); });
    for (int r : plan.reductions)
      if (s.realized[r]) plan.stores.push_back(r);
    std::sort(plan.stores.begin(), plan.stores.end());
  }
}

// Kernel names as Inductor's: kiln_<kind>_fused_<ops>_<n>, ops in graph order, each once.
// A kernel's name, as Inductor names them: kiln_<kind>_fused_<ops>_<index> (kiln_extern_<op>_<index>).
inline std::string kernel_name(Kind kind, const std::string& ops, std::size_t index) {
  return "kiln_" + std::string(kind_name(kind)) + (kind == Kind::extern_ ? "" : "_fused") + ops + "_" +
         std::to_string(index);
}

inline void name_kernels(const graph::Graph& g, Schedule& s) {
  for (std::size_t k = 0; k < s.kernels.size(); ++k) {
    auto& plan = s.kernels[k];
    std::string ops;
    std::vector<Op> seen;
    const graph::Node& d = g[plan.domain];
    const bool custom = plan.kind == Kind::extern_ && is_custom(d.op);  // kiln_extern_<op name>[_backward]_<n>
    if (plan.epilogue >= 0) {  // kiln_extern_matmul_bias_gelu_tanh_<n>
      plan.ops = "_matmul_" + s.epilogues[plan.epilogue].str();
      plan.name = kernel_name(plan.kind, plan.ops, k);
      continue;
    }
    if (custom) {
      ops = "_";
      ops += custom_ops::entry(d.attrs.custom).ident;
      if (d.op == Op::custom_backward) ops += "_backward";
    }
    for (int v : plan.members) {
      Op op = g[v].op;
      if (custom || detail::is_leaf(g[v]) || is_view(op) || op == Op::cast) continue;
      if (std::find(seen.begin(), seen.end(), op) != seen.end()) continue;
      seen.push_back(op);
      ops += "_" + std::string(name(op));
      if (seen.size() == 6) break;
    }
    if (ops.empty()) ops = "_copy";
    plan.ops = ops;
    plan.name = kernel_name(plan.kind, ops, k);
  }
}

}  // namespace kiln::schedule
