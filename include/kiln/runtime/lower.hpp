// The lowering driver: one short function that runs every pass in order, each logged under its
// KILN_LOGS channel, from the captured graph to a compiled program.
#pragma once
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../autodiff/expand_gradients.hpp"
#include "../codegen/score_mod_source.hpp"
#include "../core/linkage.hpp"
#include "../debug/log.hpp"
#include "../graph/infer.hpp"
#include "../rewrite/decompose.hpp"
#include "../rewrite/factor_sums.hpp"
#include "../rewrite/simplify.hpp"
#include "../schedule/epilogue.hpp"
#include "../schedule/partials.hpp"
#include "../schedule/realize.hpp"
#include "../schedule/split.hpp"
#include "arguments.hpp"
#include "compile/hash.hpp"
#include "launch/program.hpp"
#include "lowering.hpp"
#include "refit_held_rows.hpp"
#include "tune/autotune.hpp"

namespace kiln::runtime {

inline void log_graph(debug::Channel ch, const std::string& title, const graph::Graph& g) {
  if (debug::log_enabled(ch)) debug::log(ch, title + ":\n" + g.str());
}

// k::attention on a CUDA device, over operands the fused kernel takes
// (runtime/extern/attention_kernels.hpp's attention_flash_fits): the fused kernel's node, attention_flash
// (an extern step; its derivative rule builds the backward from primitives), instead of the
// decomposition into batched matmuls and a materialised softmax. KILN_TUNE_ATTENTION=0 keeps the
// decomposition; its other values set the kernel's warps. On Hopper the forward is the warpgroup
// kernel where it takes the head dim (KILN_TUNE_ATTENTION_WGMMA=0: the mma.sync one).
// The CUDA device of a graph's arguments, or -1 where none is on a GPU.
template <class ArgAt>
int cuda_device_of(const graph::Graph& g, ArgAt&& arg) {
  int device = -1;
  for (const auto& n : g.nodes)
    if (n.op == Op::arg && arg(n.slot).device().is_cuda()) device = arg(n.slot).device().index;
  return device;
}

// A score_mod whose nodes are pointwise in the scores (autodiff/score_mod.hpp) is inlined into the
// same kernels, forward and backward (registered, its id in attrs.custom; Hopper's warpgroup
// kernels too), the tensors it reads inputs after the scale; one that reduces or views
// the scores, or reads more than two tensors, keeps the decomposition, as does any score_mod under
// KILN_TUNE_ATTENTION_BACKWARD=0 (the materialised backward has no rule for an inlined mod).
// The rewrite for a device of compute capability cc; same_tensor(x, y): whether argument nodes x
// and y are bound to one tensor (eager tensors captured twice are two nodes).
template <class SameTensor>
graph::Graph fuse_attention(const graph::Graph& g, int cc, const Tuning& tuning, SameTensor&& same_tensor) {
  return rewrite::rebuild_graph(g, [&](rewrite::Builder& b, const graph::Node& n, const int* in,
                                       const std::vector<int>& map) {
    if (n.op == Op::constant) return b.constant(n.value);
    if (n.op != Op::attention || !attention_flash_fits(b.shape(in[0]), b.shape(in[1]), b.shape(in[2]), b.dt(in[0]), cc))
      return b.rebuild(n, in);
    int mod = -1;
    std::vector<int> captured;  // the tensors the mod reads, inputs after the scale
    if (n.attrs.c) {
      std::optional<autodiff::ScoreMod> m;
      if (tuning.attention_backward != 0)
        m = autodiff::extract_score_mod(g, static_cast<int>(&n - g.nodes.data()), same_tensor);
      if (!m) return b.rebuild(n, in);
      for (int c : m->captured) captured.push_back(map[static_cast<std::size_t>(c)]);
      m->source = codegen::score_mod_source(*m);
      m->tag = hex(hash64(m->source));
      mod = autodiff::ScoreMods::instance().add(std::move(*m));
    }
    Attrs at = n.attrs;
    at.c = 0;
    at.custom = mod;
    at.d = tuning.attention > 0 ? tuning.attention : 4;  // warps a block
    // row tiles a warp (0: by registers), and where Hopper's warpgroup kernel runs it 1 (two
    // warpgroups a block), 2 (one), 3 (two fed by a producer warpgroup) or 4 (three at head dim 64
    // without a score_mod, else two, fed by one; 5 the same looping over query tiles; 6 5 taking its tiles from a
    // counter), and whether the backward adds dq's sums in its dk/dv kernel (KILN_TUNE_ATTENTION_DQ) (default 6;
    // NOTES items 180, 183, 185, 189); dims[2]: dq in the
    // dk/dv kernel where it fits (-1), always (1) or never (0)
    const int hopper =
        cc == 90 && tuning.attention_wgmma != 0 ? (tuning.attention_wgmma > 0 ? tuning.attention_wgmma : 6) : 0;
    at.dims = Dims{std::max(tuning.attention_rows, 0), hopper, hopper ? std::clamp(tuning.attention_dq, -1, 1) : 0};
    at.keepdim = tuning.attention_backward != 0;         // its backward: fused kernels (autodiff/rules.hpp)
    graph::Node f;
    f.op = Op::attention_flash;
    f.attrs = at;
    for (int x : {in[0], in[1], in[2], in[3]}) f.in[f.n_in++] = x;
    for (int x : captured) f.in[f.n_in++] = x;
    return b.node(f);
  });
}
template <class ArgAt>
graph::Graph choose_fused_attention(const graph::Graph& g, ArgAt&& arg, const Tuning& tuning) {
  if (tuning.attention == 0) return g;
  const int device = cuda_device_of(g, arg);
  bool any = false;
  for (const auto& n : g.nodes) any = any || n.op == Op::attention;
  if (device < 0 || !any) return g;
  return fuse_attention(g, driver::compute_capability(device), tuning, [&](int x, int y) {
    if (x == y) return true;
    if (g[x].op != Op::arg || g[y].op != Op::arg) return false;
    const Tensor &tx = arg(g[x].slot), &ty = arg(g[y].slot);
    return tx.data_ptr() == ty.data_ptr() && tx.shape() == ty.shape() && tx.strides() == ty.strides() &&
           tx.dtype() == ty.dtype() && tx.device() == ty.device();
  });
}

// Captured graph -> primitive graph with shapes (decompose, simplify, then the function's own
// transform such as differentiation, then simplify again). An entry point (core/linkage.hpp),
// declared in lowering.hpp.
#if KILN_DEFINITIONS
KILN_DECL graph::Graph lower_graph(graph::Graph g, ArgRef arg, FunctionRef<graph::Graph(graph::Graph)> transform,
                                   LoweringStats& stats) {
  stats.tuning = Tuning::from_environment();  // KILN_TUNE_* as they are now
  graph::infer_shapes(g, arg);                // shapes and dtypes, errors for bad inputs
  log_graph(debug::Channel::graph, "captured graph", g);
  std::vector<int> into = g.output_into;  // k::assign targets survive the rewrites
  stats.ops_captured = g.count_ops();
  g = choose_fused_attention(g, arg, stats.tuning);  // attention as one fused kernel where it can
  const auto derive_start = std::chrono::steady_clock::now();
  g = rewrite::decompose(g);                         // composites -> primitives
  graph::infer_shapes(g, arg);
  if (autodiff::has_inner_gradients(g)) {  // compiled gradients called inside the function
    g = autodiff::expand_gradients(g);
    graph::infer_shapes(g, arg);
  }
  g = rewrite::simplify(g);  // x*1, x+0, constant folding, CSE, dead code
  graph::infer_shapes(g, arg);
  log_graph(debug::Channel::decomp, "after decomposition", g);
  g = transform(std::move(g));  // differentiation for k::grad and friends
  graph::infer_shapes(g, arg);
  g = rewrite::simplify(g);
  graph::infer_shapes(g, arg);
  bool factored = false;
  g = rewrite::factor_sums(g, &factored);  // sums of row-constant multiples no longer wait for them
  if (factored) {
    graph::infer_shapes(g, arg);
    g = rewrite::simplify(g);
    graph::infer_shapes(g, arg);
  }
  stats.ops_decomposed = g.count_ops();
  debug::log_lazy(debug::Channel::decomp, [&] {  // what the first call spends deriving the graph
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - derive_start).count();
    char took[32];
    std::snprintf(took, sizeof took, "%.2f ms", ms);
    return "decomposed and transformed (" + std::to_string(stats.ops_captured) + " ops -> " +
           std::to_string(stats.ops_decomposed) + " ops) in " + took;
  });
  if (stats.tuning.matmul_t != 0) g = rewrite::fold_matmul_transposes(g);  // (A @ B)^T written as B^T @ A^T
  graph::infer_shapes(g, arg);
  const bool gpu = stats.for_gpu || cuda_device_of(g, arg) >= 0;  // the program's device
  if (gpu && stats.tuning.matmul_wide != 0) {                     // 16-bit products read only as f32 written in f32
    g = rewrite::widen_matmul_casts(g, into);
    graph::infer_shapes(g, arg);
  }
  g = schedule::split_reductions(g, stats.tuning.partials, gpu,
                                 stats.symbolic);  // long reductions with few outputs in two stages
  graph::infer_shapes(g, arg);
  g = copy_strided_custom_inputs(g, arg);  // custom ops, embedding_backward, attention read contiguous buffers
  g.output_into = into.size() == g.outputs.size() ? into : std::vector<int>(g.outputs.size(), -1);
  write_into_arguments(g, arg);
  log_graph(debug::Channel::graph, "lowered graph", g);
  return g;
}
#endif

// The schedule of a graph: fusion, column partials where allowed, buffers, names. epilogues: matmuls
// may take their bias and activation as cuBLASLt epilogues (CUDA targets; 1: with DGELU and BGRAD;
// 2: the forward's only, no DGELU/BGRAD; 3: DGELU without BGRAD). host: for the CPU.
inline schedule::Schedule schedule_graph(const graph::Graph& g, const ir::ShapeEnv& env, int partials,
                                         bool realize = true, int epilogues = 0, bool host = false) {
  std::vector<schedule::MatmulEpilogue> chosen;
  if (epilogues)
    chosen = schedule::choose_epilogues(g, env, epilogues != 2, epilogues != 3);  // bias and activation into the GEMM
  schedule::Schedule s = schedule::fuse(g, chosen);             // group anchors into kernels
  if (realize) schedule::realize_shared(g, s);                  // buffers for values kernels would recompute
  schedule::absorb_column_partials(g, s, env, partials, host);  // dw/db-like column sums into row kernels
  schedule::plan_buffers(g, s);                                 // buffers only at fusion boundaries
  schedule::name_kernels(g, s);
  return s;
}

// Whether every row kernel given column partials holds the rows they need under its launch
// config, which only the config tells (long rows on the CPU do not).
inline bool partials_held(const graph::Graph& g, const schedule::Schedule& s, const ir::ShapeEnv& env,
                          codegen::Target target, const Tuning& tuning) {
  auto contiguous = [&](int node) { return contiguous_strides(env[node]); };
  for (int k = 0; k < static_cast<int>(s.kernels.size()); ++k)
    if (!s.kernels[k].partials.empty() &&
        !codegen::KernelWriter(g, s, env, k, target, contiguous, tuning).holds_partials())
      return false;
  return true;
}

// The schedule of a graph and each kernel's source under the rules (and the environment's knobs).
template <class ArgAt>
void plan_kernels(Program& p, const graph::Graph& g, const ir::ShapeEnv& env, codegen::Target target, ArgAt&& arg) {
  p.kernels.clear();
  const bool realize = p.tuning.realize != 0;
  // KILN_TUNE_EPILOGUE: 0 off, 2 the forward's only
  // By default DGELU without BGRAD (3): with BGRAD (1) GPT-2's step ran 6% slower on an H100 (NOTES item 164).
  const int epilogues = target == codegen::Target::cuda ? (p.tuning.epilogue < 0 ? 3 : p.tuning.epilogue) : 0;
  const bool host = target == codegen::Target::cpu;
  p.sched = schedule_graph(g, env, p.tuning.partials, realize, epilogues, host);
  if (!partials_held(g, p.sched, env, target, p.tuning)) p.sched = schedule_graph(g, env, 0, realize, epilogues, host);
  if (target == codegen::Target::cuda && p.tuning.gemm_room != 0)
    schedule::pad_gemm_buffers(g, p.sched, env);  // 16-bit GEMM operands off 8 stored with room
  if (debug::log_enabled(debug::Channel::fusion)) {
    std::string s;
    for (auto& k : p.sched.kernels) s += "  " + k.debug_str(g) + "\n";
    for (int i = 0; i < static_cast<int>(p.sched.padding.size()); ++i)
      if (auto pad = p.sched.padding[static_cast<std::size_t>(i)])
        s += "  %" + std::to_string(i) + " " + g[i].shape.str() + " stored with room for GEMMs as " +
             schedule::padded_shape(g[i].shape, pad).str() + "\n";
    debug::log(debug::Channel::fusion, "kernels:\n" + s);
  }
  for (int k = 0; k < static_cast<int>(p.sched.kernels.size()); ++k) {
    CompiledKernel ck;
    const auto& plan = p.sched.kernels[k];
    if (plan.kind == schedule::Kind::extern_) {
      ck.extern_node = plan.domain;
      ck.epilogue = plan.epilogue;
      ck.attention_lse = plan.attention_lse;
      ck.src.name = plan.name;
      ck.src.kind = plan.kind;
      const graph::Node& n = g[plan.domain];
      ck.src.fused_ops = {!is_custom(n.op)
                              ? std::string(name(n.op))
                              : custom_ops::name_of(n.attrs.custom) + (n.op == Op::custom_backward ? "_backward" : "")};
      if (plan.epilogue >= 0) {  // matmul, then bias and the activation as cuBLASLt applies them
        const schedule::MatmulEpilogue& e = p.sched.epilogues[plan.epilogue];
        if (e.bias >= 0) ck.src.fused_ops.push_back("bias");
        if (e.act != schedule::Activation::none) ck.src.fused_ops.push_back(schedule::activation_name(e.act));
      }
      if (plan.attention_lse >= 0) ck.src.fused_ops.push_back("attention_lse");  // the rows' log-sum-exp too
      if (is_fused_attention(n.op) && n.attrs.custom >= 0) ck.src.fused_ops.push_back("score_mod");  // inlined
    } else {
      ck.src = write_kernel(g, p.sched, env, k, target, arg, p.tuning).value();
      if (codegen::specialised(ck.src)) {  // on symbolic sizes: its unspecialised twin for other sizes
        Tuning looped = p.tuning;
        looped.dynamic_rows = 0;
        ck.looped = std::make_shared<CompiledKernel>();
        ck.looped->src = write_kernel(g, p.sched, env, k, target, arg, looped).value();
        // A held row whose live tiles were counted from the compiling call's length serves only
        // lengths from their end up (the default): the held kernel with the tiles inside every
        // length it serves (KILN_TUNE_LIVE_TILES=4's rule), serving from half its tiles up, goes
        // between it and the looped twin (NOTES 175).
        if (p.tuning.live_tiles < 0 && ck.src.held_max > 0) {
          Tuning wider = p.tuning;
          wider.live_tiles = 4;
          auto middle = std::make_shared<CompiledKernel>();
          middle->src = write_kernel(g, p.sched, env, k, target, arg, wider).value();
          if (middle->src.held_max > 0 && middle->src.held_min < ck.src.held_min) {
            middle->looped = std::move(ck.looped);
            ck.looped = std::move(middle);
          }
        }
      }
    }
    p.kernels.push_back(std::move(ck));
  }
}

// Primitive graph -> kernel sources and buffer plan for one target, without compiling them
// (nothing here needs a driver: k::export_kernels plans CUDA programs on machines without a GPU).
// autotune (CUDA only): every candidate of every kernel is written too (runtime/tune/autotune.hpp).
template <class ArgAt>
std::shared_ptr<Program> plan_program(graph::Graph g, ir::ShapeEnv env, Device device, ArgAt&& arg, bool autotune,
                                      const Tuning& tuning) {
  auto p = std::make_shared<Program>();
  p->device = device;
  p->tuning = tuning;
  // Autotuning times candidates at the compiling call's sizes only: rows of symbolic length stay looped.
  if (autotune) p->tuning.dynamic_rows = 0;
  codegen::Target target = device.is_cpu() ? codegen::Target::cpu : codegen::Target::cuda;
  // Looped rows kept in shared memory (KILN_TUNE_ROW_SMEM). By default only rows whose tiles all
  // fit half an SM's shared memory, less 2 KiB for what a row kernel declares itself (its
  // reductions' slots), so that two blocks share an SM: rows kept in part, or one block an SM,
  // measured slower (NOTES items 105, 108, 109). 1: half an SM's, rows kept in part too. More
  // than 1: at most that many bytes, and at most what the device allows a block (as given where no
  // driver answers: k::export_kernels for a GPU elsewhere). None where no driver answers otherwise
  // (planning without a GPU).
  if (target == codegen::Target::cuda && p->tuning.row_smem != 0 && driver::available()) {
    const int optin = driver::shared_optin(device.index) - 2048;
    const int half_sm = std::max(0, std::min(optin, driver::shared_per_sm(device.index) / 2 - 2048));
    if (p->tuning.row_smem < 0)
      p->tuning.row_smem_whole = half_sm;
    else
      p->tuning.row_smem = std::max(0, std::min(optin, p->tuning.row_smem == 1 ? half_sm : p->tuning.row_smem));
  } else if (target == codegen::Target::cuda && p->tuning.row_smem == 1) {
    p->tuning.row_smem = 0;
  }
  plan_kernels(*p, g, env, target, arg);
  if (autotune && target == codegen::Target::cuda)
    plan_candidates(*p, [&](int k, const codegen::Tuning& t) {
      return write_kernel(g, p->sched, env, k, target, arg, p->tuning.merged(t));  // dynamic rows looped too
    });
  for (int i = 0; i < g.size(); ++i)
    if (p->sched.realized[i] && g[i].op != Op::arg) p->buffers.push_back(i);
  for (int o : g.outputs) {
    p->arg_of_output.push_back(g[o].op == Op::arg ? g[o].slot : -1);
    const int writer = p->sched.kernel_of[static_cast<std::size_t>(o)];
    p->output_step.push_back(writer >= 0 && writer < static_cast<int>(p->kernels.size()) ? writer : -1);
  }
  p->output_order.resize(g.outputs.size());
  std::iota(p->output_order.begin(), p->output_order.end(), 0);
  std::stable_sort(p->output_order.begin(), p->output_order.end(), [&](int a, int b) {
    return p->output_step[static_cast<std::size_t>(a)] < p->output_step[static_cast<std::size_t>(b)];
  });
  p->check_indices = device.is_cpu();
  p->index_checks = plan_index_checks(g, p->sched);
  check_assign_order(g, *p);
  p->graph = std::move(g);
  p->env = std::move(env);
  p->lifetimes = plan_lifetimes(*p);
  return p;
}

// Primitive graph -> compiled program for one device and shape environment. With autotune, the
// candidates are compiled too, unless a stored choice names the winners (then only they are).
template <class ArgAt>
std::shared_ptr<Program> build_program(graph::Graph g, ir::ShapeEnv env, Device device, ArgAt&& arg, bool autotune,
                                       const Tuning& tuning) {
  auto p = plan_program(std::move(g), std::move(env), device, arg, autotune, tuning);
  std::string name = p->kernels.empty() ? "kiln_program" : p->kernels.front().src.name;
  // Kernel k of the program written again for CUDA under a tuning (a stored choice, a looped row).
  // merged() keeps the program's dynamic_rows; a twin's rewrite sets it to 0 (loop_spilled_rows).
  auto rewrite = [&](int k, const codegen::Tuning& t) {
    codegen::Tuning m = p->tuning.merged(t);
    if (t.dynamic_rows >= 0) m.dynamic_rows = t.dynamic_rows;
    return write_kernel(p->graph, p->sched, p->env, k, codegen::Target::cuda, arg, m);
  };
  bool tune = p->autotune && !apply_stored_choice(*p, rewrite);
  compile_program(*p, name);                                      // NVRTC or the host compiler, cached
  if (loop_spilled_rows(*p, rewrite)) compile_program(*p, name);  // with the spilling held rows looped
  if (keep_fuller_twins(*p)) compile_program(*p, name);           // a held twin with more blocks an SM first
  share_held_weights(*p, rewrite, name);                          // weights that cost blocks an SM, in shared memory
  if (tune) compile_candidates(*p, name);                         // timed at the first call (tune_program)
  if (debug::log_enabled(debug::Channel::output_code)) debug::log(debug::Channel::output_code, p->source);
  return p;
}

}  // namespace kiln::runtime
