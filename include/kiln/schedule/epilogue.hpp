// choose_epilogues: which matmuls take the bias add and activation that follow them as a library
// epilogue (cuBLASLt's BIAS, RELU_BIAS, GELU_BIAS, GELU_AUX_BIAS, ...) instead of a fused pointwise
// kernel: out = act(a @ b + bias) as one extern step. CUDA only; the CPU keeps its matmul and fused
// kernels. KILN_TUNE_EPILOGUE=0 turns it off, =1 takes DGELU with BGRAD, =2 keeps the forward's
// only, =3 (the default) takes DGELU without BGRAD (core/tuning.hpp).
//
// The pattern is recognised on the primitive graph, after decomposition and differentiation, not
// marked on the composite before it: the backward of a fused gelu needs its pre-activation, which
// only the joint graph shows, and the CPU path, the reference evaluator and the derivative rules
// then never see a new op. The activation is recognised by building what its decomposition rule
// (rewrite/decompose.hpp) builds from the candidate pre-activation with the graph's own CSE Builder:
// when every node of it is already in the graph the Builder returns the existing one, and that node
// is the activation. The rule stays the one place the formula is written; cuBLASLt's GELU is the
// tanh form, so exact gelu (erf) never matches and stays a fused pointwise kernel.
//
// A matmul qualifies when its product has no other reader; its bias is a floating vector of N
// broadcast over the rows; the dtypes are f32/f16/bf16 with the step's output in the product's
// dtype or f32 (cuBLASLt's D type; the bias is converted to it, as the graph's promotion does); and
// the activation's inner values have no other reader. When the pre-activation is read elsewhere (a
// gelu's backward reads it), gelu keeps it through GELU_AUX, which stores it beside the output; its
// leading dimension must be a multiple of 8 (cuBLASLt's rule), so N must be a static multiple of 8.
// Otherwise only the bias is taken (relu's AUX is a bit mask, not the value), and the activation
// stays in the kernels that read it. Never worse than the fused kernel: the step writes what the
// pointwise kernel would have, and its readers load one stored value instead of a product and a bias.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "../autodiff/rules.hpp"
#include "../ir/shape_env.hpp"
#include "../rewrite/decompose.hpp"

namespace kiln::schedule {

// What a matmul step applies to its product before storing it, as cuBLASLt's epilogues do:
// out = act(matmul + bias). The nodes are the graph's own (the pattern was recognised on the
// primitives), so the reference evaluator and the CPU path never see anything new.
// dgelu_tanh: the backward's GEMM of a gelu's input gradient, out = (a @ b) * gelu'(pre), pre the
// pre-activation a GELU_AUX step kept (cuBLASLt's DGELU).
enum class Activation : std::uint8_t { none, relu, gelu_tanh, dgelu_tanh };
inline const char* activation_name(Activation a) {
  constexpr const char* names[] = {"none", "relu", "gelu_tanh", "dgelu_tanh"};
  return names[static_cast<int>(a)];
}
struct MatmulEpilogue {
  int matmul = -1;  // the matmul node (it gets no buffer: its product is never stored)
  int bias = -1;    // the added vector of N (shape [N] or [1, ..., N]), -1 for none
  int pre = -1;     // the pre-activation: the bias add, or the matmul when there is no bias
  int out = -1;     // what the step stores: the activation's result, or pre
  Activation act = Activation::none;
  bool aux = false;  // pre is stored too (cuBLASLt's GELU_AUX): other kernels read it
  int aux_in = -1;   // dgelu_tanh: the kept pre-activation the step reads (DGELU's AUX input)
  std::vector<int> bias_sums;  // dgelu_tanh: the nodes of out's column sums, which the step writes too (BGRAD)
  // The column sums the step stores (bias_sums' last), -1 for none.
  int bias_grad() const { return bias_sums.empty() ? -1 : bias_sums.back(); }
  // The step's name in kernel names and reports: "bias_gelu_tanh", "relu", "bias".
  std::string str() const {
    std::string s = bias >= 0 ? "bias" : "";
    if (act != Activation::none) s += (s.empty() ? "" : "_") + std::string(activation_name(act));
    return s + (aux ? "_aux" : "") + (bias_sums.empty() ? "" : "_bgrad");
  }
};


namespace detail {

// Who reads each node, once per read (-1: the graph returns it).
// (A numel reads only its input's shape, which stays known when the input gets no buffer: mean's
// divisor, numel(matmul) after CSE, took a gradient program's GEMM out of its epilogue.)
inline std::vector<std::vector<int>> readers_of(const graph::Graph& g) {
  std::vector<std::vector<int>> r(g.size());
  for (int i = 0; i < g.size(); ++i)
    if (info(g[i].op).cls != OpClass::meta)
      for (int c = 0; c < g[i].n_in; ++c) r[g[i].in[c]].push_back(i);
  for (int o : g.outputs) r[o].push_back(-1);
  return r;
}

constexpr bool epilogue_dtype(kiln::dtype d) { return d == kiln::dtype::f32 || d == kiln::dtype::f16 || d == kiln::dtype::bf16; }

// The bias that add node u adds to matmul m: u's other operand, when it is a floating vector of N
// broadcast over m's rows (u has m's shape). -1 otherwise.
inline int bias_of(const graph::Graph& g, int m, int u) {
  const graph::Node& add = g[u];
  if (add.op != Op::add || !(add.shape == g[m].shape)) return -1;
  const int v = add.in[0] == m ? add.in[1] : add.in[0];
  const graph::Node& b = g[v];
  const std::int64_t n = g[m].shape.back();
  bool vector_of_n = b.shape.size() >= 1 && b.shape.back() == n && b.shape.product() == n;
  return vector_of_n && is_floating(b.dt) && !b.weak ? v : -1;
}

// The node of the graph that applies `op` (relu, or the composite gelu_tanh as decomposed) to pre,
// or -1 when the graph has none. `b` holds a copy of the graph: ids below `size` are the graph's.
inline int activation_of(rewrite::Builder& b, int size, int pre, Op op) {
  graph::Node n;
  n.op = op;
  n.in[0] = pre;
  n.n_in = 1;
  n.dt = b.dt(pre);
  n.shape = b.shape(pre);
  int id = op == Op::relu ? b.op(Op::relu, {pre}) : rewrite::detail::decompose_node(b, n, std::span<const int>(&pre, 1));
  return id < size ? id : -1;
}

// The nodes of v's tree (v too) down to those where stop(node) holds, leaves out.
template <class Stop>
std::vector<int> tree_above(const graph::Graph& g, int v, Stop&& stop) {
  std::vector<int> inside, stack{v};
  while (!stack.empty()) {
    const int x = stack.back();
    stack.pop_back();
    if (stop(x) || info(g[x].op).cls == OpClass::leaf || std::find(inside.begin(), inside.end(), x) != inside.end())
      continue;
    inside.push_back(x);
    for (int c = 0; c < g[x].n_in; ++c) stack.push_back(g[x].in[c]);
  }
  return inside;
}

// The nodes an activation computes between pre and its result: out's tree down to pre, leaves out.
inline std::vector<int> inner_nodes(const graph::Graph& g, int pre, int out) {
  std::vector<int> inside = tree_above(g, out, [&](int x) { return x == pre; });
  inside.erase(inside.begin());  // (out, visited first)
  return inside;
}

// Whether pre or an inner node of its activation has a reader outside the activation (or is returned).
inline bool read_elsewhere(const std::vector<std::vector<int>>& readers, int pre, const std::vector<int>& inside, int out) {
  auto within = [&](int r) { return r == out || std::find(inside.begin(), inside.end(), r) != inside.end(); };
  for (int v : inside)
    for (int r : readers[v])
      if (!within(r)) return true;
  for (int r : readers[pre])
    if (!within(r)) return true;
  return false;
}

// k::assign writes node v into an argument: the step must not write there while reading its operands.
inline bool assigned(const graph::Graph& g, int v) {
  for (std::size_t o = 0; o < g.outputs.size() && o < g.output_into.size(); ++o)
    if (g.outputs[o] == v && g.output_into[o] >= 0) return true;
  return false;
}

// GELU_AUX's leading dimension (N, the stored pre-activation being contiguous) must be a multiple of
// 8; a symbolic N may not be one at a later call.
inline bool aux_layout_ok(const ir::ShapeEnv& env, int pre) {
  const Sym& n = env[pre].back();
  return n.is_constant() && n.constant_value() % 8 == 0;
}

// The epilogue of matmul m, if it has one worth a step (a bias, an activation or both).
inline std::optional<MatmulEpilogue> match_epilogue(const graph::Graph& g, const ir::ShapeEnv& env,
                                                    const std::vector<std::vector<int>>& readers,
                                                    rewrite::Builder& b, int m) {
  if (!epilogue_dtype(g[m].dt)) return std::nullopt;
  MatmulEpilogue e;
  e.matmul = e.pre = e.out = m;  // without a bias, the activation's readers of m are checked as pre's
  const bool one_reader = readers[m].size() == 1 && readers[m][0] >= 0;
  if (int bias = one_reader ? bias_of(g, m, readers[m][0]) : -1; bias >= 0) e.bias = bias, e.pre = e.out = readers[m][0];
  const kiln::dtype dt = g[e.pre].dt;
  if (!epilogue_dtype(dt) || !(dt == g[m].dt || dt == kiln::dtype::f32)) return std::nullopt;
  constexpr std::pair<Op, Activation> activations[] = {{Op::relu, Activation::relu},
                                                       {Op::gelu_tanh, Activation::gelu_tanh}};
  for (auto [op, act] : activations) {
    const int out = activation_of(b, g.size(), e.pre, op);
    if (out < 0 || g[out].dt != dt || assigned(g, out)) continue;
    const bool keep_pre = read_elsewhere(readers, e.pre, inner_nodes(g, e.pre, out), out);
    if (keep_pre && (act != Activation::gelu_tanh || !aux_layout_ok(env, e.pre) || assigned(g, e.pre))) continue;
    e.act = act, e.out = out, e.aux = keep_pre;
    break;
  }
  if (e.out == m || (e.out == e.pre && assigned(g, e.pre))) return std::nullopt;
  return e;
}

// The cotangent of pre that the differentiator builds from a cotangent m of a gelu's output: the
// derivative rules of the activation's nodes (`inner`, ascending, out last; `on_path`: those that
// depend on pre) run again from m, in the differentiator's order (autodiff/differentiate.hpp's
// backpropagate: reverse node order, each contribution cast to its input's dtype and added in
// turn). Built with the graph's CSE Builder, so it is an existing node only where the graph
// computes exactly that.
inline int gelu_cotangent(rewrite::Builder& b, const graph::Graph& g, const std::vector<int>& inner,
                          const std::vector<char>& on_path, int pre, int m) {
  std::vector<int> ct(static_cast<std::size_t>(g.size()), -1);
  const int out = inner.back();
  ct[out] = b.cast(m, g[out].dt);
  for (auto it = inner.rbegin(); it != inner.rend(); ++it) {
    const int i = *it;
    if (ct[i] < 0) continue;
    const autodiff::Rule rule = autodiff::derivative_rules[static_cast<int>(g[i].op)];
    if (!rule) return -1;
    const autodiff::Cotangents c = rule(b, i, ct[i]);
    for (int k = 0; k < std::min<int>(g[i].n_in, static_cast<int>(c.size())); ++k) {
      const int x = g[i].in[k];
      if (c[k] < 0 || !on_path[x]) continue;
      const int cx = b.cast(c[k], g[x].dt);
      ct[x] = ct[x] < 0 ? cx : b.add(ct[x], cx);
    }
  }
  return ct[pre];
}

// The sums over the rows of 2-D x that the graph takes in x's dtype (a bias's gradient: cuBLASLt's
// BGRAD writes them beside the product): sum(x, 0), or as split_reductions leaves a long one,
// cast(sum(sum(reshape(cast(x, f32), [S, R / S, N]), 1), 0), x's dtype); each node but the last read
// by nothing else. The nodes from x's reader to the sums, the sums last; empty for none.
inline std::vector<int> column_sums_of(const graph::Graph& g, const std::vector<std::vector<int>>& readers, int x) {
  if (g[x].shape.size() != 2) return {};
  const std::int64_t n = g[x].shape[1];
  auto only_reader = [&](int v) { return readers[v].size() == 1 && readers[v][0] >= 0 ? readers[v][0] : -1; };
  auto sum_over = [&](int v, std::int64_t dim) {
    return v >= 0 && g[v].op == Op::sum && g[v].attrs.dims.size() == 1 && g[v].attrs.dims[0] == dim;
  };
  for (int r : readers[x]) {
    std::vector<int> chain;
    int v = r;
    if (v >= 0 && g[v].op == Op::cast && is_floating(g[v].dt)) chain.push_back(v), v = only_reader(v);  // widened
    if (v >= 0 && g[v].op == Op::reshape && g[v].shape.size() == 3 && g[v].shape[2] == n) {             // in two stages
      chain.push_back(v), v = only_reader(v);
      if (!sum_over(v, 1)) continue;
      chain.push_back(v), v = only_reader(v);
      if (!sum_over(v, 0)) continue;
    } else if (!sum_over(v, 0)) {
      continue;
    }
    if (g[v].dt != g[x].dt) {  // back to x's dtype
      chain.push_back(v), v = only_reader(v);
      if (v < 0 || g[v].op != Op::cast || g[v].dt != g[x].dt) continue;
    }
    if (g[v].shape.product() != n || assigned(g, v)) continue;
    chain.push_back(v);
    return chain;
  }
  return {};
}

// The backward GEMM of a gelu that a GELU_AUX step `f` kept: a matmul m whose product is the
// cotangent of f's output (as the differentiator seeds it), and from which the graph computes
// pre's cotangent by gelu's derivative rules, m and those nodes read by nothing else: one step,
// out = m * gelu'(pre), reading the kept pre (cuBLASLt's DGELU), and writing out's column sums
// where the graph takes them (a bias's gradient: DGELU_BGRAD). Recognised as activation_of
// recognises the forward: the rules are run again from m and must build only existing nodes.
inline std::optional<MatmulEpilogue> match_dgelu(const graph::Graph& g, const std::vector<std::vector<int>>& readers,
                                                 rewrite::Builder& b, const MatmulEpilogue& f,
                                                 const std::vector<bool>& taken) {
  if (f.act != Activation::gelu_tanh || !f.aux) return std::nullopt;
  const int pre = f.pre, out = f.out;
  std::vector<int> inner = inner_nodes(g, pre, out);
  inner.push_back(out);
  std::sort(inner.begin(), inner.end());
  std::vector<char> on_path(static_cast<std::size_t>(g.size()), 0), forward(static_cast<std::size_t>(g.size()), 0);
  on_path[pre] = forward[pre] = 1;
  for (int v : inner) {
    forward[v] = 1;
    for (int c = 0; c < g[v].n_in; ++c) on_path[v] = on_path[v] || on_path[g[v].in[c]];
  }
  // Candidates: the matmuls of out's shape and 16-bit dtype after pre (the step reads what the
  // forward's step wrote) that no other step took. (16-bit only: the bf16 and f16 DGELU is what
  // mixed-precision training runs; whether cuBLASLt offers it for f32 is unmeasured.)
  if (g[out].dt != kiln::dtype::bf16 && g[out].dt != kiln::dtype::f16) return std::nullopt;
  std::vector<int> candidates;
  for (int x = pre + 1; x < g.size(); ++x)
    if (g[x].op == Op::matmul && !taken[x] && g[x].shape == g[out].shape && g[x].dt == g[out].dt)
      candidates.push_back(x);
  for (int m : candidates) {
    const int grad = gelu_cotangent(b, g, inner, on_path, pre, m);
    if (grad < 0 || grad >= g.size() || g[grad].dt != g[m].dt || !(g[grad].shape == g[m].shape) || assigned(g, grad))
      continue;
    const std::vector<int> between = tree_above(g, grad, [&](int x) { return forward[x] || x == m; });
    auto within = [&](int r) { return std::find(between.begin(), between.end(), r) != between.end(); };
    bool alone = std::all_of(readers[m].begin(), readers[m].end(), within);
    for (int v : between)
      if (v != grad) alone = alone && std::all_of(readers[v].begin(), readers[v].end(), within);
    if (!alone) continue;
    MatmulEpilogue e;
    e.matmul = e.pre = m;
    e.out = grad;
    e.act = Activation::dgelu_tanh;
    e.aux_in = pre;
    e.bias_sums = column_sums_of(g, readers, grad);
    return e;
  }
  return std::nullopt;
}

}  // namespace detail

// The matmul steps of a graph that take an epilogue (see above), in graph order; `env` tells which
// sizes are static. backward: also the backward GEMMs of kept gelus (DGELU), with their bias
// gradients' column sums where bias_grads (BGRAD; else those stay kernels').
inline std::vector<MatmulEpilogue> choose_epilogues(const graph::Graph& g, const ir::ShapeEnv& env,
                                                    bool backward = true, bool bias_grads = true) {
  std::vector<MatmulEpilogue> chosen;
  std::optional<rewrite::Builder> b;  // a copy of the graph to build candidate activations in
  const auto readers = detail::readers_of(g);
  for (int m = 0; m < g.size(); ++m) {
    if (g[m].op != Op::matmul) continue;
    if (!b) b.emplace(g);
    if (auto e = detail::match_epilogue(g, env, readers, *b, m)) chosen.push_back(*e);
  }
  if (!backward) return chosen;  // (already in graph order)
  // The backward GEMMs of the gelus kept above, which then step in graph order among the rest.
  std::vector<bool> taken(static_cast<std::size_t>(g.size()), false);
  for (const auto& e : chosen) taken[e.matmul] = true;
  const std::size_t forward = chosen.size();
  for (std::size_t f = 0; f < forward; ++f)
    if (auto e = detail::match_dgelu(g, readers, *b, chosen[f], taken)) {
      taken[e->matmul] = true;
      if (!bias_grads) e->bias_sums.clear();
      chosen.push_back(*e);
    }
  std::sort(chosen.begin(), chosen.end(), [](const auto& x, const auto& y) { return x.matmul < y.matmul; });
  return chosen;
}

}  // namespace kiln::schedule
