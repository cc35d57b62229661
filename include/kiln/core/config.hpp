// The environment: every variable kiln reads is read here (README "Environment variables" lists
// them), at the point of use, so that a process (a test) may change one between calls. Nothing
// else in kiln calls getenv.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <optional>

namespace kiln::config {

// The variable's value, or nullptr when it is unset or empty.
inline const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

// An integer variable clamped to [lo, hi]; nullopt when unset or empty.
inline std::optional<std::int64_t> env_int(const char* name, std::int64_t lo, std::int64_t hi) {
  const char* v = env(name);
  if (!v) return std::nullopt;
  return std::clamp<std::int64_t>(std::atoll(v), lo, hi);
}

}  // namespace kiln::config
