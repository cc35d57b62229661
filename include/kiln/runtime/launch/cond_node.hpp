// A data-dependent branch as a CUDA conditional graph node, recorded while kiln captures a program
// for `.cuda_graphs` (GraphReplay): a one-thread kernel reads the predicate on the device and sets
// the node's handle with cudaGraphSetConditional, and each branch is captured into a body graph of
// the node, so every replay takes the right branch without the host. cudaGraphSetConditional lives
// in the device runtime (libcudadevrt.a), so that kernel is compiled by NVRTC with -rdc and linked
// by nvJitLink, once per architecture (disk cache). One IF node with an ELSE body needs driver 12.8;
// from 12.3 two IF nodes follow each other, their handles set to p and !p.
#pragma once
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "../../core/driver.hpp"
#include "../../core/driver_conditional.hpp"
#include "../../core/tensor.hpp"
#include "../compile/disk_cache.hpp"
#include "../compile/hash.hpp"
#include "../compile/nvjitlink.hpp"
#include "../compile/nvrtc.hpp"
#include "capture_keep.hpp"
#include "cuda_module.hpp"

namespace kiln::runtime {
namespace cond_node {

inline constexpr const char* set_kernel_name = "kiln_cond_set";

// One thread: handle `if_true` gets the predicate, `if_false` (two IF nodes) its negation.
inline constexpr const char* set_kernel_source = R"(
extern "C" __global__ void kiln_cond_set(const bool* pred, cudaGraphConditionalHandle if_true,
                                         cudaGraphConditionalHandle if_false, unsigned two) {
  const unsigned taken = *pred ? 1u : 0u;
  cudaGraphSetConditional(if_true, taken);
  if (two) cudaGraphSetConditional(if_false, 1u - taken);
}
)";

// The set kernel linked with the device runtime for arch: from the disk cache, else NVRTC (-rdc)
// then nvJitLink. Needs no GPU.
inline std::vector<char> set_kernel_cubin(const std::string& arch) {
  const std::vector<std::string> rdc{"-rdc=true"};
  Hasher h;
  h.update(set_kernel_source).update(nvrtc_options_string(arch, rdc)).update(nvrtc_version());
  h.update("nvJitLink + ").update(nvjitlink::find_device_runtime());
  const std::string key = hex(h.digest());
  if (auto cached = default_disk_cache().load(key, "cubin")) return std::move(*cached);
  std::vector<char> object = compile_cubin(set_kernel_source, set_kernel_name, arch, rdc);
  std::vector<char> cubin = nvjitlink::link_with_device_runtime(object, set_kernel_name, arch);
  default_disk_cache().store(key, "cubin", cubin);
  return cubin;
}

// Per device: the loaded set kernel, or why conditional nodes cannot be recorded there.
struct DeviceState {
  std::once_flag once;
  std::string missing;
  CUfunction set = nullptr;
  bool if_else = false;
};

inline DeviceState& device_state(int device) {
  static std::once_flag made;
  static std::unique_ptr<DeviceState[]> states;
  std::call_once(made, [] { states = std::make_unique<DeviceState[]>(driver::device_count()); });
  driver::require_device(device);
  DeviceState& d = states[device];
  std::call_once(d.once, [&] {
    const driver::ConditionalSupport& support = driver::conditional_support();
    d.missing = support.missing;
    d.if_else = support.if_else;
    if (!d.missing.empty()) return;
    try {  // the module is never unloaded: the driver may be gone at exit
      auto* module = new Module(set_kernel_cubin(driver::arch(device)), device);
      d.set = module->function(set_kernel_name);
    } catch (const error& e) {
      d.missing = e.what();
    }
  });
  return d;
}

// Tests: record two IF nodes even where the driver has IF/ELSE (the path of drivers 12.3 to 12.7).
inline std::atomic<bool>& two_if_nodes() {
  static std::atomic<bool> forced{false};
  return forced;
}

// Why conditional nodes cannot be recorded on this device, or empty. Builds and loads the set
// kernel the first time (GraphReplay asks before its capture starts).
inline const std::string& unavailable(int device) { return device_state(device).missing; }

// The private stream a body is captured on, per thread, device and nesting level (a branch may hold
// a k::cond of its own, captured while the outer body's stream is still capturing).
inline int& body_depth() {
  thread_local int depth = 0;
  return depth;
}
inline CUstream body_stream(int device) {
  struct Streams {
    std::map<std::pair<int, int>, CUstream> by_key;
    ~Streams() {
      if (driver::initialized())
        for (auto& [key, s] : by_key) driver::api().stream_destroy(s);
    }
  };
  thread_local Streams streams;
  CUstream& s = streams.by_key[{device, body_depth()}];
  if (!s) {
    driver::make_current(device);
    driver::check(driver::api().stream_create(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  }
  return s;
}

#if KILN_HAS_CONDITIONAL_NODES

// Captures body(stream) into `graph` (a conditional node's body), keeping what it allocates.
template <class Body>
void capture_body(CUgraph graph, int device, Body&& body) {
  const driver::ConditionalApi& a = driver::conditional_support().api;
  CUstream s = body_stream(device);
  driver::check(a.begin_capture_to_graph(s, graph, nullptr, nullptr, 0, CU_STREAM_CAPTURE_MODE_RELAXED),
                "cuStreamBeginCaptureToGraph (a k::cond branch)");
  CUgraph captured = nullptr;
  try {
    ++body_depth();
    struct Leave {
      ~Leave() { --body_depth(); }
    } leave;
    KeptAllocations kept;
    body(s);
  } catch (...) {
    driver::api().stream_end_capture(s, &captured);  // the body graph belongs to its node
    throw;
  }
  driver::check(driver::api().stream_end_capture(s, &captured), "cuStreamEndCapture (a k::cond branch)");
}

// Adds an IF node with `size` bodies after the capture's current dependencies.
inline CUgraphNode add_if_node(CUgraph graph, const CUgraphNode* deps, const CUgraphEdgeData* edges, std::size_t n,
                               CUgraphConditionalHandle handle, unsigned size, CUcontext ctx, CUgraph* bodies) {
  CUgraphNodeParams params{};
  params.type = CU_GRAPH_NODE_TYPE_CONDITIONAL;
  params.conditional.handle = handle;
  params.conditional.type = CU_GRAPH_COND_TYPE_IF;
  params.conditional.size = size;
  params.conditional.ctx = ctx;
  CUgraphNode node = nullptr;
  driver::check(driver::conditional_support().api.graph_add_node(&node, graph, deps, edges, n, &params),
                "cuGraphAddNode (a k::cond conditional node)");
  for (unsigned i = 0; i < size; ++i) bodies[i] = params.conditional.phGraph_out[i];
  return node;
}

// Records, on stream s which kiln is capturing, the node that runs if_true(stream) where the
// one-element boolean `pred` holds and if_false(stream) elsewhere; both bodies are captured now.
// The caller checked unavailable(device) is empty.
template <class IfTrue, class IfFalse>
void record(const Tensor& pred, CUstream s, IfTrue&& if_true, IfFalse&& if_false) {
  const int device = pred.device().index;
  const DeviceState& d = device_state(device);
  const bool if_else = d.if_else && !two_if_nodes().load(std::memory_order_relaxed);
  const driver::ConditionalApi& a = driver::conditional_support().api;
  driver::make_current(device);
  CUcontext ctx = nullptr;
  driver::check(driver::api().ctx_get_current(&ctx), "cuCtxGetCurrent");
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  CUgraph graph = nullptr;
  const CUgraphNode* deps = nullptr;
  const CUgraphEdgeData* edges = nullptr;
  std::size_t n = 0;
  driver::check(a.get_capture_info(s, &status, nullptr, &graph, &deps, &edges, &n), "cuStreamGetCaptureInfo");
  if (status != CU_STREAM_CAPTURE_STATUS_ACTIVE) throw error("k::cond: the stream's capture is not active");
  CUgraphConditionalHandle handles[2] = {0, 0};
  for (int i = 0; i < (if_else ? 1 : 2); ++i)
    driver::check(a.conditional_handle_create(&handles[i], graph, ctx, 0, 0), "cuGraphConditionalHandleCreate");
  void* p = pred.data_ptr();
  unsigned two = if_else ? 0u : 1u;
  void* args[] = {&p, &handles[0], &handles[1], &two};
  launch(d.set, {1, 1, 1}, {1, 1, 1}, 0, s, args, set_kernel_name);
  driver::check(a.get_capture_info(s, &status, nullptr, nullptr, &deps, &edges, &n), "cuStreamGetCaptureInfo");
  CUgraph bodies[2] = {nullptr, nullptr};
  CUgraphNode node = add_if_node(graph, deps, edges, n, handles[0], if_else ? 2 : 1, ctx, bodies);
  if (!if_else) node = add_if_node(graph, &node, nullptr, 1, handles[1], 1, ctx, bodies + 1);
  driver::check(a.update_capture_dependencies(s, &node, nullptr, 1, CU_STREAM_SET_CAPTURE_DEPENDENCIES),
                "cuStreamUpdateCaptureDependencies");
  capture_body(bodies[0], device, if_true);
  capture_body(bodies[1], device, if_false);
  if (CaptureKeep* k = active_capture_keep()) ++k->conditional_nodes;
}

#else

template <class IfTrue, class IfFalse>
void record(const Tensor&, CUstream, IfTrue&&, IfFalse&&) {
  throw error("k::cond: kiln was compiled without conditional graph nodes (cuda.h older than 12.3)");
}

#endif

}  // namespace cond_node
}  // namespace kiln::runtime
