// k::Tensor: a cheap-to-copy handle to shared storage with a shape, strides (in elements), an
// offset, a dtype and a device, like torch.Tensor. Memory comes from core/memory.hpp.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "device.hpp"
#include "dims.hpp"
#include "dtype.hpp"
#include "memory.hpp"
#include "stream.hpp"

namespace kiln {

// A block of memory on one device; owned (freed by its deleter) or borrowed (wrap).
struct Storage {
  void* data = nullptr;
  std::size_t bytes = 0;
  Device device = cpu;
  bool owned = true;
  CUstream stream = nullptr;  // the stream it was allocated on (stream-ordered free)
  Storage(void* d, std::size_t b, Device dev, bool own, CUstream s)
      : data(d), bytes(b), device(dev), owned(own), stream(s) {}
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (owned && data) memory::deallocate(data, bytes, device, stream);
  }
};

class Tensor {
 public:
  Tensor() = default;

  // Evaluates an expression (defined in kiln/eval.hpp).
  template <class E>
  requires requires { typename E::kiln_expr_tag; }
  Tensor(const E& expr);

  const Dims& shape() const { return shape_; }
  const Dims& strides() const { return strides_; }
  kiln::dtype dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : cpu; }
  std::int64_t numel() const { return shape_.product(); }
  int dim() const { return shape_.size(); }
  std::int64_t offset() const { return offset_; }
  bool defined() const { return storage_ != nullptr; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * itemsize(dtype_); }
  void* data_ptr() const {
    return storage_ ? static_cast<char*>(storage_->data) + offset_ * static_cast<std::int64_t>(itemsize(dtype_))
                    : nullptr;
  }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  bool is_contiguous() const {
    if (numel() == 0) return true;  // as in PyTorch: nothing to lay out
    std::int64_t expect = 1;
    for (int i = dim() - 1; i >= 0; --i) {
      if (shape_[i] == 1) continue;
      if (strides_[i] != expect) return false;
      expect *= shape_[i];
    }
    return true;
  }

  // A new tensor with fresh memory.
  static Tensor empty(const Dims& shape, kiln::dtype d, Device dev, Stream s = {}) {
    std::size_t bytes = static_cast<std::size_t>(shape.product()) * itemsize(d);
    void* p = memory::allocate(bytes, dev, s.handle());
    Tensor t;
    t.storage_ = std::make_shared<Storage>(p, bytes, dev, true, s.handle());
    t.shape_ = shape;
    t.strides_ = contiguous_strides(shape);
    t.dtype_ = d;
    return t;
  }

  // Views memory the caller owns (raw host or device pointers); never frees it.
  static Tensor wrap(void* data, const Dims& shape, kiln::dtype d, Device dev = cpu, const Dims& strides = {}) {
    if (!strides.empty() && strides.size() != shape.size())
      throw shape_error("Tensor::wrap: strides " + strides.str() + " do not match shape " + shape.str());
    if (dev.is_cuda()) memory::require_device(dev, "Tensor::wrap");
    Tensor t;
    t.storage_ = std::make_shared<Storage>(data, 0, dev, false, nullptr);
    t.shape_ = shape;
    t.strides_ = strides.empty() ? contiguous_strides(shape) : strides;
    t.dtype_ = d;
    return t;
  }

  // A view sharing this tensor's storage.
  Tensor as_strided(const Dims& shape, const Dims& strides, std::int64_t offset) const {
    Tensor t = *this;
    t.shape_ = shape;
    t.strides_ = strides;
    t.offset_ = offset;
    return t;
  }

  Tensor to(Device dev, Stream s = {}) const;
  Tensor to(kiln::dtype d) const;
  Tensor contiguous() const;

  std::string str() const {
    return "Tensor(shape=" + shape_.str() + ", dtype=" + std::string(name(dtype_)) + ", device=" + device().str() + ")";
  }

 private:
  std::shared_ptr<Storage> storage_;
  Dims shape_;
  Dims strides_;
  std::int64_t offset_ = 0;
  kiln::dtype dtype_ = kiln::dtype::f32;
};

// Visits every multi-index of a shape in row-major order, calling f(linear, index).
template <class F>
void for_each_index(const Dims& shape, F&& f) {
  std::int64_t n = shape.product();
  Dims idx;
  idx.resize(shape.size());
  for (std::int64_t lin = 0; lin < n; ++lin) {
    f(lin, idx);
    for (int d = shape.size() - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

inline std::int64_t dot_strides(const Dims& idx, const Dims& strides) {
  std::int64_t off = 0;
  for (int i = 0; i < idx.size(); ++i) off += idx[i] * strides[i];
  return off;
}

// Copies a (possibly strided, possibly other-dtype) host tensor into a contiguous host buffer of dtype d.
inline void copy_to_contiguous_host(const Tensor& src, void* dst, kiln::dtype d) {
  const void* base = src.storage()->data;
  for_each_index(src.shape(), [&](std::int64_t lin, const Dims& idx) {
    double v = load_as_double(base, src.dtype(), src.offset() + dot_strides(idx, src.strides()));
    store_from_double(dst, d, lin, v);
  });
}

inline Tensor Tensor::to(Device dev, Stream s) const {
  if (dev == device()) return *this;
  Tensor src = device().is_cpu() ? contiguous() : *this;
  if (!src.is_contiguous()) src = src.contiguous();  // device-side contiguous
  Tensor out = empty(shape_, dtype_, dev, s);
  memory::copy(out.data_ptr(), dev, src.data_ptr(), src.device(), nbytes(), s.handle());
  if (dev.is_cpu()) memory::synchronize(s.handle(), src.device());
  return out;
}

}  // namespace kiln
