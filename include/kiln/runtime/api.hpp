// The evaluation API of API.md: k::compile(fn, options), k::eval(expr), k::eval(out, expr) and
// `k::Tensor y = expr;`, all through the same per-function program cache.
#pragma once
#include <algorithm>
#include <cstring>
#include <memory>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "../autodiff/inner_grad.hpp"
#include "../expr/ops.hpp"
#include "extern/custom.hpp"
#include "function.hpp"

namespace kiln {

namespace detail {

// One Tensor for a single output, else a tuple.
template <int N>
auto pack_outputs(std::array<Tensor, N>& out) {
  if constexpr (N == 1)
    return out[0];
  else
    return std::apply([](auto&... t) { return std::make_tuple(t...); }, out);
}

// Lowers a traced result into a primitive graph, applying the function's transform. Views of eager
// tensors are arguments (graph/views.hpp), as evaluate gathers them.
template <class F, class E>
auto graph_builder(const F& f, const E& e, int nargs, const ArgLayout* layout = nullptr) {
  return [&f, &e, nargs, layout](auto& arg, runtime::LoweringStats& stats,
                                 const std::vector<std::uint8_t>* symbolic = nullptr) {
    return runtime::lower_graph(
        graph::flatten_result(nargs, e, true, symbolic), arg,
        [&](graph::Graph g) { return layout ? transform_graph(f, std::move(g), *layout) : transform_graph(f, std::move(g)); },
        stats);
  };
}

// The per-call scratch of evaluate (the gathered values and the argument list), reused between
// calls of one nesting level so that a warm call does not allocate. A second evaluation started
// while one is gathering at the same level (a graph transform evaluating kiln) gets its own.
class CallScratch {
 public:
  struct Values {
    graph::Captured cap;
    std::vector<const Tensor*> args;
    bool busy = false;
  };
  CallScratch() {
    auto& top = runtime::level_local<Values>();
    if (top.busy) {
      spare_ = std::make_unique<Values>();
      v_ = spare_.get();
    } else {
      v_ = &top;
    }
    v_->busy = true;
  }
  ~CallScratch() {
    v_->cap.release();  // the viewed tensors of this call
    v_->args.clear();
    v_->busy = false;
  }
  CallScratch(const CallScratch&) = delete;
  CallScratch& operator=(const CallScratch&) = delete;
  Values* operator->() const { return v_; }

 private:
  Values* v_;
  std::unique_ptr<Values> spare_;
};

// Evaluates a traced result into out[0, number of outputs): gathers this call's values, finds or
// compiles the program, runs it. call_args are the argument slots' tensors (a container's elements
// after the positional arguments: `layout`).
template <class F, class E>
void evaluate_into(runtime::ProgramCache& cache, const F& f, const E& e, std::span<const Tensor* const> call_args,
                   Tensor* out, Tensor* preset, CUstream stream, std::shared_ptr<const runtime::Entry>* used,
                   const ArgLayout* layout = nullptr) {
  CallScratch scratch;
  graph::Captured& cap = scratch->cap;
  graph::gather(e, cap, true);
  auto& args = scratch->args;
  args.assign(call_args.begin(), call_args.end());
  args.insert(args.end(), cap.tensors.begin(), cap.tensors.end());
  auto& shapes = runtime::level_local<runtime::CallShapes>();  // per nesting level: custom ops may call kiln
  auto entry = cache.get(args.data(), static_cast<int>(args.size()), cap.attrs.data(), cap.na,
                         graph_builder(f, e, static_cast<int>(call_args.size()), layout), shapes, stream,
                         cap.ops.data());
  if (used) *used = entry;
  if (preset) {  // k::eval(out, expr): check before anything runs, so a mismatch leaves out untouched
    runtime::check_preset_output(*entry, shapes, *preset);
    out[0] = *preset;
  }
  runtime::run_entry(*entry, args.data(), cap.scalars.data(), out, shapes, stream);
}

template <int NOut, class F, class E, std::size_t NArgs>
std::array<Tensor, NOut> evaluate(runtime::ProgramCache& cache, const F& f, const E& e,
                                  const std::array<const Tensor*, NArgs>& call_args, Tensor* preset, CUstream stream,
                                  std::shared_ptr<const runtime::Entry>* used = nullptr) {
  std::array<Tensor, NOut> out{};
  evaluate_into(cache, f, e, std::span<const Tensor* const>(call_args.data(), NArgs), out.data(), preset, stream, used);
  return out;
}

// The function object of an eager expression: traced as itself, no graph transform.
struct Identity {};

// ---- container arguments (std::vector<k::Tensor>) ------------------------------------------------
template <class T>
concept CallArgument = std::is_same_v<T, Tensor> || std::is_same_v<T, std::vector<Tensor>>;

// What a compiled function may be called with inside another's trace, and what its body gets.
template <class T>
concept InnerArgument = Expr<T> || std::is_same_v<T, Tensor> || is_arg_list<T>::value || is_expression_list<T>::value;
template <class R>
auto erase_result(R&& r) {
  if constexpr (graph::is_tuple<std::remove_cvref_t<R>>::value)
    return std::apply([](auto&&... x) { return std::make_tuple(expression(std::forward<decltype(x)>(x))...); },
                      std::forward<R>(r));
  else
    return expression(std::forward<R>(r));
}

// The placeholder of argument I: expr::Arg<I> for a tensor, expr::ArgList<I> for a container.
template <int I, class T>
auto placeholder(const T& a, const ArgLayout& layout) {
  if constexpr (std::is_same_v<T, Tensor>)
    return expr::Arg<I>{{}, &a};
  else
    return expr::ArgList<I>{&a, layout.spans[static_cast<std::size_t>(I)].first};
}

// A call's results with containers among the arguments: a plain function's outputs as for tensors;
// a gradient function's value (value_and_grad), then a gradient per wrt argument, a container's as
// a std::vector<k::Tensor> in its order.
// How many results a traced value gives: one per expression, a tuple's or a vector's summed.
template <class E>
int count_results(const E& e) {
  if constexpr (graph::is_tuple<E>::value)
    return std::apply([](const auto&... x) { return (0 + ... + count_results(x)); }, e);
  else if constexpr (graph::is_vector<E>::value) {
    int n = 0;
    for (const auto& x : e) n += count_results(x);
    return n;
  } else {
    return 1;
  }
}

// A plain function: its outputs as for tensors, or, when it returns a std::vector (updates of a
// container's elements, say), every output in order as one std::vector<k::Tensor>.
template <class F>
struct ContainerResults {
  template <class Traced>
  static int count(const Traced& e, const ArgLayout&) {
    if constexpr (graph::has_vector<Traced>::value)
      return count_results(e);
    else
      return num_outputs<F, Traced>;
  }
  template <class Traced, class... T>
  static auto pack(std::vector<Tensor>& out, const ArgLayout&) {
    if constexpr (graph::has_vector<Traced>::value) {
      return std::move(out);
    } else {
      constexpr int n = num_outputs<F, Traced>;
      std::array<Tensor, n> a;
      for (int i = 0; i < n; ++i) a[static_cast<std::size_t>(i)] = std::move(out[static_cast<std::size_t>(i)]);
      return pack_outputs<n>(a);
    }
  }
};
template <class G, autodiff::Mode M, int... I>
struct ContainerResults<GradFn<G, M, I...>> {
  template <class Traced>
  static int count(const Traced&, const ArgLayout& layout) {
    return (M == autodiff::Mode::value_and_grad ? 1 : 0) + static_cast<int>(layout.slots({I...}).size());
  }
  template <class Traced, class... T>
  static auto pack(std::vector<Tensor>& out, const ArgLayout& layout) {
    std::size_t at = 0;
    auto take = [&]<int P>() {
      if constexpr (std::is_same_v<std::tuple_element_t<P, std::tuple<T...>>, std::vector<Tensor>>) {
        const auto count = static_cast<std::size_t>(layout.spans[static_cast<std::size_t>(P)].second);
        std::vector<Tensor> v(out.begin() + static_cast<std::ptrdiff_t>(at),
                              out.begin() + static_cast<std::ptrdiff_t>(at + count));
        at += count;
        return v;
      } else {
        return out[at++];
      }
    };
    if constexpr (M == autodiff::Mode::value_and_grad) {
      Tensor value = out[at++];
      return std::tuple{value, take.template operator()<I>()...};  // braces: left to right
    } else if constexpr (sizeof...(I) == 1) {
      return take.template operator()<I...>();
    } else {
      return std::tuple{take.template operator()<I>()...};
    }
  }
};

}  // namespace detail

// A compiled function (k::compile): callable with tensors, it replays cached programs.
template <class F>
class Function {
 public:
  Function(F fn, options o) : fn_(std::move(fn)), cache_(std::make_shared<runtime::ProgramCache>(o)) {}

  template <class... T>
  requires(detail::CallArgument<T>&&...) auto operator()(const T&... args) const { return call(Stream{}, args...); }
  // Called while another function is traced (with expressions, or the caller's placeholders): the
  // body is inlined into the caller's graph, as torch.compile inlines a compiled callee, and fused
  // with it. The result is a k::expression (a std::tuple of them), so a loop may apply a block
  // compiled once any number of times: `for (...) h = block(h, params);`. A compiled k::grad /
  // value_and_grad / vjp gives its value and gradients so, differentiated in the caller's graph.
  template <class... T>
  requires(!(detail::CallArgument<T> && ...) && (detail::InnerArgument<T> && ...)) auto operator()(
      const T&... args) const {
    if constexpr (is_gradient_fn<F>::value)  // its gradients join the caller's graph (autodiff/inner_grad.hpp)
      return detail::inner_gradient(fn_, args...);
    else
      return detail::erase_result(fn_(detail::inner_argument(args)...));
  }
  // The same, ordered on a caller's stream.
  template <class... T>
  auto operator()(Stream stream, const T&... args) const {
    return call(stream, args...);
  }

  runtime::ProgramCache& cache() const { return *cache_; }
  const F& fn() const { return fn_; }

  // Traces the function for these arguments (used by explain).
  template <class... T>
  auto trace_with(const T&... args) const {
    return trace_impl(std::index_sequence_for<T...>{}, args...);
  }

 private:
  template <std::size_t... I, class... T>
  auto trace_impl(std::index_sequence<I...>, const T&... args) const {
    return detail::trace(fn_, expr::Arg<static_cast<int>(I)>{{}, &args}...);
  }
  template <class... T>
  auto call(Stream stream, const T&... args) const {
    return call_reporting(stream, nullptr, args...);
  }

 public:
  // A call that also says which compiled program ran (explain).
  template <class... T>
  auto call_reporting(Stream stream, std::shared_ptr<const runtime::Entry>* used, const T&... args) const {
    static_assert((detail::CallArgument<T> && ...),
                  "a compiled function runs on k::Tensor or std::vector<k::Tensor> arguments: evaluate an expression "
                  "argument with k::eval first");
    if constexpr (!(detail::CallArgument<T> && ...)) {
      return;  // (only the sentence above, no cascade of errors)
    } else if constexpr ((std::is_same_v<T, Tensor> && ...)) {
      if constexpr (!graph::has_vector<decltype(trace_with(args...))>::value) {
        auto e = trace_with(args...);
        using E = decltype(e);
        constexpr int n = detail::num_outputs<F, E>;
        std::array<const Tensor*, sizeof...(T)> argv{&args...};
        auto out = detail::evaluate<n>(*cache_, fn_, e, argv, nullptr, stream.handle(), used);
        return detail::pack_outputs<n>(out);
      } else {
        return call_with_containers(stream, used, std::index_sequence_for<T...>{}, args...);
      }
    } else {
      return call_with_containers(stream, used, std::index_sequence_for<T...>{}, args...);
    }
  }

 private:
  // Containers (std::vector<k::Tensor>) among the arguments: each position keeps its slot (a
  // container's slot holds one of its tensors, unread), the containers' elements follow in order,
  // and the function receives an expr::ArgList for each.
  template <std::size_t... I, class... T>
  auto call_with_containers(Stream stream, std::shared_ptr<const runtime::Entry>* used, std::index_sequence<I...>,
                            const T&... args) const {
    constexpr std::size_t M = sizeof...(T);
    detail::ArgLayout layout;
    std::vector<const Tensor*> argv(M, nullptr);
    const Tensor* any = nullptr;  // stands in the slot of an empty container
    auto place = [&](const auto& a) {
      if constexpr (std::is_same_v<std::remove_cvref_t<decltype(a)>, Tensor>) {
        layout.spans.emplace_back(-1, 0);
        argv[layout.spans.size() - 1] = &a;
        any = any ? any : &a;
      } else {
        layout.spans.emplace_back(static_cast<int>(argv.size()), static_cast<int>(a.size()));
        for (const Tensor& t : a) argv.push_back(&t), any = any ? any : &t;
        argv[layout.spans.size() - 1] = a.empty() ? nullptr : &a[0];
      }
    };
    (place(args), ...);
    static const Tensor nothing = Tensor::empty(Dims{0}, kiln::dtype::f32, cpu);
    for (std::size_t p = 0; p < M; ++p)
      if (!argv[p]) argv[p] = any ? any : &nothing;
    auto e = detail::trace(fn_, detail::placeholder<static_cast<int>(I)>(args, layout)...);
    using Results = detail::ContainerResults<F>;
    std::vector<Tensor> out(static_cast<std::size_t>(Results::count(e, layout)));
    detail::evaluate_into(*cache_, fn_, e, std::span<const Tensor* const>(argv), out.data(), nullptr, stream.handle(),
                          used, &layout);
    return Results::template pack<decltype(e), T...>(out, layout);
  }

 public:

 private:
  F fn_;
  std::shared_ptr<runtime::ProgramCache> cache_;
};

template <class F>
Function<F> compile(F fn, options o = {}) {
  return Function<F>(std::move(fn), o);
}

namespace detail {
// Eager expressions share one program cache per expression type: no recompile limit, their programs
// bounded together by the process-wide eager budget (runtime/program_budget.hpp).
template <class E>
runtime::ProgramCache& eager_cache() {
  static runtime::ProgramCache cache({}, runtime::CacheKind::eager);
  return cache;
}
}  // namespace detail

// Evaluates an expression (fused) into a new tensor; several outputs for a tuple.
template <class E>
requires Expr<E> || graph::is_tuple<E>::value auto eval(const E& e, Stream stream = {}) {
  constexpr int n = detail::output_count<E>::value;
  auto out = detail::evaluate<n>(detail::eager_cache<E>(), detail::Identity{}, e, std::array<const Tensor*, 0>{},
                                 nullptr, stream.handle());
  return detail::pack_outputs<n>(out);
}

namespace detail {
// The row pitch (elements) of a tensor laid out as rows of a larger buffer: its last dim
// contiguous, the other dims collapsing into one run of evenly spaced rows (e.g. a column slice of
// a wider matrix, or one of q/k/v inside a fused qkv buffer). 0 when it is not.
inline std::int64_t row_pitch(const Tensor& t) {
  int r = t.dim();
  if (r < 2 || (t.shape()[r - 1] != 1 && t.strides()[r - 1] != 1)) return 0;
  std::int64_t pitch = 0, expect = 0;
  for (int i = r - 2; i >= 0; --i) {
    if (t.shape()[i] == 1) continue;
    if (t.strides()[i] == 0) return 0;  // a broadcast (expanded) dim: rows would overlap
    if (!pitch) pitch = expect = t.strides()[i];
    if (t.strides()[i] != expect) return 0;
    expect *= t.shape()[i];
  }
  return pitch >= t.shape()[r - 1] ? pitch : 0;
}

// Copies a contiguous tensor into the rows of `out` (row_pitch(out) > 0), ordered on the stream.
inline void copy_rows(const Tensor& src, Tensor& out, std::int64_t pitch, Stream stream) {
  std::size_t item = itemsize(out.dtype());
  std::size_t width = static_cast<std::size_t>(out.shape()[out.dim() - 1]) * item;
  std::size_t rows = static_cast<std::size_t>(out.numel()) / std::max<std::size_t>(1, out.shape()[out.dim() - 1]);
  if (out.numel() == 0) return;
  if (out.device().is_cpu()) {
    for (std::size_t i = 0; i < rows; ++i)
      std::memcpy(static_cast<char*>(out.data_ptr()) + i * pitch * item,
                  static_cast<const char*>(src.data_ptr()) + i * width, width);
    return;
  }
  driver::make_current(out.device().index);
  driver::copy_2d_async(out.data_ptr(), static_cast<std::size_t>(pitch) * item, src.data_ptr(), width, width, rows,
                        stream.handle());
}
}  // namespace detail

// Evaluates into an existing tensor; a failed evaluation leaves it untouched. A contiguous out is
// written by the fused kernel itself; rows of a larger buffer (row pitch > row length: a column
// slice, a wrapped sub-buffer) get the result through one 2-D copy.
template <Expr E>
void eval(Tensor& out, const E& e, Stream stream = {}) {
  if (!out.is_contiguous()) {
    std::int64_t pitch = detail::row_pitch(out);
    if (!pitch)
      throw shape_error(
          "k::eval(out, expr): out must be contiguous or rows of a larger buffer (last dim contiguous, "
          "evenly spaced rows), got shape " +
          out.shape().str() + " strides " + out.strides().str());
    if (out.device().is_cuda() && stream.handle() && driver::is_capturing(stream.handle()))
      throw cuda_error(
          "k::eval(out, expr): out with a row pitch needs a temporary, which cannot be kept alive for a "
          "CUDA graph capture; capture into a contiguous out");
    Tensor tmp = Tensor::empty(out.shape(), out.dtype(), out.device(), stream);
    eval(tmp, e, stream);
    detail::copy_rows(tmp, out, pitch, stream);
    return;
  }
  Attrs to;
  to.dt = out.dtype();
  auto full = expr::make<Op::cast>(to, e);  // the value is stored in out's dtype
  auto got = detail::evaluate<1>(detail::eager_cache<decltype(full)>(), detail::Identity{}, full,
                                 std::array<const Tensor*, 0>{}, &out, stream.handle());
  if (got[0].data_ptr() != out.data_ptr() || !(got[0].strides() == out.strides())) {
    // The value is a tensor or a view of one (a bare permute, slice or leaf): the program returned
    // it without running a kernel, so a copying kernel writes it into out.
    expr::TensorLeaf x{{}, got[0]};
    if (out.dtype() == kiln::dtype::boolean)
      eval(out, x != 0, stream);
    else
      eval(out, cast(x * 1, out.dtype()), stream);
  }
}

template <class E>
requires requires { typename E::kiln_expr_tag; }
Tensor::Tensor(const E& expr) : Tensor(kiln::eval(expr)) {}

inline Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  if (device().is_cpu()) {  // a strided host copy needs no kernel
    Tensor out = Tensor::empty(shape_, dtype_, cpu);
    copy_to_contiguous_host(*this, out.data_ptr(), dtype_);
    return out;
  }
  expr::TensorLeaf x{{}, *this};
  if (dtype_ == kiln::dtype::boolean) return kiln::eval(x != 0);
  return kiln::eval(cast(x * 1, dtype_));
}
inline Tensor Tensor::to(kiln::dtype d) const {
  if (d == dtype_) return *this;
  return kiln::eval(cast(expr::TensorLeaf{{}, *this}, d));
}

}  // namespace kiln
