// What kiln's own CUDA graph capture (GraphReplay, the `.cuda_graphs` mode) keeps alive for the
// graph it records. Work recorded inside that capture by a nested kiln call — a k::cond branch
// captured into a conditional node's body — allocates its intermediates during the capture, and
// every replay reads those addresses: they live exactly as long as the instantiated graph. The
// keeper of the capture in progress is thread-local (the capture runs on one thread).
#pragma once
#include <utility>
#include <vector>

#include "../../core/driver_allocator.hpp"
#include "../../core/tensor.hpp"

namespace kiln::runtime {

struct CaptureKeep {
  std::vector<std::vector<Tensor>> runs;  // the buffers of each nested run recorded into the graph
  int conditional_nodes = 0;              // such a graph is instantiated anew, never updated in place
};

// The keeper of the capture GraphReplay is recording on this thread, or nullptr.
inline CaptureKeep*& active_capture_keep() {
  thread_local CaptureKeep* keep = nullptr;
  return keep;
}

// Makes `k` the thread's keeper for a scope (GraphReplay::capture).
class KeepingCapture {
 public:
  explicit KeepingCapture(CaptureKeep& k) : outer_(std::exchange(active_capture_keep(), &k)) {}
  ~KeepingCapture() { active_capture_keep() = outer_; }
  KeepingCapture(const KeepingCapture&) = delete;
  KeepingCapture& operator=(const KeepingCapture&) = delete;

 private:
  CaptureKeep* outer_;
};

// For a scope in which every allocation is handed to the keeper (a k::cond branch body): the
// caching allocator may then take fresh blocks from the driver during the (relaxed) capture.
class KeptAllocations {
 public:
  KeptAllocations() : outer_(std::exchange(driver::capture_allocations_kept(), true)) {}
  ~KeptAllocations() { driver::capture_allocations_kept() = outer_; }
  KeptAllocations(const KeptAllocations&) = delete;
  KeptAllocations& operator=(const KeptAllocations&) = delete;

 private:
  bool outer_;
};

}  // namespace kiln::runtime
