// Host-only tile operations written as whole vectors (GCC's vector extensions), for the few places
// where the lane-by-lane loops of prelude.hpp do not vectorise: the NaN-propagating maximum and
// minimum of row reductions (softmax's max, amax). Their accumulator is read three times a step
// (two NaN tests and the comparison), which GCC's loop vectoriser does not take for a reduction
// (without -ffinite-math-only it cannot use a plain max), so the row's max stayed scalar. As vector
// operations the same selects are one compare-and-blend per 8 or 16 lanes. The last piece of the
// prelude; nothing here for the device, and other compilers keep the generic loops.
#pragma once
#include <string_view>

namespace kiln::codegen {

inline constexpr std::string_view prelude_cpu_tiles = R"KILN(
#if !defined(KILN_DEVICE_CODE) && defined(__GNUC__) && !defined(__clang__)
namespace kiln {
// A tile of N lanes of f32 or f64 as one GCC vector (N must be a power of two).
template <class T> struct vector_lane { static constexpr bool value = false; };
template <> struct vector_lane<float> { static constexpr bool value = true; };
template <> struct vector_lane<double> { static constexpr bool value = true; };
// (Separate from as_vector: instantiating a vector of bool or i64 lanes to ask would be an error,
// not a substitution failure.)
template <class T, int N> struct vector_fits {
  static constexpr bool value = vector_lane<T>::value && N > 1 && (N & (N - 1)) == 0;
};
template <class T, int N> struct as_vector {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};
template <class T, int N> KILN_FN typename as_vector<T, N>::type vector_of(const tile<T, N>& t) {
  typename as_vector<T, N>::type v;
  std::memcpy(&v, t.v, sizeof v);
  return v;
}
template <class T, int N, class V> KILN_FN tile<T, N> tile_of(const V& v) {
  tile<T, N> t;
  std::memcpy(t.v, &v, sizeof v);
  return t;
}
// As the generic maximum and minimum: NaN if either lane is NaN (torch.maximum / torch.minimum).
template <class T, int N, class = typename enable_if<vector_fits<T, N>::value>::type>
KILN_FN tile<T, N> maximum(const tile<T, N>& a, const tile<T, N>& b) {
  const auto x = vector_of(a), y = vector_of(b);
  const auto m = x > y ? x : y;
  return tile_of<T, N>(x != x ? x : (y != y ? y : m));
}
template <class T, int N, class = typename enable_if<vector_fits<T, N>::value>::type>
KILN_FN tile<T, N> minimum(const tile<T, N>& a, const tile<T, N>& b) {
  const auto x = vector_of(a), y = vector_of(b);
  const auto m = x < y ? x : y;
  return tile_of<T, N>(x != x ? x : (y != y ? y : m));
}
}  // namespace kiln
#endif
)KILN";

}  // namespace kiln::codegen
