// k::dist::data_parallel(grad_fn, g, {.bucket_mb, .overlap}): a k::grad / value_and_grad / vjp
// function whose gradients are averaged over the group's ranks, as PyTorch's DistributedDataParallel
// does: each rank passes its own share of the batch, and with a mean loss and equal shares every
// rank ends with the gradient of the whole batch. The value (value_and_grad) stays this rank's own.
//
// The gradients are all-reduced in buckets of about bucket_mb, one NCCL group call a bucket. With
// overlap (the default, CUDA, world size > 1), a bucket starts on a communication stream as soon as
// the backward step that last touches its gradients is queued, and runs beside the rest of the
// backward (grad_buckets.hpp); the call's stream then waits for it. The first call runs without
// overlap and checks that the function is one program whose outputs are its results; a function
// that is not (graph breaks), a run inside a stream capture (.cuda_graphs, or the caller's), and
// gradients that alias an argument or each other are reduced after the program on the call's stream.
#pragma once
#include <cstddef>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "collectives.hpp"
#include "grad_buckets.hpp"

namespace kiln::dist {

struct data_parallel_options {
  double bucket_mb = 25;  // gradients per NCCL group call, in MiB (at least one gradient a bucket)
  bool overlap = true;    // start buckets during the backward, on a second stream
};

namespace detail {

inline void collect(std::vector<Tensor*>& out, Tensor& t) { out.push_back(&t); }
inline void collect(std::vector<Tensor*>& out, std::vector<Tensor>& v) {
  for (auto& t : v) out.push_back(&t);
}
template <class... T>
void collect(std::vector<Tensor*>& out, std::tuple<T...>& t) {
  std::apply([&](auto&... x) { (collect(out, x), ...); }, t);
}

inline void collect_args(std::vector<const Tensor*>& out, const Tensor& t) { out.push_back(&t); }
inline void collect_args(std::vector<const Tensor*>& out, const std::vector<Tensor>& v) {
  for (auto& t : v) out.push_back(&t);
}

inline bool overlaps(const Tensor& a, const Tensor& b) {
  auto pa = static_cast<const char*>(a.data_ptr()), pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// The communication stream of one data_parallel function, and whether its calls may overlap.
struct OverlapState {
  enum class Verdict { unknown, on, off };
  Verdict verdict = Verdict::unknown;
  bool last_overlapped = false;  // the last call started buckets during its run
  std::optional<GradOverlap::Streams> streams;
  int device = -1;
  GradOverlap::Streams& get(int dev) {
    if (!streams) {
      driver::make_current(dev);
      CUstream comm = nullptr;
      driver::check(driver::api().stream_create(&comm, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      streams.emplace();
      streams->comm = comm;
      device = dev;
    }
    return *streams;
  }
  OverlapState() = default;
  OverlapState(const OverlapState&) = delete;
  OverlapState& operator=(const OverlapState&) = delete;
  ~OverlapState() {
    if (streams && streams->comm) driver::api().stream_destroy(streams->comm);
  }
};

}  // namespace detail

template <class G>
class DataParallel {
 public:
  DataParallel(G fn, group g, data_parallel_options o, options co)
      : f_(compile(std::move(fn), co)), g_(std::move(g)), o_(o) {}

  template <class... T>
  requires(kiln::detail::CallArgument<T>&&...) auto operator()(const T&... args) const {
    return (*this)(Stream{}, args...);
  }

  template <class... T>
  auto operator()(Stream s, const T&... args) const {
    detail::GroupState& st = g_.state();
    constexpr std::size_t first_grad = G::mode == autodiff::Mode::value_and_grad ? 1 : 0;
    using Verdict = detail::OverlapState::Verdict;
    std::optional<detail::GradOverlap> watch;
    if (o_.overlap && st.world_size > 1 && st.device.is_cuda() && overlap_->verdict != Verdict::off)
      watch.emplace(st, overlap_->get(st.device.index), first_grad, o_.bucket_mb, overlap_->verdict == Verdict::on);
    auto result = [&] {
      std::optional<runtime::ObserveSteps> observe;
      if (watch) observe.emplace(&*watch);
      try {
        return f_(s, args...);
      } catch (...) {  // buckets already started still write the gradients: order the stream after them
        if (watch) watch->join(s.handle());
        throw;
      }
    }();
    std::vector<Tensor*> all;
    if constexpr (std::is_same_v<decltype(result), Tensor>)
      all.push_back(&result);
    else
      detail::collect(all, result);
    overlap_->last_overlapped = watch && watch->started();
    if (watch) {
      watch->join(s.handle());
      if (overlap_->verdict == Verdict::unknown) overlap_->verdict = one_program(*watch, all) ? Verdict::on : Verdict::off;
    }
    std::vector<Tensor*> grads(all.begin() + static_cast<std::ptrdiff_t>(std::min(first_grad, all.size())), all.end());
    // What the run did not average: a gradient that shares memory with an argument or with
    // another gradient (a function that returns an input as its gradient) is copied first, since
    // the reduction writes in place.
    std::vector<const Tensor*> seen;
    (detail::collect_args(seen, args), ...);
    std::vector<Tensor*> rest;
    for (Tensor* t : grads) {
      if (watch && watch->reduced(*t)) continue;
      if (!t->is_contiguous()) *t = t->contiguous();  // a fresh buffer
      for (const Tensor* o : seen)
        if (detail::overlaps(*t, *o)) {
          Tensor copy = Tensor::empty(t->shape(), t->dtype(), t->device(), s);
          memory::copy(copy.data_ptr(), copy.device(), t->data_ptr(), t->device(), copy.nbytes(), s.handle());
          *t = copy;
          break;
        }
      seen.push_back(t);
      rest.push_back(t);
    }
    detail::average(st, rest, o_.bucket_mb, s.handle());
    return result;
  }

  // Whether the last call overlapped reductions with its backward (never the first call).
  bool overlapping() const { return overlap_->last_overlapped; }

  const Function<G>& function() const { return f_; }
  const group& process_group() const { return g_; }

 private:
  // The first call's check: one program ran, and its outputs are the results.
  static bool one_program(const detail::GradOverlap& w, const std::vector<Tensor*>& results) {
    if (w.runs() != 1 || w.outputs().size() != results.size()) return false;
    for (std::size_t i = 0; i < results.size(); ++i)
      if (results[i]->data_ptr() != w.outputs()[i].data_ptr() || results[i]->nbytes() != w.outputs()[i].nbytes())
        return false;
    return true;
  }

  Function<G> f_;
  group g_;
  data_parallel_options o_;
  std::shared_ptr<detail::OverlapState> overlap_ = std::make_shared<detail::OverlapState>();
};

template <class G>
auto data_parallel(G grad_fn, const group& g, data_parallel_options o = {}, options compile_options = {}) {
  static_assert(is_gradient_fn<G>::value,
                "k::dist::data_parallel wraps a k::grad, k::value_and_grad or k::vjp function (it averages their "
                "gradients)");
  if (!(o.bucket_mb > 0)) throw error("k::dist::data_parallel: bucket_mb must be positive");
  return DataParallel<G>(std::move(grad_fn), g, o, compile_options);
}

}  // namespace kiln::dist
