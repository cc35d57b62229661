// Program::run (program.hpp's Program): one call of a compiled program on one stream. It binds the
// call's symbol values, arguments and scalars, allocates the outputs and the intermediates live at
// each step (buffer_lifetimes.hpp), and queues each step in order: a generated kernel (or the twin
// that serves the call's sizes; on the CPU, its compiled function) or a library step (matmul,
// fused attention, embedding's backward, a custom op). It never synchronises.
#pragma once
#include "program.hpp"

namespace kiln::runtime {

// A step reached a buffer that is not live at it: buffer_lifetimes.hpp's plan missed a read (the
// nodes a step touches, step_observer.hpp's nodes_touched, must list every buffer it reads).
[[noreturn]] inline void not_live(int node) {
  throw error("internal error: a step reads the buffer of node %" + std::to_string(node) +
              ", which its program did not allocate for that step (runtime/launch/buffer_lifetimes.hpp)");
}

// A kernel specialised on symbolic sizes was called at sizes it does not serve and has no twin
// (runtime/lower.hpp writes one beside every such kernel).
[[noreturn]] inline void held_row_without_twin(const std::string& kernel) {
  throw error("internal error: " + kernel + " is specialised on the compiling call's sizes, was called at others " +
              "and has no unspecialised kernel for them (runtime/lower.hpp plan_kernels)");
}

// The kernel a call with these sizes launches: k where it serves them, else the first twin that does.
inline const CompiledKernel& kernel_for(const CompiledKernel& k, Bindings sizes) {
  const CompiledKernel* t = &k;
  while (!codegen::serves(t->src, sizes)) {
    if (!t->looped) held_row_without_twin(t->src.name);
    t = t->looped.get();
  }
  return *t;
}

inline void Program::run(const Tensor* const* args, const double* scalars, Tensor* outputs, ShapeFn shape_of,
                         CUstream stream, std::vector<Tensor>* keep, KernelProbe* probe) const {
  // Per-call scratch: symbol values and kernel argument slots (grown once, then reused), one per
  // nesting level (a custom op may run kiln itself).
  auto& sizes = level_local<std::vector<std::int64_t>>();
  auto &ptrs = level_local<std::vector<void*>, 0>(), &slots = level_local<std::vector<void*>, 1>();
  auto& scal = level_local<std::vector<double>>();
  sizes.resize(std::max<std::size_t>(sizes.size(), static_cast<std::size_t>(env.num_symbols()) + 1));
  env.bind(shape_of, sizes.data());
  Bindings bind(sizes.data(), static_cast<std::size_t>(env.num_symbols()));
  // Outputs first (they may be caller-provided), then intermediates.
  // Buffers of this call, indexed by node; reused across calls (no allocation on the hit path).
  auto& call_temps = level_local<std::vector<Tensor>>();
  std::vector<Tensor>& temps = keep ? *keep : call_temps;
  temps.resize(std::max<std::size_t>(temps.size(), graph.nodes.size()));
  struct Release {
    std::vector<Tensor>& temps;
    const std::vector<int>& nodes;
    const std::vector<int>& outs;
    bool keep;
    ~Release() {
      if (!keep)
        for (int n : nodes) temps[n] = Tensor();
      for (int n : outs) temps[n] = Tensor();
    }
  } release{temps, buffers, graph.outputs, keep != nullptr};
  // An observer (step_observer.hpp) sees top-level runs only: runs nested in this one see none.
  StepObserver* observer = std::exchange(current_step_observer(), nullptr);
  struct Restore {
    StepObserver* o;
    ~Restore() { current_step_observer() = o; }
  } restore{observer};
  if (observer && (probe || (device.is_cuda() && stream && driver::is_capturing(stream))))
    observer = nullptr;  // (the driver is asked only when someone observes: not on the plain hit path)
  // Fresh outputs of a plain run are allocated as the step that writes them starts, not all at
  // once: a training step's gradients do not count toward the forward's peak (GPT-2's 497 MB of
  // f32 gradients; PyTorch's autograd allocates each .grad as it is computed). An observer is
  // handed every output before the first step, and kept or probed runs hold theirs all along.
  const bool stepwise = lifetimes.allocate_before.size() == kernels.size();
  const bool defer = stepwise && !keep && !probe && !observer && output_order.size() == graph.outputs.size();
  allocate_outputs(args, outputs, shape_of, stream, defer);
  for (std::size_t o = 0; o < graph.outputs.size(); ++o)
    if (arg_of_output[o] < 0) temps[graph.outputs[o]] = outputs[o];
  std::size_t next_output = 0;                   // output_order's first output not yet allocated
  auto allocate_outputs_until = [&](int step) {  // the fresh outputs of the steps up to `step`
    for (;
         next_output < output_order.size() && output_step[static_cast<std::size_t>(output_order[next_output])] <= step;
         ++next_output) {
      const auto o = static_cast<std::size_t>(output_order[next_output]);
      const int node = graph.outputs[o];
      if (outputs[o].defined()) continue;
      if (!temps[node].defined()) temps[node] = Tensor::empty(shape_of(node), graph[node].dt, device, stream);
      outputs[o] = temps[node];  // (two outputs of one node share its tensor)
    }
  };
  if (defer) allocate_outputs_until(-1);
  if (observer) observer->begin(*this, outputs, stream);
  // Intermediates: all of them now where they must outlive the run (keep) or a tuning probe reruns
  // steps; else each from its first step to its last (buffer_lifetimes.hpp).
  const bool all_buffers = keep || probe || !stepwise;
  auto allocate = [&](int b) {
    if (!temps[b].defined()) temps[b] = allocate_buffer(b, shape_of(b), stream);
  };
  if (all_buffers)
    for (int b : buffers) allocate(b);
  // Buffers with room get it zeroed as their lifetime starts, also where they were allocated
  // before (a CUDA graph's buffers, which share blocks with others: zeroing is part of the graph).
  auto zero_rooms = [&](const std::vector<int>& nodes) {
    if (sched.padding.empty()) return;
    for (int b : nodes)
      if (schedule::padding_of(sched, b)) zero_room(temps[b], storage_shape(b, shape_of(b)), stream);
  };
  if (!stepwise) zero_rooms(buffers);
  auto buffer = [&](int node) -> const Tensor& {
    if (graph[node].op == Op::arg) return *args[graph[node].slot];
    if (!temps[node].defined()) not_live(node);
    return temps[node];
  };
  // A matmul operand: its buffer, or a reshaped and/or transposed view of one (no copy;
  // schedule::detail::matmul_operand says which).
  auto operand = [&](int node) {
    const int src = schedule::detail::matmul_operand(graph, node);
    if (src == node) return buffer(node);
    const graph::Node& n = graph[node];
    const bool transposed = n.op == Op::permute;
    const int reshaped = transposed ? n.in[0] : node;  // the reshape, where there is one
    Tensor t = buffer(src);
    if (reshaped != src) {  // a computed buffer, contiguous (eval(out, ...) destinations are too)
      if (!t.is_contiguous())
        throw error("matmul: internal error: the buffer of %" + std::to_string(src) + " " + t.shape().str() +
                    " that a reshape views for a matmul is strided " + t.strides().str());
      const Dims shape = shape_of(reshaped);
      t = t.as_strided(shape, contiguous_strides(shape), t.offset());
    }
    if (!transposed) return t;
    Dims shape, strides;
    for (auto d : n.attrs.dims) shape.push_back(t.shape()[d]), strides.push_back(t.strides()[d]);
    return t.as_strided(shape, strides, t.offset());
  };

  // The storage shape of a matmul's operand or output that has room (schedule/pad_buffers.hpp):
  // the padded shape of its buffer, transposed with the operand; empty where it has none.
  auto room = [&](int node) {
    const bool transposed = graph[node].op == Op::permute;
    const int src = transposed ? graph[node].in[0] : node;
    const schedule::Padding pad = schedule::padding_of(sched, src);
    if (!pad || graph[src].op == Op::arg) return Dims{};
    Dims r = schedule::padded_shape(shape_of(src), pad);
    return transposed ? Dims{r[1], r[0]} : r;
  };

  // The argument slots of a kernel source's parameters (a plain function: a probe binds its
  // candidates' parameters with it too).
  struct BindState {
    const graph::Graph* graph;
    const Tensor* const* args;
    const std::vector<Tensor>* temps;
    const double* scalars;
    std::vector<std::int64_t>* sizes;
    std::vector<void*>*ptrs, *slots;
    std::vector<double>* scal;
  } state{&graph, args, &temps, scalars, &sizes, &ptrs, &slots, &scal};
  BindParams bind_params = [](const void* st, const codegen::KernelSource& src) -> void** {
    const auto& s = *static_cast<const BindState*>(st);
    std::size_t np = src.params.size();
    if (s.ptrs->size() < np) s.ptrs->resize(np), s.slots->resize(np), s.scal->resize(np);
    for (std::size_t i = 0; i < np; ++i) {
      const auto& p = src.params[i];
      const graph::Node& n = (*s.graph)[p.ref];
      switch (p.kind) {
        case codegen::Param::in_ptr:
        case codegen::Param::out_ptr:
          if (n.op != Op::arg && !(*s.temps)[p.ref].defined()) not_live(p.ref);
          (*s.ptrs)[i] = (n.op == Op::arg ? *s.args[n.slot] : (*s.temps)[p.ref]).data_ptr();
          (*s.slots)[i] = &(*s.ptrs)[i];
          break;
        case codegen::Param::scalar:
          (*s.scal)[i] = s.scalars[p.ref];
          (*s.slots)[i] = &(*s.scal)[i];
          break;
        case codegen::Param::size:
          (*s.slots)[i] = &(*s.sizes)[p.ref];
          break;
      }
    }
    return s.slots->data();
  };
  if (device.is_cuda()) driver::make_current(device.index);
  auto check_after = [&](int kernel) {  // the ids that kernel `kernel` computed (-1: the arguments)
    for (const auto& c : index_checks)
      if (c.after_kernel == kernel) check_ids(buffer(c.ids), shape_of(c.table)[0], stream);
  };
  profile::Run prof(device.is_cuda(), stream);  // KILN_PROFILE: times each step (profile.hpp)
  auto run_generated = [&](const CompiledKernel& k) {
    const std::int64_t nprog = detail::num_programs(k, bind);
    if (nprog == 0) return;
    bind_params(&state, k.src);
    if (device.is_cpu()) {
      k.cpu(slots.data(), nprog);
    } else {
      launch_compiled(k, nprog, slots.data(), stream);
    }
  };
  auto run_step = [&](const CompiledKernel& k) {
    if (k.extern_node >= 0) {
      const auto& n = graph[k.extern_node];
      if (is_custom(n.op)) {  // the user's own function: runtime/extern/custom.hpp
        run_custom(n, buffer, temps[k.extern_node], stream);
        return;
      }
      if (n.op == Op::embedding_backward) {  // a deterministic scatter-add: runtime/extern/embedding_backward.hpp
        embedding_backward(buffer(n.in[0]), buffer(n.in[1]), temps[k.extern_node], stream);
        return;
      }
      // A score_mod's parameters: this call's scalars and the tensors it reads (the inputs after the
      // scale), against the scores' [B, H, Tq, Tk].
      auto mod_of = [&](const graph::Node& n) {
        if (n.attrs.custom < 0) return ScoreModCall{};  // (plain attention: nothing to gather)
        std::vector<const Tensor*> captured;
        for (int c = first_captured_input(n); c < n.n_in; ++c) captured.push_back(&buffer(n.in[c]));
        const Dims &qs = buffer(n.in[0]).shape(), &ks = buffer(n.in[1]).shape();
        return score_mod_call(n, scalars, captured, Dims{qs[0], qs[1], qs[2], ks[2]});
      };
      if (n.op == Op::attention_flash) {  // the fused attention kernel: runtime/extern/attention.hpp
        const int lse = k.attention_lse;
        attention_flash(buffer(n.in[0]), buffer(n.in[1]), buffer(n.in[2]),
                        attention_scale(graph, n, scalars, buffer(n.in[0]).shape()[3]), n.attrs.a,
                        static_cast<int>(n.attrs.d), static_cast<int>(n.attrs.dims[0]),
                        n.attrs.dims.size() > 1 ? static_cast<int>(n.attrs.dims[1]) : 0, temps[k.extern_node],
                        lse >= 0 ? &temps[lse] : nullptr, mod_of(n), stream, autotune);
        return;
      }
      if (n.op == Op::attention_lse) {  // the rows' log-sum-exp where no forward kernel wrote it
        attention_lse(buffer(n.in[0]), buffer(n.in[1]), attention_scale(graph, n, scalars, buffer(n.in[0]).shape()[3]),
                      n.attrs.a, temps[k.extern_node], mod_of(n), stream);
        return;
      }
      if (n.op == Op::attention_grad) {  // dq, dk or dv of the fused backward
        attention_grad(static_cast<codegen::AttentionBackwardKernel::Part>(n.attrs.c + 1), buffer(n.in[0]),
                       buffer(n.in[1]), buffer(n.in[2]), buffer(n.in[3]), buffer(n.in[4]),
                       attention_scale(graph, n, scalars, buffer(n.in[0]).shape()[3]), n.attrs.a, n.attrs.d != 0,
                       temps[k.extern_node], mod_of(n), stream, autotune);
        return;
      }
      Tensor a = operand(n.in[0]), b = operand(n.in[1]);
      if (k.epilogue >= 0) {  // bias and activation in the GEMM (schedules for CUDA only)
        run_matmul_step(sched.epilogues[k.epilogue], a, b, buffer, stream, autotune);
      } else if (device.is_cpu()) {
        cpu_matmul(a, b, temps[k.extern_node]);
      } else {
        const GemmRooms rooms{room(n.in[0]), room(n.in[1]), room(k.extern_node)};
        cuda_matmul(a, b, temps[k.extern_node], stream, autotune, &rooms);
      }
      return;
    }
    if (probe && device.is_cuda()) {
      if (detail::num_programs(k, bind) > 0)
        probe->launch(static_cast<std::size_t>(&k - kernels.data()), bind_params, &state, bind, stream);
      return;
    }
    run_generated(kernel_for(k, bind));
  };
  for (const auto& k : kernels) {
    const auto step = static_cast<std::size_t>(&k - kernels.data());
    if (!all_buffers)
      for (int b : lifetimes.allocate_before[step]) allocate(b);
    if (stepwise) zero_rooms(lifetimes.allocate_before[step]);
    if (defer) allocate_outputs_until(static_cast<int>(step));
    if (check_indices) check_after(static_cast<int>(step) - 1);
    if (prof.active()) {
      // a specialised kernel's twin, where this call launches it, under its own name
      std::string what = unit_name(k.extern_node < 0 ? kernel_for(k, bind).src.name : k.src.name);
      if (k.extern_node >= 0 && graph[k.extern_node].op == Op::matmul)
        what += " " + shape_of(graph[k.extern_node].in[0]).str() + " x " + shape_of(graph[k.extern_node].in[1]).str() +
                " " + std::string(name(graph[k.extern_node].dt));
      else if (k.extern_node < 0)  // a generated kernel: its sizes (elements; rows x row length)
        what += k.src.kind == schedule::Kind::poi
                    ? " " + std::to_string(k.src.xnumel.eval(bind))
                    : " " + std::to_string(k.src.xnumel.eval(bind)) + " x " + std::to_string(k.src.rnumel.eval(bind));
      prof.start(std::move(what));
      run_step(k);
      prof.stop();
    } else {
      run_step(k);
    }
    if (observer) observer->after_step(step, stream);
    if (!all_buffers)  // this step's last buffers go back to the allocator, in stream order
      for (int b : lifetimes.release_after[step]) temps[b] = Tensor();
  }
  if (observer) observer->end(stream);
}

}  // namespace kiln::runtime
