// Shape inference for views (reshape, permute, slice and their kind, expand) and for views sized
// from a shape_of node, and the shape of two tensors joined along a dim. Shared by graph inference
// (infer.hpp) and the eager views of tensors (views.hpp). Split from infer.hpp.
#pragma once
#include <algorithm>
#include <string>

#include "graph.hpp"

namespace kiln::graph::detail {

// An op's printed name, for error messages.
inline std::string op_str(Op op) { return std::string(name(op)); }

// A zero-padded reshape (attrs.keepdim; only schedule/split.hpp makes one, for the first stage of
// a split sum): [S, -1, t...] whose -1 rounds up, so that S chunks cover any number of leading
// positions; the output's elements past the input's are 0. The input's element count must be a
// multiple of the trailing t... (the kept elements), so that each chunk position is whole or absent.
inline Dims infer_padded_reshape(const Dims& in, const Dims& want) {
  Dims out = want;
  std::int64_t trailing = 1;
  for (int i = 2; i < want.size(); ++i) {
    if (Attrs::is_input_dim(want[i])) {  // the input's own size along a dim (split.hpp's kept length)
      const int d = Attrs::input_dim_of(want[i]);
      if (d >= in.size()) throw shape_error("reshape (padded): no dimension " + std::to_string(d) + " in " + in.str());
      out[i] = in[d];
    }
    trailing *= out[i];
  }
  if (want.size() < 2 || want[0] <= 0 || want[1] != -1 || trailing <= 0 || in.product() % trailing != 0)
    throw shape_error("reshape (padded): cannot pad a tensor of shape " + in.str() + " to " + want.str());
  const std::int64_t lead = in.product() / trailing;
  out[1] = (lead + want[0] - 1) / want[0];
  return out;
}

inline Dims infer_reshape(const Dims& in, const Dims& want, Op op) {
  Dims out = want;
  int infer = -1;
  std::int64_t known = 1;
  for (int i = 0; i < out.size(); ++i)  // a size that is the input's along a dim (the pipeline's own)
    if (Attrs::is_input_dim(out[i])) {
      const int d = Attrs::input_dim_of(out[i]);
      if (d >= in.size()) throw shape_error(op_str(op) + ": no dimension " + std::to_string(d) + " in " + in.str());
      out[i] = in[d];
    }
  for (int i = 0; i < out.size(); ++i) {
    if (out[i] == -1) {
      if (infer >= 0) throw shape_error(op_str(op) + ": only one dimension of " + want.str() + " may be -1");
      infer = i;
    } else if (out[i] < 0) {
      throw shape_error(op_str(op) + ": invalid size in " + want.str());
    } else {
      known *= out[i];
    }
  }
  if (infer >= 0 && known == 0)
    throw shape_error(op_str(op) + ": cannot reshape a tensor of shape " + in.str() + " to " + want.str() +
                      ": the -1 is ambiguous next to a size 0");
  if (infer >= 0 && in.product() % known == 0) out[infer] = in.product() / known;
  if (out.product() != in.product())
    throw shape_error(op_str(op) + ": cannot reshape a tensor of shape " + in.str() + " (" +
                      std::to_string(in.product()) + " elements) to " + want.str());
  return out;
}

// The shape of a view of a tensor of shape xs (views are index maps: no data moves). Normalises
// a permutation's dims in `at`. Shared by inference and the eager views of tensors (graph/views.hpp).
inline Dims view_shape(Op op, const Dims& xs, Attrs& at) {
  const int rank = xs.size();
  Dims out;
  switch (op) {
    case Op::reshape:
      return at.keepdim ? infer_padded_reshape(xs, at.dims) : infer_reshape(xs, at.dims, op);
    case Op::permute: {
      if (at.dims.size() != rank)
        throw shape_error("permute: order " + at.dims.str() + " does not match a tensor of shape " + xs.str());
      Dims seen;
      for (auto d : at.dims) {
        int nd = normalize_dim(d, rank, "permute");
        if (std::find(seen.begin(), seen.end(), nd) != seen.end())
          throw shape_error("permute: order " + at.dims.str() + " repeats a dimension");
        seen.push_back(nd);
        out.push_back(xs[nd]);
      }
      at.dims = seen;
      return out;
    }
    case Op::transpose: {
      int a = normalize_dim(at.a, rank, "transpose"), b = normalize_dim(at.b, rank, "transpose");
      out = xs;
      if (rank > 0) std::swap(out[a], out[b]);
      return out;
    }
    case Op::slice: {
      int d = normalize_dim(at.a, rank, "slice");
      if (at.d <= 0) throw shape_error("slice: step must be positive, got " + std::to_string(at.d));
      std::int64_t size = xs[d];
      auto clampi = [&](std::int64_t v) { return std::clamp<std::int64_t>(v < 0 ? v + size : v, 0, size); };
      std::int64_t start = clampi(at.b), stop = clampi(at.c);
      out = xs;
      out[d] = stop > start ? (stop - start + at.d - 1) / at.d : 0;
      return out;
    }
    case Op::slice_backward: {  // the gradient of a slice: attrs as slice's, dims = the sliced input's shape
      // Sizes of dims = Attrs::input_dim(i) are the input's own (the dims not sliced, which a
      // program with symbolic sizes then serves at any size); xs must be that slice of the rest: a
      // program lowered for another size of the sliced dim then fails.
      Dims full = at.dims;
      for (int i = 0; i < full.size(); ++i)
        if (Attrs::is_input_dim(full[i])) {
          const int d = Attrs::input_dim_of(full[i]);
          if (d >= rank) throw shape_error("slice_backward: no dimension " + std::to_string(d) + " in " + xs.str());
          full[i] = xs[d];
        }
      Attrs sliced = at;
      Dims part = full.size() ? view_shape(Op::slice, full, sliced) : full;
      if (!(part == xs))
        throw shape_error("slice_backward: gradient of shape " + xs.str() + " does not match the slice " + part.str() +
                          " of " + full.str());
      return full;
    }
    case Op::expand: {
      const Dims& want = at.dims;
      if (want.size() < rank)
        throw shape_error("expand: cannot expand shape " + xs.str() + " to fewer dimensions " + want.str());
      out = want;
      for (int i = 0; i < want.size(); ++i) {
        int j = i - (want.size() - rank);
        std::int64_t have = j >= 0 ? xs[j] : 1;
        if (want[i] == -1) {
          if (j < 0) throw shape_error("expand: -1 is not allowed for a new leading dimension in " + want.str());
          out[i] = have;
        } else if (have != 1 && have != want[i]) {
          throw shape_error("expand: cannot expand shape " + xs.str() + " to " + want.str());
        }
      }
      return out;
    }
    case Op::unsqueeze: {
      int d = normalize_dim(at.a, rank + 1, "unsqueeze");
      out = xs;
      out.insert(d, 1);
      return out;
    }
    case Op::squeeze: {
      if (at.all) {
        for (auto s : xs)
          if (s != 1) out.push_back(s);
      } else {
        int d = normalize_dim(at.a, rank, "squeeze");
        out = xs;
        if (rank > 0 && xs[d] == 1) out.erase(d);
      }
      return out;
    }
    default:
      throw error("view_shape: " + op_str(op) + " is not a view");
  }
}

// A view sized from another node: its second input, a shape_of node of shape `s` (read for that
// alone), gives the sizes that its attributes would otherwise name, so that a program with symbolic
// sizes serves every value of them (a cat's joined dim, a slice's input, a reduction's broadcast
// cotangent). expand(x, s): x broadcast to s. slice_backward(x, s): x placed into zeros of shape s
// along attrs.a, from the start attrs.b (clamped, as a slice's) with step attrs.d, or with
// attrs.keepdim against the end (a cat's second part). slice(x, s): the part of x of s's size along
// attrs.a, from the start attrs.b with step attrs.d, or with attrs.keepdim the last ones.
inline Dims sized_view_shape(Op op, const Dims& xs, const Dims& s, const Attrs& at) {
  auto fail = [&](const std::string& why) {
    throw shape_error(op_str(op) + ": cannot view shape " + xs.str() + " as sized by " + s.str() + ": " + why);
  };
  switch (op) {
    case Op::expand: {
      if (xs.size() > s.size()) fail("fewer dimensions");
      for (int i = 0; i < xs.size(); ++i)
        if (xs[i] != 1 && xs[i] != s[s.size() - xs.size() + i]) fail("a dimension neither 1 nor the size");
      return s;
    }
    case Op::slice:
    case Op::slice_backward: {
      const Dims& full = op == Op::slice ? xs : s;
      const Dims& part = op == Op::slice ? s : xs;
      if (full.size() != part.size() || full.size() == 0) fail("ranks differ");
      const int d = normalize_dim(at.a, full.size(), op == Op::slice ? "slice" : "slice_backward");
      for (int i = 0; i < full.size(); ++i)
        if (i != d && full[i] != part[i]) fail("sizes differ off dim " + std::to_string(d));
      if (at.d <= 0 || (at.keepdim && at.d != 1)) fail("step " + std::to_string(at.d));
      const std::int64_t size = full[d];
      const std::int64_t start =
          at.keepdim ? size - part[d] : std::clamp<std::int64_t>(at.b < 0 ? at.b + size : at.b, 0, size);
      if (start < 0 || (part[d] > 0 && start + (part[d] - 1) * at.d >= size)) fail("the part runs past the end");
      Dims out = full;
      out[d] = part[d];
      return op == Op::slice ? out : full;
    }
    default:
      throw error("view_shape: " + op_str(op) + " takes no size source");
  }
}

// The shape of x and y joined along dim d (k::cat's, and a shape_of of two inputs): the same rank,
// at least 1, and the same sizes off d. `op` names the node in the errors.
inline Dims joined_shape(const std::string& op, const Dims& xs, const Dims& ys, std::int64_t dim) {
  const int rank = xs.size();
  if (rank == 0 || ys.size() != rank)
    throw shape_error(op + ": cannot join shapes " + xs.str() + " and " + ys.str() +
                      " (operands need the same rank, at least 1)");
  const int d = normalize_dim(dim, rank, op.c_str());
  for (int i = 0; i < rank; ++i)
    if (i != d && xs[i] != ys[i])
      throw shape_error(op + ": shapes " + xs.str() + " and " + ys.str() + " differ in dimension " + std::to_string(i) +
                        ", not only in the joined dimension " + std::to_string(d));
  Dims out = xs;
  out[d] = xs[d] + ys[d];
  return out;
}

}  // namespace kiln::graph::detail
