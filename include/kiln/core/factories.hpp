// Tensor factories (empty, zeros, ones, full, arange, rand, randn, from_vector) and to_vector.
// Values are made on the host (on every core where there are many) and copied once to the device;
// random values come from a counter-based generator, so a seed gives the same tensor on every
// device and every number of threads.
#pragma once
#include <algorithm>
#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

#include "tensor.hpp"

namespace kiln {

inline Tensor empty(const Dims& shape, kiln::dtype d = f32, Device dev = cpu) { return Tensor::empty(shape, d, dev); }

namespace detail {
// Runs fill(ctx, begin, end) over [0, n) in contiguous parts, one a core, where each part has at
// least 2^18 elements (a randn of 2^27 values took 19 s on one core of an H100's host: NOTES item
// 187). A function pointer, not a template: each factory's fill for each dtype instantiated
// std::thread's machinery anew in every user's translation unit (the include-only TU: 5.52 -> 5.34 s).
inline void fill_in_parts(std::int64_t n, void (*fill)(const void*, std::int64_t, std::int64_t), const void* ctx) {
  constexpr std::int64_t grain = std::int64_t{1} << 18;
  const std::int64_t parts = std::min<std::int64_t>(std::max(1u, std::thread::hardware_concurrency()), n / grain);
  if (parts <= 1) return fill(ctx, std::int64_t{0}, n);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(parts - 1));
  std::int64_t k = 1;
  try {  // where the system gives fewer threads, this one fills the parts left
    for (; k < parts; ++k) threads.emplace_back(fill, ctx, n * k / parts, n * (k + 1) / parts);
  } catch (...) {
  }
  fill(ctx, std::int64_t{0}, n / parts);
  for (; k < parts; ++k) fill(ctx, n * k / parts, n * (k + 1) / parts);
  for (std::thread& t : threads) t.join();
}
// Fills a host tensor of the shape with f(i) for each linear index (f: thread-safe, no throw), then
// moves it to `dev`.
template <class F>
Tensor generate(const Dims& shape, kiln::dtype d, Device dev, F&& f) {
  for (auto s : shape)
    if (s < 0) throw shape_error("factory: negative size in shape " + shape.str());
  Tensor host = Tensor::empty(shape, d, cpu);
  visit_dtype(d, [&](auto t) {
    using T = decltype(t);
    T* out = static_cast<T*>(host.data_ptr());
    struct Fill {
      T* out;
      std::remove_reference_t<F>* f;
    } fill{out, &f};
    fill_in_parts(
        host.numel(),
        [](const void* ctx, std::int64_t begin, std::int64_t end) {
          const Fill& c = *static_cast<const Fill*>(ctx);
          for (std::int64_t i = begin; i < end; ++i) {
            if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
              c.out[i] = T(static_cast<float>((*c.f)(i)));  // as store_from_double rounds
            else
              c.out[i] = static_cast<T>((*c.f)(i));
          }
        },
        &fill);
  });
  return dev.is_cpu() ? host : host.to(dev);
}
// splitmix64 of (seed, index): independent, reproducible streams per element.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
inline double uniform(std::uint64_t seed, std::uint64_t i, std::uint64_t stream) {
  std::uint64_t r = mix(mix(seed * 0x2545f4914f6cdd1dull + stream) ^ i);
  return (static_cast<double>(r >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // (0, 1)
}
}  // namespace detail

inline Tensor full(const Dims& shape, double value, kiln::dtype d = f32, Device dev = cpu) {
  return detail::generate(shape, d, dev, [&](std::int64_t) { return value; });
}
inline Tensor zeros(const Dims& shape, kiln::dtype d = f32, Device dev = cpu) { return full(shape, 0.0, d, dev); }
inline Tensor ones(const Dims& shape, kiln::dtype d = f32, Device dev = cpu) { return full(shape, 1.0, d, dev); }
inline Tensor arange(std::int64_t n, kiln::dtype d = i64, Device dev = cpu) {
  return detail::generate({n}, d, dev, [](std::int64_t i) { return static_cast<double>(i); });
}
// Uniform in [0, 1).
inline Tensor rand(const Dims& shape, kiln::dtype d = f32, Device dev = cpu, std::uint64_t seed = 0) {
  return detail::generate(shape, d, dev,
                          [&](std::int64_t i) { return detail::uniform(seed, static_cast<std::uint64_t>(i), 0); });
}
// Standard normal (Box-Muller).
inline Tensor randn(const Dims& shape, kiln::dtype d = f32, Device dev = cpu, std::uint64_t seed = 0) {
  return detail::generate(shape, d, dev, [&](std::int64_t i) {
    double u1 = detail::uniform(seed, static_cast<std::uint64_t>(i), 1),
           u2 = detail::uniform(seed, static_cast<std::uint64_t>(i), 2);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  });
}

template <element T>
Tensor from_vector(const std::vector<T>& v, const Dims& shape, Device dev = cpu) {
  if (static_cast<std::int64_t>(v.size()) != shape.product())
    throw shape_error("from_vector: " + std::to_string(v.size()) + " values do not fill shape " + shape.str());
  Tensor host = Tensor::empty(shape, dtype_of<T>, cpu);
  if (!v.empty()) std::copy(v.begin(), v.end(), static_cast<T*>(host.data_ptr()));
  return dev.is_cpu() ? host : host.to(dev);
}
// from_vector with a float/double vector into another dtype is common in tests: {1, 2, 3} as f32.
inline Tensor from_vector(const std::vector<double>& v, const Dims& shape, kiln::dtype d, Device dev = cpu) {
  if (static_cast<std::int64_t>(v.size()) != shape.product())
    throw shape_error("from_vector: " + std::to_string(v.size()) + " values do not fill shape " + shape.str());
  return detail::generate(shape, d, dev, [&](std::int64_t i) { return v[static_cast<std::size_t>(i)]; });
}

// Copies a tensor's elements (row-major) to a host vector, converting to T; waits for the device.
template <element T>
std::vector<T> to_vector(const Tensor& t) {
  Tensor host = t.device().is_cpu() ? t : t.to(cpu);
  std::vector<T> out(static_cast<std::size_t>(host.numel()));
  if (out.empty()) return out;
  if (host.dtype() == dtype_of<T> && host.is_contiguous()) {
    std::copy_n(static_cast<const T*>(host.data_ptr()), out.size(), out.begin());  // (std::vector<bool> has no data())
    return out;
  }
  const void* base = host.storage()->data;
  for_each_index(host.shape(), [&](std::int64_t lin, const Dims& idx) {
    double v = load_as_double(base, host.dtype(), host.offset() + dot_strides(idx, host.strides()));
    if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
      out[lin] = T(static_cast<float>(v));
    else
      out[lin] = static_cast<T>(v);
  });
  return out;
}

}  // namespace kiln
