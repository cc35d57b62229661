// partition: a report, for a joint forward/backward graph, of which forward values its backward
// reads as saved values (reduction and matmul results, and small values computed only from them)
// and which it recomputes (cheap pointwise ops and views), as AOTAutograd's min-cut partitioner
// would split them: saving a full-size pointwise result costs more bytes moved than recomputing it
// from what is already saved or is an argument. It decides nothing: kiln compiles a k::grad's
// forward and backward as one program, where the fuser makes the same choice (a reduction or
// matmul result is a buffer the backward kernels read; a pointwise value is inlined into them).
// Tests use the report to check that the joint graph offers the fuser that split.
#pragma once
#include <algorithm>
#include <sstream>
#include <string>
#include <vector>

#include "differentiate.hpp"

namespace kiln::autodiff {

struct PartitionReport {
  struct Entry {
    int id = -1;
    std::string node;  // the node, printed as in Graph::str()
    std::int64_t bytes = 0;
  };
  std::vector<Entry> saved;       // kept in memory from the forward for the backward
  std::vector<Entry> arguments;   // inputs the backward reads directly (already in memory)
  std::vector<Entry> recomputed;  // cheap forward nodes recomputed inside backward kernels
  std::int64_t saved_bytes = 0;

  std::vector<int> saved_ids() const { return ids(saved); }
  std::vector<int> argument_ids() const { return ids(arguments); }
  std::vector<int> recomputed_ids() const { return ids(recomputed); }

  std::string str() const {
    std::ostringstream os;
    os << "partition: " << saved.size() << " saved (" << saved_bytes << " bytes), " << arguments.size()
       << " arguments, " << recomputed.size() << " recomputed\n";
    auto list = [&](const char* what, const std::vector<Entry>& v) {
      for (auto& e : v) os << "  " << what << e.node << "\n";
    };
    list("saved      ", saved);
    list("argument   ", arguments);
    list("recomputed ", recomputed);
    return os.str();
  }

 private:
  static std::vector<int> ids(const std::vector<Entry>& v) {
    std::vector<int> out;
    for (auto& e : v) out.push_back(e.id);
    return out;
  }
};

namespace detail {

inline std::string node_line(const graph::Graph& g, int i) {
  const graph::Node& n = g[i];
  std::ostringstream os;
  os << "%" << i << " = " << name(n.op) << "(";
  if (n.op == Op::arg) os << "arg" << n.slot;
  for (int k = 0; k < n.n_in; ++k) os << (k ? ", " : "") << "%" << n.in[k];
  os << graph::attrs_str(n) << ") : " << kiln::name(n.dt) << n.shape.str();
  return os.str();
}

// Worth saving rather than recomputing: reductions, matmuls and gathers, and pointwise results or
// views computed only from such values that are no larger than their largest input (mean, rstd).
class Saveable {
 public:
  explicit Saveable(const graph::Graph& g) : g_(g), memo_(static_cast<std::size_t>(g.size()), -1) {}
  bool operator()(int i) {
    if (memo_[i] >= 0) return memo_[i];
    const graph::Node& n = g_[i];
    const OpClass cls = info(n.op).cls;
    bool s = false;
    if (is_reduction(n.op) || cls == OpClass::extern_ || cls == OpClass::index) {
      s = true;
    } else if (cls != OpClass::leaf && !n.weak) {
      std::int64_t largest = 0;
      s = true;
      for (int k = 0; k < n.n_in && s; ++k) {
        const graph::Node& x = g_[n.in[k]];
        if (x.weak) continue;
        s = (*this)(n.in[k]);
        largest = std::max(largest, x.shape.product());
      }
      s = s && largest > 0 && n.shape.product() <= largest;
    }
    memo_[i] = s;
    return s;
  }

 private:
  const graph::Graph& g_;
  std::vector<signed char> memo_;
};

}  // namespace detail

// Partitions a joint graph whose nodes [0, n_forward) are the forward graph's.
inline PartitionReport partition(const graph::Graph& joint, int n_forward) {
  PartitionReport report;
  detail::Saveable saveable(joint);
  std::vector<char> seen(static_cast<std::size_t>(n_forward), 0);
  auto entry = [&](int i) {
    const graph::Node& n = joint[i];
    return PartitionReport::Entry{i, detail::node_line(joint, i),
                                  n.shape.product() * static_cast<std::int64_t>(itemsize(n.dt))};
  };
  // Classifies forward node i, read by the backward; a recomputed node needs its own inputs.
  auto visit = [&](auto& self, int i) -> void {
    if (seen[i]) return;
    seen[i] = 1;
    const graph::Node& n = joint[i];
    if (n.op == Op::arg) {
      report.arguments.push_back(entry(i));
    } else if (n.weak || n.op == Op::scalar || n.op == Op::constant) {
      return;  // scalars are kernel arguments, not tensors
    } else if (saveable(i)) {
      report.saved.push_back(entry(i));
      report.saved_bytes += report.saved.back().bytes;
    } else {
      report.recomputed.push_back(entry(i));
      for (int k = 0; k < n.n_in; ++k) self(self, n.in[k]);
    }
  };
  for (int i = n_forward; i < joint.size(); ++i)
    for (int k = 0; k < joint[i].n_in && info(joint[i].op).cls != OpClass::meta; ++k)  // meta: a shape, not a value
      if (joint[i].in[k] < n_forward) visit(visit, joint[i].in[k]);
  auto by_id = [](const auto& a, const auto& b) { return a.id < b.id; };
  std::sort(report.saved.begin(), report.saved.end(), by_id);
  std::sort(report.arguments.begin(), report.arguments.end(), by_id);
  std::sort(report.recomputed.begin(), report.recomputed.end(), by_id);
  return report;
}

inline PartitionReport partition(const JointGraph& joint) { return partition(joint.graph, joint.n_forward); }

}  // namespace kiln::autodiff
