// k::custom_op: a user's own kernel (or any host function) as one opaque node of the graph, the way
// torch.library's custom ops sit inside torch.compile graphs. Registering an op stores its functions
// in a process-wide registry under a new id; calling the op builds an ordinary lazy expression whose
// attributes carry that id (run-time data: the program cache compares it like any attribute, so a
// different op never replays another's program). Shape inference, autodiff, the scheduler (an extern
// step and a fusion barrier), the runtime and the f64 oracle look the functions up by id.
#pragma once
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "../core/stream.hpp"
#include "../core/tensor.hpp"
#include "node.hpp"

namespace kiln {

// The shape and dtype of a custom op's input or output, as its shape rule sees them.
struct TensorSpec {
  Dims shape;
  kiln::dtype dtype = kiln::dtype::f32;
};

// What a custom op does; only forward is required. Inputs arrive as contiguous tensors of their
// node's dtype on the program's device; out is preallocated (contiguous, the rule's shape and dtype).
// On CUDA launch on `s` and do not synchronise; on the CPU s is the default stream and the host runs
// the function. backward fills grad_in[j], the gradient of input j, from grad_out (the cotangent of
// out): it is called once per input that needs a gradient, with only that grad_in[j] preallocated
// and the others undefined. Without a backward, differentiating through the op is a k::error.
struct CustomOpFunctions {
  int inputs = 0;  // the number of inputs it takes, 1 to 7; 0 accepts any
  std::function<TensorSpec(std::span<const TensorSpec> in)> infer{};  // default: input 0's shape and dtype
  std::function<void(std::span<const Tensor> in, Tensor& out, Stream s)> forward{};
  std::function<void(std::span<const Tensor> in, const Tensor& grad_out, std::span<Tensor> grad_in, Stream s)>
      backward{};
  // Whether a `.cuda_graphs` program may capture the functions instead of calling them at every
  // call: true only when they queue all their work on s, allocate nothing that the graph would
  // outlive, and never read device values on the host while s is captured (k::cond records a
  // conditional graph node there). Default: such programs launch plainly.
  bool capturable = false;
};

namespace custom_ops {

inline constexpr int max_inputs = 7;  // graph nodes hold 8 inputs: the backward node reads one more

struct Entry {
  std::string name;
  std::string ident;  // the name as a C identifier, for kernel names
  CustomOpFunctions fns;

  std::string prefix() const { return "custom op '" + name + "': "; }
};

// Registrations live as long as the process (ids are never reused, so a cached program never
// refers to a dead op); registering and looking up are safe from any thread.
class Registry {
 public:
  static Registry& instance() {
    static Registry r;
    return r;
  }
  std::int32_t add(Entry e) {
    std::unique_lock lock(mu_);
    entries_.push_back(std::move(e));  // a deque keeps references to earlier entries valid
    return static_cast<std::int32_t>(entries_.size() - 1);
  }
  const Entry* find(std::int64_t id) const {
    std::shared_lock lock(mu_);
    return id >= 0 && id < static_cast<std::int64_t>(entries_.size()) ? &entries_[static_cast<std::size_t>(id)]
                                                                      : nullptr;
  }

 private:
  mutable std::shared_mutex mu_;
  std::deque<Entry> entries_;
};

inline const Entry& entry(std::int64_t id) {
  const Entry* e = Registry::instance().find(id);
  if (!e) throw error("custom op: id " + std::to_string(id) + " was never registered with k::custom_op");
  return *e;
}
inline std::string name_of(std::int64_t id) {
  const Entry* e = Registry::instance().find(id);
  return e ? e->name : "<unregistered " + std::to_string(id) + ">";
}

// Runs one of the user's functions. With `rename` every exception comes back as the same kiln
// error type (or k::error) with the op named in front; without it, a k::error passes as it is
// and anything else becomes a k::error naming the op.
template <class F>
decltype(auto) call_user(const Entry& e, const char* what, bool rename, F&& f) {
  const std::string at = e.prefix() + what + ": ";
  try {
    return std::forward<F>(f)();
  } catch (const shape_error& x) {
    if (rename) throw shape_error(at + x.what());
    throw;
  } catch (const dtype_error& x) {
    if (rename) throw dtype_error(at + x.what());
    throw;
  } catch (const error& x) {
    if (rename) throw error(at + x.what());
    throw;
  } catch (const std::exception& x) {
    throw error(at + x.what());
  } catch (...) {
    throw error(at + "threw an exception that is not a std::exception");
  }
}

// The output of op `id` for inputs `in`: the user's rule (or input 0's spec), checked.
inline TensorSpec infer(std::int64_t id, std::span<const TensorSpec> in) {
  const Entry& e = entry(id);
  const int n = static_cast<int>(in.size());
  if (e.fns.inputs > 0 && n != e.fns.inputs)
    throw shape_error(e.prefix() + "takes " + std::to_string(e.fns.inputs) + " input" + (e.fns.inputs == 1 ? "" : "s") +
                      ", got " + std::to_string(n));
  TensorSpec out = e.fns.infer ? call_user(e, "shape rule", true, [&] { return e.fns.infer(in); }) : in[0];
  for (auto s : out.shape)
    if (s < 0)
      throw shape_error(e.prefix() + "the shape rule gave shape " + out.shape.str() + ", with a negative size");
  if (static_cast<int>(out.dtype) > static_cast<int>(kiln::dtype::boolean))
    throw dtype_error(e.prefix() + "the shape rule gave an invalid dtype (" +
                      std::to_string(static_cast<int>(out.dtype)) + ")");
  return out;
}

// "scaled tanh!" -> "scaled_tanh_": the op's name inside generated kernel names.
inline std::string identifier(const std::string& name) {
  std::string s = name;
  for (auto& c : s)
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))) c = '_';
  return s;
}

}  // namespace custom_ops

// A registered custom op: call it like any kiln op, with 1 to 7 tensors or expressions.
class CustomOp {
 public:
  CustomOp() = default;
  explicit CustomOp(std::int32_t id) : id_(id) {}

  std::int32_t id() const { return id_; }
  std::string name() const { return custom_ops::name_of(id_); }

  template <class... T>
  auto operator()(T&&... x) const {
    static_assert(sizeof...(T) >= 1 && sizeof...(T) <= custom_ops::max_inputs,
                  "a k::custom_op takes 1 to 7 inputs (graph nodes hold eight: the op's backward node reads one more)");
    static_assert(((Expr<T> || std::is_same_v<std::remove_cvref_t<T>, Tensor>)&&...),
                  "the inputs of a k::custom_op are tensors or expressions: a C++ number can be captured by its "
                  "functions instead");
    if (id_ < 0) throw error("k::CustomOp: this op was never registered with k::custom_op");
    Attrs at;
    at.custom = id_;
    return expr::make<Op::custom>(at, std::forward<T>(x)...);
  }

 private:
  std::int32_t id_ = -1;
};

// Registers an op; see CustomOpFunctions for what each function receives.
inline CustomOp custom_op(std::string name, CustomOpFunctions fns) {
  if (name.empty()) throw error("k::custom_op: the op needs a name");
  if (!fns.forward) throw error("k::custom_op: '" + name + "' needs a .forward function");
  if (fns.inputs < 0 || fns.inputs > custom_ops::max_inputs)
    throw error("k::custom_op: '" + name + "' declares " + std::to_string(fns.inputs) +
                " inputs; custom ops take 1 to " + std::to_string(custom_ops::max_inputs));
  std::string ident = custom_ops::identifier(name);
  return CustomOp(custom_ops::Registry::instance().add({std::move(name), std::move(ident), std::move(fns)}));
}

}  // namespace kiln
