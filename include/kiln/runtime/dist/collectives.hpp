// Collectives as expressions: k::all_reduce, k::all_gather, k::reduce_scatter and k::broadcast.
// Each is a custom op (expr/custom_op.hpp) registered once per group and per (kind, reduction,
// dim or root): an opaque extern step of the program that calls NCCL on the program's stream, so
// it works eagerly, inside k::compile'd functions and inside CUDA graphs, and the program cache
// tells groups apart by the op's id. Shape rules check ranks and divisibility before anything runs;
// the derivatives are the adjoint collectives (all_gather <-> reduce_scatter, all_reduce of the
// cotangent, a reduction to the root for broadcast). NCCL concatenates and splits along the
// first dimension; another dim goes through one permuting copy on the same stream.
#pragma once
#include <memory>
#include <span>
#include <string>

#include "../../core/factories.hpp"
#include "../../core/memory.hpp"
#include "../api.hpp"
#include "group.hpp"

namespace kiln::dist::detail {

struct Collective {
  Kind kind = Kind::all_reduce;
  reduce_op op = reduce_op::sum;
  int param = 0;  // all_gather / reduce_scatter: the dim; broadcast: the root
  std::weak_ptr<GroupState> group;

  std::string label() const {
    switch (kind) {
      case Kind::all_reduce:
        return std::string("k::all_reduce(") + name(op) + ")";
      case Kind::all_gather:
        return "k::all_gather(dim " + std::to_string(param) + ")";
      case Kind::reduce_scatter:
        return std::string("k::reduce_scatter(") + name(op) + ", dim " + std::to_string(param) + ")";
      case Kind::broadcast:
        return "k::broadcast(root " + std::to_string(param) + ")";
    }
    return "k::collective";
  }
  GroupState& state() const {
    auto g = group.lock();
    if (!g) throw error(label() + ": its k::dist::group was destroyed before the program ran");
    return *g;  // the caller's group handle keeps it alive for the call
  }
};

inline int normalize_dim(const Collective& c, int dim, int rank) {
  if (rank == 0) throw shape_error(c.label() + ": the input is a single number (rank 0); it needs a dim");
  if (dim < -rank || dim >= rank)
    throw shape_error(c.label() + ": dim " + std::to_string(dim) + " is out of range for rank " + std::to_string(rank));
  return dim < 0 ? dim + rank : dim;
}

inline TensorSpec infer(const Collective& c, int world, std::span<const TensorSpec> in) {
  TensorSpec out = in[0];
  const bool arithmetic = c.op == reduce_op::sum || c.op == reduce_op::prod || c.op == reduce_op::avg;
  if ((c.kind == Kind::all_reduce || c.kind == Kind::reduce_scatter) && arithmetic && out.dtype == kiln::dtype::boolean)
    throw dtype_error(c.label() + ": a bool tensor has no " + name(c.op) + "; use max or min, or cast it");
  if (c.kind == Kind::all_gather || c.kind == Kind::reduce_scatter) {
    const int d = normalize_dim(c, c.param, out.shape.size());
    if (c.kind == Kind::all_gather) {
      out.shape[d] *= world;
    } else {
      if (out.shape[d] % world != 0)
        throw shape_error(c.label() + ": dim " + std::to_string(d) + " of shape " + out.shape.str() + " (size " +
                          std::to_string(out.shape[d]) + ") does not split among world size " + std::to_string(world));
      out.shape[d] /= world;
    }
  }
  return out;
}

// `shape` with dim d split into (w, shape[d] / w): w goes at position d (outer) when `outer`.
inline Dims split_dim(const Dims& shape, int d, std::int64_t w) {
  Dims s;
  for (int i = 0; i < shape.size(); ++i) {
    if (i == d)
      s.push_back(w), s.push_back(shape[i] / w);
    else
      s.push_back(shape[i]);
  }
  return s;
}

// Runs collective c from `in` into `out` (contiguous, the shape rule's shape) on stream s.
inline void run(const Collective& c, const Tensor& in, Tensor& out, Stream s) {
  GroupState& g = c.state();
  if (g.world_size == 1) {  // every collective of one rank is the identity
    memory::copy(out.data_ptr(), out.device(), in.data_ptr(), in.device(), out.nbytes(), s.handle());
    return;
  }
  if (!(in.device() == g.device))
    throw device_error(c.label() + ": the tensor is on " + in.device().str() + " but rank " + std::to_string(g.rank) +
                       " of its group drives " + g.device.str());
  namespace nccl = runtime::nccl;
  const auto& api = nccl::api();
  const auto dt = nccl::data_type(in.dtype());
  const auto op = static_cast<nccl::RedOp>(static_cast<int>(c.op));
  const std::string what = c.label();
  driver::make_current(g.device.index);
  const int rank = in.dim();
  switch (c.kind) {
    case Kind::all_reduce:
      nccl::check(api.all_reduce(in.data_ptr(), out.data_ptr(), in.numel(), dt, op, g.comm, s.handle()),
                  "ncclAllReduce", what);
      return;
    case Kind::broadcast:
      nccl::check(api.broadcast(in.data_ptr(), out.data_ptr(), in.numel(), dt, c.param, g.comm, s.handle()),
                  "ncclBroadcast", what);
      return;
    case Kind::all_gather: {
      const int d = normalize_dim(c, c.param, rank);
      if (d == 0) {
        nccl::check(api.all_gather(in.data_ptr(), out.data_ptr(), in.numel(), dt, g.comm, s.handle()), "ncclAllGather",
                    what);
        return;
      }
      // Gather to [world, in...], then move the world dim next to d: out viewed as [.., world, n_d, ..].
      Dims stacked;
      stacked.push_back(g.world_size);
      for (auto n : in.shape()) stacked.push_back(n);
      Tensor tmp = Tensor::empty(stacked, in.dtype(), in.device(), s);  // freed in order on s
      nccl::check(api.all_gather(in.data_ptr(), tmp.data_ptr(), in.numel(), dt, g.comm, s.handle()), "ncclAllGather",
                  what);
      Dims order;
      for (int i = 1; i <= d; ++i) order.push_back(i);
      order.push_back(0);
      for (int i = d + 1; i <= rank; ++i) order.push_back(i);
      Tensor view = Tensor::wrap(out.data_ptr(), split_dim(out.shape(), d, g.world_size), out.dtype(), out.device());
      eval(view, permute(tmp, order), s);
      return;
    }
    case Kind::reduce_scatter: {
      const int d = normalize_dim(c, c.param, rank);
      if (d == 0) {
        nccl::check(api.reduce_scatter(in.data_ptr(), out.data_ptr(), out.numel(), dt, op, g.comm, s.handle()),
                    "ncclReduceScatter", what);
        return;
      }
      // in viewed as [.., world, n_d / world, ..], the world dim moved to the front: chunk r is rank r's part.
      Tensor view = Tensor::wrap(in.data_ptr(), split_dim(in.shape(), d, g.world_size), in.dtype(), in.device());
      Dims order;
      order.push_back(d);
      for (int i = 0; i <= rank; ++i)
        if (i != d) order.push_back(i);
      // Into a fresh contiguous buffer: eval of a bare permute would return a view.
      Dims chunk_shape;
      for (int i : order) chunk_shape.push_back(view.shape()[i]);
      Tensor chunks = Tensor::empty(chunk_shape, in.dtype(), in.device(), s);
      eval(chunks, permute(view, order), s);
      nccl::check(api.reduce_scatter(chunks.data_ptr(), out.data_ptr(), out.numel(), dt, op, g.comm, s.handle()),
                  "ncclReduceScatter", what);
      return;
    }
  }
}

// The gradient of c's input from the cotangent of its output.
inline void run_backward(const Collective& c, const Tensor& grad_out, Tensor& grad_in, Stream s) {
  GroupState& g = c.state();
  const bool linear = c.op == reduce_op::sum || c.op == reduce_op::avg;
  if ((c.kind == Kind::all_reduce || c.kind == Kind::reduce_scatter) && !linear)
    throw error(c.label() + " has no gradient (only sum and avg reductions are differentiable)");
  Collective adjoint = c;
  switch (c.kind) {
    case Kind::all_reduce:
      break;  // sum: the cotangents summed; avg: averaged
    case Kind::all_gather:
      adjoint.kind = Kind::reduce_scatter, adjoint.op = reduce_op::sum;
      break;
    case Kind::reduce_scatter:
      adjoint.kind = Kind::all_gather;
      break;
    case Kind::broadcast:
      if (g.world_size == 1) break;
      driver::make_current(g.device.index);
      runtime::nccl::check(runtime::nccl::api().reduce(grad_out.data_ptr(), grad_in.data_ptr(), grad_out.numel(),
                                                       runtime::nccl::data_type(grad_out.dtype()), runtime::nccl::sum,
                                                       c.param, g.comm, s.handle()),
                           "ncclReduce", c.label() + " (backward)");
      if (g.rank != c.param) driver::memset_async(grad_in.data_ptr(), 0, grad_in.nbytes(), s.handle());
      return;
  }
  run(adjoint, grad_out, grad_in, s);
  if (c.kind == Kind::reduce_scatter && c.op == reduce_op::avg && g.world_size > 1)
    eval(grad_in, grad_in * (1.0 / g.world_size), s);
}

// The op of (kind, op, param) for group g, registered at its first use.
inline const CustomOp& collective_op(const group& g, Kind kind, reduce_op op, int param) {
  GroupState& s = g.state();
  std::lock_guard lock(s.mu);
  auto key = std::make_tuple(static_cast<int>(kind), static_cast<int>(op), param);
  auto it = s.ops.find(key);
  if (it != s.ops.end()) return it->second;
  Collective c{kind, op, param, g.shared()};
  const int world = s.world_size;
  CustomOp registered = custom_op(
      c.label(), {.inputs = 1,
                  .infer = [c, world](std::span<const TensorSpec> in) { return infer(c, world, in); },
                  .forward = [c](std::span<const Tensor> in, Tensor& out, Stream st) { run(c, in[0], out, st); },
                  .backward = [c](std::span<const Tensor>, const Tensor& grad_out, std::span<Tensor> grad_in,
                                  Stream st) { run_backward(c, grad_out, grad_in[0], st); }});
  return s.ops.emplace(key, registered).first->second;
}

template <class X>
constexpr void check_operand() {
  static_assert(Expr<X> || std::is_same_v<X, Tensor>, "a collective's input is a tensor or an expression");
}

}  // namespace kiln::dist::detail

namespace kiln {

// Every rank gets op over all ranks' x (same shape).
template <class X>
auto all_reduce(const X& x, const dist::group& g, reduce_op op = reduce_op::sum) {
  dist::detail::check_operand<X>();
  return dist::detail::collective_op(g, dist::detail::Kind::all_reduce, op, 0)(x);
}

// Every rank gets the ranks' x concatenated along dim, in rank order.
template <class X>
auto all_gather(const X& x, const dist::group& g, int dim = 0) {
  dist::detail::check_operand<X>();
  return dist::detail::collective_op(g, dist::detail::Kind::all_gather, reduce_op::sum, dim)(x);
}

// x reduced over the ranks, then split along dim: rank r keeps part r.
template <class X>
auto reduce_scatter(const X& x, const dist::group& g, int dim = 0, reduce_op op = reduce_op::sum) {
  dist::detail::check_operand<X>();
  return dist::detail::collective_op(g, dist::detail::Kind::reduce_scatter, op, dim)(x);
}

// Every rank gets root's x.
template <class X>
auto broadcast(const X& x, const dist::group& g, int root = 0) {
  dist::detail::check_operand<X>();
  if (root < 0 || root >= g.world_size())
    throw error("k::broadcast: root " + std::to_string(root) + " is outside 0.." + std::to_string(g.world_size() - 1));
  return dist::detail::collective_op(g, dist::detail::Kind::broadcast, reduce_op::sum, root)(x);
}

}  // namespace kiln
