// What kiln's own CUDA graph capture (GraphReplay, the `.cuda_graphs` mode) keeps alive for the
// graph it records. Work recorded inside that capture by a nested kiln call — a k::cond branch
// captured into a conditional node's body — allocates its intermediates during the capture, and
// every replay reads those addresses: they live exactly as long as the instantiated graph. The
// keeper of the capture in progress is thread-local (the capture runs on one thread).
#pragma once
#include <optional>
#include <utility>
#include <vector>

#include "../../core/driver_allocator.hpp"
#include "../../core/driver_stream.hpp"
#include "../../core/tensor.hpp"

namespace kiln::runtime {

// The temporaries of library calls (a padded GEMM operand, a contiguous copy, a sort's keys)
// recorded into a graph, which reads them on every replay: they live as long as the graph.
struct CaptureScratch {
  std::vector<Tensor> blocks;
  bool may_allocate = false;  // kiln's own relaxed capture; a caller's capture takes cached blocks only
};

struct CaptureKeep {
  std::vector<std::vector<Tensor>> runs;  // the buffers of each nested run recorded into the graph
  CaptureScratch scratch{{}, true};       // library calls' temporaries (capture_temporary)
  int conditional_nodes = 0;              // such a graph is instantiated anew, never updated in place
};

// The scratch of the capture being recorded on this thread (kiln's or, during a compiled call
// inside it, the caller's), or nullptr.
inline CaptureScratch*& active_capture_scratch() {
  thread_local CaptureScratch* scratch = nullptr;
  return scratch;
}

// Makes `s` the thread's capture scratch for a scope.
class ScratchForCapture {
 public:
  explicit ScratchForCapture(CaptureScratch& s) : outer_(std::exchange(active_capture_scratch(), &s)) {}
  ~ScratchForCapture() { active_capture_scratch() = outer_; }
  ScratchForCapture(const ScratchForCapture&) = delete;
  ScratchForCapture& operator=(const ScratchForCapture&) = delete;

 private:
  CaptureScratch* outer_;
};

// The keeper of the capture GraphReplay is recording on this thread, or nullptr.
inline CaptureKeep*& active_capture_keep() {
  thread_local CaptureKeep* keep = nullptr;
  return keep;
}

// Makes `k` the thread's keeper for a scope (GraphReplay::capture).
class KeepingCapture {
 public:
  explicit KeepingCapture(CaptureKeep& k) : outer_(std::exchange(active_capture_keep(), &k)), scratch_(k.scratch) {}
  ~KeepingCapture() { active_capture_keep() = outer_; }
  KeepingCapture(const KeepingCapture&) = delete;
  KeepingCapture& operator=(const KeepingCapture&) = delete;

 private:
  CaptureKeep* outer_;
  ScratchForCapture scratch_;
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

// A temporary of a library call, queued on `stream`. While a capture records `stream`, one of the
// blocks its graph keeps: a block no call holds any more (only the scratch's handle is left) goes
// to a later call of the same capture, whose work the graph orders after the earlier one's; a new
// block comes from the driver in kiln's own capture, from the allocator's cache in a caller's
// (which, failing that, says to warm the function first). Anywhere else: a plain allocation,
// freed stream-ordered as usual.
inline Tensor capture_temporary(const Dims& shape, kiln::dtype d, Device dev, CUstream stream) {
  CaptureScratch* k = active_capture_scratch();
  if (!k || !stream || !dev.is_cuda() || !driver::is_capturing(stream)) return Tensor::empty(shape, d, dev, Stream(stream));
  const std::size_t bytes = static_cast<std::size_t>(shape.product()) * itemsize(d);
  Tensor* best = nullptr;  // the smallest free block of this dtype and device that fits
  for (Tensor& t : k->blocks)
    if (t.storage().use_count() == 1 && t.dtype() == d && t.device() == dev && t.nbytes() >= bytes &&
        (!best || t.nbytes() < best->nbytes()))
      best = &t;
  if (best) return best->as_strided(shape, contiguous_strides(shape), 0);
  std::optional<KeptAllocations> kept;
  if (k->may_allocate) kept.emplace();
  k->blocks.push_back(Tensor::empty(shape, d, dev, Stream(stream)));
  return k->blocks.back();
}

}  // namespace kiln::runtime
