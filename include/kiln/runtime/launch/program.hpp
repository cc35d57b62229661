// A compiled program: the kernels of one graph for one guard set, compiled for one device, plus
// the buffer plan. Running it allocates outputs and intermediates, binds arguments, scalars and
// symbolic sizes, and launches every kernel in order on one stream; it never synchronises.
// Program::run itself is in program_run.hpp, included at the end.
#pragma once
#include <array>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "../../codegen/kernel_writer.hpp"
#include "../../codegen/prelude.hpp"
#include "../../core/config.hpp"
#include "../../core/tensor.hpp"
#include "../../debug/log.hpp"
#include "../../schedule/pad_buffers.hpp"
#include "../compile/cached_cubin.hpp"
#include "../compile/host_compiler.hpp"
#include "../compile/kernel_cache.hpp"
#include "../compile/kernel_units.hpp"
#include "../compile/nvrtc.hpp"
#include "../extern/attention.hpp"
#include "../extern/cpu_matmul.hpp"
#include "../extern/cuda_matmul.hpp"
#include "../extern/custom.hpp"
#include "../extern/embedding_backward.hpp"
#include "../extern/matmul_step.hpp"
#include "buffer_lifetimes.hpp"
#include "cuda_module.hpp"
#include "index_checks.hpp"
#include "profile.hpp"
#include "step_observer.hpp"

namespace kiln::runtime {

struct CompiledKernel {
  codegen::KernelSource src;
  int extern_node = -1;                         // matmul or custom op: the node
  int epilogue = -1;                            // matmul: its epilogue in the schedule's (matmul_step.hpp)
  int attention_lse = -1;                       // attention_flash: the attention_lse node it writes too
  void (*cpu)(void**, std::int64_t) = nullptr;  // CPU entry: (args, number of programs)
  CUfunction cuda = nullptr;
  std::int64_t grid_limit = 0;  // CUDA row kernels: most blocks a launch (they loop over rows)
  int variant = 0;              // autotuning: which of the kernel's candidate sources this is
  // A kernel specialised on symbolic sizes (codegen's KernelSource::held_rnumel, assumed_multiples):
  // the same kernel written looped and assuming nothing, launched when a call's sizes are outside
  // what src serves. Its twin may itself be specialised, with a twin of its own (a held kernel
  // serving a wider range of lengths, then the looped one: NOTES item 175); the chain ends
  // in a kernel that serves every size.
  std::shared_ptr<CompiledKernel> looped;
};

// f(kernel) for k and each twin after it, in the order a call tries them.
template <class K, class F>
void each_twin(K& k, F&& f) {
  for (K* t = &k; t; t = t->looped.get()) f(*t);
}

// The argument slots of one kernel launch, bound for a given kernel source's parameters.
using BindParams = void** (*)(const void* run_state, const codegen::KernelSource& src);

// Handed each generated CUDA kernel of a run instead of launching it (runtime/tune/autotune.hpp times
// a kernel's candidates there). `bind(state, src)` gives the argument slots for a source's
// parameters; `sizes` the symbol values of this call.
struct KernelProbe {
  virtual ~KernelProbe() = default;
  virtual void launch(std::size_t kernel, BindParams bind, const void* state, Bindings sizes, CUstream stream) = 0;
};

// The shape of node n during this call, as a non-owning reference to any callable: Program::run
// is then compiled once per translation unit, not once per caller's lambda (user compile time).
// Built from the call's node table, it also gives each node's attributes this call (symbolic slice
// bounds are bound from them).
class ShapeFn {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, ShapeFn> && !std::is_same_v<F, std::vector<graph::Node>>)
      ShapeFn(const F& f)
      : obj_(&f), fn_([](const void* o, int n) -> const Dims& { return (*static_cast<const F*>(o))(n); }) {}
  ShapeFn(const std::vector<graph::Node>& nodes)
      : obj_(&nodes),
        fn_([](const void* o, int n) -> const Dims& {
          return (*static_cast<const std::vector<graph::Node>*>(o))[n].shape;
        }),
        nodes_(&nodes) {}
  const Dims& operator()(int n) const { return fn_(obj_, n); }
  const Attrs& attrs(int n) const {
    if (!nodes_) throw error("ShapeFn: this call's attributes were not given (build it from the call's nodes)");
    return (*nodes_)[n].attrs;
  }

 private:
  const void* obj_;
  const Dims& (*fn_)(const void*, int);
  const std::vector<graph::Node>* nodes_ = nullptr;
};

// Zeroes the room around a buffer `t` (two dims, a view at the start of its padded storage of
// shape `room`; schedule/pad_buffers.hpp): the columns past each row, then the rows past the last.
inline void zero_room(const Tensor& t, const Dims& room, CUstream stream) {
  const auto item = static_cast<std::size_t>(itemsize(t.dtype()));
  const auto rows = static_cast<std::size_t>(t.shape()[0]), cols = static_cast<std::size_t>(t.shape()[1]);
  const auto room_rows = static_cast<std::size_t>(room[0]), room_cols = static_cast<std::size_t>(room[1]);
  auto* base = static_cast<unsigned char*>(t.data_ptr());  // (room is planned for CUDA programs only)
  driver::memset_2d_async(base + cols * item, room_cols * item, 0, (room_cols - cols) * item, rows, stream);
  driver::memset_async(base + rows * room_cols * item, 0, (room_rows - rows) * room_cols * item, stream);
}

struct Program {
  graph::Graph graph;
  schedule::Schedule sched;
  ir::ShapeEnv env;
  Device device = cpu;
  std::vector<CompiledKernel> kernels;
  std::string source;                                  // every kernel's source (prelude excluded)
  std::vector<std::shared_ptr<SharedObject>> objects;  // CPU: one a distinct kernel (runtime/compile/kernel_units.hpp)
  std::vector<std::shared_ptr<const Module>> modules;  // CUDA: likewise
  std::vector<int> buffers;                            // realized non-arg nodes, in kernel order
  std::vector<int> arg_of_output;                      // per output: arg slot when the output is an argument
  // Per output, the step that writes it (-1: none), and the outputs in that order: a plain run
  // allocates each fresh output as its step starts.
  std::vector<int> output_step, output_order;
  // options.autotune (runtime/tune/autotune.hpp): each generated kernel's candidates, the rules' choice
  // first, until the first call times them and the winners replace `kernels`; GEMMs then pick
  // among cuBLASLt's algorithms by timing them too.
  bool autotune = false;
  std::vector<std::vector<CompiledKernel>> candidates;
  std::vector<std::shared_ptr<Module>> candidate_modules;  // the winners' code lives here
  // options.check_indices (default: on for CPU programs): each embedding's ids are checked against
  // its table as soon as they exist (index_checks.hpp).
  bool check_indices = false;
  std::vector<IndexCheck> index_checks;
  BufferLifetimes lifetimes;  // plain runs: when each intermediate is allocated and released
  Tuning tuning;              // the environment's KILN_TUNE_* choices when it was planned (core/tuning.hpp)
  std::string tuning_key;     // the disk cache's name for the choice

  // Runs the program. args are indexed by arg slot; outputs are filled (pre-set entries are used
  // as destinations: eval(out, expr)). shape_of(node) gives the node's concrete shape this call.
  // `keep`, when given, holds the intermediates across calls (a CUDA graph replays into the same
  // addresses): missing ones are allocated into it and none are released.
  // `probe`, when given, is handed each generated CUDA kernel instead of launching it (autotuning).
  void run(const Tensor* const* args, const double* scalars, Tensor* outputs, ShapeFn shape_of, CUstream stream,
           std::vector<Tensor>* keep = nullptr, struct KernelProbe* probe = nullptr) const;

  // Fills the outputs a run writes: arguments written in place, then the caller's preset tensors,
  // then fresh tensors ordered on `stream`; with `defer`, fresh ones are left undefined (the run
  // allocates each as the step that writes it starts).
  void allocate_outputs(const Tensor* const* args, Tensor* outputs, ShapeFn shape_of, CUstream stream,
                        bool defer = false) const {
    for (std::size_t o = 0; o < graph.outputs.size(); ++o) {
      int node = graph.outputs[o];
      if (arg_of_output[o] >= 0) {
        outputs[o] = *args[arg_of_output[o]];
        continue;
      }
      if (o < graph.output_into.size() && graph.output_into[o] >= 0) outputs[o] = *args[graph.output_into[o]];
      // Two outputs that simplification made the same node (two expressions equal after CSE) share
      // its tensor: the kernels write one buffer per node, so a second fresh tensor would stay unwritten.
      for (std::size_t p = 0; p < o && !outputs[o].defined(); ++p)
        if (graph.outputs[p] == node && arg_of_output[p] < 0 &&
            (p >= graph.output_into.size() || graph.output_into[p] < 0))
          outputs[o] = outputs[p];
      if (!outputs[o].defined() && !defer) outputs[o] = Tensor::empty(shape_of(node), graph[node].dt, device, stream);
    }
  }

  // The storage of an intermediate of this call's shape: larger where it has room for GEMMs
  // (schedule/pad_buffers.hpp), whose room a run zeroes before the buffer's first step.
  Dims storage_shape(int node, const Dims& shape) const {
    const schedule::Padding pad = schedule::padding_of(sched, node);
    return pad ? schedule::padded_shape(shape, pad) : shape;
  }
  Tensor allocate_buffer(int node, const Dims& shape, CUstream stream) const {
    const Dims storage = storage_shape(node, shape);
    Tensor t = Tensor::empty(storage, graph[node].dt, device, stream);
    return storage == shape ? t : t.as_strided(shape, t.strides(), 0);
  }
  // The buffer of `node` over storage at `data` (a block of a CUDA graph's shared intermediates).
  Tensor wrap_buffer(int node, void* data, const Dims& shape) const {
    return Tensor::wrap(data, shape, graph[node].dt, device, contiguous_strides(storage_shape(node, shape)));
  }
};

// Writes kernel k of a schedule for a target, under a tuning; nothing when the tuning's launch
// config cannot hold the rows the kernel's column partials need (KernelWriter::holds_partials).
// `arg(slot)` gives the call's arguments: a strided argument is read through its strides, a buffer
// with room (schedule/pad_buffers.hpp) through its storage's, everything else is contiguous.
template <class ArgAt>
std::optional<codegen::KernelSource> write_kernel(const graph::Graph& g, const schedule::Schedule& s,
                                                  const ir::ShapeEnv& env, int k, codegen::Target target, ArgAt&& arg,
                                                  const codegen::Tuning& tune = {}) {
  auto strides_of = [&](int node) {
    if (g[node].op == Op::arg && !arg(g[node].slot).is_contiguous()) {
      std::vector<Sym> st;
      for (auto stride : arg(g[node].slot).strides()) st.push_back(Sym(stride));
      return st;
    }
    if (auto pad = schedule::padding_of(s, node))  // a GEMM operand stored with room (schedule/pad_buffers.hpp)
      return contiguous_strides(schedule::padded_shape(env[node], pad));
    return contiguous_strides(env[node]);
  };
  codegen::KernelWriter writer(g, s, env, k, target, strides_of, tune);
  if (!writer.holds_partials()) return std::nullopt;
  return writer.write();
}

// Queues a generated CUDA kernel's `nprog` programs; row programs loop over rows, so the grid
// stops at the kernel's grid_limit (row_grid_limit).
inline void launch_compiled(const CompiledKernel& k, std::int64_t nprog, void** slots, CUstream stream) {
  if (k.grid_limit > 0) nprog = std::min<std::int64_t>(nprog, k.grid_limit);
  launch(k.cuda, {static_cast<unsigned>(nprog), 1, 1}, {static_cast<unsigned>(k.src.config.threads), 1, 1},
         static_cast<unsigned>(k.src.config.shared_bytes), stream, slots, k.src.name.c_str());
}

namespace detail {

inline std::int64_t num_programs(const CompiledKernel& k, Bindings sizes) {
  // Column partials: a program a group, each writing its sums, also where some have no rows (a GPU's
  // blocks visit the rows in turn, fewer than the groups at symbolic sizes; a host program takes
  // ceil(rows / groups) rows, the last ones none when they do not divide).
  if (k.src.partial_groups > 0) return k.src.partial_groups;
  std::int64_t xn = k.src.xnumel.eval(sizes);
  if (xn == 0) return 0;
  if (k.src.kind == schedule::Kind::poi) return (xn + k.src.config.xblock - 1) / k.src.config.xblock;
  return (xn + k.src.config.rows - 1) / k.src.config.rows;
}

}  // namespace detail

// The generated kernels of a program after the size helpers (no prelude): its `source`.
inline std::string program_body(const Program& p) {
  std::string body = std::string(sym_c_helpers) + "\n";
  for (auto& k : p.kernels)
    if (k.extern_node < 0) {
      each_twin(k, [&](const CompiledKernel& t) { body += "\n" + t.src.source; });
    }
  return body;
}

// The CUDA translation unit of all of a program's kernels (autotuning's candidates, export).
inline std::string cuda_translation_unit(const Program& p, const std::string& body) {
  bool half =
      std::any_of(p.kernels.begin(), p.kernels.end(), [](const CompiledKernel& k) { return moves_half(k.src); });
  return cuda_unit(half, body, p.tuning.prelude_loads);
}

// Enough blocks of `threads` threads for four full waves on a device with `sms` multiprocessors:
// what exported launchers emit (runtime/aot/export_launcher.hpp), and the runtime's with
// KILN_TUNE_ROW_WAVES=0.
inline std::int64_t row_grid_limit(int sms, int threads) {
  return std::int64_t{sms} * std::max(1, 2048 / std::max(threads, 1)) * 4;
}
// For a compiled kernel: 16 times the blocks the device holds at once by the kernel's occupancy
// (registers, shared memory), which measured faster than the formula above and than 1, 2 or 4
// waves (benchmarks/NOTES.md item 23). Register-cached kernels holding several rows a block take
// 64 times, about a block per row group (rows of 256 threads or more lost with it: NOTES item 30).
// A Tuning's waves (KILN_TUNE_ROW_WAVES, an autotuning candidate) sets the multiple (0: the formula).
// Called once as the kernel is loaded, it also raises the kernel's limit to the dynamic shared
// memory it asks for (the launches and the occupancy query below count on it).
inline std::int64_t row_grid_limit(CUfunction f, const codegen::KernelSource& k, int device) {
  const auto shared = static_cast<unsigned>(k.config.shared_bytes);
  allow_shared(f, shared, k.name.c_str());
  if (k.partial_groups > 0) return k.partial_groups;  // a block a row group, exactly
  bool several_rows = k.kind == schedule::Kind::per && k.config.rows >= 2 && k.config.row_threads > 1 &&
                      !k.config.x_lanes;  // not columns (held or not)
  int waves = k.tuning.waves >= 0 ? k.tuning.waves : several_rows ? 64 : 16;
  if (waves == 0) return row_grid_limit(driver::sm_count(device), k.config.threads);
  return std::int64_t{driver::sm_count(device)} * std::max(1, driver::resident_blocks(f, k.config.threads, shared)) *
         waves;
}

// Compiles the generated kernels of a program for its device: one unit per distinct kernel source
// (runtime/compile/kernel_units.hpp), the units in parallel, each from the memory or disk cache when some
// program compiled it before.
inline void compile_program(Program& p, const std::string& /*name: each unit is named after its kernel*/) {
  p.source = program_body(p);
  const bool cpu = p.device.is_cpu();
  // The generated kernels, each one's twins after it.
  std::vector<CompiledKernel*> kernels;
  for (auto& k : p.kernels)
    if (k.extern_node < 0) each_twin(k, [&](CompiledKernel& t) { kernels.push_back(&t); });
  std::vector<KernelUnit> units;
  std::vector<int> unit_of(kernels.size(), -1);
  std::unordered_map<std::string, int> by_source;
  for (std::size_t k = 0; k < kernels.size(); ++k) {
    KernelUnit u = kernel_unit(kernels[k]->src, cpu);
    auto [it, fresh] = by_source.try_emplace(u.source, static_cast<int>(units.size()));
    if (fresh) units.push_back(std::move(u));
    unit_of[k] = it->second;
  }
  if (cpu) {
    p.objects.assign(units.size(), nullptr);
    parallel_for(units.size(),
                 [&](std::size_t i) { p.objects[i] = compile_shared_object(units[i].source, units[i].name); });
    for (std::size_t k = 0; k < kernels.size(); ++k) {
      const KernelUnit& u = units[static_cast<std::size_t>(unit_of[k])];
      kernels[k]->cpu = reinterpret_cast<void (*)(void**, std::int64_t)>(
          p.objects[static_cast<std::size_t>(unit_of[k])]->symbol((u.name + "_cpu").c_str()));
    }
    return;
  }
  driver::make_current(p.device.index);
  const std::string arch = driver::arch(p.device.index);
  std::vector<std::vector<char>> cubins(units.size());
  parallel_for(units.size(), [&](std::size_t i) { cubins[i] = cached_cubin(units[i].source, units[i].name, arch); });
  p.modules.clear();
  for (auto& cubin : cubins) p.modules.push_back(shared_module(cubin, p.device.index));
  for (std::size_t k = 0; k < kernels.size(); ++k) {
    auto& kern = *kernels[k];
    kern.cuda = p.modules[static_cast<std::size_t>(unit_of[k])]->function(
        units[static_cast<std::size_t>(unit_of[k])].name.c_str());
    if (kern.src.kind != schedule::Kind::poi) kern.grid_limit = row_grid_limit(kern.cuda, kern.src, p.device.index);
  }
}

}  // namespace kiln::runtime

#include "program_run.hpp"
