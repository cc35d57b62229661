// The options of k::compile (API.md "Evaluating"): shape mode, CUDA graphs, autotuning, and what
// happens past the recompile limit.
#pragma once

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
};

}  // namespace kiln
