// Emission of values: a node's value at an index, as a C++ expression bound to a tmpN (memoised
// by loop scope), from loads, scalars, views, pointwise ops and index ops; the kernel writer's
// loops (kernel_writer_impl.hpp) call it for what they reduce and store.
#pragma once
#include "kernel_writer.hpp"

namespace kiln::codegen {

inline KernelWriter::Value KernelWriter::emit(int node, const std::vector<Sym>& idx, const std::string& extra_mask) {
  std::string key = std::to_string(scope_) + ":" + std::to_string(node) + ":" + extra_mask;
  for (auto& i : idx) {
    key += ',';
    key += i.str();
  }
  auto it = memo_.find(key);
  if (it != memo_.end()) return it->second;
  // CPU rows held across loops: a special function's tiles computed by an earlier loop are kept
  // (softmax's exp(x - max) of the sum's loop, read again by the output's), not evaluated twice.
  const bool keep = target_ == Target::cpu && rows() && in_rloop_ && config_.riters > 0 &&
                    is_transcendental(g_[node].op) && !(s_.realized[node] && s_.kernel_of[node] != k_) &&
                    tune_.keep_values != 0;
  const std::string vkey = keep ? key.substr(key.find(':') + 1) : std::string();  // without the loop's scope
  auto kept = keep ? kept_values_.find(vkey) : kept_values_.end();
  if (kept != kept_values_.end() && kept_loop_[vkey] != loop_id_)
    return memo_[key] = bind_held(kept->second + "[kiln_it]", compute_dtype(g_[node].dt));
  Value v = emit_uncached(node, idx, extra_mask);
  memo_[key] = v;
  // A kept value may be a row's scalar: a special function of a row-uniform load (row_scalars()),
  // or of an index that only xindex moves (ALiBi's head slope, exp2 of (xindex / T) % H).
  const std::string kept_code = "kiln::as_tile<RVEC>(" + v.code + ")";
  if (kept != kept_values_.end() && !v.literal) {  // the other half of the loop that keeps it
    line(kept->second + "[kiln_it] = " + kept_code + ";");
  } else if (keep && !final_loop_ && !v.literal) {
    std::string name = "kept" + std::to_string(kept_values_.size());
    kept_values_[vkey] = name;
    kept_loop_[vkey] = loop_id_;
    cache_decls_.push_back("kiln::tile<" + detail::c_type(v.ct) + ", RVEC> " + name + "[RITERS];");
    cached_cost_ += held_cost(static_cast<std::int64_t>(itemsize(v.ct)));
    line(name + "[kiln_it] = " + kept_code + ";");
  }
  return v;
}

inline KernelWriter::Value KernelWriter::emit_uncached(int node, const std::vector<Sym>& idx, const std::string& xm) {
  const auto& n = g_[node];
  kiln::dtype ct = compute_dtype(n.dt);
  bool own = s_.kernel_of[node] == k_;
  if (n.op == Op::arg || (s_.realized[node] && !own)) return load(node, idx, xm);
  if (auto r = reduced_.find(node); r != reduced_.end()) return r->second;
  auto child = [&](int i) { return emit(n.in[i], broadcast_index(n.in[i], node, idx), xm); };
  switch (info(n.op).cls) {
    case OpClass::leaf:
      if (n.op == Op::scalar) {
        std::string sc = scalar_param(n.slot);
        return n.floating ? Value{sc, kiln::dtype::f64} : Value{"((i64)" + sc + ")", kiln::dtype::i64};
      }
      if (n.op == Op::constant) return {detail::literal(n.value, kiln::dtype::f64), kiln::dtype::f64, true, n.value};
      if (n.op == Op::iota) return bind("kiln::cast<i64>(" + index_code(idx[n.attrs.a]) + ")", kiln::dtype::i64);
      break;
    case OpClass::meta: {  // iota_of: an index, as iota's; numel of the reduced dims of its input
      if (n.op == Op::shape_of) throw error("codegen: shape_of has no value (only views sized from it read it)");
      if (n.op == Op::iota_of) return bind("kiln::cast<i64>(" + index_code(idx[n.attrs.a]) + ")", kiln::dtype::i64);
      const auto& in = g_[n.in[0]];
      Sym count(1);
      for (int d = 0; d < in.shape.size(); ++d) {
        bool r = n.attrs.all || std::find_if(n.attrs.dims.begin(), n.attrs.dims.end(), [&](std::int64_t x) {
                                  return (x < 0 ? x + in.shape.size() : x) == d;
                                }) != n.attrs.dims.end();
        if (r) count = count * env_[n.in[0]][d];
      }
      if (count.is_constant())
        return {detail::literal(double(count.constant_value()), kiln::dtype::f64), kiln::dtype::f64, true,
                double(count.constant_value())};
      return {"((double)(" + index_code(count) + "))", kiln::dtype::f64};
    }
    case OpClass::unary:
    case OpClass::binary:
    case OpClass::ternary: {  // c_text.hpp's pointwise_code over the operands' values
      std::vector<Value> in;
      for (int i = 0; i < n.n_in; ++i) in.push_back(child(i));
      const std::optional<std::string> code = detail::pointwise_code(g_, n, in);
      return code ? bind(*code, ct) : in[0];  // (a cast within a compute dtype: the operand)
    }
    case OpClass::view:
      if (n.op == Op::slice_backward) {  // zero outside the sliced positions of the input
        int d = static_cast<int>(n.attrs.a < 0 ? n.attrs.a + n.shape.size() : n.attrs.a);
        Sym start = slice_start(node, n.shape), step = slice_step(node), count = env_[n.in[0]][d];
        Sym rel = idx[d] - start;
        // (Tested once, at the first lane, where it holds for all of a tile's lanes or for none.)
        const bool uniform = step == Sym(1) && uniform_on_lanes(rel, count);
        std::string r = "(" + (uniform ? at_first_lane(rel) : index_code(rel)) + ")";
        std::string inside = bind(uniform ? "(" + r + " >= 0) & (" + r + " < " + index_code(count) + ")"
                                          : "(" + r + " >= 0) & (" + r + " % " + index_code(step) + " == 0) & (" + r +
                                                " < " + index_code(count * step) + ")",
                                  kiln::dtype::boolean)
                                 .code;
        // The input's index where `inside` holds; a lane outside reads nothing (its loads are
        // masked), so a unit step keeps the index linear (contiguous runs load as vectors).
        std::vector<Sym> in_idx = idx;
        in_idx[d] = step == Sym(1) ? rel : floordiv(max(rel, Sym(0)), step);
        Value v = emit(n.in[0], in_idx, xm.empty() ? inside : "(" + xm + " & " + inside + ")");
        return bind("kiln::where(" + inside + ", " + v.code + ", " + detail::literal(0, v.ct) + ")", ct);
      }
      if (n.op == Op::reshape && n.attrs.keepdim) {  // zero-padded [S, C, t...]: chunk positions past the input read 0
        const std::vector<Sym>& out = env_[node];
        const Sym count = ir::padded_positions(env_[n.in[0]], out);  // the input's chunk positions
        Sym trailing(1);
        for (std::size_t d = 2; d < out.size(); ++d) trailing = trailing * out[d];
        if (count == out[0] * out[1]) return emit(n.in[0], view_index(node, idx), xm);  // no padding at these sizes
        // Positions past the input give 0. Where a tile's lanes run along t... the test is the same
        // for all of them (made once, at the first lane) and those positions read the input's last
        // chunk position (clamped: in bounds, and loads stay vectors and row scalars); where the
        // lanes run along the chunk (a full sum's [S, C]), its loads are masked lane by lane.
        // The test is idx1 < count - idx0 * C: its right side does not change along the chunk
        // (a column program's loop over it keeps it out of the loop). (Not bound to a temporary:
        // the test is part of the load's text, the same in both halves of a host row split at its
        // last whole vector, whose register caches are keyed by it.)
        const Sym lead = idx[0] * out[1] + idx[1], left = count - idx[0] * out[1];
        const bool uniform = uniform_on_lanes(lead, count);
        const std::string inside = "(" +
                                   (uniform ? at_first_lane(idx[1]) + " < " + at_first_lane(left)
                                            : index_code(idx[1]) + " < " + index_code(left)) +
                                   ")";
        std::vector<Sym> at(idx.begin() + 2, idx.end());
        const Sym flat = (uniform ? min(lead, count - Sym(1)) : lead) * trailing +
                         ravel(at, contiguous_strides(std::vector<Sym>(out.begin() + 2, out.end())));
        Value v = emit(n.in[0], unravel(flat, detail::nonzero(env_[n.in[0]]), true),
                       uniform      ? xm
                       : xm.empty() ? inside
                                    : "(" + xm + " & " + inside + ")");
        return bind("kiln::where(" + inside + ", " + v.code + ", " + detail::literal(0, v.ct) + ")", ct);
      }
      return emit(n.in[0], view_index(node, idx), xm);
    case OpClass::index: {
      if (n.op == Op::rand) {  // Philox of the element's row-major position; x gives only the shape
        Sym pos = ravel(idx, contiguous_strides(env_[node]));
        std::vector<std::string> words;
        for (int k = 1; k <= 4; ++k) words.push_back(cast(child(k), kiln::dtype::i64).code);
        return bind("kiln::rand_uniform(" + words[0] + ", " + words[1] + ", " + words[2] + ", " + words[3] + ", " +
                        index_code(pos) + ")",
                    ct);
      }
      if (n.op == Op::embedding) {  // table[ids[idx[:-1]], idx[-1]]: the table is a buffer
        std::vector<Sym> at(idx.begin(), idx.end() - 1);
        Value id = cast(emit(n.in[1], at, xm), kiln::dtype::i64);
        int src = n.in[0];
        std::vector<Sym> strides = strides_of_(src);
        std::string ptr = param_for(src, false);
        std::string inb =
            bind("(" + id.code + " >= 0) & (" + id.code + " < " + index_code(env_[src][0]) + ")", kiln::dtype::boolean)
                .code;
        std::string off = id.code + " * " + index_code(strides[0]) + " + " + index_code(idx.back() * strides[1]);
        return bind("kiln::load(" + ptr + ", " + off + ", " + load_mask(xm) + " & " + inb + ")", ct);
      }
      // gather along the last dim: the source is a buffer
      Value t = cast(child(1), kiln::dtype::i64);
      int src = n.in[0];
      std::vector<Sym> base = idx;
      base.back() = Sym(0);
      std::vector<Sym> strides = strides_of_(src);
      std::string ptr = param_for(src, false);
      std::string inb =
          bind("(" + t.code + " >= 0) & (" + t.code + " < " + index_code(env_[src].back()) + ")", kiln::dtype::boolean)
              .code;
      std::string off = index_code(ravel(base, strides)) + " + " + t.code + " * " + index_code(strides.back());
      return bind("kiln::load(" + ptr + ", " + off + ", " + load_mask(xm) + " & " + inb + ")", ct);
    }
    default:
      break;
  }
  throw error("codegen: cannot inline " + std::string(name(n.op)) + " (node %" + std::to_string(node) + ")");
}

}  // namespace kiln::codegen
