// Watching a program run step by step. An observer installed on this thread (ObserveSteps) is told
// when a top-level Program::run has its outputs and after each step is queued; k::dist::data_parallel
// uses it to start each gradient bucket's all-reduce as soon as the step that last touches the
// bucket is queued, so that the reduction overlaps the rest of the backward (as PyTorch's DDP does
// with its autograd hooks). Nested runs (a custom op running kiln), autotuning probes and runs
// inside a stream capture are not observed.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "../../core/tensor.hpp"
#include "../../codegen/kernel_writer.hpp"
#include "../../schedule/fuse.hpp"

namespace kiln::runtime {

struct Program;

class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // The run's outputs exist (allocated or the caller's); nothing is queued yet.
  virtual void begin(const Program& p, const Tensor* outputs, CUstream stream) = 0;
  // Step `step` (an index into p.kernels) has been queued on `stream`.
  virtual void after_step(std::size_t step, CUstream stream) = 0;
  // Every step has been queued.
  virtual void end(CUstream stream) = 0;
};

inline StepObserver*& current_step_observer() {
  thread_local StepObserver* observer = nullptr;
  return observer;
}

// Installs an observer for the runs this thread starts in its scope.
class ObserveSteps {
 public:
  explicit ObserveSteps(StepObserver* o) : prev_(std::exchange(current_step_observer(), o)) {}
  ~ObserveSteps() { current_step_observer() = prev_; }
  ObserveSteps(const ObserveSteps&) = delete;
  ObserveSteps& operator=(const ObserveSteps&) = delete;

 private:
  StepObserver* prev_;
};

// The graph nodes whose buffers step `k` of a program reads or writes: a kernel's pointer
// parameters; an extern step's node and its inputs (a matmul's transposed operand: its source
// too; its epilogue's bias, pre-activation and result, and the kept pre-activation a dgelu reads and
// the bias gradient it writes).
template <class ProgramT>
std::vector<int> nodes_touched(const ProgramT& p, std::size_t k) {
  std::vector<int> out;
  const auto& step = p.kernels[k];
  if (step.extern_node >= 0) {
    const auto& n = p.graph[step.extern_node];
    out.push_back(step.extern_node);
    for (int i = 0; i < n.n_in; ++i) {
      out.push_back(n.in[i]);
      out.push_back(schedule::detail::matmul_operand(p.graph, n.in[i]));
    }
    if (step.epilogue >= 0) {  // a GEMM with its cuBLASLt epilogue: reads the bias, writes out (and pre)
      const auto& e = p.sched.epilogues[static_cast<std::size_t>(step.epilogue)];
      const int nodes[] = {e.bias, e.pre, e.out, e.aux_in,
                           e.bias_grad()};  // (nvcc's front end: no braced list in a range-for here)
      for (int node : nodes)
        if (node >= 0) out.push_back(node);
    }
    if (step.attention_lse >= 0) out.push_back(step.attention_lse);  // the forward's rows' log-sum-exp
    return out;
  }
  for (const auto& param : step.src.params)
    if (param.kind == codegen::Param::in_ptr || param.kind == codegen::Param::out_ptr) out.push_back(param.ref);
  return out;
}

// Per output of a program: the last step that reads or writes its buffer (-1: none does).
template <class ProgramT>
std::vector<int> last_step_of_outputs(const ProgramT& p) {
  std::vector<int> last_of_node(p.graph.nodes.size(), -1);
  for (std::size_t k = 0; k < p.kernels.size(); ++k)
    for (int n : nodes_touched(p, k)) last_of_node[static_cast<std::size_t>(n)] = static_cast<int>(k);
  std::vector<int> out;
  for (int node : p.graph.outputs) out.push_back(last_of_node[static_cast<std::size_t>(node)]);
  return out;
}

}  // namespace kiln::runtime
