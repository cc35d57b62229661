// The reduce-overhead mode (`.cuda_graphs = true`): a compiled program's launches are captured
// once into a CUDA graph and replayed with one cuGraphLaunch. A graph bakes in every kernel
// argument (buffer addresses, scalars, symbolic sizes), so each compiled program keeps a few
// instantiated graphs keyed by those values: a training loop whose outputs alternate between two
// buffers replays two graphs and never re-captures. Intermediates live as long as the graphs that
// write them; replays on different streams are ordered with an event, since they share them.
// Capturable custom ops (k::cond) are recorded too: a k::cond becomes a conditional node whose
// bodies' buffers the graph keeps (capture_keep.hpp); such a graph is never updated in place.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "capture_keep.hpp"
#include "cond_node.hpp"
#include "program.hpp"

namespace kiln::runtime {

class GraphReplay {
 public:
  // Instantiated graphs kept per program; the least recently used one is updated in place after.
  static constexpr std::size_t max_graphs = 8;

  explicit GraphReplay(const Program& p) : program_(p) {
    for (const auto& k : p.kernels)
      for (const auto& prm : k.src.params)
        if (prm.kind == codegen::Param::scalar) num_scalars_ = std::max(num_scalars_, prm.ref + 1);
    for (const auto& n : p.graph.nodes) {  // the fused attention kernels' scale and score_mod's scalars
      if (!is_fused_attention(n.op)) continue;
      if (p.graph[attention_scale_node(n)].op == Op::scalar)
        num_scalars_ = std::max(num_scalars_, p.graph[attention_scale_node(n)].slot + 1);
      if (const autodiff::ScoreMod* m = score_mod_call(n).mod)
        for (int slot : m->slots) num_scalars_ = std::max(num_scalars_, slot + 1);
    }
    graphs_.reserve(max_graphs);  // slots are referred to by address
  }
  GraphReplay(const GraphReplay&) = delete;
  GraphReplay& operator=(const GraphReplay&) = delete;
  ~GraphReplay() {
    if (!driver::initialized()) return;
    if (launched_ && done_) driver::api().event_synchronize(done_->handle());  // replays may still use the temps
    for (auto& g : graphs_)
      if (g.exec) driver::api().graph_exec_destroy(g.exec);
    if (capture_stream_) driver::api().stream_destroy(capture_stream_);
  }

  // Fills the outputs and queues one graph launch on `stream` (capturing a graph on a miss).
  void run(const Tensor* const* args, int nargs, const double* scalars, Tensor* outputs, ShapeFn shape_of,
           CUstream stream) {
    const Program& p = program_;
    p.allocate_outputs(args, outputs, shape_of, stream);
    std::lock_guard lock(mutex_);
    make_key(args, nargs, scalars, outputs, shape_of);
    Graph* g = find();
    if (!g) {
      try {
        g = &capture(args, scalars, outputs, shape_of, stream);
      } catch (const error& e) {
        // A step that cannot be captured: this program runs as plain launches from now on, said
        // once a process; a real error shows up again in the plain run.
        disabled_ = true;
        say_not_captured(e.what());
        p.run(args, scalars, outputs, shape_of, stream);
        return;
      }
    }
    g->last_use = ++clock_;
    order_after_last(stream);
    driver::check(driver::api().graph_launch(g->exec, stream), "cuGraphLaunch");
    mark_launched(stream);
    ++replays_;
  }

  // True once a capture of this program failed: run_entry then launches it plainly.
  bool disabled() const { return disabled_.load(std::memory_order_relaxed); }  // on every call: no lock

  std::size_t graphs() const {
    std::lock_guard lock(mutex_);
    return graphs_.size();
  }
  std::size_t captures() const {
    std::lock_guard lock(mutex_);
    return captures_;
  }
  std::size_t replays() const {
    std::lock_guard lock(mutex_);
    return replays_;
  }

 private:
  // The intermediates of one set of sizes, shared by the graphs captured with those sizes.
  struct Temps {
    std::vector<std::int64_t> sizes;
    std::vector<Tensor> buffers;  // views into `block` where the program's lifetimes are known
    Tensor block;                 // the intermediates, at offsets that never overlap while both live
  };
  struct Graph {
    std::vector<std::uint64_t> key;
    CUgraphExec exec = nullptr;
    std::shared_ptr<Temps> temps;
    CaptureKeep kept;  // buffers of work recorded inside the capture (k::cond bodies)
    std::uint64_t last_use = 0;
  };

  // Everything a graph bakes in: buffer addresses, scalar bits and symbolic sizes.
  void make_key(const Tensor* const* args, int nargs, const double* scalars, const Tensor* outputs, ShapeFn shape_of) {
    const Program& p = program_;
    key_.clear();
    for (int i = 0; i < nargs; ++i) key_.push_back(reinterpret_cast<std::uintptr_t>(args[i]->data_ptr()));
    for (std::size_t o = 0; o < p.graph.outputs.size(); ++o)
      key_.push_back(reinterpret_cast<std::uintptr_t>(outputs[o].data_ptr()));
    for (int i = 0; i < num_scalars_; ++i) {
      std::uint64_t bits;
      std::memcpy(&bits, &scalars[i], sizeof bits);
      key_.push_back(bits);
    }
    sizes_.assign(static_cast<std::size_t>(p.env.num_symbols()) + 1, 0);
    p.env.bind(shape_of, sizes_.data());
    for (auto v : sizes_) key_.push_back(static_cast<std::uint64_t>(v));
  }

  Graph* find() {
    for (auto& g : graphs_)
      if (g.key == key_) return &g;
    return nullptr;
  }

  std::shared_ptr<Temps> temps_for_sizes() {
    for (auto& g : graphs_)
      if (g.temps && g.temps->sizes == sizes_) return g.temps;
    auto t = std::make_shared<Temps>();
    t->sizes = sizes_;
    return t;
  }

  // Records the program's launches on a private stream (relaxed mode: other threads may keep
  // allocating meanwhile) and instantiates them, or updates the least recently used graph.
  Graph& capture(const Tensor* const* args, const double* scalars, Tensor* outputs, ShapeFn shape_of, CUstream stream) {
    const Program& p = program_;
    const driver::Api& api = driver::api();
    driver::make_current(p.device.index);
    if (!capture_stream_) driver::check(api.stream_create(&capture_stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    for (const auto& k : p.kernels)  // library workspaces must exist before the capture starts
      if (k.extern_node >= 0) cuda_mm_detail::workspace(p.device.index, capture_stream_);
    if (has_capturable_custom_ops()) (void)cond_node::unavailable(p.device.index);  // loads the set kernel now
    auto temps = temps_for_sizes();
    temps->buffers.resize(std::max<std::size_t>(temps->buffers.size(), p.graph.nodes.size()));
    if (!temps->block.defined() && p.lifetimes.allocate_before.size() == p.kernels.size()) {
      // Intermediates at offsets in one block, apart wherever their lifetimes overlap
      // (launch/buffer_lifetimes.hpp).
      auto bytes_of = [&](int b) {
        return static_cast<std::size_t>(p.storage_shape(b, shape_of(b)).product()) * itemsize(p.graph[b].dt);
      };
      const PackedBuffers packed = pack_buffers(p.lifetimes, p.graph.nodes.size(), bytes_of);
      debug::log_lazy(debug::Channel::cache, [&] {
        return "CUDA graph of a program of " + std::to_string(p.kernels.size()) +
               " steps: its intermediates in one block of " + std::to_string(packed.bytes >> 20) +
               " MiB (their live peak " + std::to_string(packed.live_peak >> 20) + " MiB)";
      });
      if (packed.bytes > 0)
        temps->block =
            Tensor::empty(Dims{static_cast<std::int64_t>((packed.bytes + 3) / 4)}, dtype::f32, p.device, stream);
      for (int b : p.buffers) {
        const std::ptrdiff_t at = packed.offset_of[static_cast<std::size_t>(b)];
        if (at >= 0 && !temps->buffers[b].defined())
          temps->buffers[b] = p.wrap_buffer(b, static_cast<char*>(temps->block.data_ptr()) + at, shape_of(b));
      }
    }
    for (int b : p.buffers) {  // allocated outside the capture, on the stream the replays go to
      bool output = std::find(p.graph.outputs.begin(), p.graph.outputs.end(), b) != p.graph.outputs.end();
      if (!output && !temps->buffers[b].defined()) temps->buffers[b] = p.allocate_buffer(b, shape_of(b), stream);
    }
    driver::check(api.stream_begin_capture(capture_stream_, CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture");
    CUgraph graph = nullptr;
    CaptureKeep kept;
    try {
      KeepingCapture keeping(kept);
      p.run(args, scalars, outputs, shape_of, capture_stream_, &temps->buffers);
    } catch (...) {
      api.stream_end_capture(capture_stream_, &graph);
      if (graph) api.graph_destroy(graph);
      throw;
    }
    driver::check(api.stream_end_capture(capture_stream_, &graph), "cuStreamEndCapture");
    struct Destroy {
      CUgraph g;
      ~Destroy() { driver::api().graph_destroy(g); }
    } destroy{graph};
    ++captures_;
    Graph* slot = nullptr;
    if (graphs_.size() < max_graphs) {
      slot = &graphs_.emplace_back();
    } else {
      slot = &graphs_.front();
      for (auto& g : graphs_)
        if (g.last_use < slot->last_use) slot = &g;
      if (launched_) done_->synchronize();  // the evicted graph's temps may be freed below
      slot->key.clear();                    // no stale key if the update and instantiation fail
      CUgraphExecUpdateResultInfo info{};
      // Conditional nodes (their handles belong to one graph) are never updated in place.
      bool conditional = kept.conditional_nodes > 0 || slot->kept.conditional_nodes > 0;
      if (conditional || api.graph_exec_update(slot->exec, graph, &info) != CUDA_SUCCESS) {
        api.graph_exec_destroy(slot->exec);
        slot->exec = nullptr;
      }
    }
    if (!slot->exec) driver::check(api.graph_instantiate(&slot->exec, graph, 0), "cuGraphInstantiate");
    slot->key = key_;
    slot->temps = std::move(temps);
    slot->kept = std::move(kept);  // the evicted graph's are released here, after its last replay
    return *slot;
  }

  static void say_not_captured(const char* why) {
    static std::once_flag said;
    std::call_once(said, [&] {
      std::string line = std::string("kiln: .cuda_graphs: a compiled program could not be captured and runs as "
                                     "plain launches (") + why + ")";
      std::fprintf(stderr, "%s\n", line.c_str());
      debug::log(debug::Channel::graph_breaks, line);
    });
  }

  bool has_capturable_custom_ops() const {
    for (const auto& k : program_.kernels)
      if (k.extern_node >= 0 && is_custom(program_.graph[k.extern_node].op)) return true;
    return false;
  }

  // Replays share their intermediates: a replay on another stream first waits for the last one.
  // The last replay is marked by an event recorded right after it, so the wait never touches the
  // earlier stream (which the caller may have destroyed since).
  void order_after_last(CUstream stream) {
    if (launched_ && stream != last_stream_)
      driver::check(driver::api().stream_wait_event(stream, done_->handle(), 0), "cuStreamWaitEvent");
  }
  void mark_launched(CUstream stream) {
    if (!done_) done_ = std::make_unique<Event>(CU_EVENT_DISABLE_TIMING);
    done_->record(stream);
    launched_ = true;
    last_stream_ = stream;
  }

  const Program& program_;
  mutable std::mutex mutex_;
  int num_scalars_ = 0;
  std::vector<Graph> graphs_;
  std::vector<std::uint64_t> key_;
  std::vector<std::int64_t> sizes_;
  CUstream capture_stream_ = nullptr;
  CUstream last_stream_ = nullptr;
  bool launched_ = false;
  std::atomic<bool> disabled_{false};
  std::unique_ptr<Event> done_;
  std::uint64_t clock_ = 0;
  std::size_t captures_ = 0, replays_ = 0;
};

}  // namespace kiln::runtime
