// The oracle's values: a node evaluated to row-major f64 (Value), the rounding of a value through
// a dtype, and reading any tensor into a Value (read) or back out of one (to_tensor).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../core/tensor.hpp"

namespace kiln::reference {

// One evaluated node: a contiguous row-major buffer of doubles with its shape and (logical) dtype.
struct Value {
  Dims shape;
  std::vector<double> data;
  kiln::dtype dt = kiln::dtype::f64;

  std::int64_t numel() const { return shape.product(); }
};

namespace detail {

inline constexpr double nan = std::numeric_limits<double>::quiet_NaN();
inline constexpr double inf = std::numeric_limits<double>::infinity();

// Rounds an integral or boolean value to its dtype (floating dtypes are left in f64).
inline double round_integral(kiln::dtype d, double v) {
  switch (d) {
    case kiln::dtype::boolean:
      return v != 0 ? 1.0 : 0.0;
    case kiln::dtype::i64: {
      if (std::isnan(v)) return 0;
      v = std::trunc(v);
      constexpr double lim = 9223372036854775808.0;  // 2^63
      return std::clamp(v, -lim, std::nextafter(lim, 0.0));
    }
    case kiln::dtype::i32: {
      if (std::isnan(v)) return 0;
      v = std::trunc(v);
      if (std::abs(v) >= 9223372036854775808.0) return v < 0 ? -2147483648.0 : 2147483647.0;
      // Two's-complement wrap-around, as 32-bit integer arithmetic does.
      auto w = static_cast<std::uint32_t>(static_cast<std::uint64_t>(static_cast<std::int64_t>(v)));
      return static_cast<double>(static_cast<std::int32_t>(w));
    }
    default:
      return v;
  }
}

// Rounds a value through a dtype (a cast): floating types round once, integers truncate.
inline double round_to(kiln::dtype d, double v) {
  switch (d) {
    case kiln::dtype::f64:
      return v;
    case kiln::dtype::f32:
      return static_cast<double>(static_cast<float>(v));
    case kiln::dtype::f16:
      return static_cast<double>(static_cast<float>(kiln::half(static_cast<float>(v))));
    case kiln::dtype::bf16:
      return static_cast<double>(static_cast<float>(kiln::bfloat16(static_cast<float>(v))));
    default:
      return round_integral(d, v);
  }
}

// Reads any tensor (any dtype, strides, offset, device) into row-major doubles.
inline std::vector<double> read_values(const Tensor& t) {
  const std::int64_t n = t.numel();
  std::vector<double> out(static_cast<std::size_t>(n));
  if (n == 0) return out;
  if (!t.defined() || !t.storage()->data) throw error("reference: cannot read an undefined tensor " + t.str());
  const kiln::dtype dt = t.dtype();
  std::int64_t lo = t.offset(), hi = t.offset();
  for (int i = 0; i < t.dim(); ++i) {
    std::int64_t span = (t.shape()[i] - 1) * t.strides()[i];
    (span < 0 ? lo : hi) += span;
  }
  const void* base = t.storage()->data;
  std::int64_t shift = 0;
  std::vector<double> staging;  // double-typed so that any element type is suitably aligned
  if (t.device().is_cuda()) {
    // Copy just the span of memory the view touches, then read it through the strides on the host.
    const std::size_t isz = itemsize(dt);
    const std::size_t bytes = static_cast<std::size_t>(hi - lo + 1) * isz;
    staging.resize((bytes + sizeof(double) - 1) / sizeof(double));
    Stream s{};
    memory::copy(staging.data(), kiln::cpu, static_cast<const char*>(base) + lo * static_cast<std::int64_t>(isz),
                 t.device(), bytes, s.handle());
    memory::synchronize(s.handle(), t.device());
    base = staging.data();
    shift = -lo;
  }
  for_each_index(t.shape(), [&](std::int64_t lin, const Dims& idx) {
    out[lin] = load_as_double(base, dt, shift + t.offset() + dot_strides(idx, t.strides()));
  });
  return out;
}

inline Value make_value(const Dims& shape, kiln::dtype dt) {
  Value v;
  v.shape = shape;
  v.dt = dt;
  v.data.assign(static_cast<std::size_t>(shape.product()), 0.0);
  return v;
}

}  // namespace detail

// Reads a tensor (any dtype, layout or device) into a Value: row-major doubles.
inline Value read(const Tensor& t) {
  Value v;
  v.shape = t.shape();
  v.dt = t.dtype();
  v.data = detail::read_values(t);
  return v;
}

// A contiguous CPU f64 tensor holding a Value.
inline Tensor to_tensor(const Value& v) {
  Tensor t = Tensor::empty(v.shape, kiln::dtype::f64, kiln::cpu);
  if (!v.data.empty()) std::memcpy(t.data_ptr(), v.data.data(), v.data.size() * sizeof(double));
  return t;
}

}  // namespace kiln::reference
