// The options of k::compile (API.md "Evaluating"): shape mode, CUDA graphs, autotuning, and what
// happens past the recompile limit.
#pragma once
#include <optional>

namespace kiln {

enum class shapes { automatic, static_, dynamic };

// What a compiled function does when a call needs a program past its recompile limit.
enum class on_limit {
  generalize,  // warn once, make every size symbolic, evict the least recently used program
  raise,       // throw k::recompile_limit_error (tests that pin the number of compiles)
};

struct options {
  ::kiln::shapes shapes = ::kiln::shapes::automatic;
  bool cuda_graphs = false;
  bool autotune = false;
  int recompile_limit = 8;
  ::kiln::on_limit on_limit = ::kiln::on_limit::generalize;
  // Check gathered ids (k::embedding) before the kernels that read them: an id outside the table is a
  // k::shape_error naming it and its position, and nothing is written. Unset: on for CPU programs,
  // off for CUDA ones (a check reads the ids back: one synchronisation), where a bad id reads zeros.
  std::optional<bool> check_indices = std::nullopt;
};

}  // namespace kiln
