// Room for 16-bit GEMMs in the buffers themselves (CUDA). cuBLASLt's tensor-core kernels want
// m, n and k multiples of 8 and 16-byte leading dimensions (runtime/extern/matmul_layout.hpp); a
// GEMM over GPT-2's vocabulary of 50257 otherwise runs on zero-padded copies of its operands into
// a padded output that is copied back, a pass over each such matrix. Where the operand or output
// is an intermediate that only generated kernels and plain GEMMs read, its storage is instead
// allocated with room: dim 0 rounded up to a multiple of 8 (rows past the end), the last dim
// rounded up (a row stride of whole 16-byte vectors, the buffer a strided view), as Inductor's
// pad_mm leaves its padded mm outputs. The room is zero (the program zeroes it as it allocates
// the buffer; a padded GEMM writes zeros there, the products of zero rows or columns), so a GEMM
// may read it as the padded part of its operand: no copies. Generated kernels read and write such
// a buffer through its strides and never touch the room.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "fuse.hpp"

namespace kiln::schedule {

// The shape of a buffer's storage: its shape with the padded dims replaced.
template <class Shape>
Shape padded_shape(Shape shape, const Padding& p) {
  using Size = std::remove_cvref_t<decltype(shape[0])>;
  if (p.rows > 0) shape[0] = Size(p.rows);
  if (p.cols > 0) shape[static_cast<int>(shape.size()) - 1] = Size(p.cols);
  return shape;
}

namespace detail {

inline std::int64_t round_up8(std::int64_t x) { return (x + 7) / 8 * 8; }

// Whether buffer `b` may be stored with room: an intermediate (not an argument, not an output) of
// two dims, every extern step reading it a GEMM without epilogue that takes it as an operand or a
// transpose of one (generated kernels read any view of it through its strides).
inline bool takes_room(const graph::Graph& g, const Schedule& s, int b) {
  if (b < 0 || !s.realized[b] || g[b].op == Op::arg || g[b].shape.size() != 2) return false;
  for (int o : g.outputs)
    if (o == b) return false;
  // Written by a generated kernel or a plain GEMM: other extern steps write whole contiguous buffers.
  const int writer = s.kernel_of[static_cast<std::size_t>(b)];
  if (writer >= 0 && s.kernels[static_cast<std::size_t>(writer)].kind == Kind::extern_ &&
      (g[b].op != Op::matmul || s.kernels[static_cast<std::size_t>(writer)].epilogue >= 0))
    return false;
  for (const KernelPlan& k : s.kernels) {
    if (k.kind != Kind::extern_) continue;
    const graph::Node& n = g[k.domain];
    for (int i = 0; i < n.n_in; ++i) {
      int x = n.in[i];
      bool through_view = false;
      while (x != b && info(g[x].op).cls == OpClass::view) x = g[x].in[0], through_view = true;
      if (x != b) continue;
      const bool operand = n.op == Op::matmul && k.epilogue < 0 && i < 2 &&
                           (!through_view || (g[n.in[i]].op == Op::permute && g[n.in[i]].in[0] == b &&
                                              g[n.in[i]].attrs.dims == Dims{1, 0}));
      if (!operand) return false;
    }
  }
  return true;
}

}  // namespace detail

// Plans Schedule::padding for a CUDA program: each 16-bit GEMM (without epilogue) over a constant
// m, n or k off 8 gives that dim room in each of its operands and output that can take it.
// A GEMM that moves little per flop (below matmul_layout.hpp's intensity for padding, 32 flops a
// byte) leaves its buffers as they are: the fast kernels would not run it faster.
inline void pad_gemm_buffers(const graph::Graph& g, Schedule& s, const ir::ShapeEnv& env) {
  s.padding.assign(static_cast<std::size_t>(g.size()), Padding{});
  bool any = false;
  for (const KernelPlan& k : s.kernels) {
    if (k.kind != Kind::extern_ || k.epilogue >= 0) continue;
    const graph::Node& n = g[k.domain];
    if (n.op != Op::matmul || n.shape.size() != 2) continue;
    const kiln::dtype ab = g[n.in[0]].dt;
    if ((ab != kiln::dtype::bf16 && ab != kiln::dtype::f16) || g[n.in[1]].dt != ab) continue;
    // The three matrices as (buffer, its dim along the view's rows, along its columns).
    struct Side {
      int buffer, row_dim, col_dim;
    };
    auto side = [&](int node) {
      if (g[node].op == Op::permute && g[node].shape.size() == 2 && g[node].attrs.dims == Dims{1, 0})
        return Side{g[node].in[0], 1, 0};
      return info(g[node].op).cls == OpClass::view ? Side{-1, 0, 1} : Side{node, 0, 1};
    };
    const Side a = side(n.in[0]), b = side(n.in[1]), d{k.domain, 0, 1};
    const auto& ea = env[n.in[0]];
    const auto& eb = env[n.in[1]];
    auto size = [&](const Sym& x) { return x.is_constant() ? x.constant_value() : x.eval(env.example); };
    const std::int64_t M = size(ea[0]), K = size(ea[1]), N = size(eb[1]);
    const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
    const double bytes =
        2.0 * static_cast<double>(M * K + K * N) + static_cast<double>(M * N) * static_cast<double>(itemsize(n.dt));
    if (M <= 0 || N <= 0 || K <= 0 || flops < 32 * bytes) continue;
    // Each GEMM dim off 8 and constant: room along it in each matrix that carries it.
    auto room = [&](const Side& sd, bool along_rows, const Sym& extent) {
      if (!extent.is_constant() || extent.constant_value() % 8 == 0 || !detail::takes_room(g, s, sd.buffer)) return;
      const int dim = along_rows ? sd.row_dim : sd.col_dim;
      Padding& p = s.padding[static_cast<std::size_t>(sd.buffer)];
      (dim == 0 ? p.rows : p.cols) = detail::round_up8(extent.constant_value());
      any = true;
    };
    room(a, true, ea[0]), room(d, true, ea[0]);    // m
    room(a, false, ea[1]), room(b, true, ea[1]);   // k
    room(b, false, eb[1]), room(d, false, eb[1]);  // n
  }
  if (!any) s.padding.clear();
}

// A buffer's padding in a schedule (none where the schedule pads nothing).
inline Padding padding_of(const Schedule& s, int node) {
  return s.padding.empty() ? Padding{} : s.padding[static_cast<std::size_t>(node)];
}

}  // namespace kiln::schedule
