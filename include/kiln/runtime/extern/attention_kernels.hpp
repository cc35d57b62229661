// Which fused attention kernel a graph node runs: whether the fused kernels take its operands
// (attention_flash_fits, lowering's test), its scale and score_mod arguments, the forward's and the
// backward's kernel configurations, and the source a report shows for the node. The launches are
// attention.hpp's.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "../../autodiff/score_mod.hpp"
#include "../../codegen/attention_backward_kernel_sm90.hpp"
#include "../../codegen/attention_kernel.hpp"
#include "../../codegen/attention_kernel_sm90_pingpong.hpp"
#include "../../core/error.hpp"
#include "../../core/tensor.hpp"
#include "../../graph/graph.hpp"
#include "../../graph/infer_attention.hpp"

namespace kiln::runtime {

// Whether the fused kernel runs attention over these operands: 16-bit q, k and v of one dtype, one
// head dim for all three, a multiple of 16 up to 128 (the registers a warp holds for 16 rows),
// tensor cores with 16-bit mma (compute capability 8.0+).
inline bool attention_flash_fits(const Dims& q, const Dims& k, const Dims& v, dtype dt, int compute_capability) {
  if (dt != dtype::bf16 && dt != dtype::f16) return false;
  if (q.size() != 4 || k.size() != 4 || v.size() != 4 || compute_capability < 80) return false;
  return graph::detail::fused_attention_head_dims(q, k, v);
}

// The first input of a fused attention node that is a tensor its score_mod reads (the inputs
// after it are the others): after attention_flash's q, k, v and scale, attention_lse's q, k and
// scale, attention_grad's q, k, v, the cotangent, the statistics and the scale.
inline int first_captured_input(const graph::Node& n) {
  return n.op == Op::attention_flash ? 4 : n.op == Op::attention_lse ? 3 : 6;
}
// The node of a fused attention node's scale: its input before those.
inline int attention_scale_node(const graph::Node& n) { return n.in[first_captured_input(n) - 1]; }
// The scale it runs with: the scalar when the user gave one (attrs.b), else 1/sqrt(D).
inline double attention_scale(const graph::Graph& g, const graph::Node& n, const double* scalars, std::int64_t D) {
  if (!n.attrs.b) return 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1)));
  const graph::Node& s = g[attention_scale_node(n)];
  return s.op == Op::scalar ? scalars[s.slot] : s.value;
}

// A score_mod as a launch reads it: the registered mod (null: none) and the kernels' last
// parameter, a kiln_score_scalars by value (codegen/score_mod_source.hpp): this call's values of
// the C++ scalars it reads, then the address of each tensor it reads and its strides along the
// scores' [B, H, Tq, Tk] (0 where it is broadcast).
struct ScoreModCall {
  const autodiff::ScoreMod* mod = nullptr;
  std::vector<std::uint64_t> params;
};
// The score_mod a fused attention node inlines (attrs.custom: its id in autodiff::ScoreMods, -1
// none); with this call's scalars and the node's captured inputs (`captured`), its parameters for
// scores of shape `scores` ([B, H, Tq, Tk]).
inline ScoreModCall score_mod_call(const graph::Node& n, const double* scalars = nullptr,
                                   const std::vector<const Tensor*>& captured = {}, const Dims& scores = {}) {
  if (n.attrs.custom < 0) return {};
  const autodiff::ScoreMod& m = autodiff::ScoreMods::instance().get(n.attrs.custom);
  ScoreModCall c{&m, {}};
  if (scores.size() != 4) return c;  // (the source alone)
  if (captured.size() != m.captured.size())
    throw error("attention: the score_mod reads " + std::to_string(m.captured.size()) + " tensors, the node has " +
                std::to_string(captured.size()));
  const std::size_t nv = std::max<std::size_t>(m.slots.size(), 1), nt = std::max<std::size_t>(m.captured.size(), 1);
  c.params.assign(nv + nt * 5, 0);
  for (std::size_t k = 0; k < m.slots.size() && scalars; ++k)
    std::memcpy(&c.params[k], &scalars[m.slots[k]], sizeof(double));
  for (std::size_t t = 0; t < captured.size(); ++t) {
    const Tensor& x = *captured[t];
    bool fits = x.dim() <= 4 && x.dtype() == m.captured_dt[t];
    for (int d = 0; fits && d < x.dim(); ++d) fits = x.shape()[d] == 1 || x.shape()[d] == scores[4 - x.dim() + d];
    if (!fits)
      throw shape_error("attention: a tensor the score_mod reads is " + x.shape().str() + " " +
                        std::string(name(x.dtype())) + ", not " + std::string(name(m.captured_dt[t])) +
                        " broadcast to the scores' " + scores.str() +
                        " (sizes changed under dynamic shapes): compile it again");
    c.params[nv + t] = reinterpret_cast<std::uintptr_t>(x.data_ptr());
    for (int d = 0; d < 4; ++d) {  // right-aligned against [B, H, Tq, Tk]
      const int xd = d - (4 - x.dim());
      const bool along = xd >= 0 && x.shape()[xd] != 1;
      c.params[nv + nt + 4 * t + static_cast<std::size_t>(d)] = along ? static_cast<std::uint64_t>(x.strides()[xd]) : 0;
    }
  }
  return c;
}

// The forward kernel for head dim D: `warps` warps a block and `row_tiles` 16-row tiles a warp
// (0: AttentionKernel::for_head_dim's choice), or Hopper's warpgroup kernel where `hopper` and it
// takes D (hopper 1: two warpgroups a block, 2: one, 3: two fed by a producer warpgroup, 4: three at D 64
// fed by one, 5: 4's looping, one block an SM, 6: 5 taking tiles from a counter; attention_flash's
// attrs.dims[1]); either inlines the score_mod `mod` (null: none).
inline codegen::AttentionKernel attention_kernel_for(std::int64_t D, int warps, int row_tiles, int hopper, bool causal,
                                                     dtype dt, const autodiff::ScoreMod* mod = nullptr) {
  codegen::AttentionKernel a = codegen::AttentionKernel::for_head_dim(static_cast<int>(D), row_tiles);
  a.warps = warps;
  a.causal = causal;
  a.dt = dt;
  if (mod) a.score_mod = mod->source, a.score_mod_tag = mod->tag;
  if (!hopper) return a;
  const int warpgroups = hopper == 2 ? 1 : hopper >= 4 ? 3 : 2;
  return codegen::AttentionKernel::hopper(a, warpgroups, hopper >= 3, hopper >= 5, hopper == 6);
}
// An attention_flash node's: attrs.d warps, attrs.dims {row tiles, Hopper}, attrs.custom its mod.
inline codegen::AttentionKernel attention_kernel_of(const graph::Graph& g, const graph::Node& n) {
  const Dims& d = n.attrs.dims;
  return attention_kernel_for(g[n.in[0]].shape[3], static_cast<int>(n.attrs.d), static_cast<int>(d[0]),
                              d.size() > 1 ? static_cast<int>(d[1]) : 0, n.attrs.a != 0, g[n.in[0]].dt,
                              score_mod_call(n).mod);
}
// A backward kernel: Hopper's warpgroup kernels for dq and dk/dv where `hopper` and they take D;
// either kind inlines the score_mod `mod` (null: none).
inline codegen::AttentionBackwardKernel attention_backward_kernel_for(codegen::AttentionBackwardKernel::Part part,
                                                                      std::int64_t D, bool causal, bool hopper,
                                                                      dtype dt,
                                                                      const autodiff::ScoreMod* mod = nullptr) {
  using Part = codegen::AttentionBackwardKernel::Part;
  codegen::AttentionBackwardKernel a;
  a.part = part;
  a.head_dim = static_cast<int>(D);
  a.causal = causal;
  a.dt = dt;
  if (mod) a.score_mod = mod->source, a.score_mod_tag = mod->tag;
  a.hopper = hopper && (part == Part::dq || part == Part::dkv || part == Part::dqkv) && (D == 64 || D == 128);
  static const bool tma = Tuning::from_environment().attention_bwd_tma == 1;  // an A/B knob: see Tuning
  a.tma = a.hopper && tma;
  return a;
}
inline std::string describe_attention_step(const graph::Graph& g, int node) {
  const graph::Node& n = g[node];
  if (n.op == Op::attention_flash) {
    codegen::AttentionKernel a = attention_kernel_of(g, n);
    std::string source = codegen::attention_forward_kernel_source(a);
    // The scale's sign is a call's (a run-time scalar): attention_flash picks the _scaled kernel for one
    // that is not positive, and the report names it.
    if (a.warpgroups > 0 && !score_mod_call(n).mod) {
      a.raw_max = false;
      source = "// with a scale that is not positive: " + a.name() + "\n" + source;
    }
    return source;
  }
  codegen::AttentionBackwardKernel a = attention_backward_kernel_for(
      n.op == Op::attention_lse ? codegen::AttentionBackwardKernel::Part::stats
                                : static_cast<codegen::AttentionBackwardKernel::Part>(n.attrs.c + 1),
      g[n.in[0]].shape[3], n.attrs.a != 0, n.op == Op::attention_grad && n.attrs.d != 0, g[n.in[0]].dt,
      score_mod_call(n).mod);
  return codegen::attention_backward_kernel_source(a);
}

}  // namespace kiln::runtime
