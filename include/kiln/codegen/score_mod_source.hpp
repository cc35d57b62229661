// A score_mod (autodiff/score_mod.hpp) as C for the fused attention kernels: two functions of one
// score, written with the prelude's scalar operations as generated kernels spell them (c_text.hpp):
//   float kiln_score_mod(float s, i64 b, i64 h, i64 i, i64 j, const kiln_score_scalars& S)
//   float kiln_score_mod_vjp(float s, i64 b, i64 h, i64 i, i64 j, const kiln_score_scalars& S, float ct)
// the modded score, and the cotangent of the score given the modded score's. S holds the C++
// scalars the mod reads (ScoreMod::slots order), which change between calls without a recompile,
// and the tensors it reads (ScoreMod::captured), each element loaded where the score needs it.
#pragma once
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "../autodiff/score_mod.hpp"
#include "c_text.hpp"

namespace kiln::codegen {

namespace detail {

// The body of one function: a line a node (pointwise ones as generated kernels spell them:
// c_text.hpp's pointwise_code), the graph's output returned as f32.
inline std::string mod_body(const graph::Graph& g, const std::vector<int>& slots) {
  static const char* params[] = {"s", "b", "h", "i", "j", "ct"};
  std::vector<CValue> v(static_cast<std::size_t>(g.size()));
  std::string body;
  auto bind = [&](int id, const std::string& expr, kiln::dtype ct) {
    const std::string name = "v" + std::to_string(id);
    body += "  const " + c_type(ct) + " " + name + " = " + expr + ";\n";
    return CValue{name, compute_dtype(ct)};
  };
  for (int id = 0; id < g.size(); ++id) {
    const graph::Node& n = g[id];
    const kiln::dtype ct = compute_dtype(n.dt);
    auto in = [&](int k) { return v[static_cast<std::size_t>(n.in[k])]; };
    CValue& out = v[static_cast<std::size_t>(id)];
    if (n.op == Op::arg && n.slot >= autodiff::ScoreMod::first_captured_arg) {  // a tensor's element at (b, h, i, j)
      const std::string k = std::to_string(n.slot - autodiff::ScoreMod::first_captured_arg);
      const std::string at = "S.t[" + k + "])[b * S.st[" + k + "][0] + h * S.st[" + k + "][1] + i * S.st[" + k +
                             "][2] + j * S.st[" + k + "][3]]";
      const std::string load = "((const " + storage_c_type(n.dt) + "*)" + at;
      out =
          bind(id, n.dt == kiln::dtype::f16 || n.dt == kiln::dtype::bf16 ? "kiln::to_compute(" + load + ")" : load, ct);
    } else if (n.op == Op::arg) {
      out = {params[n.slot], n.dt};
    } else if (n.op == Op::constant) {
      out = {literal(n.value, kiln::dtype::f64), kiln::dtype::f64, true, n.value};
    } else if (n.op == Op::scalar) {
      const auto at = std::find(slots.begin(), slots.end(), n.slot) - slots.begin();
      const std::string s = "S.v[" + std::to_string(at) + "]";
      out = n.floating ? CValue{s, kiln::dtype::f64} : CValue{"((i64)" + s + ")", kiln::dtype::i64};
    } else if (n.op == Op::div && ct == kiln::dtype::f32) {
      // Not C's `/` on floats, an IEEE division (a reciprocal, four FMAs and a slow path at every
      // score): by a divisor the same at every score (a C++ scalar, a constant) x times its
      // reciprocal, taken in double where the kernel hoists it out of its loops (within 1 ulp of
      // the quotient); else div.full, as the generated kernels' tiles divide (prelude m_div).
      const CValue x = cast_value(in(0), ct), d = in(1);
      const Op by = g[n.in[1]].op;
      out = d.literal          ? bind(id, x.code + " * " + literal(1.0 / d.value, ct), ct)
            : by == Op::scalar ? bind(id, x.code + " * (float)(1.0 / (double)" + d.code + ")", ct)
                               : bind(id, "kiln::div(" + x.code + ", " + cast_value(d, ct).code + ")", ct);
    } else {
      std::vector<CValue> operands;
      for (int k = 0; k < n.n_in; ++k) operands.push_back(in(k));
      const std::optional<std::string> code = pointwise_code(g, n, operands);
      out = code ? bind(id, *code, ct) : operands[0];  // (a cast within a compute dtype: the operand)
    }
  }
  return body + "  return " + cast_value(v[static_cast<std::size_t>(g.outputs.at(0))], kiln::dtype::f32).code + ";\n";
}

}  // namespace detail

// Both functions and the struct of scalars they read, for a source that begins with the prelude.
inline std::string score_mod_source(const autodiff::ScoreMod& m) {
  const std::size_t scalars = std::max<std::size_t>(m.slots.size(), 1),
                    tensors = std::max<std::size_t>(m.captured.size(), 1);
  std::string s = "// the score_mod (autodiff/score_mod.hpp), inlined where each score is computed\n";
  s += "// S: its C++ scalars, and each tensor it reads with its strides along [B, H, Tq, Tk] (0: broadcast)\n";
  s += "struct kiln_score_scalars { double v[" + std::to_string(scalars) + "]; const void* t[" +
       std::to_string(tensors) + "]; i64 st[" + std::to_string(tensors) + "][4]; };\n";
  s += "KILN_FN float kiln_score_mod(float s, i64 b, i64 h, i64 i, i64 j, const kiln_score_scalars& S) {\n";
  s += "  (void)s, (void)b, (void)h, (void)i, (void)j, (void)S;\n" + detail::mod_body(m.mod, m.slots) + "}\n";
  s += "KILN_FN float kiln_score_mod_vjp(float s, i64 b, i64 h, i64 i, i64 j, const kiln_score_scalars& S, "
       "float ct) {\n";
  s += "  (void)s, (void)b, (void)h, (void)i, (void)j, (void)S, (void)ct;\n" + detail::mod_body(m.vjp, m.slots) + "}\n";
  return s;
}

}  // namespace kiln::codegen
