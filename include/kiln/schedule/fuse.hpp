// Fusion: decides which nodes get a buffer and groups the rest into kernels. Pointwise ops and
// views are inlined into their consumers; reductions over the same rows share one row kernel with
// their pointwise prologues and epilogues (softmax and layer_norm forward become one kernel);
// independent outputs of one shape share one pointwise kernel; matmul is an extern call.
#pragma once
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "../graph/graph.hpp"

namespace kiln::schedule {

enum class Kind { poi, per, red, extern_ };
inline const char* kind_name(Kind k) {
  constexpr const char* names[] = {"poi", "per", "red", "extern"};
  return names[static_cast<int>(k)];
}

struct KernelPlan {
  Kind kind = Kind::poi;
  std::vector<int> stores;      // nodes this kernel writes to buffers
  std::vector<int> reductions;  // row kernels: reductions computed here, in dependency order
  std::vector<int> members;     // every node computed in this kernel (inlined ones included)
  int domain = -1;              // poi: a node of the kernel's shape; rows: the reduction input
  Dims rdims;                   // rows: the reduced dims of the domain
  std::string name;
  bool closed = false;          // later anchors may not join (its stores are read by address)

  std::string debug_str(const graph::Graph& g) const {
    std::ostringstream os;
    os << name << " (" << kind_name(kind) << "): domain %" << domain << " " << g[domain].shape.str();
    if (!rdims.empty()) os << " reduce " << rdims.str();
    os << ", stores";
    for (int s : stores) os << " %" << s;
    return os.str();
  }
};

struct Schedule {
  std::vector<KernelPlan> kernels;
  std::vector<int> kernel_of;     // node -> kernel computing it as a buffer, -1 for inlined/args
  std::vector<bool> realized;     // node has a buffer (args, outputs, intermediates)
};

namespace detail {

inline Dims reduce_dims_of(const graph::Node& n, int rank) {
  Dims out;
  if (n.attrs.all) {
    for (int i = 0; i < rank; ++i) out.push_back(i);
    return out;
  }
  for (auto d : n.attrs.dims) out.push_back(d < 0 ? d + rank : d);
  std::sort(out.begin(), out.end());
  return out;
}

// The kept shape of a row domain, without and with the reduced dims kept as 1.
inline Dims kept_shape(const Dims& p, const Dims& rd, bool keepdim) {
  Dims out;
  for (int i = 0; i < p.size(); ++i) {
    bool r = std::find(rd.begin(), rd.end(), i) != rd.end();
    if (!r) out.push_back(p[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

inline bool is_leaf(const graph::Node& n) { return info(n.op).cls == OpClass::leaf || n.op == Op::numel; }

// Nodes whose value must live in memory: outputs, reductions, matmuls and matmul operands.
inline std::vector<bool> find_anchors(const graph::Graph& g) {
  std::vector<bool> anchor(g.size(), false);
  for (int o : g.outputs) anchor[o] = g[o].op != Op::arg;
  for (int i = 0; i < g.size(); ++i) {
    const auto& n = g[i];
    if (is_reduction(n.op) || n.op == Op::matmul) anchor[i] = true;
    if (n.op == Op::gather && g[n.in[0]].op != Op::arg) anchor[n.in[0]] = true;  // indexed by loaded values
    if (n.op == Op::matmul)
      for (int k = 0; k < 2; ++k)
        if (g[n.in[k]].op != Op::arg) anchor[n.in[k]] = true;
  }
  return anchor;
}

}  // namespace detail

// Groups the graph's anchors into kernels, greedily in topological order: an anchor joins the
// most recent kernel when it iterates over the same domain, else it opens a new kernel.
inline Schedule fuse(const graph::Graph& g) {
  Schedule s;
  auto anchor = detail::find_anchors(g);
  std::vector<bool> gather_source(g.size(), false);
  for (auto& n : g.nodes)
    if (n.op == Op::gather) gather_source[n.in[0]] = true;
  s.kernel_of.assign(g.size(), -1);
  s.realized.assign(g.size(), false);
  for (int i = 0; i < g.size(); ++i) s.realized[i] = g[i].op == Op::arg;

  for (int i = 0; i < g.size(); ++i) {
    if (!anchor[i]) continue;
    const auto& n = g[i];
    KernelPlan* last = s.kernels.empty() || s.kernels.back().closed ? nullptr : &s.kernels.back();
    bool last_rows = last && (last->kind == Kind::per || last->kind == Kind::red);
    if (n.op == Op::matmul) {
      KernelPlan k;
      k.kind = Kind::extern_;
      k.domain = i;
      k.stores = {i};
      s.kernels.push_back(k);
    } else if (is_reduction(n.op)) {
      const Dims& p = g[n.in[0]].shape;
      Dims rd = detail::reduce_dims_of(n, p.size());
      if (last_rows && g[last->domain].shape == p && last->rdims == rd) {
        last->reductions.push_back(i);
      } else {
        KernelPlan k;
        k.kind = Kind::per;
        k.domain = n.in[0];
        k.rdims = rd;
        k.reductions = {i};
        s.kernels.push_back(k);
      }
    } else {
      const Dims& shape = n.shape;
      bool joins_rows = last_rows && (g[last->domain].shape == shape ||
                                      detail::kept_shape(g[last->domain].shape, last->rdims, true) == shape ||
                                      detail::kept_shape(g[last->domain].shape, last->rdims, false) == shape);
      bool joins_poi = last && last->kind == Kind::poi && g[last->domain].shape == shape;
      if (joins_rows || joins_poi) {
        last->stores.push_back(i);
      } else {
        KernelPlan k;
        k.kind = Kind::poi;
        k.domain = i;
        k.stores = {i};
        s.kernels.push_back(k);
      }
    }
    s.kernel_of[i] = static_cast<int>(s.kernels.size()) - 1;
    if (gather_source[i]) s.kernels.back().closed = true;
  }
  return s;
}

// A reduction needs a buffer only when something outside its kernel (or the caller) reads it.
inline void plan_buffers(const graph::Graph& g, Schedule& s) {
  std::vector<bool> needed(g.size(), false);
  for (int o : g.outputs) needed[o] = true;
  // A node read by a kernel other than its own: walk each kernel's inlined trees.
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k) {
    auto& plan = s.kernels[k];
    std::vector<int> roots = plan.stores;
    roots.insert(roots.end(), plan.reductions.begin(), plan.reductions.end());
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
        for (int c = 0; c < 2; ++c) needed[g[v].in[c]] = g[g[v].in[c]].op != Op::arg;
        continue;
      }
      for (int c = 0; c < g[v].n_in; ++c) roots.push_back(g[v].in[c]);
    }
    std::sort(plan.members.begin(), plan.members.end());
  }
  for (int i = 0; i < g.size(); ++i) {
    if (g[i].op == Op::arg) continue;
    s.realized[i] = needed[i] && s.kernel_of[i] >= 0;
  }
  // Row kernels store the reductions that others read; kinds and names follow.
  for (auto& plan : s.kernels) {
    for (int r : plan.reductions)
      if (s.realized[r]) plan.stores.push_back(r);
    std::sort(plan.stores.begin(), plan.stores.end());
  }
}

// Kernel names as Inductor's: kiln_<kind>_fused_<ops>_<n>, ops in graph order, each once.
inline void name_kernels(const graph::Graph& g, Schedule& s) {
  for (std::size_t k = 0; k < s.kernels.size(); ++k) {
    auto& plan = s.kernels[k];
    std::string ops;
    std::vector<Op> seen;
    for (int v : plan.members) {
      Op op = g[v].op;
      if (detail::is_leaf(g[v]) || is_view(op) || op == Op::cast) continue;
      if (std::find(seen.begin(), seen.end(), op) != seen.end()) continue;
      seen.push_back(op);
      ops += "_" + std::string(name(op));
      if (seen.size() == 6) break;
    }
    if (ops.empty()) ops = "_copy";
    plan.name = "kiln_" + std::string(kind_name(plan.kind)) + (plan.kind == Kind::extern_ ? "" : "_fused") + ops + "_" +
                std::to_string(k);
  }
}

}  // namespace kiln::schedule
