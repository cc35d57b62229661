// k::compile and eager evaluation: a call gathers the tensors, scalars and attributes of the freshly
// built expression, finds or compiles its program in a program cache (program_cache.hpp) and runs
// it (run_entry), as a CUDA graph replay where asked.
#pragma once
#include <mutex>
#include <optional>
#include <vector>

#include "../autodiff/grad.hpp"
#include "program_cache.hpp"

namespace kiln::runtime {

// k::eval(out, expr): whether `out` fits the program's first output at this call's shapes, checked
// before anything runs, so that a mismatch leaves out untouched. An entry point (core/linkage.hpp).
KILN_DECL void check_preset_output(const Entry& e, const CallShapes& shapes, const Tensor& preset);
#if KILN_DEFINITIONS
KILN_DECL void check_preset_output(const Entry& e, const CallShapes& shapes, const Tensor& preset) {
  const Program& p = *e.program;
  int node = p.graph.outputs[0];
  const Dims& shape = shapes.nodes.empty() ? p.graph[node].shape : shapes.nodes[node].shape;
  if (!(shape == preset.shape()))
    throw shape_error("k::eval(out, expr): out has shape " + preset.shape().str() + " but the expression gives " +
                      shape.str());
  if (!(preset.device() == p.device))
    throw device_error("k::eval(out, expr): out is on " + preset.device().str() + " but the expression on " +
                       p.device.str());
}
#endif

// Runs an entry's program for one call and returns its outputs.
// With .cuda_graphs the launches replay as one CUDA graph, unless the caller is capturing the
// stream themselves: then the plain launches become part of the caller's graph.
// An entry point (core/linkage.hpp).
KILN_DECL void run_entry(const Entry& e, const Tensor* const* args, const double* scalars, Tensor* outputs,
                         const CallShapes& shapes, CUstream stream);
#if KILN_DEFINITIONS
KILN_DECL void run_entry(const Entry& e, const Tensor* const* args, const double* scalars, Tensor* outputs,
                         const CallShapes& shapes, CUstream stream) {
  const Program& p = *e.program;
  const std::vector<graph::Node>& nodes = shapes.nodes.empty() ? p.graph.nodes : shapes.nodes;
  ShapeFn shape_of(nodes);
  // Tuning times and synchronises: not inside a capture the caller is recording (a later call tunes).
  if (e.tune && !e.tuning_done.load(std::memory_order_acquire) && !(stream && driver::is_capturing(stream)))
    std::call_once(e.tuned, [&] {
      tune_program(*e.program, args, scalars, shape_of, stream);
      e.tuning_done.store(true, std::memory_order_release);
    });
  bool captured = e.pins && stream && driver::is_capturing(stream);
  if (captured) {  // recorded into the caller's graph: its intermediates must outlive this call
    std::vector<Tensor> keep;
    std::vector<bool> given(p.graph.outputs.size());  // buffers the caller passed in (a k::cond node's)
    for (std::size_t o = 0; o < given.size(); ++o) given[o] = outputs[o].defined();
    CaptureScratch scratch;  // library temporaries of a capture that is the caller's
    {
      std::optional<ScratchForCapture> scoped;
      if (!active_capture_scratch()) scoped.emplace(scratch);
      p.run(args, scalars, outputs, shape_of, stream, &keep);
    }
    for (Tensor& t : scratch.blocks) keep.push_back(std::move(t));
    if (CaptureKeep* k = active_capture_keep()) {  // kiln's own capture: kept as long as its graph
      // Outputs allocated here are kept too; the caller's own buffers are the caller's to keep (an
      // enclosing graph keyed on its outputs' addresses: keeping them made every call a new graph).
      for (std::size_t o = 0; o < given.size(); ++o) {
        bool into_arg = p.arg_of_output[o] >= 0 || (o < p.graph.output_into.size() && p.graph.output_into[o] >= 0);
        if (!given[o] && !into_arg) keep.push_back(outputs[o]);
      }
      k->runs.push_back(std::move(keep));
    } else {
      e.pins->add(std::move(keep));
    }
  } else if (e.graphs && !e.graphs->disabled()) {
    e.graphs->run(args, static_cast<int>(e.guards.args.size()), scalars, outputs, shape_of, stream);
  } else {
    p.run(args, scalars, outputs, shape_of, stream);
  }
}
#endif

// Runs a hand-built graph (tests and tools that make graphs at run time, such as the random-graph
// differential test): lowers, compiles and runs it once through a private cache.
inline std::vector<Tensor> run_graph(const graph::Graph& g, const std::vector<Tensor>& args,
                                     const std::vector<double>& scalars, options o = {},
                                     LoweringStats* stats = nullptr) {
  ProgramCache cache(o);
  std::vector<const Tensor*> argv;
  for (auto& t : args) argv.push_back(&t);
  CallShapes shapes;
  auto build = [&](auto& arg, LoweringStats& st) {
    return lower_graph(
        g, arg, [](graph::Graph x) { return x; }, st);
  };
  auto entry = cache.get(argv.data(), static_cast<int>(argv.size()), nullptr, 0, build, shapes);
  if (stats) *stats = entry->stats;
  std::vector<Tensor> out(g.outputs.size());
  run_entry(*entry, argv.data(), scalars.data(), out.data(), shapes, nullptr);
  return out;
}

}  // namespace kiln::runtime
