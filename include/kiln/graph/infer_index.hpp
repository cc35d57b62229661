// Shape and dtype inference for the ops that read or compute values at run-time positions: gather,
// embedding (and its scatter-add gradient, an extern step) and rand. Split from infer.hpp.
#pragma once
#include <string>

#include "graph.hpp"

namespace kiln::graph::detail {

inline void check_index_dtype(const Node& ids, const char* op, const char* what) {
  if (ids.dt != kiln::dtype::i64 && ids.dt != kiln::dtype::i32)
    throw dtype_error(std::string(op) + ": " + what + " must be i64 or i32, got " + std::string(name(ids.dt)));
}

// gather(x, idx): x[..., idx[...]] along the last dim. embedding(table [V, D], ids): ids.shape + [D].
// embedding_backward(g, ids[, shape_of(table)]) with V the table's rows (else attrs.a): the [V, D]
// sum of g's rows at each id. rand(x, seed lo/hi, offset lo/hi): f32 of x's shape, x read for its
// shape only.
inline void infer_index(const Graph& g, Node& n) {
  auto in = [&](int i) -> const Node& { return g.nodes[n.in[i]]; };
  switch (n.op) {  // dtypes: infer_dtype
    case Op::gather: {
      check_index_dtype(in(1), "gather", "indices");
      const Dims &xs = in(0).shape, &is = in(1).shape;
      if (xs.size() == 0 || xs.size() != is.size() || !std::equal(xs.begin(), xs.end() - 1, is.begin()))
        throw shape_error("gather: index shape " + is.str() + " does not match input shape " + xs.str());
      n.shape = is;
      return;
    }
    case Op::embedding: {
      check_index_dtype(in(1), "embedding", "ids");
      const Dims& ts = in(0).shape;
      if (ts.size() != 2)
        throw shape_error("embedding: the table must be [V, D], got " + ts.str() + " (ids " + in(1).shape.str() + ")");
      if (in(1).shape.size() + 1 > max_rank)
        throw shape_error("embedding: ids of shape " + in(1).shape.str() + " give more than " +
                          std::to_string(max_rank) + " dimensions");
      n.shape = in(1).shape;
      n.shape.push_back(ts[1]);
      return;
    }
    case Op::embedding_backward: {
      check_index_dtype(in(1), "embedding_backward", "ids");
      const Dims &gs = in(0).shape, &is = in(1).shape;
      if (gs.size() != is.size() + 1 || !std::equal(is.begin(), is.end(), gs.begin()))
        throw shape_error("embedding_backward: gradient " + gs.str() + " does not match ids " + is.str() +
                          " (it must be ids.shape + [D])");
      if (!is_floating(in(0).dt))
        throw dtype_error("embedding_backward: the gradient must be floating, got " + std::string(name(in(0).dt)));
      // The table's rows: its shape_of (a third input, the rule's), else attrs.a.
      n.shape = Dims{n.n_in == 3 && in(2).shape.size() ? in(2).shape[0] : n.attrs.a, gs.back()};
      return;
    }
    case Op::rand:
      n.shape = in(0).shape;
      return;
    default:
      throw error("infer_shapes: no index rule for op " + std::string(name(n.op)));
  }
}

}  // namespace kiln::graph::detail
