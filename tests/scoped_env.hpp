// Sets an environment variable for one scope and restores the old value after (tests that run a
// case under a KILN_TUNE_* or other variable read when a program is lowered).
#pragma once
#include <cstdlib>
#include <optional>
#include <string>

struct ScopedEnv {
  std::string name;
  std::optional<std::string> old;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* v = std::getenv(n)) old = v;
    if (value)
      ::setenv(n, value, 1);
    else
      ::unsetenv(n);
  }
  ~ScopedEnv() {
    if (old)
      ::setenv(name.c_str(), old->c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
};
