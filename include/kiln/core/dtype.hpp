// Element types: the dtype enum, sizes and names, PyTorch's promotion rules, and the f16/bf16
// storage types with round-to-nearest-even conversions.
#pragma once
#include <cstdint>
#include <cstring>
#include <string_view>

#include "error.hpp"

namespace kiln {

enum class dtype : std::uint8_t { f64, f32, f16, bf16, i64, i32, boolean };

inline constexpr dtype f64 = dtype::f64;
inline constexpr dtype f32 = dtype::f32;
inline constexpr dtype f16 = dtype::f16;
inline constexpr dtype bf16 = dtype::bf16;
inline constexpr dtype i64 = dtype::i64;
inline constexpr dtype i32 = dtype::i32;
inline constexpr dtype boolean = dtype::boolean;

constexpr std::string_view name(dtype d) {
  constexpr std::string_view names[] = {"f64", "f32", "f16", "bf16", "i64", "i32", "boolean"};
  return names[static_cast<int>(d)];
}
constexpr std::size_t itemsize(dtype d) {
  constexpr std::size_t sizes[] = {8, 4, 2, 2, 8, 4, 1};
  return sizes[static_cast<int>(d)];
}
constexpr bool is_floating(dtype d) { return d <= dtype::bf16; }
constexpr bool is_integral(dtype d) { return d == dtype::i64 || d == dtype::i32; }

// PyTorch's categories: boolean < integer < floating.
constexpr int category(dtype d) { return is_floating(d) ? 2 : is_integral(d) ? 1 : 0; }

// Tensor-with-tensor promotion (torch.promote_types).
constexpr dtype promote(dtype a, dtype b) {
  if (a == b) return a;
  if (category(a) != category(b)) return category(a) > category(b) ? a : b;
  if (category(a) == 1) return dtype::i64;
  if (a == dtype::f64 || b == dtype::f64) return dtype::f64;
  if (a == dtype::f32 || b == dtype::f32) return dtype::f32;
  return dtype::f32;  // f16 with bf16
}

// Tensor-with-C++-scalar promotion: the scalar only lifts the category, as in PyTorch.
constexpr dtype promote_with_scalar(dtype t, bool scalar_is_floating) {
  if (scalar_is_floating && !is_floating(t)) return dtype::f32;
  if (!scalar_is_floating && t == dtype::boolean) return dtype::i64;
  return t;
}

// The C++ type used to compute a dtype in registers: f16/bf16 compute in f32.
constexpr dtype compute_dtype(dtype d) { return d == dtype::f16 || d == dtype::bf16 ? dtype::f32 : d; }

// ---- 16-bit floating-point storage types -------------------------------------------------------

namespace detail {
inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace detail

struct half {
  std::uint16_t bits = 0;
  half() = default;
  half(float f) : bits(from_float(f)) {}
  operator float() const { return to_float(bits); }

  static std::uint16_t from_float(float f) {
    std::uint32_t x = detail::bits_of(f);
    std::uint32_t sign = (x >> 16) & 0x8000u;
    std::uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
    if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
    if (absx < 0x38800000u) {                               // subnormal half (or zero): scale by 2^24 and round
      float scaled = detail::float_of(absx) * 16777216.0f;  // exact in float
      std::uint32_t m = static_cast<std::uint32_t>(scaled);
      float rem = scaled - static_cast<float>(m);
      if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
      return static_cast<std::uint16_t>(sign | m);
    }
    std::uint32_t mant = absx & 0x7fffffu;
    std::uint32_t exp = (absx >> 23) - 112u;
    std::uint32_t h = (exp << 10) | (mant >> 13);
    std::uint32_t rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  static float to_float(std::uint16_t h) {
    std::uint32_t sign = (h & 0x8000u) << 16;
    std::uint32_t exp = (h >> 10) & 0x1fu;
    std::uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) return detail::float_of(sign | 0x7f800000u | (mant << 13));
    if (exp == 0) {
      float v = static_cast<float>(mant) / 16777216.0f;
      return sign ? -v : v;
    }
    return detail::float_of(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  bfloat16(float f) : bits(from_float(f)) {}
  operator float() const { return detail::float_of(static_cast<std::uint32_t>(bits) << 16); }

  static std::uint16_t from_float(float f) {
    std::uint32_t x = detail::bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // quiet NaN
    std::uint32_t lsb = (x >> 16) & 1u;
    return static_cast<std::uint16_t>((x + 0x7fffu + lsb) >> 16);
  }
};

// The storage type of each dtype, and the dtype of each C++ element type.
template <dtype D>
struct storage_type;
template <>
struct storage_type<dtype::f64> {
  using type = double;
};
template <>
struct storage_type<dtype::f32> {
  using type = float;
};
template <>
struct storage_type<dtype::f16> {
  using type = half;
};
template <>
struct storage_type<dtype::bf16> {
  using type = bfloat16;
};
template <>
struct storage_type<dtype::i64> {
  using type = std::int64_t;
};
template <>
struct storage_type<dtype::i32> {
  using type = std::int32_t;
};
template <>
struct storage_type<dtype::boolean> {
  using type = bool;
};

template <class T>
constexpr dtype dtype_of = dtype::f32;
template <>
inline constexpr dtype dtype_of<double> = dtype::f64;
template <>
inline constexpr dtype dtype_of<half> = dtype::f16;
template <>
inline constexpr dtype dtype_of<bfloat16> = dtype::bf16;
template <>
inline constexpr dtype dtype_of<std::int64_t> = dtype::i64;
template <>
inline constexpr dtype dtype_of<std::int32_t> = dtype::i32;
template <>
inline constexpr dtype dtype_of<bool> = dtype::boolean;

template <class T>
concept element =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16> ||
    std::is_same_v<T, std::int64_t> || std::is_same_v<T, std::int32_t> || std::is_same_v<T, bool>;

// Calls f(T{}) with the storage type of d: the one switch over dtypes that run-time code needs.
template <class F>
decltype(auto) visit_dtype(dtype d, F&& f) {
  switch (d) {
    case dtype::f64:
      return f(double{});
    case dtype::f32:
      return f(float{});
    case dtype::f16:
      return f(half{});
    case dtype::bf16:
      return f(bfloat16{});
    case dtype::i64:
      return f(std::int64_t{});
    case dtype::i32:
      return f(std::int32_t{});
    case dtype::boolean:
      return f(bool{});
  }
  throw dtype_error("visit_dtype: unknown dtype");
}

// Reads element i of a buffer of dtype d as a double, and writes one (rounding once).
inline double load_as_double(const void* p, dtype d, std::int64_t i) {
  return visit_dtype(d, [&](auto t) { return static_cast<double>(static_cast<const decltype(t)*>(p)[i]); });
}
inline void store_from_double(void* p, dtype d, std::int64_t i, double v) {
  visit_dtype(d, [&](auto t) {
    using T = decltype(t);
    if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
      static_cast<T*>(p)[i] = T(static_cast<float>(v));
    else
      static_cast<T*>(p)[i] = static_cast<T>(v);
  });
}

}  // namespace kiln
