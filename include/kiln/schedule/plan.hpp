// The fuser's result: kernels in launch order, each a plan of what it stores, reduces and
// computes (schedule/fuse.hpp builds it; codegen writes one kernel per plan).
#pragma once
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "../graph/graph.hpp"
#include "epilogue.hpp"

namespace kiln::schedule {

enum class Kind { poi, per, red, split, extern_ };
inline const char* kind_name(Kind k) {
  constexpr const char* names[] = {"poi", "per", "red", "split", "extern"};
  return names[static_cast<int>(k)];
}

struct KernelPlan {
  Kind kind = Kind::poi;
  std::vector<int> stores;      // nodes this kernel writes to buffers
  std::vector<int> reductions;  // row kernels: reductions computed here, in dependency order
  std::vector<int> members;     // every node computed in this kernel (inlined ones included)
  int domain = -1;              // poi: a node of the kernel's shape; rows: the reduction input
  Dims rdims;                   // rows: the reduced dims of the domain
  std::string name;             // kernel_name(kind, ops, index)
  std::string ops;              // the ops part of the name ("_add_mul_relu")
  bool closed = false;          // later anchors may not join (its stores are read by address)
  // Row kernels: first stages of split column sums computed here as per-program partial sums of
  // the rows each program visits (schedule/partials.hpp); their buffers hold partial_groups rows.
  std::vector<int> partials;
  std::int64_t partial_groups = 0;
  int epilogue = -1;  // a matmul step: its epilogue in Schedule::epilogues, -1 for none
  int attention_lse = -1;  // an attention_flash step: the attention_lse node its kernel writes too

  std::string debug_str(const graph::Graph& g) const {
    std::ostringstream os;
    os << name << " (" << kind_name(kind) << "): domain %" << domain << " " << g[domain].shape.str();
    if (!rdims.empty()) os << " reduce " << rdims.str();
    os << ", stores";
    for (int s : stores) os << " %" << s;
    if (!partials.empty()) os << ", column partials over " << partial_groups << " row groups";
    for (int s : partials) os << " %" << s;
    return os.str();
  }
};

// The sizes a buffer's storage is padded to: dim 0 to `rows`, the last dim to `cols` (0: as is);
// schedule/pad_buffers.hpp plans them for GEMM operands.
struct Padding {
  std::int64_t rows = 0, cols = 0;
  explicit operator bool() const { return rows > 0 || cols > 0; }
};

struct Schedule {
  std::vector<KernelPlan> kernels;
  std::vector<int> kernel_of;  // node -> kernel computing it as a buffer, -1 for inlined/args
  std::vector<bool> realized;  // node has a buffer (args, outputs, intermediates)
  std::vector<MatmulEpilogue> epilogues;  // the matmul steps' epilogues (schedule/epilogue.hpp)
  std::vector<Padding> padding;           // per node, where some buffer has room (pad_buffers.hpp)
};

}  // namespace kiln::schedule
