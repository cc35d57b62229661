// The oracle of a mean cross_entropy over [n, c] logits and n class indices, written out and
// interpreted in f64 (k::reference::eval): the loss, the mean of logsumexp - the target's logit,
// and its gradient, (softmax - one-hot) / n.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include <kiln/kiln.hpp>

inline std::pair<kiln::Tensor, kiln::Tensor> cross_entropy_oracle(const kiln::Tensor& logits, const kiln::Tensor& t) {
  namespace k = kiln;
  const std::int64_t n = logits.shape()[0], c = logits.shape()[1];
  std::vector<double> hot(static_cast<std::size_t>(n * c), 0.0), picked;
  const auto tv = k::to_vector<std::int64_t>(t);
  const auto lv = k::to_vector<double>(k::Tensor(k::cast(logits, k::f64)));
  for (std::int64_t r = 0; r < n; ++r)
    hot[static_cast<std::size_t>(r * c + tv[r])] = 1, picked.push_back(lv[static_cast<std::size_t>(r * c + tv[r])]);
  k::Tensor l64 = k::cast(logits, k::f64);
  return {k::reference::eval(k::mean(k::logsumexp(l64, 1) - k::from_vector(picked, {n}))),
          k::reference::eval((k::softmax(l64, 1) - k::from_vector(hot, {n, c})) / static_cast<double>(n))};
}
