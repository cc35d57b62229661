// The oracle's indexing and randomness: embedding, its scatter-add gradient and rand, from their
// definitions (a row read per id, a sum per id in position order, Philox per element). Split from
// eval_node.hpp, which dispatches to them.
#pragma once
#include <cstdint>
#include <string>

#include "../core/philox.hpp"
#include "../graph/graph.hpp"
#include "value.hpp"

namespace kiln::reference::detail {

// An index must lie in [0, size): else the oracle throws, naming the op, the index and, where
// given, its position.
inline void check_index(double v, std::int64_t size, const char* op, std::int64_t position = -1) {
  if (!(v >= 0 && v < static_cast<double>(size)))
    throw shape_error(std::string(op) + ": index " + std::to_string(static_cast<std::int64_t>(v)) +
                      (position >= 0 ? " at position " + std::to_string(position) : std::string()) +
                      " is out of range for a dimension of size " + std::to_string(size));
}

// embedding(table [V, D], ids): out[p, :] = table[ids[p], :].
inline void eval_embedding(const Value& table, const Value& ids, Value& out) {
  const std::int64_t V = table.shape[0], D = table.shape[1], P = ids.numel();
  for (std::int64_t p = 0; p < P; ++p) {
    check_index(ids.data[p], V, "embedding", p);
    const auto row = static_cast<std::int64_t>(ids.data[p]);
    for (std::int64_t d = 0; d < D; ++d) out.data[p * D + d] = table.data[row * D + d];
  }
}

// embedding_backward(g [ids..., D], ids) -> [V, D]: row v is the sum of g's rows at the positions
// holding v.
inline void eval_embedding_backward(const Value& g, const Value& ids, Value& out) {
  const std::int64_t V = out.shape[0], D = out.shape[1], P = ids.numel();
  for (auto& v : out.data) v = 0;
  for (std::int64_t p = 0; p < P; ++p) {
    check_index(ids.data[p], V, "embedding_backward", p);
    const auto row = static_cast<std::int64_t>(ids.data[p]);
    for (std::int64_t d = 0; d < D; ++d) out.data[row * D + d] += g.data[p * D + d];
  }
}

// rand(x, seed lo, seed hi, offset lo, offset hi): Philox per row-major position.
inline void eval_rand(const Value* const words[4], Value& out) {
  auto word = [&](int k) { return static_cast<std::uint64_t>(words[k]->data[0]) & 0xffffffffu; };
  const std::uint64_t seed = word(0) | word(1) << 32, offset = word(2) | word(3) << 32;
  for (std::size_t i = 0; i < out.data.size(); ++i) out.data[i] = philox::uniform(seed, offset, i);
}

}  // namespace kiln::reference::detail
