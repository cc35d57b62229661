// Philox 4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC'11), the counter-based generator behind k::rand_like and k::dropout: the host's copy, used by
// the oracle (reference/eval_index.hpp). The generated kernels carry the same function in their
// prelude (codegen/prelude.hpp, m_philox_uniform); tests hold both to Random123's known answers and
// to each other.
//
// Element i of a draw with key `seed` and `offset` is the first word of Philox(counter = offset + i
// as two 32-bit words, 0, 0; key = the seed's two words), its top 24 bits scaled into [0, 1): a
// function of (seed, offset, i) alone, so a CPU and a GPU kernel give the same bits, and draws of one
// seed never overlap when each call's offset advances by the previous call's numel.
#pragma once
#include <array>
#include <cstdint>

namespace kiln::philox {

constexpr std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> c, std::uint32_t k0,
                                                     std::uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    if (round) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * c[0], p1 = std::uint64_t{0xCD9E8D57u} * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
  }
  return c;
}

// The uniform number in [0, 1) at position i of the draw (seed, offset); a multiple of 2^-24, so it
// is exact in f32.
constexpr float uniform(std::uint64_t seed, std::uint64_t offset, std::uint64_t i) {
  const std::uint64_t c = offset + i;
  auto w = philox4x32_10({static_cast<std::uint32_t>(c), static_cast<std::uint32_t>(c >> 32), 0u, 0u},
                         static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  return static_cast<float>(w[0] >> 8) * (1.0f / 16777216.0f);
}

}  // namespace kiln::philox
