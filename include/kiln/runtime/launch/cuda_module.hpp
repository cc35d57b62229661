// Loading compiled kernels onto a GPU and launching them, plus events for timing them.
#pragma once
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../../core/driver.hpp"

namespace kiln::runtime {

// Grid or block extents, like CUDA's dim3.
struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
  std::string str() const { return std::to_string(x) + "x" + std::to_string(y) + "x" + std::to_string(z); }
};

// A CUBIN loaded into one device's primary context; unloaded when the last owner goes.
class Module {
 public:
  Module(const void* image, int device) : device_(device) {
    driver::make_current(device);
    CUresult r = driver::api().module_load_data(&module_, image);
    if (r != CUDA_SUCCESS) driver::throw_error(r, "load a CUBIN on cuda:" + std::to_string(device));
  }
  explicit Module(const std::vector<char>& cubin, int device = 0) : Module(cubin.data(), device) {}

  Module(Module&& o) noexcept : module_(std::exchange(o.module_, nullptr)), device_(o.device_) {}
  Module& operator=(Module&& o) noexcept {
    std::swap(module_, o.module_);
    std::swap(device_, o.device_);
    return *this;
  }
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  // The result is ignored: at process exit the driver may already be shut down.
  ~Module() {
    if (module_) driver::api().module_unload(module_);
  }

  CUfunction function(const char* name) const {
    CUfunction f = nullptr;
    CUresult r = driver::api().module_get_function(&f, module_, name);
    if (r != CUDA_SUCCESS) driver::throw_error(r, "find kernel " + std::string(name) + " in its module");
    return f;
  }

  CUmodule handle() const { return module_; }
  int device() const { return device_; }

 private:
  CUmodule module_ = nullptr;
  int device_ = 0;
};

namespace detail {

[[noreturn]] inline void launch_failed(CUresult r, const char* kernel_name, Dim3 grid, Dim3 block,
                                       unsigned shared_bytes) {
  driver::throw_error(r, "launch " + std::string(kernel_name ? kernel_name : "kernel") + " (grid " + grid.str() +
                             ", block " + block.str() + ", " + std::to_string(shared_bytes) + " B shared)");
}

}  // namespace detail

// Lets f ask for `shared_bytes` of dynamic shared memory. The driver's default is 48 KiB less the
// kernel's static shared memory (a row reduction's slots), so any dynamic amount raises the limit.
inline void allow_shared(CUfunction f, unsigned shared_bytes, const char* kernel_name, Dim3 grid = {}, Dim3 block = {}) {
  if (shared_bytes == 0) return;
  CUresult r = driver::api().func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                static_cast<int>(shared_bytes));
  if (r != CUDA_SUCCESS) detail::launch_failed(r, kernel_name, grid, block, shared_bytes);
}

// Queues f on stream s; args points at each kernel argument in order. The function's device must
// be current on this thread (driver::make_current). Above 48 KiB of dynamic shared memory the
// limit is raised here; generated row kernels have theirs raised once, when loaded (row_grid_limit),
// so that their launches make no extra driver call.
inline void launch(CUfunction f, Dim3 grid, Dim3 block, unsigned shared_bytes, CUstream s, void** args,
                   const char* kernel_name) {
  const driver::Api& api = driver::api();
  if (shared_bytes > 48 * 1024) allow_shared(f, shared_bytes, kernel_name, grid, block);
  CUresult r = api.launch_kernel(f, grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes, s, args, nullptr);
  if (r != CUDA_SUCCESS) [[unlikely]]
    detail::launch_failed(r, kernel_name, grid, block, shared_bytes);
}

// A CUDA event on the current context, for ordering and for timing with elapsed_ms.
class Event {
 public:
  explicit Event(unsigned flags = CU_EVENT_DEFAULT) {
    driver::ensure_context();
    driver::check(driver::api().event_create(&event_, flags), "cuEventCreate");
  }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (event_) driver::api().event_destroy(event_);
  }

  void record(CUstream s = nullptr) { driver::check(driver::api().event_record(event_, s), "cuEventRecord"); }
  void synchronize() const { driver::check(driver::api().event_synchronize(event_), "cuEventSynchronize"); }
  CUevent handle() const { return event_; }

 private:
  CUevent event_ = nullptr;
};

// Milliseconds between two recorded events; waits for the later one to complete.
inline float elapsed_ms(const Event& start, const Event& end) {
  end.synchronize();
  float ms = 0;
  driver::check(driver::api().event_elapsed_time(&ms, start.handle(), end.handle()), "cuEventElapsedTime");
  return ms;
}

// Milliseconds a call of go() takes on stream s, for autotuning: after one warm-up call, the
// fastest of `rounds` means over back-to-back calls (as many as fill about a millisecond, 2 to 20).
template <class Go>
double time_calls_ms(Go&& go, CUstream s, int rounds = 3) {
  Event start, end;
  go();
  start.record(s);
  go();
  end.record(s);
  double once = elapsed_ms(start, end);
  int reps = static_cast<int>(std::clamp(1.0 / std::max(once, 1e-3), 2.0, 20.0));
  double best = once;
  for (int r = 0; r < rounds; ++r) {
    start.record(s);
    for (int i = 0; i < reps; ++i) go();
    end.record(s);
    best = std::min(best, static_cast<double>(elapsed_ms(start, end)) / reps);
  }
  return best;
}

}  // namespace kiln::runtime
