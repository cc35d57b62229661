// cuda_matmul's state per CUDA device: the cuBLASLt handle, a workspace per stream, the heuristic's
// cached answers, and the module of the strided-copy and padding kernels (loaded by strided_copy.hpp).
#pragma once
#include <cublasLt.h>  // types and prototypes only: libcublasLt is never linked

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../../core/driver.hpp"
#include "../launch/cuda_module.hpp"
#include "cublaslt.hpp"

namespace kiln::runtime {
namespace cuda_mm_detail {

inline constexpr std::size_t workspace_bytes = std::size_t(32) << 20;
inline constexpr std::size_t max_cached_algos = 4096;

// A workspace of one stream. cuBLASLt may run one matmul as several kernels that pass partial sums
// through it (split K), so two host threads queueing matmuls on one stream (the default stream, say)
// must not interleave their kernels: each holds `busy` while it queues one matmul.
struct Workspace {
  void* ptr = nullptr;
  std::mutex busy;
};

// cuBLASLt's state for one device: its handle, the copy kernels, a workspace per stream and the
// heuristic's answers per problem.
struct DeviceState {
  std::once_flag handle_once;
  cublasLtHandle_t handle = nullptr;
  std::once_flag copy_once;
  Module* copy_module = nullptr;  // never unloaded: the driver may be gone at exit
  CUfunction copy_fns[4][4] = {};
  CUfunction pad_fns[2] = {};  // kiln_mm_pad_b16, kiln_mm_pad_b32
  std::mutex mutex;
  std::map<CUstream, std::unique_ptr<Workspace>> workspaces;  // never freed: captured graphs may still point at them
  std::map<std::vector<std::int64_t>, cublasLtMatmulAlgo_t> algos;
};

inline DeviceState& state(int device) {
  static std::once_flag made;
  static DeviceState* states = nullptr;  // never destroyed, like the caching allocator
  std::call_once(made, [] { states = new DeviceState[driver::device_count()]; });
  driver::require_device(device);
  return states[device];
}

inline cublasLtHandle_t handle(int device) {
  DeviceState& s = state(device);
  std::call_once(s.handle_once, [&] {
    driver::make_current(device);
    cublasLtHandle_t h = nullptr;
    cublaslt::check(cublaslt::api().create(&h), "cublasLtCreate");
    s.handle = h;
  });
  return s.handle;
}

// The workspace for work queued on this stream (one per stream, so concurrent streams never share;
// threads sharing a stream take turns through its `busy` mutex).
inline Workspace& workspace(int device, CUstream stream) {
  DeviceState& s = state(device);
  std::lock_guard lock(s.mutex);
  auto it = s.workspaces.find(stream);
  if (it != s.workspaces.end()) return *it->second;
  auto w = std::make_unique<Workspace>();
  w->ptr = driver::allocate(workspace_bytes, device, stream);
  return *s.workspaces.emplace(stream, std::move(w)).first->second;
}

}  // namespace cuda_mm_detail
}  // namespace kiln::runtime
