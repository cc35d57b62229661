// Gradient buckets of k::dist::data_parallel: consecutive gradients of about bucket_mb together,
// each bucket averaged over the ranks by one NCCL group call (one launch a bucket), and the step
// observer that starts each bucket while the backward still runs.
//
// Overlap (PyTorch's DDP does the same from autograd hooks): the program's steps are known before
// it runs, so the last step reading or writing each gradient's buffer is known too. Gradients are
// bucketed in that order; when a bucket's last step has been queued on the program's stream, an
// event hands the bucket to the group's communication stream, where its all-reduce runs beside
// the remaining backward kernels. After the run the program's stream waits for that stream.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

#include "../launch/cuda_module.hpp"
#include "../launch/program.hpp"
#include "group.hpp"

namespace kiln::dist::detail {

// Averages `ts` over the ranks in place with one NCCL group call on `s`.
inline void reduce_bucket(GroupState& st, const std::vector<Tensor*>& ts, CUstream s) {
  namespace nccl = runtime::nccl;
  const auto& api = nccl::api();
  nccl::check(api.group_start(), "ncclGroupStart", "k::dist::data_parallel");
  for (Tensor* t : ts) {
    if (!(t->device() == st.device))
      throw device_error("k::dist::data_parallel: a gradient is on " + t->device().str() + " but rank " +
                         std::to_string(st.rank) + " drives " + st.device.str());
    nccl::check(api.all_reduce(t->data_ptr(), t->data_ptr(), t->numel(), nccl::data_type(t->dtype()), nccl::avg,
                               st.comm, s),
                "ncclAllReduce", "k::dist::data_parallel");
  }
  nccl::check(api.group_end(), "ncclGroupEnd", "k::dist::data_parallel");
}

// Splits sizes (in order) into runs of consecutive entries of at most `limit` bytes each (at
// least one entry a run); returns each run's end index.
inline std::vector<std::size_t> bucket_ends(const std::vector<std::size_t>& bytes, std::size_t limit) {
  std::vector<std::size_t> ends;
  std::size_t i = 0;
  while (i < bytes.size()) {
    std::size_t total = bytes[i++];
    while (i < bytes.size() && total + bytes[i] <= limit) total += bytes[i++];
    ends.push_back(i);
  }
  return ends;
}

// Averages `grads` over the ranks in place, bucket by bucket, on `s` (after what is queued there).
inline void average(GroupState& st, const std::vector<Tensor*>& grads, double bucket_mb, CUstream s) {
  if (st.world_size == 1 || grads.empty()) return;
  driver::make_current(st.device.index);
  std::vector<std::size_t> bytes;
  for (Tensor* t : grads) bytes.push_back(t->nbytes());
  std::size_t begin = 0;
  for (std::size_t end : bucket_ends(bytes, static_cast<std::size_t>(bucket_mb * 1024 * 1024))) {
    reduce_bucket(st, std::vector<Tensor*>(grads.begin() + static_cast<std::ptrdiff_t>(begin),
                                           grads.begin() + static_cast<std::ptrdiff_t>(end)),
                  s);
    begin = end;
  }
}

// The observer of one data-parallel call (runtime/launch/step_observer.hpp). With `act` off it only
// records what ran (the first call checks that the function is one program whose outputs are the
// results); with it on it starts the buckets during the run.
class GradOverlap final : public runtime::StepObserver {
 public:
  // The communication stream and its two events belong to the caller (one set per data_parallel).
  struct Streams {
    CUstream comm;
    runtime::Event ready{CU_EVENT_DISABLE_TIMING}, done{CU_EVENT_DISABLE_TIMING};
  };
  GradOverlap(GroupState& st, Streams& streams, std::size_t first_grad, double bucket_mb, bool act)
      : st_(st), streams_(streams), first_grad_(first_grad), bucket_mb_(bucket_mb), act_(act) {}

  void begin(const runtime::Program& p, const Tensor* outputs, CUstream) override {
    if (runs_++ > 0) return;
    outputs_.assign(outputs, outputs + p.graph.outputs.size());
    if (!act_) return;
    const std::vector<int> last = runtime::last_step_of_outputs(p);
    std::vector<std::size_t> order;  // the gradients this run can reduce, by their last step
    for (std::size_t o = first_grad_; o < outputs_.size(); ++o)
      if (eligible(p, o) && last[o] >= 0) order.push_back(o);
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return last[a] < last[b]; });
    std::vector<std::size_t> bytes;
    for (std::size_t o : order) bytes.push_back(outputs_[o].nbytes());
    std::size_t begin = 0;
    for (std::size_t end : bucket_ends(bytes, static_cast<std::size_t>(bucket_mb_ * 1024 * 1024))) {
      Bucket b;
      for (std::size_t i = begin; i < end; ++i) {
        b.outputs.push_back(order[i]);
        b.step = std::max(b.step, last[order[i]]);
      }
      buckets_.push_back(std::move(b));
      begin = end;
    }
  }

  void after_step(std::size_t step, CUstream stream) override {
    while (next_ < buckets_.size() && buckets_[next_].step <= static_cast<int>(step)) launch(buckets_[next_++], stream);
  }

  void end(CUstream stream) override {
    while (next_ < buckets_.size()) launch(buckets_[next_++], stream);
  }

  // After the call: the program's stream waits for the buckets started on the communication stream.
  void join(CUstream stream) {
    if (!started_) return;
    streams_.done.record(streams_.comm);
    driver::check(driver::api().stream_wait_event(stream, streams_.done.handle(), 0), "cuStreamWaitEvent");
  }

  int runs() const { return runs_; }
  bool started() const { return started_; }
  const std::vector<Tensor>& outputs() const { return outputs_; }
  // Whether the run averaged this tensor already.
  bool reduced(const Tensor& t) const {
    return std::find(reduced_.begin(), reduced_.end(), t.data_ptr()) != reduced_.end();
  }

 private:
  struct Bucket {
    std::vector<std::size_t> outputs;
    int step = -1;
  };

  // A fresh buffer of its own: not an argument, not the caller's, not shared with another output.
  bool eligible(const runtime::Program& p, std::size_t o) const {
    if (p.arg_of_output[o] >= 0) return false;
    if (o < p.graph.output_into.size() && p.graph.output_into[o] >= 0) return false;
    for (std::size_t q = 0; q < o; ++q)
      if (p.graph.outputs[q] == p.graph.outputs[o]) return false;
    return outputs_[o].device() == st_.device && outputs_[o].is_contiguous();
  }

  void launch(const Bucket& b, CUstream stream) {
    streams_.ready.record(stream);
    driver::check(driver::api().stream_wait_event(streams_.comm, streams_.ready.handle(), 0), "cuStreamWaitEvent");
    std::vector<Tensor*> ts;
    for (std::size_t o : b.outputs) {
      ts.push_back(&outputs_[o]);
      reduced_.push_back(outputs_[o].data_ptr());
    }
    reduce_bucket(st_, ts, streams_.comm);
    started_ = true;
  }

  GroupState& st_;
  Streams& streams_;
  std::size_t first_grad_;
  double bucket_mb_;
  bool act_;
  int runs_ = 0;
  std::vector<Tensor> outputs_;
  std::vector<Bucket> buckets_;
  std::size_t next_ = 0;
  std::vector<const void*> reduced_;
  bool started_ = false;
};

}  // namespace kiln::dist::detail
