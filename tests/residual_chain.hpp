// The residual chain the sharing and expression tests build: h -> layer_norm(h + gelu(h @ w), g, b),
// N times, each block reading its input twice (typed recursion: the type grows with N).
#pragma once
#include <kiln/kiln.hpp>
#include <kiln/pipeline.hpp>

template <int N>
auto residual_chain(auto h, auto w, auto g, auto b) {
  if constexpr (N == 0) {
    return h;
  } else {
    auto r = residual_chain<N - 1>(h, w, g, b);
    return kiln::layer_norm(r + kiln::gelu(kiln::matmul(r, w)), g, b);
  }
}
