// Dims: a small inline list of sizes or strides (at most 8), comparing equal to and converting to
// std::vector<std::int64_t>, so shapes never touch the heap.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "error.hpp"

// g++ 13 under nvcc's host pass (not alone) reports reading a braced temporary's sizes in product()
// as maybe-uninitialized, though every element is initialised: a known false positive of that
// warning, silenced for this header only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kiln {

inline constexpr int max_rank = 8;

class Dims {
 public:
  constexpr Dims() = default;
  constexpr Dims(std::initializer_list<std::int64_t> v) { assign(v.begin(), v.end()); }
  Dims(const std::vector<std::int64_t>& v) { assign(v.begin(), v.end()); }
  template <class It>
  constexpr Dims(It first, It last) {
    assign(first, last);
  }

  constexpr int size() const { return n_; }
  constexpr bool empty() const { return n_ == 0; }
  constexpr std::int64_t& operator[](int i) { return v_[i]; }
  constexpr std::int64_t operator[](int i) const { return v_[i]; }
  constexpr std::int64_t* begin() { return v_.data(); }
  constexpr std::int64_t* end() { return v_.data() + n_; }
  constexpr const std::int64_t* begin() const { return v_.data(); }
  constexpr const std::int64_t* end() const { return v_.data() + n_; }
  constexpr std::int64_t back() const { return v_[n_ - 1]; }
  constexpr void push_back(std::int64_t x) {
    if (n_ == max_rank) throw shape_error("kiln supports tensors of at most 8 dimensions");
    v_[n_++] = x;
  }
  constexpr void insert(int pos, std::int64_t x) {
    push_back(0);
    for (int i = n_ - 1; i > pos; --i) v_[i] = v_[i - 1];
    v_[pos] = x;
  }
  constexpr void erase(int pos) {
    for (int i = pos; i + 1 < n_; ++i) v_[i] = v_[i + 1];
    --n_;
  }
  constexpr void resize(int n, std::int64_t fill = 0) {
    for (int i = n_; i < n; ++i) v_[i] = fill;
    n_ = n;
  }
  constexpr std::int64_t product() const {
    std::int64_t p = 1;
    for (int i = 0; i < n_; ++i) p *= v_[i];
    return p;
  }
  operator std::vector<std::int64_t>() const { return {begin(), end()}; }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  friend constexpr bool operator==(const Dims& a, const Dims& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend bool operator==(const Dims& a, const std::vector<std::int64_t>& b) {
    return a.n_ == static_cast<int>(b.size()) && std::equal(a.begin(), a.end(), b.begin());
  }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) s += (i ? ", " : "") + std::to_string(v_[i]);
    return s + "]";
  }
  friend std::ostream& operator<<(std::ostream& os, const Dims& d) { return os << d.str(); }

 private:
  template <class It>
  constexpr void assign(It first, It last) {
    for (; first != last; ++first) push_back(static_cast<std::int64_t>(*first));
  }
  std::array<std::int64_t, max_rank> v_{};
  int n_ = 0;
};

// Contiguous (row-major) strides of a shape, in elements.
constexpr Dims contiguous_strides(const Dims& shape) {
  Dims s;
  s.resize(shape.size());
  std::int64_t acc = 1;
  for (int i = shape.size() - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= std::max<std::int64_t>(shape[i], 1);
  }
  return s;
}

// A dimension index that may count from the end, checked against the rank.
inline int normalize_dim(std::int64_t dim, int rank, const char* op) {
  int r = std::max(rank, 1);
  if (dim < -r || dim >= r)
    throw shape_error(std::string(op) + ": dimension " + std::to_string(dim) +
                      " is out of range for a tensor of rank " + std::to_string(rank));
  return static_cast<int>(dim < 0 ? dim + r : dim);
}

// NumPy broadcasting of two shapes; nullopt where they cannot be broadcast together.
constexpr std::optional<Dims> try_broadcast_shapes(const Dims& a, const Dims& b) {
  int n = std::max(a.size(), b.size());
  Dims out;
  out.resize(n);
  for (int i = 0; i < n; ++i) {
    std::int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    std::int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1) return std::nullopt;
    out[i] = x == 1 ? y : x;
  }
  return out;
}
inline Dims broadcast_shapes(const Dims& a, const Dims& b, const char* op) {
  if (auto out = try_broadcast_shapes(a, b)) return *out;
  throw shape_error(std::string(op) + ": shapes " + a.str() + " and " + b.str() + " cannot be broadcast together");
}

}  // namespace kiln

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
