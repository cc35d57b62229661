// A fast, stable, non-cryptographic 128-bit hash for cache keys (kernel sources, compiler flags,
// guard sets); usable in constant expressions, and never allocates.
//
// The algorithm (kiln's own, version 1; its output is part of the on-disk cache format, so any change
// must bump the cache format version): two 64-bit lanes each consume every 8-byte little-endian word
// with a multiply / rotate / multiply round (different constants per lane, so the lanes are
// independent), and the digest is each lane passed through a xorshift-multiply finaliser after
// folding in the other lane. Each `update` is one length-delimited field: the bytes are consumed as
// words, the last partial word is zero-padded and the byte count is mixed in afterwards, so
// update("ab"), update("c") differs from update("a"), update("bc"). Integers are one field of one word.
#pragma once
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>

namespace kiln::runtime {

// A 128-bit digest; `lo` alone is a good 64-bit hash.
struct Digest {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  friend constexpr bool operator==(const Digest&, const Digest&) = default;
};

namespace detail {

inline constexpr std::uint64_t k_mul_a = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio
inline constexpr std::uint64_t k_mul_b = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t k_mul_c = 0xD6E8FEB86659FD93ull;
inline constexpr std::uint64_t k_mul_d = 0xFF51AFD7ED558CCDull;

constexpr std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// Bijective avalanche: every input bit flips about half of the output bits.
constexpr std::uint64_t finalise(std::uint64_t x) {
  x ^= x >> 32;
  x *= k_mul_c;
  x ^= x >> 29;
  x *= k_mul_d;
  x ^= x >> 32;
  return x;
}

// Assembled byte by byte so it works in constant expressions and is endian-independent; compilers
// turn it into a single load on little-endian targets.
constexpr std::uint64_t load_word(const char* p, std::size_t n) {
  std::uint64_t w = 0;
  for (std::size_t i = 0; i < n; ++i) w |= std::uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  return w;
}

}  // namespace detail

// Incremental hasher: feed fields with update(), read the result with digest() (which does not
// change the state, so a common prefix can be hashed once and copied).
class Hasher {
 public:
  constexpr Hasher() = default;
  constexpr explicit Hasher(std::uint64_t seed) : a_(k_start_a ^ seed), b_(k_start_b + detail::rotl(seed, 17)) {}

  constexpr Hasher& update(std::string_view bytes) {
    std::size_t i = 0;
    for (; i + 8 <= bytes.size(); i += 8) mix(detail::load_word(bytes.data() + i, 8));
    if (i < bytes.size()) mix(detail::load_word(bytes.data() + i, bytes.size() - i));
    mix(std::uint64_t(bytes.size()) ^ k_length_tag);
    return *this;
  }
  constexpr Hasher& update(const char* text) { return update(std::string_view(text)); }
  constexpr Hasher& update(const std::string& text) { return update(std::string_view(text)); }

  // Signed values are sign-extended, so int{-1} and std::int64_t{-1} hash alike.
  template <std::integral T>
  constexpr Hasher& update(T value) {
    mix(static_cast<std::uint64_t>(
        static_cast<std::conditional_t<std::is_signed_v<T>, std::int64_t, std::uint64_t>>(value)));
    return *this;
  }
  constexpr Hasher& update(const Digest& d) { return update(d.lo).update(d.hi); }

  constexpr Digest digest() const {
    std::uint64_t lo = detail::finalise(a_ ^ detail::rotl(b_, 23) ^ words_);
    std::uint64_t hi = detail::finalise(b_ + detail::rotl(a_, 41) * detail::k_mul_a);
    return {lo, hi};
  }

 private:
  static constexpr std::uint64_t k_start_a = 0x243F6A8885A308D3ull;  // digits of pi: arbitrary
  static constexpr std::uint64_t k_start_b = 0x13198A2E03707344ull;
  // Distinguishes a length word from a data word with the same value.
  static constexpr std::uint64_t k_length_tag = 0xA5A5'5A5A'C3C3'3C3Cull;

  constexpr void mix(std::uint64_t w) {
    a_ = detail::rotl(a_ + w * detail::k_mul_b, 31) * detail::k_mul_a;
    b_ = detail::rotl(b_ ^ (w * detail::k_mul_d), 27) * detail::k_mul_c + 0x52DCE729u;
    ++words_;
  }

  std::uint64_t a_ = k_start_a;
  std::uint64_t b_ = k_start_b;
  std::uint64_t words_ = 0;
};

constexpr Digest hash128(std::string_view bytes) { return Hasher().update(bytes).digest(); }
constexpr std::uint64_t hash64(std::string_view bytes) { return hash128(bytes).lo; }

// Lower-case hex, most significant digit first: 16 characters for a u64, 32 for a Digest (hi then lo).
inline std::string hex(std::uint64_t value) {
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[std::size_t(i)] = "0123456789abcdef"[value & 15];
  return out;
}
inline std::string hex(const Digest& d) { return hex(d.hi) + hex(d.lo); }

// For unordered containers keyed by Digest: the digest is already well mixed.
struct DigestHash {
  std::size_t operator()(const Digest& d) const noexcept { return static_cast<std::size_t>(d.lo); }
};

}  // namespace kiln::runtime

template <>
struct std::hash<kiln::runtime::Digest> : kiln::runtime::DigestHash {};
