// k::dist::data_parallel(grad_fn, g, {.bucket_mb}): a k::grad / value_and_grad / vjp function whose
// gradients are averaged over the group's ranks, as PyTorch's DistributedDataParallel does: each
// rank passes its own share of the batch, and with a mean loss and equal shares every rank ends
// with the gradient of the whole batch. The value (value_and_grad) stays this rank's own.
//
// The gradients are all-reduced in buckets of about bucket_mb: consecutive gradients, in the order
// the function returns them, share one NCCL group call (one launch per bucket), on the stream of
// the call, after the compiled program that produced them. They do not yet overlap the backward:
// the program runs as one unit, and the reduction starts when it has been queued.
#pragma once
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <vector>

#include "collectives.hpp"

namespace kiln::dist {

struct data_parallel_options {
  double bucket_mb = 25;  // gradients per NCCL group call, in MiB (at least one gradient a bucket)
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

// Averages `grads` over the ranks in place, bucket by bucket.
inline void average(const group& g, const std::vector<Tensor*>& grads, double bucket_mb, Stream s) {
  GroupState& st = g.state();
  if (st.world_size == 1 || grads.empty()) return;
  namespace nccl = runtime::nccl;
  const auto& api = nccl::api();
  driver::make_current(st.device.index);
  const auto limit = static_cast<std::size_t>(bucket_mb * 1024 * 1024);
  std::size_t i = 0;
  while (i < grads.size()) {
    std::size_t bytes = 0;
    nccl::check(api.group_start(), "ncclGroupStart", "k::dist::data_parallel");
    do {
      Tensor& t = *grads[i++];
      if (!(t.device() == st.device))
        throw device_error("k::dist::data_parallel: a gradient is on " + t.device().str() + " but rank " +
                           std::to_string(st.rank) + " drives " + st.device.str());
      nccl::check(api.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), nccl::data_type(t.dtype()), nccl::avg, st.comm,
                                 s.handle()),
                  "ncclAllReduce", "k::dist::data_parallel");
      bytes += t.nbytes();
    } while (i < grads.size() && bytes + grads[i]->nbytes() <= limit);
    nccl::check(api.group_end(), "ncclGroupEnd", "k::dist::data_parallel");
  }
}

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
    auto result = f_(s, args...);
    std::vector<Tensor*> grads;
    if constexpr (std::is_same_v<decltype(result), Tensor>)
      grads.push_back(&result);
    else
      detail::collect(grads, result);
    if (G::mode == autodiff::Mode::value_and_grad) grads.erase(grads.begin());
    // A gradient that shares memory with an argument or with another gradient (a function that
    // returns an input as its gradient) is copied first: the reduction writes in place.
    std::vector<const Tensor*> seen;
    (detail::collect_args(seen, args), ...);
    for (Tensor* t : grads) {
      if (!t->is_contiguous()) *t = t->contiguous();  // a fresh buffer
      for (const Tensor* o : seen)
        if (detail::overlaps(*t, *o)) {
          Tensor copy = empty(t->shape(), t->dtype(), t->device());
          memory::copy(copy.data_ptr(), copy.device(), t->data_ptr(), t->device(), copy.nbytes(), s.handle());
          *t = copy;
          break;
        }
      seen.push_back(t);
    }
    detail::average(g_, grads, o_.bucket_mb, s);
    return result;
  }

  const Function<G>& function() const { return f_; }
  const group& process_group() const { return g_; }

 private:
  Function<G> f_;
  group g_;
  data_parallel_options o_;
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
