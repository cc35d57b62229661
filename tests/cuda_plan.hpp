// The program k::compile(fn) would build for some CPU tensors on a device, planned but not
// compiled: a CUDA plan needs no GPU, so host tests read what the GPU would run.
#pragma once
#include <memory>
#include <vector>

#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

template <class F, class... T>
std::shared_ptr<kiln::runtime::Program> plan_for(kiln::Device device, const kiln::Function<F>& f, const T&... args) {
  namespace k = kiln;
  auto e = f.trace_with(args...);
  std::vector<const k::Tensor*> argv{&args...};
  k::graph::Captured cap;
  k::graph::gather(e, cap, true);
  for (int i = 0; i < cap.nt; ++i) argv.push_back(cap.tensors[static_cast<std::size_t>(i)]);
  auto arg = [&](int s) -> const k::Tensor& { return *argv.at(static_cast<std::size_t>(s)); };
  k::runtime::LoweringStats stats;
  stats.for_gpu = device.is_cuda();  // lowered for the GPU, as export_kernels plans one
  k::graph::Graph g = k::detail::graph_builder(f.fn(), e, static_cast<int>(sizeof...(T)))(arg, stats);
  k::ir::ShapeEnv env = k::ir::make_static_shape_env(g);
  return k::runtime::plan_program(std::move(g), std::move(env), device, arg, false, stats.tuning);
}
